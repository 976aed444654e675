"""scripts/bundle-text.py as a demanding user runs it (issue 47, items 3,
12, 18 and 20): every refusal exits 2 (the command line, the output) or 1
(the input) with one line 'bundle-text: error: ...' naming what is wrong,
no traceback, nothing left in the output folder, every input unchanged; a
device or an endless input is refused before it is read, under a memory
limit and a timeout so that a regression cannot take the machine down; and
valid inputs still give the texts they gave, byte for byte.

The script runs in a child process as users run it (or, for Ctrl-C, in
this one, imported from its path). KQSVD_BUNDLE_TEXT=PATH tries another
copy of the script (an older one, to see these tests fail on it)."""
import contextlib
import gzip
import hashlib
import importlib.util
import io
import os
import re
import resource
import stat
import subprocess
import sys
import unittest

from common import ROOT, workdir

SCRIPT = os.environ.get("KQSVD_BUNDLE_TEXT") or os.path.join(ROOT, "scripts", "bundle-text.py")
KJV = os.path.join(ROOT, "examples", "data", "kjv-genesis-exodus.txt")
# A child's address space: ample for the script and its imports, far from
# what an input read without a bound would take.
MEMORY = 1 << 30
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OPENBLAS_NUM_THREADS="1",
           OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

JARGON_TITLE = "The Jargon File, version 4.4.7, 29 Dec 2003 (in the public domain)"
# The plain-text rendering in small: a table of contents before Chapter 1,
# paragraphs wrapped and indented, no-break spaces, an index of bare
# headwords, a headword entry and one-line paragraphs.
JARGON = ("                                The Jargon File\n\n"
          "   Table of Contents\n\n"
          "   1. Hacker Slang and Hacker Culture\n\n"
          "Chapter\u00a01. Hacker Slang\n\n"
          "   This document is a collection\u00a0of slang\n"
          "   terms used by ‘hackers’.\n\n"
          "   Glossary\n\n"
          "   foo\n\n"
          "   bar\n\n"
          "   :foo: /foo/, n.\n\n"
          "   1. A sample word.\n\n"
          "   A one-line paragraph that is longer than sixty bytes and has no end\n\n"
          "   :bar: \n")
JARGON_OUT = (f"{JARGON_TITLE}\n\n"
              "Chapter 1. Hacker Slang\n\n"
              "This document is a collection of slang terms used by ‘hackers’.\n\n"
              ":foo: /foo/, n.\n\n"
              "1. A sample word.\n\n"
              "A one-line paragraph that is longer than sixty bytes and has no end\n")
KJV_IN = ("Ge1:1 In the beginning God created the heaven and the earth.\n"
          "Ge1:2 And the earth was without form.  \n"
          "\n"
          "Ge2:1 Thus the heavens were finished.\n"
          "Exo1:1 Now these are the names.\n")
KJV_OUT = ("The King James Version of the Bible, 1611 (in the public domain): Genesis and Exodus\n\n"
           "The First Book of Moses, called Genesis\n\n"
           "Chapter 1.\n\n"
           "In the beginning God created the heaven and the earth. And the earth was without form.\n\n"
           "Chapter 2.\n\n"
           "Thus the heavens were finished.\n\n"
           "The Second Book of Moses, called Exodus\n\n"
           "Chapter 1.\n\n"
           "Now these are the names.\n")


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def gz(path, text):
    with gzip.open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    return path


def verses(text):
    """The bible reader's output that gives `text` (a bundled kjv text):
    each chapter's line cut at its sentences, one verse a line."""
    book, out = None, []
    for line in text.split("\n"):
        m = re.match(r"Chapter (\d+)\.$", line)
        if line.startswith("The First Book"):
            book = "Ge"
        elif line.startswith("The Second Book"):
            book = "Exo"
        elif m:
            chapter = int(m.group(1))
        elif line and book:
            for n, verse in enumerate(re.split(r"(?<=[.;:?]) ", line), 1):
                out.append(f"{book}{chapter}:{n} {verse}")
    return "\n".join(out) + "\n"


class BundleText(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.wd = workdir("bundle")
        cls.inputs = os.path.join(cls.wd, "in")
        os.makedirs(cls.inputs)
        cls.jargon = gz(os.path.join(cls.inputs, "jargon.txt.gz"), JARGON)
        cls.kjv = os.path.join(cls.inputs, "kjv.txt")
        with open(cls.kjv, "wb") as f:
            f.write(KJV_IN.encode())

    def setUp(self):
        self.out = workdir("bundle-out")  # each case's outputs, empty at the start
        self.before = {p: digest(p) for p in (self.jargon, self.kjv)}

    def tearDown(self):
        for p, h in self.before.items():
            self.assertEqual(digest(p), h, f"{p} changed")

    def put(self, name, data, zipped=False):
        """An input of this case, checked byte for byte when it ends."""
        path = os.path.join(self.inputs, name)
        if zipped:
            gz(path, data)
        else:
            with open(path, "wb") as f:
                f.write(data)
        self.before[path] = digest(path)
        return path

    def script(self, *args, timeout=60):
        """The script in a child under MEMORY: (exit status, stdout, stderr)."""
        try:
            p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                               errors="replace", env=ENV, timeout=timeout, preexec_fn=limited,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            self.fail(f"bundle-text.py {' '.join(args)}: still running after {timeout} s")
        return p.returncode, p.stdout, p.stderr

    def made(self, kind, src, want, *extra):
        dst = os.path.join(self.out, "made.txt")
        code, out, err = self.script(kind, src, dst, *extra)
        self.assertEqual((code, out, err), (0, "", ""))
        with open(dst, encoding="utf-8", newline="") as f:
            self.assertEqual(f.read(), want)
        os.remove(dst)

    def refused(self, code, args, *words, leaves=(), timeout=60):
        """The script exits `code` with one line 'bundle-text: error: ...'
        holding every word, and leaves the output folder as it was."""
        before = sorted(os.listdir(self.out))
        got, out, err = self.script(*args, timeout=timeout)
        lines = [x for x in err.splitlines() if x.strip()]
        self.assertEqual(got, code, err[-2000:])
        self.assertEqual(len(lines), 1, err[-2000:])
        self.assertNotIn("Traceback", err)
        self.assertTrue(lines[0].startswith("bundle-text: error: "), lines[0])
        self.assertEqual(lines[0].count("error:"), 1, lines[0])
        self.assertLess(len(lines[0]), 400, "a line a person can read")
        for w in words:
            self.assertIn(w, lines[0])
        self.assertEqual(out, "")
        self.assertEqual(sorted(os.listdir(self.out)), before, f"left behind after: {lines[0]}")
        return lines[0]

    def dst(self):
        return os.path.join(self.out, "t.txt")

    # -- valid inputs: the same texts as before, byte for byte ---------------
    def test_a_jargon_like_gzip_gives_its_prose(self):
        self.made("jargon", self.jargon, JARGON_OUT)
        crlf = gz(os.path.join(self.out, "crlf.gz"), JARGON.replace("\n", "\r\n"))
        self.made("jargon", crlf, JARGON_OUT, "--force")

    def test_jargon_stops_at_the_last_whole_paragraph_under_a_million_bytes(self):
        # Paragraphs of 99,998 bytes (50,000 letters, most of two bytes) and
        # their blank line: 100,000 bytes each. The title and the heading
        # (under 100 bytes) leave room for 9, counted in bytes (counted in
        # characters, all 12 would fit).
        para = "é" * 20000 + "\n   " + "é" * 29998 + "a"
        text = "Chapter 1. X\n\n" + "".join(f"   {para}\n\n" for _ in range(12))
        src = gz(os.path.join(self.out, "long.gz"), text)
        one = para.replace("\n   ", " ")
        self.made("jargon", src, f"{JARGON_TITLE}\n\nChapter 1. X\n\n" + "\n\n".join([one] * 9) + "\n")

    def test_kjv_like_verses_give_chapters(self):
        self.made("kjv", self.kjv, KJV_OUT)
        crlf = os.path.join(self.out, "crlf.txt")
        with open(crlf, "wb") as f:
            f.write(KJV_IN.replace("\n", "\r\n").encode())
        self.made("kjv", crlf, KJV_OUT)

    def test_the_bundled_kjv_text_is_made_again(self):
        with open(KJV, encoding="utf-8") as f:
            want = f.read()
        src = os.path.join(self.out, "verses.txt")
        with open(src, "w", encoding="utf-8") as f:
            f.write(verses(want))
        self.made("kjv", src, want)

    def test_help(self):
        code, out, err = self.script("--help")
        self.assertEqual((code, err), (0, ""))
        self.assertIn("usage: bundle-text", out)
        self.assertIn("bible-kjv-text", out)

    # -- item 20: the command line and the output, exit 2 --------------------
    def test_no_arguments_is_a_usage_error_not_the_docstring(self):
        self.refused(2, [], "required", "--help")
        self.refused(2, ["kjv"], "required")
        self.refused(2, ["bible", self.kjv, self.dst()], "bible", "jargon")
        self.refused(2, ["kjv", self.kjv, self.dst(), "extra"], "extra")
        self.refused(2, ["kjv", self.kjv, self.dst(), "--forse"], "--forse")
        self.refused(2, ["kjv", "", self.dst()], "the input ''")
        self.refused(2, ["kjv", self.kjv, ""], "the output ''")

    def test_outputs_that_cannot_be_written(self):
        mine = os.path.join(self.out, "mine.txt")
        with open(mine, "w") as f:
            f.write("the user's own text\n")
        self.refused(2, ["kjv", self.kjv, mine], mine, "--force", leaves=["mine.txt"])
        with open(mine) as f:
            self.assertEqual(f.read(), "the user's own text\n")
        self.refused(2, ["kjv", self.kjv, "/dev/null", "--force"], "/dev/null", "regular file")
        self.assertTrue(stat.S_ISCHR(os.stat("/dev/null").st_mode))
        self.refused(2, ["kjv", self.kjv, self.kjv, "--force"], self.kjv, "input")
        self.refused(2, ["jargon", self.jargon, os.path.join(self.out, "no", "t.txt")],
                     "does not exist")
        self.refused(2, ["kjv", self.kjv, self.out, "--force"], "folder")
        # checked before the input is read: a bad input is not reported
        self.refused(2, ["kjv", "/dev/zero", "/dev/null"], "/dev/null")
        code, _, err = self.script("kjv", self.kjv, mine, "--force")
        self.assertEqual((code, err), (0, ""))
        with open(mine, encoding="utf-8") as f:
            self.assertEqual(f.read(), KJV_OUT)

    # -- item 3: devices and endless inputs, refused before they are read ----
    def test_devices_fifos_and_folders_are_not_read(self):
        for kind in ("kjv", "jargon"):
            self.refused(1, [kind, "/dev/zero", self.dst()], "/dev/zero", "regular file",
                         timeout=30)
            self.refused(1, [kind, self.inputs, self.dst()], self.inputs, "regular file")
        fifo = os.path.join(workdir("bundle-fifo"), "verses")
        os.mkfifo(fifo)
        for kind in ("kjv", "jargon"):
            self.refused(1, [kind, fifo, self.dst()], fifo, "regular file", timeout=30)

    def test_inputs_are_read_with_a_bound(self):
        sparse = os.path.join(self.out, "huge.txt")  # 33 MiB of NUL, no disk used
        with open(sparse, "wb") as f:
            f.truncate(33 << 20)
        self.refused(1, ["kjv", sparse, self.dst()], sparse, "MiB", leaves=["huge.txt"])
        bomb = os.path.join(self.out, "bomb.gz")  # 33 MiB of text in a few KB
        with gzip.open(bomb, "wb") as f:
            f.write(b"Chapter 1. X\n\n")
            for _ in range(33):
                f.write(b"a" * (1 << 20))
        self.assertLess(os.path.getsize(bomb), 1 << 20)
        self.refused(1, ["jargon", bomb, self.dst()], bomb, "decompresses", "MiB",
                     leaves=["huge.txt", "bomb.gz"])

    # -- item 12: inputs that yield no text ---------------------------------
    def test_inputs_without_text_are_refused(self):
        empty = self.put("empty.txt", b"")
        blank = self.put("blank.txt", b"\n  \n\r\n")
        self.refused(1, ["kjv", empty, self.dst()], empty, "empty")
        self.refused(1, ["kjv", blank, self.dst()], blank, "no verse")
        self.refused(1, ["jargon", empty, self.dst()], empty, "empty")
        nothing = self.put("nothing.gz", b"", zipped=True)
        self.refused(1, ["jargon", nothing, self.dst()], nothing, "Chapter 1.")
        heading = self.put("heading.gz", b"Chapter 1. X\n\n   foo\n\n   :foo: \n\n   index\n",
                           zipped=True)
        self.refused(1, ["jargon", heading, self.dst()], heading, "no paragraph")

    # -- item 18: one line naming the file, never a traceback ---------------
    def test_missing_input(self):
        for kind in ("kjv", "jargon"):
            missing = os.path.join(self.out, "missing.txt")
            self.refused(1, [kind, missing, self.dst()], missing, "no such file")

    def test_bad_gzips(self):
        self.refused(1, ["jargon", self.kjv, self.dst()], self.kjv, "gzip")
        with open(self.jargon, "rb") as f:
            whole = f.read()
        cut = self.put("cut.gz", whole[:len(whole) // 2])
        self.refused(1, ["jargon", cut, self.dst()], cut, "gzip")
        garbled = bytearray(whole)
        garbled[-6] ^= 0xFF  # the CRC
        bad = self.put("crc.gz", bytes(garbled))
        self.refused(1, ["jargon", bad, self.dst()], bad, "gzip")
        plain = self.put("plain.gz", KJV_IN.encode(), zipped=True)  # not the Jargon File
        self.refused(1, ["jargon", plain, self.dst()], plain, "Chapter 1.")

    def test_binary_inputs_name_their_line(self):
        binary = self.put("binary.txt", KJV_IN.encode()[:70] + b"\xff\xfe\x00\x01")
        self.refused(1, ["kjv", binary, self.dst()], binary, "line 2", "UTF-8")
        cr = self.put("cr.txt", b"Ge1:1 a\rGe1:2 b\r\r\nGe1:3 \xe9t\xe9\n")
        self.refused(1, ["kjv", cr, self.dst()], cr, "line 4", "UTF-8")
        zipped = self.put("binary.gz", b"Chapter 1. X\n\n\n\x80\x81", zipped=True)
        self.refused(1, ["jargon", zipped, self.dst()], zipped, "line 4", "UTF-8")

    def test_lines_that_are_not_verses(self):
        other = self.put("leviticus.txt", b"Ge1:1 a\n\nLe1:1 And the LORD called.\n")
        self.refused(1, ["kjv", other, self.dst()], other, "line 3", "Genesis")
        digits = self.put("digits.txt", b"Ge" + b"1" * 5000 + b":1 a\n")
        self.refused(1, ["kjv", digits, self.dst()], digits, "line 1")
        long = self.put("long.txt", b"x" * 100000 + b"\n")
        self.refused(1, ["kjv", long, self.dst()], long, "line 1")

    # -- item 20: Ctrl-C, and main() gives the status -------------------------
    def load(self):
        spec = importlib.util.spec_from_file_location("bundle_text_under_test", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    def call(self, mod, argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = mod.main(argv)
            except SystemExit as e:
                code = ("SystemExit", e.code)
            except KeyboardInterrupt:
                code = "KeyboardInterrupt"
        return code, err.getvalue()

    def test_main_returns_the_exit_status(self):
        mod = self.load()
        dst = self.dst()
        self.assertEqual(self.call(mod, ["kjv", self.kjv, dst]), (0, ""))
        self.assertEqual(self.call(mod, ["kjv", self.kjv, dst])[0], 2)
        self.assertEqual(self.call(mod, ["kjv", "/dev/zero", dst, "--force"])[0], 1)

    def test_ctrl_c_exits_130_and_writes_nothing(self):
        mod = self.load()

        def interrupted(src):
            raise KeyboardInterrupt
        mod.kjv = interrupted
        code, err = self.call(mod, ["kjv", self.kjv, self.dst()])
        self.assertEqual(code, 130, err)
        lines = err.strip().splitlines()
        self.assertEqual(len(lines), 1, err)
        self.assertIn("interrupted", lines[0])
        self.assertEqual(os.listdir(self.out), [])


if __name__ == "__main__":
    unittest.main()
