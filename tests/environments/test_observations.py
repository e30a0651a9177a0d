"""The observation encoder: node-kind ids that never move, feature columns by name."""

import numpy as np

from environments import PartitioningEnv, Task
from environments.actions import TACTIC_KINDS
from environments.observations import (ACTION_FEATURES, DYNAMIC_FEATURES, GLOBAL_FEATURES,
                                       KIND_IDS, LOOP_MARKERS, NODE_KINDS, NUM_KINDS,
                                       ActionColumns, is_manual_tactic)
from partitioner.rules import FACTOR_RULES


def test_every_primitive_with_a_rule_has_a_fixed_kind_id():
  missing = sorted(set(FACTOR_RULES) - set(KIND_IDS))
  assert not missing, f"append {missing} to the end of NODE_KINDS (never insert: ids would move)"
  assert len(set(NODE_KINDS)) == len(NODE_KINDS) and len(NODE_KINDS) + 3 <= NUM_KINDS
  # Ids of trained policies: the first entries and a few known ones stay where they are.
  assert NODE_KINDS[:4] == ("abs", "acos", "acosh", "add")
  assert (KIND_IDS["add"], KIND_IDS["dot_general"], KIND_IDS["scan"], KIND_IDS["zeta"]) == \
      (6, 40, 99, 125)
  assert all(KIND_IDS[m] == KIND_IDS["scan"] for m in LOOP_MARKERS)


def test_action_columns_are_where_the_features_are():
  env = PartitioningEnv(Task("gpt:mini", "batch=4,model=2"))
  obs = env.reset().observation
  actions, n = obs["actions"], len(env.context.actions)
  assert ActionColumns.WIDTH == ACTION_FEATURES == actions.shape[1]
  kinds = [a.kind for a in env.context.actions]
  np.testing.assert_array_equal(
      actions[:n, ActionColumns.KIND].argmax(1), [TACTIC_KINDS.index(k) for k in kinds])
  np.testing.assert_array_equal(is_manual_tactic(actions[:n]),
                                [k not in ("tile", "Microbatch", "Remat", "finish")
                                 for k in kinds])
  assert kinds.count("Remat") == 1
  cuts = [i for i, a in enumerate(env.context.actions) if a.kind == "Microbatch"]
  assert [round(2 ** (6 * float(actions[i, ActionColumns.MICROBATCHES]))) for i in cuts] == \
      [env.context.actions[i].tactic.k for i in cuts] != []
  zero = [i for i, a in enumerate(env.context.actions) if a.kind == "ZeRO"]
  assert {round(float(actions[i, ActionColumns.STAGE]) * 3) for i in zero} == {1, 2, 3}
  tiles = [i for i, a in enumerate(env.context.actions) if a.kind == "tile"]
  assert np.all(actions[tiles, ActionColumns.BYTES] > 0)
  assert len(obs["globals"]) == GLOBAL_FEATURES
  # The dynamic features close the globals: the start state is one unpartitioned step that
  # does not fit or fits, with nothing taken yet.
  dynamic = dict(zip(DYNAMIC_FEATURES, obs["globals"][-len(DYNAMIC_FEATURES):]))
  assert dynamic["step_time"] == 1.0 and dynamic["progress"] == 0.0
  assert dynamic["fits"] == float(env.fits)
  assert dynamic["inputs_over_budget"] == np.float32(
      env.cost.memory.argument_bytes / env.context.budget)


def test_search_agents_use_only_the_documented_environment_protocol():
  """Every attribute the search agents and the learned actors read from an environment is a
  member of `SearchEnvironment`, and `PartitioningEnv` has them all."""
  import ast
  import pathlib
  from environments.protocols import SearchEnvironment
  members = {n for n in dir(SearchEnvironment) if not n.startswith("_")}
  env = PartitioningEnv(Task("mlp:mini", "batch=4,model=2"))
  env.reset()
  assert isinstance(env, SearchEnvironment)
  assert all(hasattr(env, m) for m in members)
  root = pathlib.Path(__file__).resolve().parents[2] / "agents"
  names = {"env", "trial", "child", "line", "environment", "_env"}
  used = set()
  for path in [*root.glob("search/*.py"), *root.glob("alphazero/*.py"), root / "decoding.py"]:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Attribute):
        base = node.value
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if name in names:
          used.add(node.attr)
  assert used and used <= members, sorted(used - members)


def test_a_barrier_links_each_operand_to_its_own_result_only():
  """A checkpoint's optimization barrier passes operand i to result i: the graph has those
  edges, not every operand to every result (gpt:350m's folded trace needed 9,516 edges so,
  over the 8,192 training pads to; 7,884 now)."""
  env = PartitioningEnv(Task("gpt:mini,remat=true", "batch=2,model=4", "h100"))
  graph, program = env.context.graph, env.context.program
  barriers = [op for op in program.ops if op.name == "optimization_barrier"]
  assert barriers and max(len(op.inputs) for op in barriers) > 1
  edges = set(zip(graph.senders[graph.edge_mask].tolist(),
                  graph.receivers[graph.edge_mask].tolist()))
  for op in barriers:
    for k, (i, o) in enumerate(zip(op.inputs, op.outputs)):
      assert (i, o) in edges and (o, i) in edges
      others = [out for j, out in enumerate(op.outputs) if j != k and op.inputs[j] != i]
      assert not any((i, out) in edges for out in others)


def test_a_task_over_the_padding_is_named():
  """Training pads every observation to one size; a task that outgrows it says which it is."""
  import pytest
  from environments.observations import Sizes
  from partitioner.errors import WorkloadError
  with pytest.raises(WorkloadError, match=r"mlp:mini on batch=2,model=4: this task needs "
                                          r"observation sizes \(\d+, \d+, \d+\), more than"):
    PartitioningEnv(Task("mlp:mini", "batch=2,model=4", "h100"), pad_to=Sizes(16, 16, 4))
