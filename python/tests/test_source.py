"""The package's source read as a tree (ast), not run: its own modules are
imported at the top of each file (issue 57).  An import of one inside a
function says in a comment on its lines, in one of these forms, why it
cannot be at the top, and the reason holds:
- "torch at its top" (or transformers, triton, kvpress): the module
  imported brings it in at its top (itself, a package above it, or what
  either imports there), and the importing module does not already;
  "torch at kqsvd.attention's top" names the module among those that
  brings it;
- "cycle: kqsvd.x imports this one": the module imported imports this
  one at its top, by name (`import`, or `from` it a name that is not a
  module): the packages above a module are imported before it, which is
  no cycle.
importlib.import_module of a name written out counts as an import; of a
name known only at run time it is refused, but in the functions DYNAMIC
names: renamed.moved, whose module __getattr__ resolves a deprecated name
where it now lives on first access (the new module may import the old
one, so the old one cannot import it at its top: a lazy import by design,
the modules it reaches written out in each moved() call, which must be the
package's), and quality.peers.need, which imports the peers' packages
(kvpress, quanto, hqq), never the package's own.  Imports under
`if __name__ == "__main__":` or `if TYPE_CHECKING:` do not run at import.

The checker is tried on small made-up sources too (Checker)."""
import ast
import io
import os
import re
import tokenize
import unittest

from common import ROOT

SOURCE = os.path.join(ROOT, "python")
HEAVY = ("torch", "transformers", "triton", "kvpress")
LAZY = re.compile(rf"(?P<heavy>{'|'.join(HEAVY)}) at (?:its|(?P<where>[\w.]+)'s) top(?:\W.*)?$")
CYCLE = re.compile(r"cycle: (?P<by>[\w.]+) imports this one(?:\W.*)?$")
FORMS = "'torch at its top', 'torch at kqsvd.x's top', 'cycle: kqsvd.x imports this one'"
# (module, function): the only places a module named at run time is imported
DYNAMIC = {("kqsvd.renamed", "moved"): "deprecated names resolved on access",
           ("kqsvd.quality.peers", "need"): "the peers' packages, never the package's own"}


def package_files():
    """{dotted name: (path, is a package)} of every file of python/kqsvd."""
    out = {}
    for folder, _, files in os.walk(os.path.join(SOURCE, "kqsvd")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                parts = os.path.relpath(path, SOURCE)[:-3].split(os.sep)
                package = parts[-1] == "__init__"
                out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def above(name):
    """The packages above a module: imported before it runs."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_call(node):
    """For a call of importlib.import_module or __import__: its module name
    when written out (absolute), else ""; None for any other node."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if not (isinstance(f, ast.Attribute) and f.attr == "import_module" or
            isinstance(f, ast.Name) and f.id in ("import_module", "__import__")):
        return None
    arg = node.args[0] if node.args else None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:1] != ".":
        return arg.value
    return ""


def as_import(call, module):
    """An import statement of `module` at the call's lines."""
    node = ast.Import(names=[ast.alias(name=module)])
    return ast.copy_location(node, call)


def main_guard(test):
    return ast.unparse(test).replace("'", '"') in ('__name__ == "__main__"',
                                                   '"__main__" == __name__')


class Source:
    """A package's modules {name: (text, is a package, where)} as trees:
    what each imports at its top, and the checks of its function imports."""

    def __init__(self, files):
        self.package = {n: p for n, (_, p, _) in files.items()}
        self.where = {n: w for n, (_, _, w) in files.items()}
        self.trees = {n: ast.parse(t, w) for n, (t, _, w) in files.items()}
        self.comments = {}
        for n, (text, _, _) in files.items():
            self.comments[n] = {tok.start[0]: tok.string[1:].strip()
                                for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                                if tok.type == tokenize.COMMENT}
        self.top = {n: [self.targets(n, node) for node in self.at_import(tree.body)]
                    for n, tree in self.trees.items()}

    def targets(self, name, node):
        """(own modules, other top-level packages) an import statement runs
        by name: for `from X import a`, X.a where it is a module, and X
        when a is a name of X's."""
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            mod = node.module
            if node.level:
                parts = name.split(".")
                base = parts[:len(parts) + self.package[name] - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{mod}.{a.name}" for a in node.names]
            names = [s for s in subs if s in self.package]
            names += [mod] if len(names) < len(subs) else []
        own = {n for n in names if n in self.package}
        return own, {n.split(".")[0] for n in names if n.split(".")[0] != "kqsvd"}

    def at_import(self, body):
        """The imports a module body runs when it is imported: not inside
        functions, nor under `if TYPE_CHECKING:` or `if __name__ ==
        "__main__":`; import_module calls of a written-out name included."""
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If) and ("TYPE_CHECKING" in ast.unparse(node.test) or
                                               main_guard(node.test)):
                yield from self.at_import(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for part in getattr(node, block, []):
                        yield from self.at_import(part.body if isinstance(part, ast.ExceptHandler)
                                                  else [part])
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for call in ast.walk(node):
                    if import_call(call):
                        yield as_import(call, import_call(call))

    def in_functions(self, name):
        """(import statement or None, outermost function, node) for each
        import inside the module's functions and methods; None for an
        import_module of a name known only at run time."""
        def walk(node, fn):
            for child in ast.iter_child_nodes(node):
                inner = fn
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn:
                    inner = child.name
                if fn and isinstance(child, (ast.Import, ast.ImportFrom)):
                    yield child, fn, child
                elif fn and import_call(child) is not None:
                    module = import_call(child)
                    yield (as_import(child, module) if module else None), fn, child
                yield from walk(child, inner)
        yield from walk(self.trees[name], None)

    def reach(self, start, done=()):
        """(own modules, other packages) importing the modules `start` runs:
        each, the packages above it, and what they import at their top, but
        for the modules `done` (imported already)."""
        seen, heavy, todo = set(done), set(), list(start)
        while todo:
            m = todo.pop()
            for up in above(m) + [m]:
                if up in self.package and up not in seen:
                    seen.add(up)
                    for own, other in self.top[up]:
                        todo += own
                        heavy |= other
        return seen - set(done), heavy

    def reason(self, name, node):
        """The first comment on the statement's lines."""
        for line in range(node.lineno, node.end_lineno + 1):
            if line in self.comments[name]:
                return self.comments[name][line]
        return ""

    def holds(self, name, own, said):
        """Whether the reason `said` (LAZY or CYCLE) holds for importing
        `own` inside a function of `name`."""
        done = above(name) + [name]  # by the time a function runs
        mods, heavy = self.reach(own, done)
        c = CYCLE.match(said)
        if c:  # the module named imports this one by name at its top, and is reached
            return c["by"] in mods and any(name in o for o, _ in self.top[c["by"]])
        m = LAZY.match(said)
        if m["heavy"] in self.reach([name])[1]:
            return False  # this one brings it in already
        if m["where"]:
            return m["where"] in mods and m["heavy"] in self.reach([m["where"]], done)[1]
        return m["heavy"] in heavy

    def problems(self):
        """One line for each import that breaks the rule."""
        bad = []
        for name in sorted(self.trees):
            for node, fn, at in self.in_functions(name):
                where = f"{self.where[name]}:{at.lineno}"
                if node is None:
                    if (name, fn) not in DYNAMIC:
                        bad.append(f"{where}: import_module of a name known only at run time "
                                   f"(in {fn}, not one of DYNAMIC)")
                    continue
                own, _ = self.targets(name, node)
                if not own:
                    continue
                said_of = ", ".join(sorted(m for m in own if not any(o.startswith(m + ".")
                                                                       for o in own)))
                said = self.reason(name, node)
                if not (LAZY.match(said) or CYCLE.match(said)):
                    bad.append(f"{where}: {said_of} imported in a function without a reason "
                               f"in a comment, in one of the forms {FORMS}")
                elif not self.holds(name, own, said):
                    bad.append(f"{where}: {said_of}: the reason given ({said}) does not hold: "
                               "the module does not bring it in at its top, or this one "
                               "already does, or it does not import this one by name")
            bad += self.moved_targets(name)
        return bad

    def moved_targets(self, name):
        """DYNAMIC's renamed.moved resolves only the package's own modules,
        each written out in a moved() call."""
        bad = []
        for call in ast.walk(self.trees[name]):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and
                    call.func.id == "moved"):
                table = call.args[1] if len(call.args) > 1 else None
                values = table.values if isinstance(table, ast.Dict) else [table]
                for v in values:
                    if not (isinstance(v, ast.Constant) and v.value in self.package):
                        bad.append(f"{self.where[name]}:{call.lineno}: moved() to "
                                   f"{ast.unparse(v) if v else 'nothing'}: not a module "
                                   "of the package written out")
        return bad


def package_source():
    files = {}
    for name, (path, package) in package_files().items():
        with open(path) as f:
            files[name] = (f.read(), package, os.path.relpath(path, ROOT))
    return Source(files)


PACKAGE = package_source()


class Imports(unittest.TestCase):
    def test_own_modules_at_the_top(self):
        bad = PACKAGE.problems()
        self.assertEqual(bad, [], "\n" + "\n".join(bad))

    def test_reach_sees_torch(self):
        """The check above can tell: kqsvd.attention brings torch in at its
        top, kqsvd.formats does not."""
        self.assertIn("torch", PACKAGE.reach(["kqsvd.attention"])[1])
        self.assertNotIn("torch", PACKAGE.reach(["kqsvd.formats.projections"])[1])
        self.assertIn("kqsvd.formats.quant", PACKAGE.reach(["kqsvd.formats.tiers"])[0])


def made_up(files):
    """Problems of a made-up package {name: text}; a name ending in '/' is a
    package (its __init__)."""
    return Source({n.rstrip("/"): (t, n.endswith("/"), n) for n, t in files.items()}).problems()


class Checker(unittest.TestCase):
    """The checker on small made-up sources: each way a reason could pass
    without holding is caught, and reasons that hold pass."""

    def test_a_cycle_through_the_package_alone_is_none(self):
        bad = made_up({"kqsvd/": "", "kqsvd.quality/": "def f():\n    from . import measure"
                       "  # cycle: kqsvd.quality.measure imports this one\n",
                       "kqsvd.quality.measure": "from . import tally\n", "kqsvd.quality.tally": ""})
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("does not hold", bad[0])

    def test_a_cycle_that_is_one_passes(self):
        init = "def f():\n    from . import measure  # cycle: kqsvd.quality.measure imports this one\n"
        self.assertEqual(made_up({"kqsvd/": "", "kqsvd.quality/": init,
                                  "kqsvd.quality.measure": "from kqsvd.quality import X\n"}), [])
        self.assertEqual(made_up({"kqsvd/": "", "kqsvd.a": "def f():\n    from . import b"
                                  "  # cycle: kqsvd.c imports this one\n",
                                  "kqsvd.b": "from . import c\n", "kqsvd.c": "from . import a\n"}),
                         [])

    def test_imports_under_main_do_not_run_at_import(self):
        b = 'if __name__ == "__main__":\n    import torch\n'
        bad = made_up({"kqsvd/": "", "kqsvd.a": "def f():\n    from . import b  # torch at its top\n",
                       "kqsvd.b": b})
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("does not hold", bad[0])
        self.assertEqual(made_up({"kqsvd/": "", "kqsvd.a": "def f():\n    from . import b"
                                  "  # torch at its top\n", "kqsvd.b": "import torch\n" + b}), [])

    def test_a_reason_in_its_form_only(self):
        b = {"kqsvd/": "", "kqsvd.b": "import torch\n"}
        for said in ("no torch", "torch", "not a cycle", "torch at its topology"):
            with self.subTest(said):
                bad = made_up({**b, "kqsvd.a": f"def f():\n    from . import b  # {said}\n"})
                self.assertEqual(len(bad), 1, bad)
                self.assertIn("without a reason", bad[0])
        for said in ("torch at its top", "torch at its top (the tables)",
                     "torch at kqsvd.b's top"):
            with self.subTest(said):
                self.assertEqual(made_up({**b, "kqsvd.a": f"def f():\n    from . import b"
                                          f"  # {said}\n"}), [])
        bad = made_up({**b, "kqsvd.c": "", "kqsvd.a": "def f():\n    from . import b"
                       "  # torch at kqsvd.c's top\n"})
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("does not hold", bad[0])

    def test_import_module_is_an_import(self):
        b = {"kqsvd/": "", "kqsvd.b": "X = 1\n", "kqsvd.renamed": ""}
        a = ("import importlib\n\n\ndef f():\n    return importlib.import_module('kqsvd.b')\n")
        bad = made_up({**b, "kqsvd.a": a})
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("kqsvd.a:5: kqsvd.b imported in a function without a reason", bad[0])
        dynamic = "import importlib\n\n\ndef {}(m):\n    return importlib.import_module(m)\n"
        bad = made_up({**b, "kqsvd.a": dynamic.format("f")})
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("known only at run time", bad[0])
        # the one exception for deprecated names, and only to the package's modules
        self.assertEqual(made_up({**b, "kqsvd.renamed": dynamic.format("moved")}), [])
        self.assertEqual(made_up({**b, "kqsvd.renamed": dynamic.format("moved"),
                                  "kqsvd.old": "__getattr__ = moved(__name__, {'X': 'kqsvd.b'})\n"}),
                         [])
        bad = made_up({**b, "kqsvd.old": "__getattr__ = moved(__name__, {'X': 'kqsvd.gone'})\n"})
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("not a module of the package", bad[0])


if __name__ == "__main__":
    unittest.main()
