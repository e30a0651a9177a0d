"""Incremental planning and simulation give exactly what computing from scratch gives."""

import functools

import numpy as np
import pytest

import corpus
import partitioner as P
from partitioner.cost import Simulator
from partitioner.cost.compute import op_cost
from partitioner.plan import make_plan
from partitioner.propagation import factor_table

MESH = "batch=2,model=4"
TACTICS = ["BatchParallel(batch)", "Megatron(model)", "ZeRO(batch, stage=3)"]


@functools.lru_cache(maxsize=None)
def traced(spec):
  workload = corpus.load(spec)
  return P.trace(workload.fn, *workload.args)


def chain(program):
  """The partitioned programs of an episode: one more tactic at each step."""
  pps = [P.apply(program, MESH)]
  for tactic in TACTICS:
    pps.append(pps[-1].apply(tactic))
  return pps


@pytest.mark.parametrize("spec", ["mlp:small", "gpt:small"])
def test_incremental_plan_equals_the_plan_from_scratch(spec):
  program = traced(spec)
  pps = chain(program)
  for parent, child in zip(pps, pps[1:]):
    parent.plan
    assert child.parent is parent and child.state.changed
    assert child.plan == make_plan(child.state)


@pytest.mark.parametrize("spec", ["mlp:small", "gpt:small"])
def test_incremental_simulation_equals_simulation_from_scratch(spec):
  program = traced(spec)
  pps = chain(program)
  sim = Simulator(program, pps[0].mesh, "h100")
  fresh_sim = Simulator(program, pps[0].mesh, "h100")
  for pp in pps:
    incremental = sim(pp)  # each program's parent was simulated just before
    fresh = fresh_sim(P.apply(program, MESH, pp.schedule))
    assert incremental.to_dict() == fresh.to_dict()
    assert incremental.collectives == fresh.collectives


@pytest.mark.parametrize("spec", ["mlp:small", "gpt:small"])
def test_array_costs_equal_per_op_costs_from_the_plan(spec):
  """Ops that read and write their values as laid out are costed all at once with arrays; that
  must equal costing every op from its plan."""
  program = traced(spec)
  for pp in chain(program):
    sim = Simulator(program, pp.mesh, "h100")
    _, flops, nbytes = sim.costs(pp)
    exact = np.array([op_cost(op, op_plan, w, factor_table(program), sim.work, pp.state.dims,
                              sim.divisors.count)
                      for op, op_plan, w in zip(program.ops, pp.plan.ops, sim.work.work)])
    np.testing.assert_allclose(flops, exact[:, 0], rtol=1e-12)
    np.testing.assert_allclose(nbytes, exact[:, 1], rtol=1e-12)


def test_a_child_whose_parent_is_gone_is_simulated_from_scratch():
  program = traced("mlp:small")
  child = P.apply(program, MESH).apply("BatchParallel(batch)")
  assert child.parent is None  # the parent was only referenced weakly
  sim = Simulator(program, child.mesh, "h100")
  assert sim(child).to_dict() == sim(P.apply(program, MESH, "BatchParallel(batch)")).to_dict()
