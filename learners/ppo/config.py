"""PPO's learner settings."""

from __future__ import annotations

import dataclasses

from learners.sgd import SGDConfig


@dataclasses.dataclass(frozen=True)
class PPOConfig(SGDConfig):
  learning_rate: float = 3e-4
  max_gradient_norm: float = 0.5
  epochs: int = 2               # gradient steps per batch
  batch_size: int = 4           # sequences per batch
  clip_epsilon: float = 0.2
  gae_lambda: float = 0.95
  discount: float = 1.0
  entropy_cost: float = 0.01
  value_cost: float = 0.5
  reward_clip: float = 2.0      # a step over the memory budget costs 1 + overflow: bound it
  queue_size: int = 8           # sequences the queue holds before actors wait (policy lag)
