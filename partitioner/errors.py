"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class ShardzeroError(Exception):
  """Bad input: an unknown axis, a dimension that does not divide, a pattern that matches nothing..."""


class MeshError(ShardzeroError):
  """A malformed mesh or an axis that is not in it."""


class PatternError(ShardzeroError):
  """A value name or pattern that matches nothing in the program."""


class ShardingError(ShardzeroError):
  """A tiling that cannot hold: not divisible, an axis used twice, or one that undoes an earlier tactic."""


class ScheduleError(ShardzeroError):
  """A tactic schedule that does not parse or names an unknown tactic."""


class WorkloadError(ShardzeroError):
  """A model spec that does not resolve to a (function, example arguments) workload."""
