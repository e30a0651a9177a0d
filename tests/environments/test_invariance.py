"""What a policy sees does not depend on names or on the order mesh axes are written in: axes
take observation slots by where they land (`Placement.slots`), and the program is read from
its dataflow. So renaming mesh axes or parameters, or reordering axes that land on the same
links, leaves the observation (and with it a policy's proposal) unchanged."""

import numpy as np
import pytest

from environments import PartitioningEnv, Task
from partitioner.cost import Placement, load_hardware
from partitioner.mesh import Mesh

DECODER = "tests/partitioner/user_models.py:wide_decoder"
RENAMED = "tests/partitioner/user_models.py:renamed_wide_decoder"
NODE_ARRAYS = ("node_kind", "nodes", "node_sharding", "node_mask", "senders", "receivers",
               "edge_direction", "edge_mask", "globals")


def _observation(model, mesh, actions=()):
  env = PartitioningEnv(Task(model, mesh))
  obs = env.reset().observation
  for a in actions:
    obs = env.step(env.action_index(a)).observation
  return env, obs


def _same(a, b, rows_in_any_order=False):
  for key in NODE_ARRAYS:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  order = (lambda x: x[np.lexsort(x.T[::-1])]) if rows_in_any_order else (lambda x: x)
  np.testing.assert_array_equal(order(a["actions"]), order(b["actions"]))
  assert a["action_mask"].sum() == b["action_mask"].sum()


def test_slots_follow_the_hardware_not_the_names_or_written_order():
  h100 = load_hardware("h100")
  slots = lambda text: Placement(Mesh.parse(text), h100).slots()
  assert slots("batch=4,model=2") == ("model", "batch") == slots("model=2,batch=4")
  assert slots("data=4,tensor=2") == ("tensor", "data")
  # Across nodes the written order decides what lands inside one, and so the slots.
  assert slots("batch=32,model=8") == ("model", "batch")
  assert slots("model=8,batch=32") == ("batch", "model")
  assert slots("data=4,fsdp=8,tensor=8") == ("tensor", "data", "fsdp")


def test_renaming_mesh_axes_leaves_the_observation_unchanged():
  _, a = _observation("gpt:mini", "batch=4,model=2", ["BatchParallel(batch)", "Megatron(model)"])
  _, b = _observation("gpt:mini", "data=4,tensor=2", ["BatchParallel(data)", "Megatron(tensor)"])
  _same(a, b)


def test_reordering_axes_inside_a_node_leaves_the_observation_unchanged():
  """On one 8-GPU node both axes are on the same links whichever is written first: the same
  slots, the same action rows (listed in another order)."""
  _, a = _observation("gpt:mini", "batch=4,model=2", ["BatchParallel(batch)", "Megatron(model)"])
  _, b = _observation("gpt:mini", "model=2,batch=4", ["BatchParallel(batch)", "Megatron(model)"])
  _same(a, b, rows_in_any_order=True)


@pytest.mark.slow
def test_renaming_parameters_leaves_the_observation_unchanged_up_to_the_order_of_values():
  """Renamed inputs flatten in another order, so values are numbered otherwise; what each
  value is, how it is connected and what each action tiles do not change."""
  env_a, a = _observation(DECODER, "batch=4,model=2")
  env_b, b = _observation(RENAMED, "data=4,tensor=2")
  sort_rows = lambda x: x[np.lexsort(x.T[::-1])]
  for key in ("nodes", "node_sharding"):
    np.testing.assert_array_equal(sort_rows(a[key]), sort_rows(b[key]))
  np.testing.assert_array_equal(np.sort(a["node_kind"]), np.sort(b["node_kind"]))
  np.testing.assert_array_equal(a["globals"], b["globals"])
  np.testing.assert_array_equal(sort_rows(a["actions"]), sort_rows(b["actions"]))
