"""The packages import one way only: partitioner < corpus < environments < agents < learners <
launch (a package imports only itself and packages to its left), every import counted,
those inside functions too. Acme's interfaces at the bottom of `agents` import nothing of the
project but each other; the partitioner imports neither TensorFlow nor Reverb. No two modules
import each other, even through others. Only `partitioner/compat.py` names JAX's moved APIs."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ("partitioner", "corpus", "environments", "agents", "learners", "launch")
INTERFACES = ("agents/core.py", "agents/adders.py", "agents/specs.py", "agents/counting.py",
              "agents/loggers.py", "agents/environment_loop.py")


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT, names: bool = False):
  """(line, module) of every import in a file, relative ones made absolute; with `names`,
  `from a import b` also yields `a.b` (b may be a module)."""
  package = path.relative_to(root).with_suffix("").parts[:-1]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      yield from ((node.lineno, a.name) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package[:len(package) - node.level + 1]
        module = ".".join(base + ((node.module,) if node.module else ()))
      else:
        module = node.module
      yield node.lineno, module
      if names:
        yield from ((node.lineno, f"{module}.{a.name}") for a in node.names)


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


def _circles(root: pathlib.Path) -> list[list[str]]:
  """Import circles between modules (packages' `__init__` left out: a module importing its
  own package is how Python reaches it)."""
  modules = {".".join(p.relative_to(root).with_suffix("").parts): p
             for package in ORDER for p in _files(package, root) if p.name != "__init__.py"}
  edges = {m: sorted({d for _, d in _imports(p, root, names=True) if d in modules} - {m})
           for m, p in modules.items()}
  circles, done = [], set()

  def visit(m, path):
    for d in edges[m]:
      if d in path:
        circles.append(path[path.index(d):] + [d])
      elif d not in done:
        visit(d, path + [d])
    done.add(m)

  for m in sorted(modules):
    if m not in done:
      visit(m, [m])
  return circles


def test_no_module_imports_itself_through_others():
  circles = _circles(ROOT)
  assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_only_the_compat_module_names_jax_apis_that_moved():
  moved = ("jax.core", "jax.experimental.shard_map", "jax.experimental.enable_x64",
           "jax.extend")
  against = [f"{path.relative_to(ROOT)}:{line} imports {m}" for package in ORDER
             for path in _files(package) if path.name != "compat.py"
             for line, m in _imports(path, names=True) if m.startswith(moved)]
  assert not against, "\n".join(against)


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
  (tmp_path / "partitioner" / "a.py").write_text("def f():\n  from partitioner import b\n")
  (tmp_path / "partitioner" / "b.py").write_text("from partitioner.a import f\n")
  assert _circles(tmp_path) == [["partitioner.a", "partitioner.b", "partitioner.a"]]


def test_importing_the_partitioner_starts_no_jax_backend():
  """A user may still have to configure JAX after importing the partitioner
  (`jax.distributed.initialize`, the host device count): nothing it runs at import may start a
  backend (`compat.optimization_barrier_p` only traces)."""
  import subprocess
  import sys
  code = ("from jax._src import xla_bridge; import partitioner, partitioner.lowering, "
          "partitioner.cost; print(bool(xla_bridge._backends))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       check=True)
  assert out.stdout.split()[-1] == "False"
