"""`Auto(axes, agent=...)` inside a manual schedule: the agent acts only over its axes, from the
state the schedule reached, and the schedule applies what it chose."""

import pytest

import partitioner as P
from launch import auto as launch_auto
from agents.search.auto import chosen_tactics, solve, sub_environment
from agents.search.mcts import MCTSActor
from environments import Task
from environments.tasks import data_parallel_peak, load_program
from partitioner.cost import simulate
from partitioner.tactics import AutoRequest

MESH = "batch=4,model=2"


@pytest.fixture(scope="module")
def program():
  return load_program("gpt:mini")


def _axes_used(pp, start):
  return {a for r in pp.reports[start:] for t in r.targets for a in t.axes}


def test_auto_shards_only_its_axes_and_beats_the_prefix(program):
  prefix = P.apply(program, MESH, "BatchParallel(batch)")
  pp = prefix.apply("Auto(model, agent=mcts, budget=20)", solve)
  assert _axes_used(pp, 1) == {"model"}
  assert simulate(pp, "h100").step_time_s < 0.8 * simulate(prefix, "h100").step_time_s
  chose = [n for n in pp.reports[-1].notes if n.startswith("chose: ")]
  assert chose and chose[0] != "chose: nothing"
  # The same schedule chooses the same tactics, and replaying them gives the same shardings.
  again = P.apply(program, MESH, pp.strategy, solve)
  assert again.reports[-1].notes == pp.reports[-1].notes
  replay = prefix.apply(chose[0].removeprefix("chose: "))
  assert replay.state.dims == pp.state.dims


def test_auto_applies_what_the_environment_reached(program):
  prefix = P.apply(program, MESH, "BatchParallel(batch)")
  tactic = P.Auto("model", agent="mcts", budget=20)
  env = sub_environment(AutoRequest(tactic, prefix.state.copy(), prefix.schedule, ("model",)), 12)
  assert env.cost.step_time_s == pytest.approx(simulate(prefix, "h100").step_time_s)
  actor = MCTSActor(env, budget=20)
  ts = env.reset()
  while not ts.last():
    ts = env.step(actor.select_action(ts.observation))
  pp = prefix.apply(tactic, solve)
  assert [str(t) for t in chosen_tactics(env)] == \
      pp.reports[-1].notes[-1].removeprefix("chose: ").split("; ")
  assert simulate(pp, "h100").step_time_s == pytest.approx(env.cost.step_time_s)


def test_every_agent_runs_and_a_tight_budget_is_respected(program):
  budget = 1800 * 2**20
  assert data_parallel_peak(Task("gpt:mini", MESH)) > budget   # data parallelism misses it
  for agent in ("greedy", "mcts", "beam", "random"):
    pp = P.apply(program, MESH, f"Auto(batch+model, agent={agent}, budget=40, memory={budget})", solve)
    assert pp.reports[-1].notes[-1].startswith("chose: ")
    if agent in ("greedy", "mcts"):
      assert simulate(pp, "h100").peak_memory_bytes <= budget


def test_auto_without_a_solver_is_a_clear_error(program):
  with pytest.raises(P.ScheduleError, match="needs a solver"):
    P.apply(program, MESH, "BatchParallel(batch); Auto(model)")


def test_bad_auto_arguments_are_named(program):
  with pytest.raises(P.MeshError, match="expert"):
    P.apply(program, MESH, "Auto(expert)", solve)
  with pytest.raises(P.ScheduleError, match="unknown agent 'annealing'"):
    P.apply(program, MESH, "Auto(model, agent=annealing)", solve)
  with pytest.raises(P.ScheduleError, match="budget must be positive"):
    P.apply(program, MESH, "Auto(model, agent=mcts, budget=0)", solve)
  with pytest.raises(P.ShardzeroError, match="not a training run"):
    P.apply(program, MESH, "Auto(model, policy=/nonexistent/run)", launch_auto.solve)
  with pytest.raises(P.ScheduleError, match="loads trained policies"):
    P.apply(program, MESH, "Auto(model, policy=runs/demo)", solve)
  with pytest.raises(P.ShardzeroError, match="bad memory size"):
    P.apply(program, MESH, "Auto(model, memory=lots)", solve)
