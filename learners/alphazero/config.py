"""AlphaZero's learner settings."""

from __future__ import annotations

import dataclasses

from learners.sgd import SGDConfig


@dataclasses.dataclass(frozen=True)
class AlphaZeroConfig(SGDConfig):
  learning_rate: float = 1e-3
  weight_decay: float = 1e-4
  value_cost: float = 0.5
  return_clip: float = 4.0         # value targets are clipped to +-return_clip
  pretrain_steps: int = 0          # first updates clone the experts of the train split
  pretrain_learning_rate: float = 0.0  # during those updates (0: learning_rate)
  replay_size: int = 2000
  samples_per_insert: float = 4.0  # how often each step is used, on average
  min_replay_size: int = 32

  def __post_init__(self):
    super().__post_init__()
    if self.pretrain_learning_rate < 0:
      raise ValueError(f"pretrain_learning_rate must be >= 0, got {self.pretrain_learning_rate}")
    if self.pretrain_steps < 0:
      raise ValueError(f"pretrain_steps must be >= 0, got {self.pretrain_steps}")
