"""Where mesh axes land on the hardware: inside a node, across nodes, or both.

Devices are numbered row-major over the mesh axes in `order` (major to minor, the mesh's own
order by default), and devices `[k * node_size, (k + 1) * node_size)` form node k. So the
minor axes fill a node first: with `batch=8,model=8` on 8-GPU nodes, `model` is inside a node
and `batch` spans nodes; the order `model,batch` swaps them. Nothing is materialised, so meshes
of thousands of devices are cheap.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from partitioner.cost.hardware import Hardware
from partitioner.errors import MeshError
from partitioner.mesh import Mesh


class Group(NamedTuple):
  """The devices one collective spans: `intra` of them per node, over `inter` nodes."""
  size: int
  intra: int
  inter: int


class Placement:
  def __init__(self, mesh: Mesh, hardware: Hardware, order: Sequence[str] | None = None):
    order = tuple(order) if order else mesh.names
    if sorted(order) != sorted(mesh.names):
      raise MeshError(f"device order {','.join(order)} must name each mesh axis "
                      f"({','.join(mesh.names)}) once")
    self.mesh, self.hardware, self.order = mesh, hardware, order
    self._groups: dict[tuple[str, ...], Group] = {}   # a mesh has few axis subsets
    sizes = mesh.sizes
    self.strides, stride = {}, 1
    for a in reversed(order):
      self.strides[a] = stride
      stride *= sizes[a]

  def group(self, axes: tuple[str, ...]) -> Group:
    group = self._groups.get(axes)
    if group is None:
      group = self._groups[axes] = self._group(axes)
    return group

  def _group(self, axes: tuple[str, ...]) -> Group:
    sizes = self.mesh.sizes
    ids = np.zeros((), np.int64)
    for a in axes:
      ids = np.add.outer(ids, np.arange(sizes[a]) * self.strides[a])
    ids = ids.reshape(-1)
    intra = int(np.sum(ids < self.hardware.node_size))
    return Group(ids.size, intra, ids.size // intra)

  def level(self, axis: str) -> str:
    g = self.group((axis,))
    return "intra" if g.inter == 1 else "inter" if g.intra == 1 else "both"

  def describe(self) -> dict[str, str]:
    return {a: self.level(a) for a in self.mesh.names}

  def nodes(self, axis: str) -> int:
    """How many nodes one group of `axis` spans."""
    return self.group((axis,)).inter

  def slots(self) -> tuple[str, ...]:
    """The axes by where they land, not by name or written order: fewest nodes spanned first,
    then smallest, then the mesh's order. Meshes that differ only in their axes' names, or in
    an order that puts each axis on the same links (`batch=4,model=2` and `model=2,batch=4`
    inside one 8-GPU node), list the same sizes on the same links."""
    sizes = self.mesh.sizes
    ranked = sorted(enumerate(self.mesh.names),
                    key=lambda ia: (self.nodes(ia[1]), sizes[ia[1]], ia[0]))
    return tuple(a for _, a in ranked)

  def innermost(self) -> tuple[str, ...]:
    """The axes that span the fewest nodes, in the mesh's order: where tensor parallelism
    belongs (every axis of a mesh inside one node)."""
    fewest = min(self.nodes(a) for a in self.mesh.names)
    return tuple(a for a in self.mesh.names if self.nodes(a) == fewest)
