"""Micro-batches (gradient accumulation) as a rewrite of the program.

`microbatch(program, k)` cuts the step's batch into k micro-batches and runs the part of the
step that works per example once per micro-batch, in a `lax.scan`. What the step sums over
the batch (the loss, the gradients) is summed across iterations in the loop's carries; the
rest (the optimizer update) runs once, on the sums. The result is an ordinary program with one
more loop, so tactics, both lowerings and the cost model treat it as any scanned step:
activations are those of one micro-batch, what the loop reads from outside (parameters) is
made ready once, and a data-parallel gradient is reduced once, after the loop.

Which ops run per micro-batch is found from the dataflow. The program is partitioned over a
mesh of one axis of k devices with data parallelism: a micro-batch is data parallelism over
time. An op that reads the data and whose result is split on that axis, or partial over it,
runs per micro-batch. So does an op linear in such a partial sum: scaling the summed loss, or
casting a gradient. These ops are traced again at the micro-batch's size
(`tracing.retrace`), but keep the full step's constants: a mean over the batch still divides
by the whole batch.

A micro-batch takes every k-th example (rows i, i+k, i+2k...). Cutting a batch that is split
over devices along its leading dimension then moves no data. Outputs per example come back in
their order. A total of the data alone (the token count a loss is divided by) is computed from
the whole batch before the loop. A step that needs a statistic of the whole batch that depends
on the model before its gradients (a batch-norm mean, a mixture of experts' load-balancing
loss) cannot be cut so; it is refused in one line.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from partitioner import roles as R
from partitioner.errors import ScheduleError, WorkloadError
from partitioner.ir import SCAN_ENTER, SCAN_EXIT, Program, per_program
from partitioner.mesh import Mesh
from partitioner.plan import make_plan
from partitioner.propagation import ShardingState

AXIS = "microbatch"   # the axis of the one-axis mesh that finds the per-example part

# Ops linear in their operand 0 when no other operand depends on the batch.
_SHAPE_OPS = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p",
                        "convert_element_type", "broadcast_in_dim", "slice", "rev",
                        "reduce_precision", "dynamic_slice", "gather"})
_FIRST = _SHAPE_OPS | {"neg", "reduce_sum", "cumsum", "div", "pad"}
# Linear in all operands together (each a partial sum or zero).
_ALL = frozenset({"add", "add_any", "sub", "concatenate"})
# Linear in one operand when the others do not depend on the batch.
_ONE = frozenset({"mul", "dot_general"})
# Ops that draw random numbers: inside the per-micro-batch part they would repeat.
_RANDOM = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})
# Ops that keep an all-zero operand all zero.
_KEEP_ZERO = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "copy"})


class Cut(NamedTuple):
  """Where the step is cut: the ops run per micro-batch (`body`), before the loop (`pre`) and
  after it (`post`); what the loop reads whole (`invariant`) and one micro-batch of at a
  time (`split`: value -> dimension); what leaves it summed (`summed`: value -> how partial
  sums combine) or stacked per example (`stacked`: value -> dimension)."""
  body: frozenset
  pre: frozenset
  post: frozenset
  invariant: tuple
  split: dict
  summed: dict
  stacked: dict


def _refuse(what: str, why: str):
  raise ScheduleError(f"{what}: {why}")


def microbatch(program: Program, k: int) -> Program:
  """The step with its batch cut into `k` micro-batches, gradients accumulated in a loop."""
  if not isinstance(k, int) or k < 1:
    raise ScheduleError(f"Microbatch needs a positive number of micro-batches, got {k!r}")
  if k == 1:
    return program
  if program.microbatches > 1:
    _refuse(f"Microbatch({k})", "the program is cut into micro-batches already")
  if program.source is None:
    _refuse(f"Microbatch({k})", "the program was not traced from a function (partitioner.trace), "
                                "so it cannot be traced again at a micro-batch's size")
  return _microbatched(program, k)


@per_program
def _microbatched(program: Program, k: int) -> Program:
  """Made once per program and count: a search tries one cut under many schedules."""
  cut, small = cut_step(program, k)
  return _emit(program, small, cut, k)


def batch_inputs(program: Program, k: int, what: str) -> tuple[list[int], int]:
  """The data inputs a cut into `k` micro-batches splits, and the batch size."""
  picked, _ = R.batch_inputs(program, R.roles(program).data)
  if not picked:
    _refuse(what, "the step has no data input (an argument other than params and optimizer "
                  "state) to cut")
  n = program.values[picked[0]].shape[R.batch_dim(program, picked[0])]
  if n % k:
    _refuse(what, f"a batch of {n} does not divide into {k} micro-batches")
  return picked, n


class BatchSums(NamedTuple):
  """Where the batch goes in a step: per value, its dimension split over the examples
  (`example`, None where it has none), whether it is computed from the data (`data`), whether
  it is a partial sum over the batch (`partial`: value -> how partial sums combine), and the
  ops that read a partial sum without being linear in it (`nonlinear`: batch statistics)."""
  example: list
  data: np.ndarray
  partial: dict
  nonlinear: set
  plan: object


@per_program
def batch_sums(program: Program, picked: tuple[int, ...], k: int) -> BatchSums:
  """The step partitioned over a mesh of one axis of `k` devices with data parallelism: a
  micro-batch is data parallelism over time. Made once per program, inputs and count."""
  values, ops = program.values, program.ops
  state = ShardingState(program, Mesh({AXIS: k}))
  for v in picked:
    state.tile(v, R.batch_dim(program, v), (AXIS,), 0)
  state.propagate(picked, 0)
  plan = make_plan(state, deferral=False)
  example = [next((d for d, axes in enumerate(state.dims[v.id]) if AXIS in axes), None)
             for v in values]

  # Values that depend on the data. A total of the data alone (the number of tokens a loss is
  # divided by) is computed before the loop, from the whole batch, like any constant of it.
  data = _depends(program, picked)
  data &= _depends(program, [v for v in program.inputs if v not in set(picked)]) | np.array(
      [e is not None for e in example])

  # Partial sums over the batch: made by a reduction over it, or linear in such a sum. A loop
  # carry that starts at zeros is taken to be zero or a partial sum as what comes back to it
  # is (the gradient of a weight a recurrence reads at every step), until that holds.
  consts = {v.id for v in values if v.is_const and not np.any(np.asarray(v.const))}
  carries = []   # (carry in the body, what comes back to it, its initial value)
  for r in program.regions:
    enter, exit_ = ops[r.enter], ops[r.exit]
    carries += [(enter.outputs[j], exit_.inputs[j], enter.inputs[j]) for j in range(r.num_carry)]
  seeds, assumed = {}, {c for c, _, _ in carries}
  for _ in range(16):
    partial, nonlinear, zero = _partials(program, plan, data, consts | assumed, seeds)
    grown = {c: partial[back] for c, back, init in carries if back in partial and init in zero}
    kept = {c for c, back, init in carries if back in zero and init in zero and c not in grown}
    if grown == seeds and kept == assumed:
      break
    seeds, assumed = grown, kept
  else:   # no consistent assumption: assume nothing of the carries (a refusal, never a mistake)
    partial, nonlinear, zero = _partials(program, plan, data, consts, {})
  return BatchSums(example, data, partial, nonlinear, plan)


def retrace_small(program: Program, picked: list[int], n: int, k: int, what: str) -> Program:
  """The step traced again at a micro-batch of n // k examples, op for op like `program`."""
  from partitioner.tracing import retrace
  try:
    small = retrace(program, {
        program.input_position(v): _cut_shape(program.values[v].shape, R.batch_dim(program, v),
                                              k)
        for v in picked})
  except WorkloadError as e:
    _refuse(what, f"the step does not trace at a micro-batch of {n // k} examples (does it fix "
                  f"the batch size?): {e}")
  if program.head_multiple > 1:   # its attention heads padded (`HeadPadding`): so again
    from partitioner.heads import pad_heads
    small = pad_heads(small, program.head_multiple)
  if program.recomputation is not None:   # its activations recomputed (`Remat`): so again
    small = program.recomputation.again(small)
  _same_structure(program, small, what)
  return small


class _Parts(NamedTuple):
  """Which ops run per micro-batch (`body`), before the loop and after it, found from the
  dataflow at the full batch."""
  picked: list
  n: int
  example: list
  partial: dict
  body: frozenset
  pre: frozenset
  post: frozenset


def cuttable(program: Program, k: int) -> str | None:
  """Why the step cannot be cut into `k` micro-batches, as far as its dataflow tells without
  tracing it again at a micro-batch's size (a batch statistic, random numbers drawn per
  example, a batch that does not divide); None where nothing does. A step whose code fixes the
  batch size is found only when traced again (`microbatch`)."""
  if program.microbatches > 1 or program.stages > 1:
    return "the program is cut into micro-batches or pipeline stages already"
  if program.source is None:
    return "the program was not traced from a function, so it cannot be traced again"
  try:
    _parts(program, k, f"Microbatch({k})")
  except (ScheduleError, WorkloadError) as e:
    return str(e)
  return None


@per_program
def _parts(program: Program, k: int, what: str) -> _Parts:
  picked, n = batch_inputs(program, k, what)
  values, ops = program.values, program.ops
  example, data, partial, nonlinear, plan = batch_sums(program, tuple(picked), k)

  # The ops run per micro-batch: those that read the data and make something split over the
  # batch or partial over it, and those that make something of the batch's size without
  # reading the data (a broadcast, an iota) unless they draw random numbers (those are drawn
  # for the whole batch before the loop, so that each example keeps its own); whole loops
  # that hold one; then every op reading what they make that is neither (it exists only
  # inside the loop).
  producer = [v.producer for v in values]
  drawn = np.zeros(len(values), bool)   # random numbers and what they are drawn from
  for op in ops:
    if not any(data[v] for v in op.inputs) and (
        op.name in _RANDOM or any(drawn[v] for v in op.inputs)):
      drawn[list(op.outputs)] = True
  for op in reversed(ops):
    if not any(data[v] for v in op.inputs) and (
        op.name in _RANDOM or any(drawn[v] for v in op.outputs)):
      drawn[list(op.inputs)] = True
  body = {op.index for op in ops
          if any(example[v] is not None or v in partial for v in op.outputs)
          and (any(data[v] for v in op.inputs) or not any(drawn[v] for v in op.outputs))}
  while True:
    before = len(body)
    _close_regions(program, body)
    for op in ops:
      if op.index not in body and any(
          producer[v] in body and example[v] is None and v not in partial for v in op.inputs):
        body.add(op.index)
    if len(body) == before:
      break

  describe = program.name
  for i in sorted(body):
    op = ops[i]
    if i in nonlinear:
      v = next(v for v in op.inputs if v in partial)
      _refuse(what, f"op #{i} ({op.name}) needs {describe(v)}, a sum over the whole batch, "
                    "before the step's per-example work is done (a batch statistic: a batch-norm "
                    "mean, a load-balancing loss of batch means): micro-batches cannot be computed "
                    "apart")
    if op.name in _RANDOM:
      _refuse(what, f"op #{i} ({op.name}) draws random numbers inside the per-example part; they "
                    "would repeat in every micro-batch")

  # Constants the loop alone reads (zeros a scatter adds into, an iota) are made in it, where
  # XLA fuses them into their readers, rather than kept in buffers across the loop.
  made_of_constants = np.array([v.is_const for v in values])
  for op in ops:
    if (op.inputs and all(made_of_constants[v] for v in op.inputs) and op.name not in _RANDOM
        and program.region_of[op.index] < 0 and op.primitive not in (SCAN_ENTER, SCAN_EXIT)):
      made_of_constants[list(op.outputs)] = True
  users = program.users
  for op in reversed(ops):
    if (op.index not in body and all(made_of_constants[v] for v in op.outputs)
        and users[op.outputs[0]] and all(u in body for v in op.outputs for u in users[v])):
      body.add(op.index)

  # What the loop needs from outside is made before it.
  pre: set[int] = set()
  stack = [producer[v] for i in body for v in ops[i].inputs
           if producer[v] is not None and producer[v] not in body]
  while stack:
    i = stack.pop()
    if i in pre:
      continue
    pre.add(i)
    for v in ops[i].inputs:
      p = producer[v]
      if p is not None and p not in pre:
        if p in body:
          _refuse(what, f"op #{i} ({ops[i].name}) is computed from a sum over the whole batch and "
                        "read back by the per-example work (a batch statistic): micro-batches "
                        "cannot be computed apart")
        stack.append(p)
    grown = set(pre)
    _close_regions(program, grown)
    stack.extend(grown - pre)
  post = frozenset(range(len(ops))) - body - pre
  return _Parts(picked, n, example, partial, frozenset(body), frozenset(pre), post)


def cut_step(program: Program, k: int, what: str = "") -> tuple[Cut, Program]:
  """Where the step is cut into `k` micro-batches, and the step traced at a micro-batch's size;
  `what` names the tactic in refusals."""
  what = what or f"Microbatch({k})"
  picked, n, example, partial, body, pre, post = _parts(program, k, what)
  values, ops, describe = program.values, program.ops, program.name
  producer = [v.producer for v in values]
  small = retrace_small(program, picked, n, k, what)
  svals = small.values

  def dim_of(v) -> int | None:
    """The dimension the micro-batch cuts: where the small step's shape is k times smaller."""
    a, b = values[v].shape, svals[v].shape
    diff = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
    if not diff:
      return None
    if len(diff) > 1 or a[diff[0]] != n or b[diff[0]] * k != n:
      _refuse(what, f"{describe(v)} carries the batch merged with other dimensions "
                    f"({list(a)} at the full batch, {list(b)} at a micro-batch)")
    return diff[0]

  invariant, split = [], {}
  for i in sorted(body):
    for v in ops[i].inputs:
      if producer[v] in body or values[v].is_const or v in split or v in invariant:
        continue
      d = dim_of(v)
      if d is None:
        invariant.append(v)
      else:
        split[v] = d
  summed, stacked = {}, {}
  leaving = [v for i in sorted(post) for v in ops[i].inputs] + list(program.outputs)
  for v in leaving:
    if producer[v] not in body or v in summed or v in stacked:
      continue
    if example[v] is not None:
      stacked[v] = dim_of(v)
      if stacked[v] is None:
        _refuse(what, f"{describe(v)} is split over the batch but does not change with it")
    elif v in partial:
      summed[v] = partial[v]
    else:
      _refuse(what, f"{describe(v)} is made per micro-batch but is neither per example nor a sum "
                    "over the batch")
  cut = Cut(frozenset(body), frozenset(pre), post, tuple(invariant), split, summed, stacked)
  return cut, small


def _depends(program: Program, sources) -> np.ndarray:
  """Per value, whether it is computed from one of `sources` (`roles.depends_on`)."""
  out = np.zeros(len(program.values), bool)
  out[list(R.depends_on(program, tuple(sources)))] = True
  return out


def _partials(program: Program, plan, data, zero: set, seeds: dict) -> tuple[dict, set, set]:
  """Values that are partial sums over the micro-batch axis (value -> how they combine), the
  ops that read one without being linear in it, and the values that are all zero (from
  `zero`, and `seeds` taken as partial sums)."""
  partial, zero = dict(seeds), set(zero)
  nonlinear: set[int] = set()
  for op in program.ops:
    ins = op.inputs
    if not any(data[v] for v in op.outputs):   # a constant, or a total of the data alone
      if op.name in _KEEP_ZERO and ins and ins[0] in zero:
        zero.update(op.outputs)
      continue
    made = [r.reduce if AXIS in r.partial else None for r in plan.ops[op.index].result]
    if any(made):
      partial.update((v, kind) for v, kind in zip(op.outputs, made) if kind)
      continue
    if not any(v in partial for v in ins):
      continue
    kinds = _linear(op, partial, zero, data)
    if kinds is None:
      nonlinear.add(op.index)
    else:
      partial.update((v, kind) for v, kind in zip(op.outputs, kinds) if kind)
  return partial, nonlinear, zero


def _linear(op, partial, zero, data) -> list | None:
  """Per result, how the op's result is a partial sum (its combining kind, or None) if the op
  is linear in the partial sums it reads; None if it is not."""
  ins, name = op.inputs, op.name
  is_p = [v in partial for v in ins]
  is_pz = [v in partial or v in zero for v in ins]
  kinds = {partial[v] for v in ins if v in partial}
  if len(kinds) > 1:
    return None
  kind = kinds.pop()
  free = lambda js: all(not data[ins[j]] or ins[j] in zero for j in js)
  rest = lambda first: [j for j in range(len(ins)) if j not in first]
  if op.primitive is SCAN_ENTER:
    return [partial.get(v) for v in ins]
  if op.primitive is SCAN_EXIT:   # reads the carries and outputs made, then the carries in
    return [partial.get(v) for v in ins[:len(op.outputs)]]
  if kind != "sum":
    ok = name in _SHAPE_OPS and is_p[0] and free(rest([0]))
  elif name in _FIRST:
    ok = is_p[0] and free(rest([0])) and (name != "pad" or ins[1] in zero)
  elif name in _ALL:
    ok = all(is_pz)
  elif name in _ONE:
    ok = sum(is_p) == 1 and free(rest([is_p.index(True)]))
  elif name == "select_n":
    ok = free([0]) and all(is_pz[1:])
  elif name == "dynamic_update_slice":
    ok = is_pz[0] and is_pz[1] and free(range(2, len(ins)))
  else:
    ok = False
  return [kind] * len(op.outputs) if ok else None


def _close_regions(program: Program, chosen: set) -> None:
  """Adds every op of a loop that holds a chosen op, its enter and exit ops included."""
  for r in program.regions:
    if any(i in chosen for i in range(r.enter, r.exit + 1)):
      chosen.update(range(r.enter, r.exit + 1))


def _cut_shape(shape, dim: int, k: int) -> tuple[int, ...]:
  return tuple(s // k if d == dim else s for d, s in enumerate(shape))


def _same_structure(full: Program, small: Program, what: str) -> None:
  if len(full.ops) != len(small.ops) or len(full.values) != len(small.values) or any(
      a.name != b.name or len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs)
      for a, b in zip(full.ops, small.ops)):
    _refuse(what, "the step traces differently at a micro-batch's size (it branches on the batch "
                  "size), so its ops cannot be matched")
  for a, b in zip(full.ops, small.ops):
    if any(x != y for x, y in zip(a.inputs + a.outputs, b.inputs + b.outputs)):
      _refuse(what, "the step traces differently at a micro-batch's size (its values differ), so "
                    "its ops cannot be matched")


def _emit(program: Program, small: Program, cut: Cut, k: int) -> Program:
  """The cut step as a function, traced into the new program."""
  import jax.numpy as jnp
  from jax import lax

  values = program.values
  summed = list(cut.summed.items())
  stacked = list(cut.stacked.items())
  split = list(cut.split.items())
  consts = small_consts(program, small)

  def step(*flat):
    env = input_env(program, flat)
    program.run(env, only=cut.pre)
    xs = [strided(env[v], d, k) for v, d in split]
    outside = [env[v] for v in cut.invariant]
    init = [jnp.zeros(values[v].shape, wide(values[v].dtype)) for v, _ in summed]

    def iteration(carry, slices):
      senv = list(consts)
      for v, x in zip(cut.invariant, outside):
        senv[v] = x
      for (v, _), x in zip(split, slices):
        senv[v] = x
      sums = dict(zip(cut.summed, carry))

      def added(vid, x):   # a sum joins its carry as soon as it is made, and is dropped
        if vid in sums:
          sums[vid] = _combine(cut.summed[vid], sums[vid], x.astype(sums[vid].dtype))
        return x

      small.run(senv, only=cut.body, on_result=added)
      return [sums[v] for v in cut.summed], [senv[v] for v, _ in stacked]

    carry, ys = lax.scan(iteration, init, xs, length=k)
    for (v, _), c in zip(summed, carry):
      env[v] = c.astype(values[v].dtype)
    for (v, d), y in zip(stacked, ys):
      env[v] = unstrided(y, d)
    program.run(env, only=cut.post)
    return [jnp.asarray(env[v]) for v in program.outputs]

  out = traced_step(program, step)
  out.original = program
  out.microbatches = k
  return out


def small_consts(program: Program, small: Program) -> list:
  """Per value of the step traced at a micro-batch's size, its constant: the full step's where
  their shapes agree (a mean over the batch still divides by the whole batch)."""
  consts = [None] * len(small.values)
  for v in small.values:
    if v.is_const:
      full = program.values[v.id]
      consts[v.id] = full.const if full.is_const and full.shape == v.shape else v.const
  return consts


def wide(dtype) -> np.dtype:
  """Where sums over micro-batches accumulate: float32 for narrower floats."""
  import jax.numpy as jnp
  return (np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating)
          and np.dtype(dtype).itemsize < 4 else np.dtype(dtype))


def input_env(program: Program, flat) -> list:
  """Value id -> array for a run of `program` on its input leaves: its constants and inputs."""
  env: list = [None] * len(program.values)
  for v in program.values:
    if v.is_const:
      env[v.id] = v.const
  for vid, x in zip(program.inputs, flat):
    env[vid] = x
  return env


def traced_step(program: Program, step) -> Program:
  """`step` (input leaves -> output leaves, a rewrite of `program`) traced with `program`'s
  signature, loops kept, holding its inputs and outputs in `program`'s layouts."""
  import jax
  from partitioner.tracing import abstract_args, trace

  def fn(*args):
    outs = step(*program.flatten_args(args))
    return jax.tree_util.tree_unflatten(program.out_tree, outs)

  out = trace(fn, *abstract_args(program), arg_names=program.arg_names, loops="keep",
              layouts=False)   # `program`'s layouts, kept below
  out.layouts, out.output_layouts = program.layouts, program.output_layouts
  return out


def _combine(kind: str, a, b):
  import jax.numpy as jnp
  return a + b if kind == "sum" else jnp.maximum(a, b) if kind == "max" else jnp.minimum(a, b)


def strided(x, dim: int, k: int):
  """Micro-batch i of `x` at index i: rows i, i+k, i+2k... of dimension `dim`."""
  import jax.numpy as jnp
  shape = x.shape[:dim] + (x.shape[dim] // k, k) + x.shape[dim + 1:]
  return jnp.moveaxis(x.reshape(shape), dim + 1, 0)


def unstrided(y, dim: int):
  """The inverse of `_strided`: micro-batches stacked at index 0 back in their rows."""
  import jax.numpy as jnp
  y = jnp.moveaxis(y, 0, dim + 1)
  return y.reshape(y.shape[:dim] + (y.shape[dim] * y.shape[dim + 1],) + y.shape[dim + 2:])
