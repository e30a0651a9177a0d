"""The learning algorithms by name, and a builder made from a run's flat settings: each setting
goes to the learner's config or the actor's, whichever has the field, checked against the type
of its default."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from agents import networks as networks_lib
from agents.alphazero.config import AlphaZeroActorConfig
from agents.ppo.config import PPOActorConfig
from environments.observations import DEFAULT_SIZES, Sizes
from learners.alphazero.builder import AlphaZeroBuilder
from learners.alphazero.config import AlphaZeroConfig
from learners.builders import Builder
from learners.ppo.builder import PPOBuilder
from learners.ppo.config import PPOConfig
from partitioner.errors import ShardzeroError


class Algorithm(NamedTuple):
  builder: type
  learner_config: type
  actor_config: type


ALGORITHMS = {"ppo": Algorithm(PPOBuilder, PPOConfig, PPOActorConfig),
              "alphazero": Algorithm(AlphaZeroBuilder, AlphaZeroConfig, AlphaZeroActorConfig)}


def _typed(algorithm: str, field: dataclasses.Field, value):
  """A setting's value checked against the type of its default (an int is a float too)."""
  default = field.default
  if default is dataclasses.MISSING or default is None or value is None:
    return value
  kind = type(default)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    article = "an" if kind.__name__[0] in "aeiou" else "a"
    raise ShardzeroError(f"{algorithm} setting {field.name} takes {article} {kind.__name__} "
                         f"(like {default!r}), got {value!r}")
  return value


def make_builder(algorithm: str, settings: dict | None = None, sizes=DEFAULT_SIZES,
                 network: dict | None = None) -> Builder:
  """A builder by name with setting overrides (what `shardzero train --set` saves in a run)."""
  if algorithm not in ALGORITHMS:
    raise ShardzeroError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
  spec = ALGORITHMS[algorithm]
  settings = dict(settings or {})
  configs = []
  for cls in (spec.learner_config, spec.actor_config):
    fields = dataclasses.fields(cls)
    mine = {f.name: _typed(algorithm, f, settings.pop(f.name)) for f in fields
            if f.name in settings}
    try:
      configs.append(cls(**mine))
    except ValueError as e:
      raise ShardzeroError(f"bad {algorithm} settings: {e}") from None
  if settings:
    raise ShardzeroError(f"unknown {algorithm} settings {sorted(settings)}; "
                         f"known: {', '.join(sorted(known_settings(algorithm)))}")
  return spec.builder(*configs, Sizes(*sizes), networks_lib.NetworkConfig(**(network or {})))


def known_settings(algorithm: str) -> list[str]:
  spec = ALGORITHMS[algorithm]
  return [f.name for cls in (spec.learner_config, spec.actor_config)
          for f in dataclasses.fields(cls)]

