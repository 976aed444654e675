#!/usr/bin/env python3
"""Make the bundled long-context texts of examples/data from Debian
packages: `jargon` and `kjv`.

jargon: examples/data/jargon-file-4.4.7.txt, from
Debian's jargon-text package (the Jargon File 4.4.7, in the public domain):

    apt-get download jargon-text && dpkg -x jargon-text_*.deb /tmp/jargon
    .venv/bin/python scripts/bundle-text.py jargon [--force] /tmp/jargon/usr/share/doc/jargon-text/jargon.txt.gz \\
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
references dropped.

Exit status, as the package's commands: 2 for the command line and the
output, 1 for the input, 130 for Ctrl-C; each error is one line."""
import argparse
import gzip
import os
import re
import stat
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from kqsvd.commands.cli import ArgumentParser, run_command  # noqa: E402
from kqsvd.errors import KqsvdError, UsageError  # noqa: E402
from kqsvd.formats.files import check_input_file, check_outputs, write_atomic  # noqa: E402

PROG = "bundle-text"
LIMIT = 1_000_000
# Inputs are read whole, so their size is bounded (the file, and a gzip's
# text): far above what the packages give (jargon.txt.gz is 0.6 MB of 1.7 MB
# of text; the reader's whole Bible, 4.5 MB), far below what exhausts memory.
MOST = 32 << 20
CHUNK = 1 << 20
HEADWORD = re.compile(r"^\s*:(.+?):(?: |$)")
BOOKS = {"Ge": "The First Book of Moses, called Genesis",
         "Exo": "The Second Book of Moses, called Exodus"}
VERSE = re.compile(r"^([A-Za-z]+)(\d+):(\d+) (.*)$")


def bounded(read, src, what):
    """All that read(n) gives, taken in chunks so that an endless input or
    a gzip bomb is refused at MOST bytes, not once it has filled memory."""
    chunks, size = [], 0
    while True:
        chunk = read(CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MOST:
            raise KqsvdError(f"the input {src} {what} over {MOST >> 20} MiB: not a text "
                             "of this kind")
        chunks.append(chunk)


def opened(src):
    """src opened to read bytes, checked again once open (it may have been
    replaced since check_input_file): a regular file, not too big."""
    try:
        f = open(src, "rb")
    except OSError as e:
        raise KqsvdError(f"the input {src}: cannot be read: {e.strerror or e}") from None
    st = os.fstat(f.fileno())
    why = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
           f"is over {MOST >> 20} MiB: not a text of this kind" if st.st_size > MOST else None)
    if why:
        f.close()
        raise KqsvdError(f"the input {src} {why}")
    return f


def decoded(data, name):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        head = data[:e.start]  # lines counted as text mode counts them
        line = head.count(b"\n") + head.count(b"\r") - head.count(b"\r\n") + 1
        raise KqsvdError(f"{name}, line {line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None


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
    with opened(src) as raw:
        try:
            with gzip.GzipFile(fileobj=raw) as f:
                data = bounded(f.read, src, "decompresses to")
            if raw.tell() == 0:  # gzip reads an empty file as an empty text
                raise KqsvdError(f"the input {src} is empty")
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise KqsvdError(f"the input {src}: not a whole gzip file ({e})") from None
    # the rendering puts no-break spaces in headings and around numbers
    lines = decoded(data, f"the input {src} (decompressed)").replace("\u00a0", " ").splitlines()
    start = next((i for i, s in enumerate(lines) if s.startswith("Chapter 1.")), None)
    if start is None:
        raise KqsvdError(f"the input {src}: no line starts with 'Chapter 1.': not the Jargon "
                         "File's plain-text rendering")
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
    if all(p.startswith("Chapter ") for p in out[1:]):  # a title, headings: no text
        raise KqsvdError(f"the input {src}: no paragraph of text after 'Chapter 1.' (indexes "
                         f"dropped, each paragraph under {LIMIT:,} bytes)")
    return "".join(out).rstrip("\n") + "\n"


def kjv(src):
    """Genesis and Exodus from the bible reader's output."""
    with opened(src) as f:
        data = bounded(f.read, src, "is")
    if not data:  # read, not stat'ed: /proc's files say 0 bytes
        raise KqsvdError(f"the input {src} is empty")
    text = decoded(data, f"the input {src}")
    chapters = {}  # (book, chapter) -> verses, in order
    # lines as text mode gives them: universal newlines, split at "\n" only
    for n, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        if not line.strip():
            continue
        m = VERSE.match(line.strip())
        try:  # int() refuses a chapter of over 4,300 digits
            key = (m.group(1), int(m.group(2))) if m and m.group(1) in BOOKS else None
        except ValueError:
            key = None
        if key is None:
            shown = repr(line[:80]) + ("..." if len(line) > 80 else "")
            raise KqsvdError(f"the input {src}, line {n}: not a verse of Genesis or Exodus: "
                             f"{shown}")
        chapters.setdefault(key, []).append(m.group(4).strip())
    if not chapters:
        raise KqsvdError(f"the input {src}: no verse (blank lines only); expected the bible "
                         "reader's output, one verse a line")
    out = ["The King James Version of the Bible, 1611 (in the public domain): "
           "Genesis and Exodus", ""]
    book = None
    for (b, c), verses in chapters.items():
        if b != book:
            out += [BOOKS[b], ""]
            book = b
        out += [f"Chapter {c}.", "", " ".join(verses), ""]
    return "\n".join(out)


def parse(argv):
    ap = ArgumentParser(prog=PROG, description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("jargon", "kjv"), help="which text to make")
    ap.add_argument("input", help="jargon.txt.gz (jargon) or the reader's verses (kjv)")
    ap.add_argument("output", help="the text to write")
    ap.add_argument("--force", action="store_true", help="replace the output if it exists")
    return ap.parse_args(argv)


def run(args):
    if not args.input:
        raise UsageError("the input '': give a file name")
    # no folder, no input of the run, no replacement without --force
    check_outputs([("the output", args.output)], [("the input", args.input)], args.force)
    check_input_file("the input", args.input)  # never a device such as /dev/zero
    make = {"jargon": jargon, "kjv": kjv}[args.kind]  # looked up now: tests replace them
    text = make(args.input)

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    write_atomic(args.output, write, args.force)  # a whole file or none


def main(argv=None):
    """Makes one text; returns the exit status (cli.run_command's)."""
    try:
        return run_command(PROG, lambda: run(parse(argv)))
    except SystemExit as e:  # --help, printed by argparse
        return e.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
