"""gather and scatter-add, as used by embedding lookups, `take_along_axis` and their gradients.

An operand dimension that is indexed point-wise (collapsed, slice size 1) can be sharded in two
ways. If the index component is an `iota` along an index batch dimension (how `take_along_axis`
addresses the dimensions it does not gather along), the dimension is *parallel*: it shares a
factor with that batch dimension. Otherwise each device looks up only the indices that fall in
its shard and contributes zero elsewhere: a gather becomes a partial sum (Megatron's
vocab-parallel embedding), a scatter-add touches only its own rows.
"""

import numpy as np
import jax.numpy as jnp
from jax import lax

from partitioner.factors import PASS, REPL, SUM, FactorBuilder
from partitioner.ir import bind
from partitioner.rules import Unsupported, factor_rule, local_rule


def _iota_along(program, vid, depth: int = 0):
  """The dimension along which value `vid` counts 0, 1, 2... (an iota seen through casts,
  broadcasts and JAX's negative-index normalisation), or None."""
  v = program.values[vid]
  if v.producer is None or depth > 8:
    return None
  op = program.ops[v.producer]
  if op.name == "iota":
    return op.params["dimension"] if tuple(op.params["shape"]) == v.shape else None
  if op.name == "convert_element_type":
    return _iota_along(program, op.inputs[0], depth + 1)
  if op.name == "broadcast_in_dim":
    j = _iota_along(program, op.inputs[0], depth + 1)
    if j is None:
      return None
    d = op.params["broadcast_dimensions"][j]
    return d if program.values[op.inputs[0]].shape[j] == v.shape[d] else None
  if op.name == "select_n" and len(op.inputs) == 3:
    # `where(i < 0, i + n, i)`: an iota is never negative, so this is the iota itself.
    pred, keep, shifted = (program.values[i] for i in op.inputs)
    test = program.ops[pred.producer] if pred.producer is not None else None
    add = program.ops[shifted.producer] if shifted.producer is not None else None
    if test is not None and test.name == "lt" and test.inputs[0] == keep.id and \
        _is_zero(program, test.inputs[1]) and add is not None and add.name == "add" and \
        keep.id in add.inputs:
      return _iota_along(program, keep.id, depth + 1)
  return None


def _is_zero(program, vid) -> bool:
  v = program.values[vid]
  return v.is_const and v.rank == 0 and v.const == 0


def _iota_dim(program, vid, rank):
  """The index-batch dimension along which value `vid` (trailing size 1) is an iota, if any."""
  d = _iota_along(program, vid)
  return d if d is not None and d < rank - 1 else None


def iota_components(program, indices: int) -> dict[int, int]:
  """Index-vector components that are iotas: component position -> index batch dimension."""
  v = program.values[indices]
  rank = v.rank
  pieces = [indices]
  if v.producer is not None:
    op = program.ops[v.producer]
    if op.name == "concatenate" and op.params["dimension"] == rank - 1:
      pieces = list(op.inputs)
  found, pos = {}, 0
  for p in pieces:
    width = program.values[p].shape[-1]
    if width == 1:
      j = _iota_dim(program, p, rank)
      if j is not None and j not in found.values():
        found[pos] = j
    pos += width
  return found


def _check(dn):
  if getattr(dn, "operand_batching_dims", ()) or getattr(dn, "start_indices_batching_dims", ()):
    raise Unsupported("gather/scatter with batching dims")


def _index_factors(b, program, op, index_map, pointwise, batch_dims, other_f, masked_kind):
  """Factors shared by gather and scatter-add: operand dims looked up point-wise (parallel if
  their index is an iota, else `masked_kind`), and index batch dims paired with `batch_dims` of
  the other tensor (the gather output / the scatter updates)."""
  operand, indices = op.inputs[:2]
  os = program.values[operand].shape
  ishape = program.values[indices].shape
  op_f, idx_f = [()] * len(os), [()] * len(ishape)
  if ishape[-1] > 1:
    idx_f[-1] = (b.new(ishape[-1], REPL),)
  iotas = iota_components(program, indices)
  parallel = {}
  for k, d in enumerate(index_map):
    if d in pointwise and os[d] > 1:
      j = iotas.get(k)
      if j is not None and ishape[j] == os[d]:
        parallel[j] = op_f[d] = (b.new(os[d]),)
      else:
        op_f[d] = (b.new(os[d], masked_kind),)
  for j, o in enumerate(batch_dims):
    if ishape[j] > 1:
      idx_f[j] = other_f[o] = parallel.get(j) or (
          b.new(ishape[j], SUM if masked_kind == PASS else PASS),)
  return op_f, idx_f


def _window_factors(b, os, op_f, other_shape, other_f, pairs):
  """Operand dims taken whole by a window dim of the other tensor pass through; others not."""
  for o, d in pairs:
    if other_shape[o] == os[d] and os[d] > 1:
      op_f[d] = other_f[o] = (b.new(os[d]),)
    else:
      op_f[d] = (b.new(os[d], REPL),) if os[d] > 1 else ()
      other_f[o] = (b.new(other_shape[o], REPL),) if other_shape[o] > 1 else ()


@factor_rule("gather")
def gather(op, program):
  """Point-wise looked-up dims are parallel or masked (a partial sum); batch dims pass, and so
  do batching dims (a vmapped lookup: operand and indices share them, as current JAX writes
  `vmap` of a `dynamic_slice` with a batched index)."""
  dn = op.params["dimension_numbers"]
  batching = tuple(zip(getattr(dn, "operand_batching_dims", ()) or (),
                       getattr(dn, "start_indices_batching_dims", ()) or ()))
  os = program.values[op.inputs[0]].shape
  ishape = program.values[op.inputs[1]].shape
  if any(j == len(ishape) - 1 for _, j in batching):
    raise Unsupported("gather with a batching dim last in its indices")
  out = program.values[op.outputs[0]].shape
  b = FactorBuilder()
  out_f = [()] * len(out)
  batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
  op_f, idx_f = _index_factors(b, program, op, dn.start_index_map, dn.collapsed_slice_dims,
                               batch_out, out_f, SUM)
  for d, j in batching:
    op_f[d] = idx_f[j] if os[d] == ishape[j] else (b.new(os[d], REPL),) if os[d] > 1 else ()
  skipped = set(dn.collapsed_slice_dims) | {d for d, _ in batching}
  kept = [d for d in range(len(os)) if d not in skipped]
  _window_factors(b, os, op_f, out, out_f, zip(dn.offset_dims, kept))
  return b.build([op_f, idx_f], [out_f])


@factor_rule("scatter-add")
def scatter_add(op, program):
  """Point-wise written dims are parallel or masked (each device applies its own rows); the
  update batch dims are summed."""
  dn = op.params["dimension_numbers"]
  _check(dn)
  os = program.values[op.inputs[0]].shape
  us = program.values[op.inputs[2]].shape
  b = FactorBuilder()
  upd_f = [()] * len(us)
  scatter_upd = [d for d in range(len(us)) if d not in dn.update_window_dims]
  op_f, idx_f = _index_factors(b, program, op, dn.scatter_dims_to_operand_dims,
                               dn.inserted_window_dims, scatter_upd, upd_f, PASS)
  kept = [d for d in range(len(os)) if d not in dn.inserted_window_dims]
  _window_factors(b, os, op_f, us, upd_f, zip(dn.update_window_dims, kept))
  return b.build([op_f, idx_f, upd_f], [op_f])


# ----------------------------------------------------------------------------- local lowering
def _fill_value(dtype, fill):
  if fill is not None:
    return fill
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.inexact):
    return np.nan
  if np.issubdtype(dtype, np.signedinteger):
    return np.iinfo(dtype).min
  if np.issubdtype(dtype, np.unsignedinteger):
    return np.iinfo(dtype).max
  return True


def _parallel_dims(ctx) -> set[int]:
  """Operand dims whose factor is shared with the indices (iota components)."""
  index_factors = {f for d in ctx.factors.operands[1] for f in d}
  return {d for d, fs in enumerate(ctx.factors.operands[0]) if fs and fs[0] in index_factors}


def _localize_indices(op, ctx, indices, index_map, pointwise):
  """Moves the index components of sharded point-wise dims to local coordinates.

  Parallel components are shifted; the others are masked to the rows this device holds.
  Returns (indices, in-range mask or None, global out-of-bounds mask or None, masked dims).
  """
  gshape = ctx.program.values[op.inputs[0]].shape
  lshape = ctx.operand_shape(0)
  dims = ctx.operand_dims(0)
  parallel = _parallel_dims(ctx)
  clip = op.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP
  comps = [indices[..., k] for k in range(indices.shape[-1])]
  mask = oob = None
  masked = []
  for k, d in enumerate(index_map):
    axes = dims[d]
    if not axes or d not in pointwise:
      continue
    lo = (ctx.shard_index(axes) * lshape[d]).astype(indices.dtype)
    if d in parallel:
      comps[k] = comps[k] - lo
      continue
    masked.append(d)
    idx = comps[k]
    if clip:
      idx = jnp.clip(idx, 0, gshape[d] - 1)
    else:
      bad = (idx < 0) | (idx >= gshape[d])
      oob = bad if oob is None else (oob | bad)
    local = idx - lo
    ok = (local >= 0) & (local < lshape[d])
    mask = ok if mask is None else (mask & ok)
    comps[k] = jnp.where(ok, local, 0)
  return jnp.stack(comps, axis=-1), mask, oob, masked


def _all_first(ctx, axes_list):
  """True on the devices whose index along every given axis is 0."""
  first = None
  for axes in axes_list:
    at0 = ctx.shard_index(axes) == 0
    first = at0 if first is None else (first & at0)
  return first


@local_rule("gather")
def gather_local(op, ctx, args):
  operand, indices = args
  dn = op.params["dimension_numbers"]
  gshape = ctx.program.values[op.inputs[0]].shape
  lshape = ctx.operand_shape(0)
  indices, mask, oob, masked = _localize_indices(op, ctx, indices, dn.start_index_map,
                                                 set(dn.collapsed_slice_dims))
  sizes = tuple(l if s == g else s for s, g, l in zip(op.params["slice_sizes"], gshape, lshape))
  out = bind(op, [operand, indices], dict(op.params, slice_sizes=sizes))[0]
  if mask is None:
    return [out]
  batch_out = tuple(d for d in range(out.ndim) if d not in dn.offset_dims)
  fill = jnp.zeros((), out.dtype)
  if oob is not None:
    # Out-of-bounds lookups read the fill value; exactly one device contributes it to the sum.
    dims = ctx.operand_dims(0)
    first = _all_first(ctx, [dims[d] for d in masked])
    value = jnp.asarray(_fill_value(out.dtype, op.params.get("fill_value")), out.dtype)
    fill = jnp.where(lax.broadcast_in_dim(oob & first, out.shape, batch_out), value, fill)
  return [jnp.where(lax.broadcast_in_dim(mask, out.shape, batch_out), out, fill)]


@local_rule("scatter-add")
def scatter_add_local(op, ctx, args):
  operand, indices, updates = args
  dn = op.params["dimension_numbers"]
  indices, mask, _, _ = _localize_indices(op, ctx, indices, dn.scatter_dims_to_operand_dims,
                                          set(dn.inserted_window_dims))
  if mask is not None:
    scatter_upd = tuple(d for d in range(updates.ndim) if d not in dn.update_window_dims)
    updates = jnp.where(lax.broadcast_in_dim(mask, updates.shape, scatter_upd), updates,
                        jnp.zeros((), updates.dtype))
  # The result is summed afterwards over the axes that split the updates' summed dims: only
  # one device keeps the operand. (Over axes that a held partial sum, operand and updates
  # alike, is partial over, each device's operand is its own summand.)
  summed = {a for f, axes in enumerate(ctx.plan.fac_axes) if ctx.factors.kinds[f] == SUM
            for a in axes}
  over = [a for a in ctx.partial if a in summed]
  if over:
    first = _all_first(ctx, [(a,) for a in over])
    operand = jnp.where(first, operand, jnp.zeros((), operand.dtype))
  return bind(op, [operand, indices, updates], op.params)
