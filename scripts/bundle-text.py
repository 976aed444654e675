#!/usr/bin/env python3
"""Make the bundled long-context texts of examples/data from Debian
packages: `jargon` and `kjv`.

jargon: examples/data/jargon-file-4.4.7.txt, from
Debian's jargon-text package (the Jargon File 4.4.7, in the public domain):

    apt-get download jargon-text && dpkg -x jargon-text_*.deb /tmp/jargon
    .venv/bin/python scripts/bundle-text.py jargon [--force] /tmp/jargon/usr/share/doc/jargon-text/jargon.txt.gz \
        examples/data/jargon-file-4.4.7.txt

The file's plain-text rendering wraps paragraphs and repeats every
headword in indexes; a language model should see running prose, so the
paragraphs are joined into lines, the indexes (one short line each, no
sentence) are dropped, and the text stops at the last whole paragraph
under 1,000,000 bytes (the bundling limit).

kjv: examples/data/kjv-genesis-exodus.txt, the second long-context text
(held out from every calibration), from Debian's bible-kjv-text package:
the King James Version of 1611, whose copyright has long expired (the
package's copyright file says so), read through the package's reader:

    apt-get install bible-kjv    # and its data, bible-kjv-text
    bible -f "Ge1:1-50:26" "Ex1:1-40:38" > /tmp/kjv.txt
    .venv/bin/python scripts/bundle-text.py kjv [--force] /tmp/kjv.txt examples/data/kjv-genesis-exodus.txt

The reader prints one verse a line behind its reference ("Ge1:1 In the
beginning ..."); a language model should see running prose, so each
chapter's verses are joined into one line under a heading, the
references dropped."""
import gzip
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from kqsvd.errors import KqsvdError  # noqa: E402
from kqsvd.formats.files import check_outputs, write_atomic  # noqa: E402

LIMIT = 1_000_000
HEADWORD = re.compile(r"^\s*:(.+?):(?: |$)")
BOOKS = {"Ge": "The First Book of Moses, called Genesis",
         "Exo": "The Second Book of Moses, called Exodus"}
VERSE = re.compile(r"^([A-Za-z]+)(\d+):(\d+) (.*)$")


def paragraphs(lines):
    block = []
    for line in lines:
        if line.strip():
            block.append(line.strip())
        elif block:
            yield block
            block = []
    if block:
        yield block


def keep(block, headwords):
    if len(block) > 1 or block[0].startswith((":", "Chapter ")):
        return True
    # index entries are bare headwords; a one-line paragraph of prose ends
    # like a sentence
    return block[0] not in headwords and (
        len(block[0]) > 60 or block[0].endswith((".", "!", "?", ":", "”")))


def jargon(src):
    """The Jargon File's text from its plain-text rendering."""
    with gzip.open(src, "rt", encoding="utf-8") as f:
        # the rendering puts no-break spaces in headings and around numbers
        lines = f.read().replace("\u00a0", " ").splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith("Chapter 1."))
    head = "The Jargon File, version 4.4.7, 29 Dec 2003 (in the public domain)\n\n"
    headwords = {m.group(1) for m in map(HEADWORD.match, lines) if m}
    out, size = [head], len(head.encode())
    for block in paragraphs(lines[start:]):
        if not keep(block, headwords):
            continue
        text = " ".join(block) + "\n\n"
        if size + len(text.encode()) > LIMIT:
            break
        out.append(text)
        size += len(text.encode())
    while out[-1].startswith(":"):  # no headword without its entry at the end
        out.pop()
    return "".join(out).rstrip("\n") + "\n"


def kjv(src):
    """Genesis and Exodus from the bible reader's output."""
    chapters = {}  # (book, chapter) -> verses, in order
    with open(src, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            m = VERSE.match(line.strip())
            if not m or m.group(1) not in BOOKS:
                raise KqsvdError(f"{src}, line {n}: not a verse of Genesis or Exodus: {line!r}")
            chapters.setdefault((m.group(1), int(m.group(2))), []).append(m.group(4).strip())
    out = ["The King James Version of the Bible, 1611 (in the public domain): "
           "Genesis and Exodus", ""]
    book = None
    for (b, c), verses in chapters.items():
        if b != book:
            out += [BOOKS[b], ""]
            book = b
        out += [f"Chapter {c}.", "", " ".join(verses), ""]
    return "\n".join(out)


def main(argv):
    args = [x for x in argv if x != "--force"]
    if len(args) != 3 or args[0] not in ("jargon", "kjv"):
        sys.exit(__doc__)
    make, src, dst = globals()[args[0]], args[1], args[2]
    try:  # no folder, no input of the run, no replacement without --force
        check_outputs([("the output", dst)], [("the input", src)], "--force" in argv)
        text = make(src)

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
        write_atomic(dst, write)  # a whole file or none
    except KqsvdError as e:
        sys.exit(f"bundle-text: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
