"""Values held in another layout than the user's, so that they split where the user's do not.

Two layouts, found from the dataflow when a step is traced:

- **Interleaved** fused projections. HF GPT-2's `c_attn` makes q, k and v with one matmul and
  slices its output columns into three chunks. Split over m devices, a block of those columns
  is a third of the chunks, not a share of every chunk's heads. Held interleaved (column
  `i*n + j` holds column `i` of chunk `j`), a block holds rows `i` of every chunk, and taking
  chunk `j` is a reshape to `(c, n)` and a slice of `n`, which shard like any other dimension.
  Megatron-LM permutes its fused `query_key_value` so when it converts a checkpoint.
- **Padded** vocabularies. An embedding table of 50,257 rows divides by no mesh axis. Held
  with zero rows up to a multiple of 128 (50,304), as Megatron-LM and GSPMD pad, it splits
  over axes of up to 128 devices (an untied output head likewise, by its columns); every op
  then computes the padding too (priced by the simulator like any other work) and keeps it out
  of the results: the padding is kept zero, and a maximum or minimum over it reads the
  identity there.

A third is chosen by a plan, not at tracing, as it costs work wherever the plan does not split
the heads: **padded heads** (`partitioner/heads.py`, the `HeadPadding` tactic): a padding of
the heads' factor (`Padded.unit`) that follows it through the reshapes that merge it with the
head width or split it off, and a fused projection's chunks each padded and then interleaved
(`Interleaved.padded`).

`hold_in_layouts` grows each layout from its seed (the sliced value, the table) to every value
indexed alike through the factor rules (the kernel, its bias, gradients, optimizer state,
logits), and traces the program again from a run of its ops that keeps those values so: ops
that index the dimension alike run unchanged, a fused chunk's slice, pad or concatenation
becomes a reshape and a slice, pad or stack, and any other op reads its operands in the user's
layout. The program's inputs and outputs among them are listed in `Program.layouts`:
`Program.store_inputs` converts the user's arrays once, when they are placed on devices, and
`Program.load_outputs` gives results back as the user's program would.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from partitioner.factors import MAX, MIN, REPL
from partitioner.ir import SCAN_ENTER, SCAN_EXIT, Program, bind
from partitioner.rules.elementwise import NARY, UNARY

_ALIKE = frozenset(UNARY) | frozenset(NARY) | frozenset("""
broadcast_in_dim dot_general reduce_sum reduce_max reduce_min transpose reshape squeeze
expand_dims slice concatenate dynamic_slice dynamic_update_slice""".split())
# Ops that index every dimension their factor rule passes through (or reduces) alike in all
# tensors, so that permuting it in all of them permutes the result the same way.
_PERMUTES = _ALIKE | {"pad", "rev"}
# Ops that compute the user's part of a padded dimension from the user's part only (point-wise
# lookups and writes address rows below the user's size; reductions see the padding).
_PADS = _ALIKE | {"pad", "gather", "scatter-add"}
# Ops whose result is zero where their padded operands are (f(0) = 0), given which operands
# are padded (`_keeps_zero`).
_ZERO_UNARY = frozenset("""neg sign floor ceil round sqrt cbrt abs real imag conj square copy
stop_gradient reduce_precision convert_element_type tanh sin tan sinh asin atan asinh atanh erf
erf_inv expm1 log1p""".split())

VOCAB_MULTIPLE = 128   # a padded table's rows: a multiple of this (Megatron-LM's default)
VOCAB_MIN = 1024       # smaller tables (token types, relative positions) are left alone


class Interleaved(NamedTuple):
  """Dimension `dim` of `chunks` equal chunks, held chunk-minor; with `padded` (0: none), of
  `size` held as `padded`, zeros after the user's part: each chunk padded at its end (by whole
  heads, `heads.pad_heads`) and then interleaved."""
  dim: int
  chunks: int
  size: int = 0
  padded: int = 0

  def _swap(self, x, first: int):
    import jax.numpy as jnp
    d, s = self.dim, x.shape
    y = jnp.reshape(x, s[:d] + (first, s[d] // first) + s[d + 1:])
    return jnp.reshape(jnp.swapaxes(y, d, d + 1), s)

  def store(self, x):
    x = self._swap(x, self.chunks)
    return Padded(self.dim, self.size, self.padded).store(x) if self.padded else x

  def load(self, x):
    if self.padded:
      x = Padded(self.dim, self.size, self.padded).load(x)
    return self._swap(x, x.shape[self.dim] // self.chunks)

  def __str__(self) -> str:
    pad = (f", padded from {self.size} to {self.padded} (by heads)" if self.padded else "")
    return f"dimension {self.dim} interleaved by its {self.chunks} chunks{pad}"


class Padded(NamedTuple):
  """Dimension `dim` of `size` held as `padded`, zeros after the user's part. `unit` (0: none):
  the padding is of the dimension's major factor, whose elements are `unit` wide, so it
  follows that factor through reshapes that merge it with minor ones or split them off
  (attention heads: a projection's columns padded by whole heads are the heads dimension
  padded once the columns are split into heads, whose `unit` is 1)."""
  dim: int
  size: int
  padded: int
  unit: int = 0

  def store(self, x):
    import jax.numpy as jnp
    pads = [(0, 0)] * x.ndim
    pads[self.dim] = (0, self.padded - self.size)
    return jnp.pad(x, pads)

  def load(self, x):
    from jax import lax
    return lax.slice_in_dim(x, 0, self.size, axis=self.dim)

  def valid(self, shape, dim: int):
    """True on the user's part of `dim` of an array of `shape`."""
    import jax.numpy as jnp
    from jax import lax
    return lax.broadcasted_iota(jnp.int32, shape, dim) < self.size

  def __str__(self) -> str:
    what = (f"{self.size // self.unit} heads to {self.padded // self.unit}" if self.unit else
            f"+{100 * (self.padded / self.size - 1):.2g}% of its work")
    return f"dimension {self.dim} padded from {self.size} to {self.padded} ({what})"


class StageChunks(NamedTuple):
  """Dimension `dim` (a layer stack's) of `chunks` x `stages` x c layers, held `stages` x
  `chunks` x c: an interleaved pipeline's stage s holds chunks s, s+S, ... of layers
  (`pipeline._held_by_stage`), and held so they are one block of the dimension."""
  dim: int
  stages: int
  chunks: int

  def _swap(self, x, first: int, second: int):
    import jax.numpy as jnp
    d, s = self.dim, x.shape
    y = jnp.reshape(x, s[:d] + (first, second, s[d] // (first * second)) + s[d + 1:])
    return jnp.reshape(jnp.swapaxes(y, d, d + 1), s)

  def store(self, x):
    return self._swap(x, self.chunks, self.stages)

  def load(self, x):
    return self._swap(x, self.stages, self.chunks)

  def __str__(self) -> str:
    return (f"dimension {self.dim} held by stage: {self.chunks} chunks of layers for each of "
            f"{self.stages} stages")


def hold_in_layouts(program: Program, trace) -> Program:
  """The program with its fused projections interleaved and its vocabularies padded; itself if
  it has neither. `trace(fn, shapes)`: `fn`, which takes the program's arguments, traced with
  the given inputs (position -> shape) reshaped (`tracing.trace` passes it)."""
  held = _held(program)
  if not held:
    return program
  try:
    return _rewrite(program, held, trace)
  except Exception as e:   # an optimisation: never the reason a step cannot be partitioned
    import warnings
    warnings.warn(f"partitioner.layouts: the step could not be traced with its fused projections "
                  f"or vocabularies held in layout ({type(e).__name__}: {e}); it keeps the "
                  f"user's layout", stacklevel=2)
    return program


def _held(program: Program) -> dict:
  """Value id -> its layout, for every value of each layout's class."""
  from partitioner.propagation import factor_table
  from partitioner.roles import roles
  table = factor_table(program)
  params = frozenset(roles(program).params)
  found: dict = {}
  seeds = [(v, d, Interleaved(d, n), _PERMUTES) for v, d, n in _fused(program)]
  seeds += [(v, d, Padded(d, n, math.ceil(n / VOCAB_MULTIPLE) * VOCAB_MULTIPLE), _PADS)
            for v, d, n in _tables(program)]
  for vid, dim, layout, ops in seeds:
    if vid in found:
      continue
    members = _grow(program, table, vid, layout._replace(dim=dim), ops)
    if (members is None or params.isdisjoint(members) or not _usable(program, members)
        or any(v in found for v in members)):
      continue
    found.update(members)
  return found


def _fused(program: Program):
  """(value, dim, chunks) for each float value whose dimension is sliced into two or more equal
  chunks (`jnp.split(qkv, 3, axis=-1)`)."""
  import jax.numpy as jnp
  for v in program.values:
    if v.producer is None or not jnp.issubdtype(v.dtype, jnp.floating):
      continue
    cuts: dict = {}
    for u in program.users[v.id]:
      op = program.ops[u]
      if op.name != "slice":
        continue
      starts, limits = op.params["start_indices"], op.params["limit_indices"]
      strides = op.params.get("strides") or (1,) * v.rank
      cut = [d for d in range(v.rank) if (starts[d], limits[d]) != (0, v.shape[d])]
      if len(cut) == 1 and strides[cut[0]] == 1:
        d = cut[0]
        cuts.setdefault(d, set()).add((starts[d], limits[d] - starts[d]))
    for d, pieces in cuts.items():
      sizes = {size for _, size in pieces}
      if len(sizes) != 1:
        continue
      size = sizes.pop()
      n = v.shape[d] // size
      if size > 1 and n >= 2 and n * size == v.shape[d] and all(s % size == 0 for s, _ in pieces):
        yield v.id, d, n


def _tables(program: Program):
  """(parameter, vocabulary dim, size) of embedding tables (the looked-up rows) and untied
  output heads (the classes a softmax normalises) whose vocabulary no axis of up to
  `VOCAB_MULTIPLE` devices divides."""
  from partitioner.roles import embedding_tables, output_heads
  for vid, dim in embedding_tables(program) + output_heads(program, 1):
    n = program.values[vid].shape[dim]
    if n >= VOCAB_MIN and n % VOCAB_MULTIPLE:
      yield vid, dim, n


def _factor_of(entry, vid: int, dim: int) -> tuple:
  for v, dfs in entry.tensors:
    if v == vid:
      return dfs[dim]
  return ()


def _linked(entry, op, vid: int, lay, ops) -> list[tuple[int, object]] | None:
  """The tensors an op among `ops` indexes like dimension `lay.dim` of `vid`, each with its
  layout, or None where it does not (another op, a dimension merged with others, one the op
  needs whole). A merged padding follows the dimension's major factor into every dimension
  that holds that factor first."""
  if op.name not in ops:
    return None
  fl = _factor_of(entry, vid, lay.dim)
  if not fl or entry.factors.kinds[fl[0]] == REPL:
    return None
  sizes = entry.factors.sizes
  minor = lambda t: math.prod(sizes[f] for f in t[1:])
  merged = isinstance(lay, Padded) and lay.unit > 0
  if merged:   # the major factor's padded size and its elements' width
    if (sizes[fl[0]] * minor(fl) != lay.size or lay.padded % minor(fl)
        or lay.unit % minor(fl)):
      return None
    major, width = lay.padded // minor(fl), lay.unit // minor(fl)
  elif len(fl) != 1:
    return None
  out = []
  for v, dfs in entry.tensors:
    for k, t in enumerate(dfs):
      if fl[0] not in t:
        continue
      if not merged:
        if len(t) != 1:
          return None
        out.append((v, lay._replace(dim=k)))
      elif t[0] != fl[0]:
        return None
      else:
        out.append((v, lay._replace(dim=k, size=sizes[fl[0]] * minor(t),
                                    padded=major * minor(t), unit=width * minor(t))))
  return out


def _grow(program: Program, table, seed: int, layout, ops) -> dict | None:
  """Every value indexed like the seed's dimension through `ops`, with its layout; None if a
  value would hold two such dimensions."""
  members, work = {seed: layout}, [seed]
  while work:
    vid = work.pop()
    for i in table.touching[vid]:
      for v, lay in _linked(table[i], program.ops[i], vid, members[vid], ops) or ():
        if v not in members:
          members[v] = lay
          work.append(v)
        elif members[v] != lay:
          return None
  return members


def _usable(program: Program, members: dict[int, int]) -> bool:
  """A class (worth holding where it holds a parameter: the kernel, the table) can be held if
  none of it crosses a loop's boundary or lives in a loop's body."""
  region_of = program.region_of
  for v in members:
    producer = program.values[v].producer
    for i in list(program.users[v]) + ([producer] if producer is not None else []):
      if program.ops[i].primitive in (SCAN_ENTER, SCAN_EXIT) or region_of[i] >= 0:
        return False
  return True


# --------------------------------------------------------------------------- the rewrite
def _rewrite(program: Program, held: dict, trace) -> Program:
  """The program traced again from a run of its ops that keeps `held`'s values in layout."""
  import jax
  from partitioner.propagation import factor_table
  table = factor_table(program)

  def alike(op) -> bool:
    entry = table[op.index]
    for v, _ in entry.tensors:
      lay = held.get(v)
      if lay is None:
        continue
      ops = (_PADS if isinstance(lay, Padded) else
             _PERMUTES & _PADS if lay.padded else _PERMUTES)
      linked = _linked(entry, op, v, lay, ops)
      if linked is None or any(held.get(u) != k for u, k in linked):
        return False
    return True

  def bind_op(op, args):
    lay_in = [held.get(v) for v in op.inputs]
    lay_out = [held.get(v) for v in op.outputs]
    if all(lay is None for lay in lay_in + lay_out):
      return bind(op, args, op.params)
    if alike(op):
      pad_in, pad_out = [_padding(lay) for lay in lay_in], [_padding(lay) for lay in lay_out]
      if not any(pad_in + pad_out):
        return bind(op, args, op.params)
      return _padded_op(program, table, op, args, pad_in, pad_out)
    out = _chunk_op(program, op, args, lay_in, lay_out)
    if out is not None:
      return out
    args = [x if lay is None else lay.load(x) for x, lay in zip(args, lay_in)]
    return [y if lay is None else lay.store(y)
            for y, lay in zip(bind(op, args, op.params), lay_out)]

  def step(*flat):
    env: list = [None] * len(program.values)
    for v in program.values:
      if v.is_const:
        env[v.id] = v.const if v.id not in held else held[v.id].store(v.const)
    for vid, x in zip(program.inputs, flat):
      env[vid] = x
    program.run(env, bind_op=bind_op)
    return [env[v] for v in program.outputs]

  def fn(*args):
    outs = step(*program.flatten_args(args))
    return jax.tree_util.tree_unflatten(program.out_tree, outs)

  shapes = {k: _held_shape(program.values[v].shape, held[v])
            for k, v in enumerate(program.inputs) if v in held}
  out = trace(fn, shapes)
  out.source, out.original, out.loops = program.source, program, program.loops
  out.layouts = {k: held[v] for k, v in enumerate(program.inputs) if v in held}
  out.output_layouts = {k: held[v] for k, v in enumerate(program.outputs) if v in held}
  return out


def _held_shape(shape, lay) -> tuple[int, ...]:
  pad = _padding(lay)
  if pad is not None:
    return shape[:pad.dim] + (pad.padded,) + shape[pad.dim + 1:]
  return tuple(shape)


def _padding(lay) -> Padded | None:
  """The padding a layout holds its dimension with, if any (a padded fused projection's too)."""
  if isinstance(lay, Padded):
    return lay
  if isinstance(lay, Interleaved) and lay.padded:
    return Padded(lay.dim, lay.size, lay.padded)
  return None


def _as_chunk(x, d: int, user: int, lay):
  """A chunk taken from a held fused value (`user` wide, held as wide as `x`) in `lay`, the
  chunk's own layout: its user's part, or padded as held; None where it is neither."""
  from jax import lax
  if lay is None:
    return x if x.shape[d] == user else lax.slice_in_dim(x, 0, user, axis=d)
  if isinstance(lay, Padded) and lay.size == user and lay.padded == x.shape[d]:
    return x
  return None


def _chunk_op(program: Program, op, args, lay_in, lay_out):
  """A chunk taken from an interleaved value (slice), or one placed in it (pad, concatenate),
  as a reshape to `(c, n)` and an op on the `n` dimension; None for anything else. A padded
  interleaved value's chunks are padded as it is (`c` is then the held chunk's width)."""
  import jax.numpy as jnp
  from jax import lax
  src = program.values[op.inputs[0]].shape
  dst = program.values[op.outputs[0]].shape
  if (op.name == "slice" and isinstance(lay_in[0], Interleaved)
      and not isinstance(lay_out[0], Interleaved)):
    d, n = lay_in[0].dim, lay_in[0].chunks
    c = src[d] // n
    starts, limits = op.params["start_indices"], op.params["limit_indices"]
    strides = op.params.get("strides") or (1,) * len(src)
    if (all((starts[k], limits[k]) == (0, src[k]) for k in range(len(src)) if k != d)
        and strides[d] == 1 and limits[d] - starts[d] == c and starts[d] % c == 0):
      held = args[0].shape
      x = jnp.reshape(args[0], held[:d] + (held[d] // n, n) + held[d + 1:])
      chunk = _as_chunk(lax.index_in_dim(x, starts[d] // c, axis=d + 1, keepdims=False), d, c,
                        lay_out[0])
      return None if chunk is None else [chunk]
  if op.name == "pad" and isinstance(lay_out[0], Interleaved) and not isinstance(
      lay_in[0], Interleaved):
    lay = lay_out[0]
    d, n = lay.dim, lay.chunks
    c = dst[d] // n
    config = [tuple(p) for p in op.params["padding_config"]]
    lo, hi, interior = config[d]
    if (src[d] == c and interior == 0 and lo % c == 0 and lo + c + hi == dst[d]
        and all(p == (0, 0, 0) for k, p in enumerate(config) if k != d)):
      x = _chunk_to(args[0], lay_in[0], lay)
      if x is None:
        return None
      x = jnp.expand_dims(x, d + 1)
      pads = [(0, 0, 0)] * x.ndim
      pads[d + 1] = (lo // c, hi // c, 0)
      return [jnp.reshape(lax.pad(x, args[1], pads), _held_shape(dst, lay))]
  if (op.name == "concatenate" and isinstance(lay_out[0], Interleaved)
      and op.params["dimension"] == lay_out[0].dim
      and not any(isinstance(lay, Interleaved) for lay in lay_in)):
    lay = lay_out[0]
    d, n = lay.dim, lay.chunks
    if len(args) == n and all(program.values[v].shape[d] == dst[d] // n for v in op.inputs):
      chunks = [_chunk_to(x, li, lay) for x, li in zip(args, lay_in)]
      if any(x is None for x in chunks):
        return None
      return [jnp.reshape(jnp.stack(chunks, axis=d + 1), _held_shape(dst, lay))]
  return None


def _chunk_to(x, lay, fused: Interleaved):
  """A chunk in layout `lay` (None or padded) as the chunks of `fused` are held."""
  if not fused.padded:
    return x if lay is None else None
  width = fused.padded // fused.chunks
  if lay is None:
    return Padded(fused.dim, x.shape[fused.dim], width).store(x)
  return x if isinstance(lay, Padded) and lay.padded == width else None


def _padded_op(program: Program, table, op, args, lay_in, lay_out) -> list:
  """An op that indexes padded dimensions alike, run on the padded values: a maximum or minimum
  over the padding reads the identity there, shapes in its parameters grow to the padded
  size, and a result whose padding is not zero by construction is masked to zero."""
  import jax.numpy as jnp
  entry = table[op.index]
  args = list(args)
  for k, lay in enumerate(lay_in):
    if isinstance(lay, Padded):
      fl = _factor_of(entry, op.inputs[k], lay.dim)
      kind = entry.factors.kinds[fl[0]]
      if kind in (MAX, MIN) and fl[0] not in _out_factors(entry, len(op.inputs)):
        x = args[k]
        args[k] = jnp.where(lay.valid(x.shape, lay.dim), x, _identity(x.dtype, kind))
  outs = bind(op, args, _padded_params(program, op, lay_in, lay_out))
  keeps = _keeps_zero(program, op, [isinstance(lay, Padded) for lay in lay_in])
  return [y if not isinstance(lay, Padded) or keeps else
          jnp.where(lay.valid(y.shape, lay.dim), y, jnp.zeros((), y.dtype))
          for y, lay in zip(outs, lay_out)]


def _out_factors(entry, num_operands: int) -> set:
  return {f for _, dfs in entry.tensors[num_operands:] for t in dfs for f in t}


def _identity(dtype, kind):
  import jax.numpy as jnp
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return jnp.asarray(kind == MIN)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.asarray(-np.inf if kind == MAX else np.inf, dtype)
  info = np.iinfo(dtype)
  return jnp.asarray(info.min if kind == MAX else info.max, dtype)


def _padded_params(program: Program, op, lay_in, lay_out) -> dict:
  """The op's parameters with the sizes they give padded dimensions grown to the padding: a
  result's shape, or the extent of an operand taken whole (its factor passes)."""
  params = dict(op.params)
  key = {"broadcast_in_dim": "shape", "reshape": "new_sizes"}.get(op.name)
  lay = lay_out[0] if lay_out else None
  if key is not None and isinstance(lay, Padded):
    sizes = list(params[key])
    sizes[lay.dim] = lay.padded
    params[key] = tuple(sizes)
  key = {"slice": "limit_indices", "dynamic_slice": "slice_sizes",
         "gather": "slice_sizes"}.get(op.name)
  lay = lay_in[0] if lay_in else None
  if key is not None and isinstance(lay, Padded):
    sizes = list(params[key])
    if sizes[lay.dim] == program.values[op.inputs[0]].shape[lay.dim]:
      sizes[lay.dim] = lay.padded
    params[key] = tuple(sizes)
  return params


def _keeps_zero(program: Program, op, padded: list[bool]) -> bool:
  """Whether the op's result is zero wherever its padded operands are zero."""
  name = op.name
  if name in _ZERO_UNARY or name in ("transpose", "reshape", "squeeze", "expand_dims",
                                     "slice", "dynamic_slice", "reduce_sum", "reduce_max",
                                     "reduce_min", "dot_general", "scatter-add"):
    return padded[0] or name == "dot_general" and any(padded)
  if name == "pad":
    return padded[0] and _is_zero(program, op.inputs[1])
  if name == "broadcast_in_dim":
    return padded[0] or _is_zero(program, op.inputs[0])
  if name in ("add", "sub", "add_any", "max", "min", "concatenate", "dynamic_update_slice"):
    n = 2 if name == "dynamic_update_slice" else len(op.inputs)   # then the start indices
    return all(p or _is_zero(program, v) for p, v in zip(padded[:n], op.inputs[:n]))
  if name == "select_n":
    return all(p or _is_zero(program, v) for p, v in zip(padded[1:], op.inputs[1:]))
  if name in ("mul", "and"):
    return any(padded)
  if name == "div":
    return padded[0] and not padded[1]
  if name == "integer_pow":
    return padded[0] and op.params["y"] > 0
  return False


def _is_zero(program: Program, vid: int) -> bool:
  v = program.values[vid]
  return v.is_const and not np.any(np.asarray(v.const))
