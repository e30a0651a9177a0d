"""A PPO actor's settings."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PPOActorConfig:
  sequence_length: int = 8      # actions per sequence its adder writes (T); items hold T+1 steps

  def __post_init__(self):
    if self.sequence_length < 1:
      raise ValueError(f"sequence_length must be positive, got {self.sequence_length}")
