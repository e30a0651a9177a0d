"""Rule of `stage_shift` (partitioner/shift.py): every dimension passes through, the shifted
one included, so slots stay on their stages; on one device the row that crosses a shard
boundary moves to the neighbouring device in a collective permute."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from partitioner.factors import FactorBuilder
from partitioner.rules import factor_rule, local_rule, shapes_of


@factor_rule("stage_shift")
def _shift(op, program):
  b = FactorBuilder()
  dims = b.dims(shapes_of(program, op.inputs)[0])
  return b.build([dims], [dims])


def crossing(op, value, dims, sizes) -> tuple[tuple[str, ...], int]:
  """The mesh axes the shifted dimension of `value` (laid out as `dims`) is split over, and the
  bytes of the row that crosses to the next device; ((), 0) where the dimension is whole."""
  dim = op.params["dim"]
  axes = tuple(dims[dim])
  if not axes:
    return (), 0
  count = lambda d: math.prod(sizes[a] for a in dims[d])
  row = math.prod(n // count(d) for d, n in enumerate(value.shape) if d != dim)
  return axes, row * value.dtype.itemsize


@local_rule("stage_shift")
def _local_shift(op, ctx, args):
  x = args[0]
  dim, offset = op.params["dim"], op.params["offset"]
  axes = tuple(ctx.operand_dims(0)[dim])
  if not axes:
    return [jnp.roll(x, offset, dim)]
  n = math.prod(ctx.sizes[a] for a in axes)
  rows = x.shape[dim]
  perm = [(i, (i + offset) % n) for i in range(n)]
  name = axes if len(axes) > 1 else axes[0]
  if offset == 1:   # the last row goes to the next device, which puts it first
    got = lax.ppermute(lax.slice_in_dim(x, rows - 1, rows, axis=dim), name, perm)
    return [lax.concatenate([got, lax.slice_in_dim(x, 0, rows - 1, axis=dim)], dim)]
  got = lax.ppermute(lax.slice_in_dim(x, 0, 1, axis=dim), name, perm)   # the first, back
  return [lax.concatenate([lax.slice_in_dim(x, 1, rows, axis=dim), got], dim)]
