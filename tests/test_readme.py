"""The README's Python example runs as written, and its partitioned step computes what the
step computes unpartitioned (on whichever JAX runs the tests)."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
  text = README.read_text()
  section = text[text.index("## Partition your own training step from Python"):]
  return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_the_readme_example_partitions_and_matches_the_unpartitioned_step(capsys):
  scope: dict = {}
  exec(compile(_example(), str(README), "exec"), scope)
  assert "[-, model]" in capsys.readouterr().out
  pp, shardings = scope["pp"], scope["shardings"]
  assert pp.input_shardings()["params/w1"].spec() == jax.sharding.PartitionSpec(None, "model")
  # The step ran once, partitioned; run the unpartitioned step from the same start and compare.
  fresh: dict = {}
  exec(compile(_example().split("program = P.trace")[0], str(README), "exec"), fresh)
  expected = fresh["train_step"](fresh["params"], fresh["opt_state"], fresh["batch"])
  actual = (scope["params"], scope["opt_state"], scope["value"])
  for a, b in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert scope["params"]["w1"].sharding == shardings.out_shardings[0]["w1"]
