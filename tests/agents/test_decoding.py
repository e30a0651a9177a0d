"""Decoding a policy's line: the environment keeps the best state the line passed through, cut
into micro-batches in the policy's order where it is over the budget."""

from agents.decoding import PATIENCE, play_best_prefix
from environments import PartitioningEnv, Task
from environments.actions import ends_episode

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
  # The best prefix is the first two moves; data parallelism is then dropped, as Megatron
  # alone scores higher still on this task (`pruned`).
  assert [env.action_name(a) for a in env.history] == [LINE[1], "Finish"]
  assert env.score() > scores[2]


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
  assert [env.action_name(a) for a in env.history] == [LINE[1], "Finish"]   # pruned, as above


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


def test_a_best_state_over_the_budget_ends_with_the_policy_s_first_cut_that_fits():
  """gpt:mini at 8 sequences a device, in 60% of the smallest peak any hand schedule reaches,
  after ZeRO-3 over both axes (then only cuts into micro-batches and recomputation are legal):
  the line ends cutting into 2, which does not fit, so it is taken back and the policy asked
  for its cuts, most likely first: 2 again, then 4, which fits and ends the episode."""
  from environments.tasks import smallest_expert_peak
  task = Task("gpt:mini,batch=64", "batch=2,model=4")
  env = PartitioningEnv(Task(task.model, task.mesh, "h100",
                             int(0.6 * smallest_expert_peak(task))))
  env.reset()
  for text in ("BatchParallel(batch)", "ZeRO(batch)", "ZeRO(model)"):
    env.step(env.action_index(text))
  names = lambda mask: {env.action_name(a) for a in mask.nonzero()[0]}
  cuts = {"Microbatch(2)", "Microbatch(4)", "Microbatch(8)", "Microbatch(16)", "Remat()"}
  assert names(env.observation()["action_mask"]) == cuts | {"Finish"}
  cut = lambda k: env.action_index(f"Microbatch({k})")
  answers, offered = iter([cut(2), cut(2), cut(4)]), []

  def policy(observation):
    offered.append(names(observation["action_mask"]))
    return next(answers)

  play_best_prefix(env, policy)
  assert [env.action_name(a) for a in env.history][3:] == ["Microbatch(4)"]
  assert env.done and env.fits
  assert offered == [cuts] * 2 + [cuts - {"Microbatch(2)"}]


def test_a_line_over_the_budget_is_cut_where_it_pays_most_walking_back():
  """gpt:mini at 8 sequences a device on 32 H100s (4 nodes), in 45% of the smallest peak any
  hand schedule reaches. The line's best state ends with ZeRO-3 over the batch axis, across
  nodes; it ended cutting into 2, which does not fit. Cut the policy's way (its smallest count
  that fits, here), the state before that ZeRO is faster, and the one before that fits no cut:
  the walk back stops there."""
  from environments.tasks import smallest_expert_peak
  task = Task("gpt:mini,batch=256", "batch=4,model=8")
  env = PartitioningEnv(Task(task.model, task.mesh, "h100",
                             int(0.45 * smallest_expert_peak(task))))
  env.reset()
  plan = ("BatchParallel(batch)", "BatchParallel(model)", "ZeRO(model)", "ZeRO(batch)")
  line = iter([*(env.action_index(t) for t in plan), env.action_index("Microbatch(2)")])
  count = lambda a: int(env.action_name(a)[len("Microbatch("):-1])

  def policy(observation):
    legal = observation["action_mask"].nonzero()[0]
    if all(ends_episode(env.action_name(a)) for a in legal):   # cuts: the smallest count first
      counts = [a for a in legal if env.action_name(a) != "Remat()"]
      return int(min(counts, key=count)) if counts else int(legal[0])   # then recomputation
    return next(line)

  scores = {}
  for n in (3, 4):
    for k in (2, 4):
      trial = env.clone()
      for text in plan[:n] + (f"Microbatch({k})",):
        trial.step(trial.action_index(text))
      scores[n, k] = (trial.fits, trial.score())
  assert not scores[4, 2][0] and not scores[3, 2][0]             # the premises
  assert scores[3, 4][0] and scores[4, 4][0] and scores[3, 4][1] > scores[4, 4][1]
  play_best_prefix(env, policy)
  assert [env.action_name(a) for a in env.history] == [*plan[:3], "Microbatch(4)"]
  assert env.done and env.fits and env.score() == scores[3, 4][1]


def test_a_line_that_ends_recomputed_is_recomputed_where_it_pays_most_walking_back():
  """gpt:mini at 8 sequences a device on 32 H100s in 1,900 MiB: no state of the line fits
  whole; it ends recomputing its activations after ZeRO-3 over the batch axis, across nodes,
  which fits. Recomputed one state earlier it fits too, and faster: the ZeRO was needless once
  recomputed. Two states earlier, recomputed, it does not fit: the walk back stops there."""
  env = PartitioningEnv(Task("gpt:mini,batch=256", "batch=4,model=8", "h100", 1900 * 2**20))
  env.reset()
  plan = ("BatchParallel(batch)", "BatchParallel(model)", "ZeRO(model)", "ZeRO(batch)")
  line = iter([*(env.action_index(t) for t in plan), env.action_index("Remat()")])
  remat = env.action_index("Remat()")

  def policy(observation):
    legal = observation["action_mask"].nonzero()[0]
    if all(ends_episode(env.action_name(a)) for a in legal):   # recomputation, nothing else
      return remat if remat in legal else env.finish_action
    return next(line)

  states = {}
  for n in (2, 3, 4):
    trial = env.clone()
    for text in plan[:n]:
      trial.step(trial.action_index(text))
    whole = trial.fits
    trial.step(remat)
    states[n] = (whole, trial.fits, trial.score())
  assert not any(whole for whole, _, _ in states.values())          # the premises
  assert states[4][1] and states[3][1] and not states[2][1] and states[3][2] > states[4][2]
  play_best_prefix(env, policy)
  assert [env.action_name(a) for a in env.history] == [*plan[:3], "Remat()"]
  assert env.done and env.fits and env.score() == states[3][2]


def test_from_a_state_that_fits_no_cut_or_recomputation_scores_higher():
  """What lets a line stop where the policy cuts or recomputes a state that fits: each ending
  costs time (the step's loop, the weights read again per micro-batch, the forward pass run
  twice) and the state fitted already."""
  env = PartitioningEnv(Task("gpt:mini,batch=16", "batch=2,model=4", "h100"))
  env.reset()
  for text in ("", "BatchParallel(batch)", "Megatron(model)", "ZeRO(batch)"):
    if text:
      env.step(env.action_index(text))
    assert env.fits
    endings = [a for a in env.legal_actions() if ends_episode(env.action_name(a))]
    assert len(endings) == 4          # Microbatch(2, 4, 8) and Remat()
    for a in endings:
      trial = env.clone()
      trial.step(a)
      assert trial.score() <= env.score(), (text, env.action_name(a))


def test_a_line_stops_unpriced_where_the_policy_cuts_a_state_that_fits(monkeypatch):
  """Pricing a cut traces the whole step again (0.8 s on Megatron-LM's 1.7B): where the state
  fits, the line stops instead and keeps its best state."""
  from environments.partitioning_env import TaskContext
  env = PartitioningEnv(Task("gpt:mini,batch=16", "batch=2,model=4", "h100"))
  env.reset()
  rewritten = []
  original = TaskContext._rewritten
  monkeypatch.setattr(TaskContext, "_rewritten",
                      lambda *a: rewritten.append(a[-1]) or original(*a))
  moves = iter(env.action_index(t) for t in
               ("BatchParallel(batch)", "Megatron(model)", "Microbatch(2)"))
  play_best_prefix(env, lambda observation: next(moves))
  assert [env.action_name(a) for a in env.history] == [
      "BatchParallel(batch)", "Megatron(model)", "Finish"]
  assert rewritten == []


def test_a_move_the_line_scores_higher_without_is_dropped():
  """A tiling of one weight over the model axis after Megatron loses; the ZeRO-2 over the
  batch axis after it gains, so the line's best state holds both. Without the tiling the same
  line scores higher still: the decoded plan drops it (`pruned`)."""
  env = PartitioningEnv(TASK)
  env.reset()
  line = ("BatchParallel(batch)", "Megatron(model)", "Tile(params/mlp/layer_2/w, 0, model)",
          "ZeRO(batch, stage=2)")

  def score(texts):
    trial = env.clone()
    for text in texts:
      trial.step(trial.action_index(text))
    return trial.score()
  scores = [score(line[:n]) for n in range(5)]
  without = score(line[:2] + line[3:])
  assert scores[3] < scores[2] < scores[4] < without          # the premises
  moves = iter([*(env.action_index(t) for t in line), env.finish_action])
  play_best_prefix(env, lambda observation: next(moves))
  played = [env.action_name(a) for a in env.history]
  assert line[2] not in played and played[-2:] == [line[3], "Finish"]
  assert env.score() >= without
