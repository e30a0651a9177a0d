"""Collectives in compiled XLA HLO, to check the partitioner's predictions against XLA.

Reads the text of `jax.jit(...).lower(...).compile().as_text()`: every all-reduce, all-gather,
reduce-scatter, all-to-all and collective-permute (and their async -start forms), with bytes
per device counted as the partitioner counts them (the larger side) and the mesh axes its
replica groups span.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Sequence

import numpy as np

from partitioner.collectives import Collective
from partitioner.mesh import Mesh

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
                   r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                   r"(?P<start>-start)?\((?P<operands>.*?)\)(?P<attrs>,.*)?$")
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


class HloCollective(NamedTuple):
  kind: str
  axes: tuple[str, ...]
  bytes: int
  count: int = 1            # tensors combined into this one instruction
  from_constant: bool = False  # its operand is a broadcast constant: it moves no information
  source: str = ""          # the JAX primitive it was partitioned from (HLO op_name metadata)


def _shape_bytes(text: str) -> list[int]:
  out = []
  for dtype, dims in _SHAPE.findall(text):
    if dtype in _BYTES:
      out.append(_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
  return out


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
  """Parses `replica_groups={{0,1},{2,3}}` or the iota form `[2,4]<=[4,2]T(1,0)`."""
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape).tolist()
  m = re.search(r"replica_groups=\{(.*?)\}(?:,|$)", attrs + ",")
  if m and m.group(1).strip():
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}",
                                                                               m.group(0))]
  return [list(range(num_devices))]


def _axes_of(group: Sequence[int], mesh: Mesh) -> tuple[str, ...]:
  coords = np.array(np.unravel_index(np.asarray(group), mesh.shape)).T
  return tuple(name for k, name in enumerate(mesh.names) if len(set(coords[:, k])) > 1)


_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*\S.*?\s([a-z\-]+)\((.*?)\)")


def _constant_values(hlo_text: str) -> set[str]:
  """Instructions that compute a constant: constants, broadcasts of them, operand-less fusions."""
  consts: set[str] = set()
  for line in hlo_text.splitlines():
    m = _DEF.match(line)
    if not m:
      continue
    name, opcode, operands = m.groups()
    refs = re.findall(r"%[\w.\-]+", operands)
    if opcode == "constant" or (opcode in ("fusion", "broadcast", "iota") and
                                all(r in consts for r in refs)):
      consts.add(name)
  return consts


_RESULT = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.+?)\s+[a-z][\w\-]*\(")


def _result_bytes(hlo_text: str) -> dict[str, list[int]]:
  """Each instruction's result bytes: XLA after jaxlib 0.4 prints operands by name alone."""
  out = {}
  for line in hlo_text.splitlines():
    m = _RESULT.match(line)
    if m:
      out[m.group(1)] = _shape_bytes(m.group(2))
  return out


def hlo_collectives(hlo_text: str, mesh: Mesh) -> list[HloCollective]:
  found = []
  constants = _constant_values(hlo_text)
  named = None
  for line in hlo_text.splitlines():
    m = _LINE.match(line)
    if not m:
      continue
    kind, attrs = m.group("kind"), m.group("attrs") or ""
    results = _shape_bytes(m.group("type"))
    operands = _shape_bytes(m.group("operands"))
    if not operands:
      named = _result_bytes(hlo_text) if named is None else named
      operands = [b for r in re.findall(r"%[\w.\-]+", m.group("operands"))
                  for b in named.get(r, [])]
    if m.group("start"):
      nbytes = max(results + operands)
      count = 1
    elif kind == "reduce-scatter":
      nbytes, count = sum(operands), len(operands)
    else:
      nbytes, count = sum(results), len(results)
    if kind == "collective-permute":
      axes = ()
    else:
      axes = _axes_of(replica_groups(attrs, mesh.device_count)[0], mesh)
    refs = re.findall(r"%[\w.\-]+", m.group("operands"))
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    source = op_name.group(1).rsplit("/", 1)[-1] if op_name else ""
    found.append(HloCollective(kind, axes, nbytes, count, bool(refs) and all(
        r in constants for r in refs), source))
  return found


class KindComparison(NamedTuple):
  kind: str
  predicted_bytes: int
  compiled_bytes: int      # collectives that move data
  predicted_count: int
  compiled_count: int
  constant_bytes: int = 0  # XLA collectives of broadcast constants (no information moved)

  @property
  def ratio(self) -> float:
    if self.predicted_bytes == 0:
      return math.inf if self.compiled_bytes else 1.0
    return self.compiled_bytes / self.predicted_bytes


def compare(predicted: Sequence[Collective], compiled: Sequence[HloCollective]):
  """Per kind: bytes and counts the partitioner predicted next to what XLA compiled."""
  rows = []
  for kind in KINDS:
    p = [c for c in predicted if c.kind == kind]
    c = [x for x in compiled if x.kind == kind and not x.from_constant]
    k = [x for x in compiled if x.kind == kind and x.from_constant]
    if p or c or k:
      rows.append(KindComparison(kind, sum(x.bytes for x in p), sum(x.bytes for x in c),
                                 len(p), sum(x.count for x in c), sum(x.bytes for x in k)))
  return rows


def memory_footprint(analysis) -> int:
  """Bytes a compiled program holds at once per device, from XLA's `memory_analysis()`:
  arguments + outputs + temporaries - what outputs alias."""
  return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes +
          analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
