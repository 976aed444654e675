#!/usr/bin/env python3
"""Make examples/data/kjv-genesis-exodus.txt, the second long-context text
(held out from every calibration), from Debian's bible-kjv-text package:
the King James Version of 1611, whose copyright has long expired (the
package's copyright file says so), read through the package's reader:

    apt-get install bible-kjv    # and its data, bible-kjv-text
    bible -f "Ge1:1-50:26" "Ex1:1-40:38" > /tmp/kjv.txt
    scripts/kjv-text.py /tmp/kjv.txt examples/data/kjv-genesis-exodus.txt

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
    if os.path.isdir(dst) or (os.path.exists(dst) and os.path.samefile(src, dst)):
        sys.exit(f"kjv-text: {dst}: a folder or the input itself")
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
    tmp = f"{dst}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(out))
    os.replace(tmp, dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
