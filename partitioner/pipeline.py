"""Pipeline stages over a scanned layer stack, as a rewrite of the program in SPMD form.

`pipeline(program, stages=S, microbatches=M)` cuts the L layers of a stack (a `lax.scan` over
stacked weights, `hk.layer_stack`, `nn.scan`) into S stages of L/S consecutive layers, and
streams M micro-batches through them, as MaxText and Praxis write a pipeline for XLA's SPMD
partitioner:

- every stacked weight `[L, ...]` is held as `[L/S, S, ...]`; split over the stage axis, each
  device holds its stage's layers;
- the forward stack becomes a loop of M+S-1 iterations over a state with one slot per stage
  (`[S, micro-batch, ...]`). Each iteration hands every slot to the next stage
  (`shift.stage_shift`, a collective permute), puts the next micro-batch in slot 0, and runs
  each stage's layers on its slot (the layer body, vmapped over the stages). The last slot
  leaves as one micro-batch's output;
- the backward stack becomes the same loop run in reverse, handing gradients back a stage at a
  time, reading what the forward pass kept per (iteration, stage), and summing each layer's
  weight gradient over the micro-batches.

The rest of the step (embedding, head, loss, optimizer) runs on the whole batch as before. The
bubble (S-1 of the M+S-1 iterations do no useful work on each stage), the activations each
stage keeps for its M micro-batches (GPipe's schedule), the hand-over and the gradient
reduction after the last micro-batch are then in the program, so the cost model prices them
as it prices any loop.

The stack is found from the dataflow: a loop and the reverse loop that reads what it kept, of
the same length. What cannot be cut exactly is refused in one line: a stack that reads a
statistic of the whole batch, carries something other than per-example activations across
layers, draws random numbers, or two stacks at once (an encoder and a decoder).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from partitioner import microbatch as MB
from partitioner.errors import ScheduleError
from partitioner.ir import Program, Region, per_program

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Stack(NamedTuple):
  """The forward and backward loops of a layer stack (region indices), and what each of their
  inputs is: per carry, its batch dimension (None: an accumulator); per stacked input, the
  forward loop's stacked output it is (a kept activation) or None (a weight)."""
  forward: int
  backward: int
  forward_carries: tuple     # batch dimension of each forward carry
  backward_carries: tuple    # batch dimension of each backward carry (None: a sum)
  backward_xs: tuple         # per stacked input of the backward loop: forward output k, or None
  invariants: tuple          # values the bodies read from outside at a micro-batch's size


def _refuse(what: str, why: str):
  raise ScheduleError(f"{what}: {why}")


def pipeline(program: Program, stages: int, microbatches: int,
             schedule: str = "gpipe") -> Program:
  """The step with its layer stack cut into `stages` stages that `microbatches` micro-batches
  stream through (see the module docstring)."""
  what = f"Pipeline(stages={stages}, microbatches={microbatches})"
  for name, n in (("stages", stages), ("microbatches", microbatches)):
    if not isinstance(n, int) or n < 1:
      raise ScheduleError(f"Pipeline needs a positive number of {name}, got {n!r}")
  if schedule not in SCHEDULES:
    raise ScheduleError(f"Pipeline schedule must be one of {', '.join(SCHEDULES)}, got "
                        f"{schedule!r}")
  if schedule != "gpipe":
    _refuse(what, f"the {schedule} schedule is not built: the step's backward pass is a loop of "
                  "its own, after the forward one, so only GPipe's order (all forward micro-"
                  "batches, then all backward) can be written as a rewrite of it")
  if program.microbatches > 1:
    _refuse(what, "the program is cut into micro-batches already; Pipeline streams its own")
  if program.source is None:
    _refuse(what, "the program was not traced from a function (partitioner.trace), so it "
                  "cannot be traced again at a micro-batch's size")
  return _pipelined(program, stages, microbatches)


@per_program
def _pipelined(program: Program, stages: int, microbatches: int) -> Program:
  what = f"Pipeline(stages={stages}, microbatches={microbatches})"
  if not _stacks(program) and program.source[1] != "keep":
    program = _kept(program)   # the stack may have been unrolled: trace it as a loop
  if not _stacks(program):
    _refuse(what, "found no layer stack: the layers must be a loop over stacked weights "
                  "(lax.scan, hk.layer_stack, nn.scan) whose gradient is a loop too")
  picked, n = MB.batch_inputs(program, microbatches, what)
  small = MB.retrace_small(program, picked, n, microbatches, what)
  stack = _stack(program, small, picked, stages, microbatches, what)
  out = _emit(program, small, stack, stages, microbatches)
  out.original = program
  out.microbatches = microbatches
  out.stages = stages
  return out


def _kept(program: Program) -> Program:
  from partitioner.tracing import trace, abstract_args
  fn, _ = program.source
  return trace(fn, *abstract_args(program.root), arg_names=program.arg_names, loops="keep")


def _stacks(program: Program) -> list[tuple[int, int]]:
  """(forward, backward) region pairs: a top-level loop, and a reverse loop of the same length
  that reads what it stacked."""
  regions, ops, users = program.regions, program.ops, program.users
  found = []
  for f, rf in enumerate(regions):
    if rf.parent >= 0 or rf.reverse:
      continue
    kept = ops[rf.exit].outputs[rf.num_carry:]
    readers = {u for v in kept for u in users[v]}
    for b, rb in enumerate(regions):
      if (rb.parent < 0 and rb.reverse and rb.length == rf.length and rb.enter in readers):
        found.append((f, b))
  return found


def _body_reads(program: Program, region: Region) -> list[int]:
  """Values a loop's body reads from outside it (not constants), in order of first read."""
  out, seen = [], set()
  for i in range(region.enter + 1, region.exit + 1):
    op = program.ops[i]
    reads = op.inputs if i < region.exit else op.inputs[:len(op.inputs) - region.num_carry]
    for v in reads:
      p = program.values[v].producer
      if v in seen or program.values[v].is_const:
        continue
      if p is None or p < region.enter or p > region.exit:
        seen.add(v)
        out.append(v)
  return out


def _stack(program: Program, small: Program, picked, S: int, M: int, what: str) -> Stack:
  pairs = _stacks(program)
  if len(pairs) > 1:
    _refuse(what, f"found {len(pairs)} layer stacks (an encoder and a decoder?); a pipeline "
                  "over several stacks is not built")
  (f, b), = pairs
  regions, ops, values, svals = program.regions, program.ops, program.values, small.values
  rf, rb = regions[f], regions[b]
  L = rf.length
  if L % S:
    _refuse(what, f"the stack has {L} layers, which do not divide into {S} stages")
  describe = program.name

  def batch_dim(v):
    a, s = values[v].shape, svals[v].shape
    diff = [d for d, (x, y) in enumerate(zip(a, s)) if x != y]
    if not diff:
      return None
    if len(diff) > 1 or s[diff[0]] * M != a[diff[0]]:
      _refuse(what, f"{describe(v)} carries the batch merged with other dimensions")
    return diff[0]

  sums = MB.batch_sums(program, picked, M)
  for region in (rf, rb):
    for i in range(region.enter + 1, region.exit):
      op = ops[i]
      if i in sums.nonlinear:
        _refuse(what, f"op #{i} ({op.name}) in the layer stack needs a sum over the whole batch "
                      "(a batch statistic): micro-batches cannot be computed apart")
      if op.name in MB._RANDOM:
        _refuse(what, f"op #{i} ({op.name}) draws random numbers inside the layer stack; they "
                      "would repeat in every micro-batch")

  enter_f, exit_f, enter_b, exit_b = (ops[rf.enter], ops[rf.exit], ops[rb.enter], ops[rb.exit])
  nf, nb = rf.num_carry, rb.num_carry
  forward_carries = tuple(batch_dim(v) for v in enter_f.inputs[:nf])
  if None in forward_carries:
    v = enter_f.inputs[forward_carries.index(None)]
    _refuse(what, f"the stack carries {describe(v)} from layer to layer, which is not per "
                  "example (a counter, a running sum): only activations can stream")
  for v in enter_f.inputs[nf:]:
    if batch_dim(v) is not None:
      _refuse(what, f"the stack reads {describe(v)} per layer and per example; only weights "
                    "can be stacked per layer")
  kept = exit_f.outputs[nf:]
  for v in kept:
    if any(u != rb.enter for u in program.users[v]):
      _refuse(what, f"{describe(v)}, stacked by the forward stack, is read outside its "
                    "gradient (per-layer outputs the loss reads are not supported)")
  backward_carries = []
  for j, v in enumerate(enter_b.inputs[:nb]):
    d = batch_dim(v)
    if d is None and not (_is_zero(program, v) and exit_b.inputs[j] in sums.partial):
      _refuse(what, f"the gradient stack carries {describe(v)}, neither per example nor a sum "
                    "that starts at zero")
    backward_carries.append(d)
  backward_xs = []
  for v in enter_b.inputs[nb:]:
    if v in kept:
      backward_xs.append(kept.index(v))
    elif batch_dim(v) is None:
      backward_xs.append(None)
    else:
      _refuse(what, f"the gradient stack reads {describe(v)} per layer and per example, not "
                    "from the forward stack")
  for v in exit_b.outputs[nb:]:
    if batch_dim(v) is not None or sums.partial.get(exit_b.inputs[exit_b.outputs.index(v)]) \
        != "sum":
      _refuse(what, f"the gradient stack makes {describe(v)} per layer, which is not a sum "
                    "over the batch (a weight's gradient)")
  invariants = []
  for region in (rf, rb):
    for v in _body_reads(program, region):
      p = values[v].producer
      if p is not None and (rf.enter <= p <= rf.exit) and region is rb:
        _refuse(what, f"the gradient stack reads {describe(v)}, an output of the forward stack, "
                      "whole")
      if batch_dim(v) is not None:
        if sums.data[v] or any(u in program.inputs for u in _ancestors(program, v)):
          _refuse(what, f"every layer reads {describe(v)}, which changes with the batch (an "
                        "attention mask?): streaming it with the micro-batches is not built")
        invariants.append(v)   # made of constants: made again at a micro-batch's size
      elif sums.data[v]:
        _refuse(what, f"every layer reads {describe(v)}, a statistic of the whole batch")
  return Stack(f, b, forward_carries, tuple(backward_carries), tuple(backward_xs),
               tuple(dict.fromkeys(invariants)))


def _ancestors(program: Program, v: int) -> set[int]:
  """The values `v` is computed from (itself included)."""
  out, stack = set(), [v]
  while stack:
    x = stack.pop()
    if x in out:
      continue
    out.add(x)
    p = program.values[x].producer
    if p is not None:
      stack.extend(program.ops[p].inputs)
  return out


def _is_zero(program: Program, v: int) -> bool:
  """Whether `v` is all zeros: a constant, or a broadcast or cast of one."""
  while True:
    val = program.values[v]
    if val.is_const:
      return not np.any(np.asarray(val.const))
    op = program.ops[val.producer]
    if op.name not in ("broadcast_in_dim", "convert_element_type", "reshape", "copy"):
      return False
    v = op.inputs[0]


def _emit(program: Program, small: Program, stack: Stack, S: int, M: int) -> Program:
  """The pipelined step as a function, traced into the new program."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from partitioner.shift import stage_shift
  from partitioner.tracing import abstract_args, trace

  ops, values, svals = program.ops, program.values, small.values
  rf, rb = program.regions[stack.forward], program.regions[stack.backward]
  enter_f, exit_f, enter_b, exit_b = (ops[rf.enter], ops[rf.exit], ops[rb.enter], ops[rb.exit])
  nf, nb = rf.num_carry, rb.num_carry
  L, T = rf.length, M + S - 1
  Lp = L // S
  nb_grads = len(exit_b.outputs) - nb
  needed = sorted({k for k in stack.backward_xs if k is not None})   # what the gradient reads
  # The micro-batch step's constants are the full step's where their shapes agree.
  consts = [None] * len(svals)
  for v in svals:
    if v.is_const:
      full = values[v.id]
      consts[v.id] = full.const if full.is_const and full.shape == v.shape else v.const
  made = sorted({values[u].producer for v in stack.invariants
                 for u in _ancestors(program, v) if values[u].producer is not None})
  wide = lambda dtype: (np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating)
                        and np.dtype(dtype).itemsize < 4 else np.dtype(dtype))

  def to_stages(x):    # [L, ...] -> [L/S, S, ...]: stage s holds layers s*L/S ...
    return jnp.moveaxis(x.reshape((S, Lp) + x.shape[1:]), 0, 1)

  def from_stages(x):
    return jnp.moveaxis(x, 1, 0).reshape((L,) + x.shape[2:])

  def slot_mask(x, s):
    shape = (S,) + (1,) * (x.ndim - 1)
    return (lax.iota(np.int32, S) == s).reshape(shape)

  def layers(region, senv_base, carries, xs, reverse):
    """One stage's layers on one micro-batch: the loop body of `small`, L/S times."""
    enter, exit_ = small.ops[region.enter], small.ops[region.exit]
    n = region.num_carry
    dtypes = [svals[v].dtype for v in enter.outputs[:n]]

    def layer(c, x):
      senv = list(senv_base)
      for vid, a in zip(enter.outputs, list(c) + list(x)):
        senv[vid] = a
      small.run(senv, span=(region.enter + 1, region.exit))
      read = [senv[v] for v in exit_.inputs]
      return ([lax.convert_element_type(a, d) for a, d in zip(read[:n], dtypes)],
              read[n:len(read) - n])

    c0 = [lax.convert_element_type(a, d) for a, d in zip(carries, dtypes)]
    return lax.scan(layer, c0, xs, length=Lp, reverse=reverse)

  def step(*flat):
    env: list = [None] * len(values)
    for v in values:
      if v.is_const:
        env[v.id] = v.const
    for vid, x in zip(program.inputs, flat):
      env[vid] = x
    senv = list(consts)   # what the bodies read from outside, at a micro-batch's size
    small.run(senv, only=set(made))
    program.run(env, span=(0, rf.enter))
    fwd_reads = [v for v in _body_reads(program, rf) if v not in stack.invariants]

    # The forward stack: micro-batch m enters stage 0 at iteration m and leaves stage S-1 at
    # iteration m + S - 1.
    dims = stack.forward_carries
    entering = [MB.strided(env[v], d, M) for v, d in zip(enter_f.inputs[:nf], dims)]
    entering = [jnp.concatenate([x, jnp.zeros((S - 1,) + x.shape[1:], x.dtype)])
                for x in entering]
    weights = [to_stages(env[v]) for v in enter_f.inputs[nf:]]
    outside = [env[v] for v in fwd_reads]

    def stage_forward(w, c):
      base = list(senv)
      for v, x in zip(fwd_reads, outside):
        base[v] = x
      c, ys = layers(rf, base, c, w, reverse=False)
      return c, [ys[k] for k in needed]

    def forward(state, x):
      state = [jnp.where(slot_mask(s, 0), a[None], stage_shift(s, 1))
               for s, a in zip(state, x)]
      state, kept = jax.vmap(stage_forward, in_axes=(1, 0), out_axes=(0, 1))(weights, state)
      leaving = [jnp.where(slot_mask(s, S - 1), s, jnp.zeros((), s.dtype)).sum(0)
                 for s in state]
      return state, (leaving, kept)

    init = [jnp.zeros((S,) + x.shape[1:], svals[v].dtype)
            for x, v in zip(entering, enter_f.outputs[:nf])]
    _, (left, kept) = lax.scan(forward, init, entering, length=T)
    for v, x, d in zip(exit_f.outputs[:nf], left, dims):
      env[v] = MB.unstrided(x[S - 1:], d).astype(values[v].dtype)

    program.run(env, span=(rf.exit + 1, rb.enter))

    # The backward stack: gradients flow back a stage per iteration, in reverse.
    bdims = stack.backward_carries
    bwd_reads = [v for v in _body_reads(program, rb) if v not in stack.invariants]
    coming = [jnp.concatenate([jnp.zeros((S - 1,) + x.shape[1:], x.dtype), x])
              for x in (MB.strided(env[v], d, M)
                        for v, d in zip(enter_b.inputs[:nb], bdims) if d is not None)]
    stacked = [None if k is not None else to_stages(env[v])
               for v, k in zip(enter_b.inputs[nb:], stack.backward_xs)]
    outside_b = [env[v] for v in bwd_reads]
    carry_types = [svals[v].dtype for v in enter_b.outputs[:nb]]
    grads0 = [jnp.zeros((Lp, S) + values[v].shape[1:], wide(values[v].dtype))
              for v in exit_b.outputs[nb:]]

    def stage_backward(w, res, c):
      base = list(senv)
      for v, x in zip(bwd_reads, outside_b):
        base[v] = x
      xs, wi, ri = [], iter(w), iter(res)
      for k in stack.backward_xs:
        xs.append(next(wi) if k is None else next(ri))
      return layers(rb, base, c, xs, reverse=True)

    weights_b = [x for x in stacked if x is not None]

    def backward(carry, x):
      state, grads = carry
      arriving, kept_t = x
      arriving = iter(arriving)
      state = [s + jnp.where(slot_mask(s, S - 1), next(arriving)[None], jnp.zeros((), s.dtype))
               if d is not None else s for s, d in zip(state, bdims)]
      res = [kept_t[needed.index(k)] for k in stack.backward_xs if k is not None]
      state, g = jax.vmap(stage_backward, in_axes=(1, 1, 0), out_axes=(0, 1))(
          weights_b, res, state)
      leaving = [jnp.where(slot_mask(s, 0), s, jnp.zeros((), s.dtype)).sum(0)
                 for s, d in zip(state, bdims) if d is not None]
      state = [stage_shift(jnp.where(slot_mask(s, 0), jnp.zeros((), s.dtype), s), -1)
               if d is not None else s for s, d in zip(state, bdims)]
      grads = [a + y.astype(a.dtype) for a, y in zip(grads, g)]
      return (state, grads), leaving

    state0 = [jnp.zeros((S,) + svals[v].shape, t)
              for v, t in zip(enter_b.outputs[:nb], carry_types)]
    (state, grads), left_b = lax.scan(backward, (state0, grads0), (coming, kept), length=T,
                                      reverse=True)
    left_b = iter(left_b)
    for j, (v, d) in enumerate(zip(exit_b.outputs[:nb], bdims)):
      if d is not None:
        env[v] = MB.unstrided(next(left_b)[:M], d).astype(values[v].dtype)
      else:
        env[v] = (env[enter_b.inputs[j]] + state[j].sum(0)).astype(values[v].dtype)
    for v, g in zip(exit_b.outputs[nb:], grads):
      env[v] = from_stages(g).astype(values[v].dtype)

    program.run(env, span=(rb.exit + 1, len(ops)))
    return [jnp.asarray(env[v]) for v in program.outputs]

  def fn(*args):
    outs = step(*program.flatten_args(args))
    return jax.tree_util.tree_unflatten(program.out_tree, outs)

  out = trace(fn, *abstract_args(program), arg_names=program.arg_names, loops="keep",
              layouts=False)
  out.layouts, out.output_layouts = program.layouts, program.output_layouts
  out.stage_values = _stage_values(out, S, T, (nf, nb, nb_grads))
  return out


def _stage_values(program: Program, S: int, T: int, carries: tuple[int, int, int]):
  """The values whose stage dimension the stage axis splits, as (value, dimension): the state
  of the two loops of M+S-1 iterations (dimension 0) and the backward loop's per-layer gradient
  sums (`[L/S, S, ...]`, dimension 1). `carries`: how many of each the loops carry."""
  nf, nb, ng = carries
  out = []
  for r in program.regions:
    if r.parent >= 0 or r.length != T or r.num_carry != (nb + ng if r.reverse else nf):
      continue
    init = program.ops[r.enter].inputs[:r.num_carry]
    if all(program.values[v].shape[:1] == (S,) for v in init[:nb if r.reverse else nf]):
      out += [(v, 0 if j < (nb if r.reverse else nf) else 1) for j, v in enumerate(init)]
  return tuple(out)
