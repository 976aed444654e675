"""The package's source read as a tree (ast), not run: its own modules are
imported at the top of each file (issue 57).  An import of one inside a
function says on its line why it cannot be at the top, and the reason
holds:
- torch, transformers, triton or kvpress: the module imported brings it in
  at its top (itself, a package above it, or what either imports there),
  and the importing module does not already;
- a cycle: the module imported imports this one at its top."""
import ast
import os
import unittest

from common import ROOT

SOURCE = os.path.join(ROOT, "python")
HEAVY = ("torch", "transformers", "triton", "kvpress")
REASONS = HEAVY + ("cycle",)


def modules():
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


MODULES = modules()


def targets(name, package, node):
    """(own modules, other top-level packages) an import statement names:
    for `from X import a`, X and X.a where X.a is a module."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.level == 0:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        base = name.split(".")[:len(name.split(".")) + package - node.level]
        mod = ".".join(base + ([node.module] if node.module else []))
        names = [mod] + [f"{mod}.{a.name}" for a in node.names]
    own = {n for n in names if n in MODULES}
    return own, {n.split(".")[0] for n in names if n.split(".")[0] != "kqsvd"}


def at_import(body):
    """The import statements a module body runs when it is imported: not
    inside functions, nor under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from at_import(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for part in getattr(node, block, []):
                    yield from at_import(part.body if isinstance(part, ast.ExceptHandler)
                                         else [part])


def in_functions(tree):
    """The import statements inside the module's functions and methods."""
    seen = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in seen:
                    seen.add(id(node))
                    yield node


TREES = {}
for _name, (_path, _) in MODULES.items():
    with open(_path) as _f:
        TREES[_name] = ast.parse(_f.read(), _path)
TOP = {name: [targets(name, MODULES[name][1], n) for n in at_import(TREES[name].body)]
       for name in MODULES}


def above(name):
    """The packages above a module: imported before it runs."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reach(start, done=()):
    """(own modules, other packages) importing the modules `start` runs:
    each, the packages above it, and what they import at their top, but
    for the modules `done` (imported already)."""
    seen, heavy, todo = set(done), set(), list(start)
    while todo:
        m = todo.pop()
        for up in above(m) + [m]:
            if up in MODULES and up not in seen:
                seen.add(up)
                for own, other in TOP[up]:
                    todo += own
                    heavy |= other
    return seen - set(done), heavy


class Imports(unittest.TestCase):
    def test_own_modules_at_the_top(self):
        bad = []
        for name, (path, package) in sorted(MODULES.items()):
            with open(path) as f:
                lines = f.read().splitlines()
            here = reach([name])[1]
            for node in in_functions(TREES[name]):
                own, _ = targets(name, package, node)
                if not own:
                    continue
                said_of = ", ".join(sorted(m for m in own if not any(o.startswith(m + ".")
                                                                       for o in own)))
                where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
                text = " ".join(lines[node.lineno - 1:node.end_lineno])
                said = text.partition("#")[2].lower()
                claims = [r for r in REASONS if r in said]
                if not claims:
                    bad.append(f"{where}: {said_of} imported in a function "
                               f"without a reason ({', '.join(REASONS)}) in a comment")
                    continue
                mods, heavy = reach(own, above(name))  # those run before this one
                holds = [r for r in claims if (name in mods if r == "cycle" else
                                               r in heavy and r not in here)]
                if not holds:
                    bad.append(f"{where}: {said_of}: the reason given ({', '.join(claims)}) "
                               "does not hold: the module does not bring it in at its top, or "
                               "this one already does")
        self.assertEqual(bad, [], "\n" + "\n".join(bad))

    def test_reach_sees_torch(self):
        """The check above can tell: kqsvd.attention brings torch in at its
        top, kqsvd.formats does not."""
        self.assertIn("torch", reach(["kqsvd.attention"])[1])
        self.assertNotIn("torch", reach(["kqsvd.formats.projections"])[1])
        self.assertIn("kqsvd.formats.quant", reach(["kqsvd.formats.tiers"])[0])


if __name__ == "__main__":
    unittest.main()
