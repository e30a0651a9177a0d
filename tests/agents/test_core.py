"""Acme's interfaces as the project carries them: the loop, counters, loggers, specs."""

import csv

import dm_env
import numpy as np
import pytest
from dm_env import specs as dm_specs

from agents import core
from agents.counting import Counter
from agents.environment_loop import EnvironmentLoop
from agents.loggers import CSVLogger, Dispatcher, InMemoryLogger, TerminalLogger
from agents.specs import make_environment_spec


class Countdown(dm_env.Environment):
  """Episodes of `length` steps; the reward is the action taken."""

  def __init__(self, length=3):
    self.length, self.t = length, 0

  def reset(self):
    self.t = 0
    return dm_env.restart(np.int32(self.t))

  def step(self, action):
    self.t += 1
    if self.t >= self.length:
      return dm_env.termination(float(action), np.int32(self.t))
    return dm_env.transition(float(action), np.int32(self.t))

  def observation_spec(self):
    return dm_specs.Array((), np.int32)

  def action_spec(self):
    return dm_specs.DiscreteArray(3)


class Recorder(core.Actor):
  def __init__(self):
    self.seen, self.updates = [], 0

  def select_action(self, observation):
    return 2

  def observe_first(self, timestep):
    self.seen.append(("first", int(timestep.observation)))

  def observe(self, action, next_timestep):
    self.seen.append((action, int(next_timestep.observation), next_timestep.last()))

  def update(self, wait=False):
    self.updates += 1


def test_environment_loop_runs_episodes_and_counts():
  actor, logger, counter = Recorder(), InMemoryLogger(), Counter()
  loop = EnvironmentLoop(Countdown(3), actor, counter, logger)
  assert loop.run(num_episodes=2) == 6
  assert actor.seen[:4] == [("first", 0), (2, 1, False), (2, 2, False), (2, 3, True)]
  assert actor.updates == 6
  assert [r["episode_return"] for r in logger.data] == [6.0, 6.0]
  assert logger.data[-1]["episodes"] == 2 and logger.data[-1]["steps"] == 6
  assert loop.run(num_steps=4) == 6  # whole episodes: stops after the one that crosses 4
  with pytest.raises(ValueError):
    loop.run(num_episodes=-1)


def test_counters_are_hierarchical_and_saveable():
  root = Counter()
  actor = Counter(root, "actor")
  learner = Counter(root, "learner", return_only_prefixed=True)
  actor.increment(steps=5)
  learner.increment(steps=2)
  assert root.get_counts() == {"actor_steps": 5, "learner_steps": 2}
  assert actor.get_counts() == {"actor_steps": 5, "learner_steps": 2, "steps": 5}
  assert learner.get_counts() == {"learner_steps": 2, "steps": 2}
  saved = actor.save()
  fresh = Counter(Counter(), "actor")
  fresh.restore(saved)
  assert fresh.get_counts()["steps"] == 5


def test_loggers_write_terminal_lines_and_csv(tmp_path):
  lines = []
  TerminalLogger("actor", print_fn=lines.append).write({"episode_return": np.float32(1.5),
                                                        "steps": 3})
  assert lines == ["[Actor] Episode Return = 1.5 | Steps = 3"]
  logger = CSVLogger(str(tmp_path), label="learner")
  Dispatcher([logger, InMemoryLogger()]).write({"step": 1, "loss": 0.5})
  logger.write({"step": 2, "loss": 0.25})
  with pytest.raises(ValueError, match="new columns"):
    logger.write({"step": 3, "other": 1})
  logger.close()
  resumed = CSVLogger(str(tmp_path), label="learner")  # appends under the same header
  resumed.write({"loss": 0.125, "step": 3})
  resumed.close()
  rows = list(csv.DictReader(open(tmp_path / "learner.csv")))
  assert [(r["step"], r["loss"]) for r in rows] == [("1", "0.5"), ("2", "0.25"), ("3", "0.125")]


def test_a_row_torn_by_a_crash_is_dropped_and_lost_updates_are_cut(tmp_path):
  from agents.loggers import truncate_csv
  path = tmp_path / "learner.csv"
  logger = CSVLogger(str(path))
  for step in (1, 2, 3, 4):
    logger.write({"steps": step, "loss": 1.0 / step})
  logger.close()
  with open(path, "a") as f:
    f.write("5,0.1")                     # killed mid-row: no line end
  appending = CSVLogger(str(path))       # a restarted writer drops the torn row
  assert truncate_csv(str(path), "steps", 2) == 2    # rows 3 and 4: updates the crash lost
  appending.write({"steps": 3, "loss": 0.3})         # goes on at the new end of the file
  appending.close()
  rows = list(csv.DictReader(open(path)))
  assert [(r["steps"], r["loss"]) for r in rows] == [("1", "1.0"), ("2", "0.5"), ("3", "0.3")]
  assert truncate_csv(str(path), "steps", 10) == 0
  assert truncate_csv(str(tmp_path / "missing.csv"), "steps", 0) == 0


def test_environment_spec_and_learner_defaults():
  spec = make_environment_spec(Countdown())
  assert spec.actions.num_values == 3 and spec.observations.dtype == np.int32

  class Stepper(core.Learner):
    steps = 0

    def step(self):
      self.steps += 1

    def get_variables(self, names):
      return [{"steps": self.steps} for _ in names]

  learner = Stepper()
  learner.run(num_steps=4)
  assert learner.get_variables(["policy"]) == [{"steps": 4}]
  with pytest.raises(NotImplementedError):
    learner.save()
