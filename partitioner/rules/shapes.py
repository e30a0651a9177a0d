"""Ops that move or reshape data: broadcast, reshape, transpose, squeeze, slices, pads, iota..."""

import math

from partitioner.factors import PASS, REPL, FactorBuilder
from partitioner.ir import bind
from partitioner.rules import Unsupported, factor_rule, local_rule, shapes_of


def _with(op, **changes):
  params = dict(op.params)
  params.update(changes)
  return params


# --------------------------------------------------------------------------- broadcast_in_dim
@factor_rule("broadcast_in_dim")
def broadcast_in_dim(op, program):
  src = program.values[op.inputs[0]].shape
  shape = op.params["shape"]
  if len(op.inputs) != 1:
    raise Unsupported("broadcast_in_dim with dynamic shapes")
  b = FactorBuilder()
  out = [None] * len(shape)
  operand = []
  for i, d in enumerate(op.params["broadcast_dimensions"]):
    if src[i] == shape[d] and src[i] > 1:
      out[d] = (b.new(src[i]),)
      operand.append(out[d])
    else:
      operand.append(())
  out = [o if o is not None else ((b.new(n),) if n > 1 else ()) for o, n in zip(out, shape)]
  return b.build([operand], [out])


@local_rule("broadcast_in_dim")
def broadcast_in_dim_local(op, ctx, args):
  return bind(op, args, _with(op, shape=ctx.result_shape(0)))


# --------------------------------------------------------------------------- reshape
def reshape_factors(b: FactorBuilder, ins, outs):
  """Split/merged factors between two shapes of equal size (Shardy's reshape rule).

  Dimensions are grouped into runs of equal product; inside a group a common refinement of the
  two factorisations is found with gcds. A group with none is left whole (REPL).
  """
  in_f = [[] for _ in ins]
  out_f = [[] for _ in outs]
  i = j = 0
  while True:
    while i < len(ins) and ins[i] == 1:
      i += 1
    while j < len(outs) and outs[j] == 1:
      j += 1
    if i == len(ins) or j == len(outs):
      break
    gi, gj, pi, pj = [i], [j], ins[i], outs[j]
    while pi != pj:
      if pi < pj:
        i += 1
        gi.append(i)
        pi *= ins[i]
      else:
        j += 1
        gj.append(j)
        pj *= outs[j]
    i += 1
    j += 1
    gi = [d for d in gi if ins[d] > 1]
    gj = [d for d in gj if outs[d] > 1]
    pieces = _refine([ins[d] for d in gi], [outs[d] for d in gj])
    if pieces is None:
      for d in gi:
        in_f[d].append(b.new(ins[d], REPL))
      for d in gj:
        out_f[d].append(b.new(outs[d], REPL))
      continue
    for size, a, c in pieces:
      f = b.new(size)
      in_f[gi[a]].append(f)
      out_f[gj[c]].append(f)
  return [tuple(f) for f in in_f], [tuple(f) for f in out_f]


def _refine(xs, ys):
  """Common factors of two factorisations of one number: [(size, x index, y index)], or None."""
  pieces, a, c = [], 0, 0
  ra, rc = xs[0], ys[0]
  while True:
    g = math.gcd(ra, rc)
    if g == 1:
      return None
    pieces.append((g, a, c))
    ra //= g
    rc //= g
    if ra == 1:
      a += 1
      if a < len(xs):
        ra = xs[a]
    if rc == 1:
      c += 1
      if c < len(ys):
        rc = ys[c]
    if a == len(xs) or c == len(ys):
      return pieces if (a == len(xs) and c == len(ys)) else None


@factor_rule("reshape")
def reshape(op, program):
  if op.params.get("dimensions") is not None:
    raise Unsupported("reshape with dimensions")
  src = program.values[op.inputs[0]].shape
  dst = program.values[op.outputs[0]].shape
  b = FactorBuilder()
  ins, outs = reshape_factors(b, src, dst)
  return b.build([ins], [outs])


@local_rule("reshape")
def reshape_local(op, ctx, args):
  return bind(op, args, _with(op, new_sizes=ctx.result_shape(0)))


# --------------------------------------------------------------------------- transpose, squeeze
@factor_rule("transpose")
def transpose(op, program):
  src = program.values[op.inputs[0]].shape
  b = FactorBuilder()
  ins = b.dims(src)
  return b.build([ins], [[ins[p] for p in op.params["permutation"]]])


@factor_rule("squeeze")
def squeeze(op, program):
  src = program.values[op.inputs[0]].shape
  b = FactorBuilder()
  ins = b.dims(src)
  gone = {d % len(src) for d in op.params["dimensions"]}
  return b.build([ins], [[f for d, f in enumerate(ins) if d not in gone]])


@factor_rule("rev")
def rev(op, program):
  src = program.values[op.inputs[0]].shape
  b = FactorBuilder()
  flipped = set(op.params["dimensions"])
  ins = [(b.new(n, REPL if d in flipped else PASS),) if n > 1 else () for d, n in enumerate(src)]
  outs = [((b.new(n, REPL),) if d in flipped and n > 1 else ins[d]) for d, n in enumerate(src)]
  return b.build([ins], [outs])


# --------------------------------------------------------------------------- iota
@factor_rule("iota")
def iota(op, program):
  b = FactorBuilder()
  return b.build([], [b.dims(op.params["shape"])])


@local_rule("iota")
def iota_local(op, ctx, args):
  shape = ctx.result_shape(0)
  d = op.params["dimension"]
  x = bind(op, [], _with(op, shape=shape))[0]
  axes = ctx.result_dims(0)[d]
  if axes:
    x = x + (ctx.shard_index(axes) * shape[d]).astype(x.dtype)
  return [x]


# --------------------------------------------------------------------------- slices and pads
def _whole_or_repl(b, shape, whole):
  return [((b.new(n),) if w else (b.new(n, REPL),)) if n > 1 else () for n, w in zip(shape, whole)]


@factor_rule("slice")
def slice_(op, program):
  src = program.values[op.inputs[0]].shape
  dst = program.values[op.outputs[0]].shape
  strides = op.params["strides"] or (1,) * len(src)
  whole = [s == 0 and l == n and st == 1 for s, l, n, st in
           zip(op.params["start_indices"], op.params["limit_indices"], src, strides)]
  b = FactorBuilder()
  ins = _whole_or_repl(b, src, whole)
  outs = [i if w else ((b.new(n, REPL),) if n > 1 else ()) for i, w, n in zip(ins, whole, dst)]
  return b.build([ins], [outs])


@local_rule("slice")
def slice_local(op, ctx, args):
  src = ctx.operand_shape(0)
  limits = [n if (s == 0 and l == g) else l for s, l, n, g in
            zip(op.params["start_indices"], op.params["limit_indices"], src,
                ctx.program.values[op.inputs[0]].shape)]
  return bind(op, args, _with(op, limit_indices=tuple(limits)))


@factor_rule("dynamic_slice")
def dynamic_slice(op, program):
  src = program.values[op.inputs[0]].shape
  sizes = op.params["slice_sizes"]
  b = FactorBuilder()
  ins = _whole_or_repl(b, src, [s == n for s, n in zip(sizes, src)])
  outs = [i if s == n else ((b.new(s, REPL),) if s > 1 else ()) for i, s, n in zip(ins, sizes, src)]
  return b.build([ins] + [()] * (len(op.inputs) - 1), [outs])


@local_rule("dynamic_slice")
def dynamic_slice_local(op, ctx, args):
  src = ctx.program.values[op.inputs[0]].shape
  local = ctx.operand_shape(0)
  sizes = tuple(l if s == n else s for s, n, l in zip(op.params["slice_sizes"], src, local))
  return bind(op, args, _with(op, slice_sizes=sizes))


@factor_rule("dynamic_update_slice")
def dynamic_update_slice(op, program):
  src = program.values[op.inputs[0]].shape
  upd = program.values[op.inputs[1]].shape
  b = FactorBuilder()
  whole = [u == n for u, n in zip(upd, src)]
  ins = _whole_or_repl(b, src, whole)
  ups = [i if w else ((b.new(u, REPL),) if u > 1 else ()) for i, w, u in zip(ins, whole, upd)]
  return b.build([ins, ups] + [()] * (len(op.inputs) - 2), [ins])


@factor_rule("pad")
def pad(op, program):
  src = program.values[op.inputs[0]].shape
  dst = program.values[op.outputs[0]].shape
  whole = [tuple(c) == (0, 0, 0) for c in op.params["padding_config"]]
  b = FactorBuilder()
  ins = _whole_or_repl(b, src, whole)
  outs = [i if w else ((b.new(n, REPL),) if n > 1 else ()) for i, w, n in zip(ins, whole, dst)]
  return b.build([ins, ()], [outs])


@factor_rule("concatenate")
def concatenate(op, program):
  d = op.params["dimension"]
  shapes = shapes_of(program, op.inputs)
  dst = program.values[op.outputs[0]].shape
  b = FactorBuilder()
  common = [(b.new(n),) if n > 1 and k != d else () for k, n in enumerate(dst)]

  def tensor(shape):
    return [common[k] if k != d else ((b.new(shape[k], REPL),) if shape[k] > 1 else ())
            for k in range(len(shape))]

  return b.build([tensor(s) for s in shapes], [tensor(dst)])


# --------------------------------------------------------------------------- windows and scans
def _shared_except(op, program, src, keep):
  """Tensors of `src`'s rank share a factor on dims `keep` marks (where sizes agree); the
  other dims are REPL; scalars take no factors."""
  b = FactorBuilder()
  common = [(b.new(n),) if n > 1 and k else None for n, k in zip(src, keep)]

  def tensor(shape):
    if len(shape) == 0:
      return []
    if len(shape) != len(src):
      raise Unsupported(f"{op.name} with operands of different ranks")
    return [common[d] if common[d] is not None and shape[d] == src[d] else
            ((b.new(shape[d], REPL),) if shape[d] > 1 else ()) for d in range(len(shape))]

  return b.build([tensor(program.values[v].shape) for v in op.inputs],
                 [tensor(program.values[v].shape) for v in op.outputs])


def _along_axis(param):
  def rule(op, program):
    src = program.values[op.inputs[0]].shape
    axes = op.params[param]
    axes = {a % len(src) for a in (axes if isinstance(axes, (tuple, list)) else (axes,))}
    return _shared_except(op, program, src, [d not in axes for d in range(len(src))])
  return rule


factor_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")(_along_axis("axis"))
factor_rule("sort")(_along_axis("dimension"))


@factor_rule("top_k")
def top_k(op, program):
  src = program.values[op.inputs[0]].shape
  return _shared_except(op, program, src, [d < len(src) - 1 for d in range(len(src))])


@factor_rule("reduce_window_sum", "reduce_window_max", "reduce_window_min",
             "select_and_scatter_add", "select_and_gather_add")
def windowed(op, program):
  """Window ops (pooling and its gradient) partition only along trivial window dimensions."""
  src = program.values[op.inputs[0]].shape
  n = len(src)
  dims, strides = op.params["window_dimensions"], op.params["window_strides"]
  pads = op.params.get("padding") or ((0, 0),) * n
  base = op.params.get("base_dilation") or (1,) * n
  win = op.params.get("window_dilation") or (1,) * n
  trivial = [w == 1 and s == 1 and tuple(p) == (0, 0) and bd == 1 and wd == 1
             for w, s, p, bd, wd in zip(dims, strides, pads, base, win)]
  return _shared_except(op, program, src, trivial)
