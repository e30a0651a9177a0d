"""A logical device mesh: ordered, named axes with sizes."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Mapping

from partitioner.errors import MeshError

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True, init=False)
class Mesh:
  """Named axes, major to minor. `Mesh({"batch": 4, "model": 2})` or `Mesh.parse("batch=4,model=2")`."""

  axes: tuple[tuple[str, int], ...]

  def __init__(self, axes: Mapping[str, int] | tuple[tuple[str, int], ...]):
    items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(axes)
    if not items:
      raise MeshError("a mesh needs at least one axis")
    seen = set()
    for name, size in items:
      if not isinstance(name, str) or not _AXIS_NAME.match(name):
        raise MeshError(f"bad mesh axis name {name!r}: use letters, digits and '_'")
      if name in seen:
        raise MeshError(f"mesh axis {name!r} appears twice")
      if not isinstance(size, int) or size < 1:
        raise MeshError(f"mesh axis {name!r} needs a positive integer size, got {size!r}")
      seen.add(name)
    object.__setattr__(self, "axes", items)

  @classmethod
  def parse(cls, text: str) -> "Mesh":
    """Parses `batch=4,model=2`."""
    items = []
    for part in text.split(","):
      part = part.strip()
      if not part:
        continue
      name, eq, size = part.partition("=")
      if not eq or not size.strip().isdigit():
        raise MeshError(f"bad mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...], e.g. batch=4,model=2")
      items.append((name.strip(), int(size)))
    return cls(tuple(items))

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(n for n, _ in self.axes)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(s for _, s in self.axes)

  @functools.cached_property
  def sizes(self) -> dict[str, int]:
    return dict(self.axes)

  @property
  def device_count(self) -> int:
    return math.prod(self.shape)

  def size(self, axis: str) -> int:
    self.check_axis(axis)
    return self.sizes[axis]

  def check_axis(self, axis: str) -> str:
    if axis not in self.sizes:
      raise MeshError(f"unknown mesh axis {axis!r}; the mesh has {', '.join(self.names)}")
    return axis

  def to_jax(self, devices=None):
    """The `jax.sharding.Mesh` over the first `device_count` local devices (or the given ones)."""
    import jax
    import numpy as np
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < self.device_count:
      raise MeshError(
          f"mesh {self} needs {self.device_count} devices, {len(devices)} available "
          "(for CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)")
    grid = np.array(devices[: self.device_count], dtype=object).reshape(self.shape)
    return jax.sharding.Mesh(grid, self.names)

  def __str__(self) -> str:
    return ",".join(f"{n}={s}" for n, s in self.axes)
