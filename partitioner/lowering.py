"""Lowering a partitioned program to real JAX, two ways.

`lower_spmd`: an explicit per-device program under `shard_map` that runs every op on local
pieces and issues exactly the collectives of the plan (psum, psum_scatter, all_gather,
all_to_all). It proves the rewriting semantics.

`to_jax_shardings` / `jit_partitioned`: `NamedSharding`s for inputs and outputs and a
`with_sharding_constraint` on every intermediate, for XLA's own SPMD partitioner under `jax.jit`;
gathers and scatters run as one-op `shard_map` islands (`ISLANDS`), as the plan runs them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from partitioner import collectives as C
from partitioner.compat import shard_map
from partitioner.ir import SCAN_ENTER, SCAN_EXIT, bind, run_loop, walk
from partitioner.rules import LOCAL_RULES
from partitioner.sharding import Sharding, local_shape


class LocalContext:
  """What a local rule may ask about the op it is running on one device."""

  __slots__ = ("op", "program", "sizes", "plan", "factors")

  def __init__(self, op, program, sizes, plan, factors):
    self.op, self.program, self.sizes, self.plan, self.factors = op, program, sizes, plan, factors

  def operand_dims(self, k):
    return self.plan.operand_dims[k]

  def result_dims(self, k):
    return self.plan.result[k].dims

  def operand_shape(self, k):
    return local_shape(self.program.values[self.op.inputs[k]].shape, self.operand_dims(k),
                       self.sizes)

  def result_shape(self, k):
    return local_shape(self.program.values[self.op.outputs[k]].shape, self.result_dims(k),
                       self.sizes)

  @property
  def partial(self):
    return self.plan.result[0].partial if self.plan.result else ()

  def shard_index(self, axes):
    return shard_index(axes, self.sizes)


def shard_index(axes, sizes):
  """This device's position along a tuple of mesh axes, major to minor (traced)."""
  idx = None
  for a in axes:
    i = lax.axis_index(a)
    idx = i if idx is None else idx * sizes[a] + i
  return idx


_REDUCERS = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


def run_steps(x, steps, sizes):
  for s in steps:
    if s.kind == C.ALL_REDUCE:
      x = _REDUCERS[s.reduce](x, s.axes)
    elif s.kind == C.REDUCE_SCATTER:
      x = lax.psum_scatter(x, s.axes, scatter_dimension=s.dim, tiled=True)
    elif s.kind == C.ALL_GATHER:
      x = lax.all_gather(x, s.axes, axis=s.dim, tiled=True)
    elif s.kind == C.ALL_TO_ALL:
      x = lax.all_to_all(x, s.axes[0], s.to_dim, s.dim, tiled=True)
    elif s.kind == C.SLICE:
      chunk = x.shape[s.dim] // math.prod(sizes[a] for a in s.axes)
      x = lax.dynamic_slice_in_dim(x, shard_index(s.axes, sizes) * chunk, chunk, s.dim)
    else:
      raise AssertionError(s)
  return x


def _spmd_body(pp) -> Callable:
  program, plan, state = pp.program, pp.plan, pp.state
  sizes = pp.mesh.sizes
  table = state.table

  # Copies a loop reads but does not make, made before the loop: enter op -> (copy, its first
  # (op, operand)).
  hoisted: dict[int, list] = {}
  seen: set = set()
  for (i, k), c in sorted(plan.copy_of.items()):
    first = plan.copies[c].first
    if c not in seen and first != i and program.ops[first].primitive is SCAN_ENTER:
      seen.add(c)
      hoisted.setdefault(first, []).append((c, (i, k)))

  def body(*local_inputs):
    env: list[Any] = [None] * len(program.values)
    for vid, x in zip(program.inputs, local_inputs):
      env[vid] = x
    cache: dict = {}
    copy_of = plan.copy_of

    def value(vid):
      x = env[vid]
      return jnp.asarray(program.values[vid].const) if x is None else x

    def operand(op, k):
      x = value(op.inputs[k])
      c = copy_of.get((op.index, k), -1)
      if c >= 0:
        if c not in cache:
          cache[c] = run_steps(x, plan.ops[op.index].operand_steps[k], sizes)
        x = cache[c]
      return x

    def step(op):
      op_plan = plan.ops[op.index]
      args = [operand(op, k) for k in range(len(op.inputs))]
      rule = LOCAL_RULES.get(op.name)
      if rule is not None:
        outs = rule(op, LocalContext(op, program, sizes, op_plan, table[op.index].factors), args)
      else:
        outs = bind(op, args, op.params)
      for k, vid in enumerate(op.outputs):
        env[vid] = run_steps(outs[k], op_plan.result_steps[k], sizes)

    def loop(r, lo, hi):
      # The enter op's operands and results are resharded as its plan says, the stacked inputs
      # once before the loop; the exit op's operands in every iteration, its results after.
      enter, exit_ = program.ops[lo - 1], program.ops[hi]
      entering, leaving = plan.ops[enter.index], plan.ops[exit_.index]
      n = program.regions[r].num_carry
      for c, (i, k) in hoisted.get(enter.index, ()):
        if c not in cache:
          cache[c] = run_steps(value(program.ops[i].inputs[k]),
                               plan.ops[i].operand_steps[k], sizes)
      operands = [operand(enter, k) for k in range(len(enter.inputs))]
      init = [run_steps(x, entering.result_steps[k], sizes) for k, x in enumerate(operands[:n])]

      def iteration(carries, slices):
        outer = dict(cache)   # copies made in the body are values of this trace only
        for vid, x in zip(enter.outputs, carries):
          env[vid] = x
        for vid, x, steps in zip(enter.outputs[n:], slices, entering.result_steps[n:]):
          env[vid] = run_steps(x, steps, sizes)
        walk(program, lo, hi, step, loop)
        read = [operand(exit_, k) for k in range(len(exit_.inputs) - n)]
        cache.clear()
        cache.update(outer)
        return read[:n], read[n:]

      outs = run_loop(program, r, init + operands[n:], iteration)
      for vid, x, steps in zip(exit_.outputs, outs, leaving.result_steps):
        env[vid] = run_steps(x, steps, sizes)

    walk(program, 0, len(program.ops), step, loop)
    results = []
    for vid in program.outputs:
      x = env[vid]
      if x is None:  # a constant output: replicated, then cut to its sharding.
        v = program.values[vid]
        steps = C.reshard_steps(v.shape, v.dtype.itemsize, ((),) * v.rank, (), "sum",
                                state.dims[vid], sizes)
        x = run_steps(jnp.asarray(v.const), steps, sizes)
      results.append(x)
    return tuple(results)

  return body


def lower_spmd(pp, jax_mesh=None) -> Callable:
  """The per-device program under `shard_map`, called like the original function."""
  program, state = pp.program, pp.state
  mesh = jax_mesh if jax_mesh is not None else pp.mesh.to_jax()
  in_specs = tuple(Sharding(state.dims[v]).spec() for v in program.inputs)
  out_specs = tuple(Sharding(state.dims[v]).spec() for v in program.outputs)
  flat = shard_map(_spmd_body(pp), mesh=mesh, in_specs=in_specs, out_specs=out_specs)

  def run(*args):
    outs = flat(*program.store_inputs(program.flatten_args(args)))
    return jax.tree_util.tree_unflatten(program.out_tree, program.load_outputs(list(outs)))

  run.flat = flat
  return run


class JaxShardings(NamedTuple):
  mesh: Any
  in_shardings: tuple            # pytree of NamedSharding, like the arguments
  out_shardings: Any             # pytree of NamedSharding, like the outputs
  constrained: Callable          # the program with with_sharding_constraint on intermediates
  flat_in: tuple                 # NamedSharding per program input (array leaves only)
  flat_out: tuple                # NamedSharding per program output
  constrained_flat: Callable     # `constrained` on the input leaves, returning output leaves


def to_jax_shardings(pp, jax_mesh=None) -> JaxShardings:
  """Shardings for `jax.jit`. Argument leaves that are constants of the trace (a Python step
  count) get a replicated sharding in `in_shardings`; the program does not read them."""
  program, state = pp.program, pp.state
  mesh = jax_mesh if jax_mesh is not None else pp.mesh.to_jax()
  named = lambda vid: NamedSharding(mesh, Sharding(state.dims[vid]).spec())
  flat_in = tuple(named(v) for v in program.inputs)
  flat_out = tuple(named(v) for v in program.outputs)
  replicated = NamedSharding(mesh, Sharding(()).spec())
  per_leaf, inputs = [], iter(flat_in)
  for i in range(program.in_tree.num_leaves):
    per_leaf.append(replicated if i in program.static else next(inputs))
  in_shardings = jax.tree_util.tree_unflatten(program.in_tree, per_leaf)
  out_shardings = jax.tree_util.tree_unflatten(program.out_tree, list(flat_out))
  constraints = {v.id: named(v.id) for v in program.values
                 if v.producer is not None and v.rank > 0}
  # A value held partial (partial_sums.py) is a leading dimension split over its partial axes:
  # its producer writes each device's summand there, the ops that read it run once per
  # summand, and the op whose result is reduced sums that dimension away.
  # A held loop carry starts as zeros, broadcast to every summand.
  held = pp.plan.held
  for vid, axes in {**held.values, **held.zeros}.items():
    constraints[vid] = NamedSharding(mesh, PartitionSpec(axes, *Sharding(state.dims[vid]).spec()))
  reduced = ({program.ops[j].outputs[0] for j in held.ops} |
             {program.ops[i].outputs[k] for i, ks in held.carries.items() for k in ks}) - set(
                 held.values)
  summands = {vid: math.prod(pp.mesh.sizes[a] for a in axes) for vid, axes in held.zeros.items()}
  # A loop stacks a held value's summands inside each iteration's slice: put them first.
  stacked = {vid for op in program.ops if op.primitive is SCAN_EXIT
             for vid in op.outputs[op.params["num_carry"]:] if vid in held.values}

  def constrain(vid, x):
    if vid in stacked:
      x = jnp.moveaxis(x, 1, 0)
    if vid in reduced:
      x = x.sum(0)
    elif vid in summands:
      x = jnp.broadcast_to(x, (summands[vid],) + x.shape)
    s = constraints.get(vid)
    return x if s is None else lax.with_sharding_constraint(x, s)

  mesh_axes = set(pp.mesh.sizes)
  padded_concats = {op.index for op in program.ops if op.name == "concatenate" and (
      (dims := state.dims[op.outputs[0]])[op.params["dimension"]]
      and {a for d in dims for a in d} != mesh_axes)}

  # A slice whose result is sharded on a dimension its operand has whole: constrained first
  # like its operand, so that XLA cuts each device's piece locally (as the plan does) instead
  # of resharding the operand and exchanging halos with collective-permutes.
  local_slices = {}
  for op in program.ops:
    if op.name == "slice":
      src, out = state.dims[op.inputs[0]], state.dims[op.outputs[0]]
      if any(o and not i for i, o in zip(src, out)):
        local_slices[op.index] = named(op.inputs[0])

  islands = {op.index: _island(pp, op, mesh) for op in program.ops
             if op.name in ISLANDS or op.index in held.leaves}

  # A convolution reads its operands in the plan's layouts (spatial dimensions whole). Left to
  # choose, XLA's CPU SPMD partitioner (jaxlib 0.4.34) computes a wrong filter gradient when the
  # images are split along their width on an axis that splits the labels' batch (found by
  # benchmarks/fuzz_partitioner.py; pinned in tests/partitioner/test_random_schedules.py).
  plan_ops = pp.plan.ops
  read_as_planned = {
      op.index: [NamedSharding(mesh, Sharding(plan_ops[op.index].operand_dims[k]).spec())
                 if k in plan_ops[op.index].reads else None for k in range(len(op.inputs))]
      for op in program.ops if op.name in PLANNED_READS and plan_ops[op.index].reads}

  # A layout the plan makes again in the backward pass (a ZeRO-3 parameter gathered again)
  # is read through an optimization barrier, so that XLA's CSE does not merge it with the
  # forward pass's gather and keep the gathered parameter alive across the step.
  made, again = set(), {}
  for (i, k), c in sorted(pp.plan.copy_of.items(), key=lambda item: item[1]):
    copy = pp.plan.copies[c]
    key = (copy.value, copy.dims)
    if key in made and any(s.kind == C.ALL_GATHER for s in plan_ops[i].operand_steps[k]):
      again.setdefault(i, set()).add(k)
    made.add(key)

  def bind_op(op, args):
    if op.index in again:
      args = [lax.optimization_barrier(a) if k in again[op.index] else a
              for k, a in enumerate(args)]
    shardings = read_as_planned.get(op.index)
    if shardings is not None:
      args = [a if s is None else lax.with_sharding_constraint(a, s)
              for a, s in zip(args, shardings)]
    if op.index in padded_concats:
      return [concatenate_by_padding(args, op.params["dimension"])]
    if op.index in islands:
      return list(islands[op.index](*args))
    if op.index in held.ops:
      return list(jax.vmap(lambda *a: bind(op, a, op.params),
                           in_axes=[0 if v in held.values else None for v in op.inputs])(*args))
    outs = bind(op, args, op.params)
    if op.index in local_slices:
      outs = [lax.with_sharding_constraint(outs[0], local_slices[op.index])]
    return outs

  def constrained_flat(*inputs):
    return tuple(program.evaluate(*inputs, on_result=constrain, bind_op=bind_op))

  def constrained(*args):
    outs = constrained_flat(*program.flatten_args(args))
    return jax.tree_util.tree_unflatten(program.out_tree, list(outs))

  return JaxShardings(mesh, tuple(in_shardings), out_shardings, constrained, flat_in, flat_out,
                      constrained_flat)


# Ops whose resharded operands the jit lowering constrains to the plan's layouts.
PLANNED_READS = frozenset({"conv_general_dilated"})


# Ops the jit lowering runs as they run in the plan, under a one-op `shard_map`. Indexing is
# where XLA's own choices part from the plan: it partitions a scatter into a batch-sharded
# operand by also splitting the updates over the axes that replicate it and summing whole
# results (for GPT-2's cross-entropy gradient a logits-sized all-reduce, 1.5 GiB per step),
# and moves gathered rows with collective-permutes, where the plan indexes locally. A pipeline's
# `stage_shift` moves one row to the neighbouring stage, as its local rule says.
ISLANDS = frozenset({"scatter-add", "scatter", "gather", "stage_shift"})


def _island(pp, op, mesh) -> Callable:
  """One op as the plan runs it: local operands in the plan's layouts, the local rule, the
  result's collectives."""
  program, op_plan, sizes = pp.program, pp.plan.ops[op.index], pp.mesh.sizes
  factors = pp.state.table[op.index].factors
  rule = LOCAL_RULES.get(op.name)

  held = [pp.plan.held.values.get(v) for v in op.outputs]
  held_in = [pp.plan.held.values.get(v) for v in op.inputs]   # one summand here: its own

  def local(*args):
    args = [a[0] if axes else a for a, axes in zip(args, held_in)]
    if rule is not None:
      outs = rule(op, LocalContext(op, program, sizes, op_plan, factors), list(args))
    else:
      outs = bind(op, list(args), op.params)
    return tuple(run_steps(x, steps, sizes) if axes is None else x[None]
                 for x, steps, axes in zip(outs, op_plan.result_steps, held))

  in_specs = tuple(Sharding(d).spec() if axes is None else PartitionSpec(axes, *Sharding(d).spec())
                   for d, axes in zip(op_plan.operand_dims, held_in))
  out_specs = tuple(Sharding(pp.state.dims[v]).spec() if axes is None else
                    PartitionSpec(axes, *Sharding(pp.state.dims[v]).spec())
                    for v, axes in zip(op.outputs, held))
  return shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def concatenate_by_padding(args, dimension: int):
  """`lax.concatenate` as a sum of zero-padded operands: exact, and what the jit lowering emits
  for a concatenate whose concatenated dimension is sharded while other mesh axes replicate
  the result. XLA's SPMD partitioner on CPU (jaxlib 0.4.34) miscompiles that case: the result
  comes back multiplied by the number of replicas (jax-ml/jax#19106)."""
  total = sum(a.shape[dimension] for a in args)
  out, offset = None, 0
  for a in args:
    config = [(0, 0, 0)] * a.ndim
    config[dimension] = (offset, total - offset - a.shape[dimension], 0)
    piece = lax.pad(a, jnp.zeros((), a.dtype), config)
    out = piece if out is None else (out | piece if a.dtype == jnp.bool_ else out + piece)
    offset += a.shape[dimension]
  return out


class JittedProgram:
  """A jitted (lowered, compiled) program over input leaves, called with the original
  arguments: `pp.jit()(*args)`, `pp.jit().lower(*args).compile()(*args)`. Everything else
  (`as_text`, `memory_analysis`, ...) is the wrapped JAX object's."""

  def __init__(self, program, wrapped):
    self.program, self.wrapped = program, wrapped

  def __call__(self, *args):
    """The user's arguments in, the user's results out; where the program holds a value
    otherwise (`Program.layouts`), it is converted on the way (a training loop would convert
    its state once: `program.store_inputs`, then call `wrapped` on leaves)."""
    outs = self.wrapped(*self.program.store_inputs(self.program.flatten_args(args)))
    return jax.tree_util.tree_unflatten(self.program.out_tree,
                                        self.program.load_outputs(list(outs)))

  def lower(self, *args):
    return JittedProgram(self.program, self.wrapped.lower(
        *self.program.store_inputs(self.program.flatten_args(args))))

  def compile(self, *args, **kwargs):
    return JittedProgram(self.program, self.wrapped.compile(*args, **kwargs))

  def __getattr__(self, name):
    return getattr(self.wrapped, name)


def jit_partitioned(pp, jax_mesh=None, donate: bool = False) -> JittedProgram:
  """`jax.jit` of the program with the partitioner's shardings on inputs, outputs and
  intermediates; with `donate`, the state the step updates (parameters, optimizer state) is
  donated, so its new values are written over the old ones as a training loop runs them."""
  s = to_jax_shardings(pp, jax_mesh)
  donated = tuple(sorted(set(pp.program.aliases.values()))) if donate else ()
  return JittedProgram(pp.program, jax.jit(s.constrained_flat, in_shardings=s.flat_in,
                                           out_shardings=s.flat_out, donate_argnums=donated))
