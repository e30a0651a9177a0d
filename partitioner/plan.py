"""The SPMD plan: for every op, what each device reads, computes and communicates.

Derived from the final shardings alone: each op agrees its factor axes from its tensors (the
same merge propagation uses), reads its operands in the layout those axes imply (resharding
where a value is laid out otherwise), produces a local result that is partial over the axes of
its sharded reduction factors, and reshards that into the value's own sharding. Both lowerings
and the cost model read this plan, so the collectives they see are the same.
"""

from __future__ import annotations

from typing import NamedTuple

from partitioner.collectives import SLICE, Collective, Step, reshard_steps
from partitioner.factors import REDUCE_OF_KIND, join_dim
from partitioner.propagation import ShardingState
from partitioner.sharding import Dims, Sharding


class OpPlan(NamedTuple):
  fac_axes: tuple
  operand_dims: tuple[Dims, ...]          # the layout the local op reads
  result: tuple[Sharding, ...]            # what the local op produces (maybe partial)
  operand_steps: tuple[tuple[Step, ...], ...]
  result_steps: tuple[tuple[Step, ...], ...]


class Plan(NamedTuple):
  ops: list[OpPlan]
  collectives: list[Collective]


def _dims(dfs, fac_axes, fsizes, mesh) -> Dims:
  return tuple(() if not fl else fac_axes[fl[0]] if len(fl) == 1 else
               join_dim(fl, fac_axes, fsizes, mesh) for fl in dfs)


def _record(collectives, steps, vid, op):
  for s in steps:
    if s.kind != SLICE:
      collectives.append(Collective(s.kind, s.axes, s.bytes, vid, op, s.reduce))


def make_plan(state: ShardingState) -> Plan:
  program, table, mesh = state.program, state.table, state.sizes
  values = program.values
  plans: list[OpPlan] = []
  collectives: list[Collective] = []
  done: set = set()
  for op in program.ops:
    fac, tensors, n_in, _ = table[op.index]
    fac_axes = tuple(state.merge(op.index))
    operand_dims = tuple(_dims(dfs, fac_axes, fac.sizes, mesh) for _, dfs in tensors[:n_in])
    partial, reduce = (), "sum"
    for f, kind in enumerate(fac.kinds):
      if kind in REDUCE_OF_KIND and fac_axes[f]:
        partial += fac_axes[f]
        reduce = REDUCE_OF_KIND[kind]
    results = tuple(Sharding(_dims(dfs, fac_axes, fac.sizes, mesh), partial, reduce)
                    for _, dfs in tensors[n_in:])
    operand_steps = []
    for vid, want in zip(op.inputs, operand_dims):
      v = values[vid]
      have = ((),) * v.rank if v.is_const else state.dims[vid]
      steps = reshard_steps(v.shape, v.dtype.itemsize, have, (), "sum", want, mesh)
      if steps and (vid, want) not in done:
        done.add((vid, want))
        _record(collectives, steps, vid, op.index)
      operand_steps.append(steps)
    result_steps = []
    for vid, local in zip(op.outputs, results):
      v = values[vid]
      steps = reshard_steps(v.shape, v.dtype.itemsize, local.dims, local.partial, local.reduce,
                            state.dims[vid], mesh)
      _record(collectives, steps, vid, op.index)
      result_steps.append(steps)
    plans.append(OpPlan(fac_axes, operand_dims, results, tuple(operand_steps),
                        tuple(result_steps)))
  return Plan(plans, collectives)
