"""Decoding a policy's line: the environment keeps the best state the line passed through."""

from agents.decoding import PATIENCE, play_best_prefix
from environments import PartitioningEnv, Task

# On this task the line below first loses (data parallelism alone), then gains (Megatron over
# the model axis), then loses again (ZeRO-1 over the model axis after Megatron).
TASK = Task("mlp:mini,batch=1024", "batch=4,model=2")
LINE = ("BatchParallel(batch)", "Megatron(model)", "ZeRO(model, stage=1)", "Finish")
# Each loses after data parallelism and Megatron: a line of them stops after PATIENCE.
LOSING = ("BatchParallel(model)", "ZeRO(model, stage=1)", "Megatron(batch)")


def _scripted(env):
  moves = iter(env.action_index(t) for t in LINE)
  return lambda observation: next(moves)


def test_the_line_is_kept_up_to_its_best_state_not_its_first_loss():
  env = PartitioningEnv(TASK)
  env.reset()
  scores, trial = [env.score()], env.clone()
  for text in LINE[:-1]:
    trial.step(trial.action_index(text))
    scores.append(trial.score())
  assert scores[1] < scores[0] < scores[2] and scores[3] < scores[2]   # the line's shape
  play_best_prefix(env, _scripted(env))
  assert env.done
  assert [env.action_name(a) for a in env.history] == [*LINE[:2], "Finish"]
  assert env.score() == scores[2]


def test_a_line_that_never_beats_its_start_finishes_at_once():
  env = PartitioningEnv(TASK)
  env.reset()
  env.step(env.action_index("BatchParallel(batch)"))
  env.step(env.action_index("Megatron(model)"))
  start = env.score()
  moves = iter([env.action_index("ZeRO(model, stage=1)"), env.finish_action])
  play_best_prefix(env, lambda observation: next(moves))
  assert [env.action_name(a) for a in env.history][2:] == ["Finish"]
  assert env.done and env.score() == start


def test_the_line_runs_past_where_the_policy_would_finish():
  # A policy that would finish at once: with finish masked it plays on, and the line's gain
  # (Megatron over the model axis after data parallelism) is kept.
  env = PartitioningEnv(TASK)
  env.reset()
  then = iter(env.action_index(t) for t in (*LINE[:2], *LOSING))

  def finish_first(observation):
    return env.finish_action if observation["action_mask"][env.finish_action] else next(then)

  play_best_prefix(env, finish_first)
  assert [env.action_name(a) for a in env.history] == [*LINE[:2], "Finish"]


def test_the_line_stops_after_patience_actions_without_a_new_best():
  env = PartitioningEnv(TASK)
  env.reset()
  env.step(env.action_index("BatchParallel(batch)"))
  env.step(env.action_index("Megatron(model)"))
  start, trial = env.score(), env.clone()
  for text in LOSING:                  # the premise: none of them is a new best
    trial.step(trial.action_index(text))
    assert trial.score() < start
  asked = []

  def scripted(observation):
    asked.append(1)
    return env.action_index((*LOSING, "ZeRO(batch, stage=2)")[len(asked) - 1])

  play_best_prefix(env, scripted)
  assert len(asked) == PATIENCE == len(LOSING)
  assert [env.action_name(a) for a in env.history][2:] == ["Finish"]
  assert env.score() == start
