"""Playing a trained policy in an environment: greedy decoding, or MCTS guided by the policy.

Needs neither Reverb nor TensorFlow, so `propose` and the `Auto` tactic stay light. Loading a
policy from a run directory is the learners' side (`learners.policies.load_policy`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from agents.networks import Networks
from agents.ppo.networks import make_policy
from environments.actions import ends_episode
from partitioner.errors import ShardzeroError


class TrainedPolicy(NamedTuple):
  networks: Networks
  params: Any
  version: int          # learner updates behind the parameters
  max_steps: int        # the episode length it was trained for
  run_dir: str


PATIENCE = 3   # actions in a row without a new best state before a decoded line stops


def play_best_prefix(env, choose: Callable[[dict], int], cut: bool = True) -> None:
  """Plays `choose(observation)` from `env`'s state in a clone until the episode ends, then
  plays in `env` the prefix of that line whose state scores best (the earliest of equals) and
  finishes. The environment costs every state it passes through, so this costs no simulation;
  it undoes the trailing actions a policy takes on meshes larger than it was trained on (a
  data-parallel tiling over the model axis after Megatron).

  `choose` sees finish masked while anything else is legal, so the line runs on past where
  the policy would finish and the simulator, not the policy, says where it ends: a policy stops
  early where its train tasks stopped (ZeRO over the model axis, then finish, leaving a 32-way
  batch axis idle on 256 devices), and the best prefix drops whatever a longer line gets wrong.
  The line stops once `PATIENCE` actions in a row have not beaten its best state, which keeps
  a proposal on a large program under a second or two, or where the policy cuts or recomputes
  a state that fits: that ends the episode on a slower plan, and pricing it would trace the
  whole step again (0.8 s on Megatron-LM's 1.7B). Where that state is over the memory
  budget, or is one the line rewrote to fit (it ends cut into micro-batches or recomputed),
  it and the states before it are rewritten the policy's way (`_cut_back`; not without
  `cut`); then a move of the line is dropped wherever the line scores higher without it
  (`pruned`): the policy proposes, the simulator says which of its proposals stands."""
  if env.done:
    return
  start, line = len(env.history), env.clone()
  best, best_score = 0, line.score()
  observation, done = line.observation(), False
  while not done and len(line.history) - start - best < PATIENCE:
    a = choose(_without_finish(observation, line.finish_action))
    if line.fits and ends_episode(line.action_name(a)):
      break   # a cut or recomputation of a state that fits only costs time
    ts = line.step(a)
    observation, done = ts.observation, ts.last()
    if line.score() > best_score + 1e-12:
      best, best_score = len(line.history) - start, line.score()
  moves = list(line.history[start:start + best])
  rewritten = bool(moves) and ends_episode(env.action_name(moves[-1]))
  if cut and (rewritten or not _after(env, moves).fits):
    moves = _cut_back(env, moves, choose)
  moves, _ = pruned(env, moves, score_of(env, moves))
  for a in moves:
    env.step(a)
  if not env.done:
    env.step(env.finish_action)


def score_of(env, moves) -> float | None:
  """env.score() after `moves` from `env`'s state in a clone; None where one is not legal."""
  trial = env.clone()
  for a in moves:
    if trial.done or a not in trial.legal_actions():
      return None
    trial.step(a)
  return trial.score()


def pruned(env, moves: list[int], score: float, tolerance: float = -1e-12):
  """(`moves` without each move, the last first, whose line without it scores at least
  `score - tolerance`, and the line's score). By default only a move the line scores higher
  without goes: one that saves memory the plan did not need, or that a later move made
  needless (a policy's line on HF Llama 7B at 64 H100s, ZeRO-3 over the batch axis across
  nodes and then over the node's model axis, recomputed, is 2.24 s; without the first ZeRO it
  fits at 1.39 s, the plan the shipped policy plays). Demonstrations drop moves worth less
  than a tolerance too. A simulation per line tried (states are cached): under 0.5 s on the
  7B tasks."""
  for i in reversed(range(len(moves))):
    rest = moves[:i] + moves[i + 1:]
    without = score_of(env, rest)
    if without is not None and without >= score - tolerance:
      moves, score = rest, max(score, without)
  return moves, score


def _after(env, moves):
  """A clone of `env` after `moves` (states the line passed through are cached)."""
  trial = env.clone()
  for a in moves:
    trial.step(a)
  return trial


def _cut_back(env, moves: list[int], choose: Callable[[dict], int]) -> list[int]:
  """Where the line's best state is over the memory budget (so is every state of the line: one
  that fits scores higher), or ends rewritten (cut or recomputed, after states that did not
  fit): the states of the line from it back toward the start, each cut into micro-batches or
  recomputed as the policy would (`_cut_in_turn`), while one of those fits; the best of them
  (and of the line's own, where it ended rewritten). A move that saves memory at a cost in
  time (ZeRO-3 over an axis across nodes) is what a line over the budget ends with, and what a
  rewrite makes needless: on HF Llama 7B at 64 H100s the line's best state cut is 1.46x the
  state before it, cut; at 1,024 H100s the line recomputed after ZeRO-2 over the batch axis is
  1.38x the state before that ZeRO, recomputed."""
  ends_cut = bool(moves) and ends_episode(env.action_name(moves[-1]))
  candidates = []
  if ends_cut:
    candidates.append((_after(env, moves).score(), moves))
    moves = moves[:-1]
  for i in range(len(moves), -1, -1):
    trial = _after(env, moves[:i])
    cut = _cut_in_turn(trial, choose)
    candidates.append((trial.score(), moves[:i] + ([cut] if cut is not None else [])))
    if not trial.fits:
      break
  return max(candidates, key=lambda c: c[0])[1]


def _cut_in_turn(env, choose: Callable[[dict], int]) -> int | None:
  """The policy's cuts of the batch into micro-batches and its recomputation of the
  activations (`Microbatch(k)`, `Remat()`: each ends the episode) in `env`'s state, its most
  likely first, until one fits; where none does, the one that scores best, if it beats the
  state as it is. Played in `env`; returns it (None: none). None is tried where the inputs
  alone (parameters, optimizer state, batch) are over the budget: neither rewrite shrinks them,
  and each traces the whole step again (seconds a try on a 7B model)."""
  if env.cost.memory.argument_bytes >= env.context.budget:
    return None
  observation = env.observation()
  cuts = {int(a) for a in env.legal_actions() if ends_episode(env.action_name(a))}
  best, best_score = None, env.score()
  while cuts:
    mask = np.zeros_like(observation["action_mask"])
    mask[sorted(cuts)] = True
    a = choose({**observation, "action_mask": mask})
    if a not in cuts:
      break
    cuts.discard(a)
    trial = env.clone()
    trial.step(a)
    if trial.fits:
      best = a
      break
    if trial.score() > best_score:
      best, best_score = a, trial.score()
  if best is not None:
    env.step(best)
  return best


def _without_finish(observation: dict, finish: int) -> dict:
  """`observation` with finish masked out where another action is legal."""
  mask = observation["action_mask"]
  if not mask[finish] or mask.sum() == 1:
    return observation
  mask = mask.copy()
  mask[finish] = False
  return {**observation, "action_mask": mask}


def greedy_decoder(networks: Networks, cut: bool = True) -> Callable[[Any, Any], None]:
  """`decode(env, params)`: the policy's most likely legal action but finish at each state,
  kept up to the best state of that line (`play_best_prefix`). One compilation per
  observation size bucket, shared by every call."""
  policy = make_policy(networks, evaluation=True)
  key = jax.random.PRNGKey(0)

  def decode(env, params) -> None:
    play_best_prefix(env, lambda observation: int(policy(params, key, observation)[0]), cut)

  decode.policy = policy
  return decode


def play_policy(env, policy: TrainedPolicy, search: str = "greedy",
                budget: int = 50, cut: bool = True) -> tuple[float, int]:
  """Plays `policy` in `env` from its current state to the end: greedy decoding (the most
  likely legal action but finish, kept up to the best state of that line: `play_best_prefix`),
  or MCTS with `budget` simulations guided by the policy's prior and value, which also decodes
  greedily and plays the better of the two (a small search need not pass through the greedy
  line). Returns (seconds spent deciding and applying, simulations). The first call for a size
  bucket compiles; the timing is taken after a warm-up call."""
  from agents.alphazero.networks import make_search_fns
  from agents.search.mcts import MCTSActor
  from agents.search.planning import path_to, play
  if search not in ("greedy", "mcts"):
    raise ShardzeroError(f"unknown policy search {search!r}; use greedy or mcts")
  networks, params = policy.networks, policy.params
  decode = greedy_decoder(networks, cut)
  decode.policy(params, jax.random.PRNGKey(0), env.observation())[0].block_until_ready()
  start = time.perf_counter()
  simulations = 0
  if search == "mcts":
    prior_fn, value_fn = make_search_fns(networks, lambda: params)
    mcts = MCTSActor(env, budget=budget, prior_fn=prior_fn, value_fn=value_fn)
    plan = mcts.plan(env.clone())
    simulations = plan.simulations
    line = env.clone()
    decode(line, params)
    better = line.score() > plan.score + 1e-12
    play(env, path_to(line, len(env.history)) if better else plan.actions)
  else:
    decode(env, params)
  return time.perf_counter() - start, simulations
