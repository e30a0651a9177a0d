"""The partitioning IR: SSA values with shapes, primitive ops in program order, named inputs.

It is a flat view of a jaxpr: nested calls are inlined by `tracing.trace`; a `scan` kept as a
loop is a region of the flat op list (`Region`): its body's ops appear once, between a
`scan_enter` and a `scan_exit` op, so every analysis sees through the body as it sees through
straight-line code. Other region ops (`while`, `cond`) keep their bodies in `Op.params`. Ops hold
the original primitive and parameters, so the IR can always be evaluated and re-emitted as JAX.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import re
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from partitioner.errors import PatternError


def _marker(name: str):
  from partitioner.compat import Primitive
  p = Primitive(name)
  p.multiple_results = True
  return p


# The two ends of a loop region. `scan_enter` reads the initial carries and the stacked inputs
# (`xs`) and makes the carries of one iteration and one slice of each stacked input;
# `scan_exit` reads the carries and per-iteration outputs the body makes, then the carries
# `scan_enter` made (so the carry has one layout all around the loop), and makes the final
# carries and the stacked outputs (`ys`). Both carry params {region, length, reverse,
# num_carry}; neither is ever bound: evaluation and the lowerings run the region as a
# `lax.scan`.
SCAN_ENTER = _marker("scan_enter")
SCAN_EXIT = _marker("scan_exit")


class Region(NamedTuple):
  """A loop: ops enter+1 .. exit-1 are its body, run `length` times."""
  enter: int
  exit: int
  length: int
  reverse: bool
  num_carry: int
  parent: int     # the enclosing region (-1: none)


class Value:
  """A tensor: shape, dtype, a name for inputs and outputs, its producer, or constant data."""

  __slots__ = ("id", "shape", "dtype", "name", "producer", "const")

  def __init__(self, id: int, shape: tuple[int, ...], dtype, name: str | None = None,
               producer: int | None = None, const: Any = None):
    self.id = id
    self.shape = tuple(int(d) for d in shape)
    self.dtype = np.dtype(dtype)
    self.name = name
    self.producer = producer
    self.const = const

  @property
  def rank(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize

  @property
  def is_const(self) -> bool:
    return self.const is not None

  def __repr__(self) -> str:
    return f"Value(%{self.id}, {self.dtype.name}{list(self.shape)}, {self.name!r})"


class Op:
  """One primitive application: `outputs = primitive.bind(*inputs, **params)`."""

  __slots__ = ("index", "primitive", "inputs", "outputs", "params", "name_stack")

  def __init__(self, index: int, primitive, inputs: tuple[int, ...], outputs: tuple[int, ...],
               params: dict, name_stack=None):
    self.index = index
    self.primitive = primitive
    self.inputs = inputs
    self.outputs = outputs
    self.params = params
    self.name_stack = name_stack

  @property
  def name(self) -> str:
    return self.primitive.name

  @property
  def scope(self) -> str:
    return str(self.name_stack) if self.name_stack is not None else ""

  def __repr__(self) -> str:
    return f"Op#{self.index}({self.name}, in={list(self.inputs)}, out={list(self.outputs)})"


def _glob_regex(pattern: str) -> re.Pattern:
  """`*` matches within one path segment, `**` across segments, `?` one character."""
  out, i = [], 0
  while i < len(pattern):
    if pattern.startswith("**", i):
      out.append(".*")
      i += 2
      if i < len(pattern) and pattern[i] == "/":
        out[-1] = "(?:.*/)?"
        i += 1
    elif pattern[i] == "*":
      out.append("[^/]*")
      i += 1
    elif pattern[i] == "?":
      out.append("[^/]")
      i += 1
    else:
      out.append(re.escape(pattern[i]))
      i += 1
  return re.compile("".join(out) + r"\Z")


def per_program(fn):
  """Memoises `fn(program, *args)` on the program itself: what is derived from a program lives
  and dies with it, where a process-wide cache would keep programs alive."""
  name = fn.__qualname__

  @functools.wraps(fn)
  def memoised(program: "Program", *args):
    key = (name, *args)
    derived = program.derived
    if key not in derived:
      derived[key] = fn(program, *args)
    return derived[key]

  return memoised


class Program:
  """A traced function: values, ops in program order, named inputs and outputs."""

  def __init__(self, values: list[Value], ops: list[Op], inputs: Sequence[int],
               input_names: Sequence[str], outputs: Sequence[int], output_names: Sequence[str],
               in_tree, out_tree, arg_names: Sequence[str], aliases: dict[int, int],
               static: dict[int, Any] | None = None):
    self.values = values
    self.ops = ops
    self.inputs = tuple(inputs)
    self.input_names = tuple(input_names)
    self.outputs = tuple(outputs)
    self.output_names = tuple(output_names)
    self.in_tree = in_tree
    self.out_tree = out_tree
    self.arg_names = tuple(arg_names)
    self.aliases = dict(aliases)  # output position -> input position (the updated state).
    self.static = dict(static or {})  # argument leaf position -> a constant of the trace
    self.loops: tuple[dict, ...] = ()  # the scans tracing met, unrolled or kept (`trace`)
    self.source: tuple | None = None   # (function, loops) it was traced from (`tracing.retrace`)
    self.original: "Program | None" = None   # the program a rewrite made this one from
    self.microbatches = 1              # into how many micro-batches a step's batch is cut
    self.stages = 1                    # into how many pipeline stages its layers are cut
    self.head_multiple = 1             # its attention heads padded to divide by this
    self.recomputation = None          # where `remat.remat` cut it (`remat.Recomputation`)
    self.stage_values: tuple = ()      # (value, dim) a pipeline's stage axis splits
    self.handed: tuple = ()            # (value, feature dim) of what crosses its stages
    # Input / output position -> how the program holds it, where not as the user does
    # (`layouts.Interleaved`, `layouts.Padded`): `store_inputs` and `load_outputs` convert.
    self.layouts: dict[int, Any] = {}
    self.output_layouts: dict[int, Any] = {}
    self._input_pos = {v: i for i, v in enumerate(self.inputs)}
    self._output_pos: dict[int, int] = {}
    for i, v in enumerate(self.outputs):
      self._output_pos.setdefault(v, i)
    self._by_name: dict[str, int] = {}
    for v, n in zip(self.outputs, self.output_names):
      self._by_name.setdefault(n, v)
    for v, n in zip(self.inputs, self.input_names):
      self._by_name[n] = v
    self._matches: dict[str, tuple[int, ...]] = {}   # pattern -> its inputs and outputs
    self.derived: dict = {}   # what `per_program` functions computed from this program

  # ----------------------------------------------------------------------------- structure
  @functools.cached_property
  def users(self) -> list[tuple[int, ...]]:
    """For each value, the indices of the ops that read it (in program order, no repeats)."""
    users: list[list[int]] = [[] for _ in self.values]
    for op in self.ops:
      for v in op.inputs:
        u = users[v]
        if not u or u[-1] != op.index:
          u.append(op.index)
    return [tuple(u) for u in users]

  @functools.cached_property
  def aliased(self) -> dict[int, tuple[int, ...]]:
    """Input value -> the output values that are its updated version."""
    out: dict[int, list[int]] = {}
    for o, i in sorted(self.aliases.items()):
      out.setdefault(self.inputs[i], []).append(self.outputs[o])
    return {k: tuple(v) for k, v in out.items()}

  @functools.cached_property
  def regions(self) -> tuple[Region, ...]:
    """The loop regions, in the order they begin."""
    found, open_, by_id = [], [], {}
    for op in self.ops:
      if op.primitive is SCAN_ENTER:
        by_id[op.params["region"]] = len(found)
        found.append([op.index, -1, op.params["length"], op.params["reverse"],
                      op.params["num_carry"], open_[-1] if open_ else -1])
        open_.append(len(found) - 1)
      elif op.primitive is SCAN_EXIT:
        r = by_id[op.params["region"]]
        if not open_ or open_[-1] != r:
          raise AssertionError(f"loop regions do not nest at op {op.index}")
        open_.pop()
        found[r][1] = op.index
    return tuple(Region(*r) for r in found)

  @functools.cached_property
  def region_starts(self) -> dict[int, int]:
    """Enter op -> its region."""
    return {r.enter: k for k, r in enumerate(self.regions)}

  @functools.cached_property
  def region_of(self) -> np.ndarray:
    """Per op: the innermost region whose body holds it (-1: none; a region's enter and exit
    ops belong to the enclosing one)."""
    out = np.full(len(self.ops), -1, np.int64)
    for r, region in enumerate(self.regions):   # outer regions first, inner ones overwrite
      out[region.enter + 1:region.exit] = r
    return out

  @functools.cached_property
  def op_repeat(self) -> np.ndarray:
    """Per op: how many times one step runs it (the product of its loops' lengths)."""
    out = np.ones(len(self.ops))
    for region in self.regions:
      out[region.enter + 1:region.exit] *= region.length
    return out

  def hoist(self, op_index: int, producer: int | None) -> tuple[int, int]:
    """Where something op `op_index` reads, made by `producer` (None: an input or a constant),
    can be made ready once and until when it must stay: (the enter op, the exit op) of the
    outermost loop that holds the reader but not the producer (the body reads it in every
    iteration), or (op_index, op_index). A loop's enter op makes values of its body."""
    r, first, last = int(self.region_of[op_index]), op_index, op_index
    while r >= 0:
      region = self.regions[r]
      if producer is not None and region.enter <= producer < region.exit:
        break
      first, last, r = region.enter, region.exit, region.parent
    return first, last

  def input_position(self, vid: int) -> int | None:
    return self._input_pos.get(vid)

  def output_position(self, vid: int) -> int | None:
    return self._output_pos.get(vid)

  def name(self, vid: int) -> str:
    """The value's name: its input or output path, or `%id` with its producer and scope."""
    v = self.values[vid]
    if v.name is not None:
      return v.name
    pos = self._output_pos.get(vid)
    if pos is not None:
      return self.output_names[pos]
    if v.is_const:
      return f"%{vid}(const)"
    op = self.ops[v.producer]
    scope = op.scope
    return f"%{vid}({op.name}{' in ' + scope if scope else ''})"

  def value(self, name_or_id: str | int) -> Value:
    """Looks a value up by input/output name or `%id`."""
    if isinstance(name_or_id, int):
      return self.values[name_or_id]
    vid = self._by_name.get(name_or_id)
    if vid is None and name_or_id.startswith("%") and name_or_id[1:].isdigit():
      vid = int(name_or_id[1:])
      if vid >= len(self.values):
        vid = None
    if vid is None:
      raise PatternError(f"no value named {name_or_id!r} in the program")
    return self.values[vid]

  def match(self, pattern: str, among: Iterable[int] | None = None) -> list[int]:
    """Value ids whose name matches a glob (`params/**/w`, `opt_state/*/mu/**`) or equals it."""
    if pattern.startswith("%") and pattern[1:].isdigit():
      return [self.value(pattern).id]
    if among is None:   # tactics match the same patterns again and again
      found = self._matches.get(pattern)
      if found is None:
        among = list(self.inputs) + [v for v in self.outputs if v not in self._input_pos]
        found = self._matches[pattern] = tuple(self.match(pattern, among))
      return list(found)
    rx = _glob_regex(pattern)
    return [v for v in among if rx.match(self.name(v))]

  @property
  def num_ops(self) -> int:
    return len(self.ops)

  def primitives(self) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in self.ops:
      counts[op.name] = counts.get(op.name, 0) + 1
    return counts

  # ----------------------------------------------------------------------------- evaluation
  def evaluate(self, *flat_inputs, on_result=None, bind_op=None):
    """Runs the program on flat input leaves and returns the flat outputs (un-partitioned).
    `on_result(value id, x)`, if given, may replace each op result (a sharding constraint);
    `bind_op(op, args)`, if given, runs ops in place of `bind` (a rewrite of one kind of op)."""
    env: list[Any] = [None] * len(self.values)
    for vid, x in zip(self.inputs, flat_inputs):
      env[vid] = x
    for v in self.values:
      if v.is_const:
        env[v.id] = v.const
    self.run(env, on_result=on_result, bind_op=bind_op)
    return [env[v] for v in self.outputs]

  def run(self, env: list, only=None, on_result=None, bind_op=None, span=None) -> None:
    """Runs ops in program order on `env` (value id -> array), writing their results there.
    `only`: the op indices to run (a loop runs whole when its enter op is among them);
    `span`: (first, end), the ops first .. end-1 (a loop's body: its enter op's index + 1 and
    its exit op's)."""
    bind_op = bind_op or (lambda op, args: bind(op, args, op.params))
    on_result = on_result or (lambda vid, x: x)

    def step(op):
      outs = bind_op(op, [env[i] for i in op.inputs])
      for vid, x in zip(op.outputs, outs):
        env[vid] = on_result(vid, x)

    def loop(k, lo, hi):
      enter, exit_ = self.ops[lo - 1], self.ops[hi]
      n = self.regions[k].num_carry

      def iteration(carries, slices):
        for vid, x in zip(enter.outputs, carries + slices):
          env[vid] = on_result(vid, x)
        walk(self, lo, hi, step, loop)
        read = [env[v] for v in exit_.inputs]
        return read[:n], read[n:len(read) - n]

      for vid, x in zip(exit_.outputs, run_loop(self, k, [env[v] for v in enter.inputs],
                                                iteration)):
        env[vid] = on_result(vid, x)

    if span is not None:
      walk(self, span[0], span[1], step, loop)
    elif only is None:
      walk(self, 0, len(self.ops), step, loop)
    else:   # a loop runs whole when its enter op is chosen
      walk(self, 0, len(self.ops), lambda op: op.index in only and step(op),
           lambda k, lo, hi: lo - 1 in only and loop(k, lo, hi))

  def __call__(self, *args):
    import jax
    return jax.tree_util.tree_unflatten(self.out_tree, self.evaluate(*self.flatten_args(args)))

  def flatten_args(self, args) -> list:
    """The input leaves of `args` (arguments shaped like the traced ones). Leaves that were
    constants when traced (Python numbers, strings) must be equal now: the program has them
    built in."""
    import jax
    from partitioner.compat import Tracer
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    if tree != self.in_tree:
      raise ValueError(f"arguments do not match the traced structure:\n{tree}\nvs\n{self.in_tree}")
    for i, traced in self.static.items():
      given = leaves[i]
      if isinstance(given, Tracer):
        continue  # under an outer jit: the traced constant is what runs
      try:
        same = bool(given is traced or given == traced)
      except Exception:
        same = False
      if not same:
        raise ValueError(f"argument leaf {i} was the constant {traced!r} when the program was "
                         f"traced, got {given!r}: pass an array to make it an input")
    return [x for i, x in enumerate(leaves) if i not in self.static]

  @property
  def root(self) -> "Program":
    """The user's program, before any rewrite."""
    program = self
    while program.original is not None:
      program = program.original
    return program

  def store_inputs(self, flat: Sequence) -> list:
    """The user's input leaves as this program holds them (once, as they go to devices);
    abstract ones (`jax.ShapeDtypeStruct`) take the shape they are held in."""
    if not self.layouts:
      return list(flat)
    import jax
    out = list(flat)
    for k, x in enumerate(out):
      if k in self.layouts and isinstance(x, jax.ShapeDtypeStruct):
        out[k] = jax.ShapeDtypeStruct(self.values[self.inputs[k]].shape, x.dtype)
    return _convert(out, {k: lay for k, lay in self.layouts.items()
                          if not isinstance(out[k], jax.ShapeDtypeStruct)}, "store")

  def load_outputs(self, flat: Sequence) -> list:
    """This program's output leaves as the user's program makes them."""
    return _convert(list(flat), self.output_layouts, "load") if self.output_layouts else list(flat)

  def __repr__(self) -> str:
    return (f"Program({len(self.ops)} ops, {len(self.inputs)} inputs, {len(self.outputs)} outputs)")


def walk(program: Program, lo: int, hi: int, step, loop) -> None:
  """Runs ops lo .. hi-1 in order: `step(op)` for an op, `loop(k, first, exit)` for loop region
  k, which begins in the range (`first`: its body's first op; `exit`: its exit op)."""
  starts = program.region_starts
  i = lo
  while i < hi:
    k = starts.get(i)
    if k is None:
      step(program.ops[i])
      i += 1
    else:
      region = program.regions[k]
      loop(k, region.enter + 1, region.exit)
      i = region.exit + 1


def _convert(flat: list, layouts: dict, method: str) -> list:
  """`flat` with the leaves at `layouts`' positions converted (`store` or `load`): in one
  computation, so that sharded leaves' conversions, which move data between devices, run as
  one program rather than as many small ones in flight at once (which XLA's CPU collectives can
  interleave into a deadlock); inline while tracing."""
  from partitioner.compat import Tracer
  ks = sorted(layouts)
  if any(isinstance(flat[k], Tracer) for k in ks):
    converted = [getattr(layouts[k], method)(flat[k]) for k in ks]
  else:
    converted = _converter(method, tuple(layouts[k] for k in ks))(*[flat[k] for k in ks])
  for k, x in zip(ks, converted):
    flat[k] = x
  return flat


@functools.lru_cache(maxsize=64)
def _converter(method: str, layouts: tuple):
  import jax
  return jax.jit(lambda *xs: [getattr(lay, method)(x) for lay, x in zip(layouts, xs)])


def run_loop(program: Program, k: int, operands: list, iteration) -> list:
  """Region k as a `lax.scan`, from the local values of its enter op's operands (initial
  carries, stacked inputs): `iteration(carries, slices)` runs the body once and returns the
  next carries and this iteration's outputs. Returns the final carries, then the stacked
  outputs: what the exit op makes."""
  from jax import lax
  region = program.regions[k]
  enter = program.ops[region.enter]
  dtypes = [program.values[v].dtype for v in enter.outputs[:region.num_carry]]
  cast = lambda xs: [lax.convert_element_type(x, d) for x, d in zip(xs, dtypes)]

  def step(carry, xs):
    carry, ys = iteration(list(carry), list(xs))
    return cast(carry), list(ys)

  n = region.num_carry
  final, ys = lax.scan(step, cast(operands[:n]), list(operands[n:]), length=region.length,
                       reverse=region.reverse)
  return list(final) + list(ys)


# A rewrite every bound op's arguments and parameters pass through first (`rewriting_binds`).
_BIND_REWRITE: contextvars.ContextVar = contextvars.ContextVar("bind_rewrite", default=None)


@contextlib.contextmanager
def rewriting_binds(rewrite):
  """While inside, every op bound through `bind` (by `Program.evaluate`, either lowering, the
  local rules) passes `rewrite(op, args, params) -> (args, params)` first: how `verify` runs
  the lowerings in float64. It acts while a function is traced, not when it is compiled."""
  token = _BIND_REWRITE.set(rewrite)
  try:
    yield
  finally:
    _BIND_REWRITE.reset(token)


def bind(op: Op, args: list, params: dict) -> list:
  """Applies an op's primitive to arguments, always returning a list of results."""
  from partitioner import compat
  rewrite = _BIND_REWRITE.get()
  if rewrite is not None:
    args, params = rewrite(op, args, params)
  out = compat.bind(op.primitive, args, params)
  return list(out) if op.primitive.multiple_results else [out]
