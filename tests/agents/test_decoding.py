"""Decoding a policy's line: the environment keeps the best state the line passed through."""

from agents.decoding import play_best_prefix
from environments import PartitioningEnv, Task

# On this task the line below first loses (data parallelism alone), then gains (Megatron over
# the model axis), then loses again (ZeRO-1 over the model axis after Megatron).
TASK = Task("mlp:mini,batch=1024", "batch=4,model=2")
LINE = ("BatchParallel(batch)", "Megatron(model)", "ZeRO(model, stage=1)", "Finish")


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
