"""The processes of a training run and what they share: the run directory, its config, and one
function per role (replay, learner, actor, evaluator). Every role takes the Reverb address, so
the same functions run as local processes (`launch/train_command.py`) or on other machines.

A run directory holds `config.json`, `checkpoint.ckpt` (parameters, optimizer state, counters:
arrays and JSON, `learners/checkpointing.py`), `logs/*.csv` (one per process), `tb/`
(TensorBoard scalars) and `logs/*.log` (each process's output when the local launcher started
it).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import Optional

import numpy as np

from learners.run_config import RunConfig
from partitioner.errors import ShardzeroError

SIGTERM_GRACE_S = 20.0   # a SIGTERM'd role's time to end: what `processes.terminate_all` waits


def stop_on_sigterm(watchdog: bool = False):
  """SIGTERM ends the process the way Ctrl-C does (cleanup runs, the checkpoint is kept). A
  role blocked in a native call never returns to Python to see it: an actor whose Ray worker
  was killed stayed in a Reverb insert held by the rate limiter, orphaned, until the machine
  was cleaned. With `watchdog` (the roles; not a launcher, which stops its roles first) the
  signal also wakes a thread (`signal.set_wakeup_fd` writes to it even while the main thread
  is blocked) that ends the process `SIGTERM_GRACE_S` later if it is still running."""
  def handler(signum, frame):
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, handler)
  if not watchdog:
    return
  read, write = os.pipe()
  os.set_blocking(write, False)
  signal.set_wakeup_fd(write)

  def end_later():
    while signal.SIGTERM not in os.read(read, 64):
      pass
    time.sleep(SIGTERM_GRACE_S)
    os._exit(128 + signal.SIGTERM)

  threading.Thread(target=end_later, name="sigterm-watchdog", daemon=True).start()


def _client(address: str, wait_s: float = 120.0):
  import reverb
  client = reverb.Client(address)
  deadline = time.time() + wait_s
  while True:
    try:
      client.server_info(timeout=5)
      return client
    except Exception:
      if time.time() > deadline:
        raise ShardzeroError(f"no Reverb server answers at {address}")
      time.sleep(0.5)


def _tensorboard(run_dir: str, label: str):
  """A function writing scalars to `run_dir/tb/label`."""
  import tensorflow as tf
  writer = tf.summary.create_file_writer(os.path.join(run_dir, "tb", label))

  def write(step: int, data: dict):
    with writer.as_default():
      for key, value in data.items():
        if isinstance(value, (int, float, np.floating, np.integer)):
          tf.summary.scalar(key, float(value), step=int(step))
    writer.flush()
  return write


def _last_row(path: str) -> Optional[dict]:
  import csv
  if not os.path.exists(path):
    return None
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  return rows[-1] if rows else None


# ---------------------------------------------------------------------------------------- roles
def run_replay(config: RunConfig, port: int) -> None:
  """Serves the trajectory and parameter tables until stopped."""
  import reverb
  stop_on_sigterm(watchdog=True)
  server = reverb.Server(config.builder().make_replay_tables(), port=port)
  try:
    while True:          # not server.wait(): a signal handler runs only between bytecodes
      time.sleep(1.0)
  except KeyboardInterrupt:
    pass
  finally:
    server.stop()


def run_learner(config: RunConfig, run_dir: str, address: str, resume: bool = False) -> int:
  """Updates until `config.steps`, publishing parameters after every update and checkpointing
  every `checkpoint_every` updates and on the way out. Returns the updates done."""
  from agents.counting import Counter
  from agents.variable_client import AVERAGE_TABLE, publish
  from agents.loggers import CSVLogger
  from learners import checkpointing
  stop_on_sigterm(watchdog=True)
  builder = config.builder()
  client = _client(address)
  networks = builder.make_networks()
  params = builder.init_params(networks, config.seed)
  logger = CSVLogger(os.path.join(run_dir, "logs"), "learner")
  replay = builder.make_dataset_iterator(client)
  pretrain = builder.pretraining[0]

  def batches():
    """Behaviour cloning of the experts' demonstrations up to update `pretrain_steps` (also
    after a resume), then what the actors write."""
    if learner.version < pretrain:
      from agents.alphazero.demonstrations import demonstration_batches, demonstration_items
      items = demonstration_items(config.train_tasks().tasks(), builder.sizes,
                                  config.env_config(), log=lambda m: print(m, flush=True),
                                  simulations=builder.actor_config.demonstration_search)
      demos = demonstration_batches(items, builder.config.batch_size, config.seed)
      while learner.version < pretrain:
        batch = next(demos)
        batch["version"] = np.full_like(batch["version"], learner.version)  # no policy lag
        yield batch
    yield from replay

  learner = builder.make_learner(networks, params, batches(), counter=Counter(), logger=logger)
  path = os.path.join(run_dir, checkpointing.FILENAME)
  if resume and (os.path.exists(path) or checkpointing.is_pickled_run(run_dir)):
    learner.restore(checkpointing.load(run_dir)["learner"])   # a pickled one is refused
    _forget_lost_updates(run_dir, learner.version)
  elif os.path.exists(path) or checkpointing.is_pickled_run(run_dir):
    raise ShardzeroError(f"{run_dir} already has a checkpoint: pass --resume to continue it, "
                         "or choose another --run-dir")

  def save():
    checkpointing.save(path, {"learner": learner.save(), "config": dataclasses.asdict(config)})

  tb = _tensorboard(run_dir, "learner")

  def publish_all():
    publish(client, learner.get_variables(["policy"])[0], learner.version)
    if builder.evaluation_variables == "average":
      publish(client, learner.get_variables(["average"])[0], learner.version, AVERAGE_TABLE)

  publish_all()
  try:
    while learner.version < config.steps:
      metrics = learner.step()
      publish_all()
      tb(learner.version, metrics)
      if learner.version % config.checkpoint_every == 0:
        save()
  except KeyboardInterrupt:
    pass
  except Exception as e:
    try:
      alive = _answers(client)
    except KeyboardInterrupt:     # stopped meanwhile
      alive = False
    if alive:
      raise
    raise ShardzeroError(f"learner: the Reverb server at {address} stopped answering "
                         f"({type(e).__name__}); the checkpoint keeps update "
                         f"{learner.version}: continue with --resume") from None
  finally:
    save()
    logger.close()
  return learner.version


def _answers(client) -> bool:
  try:
    client.server_info(timeout=2)
    return True
  except Exception:
    return False


def _forget_lost_updates(run_dir: str, version: int) -> None:
  """After a crash, the updates past the checkpoint's `version` are lost and will be redone:
  their rows leave the learner's and the evaluator's logs (which then continue without
  duplicates), and a checkpoint the crash left half-written is deleted."""
  import glob
  from agents.loggers import truncate_csv
  from learners import checkpointing
  logs = os.path.join(run_dir, "logs")
  cut = {name: truncate_csv(os.path.join(logs, f"{name}.csv"), column, version)
         for name, column in (("learner", "steps"), ("evaluator", "version"))}
  for tmp in glob.glob(os.path.join(run_dir, checkpointing.FILENAME + ".tmp.*")):
    os.remove(tmp)
  if any(cut.values()):
    print(f"learner: resumed at update {version}; the updates after it were lost with the "
          f"process that ran them and are redone ({cut['learner']} learner and "
          f"{cut['evaluator']} evaluator log rows dropped)", flush=True)


def run_actor(config: RunConfig, run_dir: str, address: str, actor_id: int,
              episodes: Optional[int] = None) -> None:
  """Plays training tasks with the latest parameters, writing experience to replay."""
  from agents.counting import Counter
  from agents.environment_loop import EnvironmentLoop
  from agents.variable_client import ReverbVariableSource
  from agents.loggers import CSVLogger
  from environments import PartitioningEnv
  from environments.observations import Sizes
  stop_on_sigterm(watchdog=True)
  builder = config.builder()
  client = _client(address)
  networks = builder.make_networks()
  source = ReverbVariableSource(client, builder.params_treedef(networks))
  label = f"actor_{actor_id}"
  logger = CSVLogger(os.path.join(run_dir, "logs"), label)   # drops a row torn by a crash
  counter = Counter()
  last = _last_row(logger.file_path)     # a restarted actor keeps counting where it stopped
  if last:
    counter.restore({"episodes": float(last["episodes"]), "steps": float(last["steps"])})
  # A restarted actor plays on from its episode count rather than replaying its first tasks.
  seed = config.seed * 1000 + actor_id + 1_000_003 * int(counter.get_counts().get("episodes", 0))
  env = PartitioningEnv(config.train_tasks(), seed=seed, config=config.env_config(),
                        pad_to=Sizes(*config.sizes))
  adder = builder.make_adder(client)
  actor = builder.make_actor(env, networks, source, adder, seed=seed,
                             update_period=config.variable_update_period)
  loop = EnvironmentLoop(env, actor, counter=counter, logger=_EpisodeRecord(logger, actor, env))
  pretrain = builder.pretraining[0]
  try:
    if pretrain:
      # Search data from a policy that has not yet cloned the experts would be stale when the
      # learner first reads replay, and would undo the cloning.
      print(f"{label}: waiting for the learner to clone the experts ({pretrain} updates)",
            flush=True)
      _wait_for_version(source, pretrain)
    loop.run(num_episodes=episodes)
  except KeyboardInterrupt:
    pass
  finally:
    logger.close()


def _wait_for_version(source, version: int, poll_s: float = 1.0) -> None:
  """Blocks until the published parameters have reached `version`."""
  while not source.available() or source.get_variables(["policy"])[0][1] < version:
    time.sleep(poll_s)


class _EpisodeRecord:
  """Adds the task, the parameter version and the final cost to each episode's record."""

  def __init__(self, logger, actor, env):
    self._logger, self._actor, self._env = logger, actor, env

  def write(self, data):
    ctx = self._env.context
    self._logger.write({
        "episodes": data["episodes"], "steps": data["steps"],
        "episode_length": data["episode_length"], "episode_return": float(data["episode_return"]),
        "steps_per_second": data["steps_per_second"], "time": time.time(),
        "version": self._actor.version,
        "cost_ratio": self._env.cost.step_time_s / ctx.root.cost.step_time_s,
        "fits": float(self._env.fits)})


def evaluate_policy(decode, params, tasks, env_config, experts: dict) -> dict:
  """Greedy episodes (`decode`, an `agents.decoding.greedy_decoder`) of the policy on `tasks`:
  step time relative to the best expert; `experts` keeps each task's best expert's cost."""
  from agents.search.expert import best_expert, evaluate_experts
  from environments import PartitioningEnv
  out = {}
  for task in tasks:
    env = PartitioningEnv(task, config=env_config)
    env.reset()
    if task not in experts:
      experts[task] = best_expert(evaluate_experts(env.restart_clone())).cost
    decode(env, params)
    out[task.model] = (env.cost.step_time_s / experts[task].step_time_s, env.fits)
  return out


def run_evaluator(config: RunConfig, run_dir: str, address: str,
                  rounds: Optional[int] = None) -> None:
  """Every `eval_every_s`, plays the greedy policy on the held-out tasks and logs the mean
  ratio of its step time to the best expert strategy's (lower is better; 1 is parity); the
  same at a tight memory budget, where the best expert is the fastest that fits and a policy
  counts as within 10% only if it fits too; and the mean over the training models. It plays
  the parameter average where the learner keeps one, as `propose` does."""
  from agents.decoding import greedy_decoder
  from agents.loggers import CSVLogger
  from agents.variable_client import AVERAGE_TABLE, PARAMS_TABLE, ReverbVariableSource
  stop_on_sigterm(watchdog=True)
  builder = config.builder()
  client = _client(address)
  networks = builder.make_networks()
  table = AVERAGE_TABLE if builder.evaluation_variables == "average" else PARAMS_TABLE
  source = ReverbVariableSource(client, builder.params_treedef(networks), table)
  logger = CSVLogger(os.path.join(run_dir, "logs"), "evaluator")
  tb = _tensorboard(run_dir, "evaluator")
  experts: dict = {}
  decode = greedy_decoder(networks)
  tight_tasks = config.heldout_tasks(tight=True)
  done = 0
  try:
    while rounds is None or done < rounds:
      start = time.time()
      params, version = source.get_variables(["policy"])[0]
      result = evaluate_policy(decode, params, config.heldout_tasks(), config.env_config(),
                               experts)
      train = evaluate_policy(decode, params, config.train_eval_tasks(), config.env_config(),
                              experts)
      ratios = [r for r, _ in result.values()]
      train_ratios = [r for r, _ in train.values()]
      record = {"version": version, "time": time.time(),
                "heldout_cost_ratio": float(np.mean(ratios)),
                "heldout_within_10pct": float(np.mean([r <= 1.1 for r in ratios])),
                "heldout_fits": float(np.mean([f for _, f in result.values()])),
                "train_cost_ratio": float(np.mean(train_ratios)),
                # One train model far off (mlp:mini, whose best expert is Megatron over both
                # axes) moves the mean; the median and the share within 10% do not hide it.
                "train_median_cost_ratio": float(np.median(train_ratios)),
                "train_within_10pct": float(np.mean([r <= 1.1 for r in train_ratios])),
                **{f"ratio_{m.split(':')[0]}": r for m, (r, _) in result.items()}}
      if tight_tasks:
        tight = evaluate_policy(decode, params, tight_tasks, config.env_config(), experts)
        record.update({
            "heldout_tight_cost_ratio": float(np.mean([r for r, _ in tight.values()])),
            "heldout_tight_within_10pct": float(np.mean([r <= 1.1 and f
                                                         for r, f in tight.values()])),
            "heldout_tight_fits": float(np.mean([f for _, f in tight.values()]))})
      logger.write(record)
      tb(version, record)
      done += 1
      time.sleep(max(0.0, config.eval_every_s - (time.time() - start)))
  except KeyboardInterrupt:
    pass
  finally:
    logger.close()
