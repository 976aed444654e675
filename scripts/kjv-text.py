#!/usr/bin/env python3
"""Make examples/data/kjv-genesis-exodus.txt, the second long-context text
(held out from every calibration), from Debian's bible-kjv-text package:
the King James Version of 1611, whose copyright has long expired (the
package's copyright file says so), read through the package's reader:

    apt-get install bible-kjv    # and its data, bible-kjv-text
    bible -f "Ge1:1-50:26" "Ex1:1-40:38" > /tmp/kjv.txt
    .venv/bin/python scripts/kjv-text.py [--force] /tmp/kjv.txt examples/data/kjv-genesis-exodus.txt

The reader prints one verse a line behind its reference ("Ge1:1 In the
beginning ..."); a language model should see running prose, so each
chapter's verses are joined into one line under a heading, the
references dropped."""
import os
import re
import sys

BOOKS = {"Ge": "The First Book of Moses, called Genesis",
         "Exo": "The Second Book of Moses, called Exodus"}
VERSE = re.compile(r"^([A-Za-z]+)(\d+):(\d+) (.*)$")


def main(src, dst):
    chapters = {}  # (book, chapter) -> verses, in order
    with open(src, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            m = VERSE.match(line.strip())
            if not m or m.group(1) not in BOOKS:
                sys.exit(f"kjv-text: {src}, line {n}: not a verse of Genesis or Exodus: {line!r}")
            chapters.setdefault((m.group(1), int(m.group(2))), []).append(m.group(4).strip())
    out = ["The King James Version of the Bible, 1611 (in the public domain): "
           "Genesis and Exodus", ""]
    book = None
    for (b, c), verses in chapters.items():
        if b != book:
            out += [BOOKS[b], ""]
            book = b
        out += [f"Chapter {c}.", "", " ".join(verses), ""]

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(out))
    write_atomic(dst, write)  # a whole file or none


if __name__ == "__main__":
    args = [x for x in sys.argv[1:] if x != "--force"]
    if len(args) != 2:
        sys.exit(__doc__)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from kqsvd.errors import KqsvdError
    from kqsvd.formats.files import check_outputs, write_atomic
    try:  # no folder, no input of the run, no replacement without --force
        check_outputs([("the output", args[1])], [("the input", args[0])],
                      "--force" in sys.argv)
        main(*args)
    except KqsvdError as e:
        sys.exit(f"kjv-text: {e}")
