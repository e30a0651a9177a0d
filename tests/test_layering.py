"""The packages import one way only: partitioner < corpus < environments < agents < learners <
launch (a package imports only itself and packages to its left), every import counted,
those inside functions too. Acme's interfaces at the bottom of `agents` import nothing of the
project but each other; the partitioner imports neither TensorFlow nor Reverb."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ("partitioner", "corpus", "environments", "agents", "learners", "launch")
INTERFACES = ("agents/core.py", "agents/adders.py", "agents/specs.py", "agents/counting.py",
              "agents/loggers.py", "agents/environment_loop.py")


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT):
  """(line, module) of every import in a file, relative ones made absolute."""
  package = path.relative_to(root).with_suffix("").parts[:-1]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      yield from ((node.lineno, a.name) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package[:len(package) - node.level + 1]
        yield node.lineno, ".".join(base + ((node.module,) if node.module else ()))
      else:
        yield node.lineno, node.module


def _files(package: str, root: pathlib.Path = ROOT):
  return sorted((root / package).rglob("*.py"))


def _against_the_order(root: pathlib.Path) -> list[str]:
  rank = {p: i for i, p in enumerate(ORDER)}
  against = []
  for package in ORDER:
    for path in _files(package, root):
      for line, module in _imports(path, root):
        top = module.split(".")[0]
        if top in rank and rank[top] > rank[package]:
          against.append(f"{path.relative_to(root)}:{line} imports {module}")
  return against


def test_packages_import_only_to_their_left():
  against = _against_the_order(ROOT)
  assert not against, "imports against the layering:\n" + "\n".join(against)


def test_acme_interfaces_import_only_each_other():
  allowed = {p.removesuffix(".py").replace("/", ".") for p in INTERFACES}
  against = [f"{p}:{line} imports {m}" for p in INTERFACES
             for line, m in _imports(ROOT / p)
             if m.split(".")[0] in ORDER and m not in allowed]
  assert not against, "\n".join(against)


def test_the_partitioner_imports_neither_tensorflow_nor_reverb():
  against = [f"{path.relative_to(ROOT)}:{line} imports {m}" for path in _files("partitioner")
             for line, m in _imports(path) if m.split(".")[0] in ("tensorflow", "reverb")]
  assert not against, "\n".join(against)


def test_the_checker_sees_imports_against_the_order(tmp_path):
  """The tests above would pass vacuously if they read nothing: planted back-edges (inside a
  function, and relative) are found."""
  (tmp_path / "partitioner" / "sub").mkdir(parents=True)
  (tmp_path / "partitioner" / "x.py").write_text("def f():\n  from launch import cli\n")
  (tmp_path / "agents").mkdir()
  (tmp_path / "agents" / "y.py").write_text("import os\nfrom learners.sgd import SGDLearner\n")
  (tmp_path / "partitioner" / "sub" / "z.py").write_text("from .. import errors\n")
  assert _against_the_order(tmp_path) == ["partitioner/x.py:2 imports launch",
                                          "agents/y.py:2 imports learners.sgd"]
