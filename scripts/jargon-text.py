#!/usr/bin/env python3
"""Make examples/data/jargon-file-4.4.7.txt, the long-context text, from
Debian's jargon-text package (the Jargon File 4.4.7, in the public domain):

    apt-get download jargon-text && dpkg -x jargon-text_*.deb /tmp/jargon
    .venv/bin/python scripts/jargon-text.py [--force] /tmp/jargon/usr/share/doc/jargon-text/jargon.txt.gz \
        examples/data/jargon-file-4.4.7.txt

The file's plain-text rendering wraps paragraphs and repeats every
headword in indexes; a language model should see running prose, so the
paragraphs are joined into lines, the indexes (one short line each, no
sentence) are dropped, and the text stops at the last whole paragraph
under 1,000,000 bytes (the bundling limit)."""
import gzip
import os
import re
import sys

LIMIT = 1_000_000
HEADWORD = re.compile(r"^\s*:(.+?):(?: |$)")


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


def main(src, dst):
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

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(out).rstrip("\n") + "\n")
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
        sys.exit(f"jargon-text: {e}")
