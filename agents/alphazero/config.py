"""An AlphaZero actor's settings: how it searches and what it records."""

from __future__ import annotations

import dataclasses

POLICY_TARGETS = ("completed_q", "visits")


@dataclasses.dataclass(frozen=True)
class AlphaZeroActorConfig:
  simulations: int = 16            # MCTS simulations per move
  temperature: float = 1.0         # moves are sampled from visits^(1/temperature)
  policy_target: str = "visits"    # or "completed_q" (Gumbel MuZero's): see AlphaZeroActor
  prior_mix: float = 0.25          # search with this share of the heuristic prior
  demonstrations: float = 0.0      # share of episodes that replay the best known strategy
  demonstration_search: int = 0    # plain MCTS simulations per train task that may beat its
                                   # best expert as the demonstration (0: experts only)

  def __post_init__(self):
    if self.policy_target not in POLICY_TARGETS:
      raise ValueError(f"unknown policy_target {self.policy_target!r}; "
                       f"choose from {', '.join(POLICY_TARGETS)}")
    if self.simulations < 1:
      raise ValueError(f"simulations must be positive, got {self.simulations}")
    if self.demonstration_search < 0:
      raise ValueError(f"demonstration_search must be >= 0, got {self.demonstration_search}")
    if not 0.0 <= self.demonstrations <= 1.0:
      raise ValueError(f"demonstrations must be in [0, 1], got {self.demonstrations}")
    if not 0.0 <= self.prior_mix <= 1.0:
      raise ValueError(f"prior_mix must be in [0, 1], got {self.prior_mix}")

  def for_evaluation(self) -> "AlphaZeroActorConfig":
    """The same search without exploration aids (no heuristic prior, no demonstrations)."""
    return dataclasses.replace(self, prior_mix=0.0, demonstrations=0.0)
