"""The pipeline's own ops: `stage_shift`, a cyclic shift by one along a dimension (the
point-to-point step), and `stage_view`, where a stage's layers read or make a hand-over.

Pipelines in SPMD form (partitioner/pipeline.py) hold one slot per stage along a dimension
split over the stage axis; between iterations every stage hands its slot to the next. Written
as slices and a concatenate, that is a gather of the whole dimension; as its own op, it has a
rule that keeps the dimension split (rules/shift.py), runs on one device as a collective
permute of the row that crosses to the neighbour, and is priced as that permute.

`stage_view` is the identity, sharded as an elementwise op. It marks a hand-over (or what a
stage keeps) where a stage's layers read or make it, so that `StageScatter` can hold the
hand-over split and keep the layers' side whole: the gather happens there, once, and the
layers stay as the other tactics shard them.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from partitioner.compat import Primitive, ShapedArray


def _roll(x, *, offset: int, dim: int):
  return jnp.roll(x, offset, dim)


@functools.lru_cache(maxsize=None)
def primitive() -> Primitive:
  """The primitive, made once: `bind(x, offset=+1 or -1, dim=d)`, slot i goes to i + offset."""
  from jax.interpreters import mlir
  p = Primitive("stage_shift")
  p.def_impl(_roll)
  p.def_abstract_eval(lambda x, **_: ShapedArray(x.shape, x.dtype))
  mlir.register_lowering(p, mlir.lower_fun(_roll, multiple_results=False))
  return p


def stage_shift(x, offset: int, dim: int = 0):
  """`jnp.roll(x, offset, dim)` for `offset` in (+1, -1), as one op of the IR."""
  if offset not in (1, -1):
    raise ValueError(f"stage_shift moves slots by +1 or -1, got {offset}")
  return primitive().bind(x, offset=offset, dim=dim)


@functools.lru_cache(maxsize=None)
def view_primitive() -> Primitive:
  """The identity primitive of `stage_view`, made once (with a rule for `vmap`)."""
  from jax.interpreters import batching, mlir
  p = Primitive("stage_view")
  p.def_impl(lambda x: x)
  p.def_abstract_eval(lambda x: ShapedArray(x.shape, x.dtype))
  mlir.register_lowering(p, mlir.lower_fun(lambda x: x, multiple_results=False))
  batching.primitive_batchers[p] = lambda args, dims: (p.bind(*args), dims[0])
  return p


def stage_view(x):
  """`x`, as a stage's layers read or make a hand-over (see the module docstring)."""
  return view_primitive().bind(x)
