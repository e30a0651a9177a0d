"""From a JAX function to the partitioning IR.

`jax.make_jaxpr` does the tracing; this module flattens it: nested `pjit`, `closed_call`,
`custom_jvp_call`, `custom_vjp_call`, `checkpoint`/`remat` are inlined (their bodies are what
runs), literals and closed-over constants become constant values, and inputs are named by
their pytree paths under the function's parameter names (`params/layer_0/mlp/w_in`).

A `scan` is either unrolled (each iteration becomes ordinary ops, so a short loop partitions
like straight-line code) or kept as a loop region: a `scan_enter` op, the body's ops once, and a
`scan_exit` op (see `ir.Region`). `loops="auto"` unrolls loops of at most `UNROLL_LENGTH`
iterations (and `UNROLL_LIMIT` equations once unrolled) and keeps the rest; `trace` records
what it did with each in `Program.loops`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util

from partitioner import compat as core
from partitioner.errors import WorkloadError
from partitioner.ir import SCAN_ENTER, SCAN_EXIT, Op, Program, Value

# Call-like primitives whose body is inlined, with the parameter holding the body.
_INLINE = {
    "pjit": ("jaxpr",),
    "jit": ("jaxpr",),        # pjit as current JAX names it
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
    "checkpoint": ("jaxpr",),
    "remat": ("jaxpr",),
    "remat2": ("jaxpr",),
    "named_call": ("call_jaxpr",),
}

# Checkpoint primitives (`jax.checkpoint`/`remat` by the names JAX versions give them).
_REMAT = frozenset({"checkpoint", "remat", "remat2"})

# `jax.random` primitives on typed keys (`Builder.emit_key_op`).
_KEY_OPS = frozenset({"random_wrap", "random_unwrap", "random_bits", "random_split",
                      "random_fold_in", "random_seed"})


def _is_key(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# Under loops="auto", scans of at most this many iterations, and this many equations once
# unrolled (length x body), are unrolled; the others are kept as loops.
UNROLL_LENGTH = 4
UNROLL_LIMIT = 50_000
LOOP_MODES = ("auto", "unroll", "keep")


def key_name(key) -> str:
  if isinstance(key, tree_util.DictKey):
    return str(key.key)
  if isinstance(key, tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, tree_util.GetAttrKey):
    return key.name
  if isinstance(key, tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def path_name(path) -> str:
  return "/".join(key_name(k) for k in path)


def argument_names(fn: Callable, nargs: int) -> list[str]:
  """The positional parameter names of `fn` (`params`, `opt_state`, `batch`), else `argN`."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return [f"arg{i}" for i in range(nargs)]
  names = []
  for p in sig.parameters.values():
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      names.append(p.name)
    elif p.kind == p.VAR_POSITIONAL:
      names.extend(f"{p.name}{i}" for i in range(nargs - len(names)))
      break
  names += [f"arg{i}" for i in range(len(names), nargs)]
  return names[:nargs]


class _Builder:
  """Accumulates values and ops while walking (and inlining) a jaxpr."""

  def __init__(self, loops: str = "auto"):
    self.values: list[Value] = []
    self.ops: list[Op] = []
    self.effectful: set[int] = set()
    self.loops: list[dict] = []   # every scan met: its length, body size and what was done
    self.mode = loops
    self.regions = 0              # loop regions emitted so far

  def unroll(self, length: int, body_eqns: int) -> bool:
    if self.mode != "auto":
      return self.mode == "unroll"
    return length <= UNROLL_LENGTH and length * body_eqns <= UNROLL_LIMIT

  def add_op(self, primitive, ins, out_avals, params, name_stack=None) -> tuple[int, ...]:
    index = len(self.ops)
    outs = tuple(self.new_value(a, producer=index) for a in out_avals)
    self.ops.append(Op(index, primitive, tuple(ins), outs, params, name_stack))
    return outs

  def emit_loop(self, eqn, ins: list[int]) -> list[int]:
    """A scan kept as a loop: `scan_enter` (carries in, stacked inputs sliced), the body once,
    `scan_exit` (carries out, per-iteration outputs stacked; it also reads the carries in, so
    a carry has one layout around the loop)."""
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], int(p["length"])
    consts, init, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    params = {"region": self.regions, "length": length, "reverse": bool(p["reverse"]),
              "num_carry": n_carry}
    self.regions += 1
    vals = self.values
    slices = [core.ShapedArray(vals[x].shape[1:], vals[x].dtype) for x in xs]
    entered_at = len(self.ops)
    entered = self.add_op(SCAN_ENTER, init + xs,
                          [core.ShapedArray(vals[c].shape, vals[c].dtype) for c in init] + slices,
                          params, eqn.source_info.name_stack)
    carry_in = list(entered[:n_carry])
    body = p["jaxpr"]
    outs = self.emit(body.jaxpr, body.consts, consts + carry_in + list(entered[n_carry:]))
    carry_out, ys = outs[:n_carry], outs[n_carry:]
    out_avals = [core.ShapedArray(vals[c].shape, vals[c].dtype) for c in carry_in] + [
        core.ShapedArray((length,) + vals[y].shape, vals[y].dtype) for y in ys]
    if any(i > entered_at for i in self.effectful):   # a body with effects runs whatever
      self.effectful.add(len(self.ops))               # uses its results
    return list(self.add_op(SCAN_EXIT, carry_out + ys + carry_in, out_avals, params,
                            eqn.source_info.name_stack))

  def eliminate_dead_code(self, outputs: Sequence[int]) -> None:
    """Drops ops whose results nothing uses (the primal of a `jax.grad`, say); ops with
    effects stay. Renumbers the ops that remain."""
    live = set(outputs)
    keep, loops = [], set()   # loops whose exit is kept keep their enter
    for op in reversed(self.ops):
      region = op.params.get("region") if op.primitive in (SCAN_ENTER, SCAN_EXIT) else None
      if (op.index in self.effectful or any(v in live for v in op.outputs) or
          (op.primitive is SCAN_ENTER and region in loops)):
        keep.append(op)
        live.update(op.inputs)
        if op.primitive is SCAN_EXIT:
          loops.add(region)
    keep.reverse()
    kept = {id(op) for op in keep}
    for op in self.ops:
      if id(op) not in kept:
        for v in op.outputs:  # orphaned: nothing refers to these values any more.
          self.values[v].producer = None
    for new_index, op in enumerate(keep):
      op.index = new_index
      for v in op.outputs:
        self.values[v].producer = new_index
    self.ops = keep

  def emit_key_op(self, eqn, ins: list[int]) -> list[int]:
    """A `jax.random` primitive on typed keys, emitted as threefry on the keys' raw uint32
    data (`jax.random.key_data`), which is what typed keys are in the IR."""
    impl = core.threefry
    name, p = eqn.primitive.name, eqn.params
    if "impl" in p and getattr(p["impl"], "name", None) != impl.name:
      raise WorkloadError(f"{name} with the {getattr(p['impl'], 'name', p['impl'])} PRNG: only "
                          "threefry keys (JAX's default) are supported")
    if name in ("random_wrap", "random_unwrap"):
      return [ins[0]]
    vals = [self.values[i] for i in ins]
    keys = len(vals[0].shape) - (0 if name == "random_seed" else len(impl.key_shape))
    fn = {"random_bits": lambda k: impl.random_bits(k, p["bit_width"], p["shape"]),
          "random_split": lambda k: impl.split(k, p["shape"]),
          "random_fold_in": impl.fold_in,
          "random_seed": impl.seed}[name]
    for _ in range(keys):   # an array of keys: each key on its own
      fn = jax.vmap(fn, in_axes=[0 if len(v.shape) > keys - 1 else None for v in vals])
    closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in vals))
    return self.emit(closed.jaxpr, closed.consts, ins)

  def barrier(self, ins: list[int], name_stack) -> list[int]:
    """`ins` through one `optimization_barrier`, as JAX lowers a differentiated `checkpoint`:
    the recomputation in the backward pass then reads values XLA cannot prove equal to the
    forward pass's, so its CSE does not merge the two and keep every activation alive (the
    rematerialisation the user asked for is kept). Constants pass around it."""
    through = [i for i in ins if not self.values[i].is_const]
    if not through:
      return ins
    index = len(self.ops)
    outs = tuple(self.new_value(self.values[i], producer=index) for i in through)
    self.ops.append(Op(index, core.optimization_barrier_p(), tuple(through), outs, {},
                       name_stack))
    renamed = dict(zip(through, outs))
    return [renamed.get(i, i) for i in ins]

  def new_value(self, aval, name=None, producer=None, const=None) -> int:
    vid = len(self.values)
    self.values.append(Value(vid, aval.shape, aval.dtype, name, producer, const))
    return vid

  def const(self, x) -> int:
    aval = core.get_aval(x)
    return self.new_value(aval, const=x)

  def emit(self, jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[int]) -> list[int]:
    env: dict[core.Var, int] = {}
    for var, c in zip(jaxpr.constvars, consts):
      env[var] = self.const(c)
    for var, vid in zip(jaxpr.invars, args):
      env[var] = vid

    def read(atom) -> int:
      if isinstance(atom, core.Literal):
        return self.const(core.literal(atom.val))
      return env[atom]

    for eqn in jaxpr.eqns:
      ins = [read(a) for a in eqn.invars]
      name = eqn.primitive.name
      if name in _KEY_OPS:
        for var, vid in zip(eqn.outvars, self.emit_key_op(eqn, ins)):
          if not isinstance(var, core.DropVar):
            env[var] = vid
        continue
      if name not in _INLINE and any(_is_key(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        raise WorkloadError(f"{name} of a typed PRNG key is not supported: keep keys as raw "
                            "uint32 data (jax.random.key_data) outside jax.random's calls")
      body_keys = _INLINE.get(name)
      body = None
      if body_keys is not None:
        for key in body_keys:
          if key in eqn.params:
            body = eqn.params[key]
            break
      if name in _DECOMPOSED or _batched_indexing(eqn):
        body = (_DECOMPOSED.get(name) or _unbatched_indexing)(eqn)
      if name == "scan":
        body_eqns = _count_eqns(eqn.params["jaxpr"].jaxpr)
        unroll = self.unroll(int(eqn.params["length"]), body_eqns)
        self.loops.append({"length": int(eqn.params["length"]), "body_eqns": body_eqns,
                           "unrolled": unroll})
        if unroll:
          body = _unrolled_scan(eqn)
        else:
          for var, vid in zip(eqn.outvars, self.emit_loop(eqn, ins)):
            if not isinstance(var, core.DropVar):
              env[var] = vid
          continue
      if body is not None:
        if name in _REMAT and eqn.params.get("prevent_cse") and eqn.params.get("differentiated"):
          ins = self.barrier(ins, eqn.source_info.name_stack)
        if isinstance(body, core.ClosedJaxpr):
          outs = self.emit(body.jaxpr, body.consts, ins)
        else:
          outs = self.emit(body, (), ins)
        for var, vid in zip(eqn.outvars, outs):
          if not isinstance(var, core.DropVar):
            env[var] = vid
        continue
      index = len(self.ops)
      outs = tuple(self.new_value(v.aval, producer=index) for v in eqn.outvars)
      self.ops.append(Op(index, eqn.primitive, tuple(ins), outs, dict(eqn.params),
                         eqn.source_info.name_stack))
      if eqn.effects:
        self.effectful.add(index)
      for var, vid in zip(eqn.outvars, outs):
        if not isinstance(var, core.DropVar):
          env[var] = vid
    return [read(a) for a in jaxpr.outvars]


def _count_eqns(jaxpr: core.Jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    if eqn.primitive.name == "scan":
      n += eqn.params["length"] * _count_eqns(eqn.params["jaxpr"].jaxpr)
    else:
      n += sum(_count_eqns(j.jaxpr if isinstance(j, core.ClosedJaxpr) else j)
               for j in eqn.params.values() if isinstance(j, (core.Jaxpr, core.ClosedJaxpr)))
  return n


def _unrolled_scan(eqn) -> core.ClosedJaxpr:
  """The scan as straight-line code: the body once per step, `xs` sliced, `ys` stacked."""
  p = eqn.params
  body, length = p["jaxpr"], p["length"]
  n_consts, n_carry = p["num_consts"], p["num_carry"]

  def unrolled(*args):
    consts, carry = args[:n_consts], list(args[n_consts:n_consts + n_carry])
    xs = args[n_consts + n_carry:]
    ys = [None] * length
    for i in (reversed(range(length)) if p["reverse"] else range(length)):
      out = core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *(x[i] for x in xs))
      carry, ys[i] = out[:n_carry], out[n_carry:]
    n_ys = len(body.jaxpr.outvars) - n_carry
    stacked = [jax.numpy.stack([y[j] for y in ys]) for j in range(n_ys)]
    return (*carry, *stacked)

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
  return jax.make_jaxpr(unrolled)(*avals)


def _stack(eqn) -> core.ClosedJaxpr:
  axis = eqn.params["axis"]
  return _as_jaxpr(eqn, lambda *xs: jax.lax.concatenate(
      [jax.lax.expand_dims(x, (axis,)) for x in xs], axis))


def _split(eqn) -> core.ClosedJaxpr:
  axis, sizes = eqn.params["axis"], [int(n) for n in eqn.params["sizes"]]
  starts = np.cumsum([0] + sizes)
  return _as_jaxpr(eqn, lambda x: [jax.lax.slice_in_dim(x, int(a), int(a) + n, axis=axis)
                                   for a, n in zip(starts, sizes)])


def _as_jaxpr(eqn, fn) -> core.ClosedJaxpr:
  return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                              for v in eqn.invars))


def _batched_indexing(eqn) -> bool:
  """A gather or scatter with batching dimensions (which JAX 0.4 never emits)."""
  name = eqn.primitive.name
  return (name == "gather" or name.startswith("scatter")) and bool(
      getattr(eqn.params.get("dimension_numbers"), "operand_batching_dims", ()))


def _unbatched_indexing(eqn) -> core.ClosedJaxpr:
  """A gather or scatter with batching dimensions (how current JAX writes `take_along_axis`)
  as JAX 0.4 wrote it: each batching dimension becomes an iota index component, looked up
  point-wise. The indexing rules read such iotas as parallel dimensions."""
  dn, params = eqn.params["dimension_numbers"], dict(eqn.params)
  operand_dims = tuple(dn.operand_batching_dims)
  if eqn.primitive.name == "gather":
    index_dims = tuple(dn.start_indices_batching_dims)
    params["dimension_numbers"] = dn._replace(
        collapsed_slice_dims=tuple(sorted(dn.collapsed_slice_dims + operand_dims)),
        start_index_map=operand_dims + tuple(dn.start_index_map),
        operand_batching_dims=(), start_indices_batching_dims=())
  else:
    index_dims = tuple(dn.scatter_indices_batching_dims)
    params["dimension_numbers"] = dn._replace(
        inserted_window_dims=tuple(sorted(dn.inserted_window_dims + operand_dims)),
        scatter_dims_to_operand_dims=operand_dims + tuple(dn.scatter_dims_to_operand_dims),
        operand_batching_dims=(), scatter_indices_batching_dims=())
  params["indices_are_sorted"] = False

  def unbatched(operand, indices, *rest):
    shape = indices.shape[:-1] + (1,)
    iotas = [jax.lax.broadcasted_iota(indices.dtype, shape, d) for d in index_dims]
    indices = jax.lax.concatenate(iotas + [indices], len(shape) - 1)
    return core.bind(eqn.primitive, (operand, indices, *rest), params)

  return _as_jaxpr(eqn, unbatched)


# Primitives current JAX added (`jnp.stack`, `jnp.split`) are traced as the ops JAX 0.4 emits
# for them, so the program, its rules and its cost are the same on both; so are gathers and
# scatters with batching dimensions (`_unbatched_indexing`).
_DECOMPOSED = {"stack": _stack, "split": _split}


def is_array(x) -> bool:
  """Whether a pytree leaf is data (an array or an abstract one) rather than a constant."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, core.Tracer))


def _signature(x) -> tuple | None:
  return (tuple(x.shape), np.dtype(x.dtype)) if is_array(x) else None


def _children(tree) -> list:
  """The pytree node's direct children in flattening order ([] for a leaf)."""
  children, _ = tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
  return [] if len(children) == 1 and children[0] is tree else children


def _find_aliases(args, out_shape, dynamic: list[int]) -> dict[int, int]:
  """Output leaves that are the updated version of an argument leaf: a piece of the result
  (the result itself, or recursively one of its children) with the same tree structure as an
  argument, leaf by leaf with the same shape and dtype. Leaves that were constants in the
  argument alias nothing."""
  input_of = {flat: k for k, flat in enumerate(dynamic)}   # flat leaf -> input position
  arg_leaves, offset = [], 0
  for a in args:
    leaves, treedef = tree_util.tree_flatten(a)
    arg_leaves.append((treedef, leaves, offset))
    offset += len(leaves)
  aliases, used = {}, set()

  def match(part, out_offset) -> int:
    leaves, treedef = tree_util.tree_flatten(part)
    for j, (atree, aleaves, aoffset) in enumerate(arg_leaves):
      if j in used or not leaves or atree != treedef:
        continue
      matched = {out_offset + k: input_of[aoffset + k]
                 for k, (a, o) in enumerate(zip(aleaves, leaves))
                 if aoffset + k in input_of and _signature(a) == _signature(o)}
      if matched:
        used.add(j)
        aliases.update(matched)
        return len(leaves)
    for child in _children(part):
      out_offset += match(child, out_offset)
    return len(leaves)

  match(out_shape, 0)
  return aliases


def trace(fn: Callable, *args, arg_names: Sequence[str] | None = None,
          loops: str = "auto", layouts: bool = True) -> Program:
  """Traces `fn(*args)` into a `Program`. Arguments are pytrees (dicts, NamedTuples,
  dataclasses, Flax `TrainState`s...); array leaves (or `jax.ShapeDtypeStruct`s) are the
  inputs, every other leaf (a Python number, a string, a callable) is a constant of the trace.
  `loops`: what becomes of `scan`s ("auto", "unroll" or "keep"; see the module docstring).
  A function that fails to trace raises `WorkloadError` naming the cause. `layouts`: fused
  projections are held interleaved and vocabularies padded, so that they split
  (`layouts.hold_in_layouts`)."""
  if loops not in LOOP_MODES:
    raise ValueError(f"loops must be one of {', '.join(LOOP_MODES)}, got {loops!r}")
  names = list(arg_names) if arg_names is not None else argument_names(fn, len(args))
  leaves_with_paths, in_tree = tree_util.tree_flatten_with_path(tuple(args))
  leaves = [x for _, x in leaves_with_paths]
  dynamic = [i for i, x in enumerate(leaves) if is_array(x)]
  static = {i: x for i, x in enumerate(leaves) if not is_array(x)}
  for i in dynamic:
    if _is_key(leaves[i]):
      path = leaves_with_paths[i][0]
      where = names[path[0].idx] + ("/" + path_name(path[1:]) if path[1:] else "")
      raise WorkloadError(f"argument {where} is a typed PRNG key: pass its raw data, "
                          "jax.random.key_data(key)")

  def flat_fn(*inputs):
    full = list(leaves)
    for i, x in zip(dynamic, inputs):
      full[i] = x
    return fn(*tree_util.tree_unflatten(in_tree, full))

  try:
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*(leaves[i] for i in dynamic))
  except Exception as e:  # the user's function: one line, the cause kept for debugging
    raise WorkloadError(f"tracing {getattr(fn, '__name__', 'the function')} failed: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
  input_names = []
  for i in dynamic:
    path = leaves_with_paths[i][0]
    top, rest = path[0], path[1:]
    arg = names[top.idx]
    input_names.append(arg + ("/" + path_name(rest) if rest else ""))

  builder = _Builder(loops)
  jaxpr = closed.jaxpr
  inputs = [builder.new_value(v.aval, name=n) for v, n in zip(jaxpr.invars, input_names)]
  outputs = builder.emit(jaxpr, closed.consts, inputs)
  builder.eliminate_dead_code(outputs)

  out_paths, out_tree = tree_util.tree_flatten_with_path(out_shape)
  output_names = [("out/" + path_name(p)) if p else "out" for p, _ in out_paths]
  aliases = _find_aliases(args, out_shape, dynamic)
  program = Program(builder.values, builder.ops, inputs, input_names, outputs, output_names,
                    in_tree, out_tree, names, aliases, static)
  program.loops = tuple(builder.loops)
  program.source = (fn, loops)
  if layouts:
    from partitioner.layouts import hold_in_layouts
    traced = program
    program = hold_in_layouts(program, lambda f, shapes: trace(
        f, *abstract_args(traced, shapes), arg_names=names, loops="keep", layouts=False))
  return program


def abstract_args(program: Program, shapes: dict[int, tuple[int, ...]] | None = None) -> tuple:
  """Arguments shaped like the traced ones: abstract arrays (with `shapes`: input position ->
  a new shape) and the trace's constants."""
  leaves, inputs = [], iter(enumerate(program.inputs))
  for i in range(program.in_tree.num_leaves):
    if i in program.static:
      leaves.append(program.static[i])
      continue
    k, vid = next(inputs)
    v = program.values[vid]
    leaves.append(jax.ShapeDtypeStruct((shapes or {}).get(k, v.shape), v.dtype))
  return tree_util.tree_unflatten(program.in_tree, leaves)


def retrace(program: Program, shapes: dict[int, tuple[int, ...]]) -> Program:
  """The program's function traced again with some inputs reshaped (input position -> shape):
  the same step at another batch size."""
  if program.source is None:
    raise WorkloadError("this program was not traced from a function (partitioner.trace), so it "
                        "cannot be traced again at another shape")
  fn, loops = program.source
  # The function takes the user's arguments, whatever layouts the program holds them in.
  return trace(fn, *abstract_args(program.root, shapes), arg_names=program.arg_names,
               loops=loops)
