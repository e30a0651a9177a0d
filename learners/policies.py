"""Loading a trained policy from a `shardzero train` run directory: its config and the
parameters of its checkpoint. Playing it is `agents.decoding`."""

from __future__ import annotations

import os

import jax
import numpy as np

from agents.decoding import TrainedPolicy
from environments.caching import LRU
from environments.observations import OBSERVATION_VERSION
from learners import checkpointing
from learners.run_config import CONFIG, RunConfig


def load_policy(run_dir: str) -> TrainedPolicy:
  """The policy checkpointed in `run_dir`: the moving average of the parameters where the
  learner kept one (what its evaluator played), else the latest."""
  config = RunConfig.load(run_dir)
  builder = config.builder()
  state = checkpointing.load(run_dir)["learner"]["state"]
  if config.observation_version != OBSERVATION_VERSION:
    raise checkpointing.CheckpointError(
        f"{run_dir} was trained on observations of version {config.observation_version}; this "
        f"shardzero encodes version {OBSERVATION_VERSION}: train it again")
  networks = builder.make_networks()
  params = state[0]
  if builder.evaluation_variables == "average" and len(state) > 3 and state[3] is not None:
    params = state[3]
  shapes = lambda tree: jax.tree_util.tree_map(np.shape, tree)
  # Shapes only: initialising for real runs every op eagerly (2.7 s on 2 cores).
  if shapes(params) != shapes(jax.eval_shape(lambda: builder.init_params(networks))):
    raise checkpointing.CheckpointError(
        f"the checkpoint in {run_dir} does not fit the network of its {CONFIG}; train it again")
  return TrainedPolicy(networks, params, int(np.asarray(state[2])), config.max_steps, run_dir)


class PolicyCache:
  """Loaded policies by run directory, the `size` most recently used kept; a policy whose
  checkpoint changed since it was loaded is loaded again."""

  def __init__(self, size: int = 4):
    self._loaded: LRU[tuple[float, TrainedPolicy]] = LRU(size)

  def __call__(self, run_dir: str) -> TrainedPolicy:
    path = os.path.join(run_dir, checkpointing.FILENAME)
    stamp = os.path.getmtime(path) if os.path.exists(path) else 0.0
    hit = self._loaded.get(run_dir)
    if hit is None or hit[0] != stamp:
      hit = self._loaded.put(run_dir, (stamp, load_policy(run_dir)))
    return hit[1]

  def clear(self) -> None:
    self._loaded.clear()


def export_policy(run_dir: str, out_dir: str) -> TrainedPolicy:
  """Writes to `out_dir` the policy of `run_dir` as it is played and nothing more: the run's
  config and a checkpoint of only the parameters `load_policy` plays, with their version (a
  few hundred kB, where the learner's whole state with its optimizer is several times that).
  What `policies/default` ships."""
  policy = load_policy(run_dir)
  config = RunConfig.load(run_dir)
  os.makedirs(out_dir, exist_ok=True)
  config.save(out_dir)
  state = (policy.params, None, np.asarray(policy.version), None)
  checkpointing.save(os.path.join(out_dir, checkpointing.FILENAME),
                     {"learner": {"counts": {"steps": policy.version}, "state": state}})
  return load_policy(out_dir)
