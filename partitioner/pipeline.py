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
stage keeps at most 2S-1 micro-batches' activations. `schedule="interleaved"` with V virtual
stages is 1F1B over V*S chunks of layers, stage s holding chunks s, s+S, ... (`_timetable`):
each iteration runs one chunk a stage, the last stage hands over to the first, the layers
are held with each stage's chunks together (`_held_by_stage`), and the per-example work
before and after the stack runs only in the iterations that need it (a loop of loops).
Whatever the schedule, the bubble, the activations
kept, the hand-overs and the gradient reduction after the last micro-batch are in the
program, so the cost model prices them as it prices any loop. Where the stages' layers read
or make a hand-over (or what a stage keeps), it passes through `shift.stage_view`, so that
`StageScatter` can split the hand-over and gather it there.

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
             schedule: str = "1f1b", virtual: int = 1) -> Program:
  """The step with its layer stack cut into `stages` stages that `microbatches` micro-batches
  stream through (see the module docstring); `virtual` stages a device under the interleaved
  schedule."""
  what = f"Pipeline(stages={stages}, microbatches={microbatches})"
  for name, n in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
    if not isinstance(n, int) or n < 1:
      raise ScheduleError(f"Pipeline needs a positive number of {name}, got {n!r}")
  if schedule not in SCHEDULES:
    raise ScheduleError(f"Pipeline schedule must be one of {', '.join(SCHEDULES)}, got "
                        f"{schedule!r}")
  if (schedule == "interleaved") != (virtual > 1):
    _refuse(what, f"virtual={virtual} stages a device with schedule={schedule}: the "
                  "interleaved schedule takes 2 or more, the others 1")
  if schedule == "interleaved" and microbatches % stages:
    _refuse(what, f"the interleaved schedule streams micro-batches in rounds of one per stage: "
                  f"{microbatches} micro-batches do not divide into rounds of {stages}")
  if program.microbatches > 1:
    _refuse(what, "the program is cut into micro-batches already; Pipeline streams its own")
  if program.head_multiple > 1:
    _refuse(what, "its attention heads are padded (HeadPadding), which cannot reach into a "
                  "layer stack's loop: pipeline the step as traced")
  if program.source is None:
    _refuse(what, "the program was not traced from a function (partitioner.trace), so it "
                  "cannot be traced again at a micro-batch's size")
  from partitioner.remat import rematerialised
  if rematerialised(program) is not None:
    _refuse(what, "the step recomputes its activations (Remat), which cannot reach into a "
                  "layer stack's loop: write the layers with jax.checkpoint (nn.remat) instead")
  return _pipelined(program, stages, microbatches, schedule, virtual)


@per_program
def _pipelined(program: Program, stages: int, microbatches: int, schedule: str,
               virtual: int = 1) -> Program:
  what = f"Pipeline(stages={stages}, microbatches={microbatches}, schedule={schedule}" + (
      f", virtual={virtual})" if virtual > 1 else ")")
  if not program.root.loops:
    _refuse(what, "found no layer stack: the step has no loop (lax.scan, hk.layer_stack, "
                  "nn.scan) over stacked layers; a Python loop over layers (as HF's Flax "
                  "models write their stacks) is unrolled when traced: run the blocks under "
                  "nn.scan (as stack=scan does for hf_gpt2, hf_llama and hf_mistral)")
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
    stack = _stack(program, small, picked, stages, microbatches, what, virtual)
    held = _held_by_stage(program, stack, stages, virtual, what) if virtual > 1 else ({}, {})
    out = _emit_1f1b(program, small, cut, stack, stages, microbatches, what, virtual)
    out.layouts = {**program.layouts, **held[0]}
    out.output_layouts = {**program.output_layouts, **held[1]}
  out.original = program
  out.microbatches = microbatches
  out.stages = stages
  return out


def _held_by_stage(program: Program, stack: Stack, S: int, V: int, what: str):
  """Where the interleaved schedule's layers live: stage s holds chunks s, s+S, ... of the
  stack, which are not one block of the user's layer dimension. The stacked weights, and what
  is indexed alike by layer outside the stack (master weights, optimizer state, gradients,
  their updates), are held with each stage's chunks together (`layouts.StageChunks`), so that
  splitting that dimension over the stage axis gives each stage its own. Returns the layouts
  of the program's inputs and outputs among them (by position); refuses where an op other
  than the stack and ops that index layers alike reads them."""
  from partitioner.layouts import _PERMUTES, StageChunks, _grow, _linked
  from partitioner.propagation import factor_table
  ops = program.ops
  rf, rb = program.regions[stack.forward], program.regions[stack.backward]
  enter_f, enter_b, exit_b = ops[rf.enter], ops[rb.enter], ops[rb.exit]
  seeds = list(enter_f.inputs[rf.num_carry:]) + list(exit_b.outputs[rb.num_carry:]) + [
      v for v, k in zip(enter_b.inputs[rb.num_carry:], stack.backward_xs) if k is None]
  table = factor_table(program)
  members: dict[int, int] = {}
  layer = StageChunks(0, S, V)
  for seed in seeds:
    grown = _grow(program, table, seed, layer, _PERMUTES) if seed not in members else {}
    grown = grown if grown is None else {v: lay.dim for v, lay in grown.items()}
    if grown is None or any(members.get(v, d) != d for v, d in grown.items()):
      _refuse(what, f"{program.name(seed)} is indexed by layer along two dimensions; the "
                    "interleaved schedule cannot hold its layers by stage")
    members.update(grown)
  loops = {rf.enter, rb.enter, rb.exit}
  for v, d in members.items():
    if program.values[v].shape[d] != rf.length:
      _refuse(what, f"{program.name(v)} is indexed like the layers but has "
                    f"{program.values[v].shape[d]} of them")
    producer = program.values[v].producer
    for i in list(program.users[v]) + ([producer] if producer is not None else []):
      if i not in loops and _linked(table[i], ops[i], v, layer._replace(dim=d),
                                    _PERMUTES) is None:
        _refuse(what, f"op #{i} ({ops[i].name}) reads {program.name(v)} other than layer by "
                      "layer; the interleaved schedule holds its layers by stage")
  inputs = {k: StageChunks(members[v], S, V) for k, v in enumerate(program.inputs)
            if v in members}
  outputs = {k: StageChunks(members[v], S, V) for k, v in enumerate(program.outputs)
             if v in members}
  for k in inputs:
    if k in program.layouts:
      _refuse(what, f"{program.input_names[k]} is held in another layout already "
                    f"({program.layouts[k]})")
  return inputs, outputs


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


def _stack(program: Program, small: Program, picked, S: int, M: int, what: str,
           V: int = 1) -> Stack:
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
  if L % (S * V):
    _refuse(what, f"the stack has {L} layers, which do not divide into {S} stages of {V} "
                  "virtual stages")
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
  """[L, ...] -> [L/S, S, ...]: stage s holds rows s*L/S ... (s+1)*L/S - 1 (its layers; with
  virtual stages, held so by `_held_by_stage`: its chunks, one after the other)."""
  import jax.numpy as jnp
  return jnp.moveaxis(x.reshape((S, Lp) + x.shape[1:]), 0, 1)


def _from_stages(x, L: int):
  import jax.numpy as jnp
  return jnp.moveaxis(x, 1, 0).reshape((L,) + x.shape[2:])


def _chunk_dims(x, ndim: int):
  """Gather/scatter dimension numbers of one chunk per stage of `[V*c, S, ...]` (indices
  `[S, 2]`: the chunk's first row, the stage), the chunk laid out `[c, S, ...]`."""
  from jax import lax
  window = (0,) + tuple(range(2, ndim))
  return (lax.GatherDimensionNumbers(offset_dims=window, collapsed_slice_dims=(1,),
                                     start_index_map=(0, 1)),
          lax.ScatterDimensionNumbers(update_window_dims=window, inserted_window_dims=(1,),
                                      scatter_dims_to_operand_dims=(0, 1)))


def _chunk_index(r, c: int):
  """Per stage, (the first row of chunk r[s], s): the indices of `_pick` and `_add_chunk`."""
  from jax import lax
  S = r.shape[0]
  rows = lax.broadcast_in_dim((r * c).astype(np.int32), (S, 1), (0,))
  return lax.concatenate([rows, lax.broadcasted_iota(np.int32, (S, 1), 0)], 1)


def _pick(x, index, c: int):
  """`[V*c, S, ...]` -> `[c, S, ...]`: per stage, its chunk (rows index[s, 0] ...)."""
  from jax import lax
  gather_dims, _ = _chunk_dims(x, x.ndim)
  return lax.gather(x, index, gather_dims, (c, 1) + x.shape[2:],
                    mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _add_chunk(x, index, y):
  """`x` (`[V*c, S, ...]`) with `y` (`[c, S, ...]`) added to each stage's chunk."""
  from jax import lax
  _, scatter_dims = _chunk_dims(x, x.ndim)
  return lax.scatter_add(x, index, y.astype(x.dtype), scatter_dims,
                         mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


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
  from partitioner.shift import stage_view, stage_shift

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
  view_carries = lambda c: [stage_view(a) if d is not None else a
                            for a, d in zip(c, stack.backward_carries)]

  def step(*flat):
    env = MB.input_env(program, flat)
    senv = list(consts)   # what the bodies read from outside, at a micro-batch's size
    small.run(senv, only=set(made))
    program.run(env, span=(0, rf.enter))
    fwd_reads = [v for v in _body_reads(program, rf) if v not in stack.invariants]

    # The forward stack: micro-batch m enters stage 0 at iteration m and leaves stage S-1 at
    # iteration m + S - 1.
    dims = stack.forward_carries
    entering = [MB.strided(stage_view(env[v]), d, M) for v, d in zip(enter_f.inputs[:nf], dims)]
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
      c, ys = layers(rf, base, [stage_view(a) for a in c], w, reverse=False)
      return [stage_view(a) for a in c], [stage_view(ys[k]) for k in needed]

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
      env[v] = stage_view(MB.unstrided(x[S - 1:], d).astype(values[v].dtype))

    program.run(env, span=(rf.exit + 1, rb.enter))

    # The backward stack: gradients flow back a stage per iteration, in reverse.
    bdims = stack.backward_carries
    bwd_reads = [v for v in _body_reads(program, rb) if v not in stack.invariants]
    coming = [jnp.concatenate([jnp.zeros((S - 1,) + x.shape[1:], x.dtype), x])
              for x in (MB.strided(stage_view(env[v]), d, M)
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
        xs.append(next(wi) if k is None else stage_view(next(ri)))
      c, g = layers(rb, base, view_carries(c), xs, reverse=True)
      return view_carries(c), g

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
        env[v] = stage_view(MB.unstrided(next(left_b)[:M], d).astype(values[v].dtype))
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


def _timetable(S: int, M: int, V: int) -> dict:
  """Per iteration t of the 1F1B loop with V virtual stages a device (V=1: plain 1F1B), what
  each stage does. Micro-batch m = g*S + i runs forward on virtual stage j = r*S + s (device s,
  its chunk r) at iteration g*VS + r*S + i + s, and backward at VS-1 + g*VS + (V-1-r)*S + i +
  S-1-s: each hand-over moves one stage a step, the last stage's to the first (a cyclic
  shift), and a micro-batch's gradient starts back in the iteration its loss is computed.
  Returns arrays over t (and stage): the forward and backward chunks, whether the first stage
  takes a new micro-batch, the ring slot written and each stage's slot read, whether stage 0's
  gradient leaves, and the micro-batch (with its validity) entering, leaving the last stage
  and leaving the first stage's gradient."""
  VS = V * S
  C, T, D = VS - 1, V * M + VS + S - 2, 2 * VS - 1
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  back = V - 1 - ((t - C - (S - 1 - s)) % VS) // S

  def position(u):
    """(micro-batch, valid) of the u-th step of a virtual stage's order, on its last chunk."""
    valid = (u >= 0) & (u < V * M) & (u % VS >= (V - 1) * S)
    return np.clip(u // VS * S + u % VS - (V - 1) * S, 0, M - 1), valid

  t = t[:, 0]
  m_out, out_valid = position(t - (S - 1))
  m_ret, ret_valid = position(t - C - (S - 1))
  m_in = t // VS * S + t % VS
  i32 = lambda a: np.asarray(a, np.int32)
  ends = ((t % VS) < S) | (((t + 1) % VS) < S) | (back[:, 0] == 0)
  return {"forward": i32(((t[:, None] - s) % VS) // S), "backward": i32(back), "ends": ends,
          "enter": (t % VS) < S, "in_valid": ((t % VS) < S) & (m_in < M),
          "write": i32(t % D), "read": i32((t[:, None] - 2 * (VS - 1 - (back * S + s))) % D),
          "leave": back[:, 0] == 0, "out_valid": out_valid, "ret_valid": ret_valid,
          "m_in": i32(np.clip(m_in, 0, M - 1)), "m_out": i32(m_out), "m_ret": i32(m_ret)}


def _segments(flags) -> list[tuple[int, list[tuple[int, bool]]]]:
  """`flags` (per iteration) as (k, runs): k times the runs (length, flag) in order; runs
  that repeat in pairs are grouped so."""
  runs = []
  for f in np.asarray(flags).tolist():
    if runs and runs[-1][1] == f:
      runs[-1][0] += 1
    else:
      runs.append([1, f])
  runs = [tuple(r) for r in runs]
  out, i = [], 0
  while i < len(runs):
    k = 1
    while runs[i + 2 * k:i + 2 * k + 2] == runs[i:i + 2] and len(runs[i:i + 2]) == 2:
      k += 1
    if k > 1:
      out.append((k, list(runs[i:i + 2])))
      i += 2 * k
    else:
      out.append((1, [runs[i]]))
      i += 1
  return out


def _emit_1f1b(program: Program, small: Program, cut, stack: Stack, S: int, M: int,
               what: str, V: int = 1) -> Program:
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
  from partitioner.shift import stage_view, stage_shift

  ops, values, svals = program.ops, program.values, small.values
  rf, rb = program.regions[stack.forward], program.regions[stack.backward]
  enter_f, exit_f, enter_b, exit_b = (ops[rf.enter], ops[rf.exit], ops[rb.enter], ops[rb.exit])
  nf, nb = rf.num_carry, rb.num_carry
  L, VS = rf.length, V * S
  C, T, D = VS - 1, V * M + VS + S - 2, 2 * VS - 1
  Lp = L // S
  Lc = Lp // V   # layers of a chunk (a virtual stage)
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
  table = _timetable(S, M, V)
  loops = []   # (length, stage dim of each carry) of the pipeline's top-level loops, as emitted
  n_accs = sum(d is None for d in bdims)

  def adds_to(backward: bool, ends: bool) -> tuple:
    """Which of the sums (the stack's accumulators, its weights' gradients, the head's, the
    tail's, the embedding's) a loop adds to: a loop of forward work only adds to none but the
    embedding's, one without the ends to none of theirs."""
    return backward, backward, backward and ends, backward and ends, ends

  # The stage dimension of each sum (per the carry's structure in `step`).
  sum_dims = ([0] * n_accs, [1] * len(exit_b.outputs[nb:]),
              [0] * len(head_sums), [0] * len(tail_sums), [None] * len(embed_sums))

  def carried(backward: bool, ends: bool) -> tuple:
    """The stage dimension of each carry of a loop: its state, then the sums it adds to."""
    return tuple([0] * (nf + nb - n_accs + len(needed)) + [
        d for ds, keep in zip(sum_dims, adds_to(backward, ends)) if keep for d in ds])
  zero = lambda x: jnp.zeros((), x.dtype)

  def step(*flat):
    env = MB.input_env(program, flat)
    program.run(env, only=cut.pre)
    base = list(consts)   # what one micro-batch reads from outside
    small.run(base, only=set(made))
    for v in cut.invariant:
      base[v] = env[v]

    data = [MB.strided(env[v], d, M) for v, d in split]
    # Per iteration: what each stage does, and the data of the micro-batch entering, leaving
    # the last stage and leaving the gradient of the first stage.
    plan = {k: jnp.asarray(a) for k, a in table.items() if not k.startswith("m_") and k != "ends"}
    xs = (plan, *([jnp.take(x, table[k], axis=0) for x in data]
                  for k in ("m_in", "m_out", "m_ret")))
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
      c, ys = _layers(small, rf, base, [stage_view(a) for a in c], w, Lc, reverse=False)
      return [stage_view(a) for a in c], [stage_view(ys[k]) for k in needed]

    def stage_backward(w, res, c):
      x, wi, ri = [], iter(w), iter(res)
      for k in stack.backward_xs:
        x.append(next(wi) if k is None else stage_view(next(ri)))
      view = lambda c: [stage_view(a) if d is not None else a for a, d in zip(c, bdims)]
      c, g = _layers(small, rb, base, view(c), x, Lc, reverse=True)
      return view(c), g

    def loss_and_gradient(out, batch):
      """The per-example work between the stack and its gradient (the head, the loss and
      their gradients), on one stage's slot: the gradient entering the stack, and sums."""
      senv = embedded(batch)
      for v, x in zip(exit_f.outputs[:nf], out):
        senv[v] = stage_view(x)
      small.run(senv, only=head)
      return ([stage_view(senv[v]) for v, d in zip(enter_b.inputs[:nb], bdims) if d is not None],
              [senv[v] for v in head_sums])

    def after(grad_in, batch):
      """The per-example work after the stack's gradient (the embedding's gradient)."""
      senv = embedded(batch)
      slots = iter(grad_in)
      for v, d in zip(exit_b.outputs[:nb], bdims):
        if d is not None:
          senv[v] = stage_view(next(slots))
      small.run(senv, only=tail)
      return [senv[v] for v in tail_sums]

    def chunks(weights, r):
      """Each stage's chunk r[s] of its weights (all of them without virtual stages)."""
      return weights if V == 1 else [_pick(w, _chunk_index(r, Lc), Lc) for w in weights]

    def iteration(carry, x, ends: bool, backward: bool):
      """One iteration: every stage's forward, and with `backward` its backward; with `ends`
      the per-example work before and after the stack (entering, the head and loss, the
      embedding's gradient), which interleaved stages need in S+2 of every VS iterations."""
      fstate, cts, ring, (accs, grads, head_acc, tail_acc, embed_acc) = carry
      now, entering, leaving, returning = x
      if ends:
        senv = embedded(entering)
        embed_acc = [a + jnp.where(now["in_valid"], senv[v], zero(senv[v])).astype(a.dtype)
                     for a, v in zip(embed_acc, embed_sums)]
        fstate = [jnp.where(mask(s, 0) & now["enter"], stage_view(senv[v])[None],
                            stage_shift(s, 1))
                  for s, v in zip(fstate, enter_f.inputs[:nf])]
      else:
        fstate = [stage_shift(s, 1) for s in fstate]
      fstate, kept = jax.vmap(stage_forward, in_axes=(1, 0))(
          chunks(weights_f, now["forward"]), fstate)
      ring = [lax.dynamic_update_slice_in_dim(r, k[:, :, None].astype(r.dtype), now["write"],
                                              axis=2)
              for r, k in zip(ring, kept)]
      if ends and backward:
        grad_out, made_ = jax.vmap(loss_and_gradient, in_axes=(0, None))(fstate, leaving)
        valid = now["out_valid"]
        last = lambda s: mask(s, S - 1) & valid
        cts = [s + jnp.where(last(s), g.astype(s.dtype), zero(s)) for s, g in zip(cts, grad_out)]
        head_acc = [a + jnp.where(last(m), m, zero(m)).astype(a.dtype)
                    for a, m in zip(head_acc, made_)]
      if backward:
        res = [jax.vmap(lambda r, i: lax.dynamic_index_in_dim(r, i, 1, keepdims=False),
                        out_axes=1)(r, now["read"]) for r in ring]   # each stage's own delay
        ci, ai = iter(cts), iter(accs)
        state = [next(ci) if d is not None else next(ai) for d in bdims]
        state, g = jax.vmap(stage_backward, in_axes=(1, 1, 0), out_axes=(0, 1))(
            chunks(weights_b, now["backward"]), res, state)
        cts = [s for s, d in zip(state, bdims) if d is not None]
        accs = [s for s, d in zip(state, bdims) if d is None]
        if V == 1:
          grads = [a + y.astype(a.dtype) for a, y in zip(grads, g)]
        else:
          at = _chunk_index(now["backward"], Lc)
          grads = [_add_chunk(a, at, y) for a, y in zip(grads, g)]
        if ends:
          made_ = jax.vmap(after, in_axes=(0, None))(cts, returning)
          first = lambda s: mask(s, 0) & now["ret_valid"]
          tail_acc = [a + jnp.where(first(m), m, zero(m)).astype(a.dtype)
                      for a, m in zip(tail_acc, made_)]
        # What leaves the first stage is done; what does not goes round to the last.
        cts = [stage_shift(jnp.where(mask(s, 0) & now["leave"], zero(s), s), -1) for s in cts]
      return (fstate, cts, ring, (accs, grads, head_acc, tail_acc, embed_acc)), None

    sdt = lambda v: svals[v].dtype
    fstate = [jnp.zeros((S,) + svals[v].shape, sdt(v)) for v in enter_f.outputs[:nf]]
    cts = [jnp.zeros((S,) + svals[v].shape, sdt(v))
           for v, d in zip(enter_b.outputs[:nb], bdims) if d is not None]
    kept_f = [exit_f.inputs[nf + k] for k in needed]   # per layer, in the small step
    # A stage between micro-batches runs backward on a zero gradient and slots of the ring no
    # micro-batch wrote: they start as what its layers keep of a zero input, so that this
    # work is finite and adds exactly zero (a variance of 0 would make inf times 0).
    # The ring is [S, L/(SV), 2VS-1, ...]: per stage, per layer of a chunk, per slot.
    _, kept0 = jax.vmap(stage_forward, in_axes=(1, 0))([w[:Lc] for w in weights_f], fstate)
    ring = [jnp.broadcast_to(k[:, :, None], k.shape[:2] + (D,) + k.shape[2:]).astype(sdt(v))
            for k, v in zip(kept0, kept_f)]

    def sums():
      """The sums over micro-batches, zeros to begin with (`adds_to` names them)."""
      per_slot = lambda vs: [jnp.zeros((S,) + values[v].shape, MB.wide(values[v].dtype))
                             for v in vs]
      return ([jnp.zeros((S,) + svals[v].shape, MB.wide(sdt(v)))
               for v, d in zip(enter_b.outputs[:nb], bdims) if d is None],
              [jnp.zeros((Lp, S) + values[v].shape[1:], MB.wide(values[v].dtype))
               for v in exit_b.outputs[nb:]],
              per_slot(head_sums), per_slot(tail_sums),
              [jnp.zeros(values[v].shape, MB.wide(values[v].dtype)) for v in embed_sums])

    def carried_sums(acc, backward: bool, ends: bool):
      """The sums a loop adds to, the others left out."""
      return tuple(x if keep else [] for x, keep in zip(acc, adds_to(backward, ends)))

    def merged(acc, made_):
      return tuple(y if y else x for x, y in zip(acc, made_))

    def loop(state, acc, part, ends: bool, backward: bool, length: int):
      """A loop of `length` iterations, carrying on the sums it adds to: each stays partial
      over the data-parallel axes from the first loop that adds to it to the last, and is
      reduced once after it."""
      loops.append((length, carried(backward, ends)))
      (*state, made_), _ = lax.scan(lambda c, x: iteration(c, x, ends, backward),
                                    (*state, carried_sums(acc, backward, ends)), part,
                                    length=length)
      return tuple(state), merged(acc, made_)

    def rounds(state, acc, part, runs, k: int, backward: bool):
      """`k` rounds of the same runs (with and without the ends) in a loop of loops."""
      loops.append((k, carried(backward, True)))
      part = jax.tree_util.tree_map(lambda a: a.reshape((k, -1) + a.shape[1:]), part)

      def body(carry, x):
        *state, inner = carry
        state, at = tuple(state), 0
        for n, ends in runs:
          piece = jax.tree_util.tree_map(lambda a: a[at:at + n], x)
          state, inner = loop(state, inner, piece, ends, backward, n)
          at += n
        return (*state, inner), None

      loops_before = len(loops)
      (*state, made_), _ = lax.scan(body, (*state, carried_sums(acc, backward, True)), part,
                                    length=k)
      del loops[loops_before:]   # the inner loops are nested, not the pipeline's own
      return tuple(state), merged(acc, made_)

    # VS-1 iterations of forward work only, then VM+S-1 of all of it (the last ones run the
    # forward on padding: one set of sums, where a loop of backward work only after would
    # hold a second set of gradients until the end). Where interleaved stages need the ends
    # in only some iterations, those repeat every VS iterations: each run of iterations that
    # need them and of those that do not is a loop, and k rounds of them a loop of loops.
    loops.clear()
    state, acc = (fstate, cts, ring), sums()
    for lo, hi, backward in ((0, C, False), (C, T, True)):
      at = lo
      for k, runs in _segments(table["ends"][lo:hi]):
        n = k * sum(r for r, _ in runs)
        part = jax.tree_util.tree_map(lambda a: a[at:at + n], xs)
        state, acc = (loop(state, acc, part, runs[0][1], backward, n)
                      if k == 1 and len(runs) == 1 else rounds(state, acc, part, runs, k, backward))
        at += n
    fstate, cts, ring = state
    accs, grads, head_acc, tail_acc, embed_acc = acc

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
  # The values whose stage dimension the stage axis splits: the carries of the pipeline's
  # loops (the loops nested in them follow), matched to the loops in the order emitted (a
  # loop of one iteration may be traced as straight-line code: the others carry its values).
  found, top, at = [], [r for r in out.regions if r.parent < 0], 0
  for length, ds in loops:
    match = next((k for k in range(at, len(top))
                  if (top[k].length, top[k].num_carry) == (length, len(ds))), None)
    if match is not None:
      init = out.ops[top[match].enter].inputs[:top[match].num_carry]
      found += [(v, d) for v, d in zip(init, ds) if d is not None]
      at = match + 1
  out.stage_values = tuple(found)
  # What crosses stages and what a stage keeps: the activations, their gradients, the ring.
  handed = range(nf + nb - n_accs + len(needed))
  out.handed = _handed(out, tuple({(length, False, len(ds), handed) for length, ds in loops}))
  return out
