"""Pipeline stages over a scanned layer stack, as a rewrite of the program in SPMD form.

`pipeline(program, stages=S, microbatches=M, schedule)` cuts the L layers of a stack (a
`lax.scan` over stacked weights, `hk.layer_stack`, `nn.scan`) into S stages of L/S consecutive
layers, and streams M micro-batches through them, as MaxText and Praxis write a pipeline for
XLA's SPMD partitioner:

- every stacked weight `[L, ...]` is held as `[L/S, S, ...]`; split over the stage axis, each
  device holds its stage's layers;
- a loop iterates over a state with one slot per stage (`[S, micro-batch, ...]`). Each
  iteration hands every slot to the next stage (`shift.stage_shift`, a collective permute),
  puts the next micro-batch in slot 0, and runs each stage's layers on its slot (the layer
  body of the step traced at a micro-batch's size, vmapped over the stages); gradients flow
  back the same way, a stage per iteration, and each layer's weight gradient is summed over
  the micro-batches.

`schedule="gpipe"` rewrites the stack alone: a loop of M+S-1 iterations for its forward pass,
then one for its backward pass, reading what the forward kept per (iteration, stage); the
rest of the step (embedding, head, loss, optimizer) runs on the whole batch as before.
`schedule="1f1b"` (`_emit_1f1b`) puts the whole per-example step in one pipeline, so that a
stage keeps at most 2S-1 micro-batches' activations. Either way the bubble, the activations
kept, the hand-overs and the gradient reduction after the last micro-batch are in the
program, so the cost model prices them as it prices any loop.

The stack is found from the dataflow: a loop and the reverse loop that reads what it kept, of
the same length. What cannot be cut exactly is refused in one line: a stack that reads a
statistic of the whole batch, carries something other than per-example activations across
layers, reads other per-example values, draws random numbers, or two stacks at once (an
encoder and a decoder).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from partitioner import microbatch as MB
from partitioner import roles as R
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
             schedule: str = "1f1b") -> Program:
  """The step with its layer stack cut into `stages` stages that `microbatches` micro-batches
  stream through (see the module docstring)."""
  what = f"Pipeline(stages={stages}, microbatches={microbatches})"
  for name, n in (("stages", stages), ("microbatches", microbatches)):
    if not isinstance(n, int) or n < 1:
      raise ScheduleError(f"Pipeline needs a positive number of {name}, got {n!r}")
  if schedule not in SCHEDULES:
    raise ScheduleError(f"Pipeline schedule must be one of {', '.join(SCHEDULES)}, got "
                        f"{schedule!r}")
  if schedule == "interleaved":
    _refuse(what, "the interleaved schedule (virtual stages) is not built; gpipe and 1f1b are")
  if program.microbatches > 1:
    _refuse(what, "the program is cut into micro-batches already; Pipeline streams its own")
  if program.source is None:
    _refuse(what, "the program was not traced from a function (partitioner.trace), so it "
                  "cannot be traced again at a micro-batch's size")
  return _pipelined(program, stages, microbatches, schedule)


@per_program
def _pipelined(program: Program, stages: int, microbatches: int, schedule: str) -> Program:
  what = f"Pipeline(stages={stages}, microbatches={microbatches}, schedule={schedule})"
  if not program.root.loops:
    _refuse(what, "found no layer stack: the step has no loop (lax.scan, hk.layer_stack, "
                  "nn.scan) over stacked layers")
  if not _stacks(program) and program.source[1] != "keep":
    kept = _kept(program)   # the stack may have been unrolled: trace it as a loop
    kept.original, program = program, kept
  if not _stacks(program):
    _refuse(what, "found no layer stack: the layers must be a loop over stacked weights "
                  "(lax.scan, hk.layer_stack, nn.scan) whose gradient is a loop too")
  picked, n = MB.batch_inputs(program, microbatches, what)
  if schedule == "gpipe":
    small = MB.retrace_small(program, picked, n, microbatches, what)
    stack = _stack(program, small, picked, stages, microbatches, what)
    out = _emit(program, small, stack, stages, microbatches)
  else:
    cut, small = MB.cut_step(program, microbatches, what)
    stack = _stack(program, small, picked, stages, microbatches, what)
    out = _emit_1f1b(program, small, cut, stack, stages, microbatches, what)
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

  sums = MB.batch_sums(program, tuple(picked), M)
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
        if sums.data[v] or any(u in program.inputs for u in R.ancestors(program, [v])):
          _refuse(what, f"every layer reads {describe(v)}, which changes with the batch (an "
                        "attention mask?): streaming it with the micro-batches is not built")
        invariants.append(v)   # made of constants: made again at a micro-batch's size
      elif sums.data[v]:
        _refuse(what, f"every layer reads {describe(v)}, a statistic of the whole batch")
  return Stack(f, b, forward_carries, tuple(backward_carries), tuple(backward_xs),
               tuple(dict.fromkeys(invariants)))



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




def _to_stages(x, S: int, Lp: int):
  """[L, ...] -> [L/S, S, ...]: stage s holds layers s*L/S ... (s+1)*L/S - 1."""
  import jax.numpy as jnp
  return jnp.moveaxis(x.reshape((S, Lp) + x.shape[1:]), 0, 1)


def _from_stages(x, L: int):
  import jax.numpy as jnp
  return jnp.moveaxis(x, 1, 0).reshape((L,) + x.shape[2:])


def _slot_mask(x, s, S: int):
  """Per slot of `x`'s leading (stage) dimension, whether it is slot `s`, broadcastable."""
  from jax import lax
  return (lax.iota(np.int32, S) == s).reshape((S,) + (1,) * (x.ndim - 1))


def _layers(small: Program, region: Region, senv_base: list, carries, xs, Lp: int,
            reverse: bool):
  """One stage's layers on one micro-batch: the loop body of `small`, L/S times."""
  from jax import lax
  enter, exit_ = small.ops[region.enter], small.ops[region.exit]
  n = region.num_carry
  dtypes = [small.values[v].dtype for v in enter.outputs[:n]]

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

def _emit(program: Program, small: Program, stack: Stack, S: int, M: int) -> Program:
  """The pipelined step as a function, traced into the new program."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from partitioner.shift import stage_shift

  ops, values, svals = program.ops, program.values, small.values
  rf, rb = program.regions[stack.forward], program.regions[stack.backward]
  enter_f, exit_f, enter_b, exit_b = (ops[rf.enter], ops[rf.exit], ops[rb.enter], ops[rb.exit])
  nf, nb = rf.num_carry, rb.num_carry
  L, T = rf.length, M + S - 1
  Lp = L // S
  nb_grads = len(exit_b.outputs) - nb
  needed = sorted({k for k in stack.backward_xs if k is not None})   # what the gradient reads
  consts = MB.small_consts(program, small)
  made = sorted({values[u].producer for v in stack.invariants
                 for u in R.ancestors(program, [v]) if values[u].producer is not None})
  wide = MB.wide
  to_stages = lambda x: _to_stages(x, S, Lp)
  from_stages = lambda x: _from_stages(x, L)
  slot_mask = lambda x, s: _slot_mask(x, s, S)
  layers = lambda region, base, c, xs, reverse: _layers(small, region, base, c, xs, Lp, reverse)

  def step(*flat):
    env = MB.input_env(program, flat)
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
    staged = {}   # a weight both stacks read is held per stage once

    def held(v):
      if v not in staged:
        staged[v] = to_stages(env[v])
      return staged[v]

    weights = [held(v) for v in enter_f.inputs[nf:]]
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
    stacked = [None if k is not None else held(v)
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

  out = MB.traced_step(program, step)
  out.stage_values = _stage_values(out, S, T, (nf, nb, nb_grads))
  # What crosses stages: the forward loop's activations and the backward loop's gradients of
  # them (not its sums).
  out.handed = _handed(out, ((T, False, nf, range(nf)),
                             (T, True, nb + nb_grads, [j for j, d in enumerate(
                                 stack.backward_carries) if d is not None])))
  return out


def _handed(program: Program, loops) -> tuple:
  """(value, last dimension) of the carries that hold per-example activations or their
  gradients, one slot per stage: `loops` lists (length, reverse, carries, which) of the
  pipeline's top-level loops."""
  out = []
  for r in program.regions:
    for length, reverse, n, which in loops:
      if r.parent < 0 and r.length == length and r.reverse == reverse and r.num_carry == n:
        init = program.ops[r.enter].inputs
        out += [(init[j], program.values[init[j]].rank - 1) for j in which]
  return tuple(out)


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


def _emit_1f1b(program: Program, small: Program, cut, stack: Stack, S: int, M: int,
               what: str) -> Program:
  """The step with its whole per-example part in one pipeline, in 1F1B's order: micro-batch m
  runs forward on stage s at iteration m + s, its loss and gradient at the last stage right
  after, and backward on stage s at iteration m + 2(S-1) - s. Each stage holds the activations
  of at most 2S-1 micro-batches (a ring it writes once per iteration and reads at its own
  delay); no stage waits for the whole batch. The embedding (before the stack) runs on each
  micro-batch as it enters and again as its gradient leaves; the head and loss (after it) on
  the micro-batch leaving the last stage; their sums accumulate per stage, and are added up
  over the stages once, after the loops. Two loops: S-1 iterations of forward work only,
  then M+S-1 of all of it, the forward of the last S-1 on padding. The bubble is then
  1F1B's, S-1 of M+S-1 iterations, and S-1 forward passes more."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from partitioner.shift import stage_shift

  ops, values, svals = program.ops, program.values, small.values
  rf, rb = program.regions[stack.forward], program.regions[stack.backward]
  enter_f, exit_f, enter_b, exit_b = (ops[rf.enter], ops[rf.exit], ops[rb.enter], ops[rb.exit])
  nf, nb = rf.num_carry, rb.num_carry
  L, T, D = rf.length, M + 2 * S - 2, 2 * S - 1
  Lp = L // S
  if rf.enter not in cut.body or rb.enter not in cut.body:
    _refuse(what, "the layer stack does not run per example")
  if cut.stacked:
    v = next(iter(cut.stacked))
    _refuse(what, f"{program.name(v)} is an output per example; the 1f1b schedule returns "
                  "sums over the batch only")
  head = frozenset(i for i in cut.body if rf.exit < i < rb.enter)
  embed = frozenset(i for i in cut.body if i < rf.enter)
  tail = {i for i in cut.body if i > rb.exit}
  # What the tail makes of the layers' weight gradients alone (the transpose of a cast of the
  # stacked weights made before the stack, as a step that casts its master weights once does)
  # runs once, after the loops, on their sums: the cut keeps only linear work on a sum per
  # micro-batch, so that is the same sum.
  grads_out = set(exit_b.outputs[nb:])
  late = set()
  for i in sorted(tail):
    if any(v in grads_out or values[v].producer in late for v in ops[i].inputs):
      late.add(i)
  tail -= late
  for i in sorted(late):
    for v in ops[i].inputs:
      if not (v in grads_out or values[v].producer in late or
              values[v].producer not in cut.body):
        _refuse(what, f"op #{i} ({ops[i].name}) combines the layers' weight gradients with "
                      f"{program.name(v)}, made per micro-batch")
  # A sum the head makes that the tail adds into a sum of its own (a tied embedding's two
  # gradients) is joined after the loops: the add (and the casts to what leaves the body)
  # runs once, on the two sums.
  joined = []   # (ops of the join, the head's sum, the tail's sum)
  for i in sorted(tail):
    op = ops[i]
    made_by = [values[v].producer for v in op.inputs]
    if op.name in ("add", "add_any") and len(op.inputs) == 2 and (
        sum(p in head for p in made_by) == 1 and sum(p in tail for p in made_by) == 1):
      chain, w = [i], op.outputs[0]
      while w not in cut.summed and len(program.users[w]) == 1 and ops[
          program.users[w][0]].name in ("convert_element_type", "copy"):
        chain.append(program.users[w][0])
        w = ops[chain[-1]].outputs[0]
      if w in cut.summed and cut.summed[w] == "sum":
        h = op.inputs[made_by.index(next(p for p in made_by if p in head))]
        joined.append((tuple(chain), h, next(v for v in op.inputs if v != h)))
  tail -= {i for chain, _, _ in joined for i in chain}
  for i in tail:
    for v in ops[i].inputs:
      if values[v].producer in head or (
          values[v].producer == rb.exit and exit_b.outputs.index(v) < nb
          and stack.backward_carries[exit_b.outputs.index(v)] is None):
        _refuse(what, f"op #{i} ({ops[i].name}), after the gradient of the stack, reads "
                      f"{program.name(v)}, a sum the pipeline makes across its stages")
  for v, kind in cut.summed.items():
    if kind != "sum":
      _refuse(what, f"{program.name(v)} combines micro-batches by {kind}; the 1f1b schedule "
                    "sums them")
  group = {}   # summed value -> where it is made
  joins = {ops[chain[-1]].outputs[0] for chain, _, _ in joined}
  for v in [v for v in cut.summed if v not in joins] + [
      x for _, h, w in joined for x in (h, w)]:
    p = values[v].producer
    if p == rb.exit:
      k = exit_b.outputs.index(v)
      group[v] = ("grad", k - nb) if k >= nb else ("carry", k)
    elif p in head:
      group[v] = ("head", None)
    elif p in tail:
      group[v] = ("tail", None)
    elif p in late:
      group[v] = ("late", None)
    elif p in embed:
      group[v] = ("embed", None)
    else:
      _refuse(what, f"{program.name(v)}, a sum over the batch, is made inside the forward stack")
  head_sums = [v for v in group if group[v][0] == "head"]
  tail_sums = [v for v in group if group[v][0] == "tail"]
  embed_sums = [v for v in group if group[v][0] == "embed"]
  tail, late = frozenset(tail), frozenset(late)
  late_reads = [(k, v) for k, v in enumerate(exit_b.outputs[nb:])
                if any(v in ops[i].inputs for i in late)]
  needed = sorted({k for k in stack.backward_xs if k is not None})
  consts = MB.small_consts(program, small)
  # What the stack reads from the per-example part of the step (masks, made of constants) is
  # made once, at a micro-batch's size.
  inputs = set(program.inputs)
  made = set()
  for v in _body_reads(program, rf) + _body_reads(program, rb):
    if values[v].producer in cut.body:
      if inputs & R.ancestors(program, [v]):
        _refuse(what, f"every layer reads {program.name(v)}, made from the step's inputs per "
                      "micro-batch: streaming it with the micro-batches is not built")
      made.update(values[u].producer for u in R.ancestors(program, [v])
                  if values[u].producer is not None)
  bdims = stack.backward_carries
  split = list(cut.split.items())
  to_stages = lambda x: _to_stages(x, S, Lp)
  mask = lambda x, s: _slot_mask(x, s, S)
  zero = lambda x: jnp.zeros((), x.dtype)

  def step(*flat):
    env = MB.input_env(program, flat)
    program.run(env, only=cut.pre)
    base = list(consts)   # what one micro-batch reads from outside
    small.run(base, only=set(made))
    for v in cut.invariant:
      base[v] = env[v]

    def pad(x, front):
      back = T - M - front
      return jnp.concatenate([jnp.zeros((front,) + x.shape[1:], x.dtype), x,
                              jnp.zeros((back,) + x.shape[1:], x.dtype)])

    data = [MB.strided(env[v], d, M) for v, d in split]
    # Per iteration t: the data of the micro-batch entering (t), leaving the last stage
    # (t - S + 1) and leaving the gradient of the first stage (t - 2S + 2).
    xs = (jnp.arange(T), [pad(x, 0) for x in data], [pad(x, S - 1) for x in data],
          [pad(x, 2 * S - 2) for x in data])
    staged = {}   # a weight both stacks read is held per stage once
    for v in list(enter_f.inputs[nf:]) + [v for v, k in zip(enter_b.inputs[nb:],
                                                             stack.backward_xs) if k is None]:
      if v not in staged:
        staged[v] = to_stages(env[v])
    weights_f = [staged[v] for v in enter_f.inputs[nf:]]
    weights_b = [staged[v] for v, k in zip(enter_b.inputs[nb:], stack.backward_xs) if k is None]

    def embedded(batch):
      """The per-example work before the stack, on one micro-batch of data."""
      senv = list(base)
      for (v, _), x in zip(split, batch):
        senv[v] = x
      small.run(senv, only=embed)
      return senv

    def stage_forward(w, c):
      c, ys = _layers(small, rf, base, c, w, Lp, reverse=False)
      return c, [ys[k] for k in needed]

    def stage_backward(w, res, c):
      x, wi, ri = [], iter(w), iter(res)
      for k in stack.backward_xs:
        x.append(next(wi) if k is None else next(ri))
      return _layers(small, rb, base, c, x, Lp, reverse=True)

    def loss_and_gradient(out, batch):
      """The per-example work between the stack and its gradient (the head, the loss and
      their gradients), on one stage's slot: the gradient entering the stack, and sums."""
      senv = embedded(batch)
      for v, x in zip(exit_f.outputs[:nf], out):
        senv[v] = x
      small.run(senv, only=head)
      return ([senv[v] for v, d in zip(enter_b.inputs[:nb], bdims) if d is not None],
              [senv[v] for v in head_sums])

    def after(grad_in, batch):
      """The per-example work after the stack's gradient (the embedding's gradient)."""
      senv = embedded(batch)
      slots = iter(grad_in)
      for v, d in zip(exit_b.outputs[:nb], bdims):
        if d is not None:
          senv[v] = next(slots)
      small.run(senv, only=tail)
      return [senv[v] for v in tail_sums]

    def iteration(carry, x, forward: bool, both: bool, backward: bool):
      fstate, cts, ring, (accs, grads, head_acc, tail_acc, embed_acc) = carry
      t, entering, leaving, returning = x
      if forward:
        senv = embedded(entering)
        valid = t < M
        embed_acc = [a + jnp.where(valid, senv[v], zero(senv[v])).astype(a.dtype)
                     for a, v in zip(embed_acc, embed_sums)]
        fstate = [jnp.where(mask(s, 0), senv[v][None], stage_shift(s, 1))
                  for s, v in zip(fstate, enter_f.inputs[:nf])]
        fstate, kept = jax.vmap(stage_forward, in_axes=(1, 0))(weights_f, fstate)
        ring = [lax.dynamic_update_slice_in_dim(r, k[:, :, None].astype(r.dtype), t % D, axis=2)
                for r, k in zip(ring, kept)]
      if both:
        grad_out, made_ = jax.vmap(loss_and_gradient, in_axes=(0, None))(fstate, leaving)
        valid = (t >= S - 1) & (t < M + S - 1)
        last = lambda s: mask(s, S - 1) & valid
        cts = [s + jnp.where(last(s), g.astype(s.dtype), zero(s)) for s, g in zip(cts, grad_out)]
        head_acc = [a + jnp.where(last(m), m, zero(m)).astype(a.dtype)
                    for a, m in zip(head_acc, made_)]
      if backward:
        when = (t - 2 * (S - 1 - lax.iota(np.int32, S))) % D   # each stage's own delay
        res = [jax.vmap(lambda r, i: lax.dynamic_index_in_dim(r, i, 1, keepdims=False),
                        out_axes=1)(r, when) for r in ring]
        ci, ai = iter(cts), iter(accs)
        state = [next(ci) if d is not None else next(ai) for d in bdims]
        state, g = jax.vmap(stage_backward, in_axes=(1, 1, 0), out_axes=(0, 1))(
            weights_b, res, state)
        cts = [s for s, d in zip(state, bdims) if d is not None]
        accs = [s for s, d in zip(state, bdims) if d is None]
        grads = [a + y.astype(a.dtype) for a, y in zip(grads, g)]
        valid = (t >= 2 * S - 2) & (t < T)
        made_ = jax.vmap(after, in_axes=(0, None))(cts, returning)
        first = lambda s: mask(s, 0) & valid
        tail_acc = [a + jnp.where(first(m), m, zero(m)).astype(a.dtype)
                    for a, m in zip(tail_acc, made_)]
        cts = [stage_shift(jnp.where(mask(s, 0), zero(s), s), -1) for s in cts]
      return (fstate, cts, ring, (accs, grads, head_acc, tail_acc, embed_acc)), None

    sdt = lambda v: svals[v].dtype
    fstate = [jnp.zeros((S,) + svals[v].shape, sdt(v)) for v in enter_f.outputs[:nf]]
    cts = [jnp.zeros((S,) + svals[v].shape, sdt(v))
           for v, d in zip(enter_b.outputs[:nb], bdims) if d is not None]
    kept_f = [exit_f.inputs[nf + k] for k in needed]   # per layer, in the small step
    # A stage between micro-batches runs backward on a zero gradient and slots of the ring no
    # micro-batch wrote: they start as what its layers keep of a zero input, so that this
    # work is finite and adds exactly zero (a variance of 0 would make inf times 0).
    # The ring is [S, L/S, 2S-1, ...]: per stage, per layer of it, per slot.
    _, kept0 = jax.vmap(stage_forward, in_axes=(1, 0))(weights_f, fstate)
    ring = [jnp.broadcast_to(k[:, :, None], k.shape[:2] + (D,) + k.shape[2:]).astype(sdt(v))
            for k, v in zip(kept0, kept_f)]

    def sums(backward: bool = True):
      """Sums over micro-batches, from zeros in each loop (so that each stays partial over
      the data-parallel axes to its loop's end, and is reduced once), added up after; a
      loop of forward work only makes none but the embedding's."""
      if not backward:
        return [], [], [], [], [jnp.zeros(values[v].shape, MB.wide(values[v].dtype))
                                for v in embed_sums]
      per_slot = lambda vs: [jnp.zeros((S,) + values[v].shape, MB.wide(values[v].dtype))
                             for v in vs]
      return ([jnp.zeros((S,) + svals[v].shape, MB.wide(sdt(v)))
               for v, d in zip(enter_b.outputs[:nb], bdims) if d is None],
              [jnp.zeros((Lp, S) + values[v].shape[1:], MB.wide(values[v].dtype))
               for v in exit_b.outputs[nb:]],
              per_slot(head_sums), per_slot(tail_sums),
              [jnp.zeros(values[v].shape, MB.wide(values[v].dtype)) for v in embed_sums])

    total = None
    # S-1 iterations of forward work only, then M+S-1 of all of it (the last S-1 run the
    # forward on padding: one loop keeps one set of sums, where a third loop of backward work
    # only would hold a second set of gradients until the end).
    phases = ((0, S - 1, (True, False, False)), (S - 1, T, (True, True, True)))
    for lo, hi, (f, h, b) in phases:
      if hi > lo:
        part = jax.tree_util.tree_map(lambda a: a[lo:hi], xs)
        (fstate, cts, ring, made_), _ = lax.scan(lambda c, x: iteration(c, x, f, h, b),
                                                 (fstate, cts, ring, sums(b)), part,
                                                 length=hi - lo)
        total = made_ if total is None else made_[:4] + (
            [a + e for a, e in zip(total[4], made_[4])],)
    accs, grads, head_acc, tail_acc, embed_acc = total

    acc_of = dict(zip([j for j, d in enumerate(bdims) if d is None], accs))
    for v, (kind, k) in group.items():
      if kind == "grad":
        x = _from_stages(grads[k], L)
      elif kind == "carry":
        x = env[enter_b.inputs[k]] + acc_of[k].sum(0)
      elif kind == "head":
        x = head_acc[head_sums.index(v)].sum(0)
      elif kind == "tail":
        x = tail_acc[tail_sums.index(v)].sum(0)
      elif kind == "late":
        continue
      else:
        x = embed_acc[embed_sums.index(v)]
      env[v] = x.astype(values[v].dtype)
    for k, v in late_reads:
      env[v] = _from_stages(grads[k], L).astype(values[v].dtype)
    program.run(env, only=late)
    program.run(env, only={i for chain, _, _ in joined for i in chain})
    program.run(env, only=cut.post)
    return [jnp.asarray(env[v]) for v in program.outputs]

  out = MB.traced_step(program, step)
  # The stage dimension of every carry of the two loops (per the carry's structure above).
  n_accs = sum(d is None for d in bdims)
  dims = ([0] * nf + [0] * (nb - n_accs) + [0] * len(needed) + [0] * n_accs
          + [1] * len(exit_b.outputs[nb:]) + [0] * (len(head_sums) + len(tail_sums))
          + [None] * len(embed_sums))
  forward_only = dims[:nf + nb - n_accs + len(needed)] + [None] * len(embed_sums)
  found = []
  for r in out.regions:
    for length, ds in ((S - 1, forward_only), (M + S - 1, dims)):
      if r.parent < 0 and r.num_carry == len(ds) and r.length == length:
        init = out.ops[r.enter].inputs[:r.num_carry]
        found += [(v, d) for v, d in zip(init, ds) if d is not None]
  out.stage_values = tuple(found)
  # What crosses stages and what a stage keeps: the activations, their gradients, the ring.
  handed = range(nf + nb - n_accs + len(needed))
  out.handed = _handed(out, ((S - 1, False, len(forward_only), handed),
                             (M + S - 1, False, len(dims), handed)))
  return out
