"""A training run's config (`config.json` in its run directory): what it trains on and how.
`shardzero train` writes it; the roles, `propose`, `evaluate` and the `Auto` tactic read it."""

from __future__ import annotations

import dataclasses
import json
import os

from environments.observations import DEFAULT_SIZES, OBSERVATION_VERSION
from partitioner.errors import ShardzeroError

CONFIG = "config.json"


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What a run trains on and how. `settings` override the algorithm's config fields."""
  algorithm: str = "ppo"
  preset: str = "mini"
  models: tuple[str, ...] = ()        # training models (default: corpus.train_models(preset))
  heldout: tuple[str, ...] = ()       # evaluation models (default: the held-out split)
  meshes: tuple[str, ...] = ("batch=4,model=2", "batch=2,model=4")
  hardware: str = "h100"
  budget_fractions: tuple = (None, 0.5)
  eval_mesh: str = "batch=4,model=2"
  max_steps: int = 12                 # actions per episode
  batch_per_device: int | tuple | None = None  # weak scaling: each model's batch grows with
                                               # its mesh (several: drawn per task)
  steps: int = 100                    # learner updates
  actors: int = 2
  seed: int = 0
  checkpoint_every: int = 1           # learner updates between checkpoints
  variable_update_period: int = 8     # actor steps between parameter pulls
  eval_every_s: float = 60.0
  sizes: tuple[int, int, int] = tuple(DEFAULT_SIZES)
  settings: dict = dataclasses.field(default_factory=dict)
  network: dict = dataclasses.field(default_factory=dict)
  observation_version: int = OBSERVATION_VERSION   # the encoding its policy was trained on

  def save(self, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, CONFIG), "w") as f:
      json.dump(dataclasses.asdict(self), f, indent=2)

  @classmethod
  def load(cls, run_dir: str) -> "RunConfig":
    path = os.path.join(run_dir, CONFIG)
    if not os.path.exists(path):
      raise ShardzeroError(f"{run_dir} is not a training run (no {CONFIG})")
    try:
      with open(path) as f:
        data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ShardzeroError(f"{path} cannot be read: {e}") from None
    if not isinstance(data, dict):
      raise ShardzeroError(f"{path} is not a run config (a JSON object)")
    data.setdefault("observation_version", 1)   # runs from before observations had versions
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields
    if unknown:
      raise ShardzeroError(f"{path}: unknown settings {sorted(unknown)}")
    if isinstance(data.get("batch_per_device"), list):
      data["batch_per_device"] = tuple(data["batch_per_device"])
    for key in ("meshes", "budget_fractions", "sizes", "models", "heldout"):
      if key in data:
        data[key] = tuple(data[key])
    return cls(**data)

  def builder(self):
    from learners.algorithms import make_builder
    return make_builder(self.algorithm, self.settings, self.sizes, self.network)

  def env_config(self):
    from environments import EnvConfig
    return EnvConfig(max_steps=self.max_steps)

  def train_tasks(self):
    import corpus
    from environments import TaskDistribution
    models = self.models or tuple(corpus.train_models(self.preset))
    return TaskDistribution(models, meshes=self.meshes, hardware=(self.hardware,),
                            budget_fractions=self.budget_fractions,
                            batch_per_device=self.batch_per_device)

  def heldout_tasks(self, tight: bool = False):
    """The held-out models on the evaluation mesh, at the device's memory; with `tight`, at the
    first tight budget fraction the run trains with (none if it trains with none)."""
    import corpus
    from environments.tasks import tight_budget
    models = self.heldout or [f"{name}:{self.preset}" for name in corpus.split("heldout")]
    tasks = [self._eval_task(model) for model in models]
    if not tight:
      return tasks
    fractions = [f for f in self.budget_fractions if f is not None]
    return [dataclasses.replace(t, memory_budget=tight_budget(t, fractions[0]))
            for t in tasks] if fractions else []

  def train_eval_tasks(self):
    """The training models on the evaluation mesh: what the policy learned from, as a
    reference for how well it transfers to the held-out models."""
    return [self._eval_task(model) for model in self.train_tasks().models]

  def _eval_task(self, model: str):
    """`model` on the evaluation mesh, its batch scaled as the training tasks' are (at the
    first count where they draw from several)."""
    return self.train_tasks().task(model, self.eval_mesh, self.hardware)
