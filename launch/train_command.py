"""`shardzero train`: a local run of the distributed layout (Reverb server, learner, actors,
evaluator as separate processes), or one role of it (`--role`) for runs across machines."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os

from launch.processes import exposure_warning, finish

HELP = "train a partitioning policy with distributed actors and a learner over Reverb"

DESCRIPTION = """\
Trains a graph-network policy to choose tactics. The local launcher starts, as processes on
this machine: a Reverb server (the trajectory table and one-item parameter tables), a learner
(samples, updates, publishes parameters, checkpoints to RUN_DIR every --checkpoint-every
updates), --actors actor processes (each plays tasks from the corpus' train split at --preset
over --meshes and writes experience through a Reverb adder) and an evaluator (plays the greedy
policy on the held-out split, at the device's memory and at a tight budget, and logs its step
time over the best expert strategy's).

Algorithms:
  ppo        clipped-surrogate PPO with GAE on sequences (a queue: on-policy)
  alphazero  MCTS with the network's prior and value at every step; the learner fits the
             root's visit distributions (--set policy_target=completed_q: the prior
             improved by the root's completed Q-values, Gumbel MuZero's target) and the
             returns (uniform replay with a sample-to-insert rate limiter).
             Expert demonstrations: --set pretrain_steps=N clones the corpus' best expert
             strategies on the train split for the first N updates (actors wait for
             them), at --set pretrain_learning_rate=R if given (cloning is slow at
             the learning rate that suits search targets); --set demonstrations=F has
             actors replay the best expert in that share of their episodes;
             --set demonstration_search=N demonstrates instead what a plain MCTS of N
             simulations finds on a train task where it beats every expert.
             --set decay_steps=N: after cloning the rate falls along a cosine to 0
             over N updates (e.g. --steps minus pretrain_steps).
  both       --set ema_decay=D (e.g. 0.99) keeps a moving average of the parameters,
             which the evaluator and 'propose' play (actors keep the latest).

Progress shows learner updates, actor episodes/s, mean return and the held-out cost ratio.
Faults: an actor or the evaluator that dies is started again (at most --max-restarts times
each; the cause and its last log lines are printed), and the run goes on. Ctrl-C, SIGTERM
(kill, a scheduler's preemption), or the death of the learner or the Reverb server stops
every process; the checkpoint keeps parameters, optimizer state and counters, and --resume
continues the run: at most --checkpoint-every updates are lost and redone, and the logs go on
without duplicated rows (the rows of lost updates are dropped). A new Reverb server starts
empty: PPO's queue refills at once, AlphaZero's replay after its minimum size.

Across machines: start '--role replay --port P' on one machine, then on any machine
'--role learner|actor|evaluator --reverb HOST:P --run-dir DIR' (actors take --actor-id). The
learner and the evaluator need the run directory; actors only write their CSV log there.

Ray: '--launcher ray' runs the same roles as Ray actors on a Ray cluster (pip install -c
constraints.txt -e '.[ray]' on every node): '--address auto' on a node of a running cluster
(or HOST:PORT of its head; without --address, Ray starts on this machine). Ray places the
learner on a node with --learner-resources (e.g. GPU=1), actors and the evaluator with
--actor-cpus each. RUN_DIR must be a path that this machine and every node see (a shared
file system: NFS, a cluster volume): the roles write config, checkpoint and logs there. An
actor, the evaluator or the learner whose process dies, or whose Ray worker or node is lost,
is started again where Ray finds room (the learner with --resume from its checkpoint, at
most --checkpoint-every updates lost); a lost Reverb server takes replay with it: every role
starts again on a new server, the learner from its checkpoint, and the actors refill replay.
Each at most --max-restarts times. Ctrl-C stops every role on every node.

Network: the Reverb server listens on every interface of its machine, with no authentication
(dm-reverb 0.14 binds [::]:PORT and has no option to bind the loopback address only). Whoever
can reach that port can read the policy's parameters and insert trajectories. The local
launcher picks a random free port and prints it; run training on a machine whose firewall
closes incoming ports, and across machines only inside a private network (a VPC subnet or
cluster network with no public address, or an SSH tunnel: 'ssh -L P:localhost:P host').
"""

EXAMPLES = """\
examples:
  shardzero train --run-dir runs/ppo --actors 2 --steps 200
  shardzero train --run-dir runs/az --algorithm alphazero --set simulations=8 --steps 100
  shardzero train --run-dir runs/ppo --resume --steps 400
  shardzero train --run-dir /shared/runs/az --algorithm alphazero --launcher ray \
      --address auto --actors 16 --learner-resources GPU=1
  shardzero plot runs/ppo
"""

ROLES = ("launcher", "replay", "learner", "actor", "evaluator")


def add_parser(sub) -> None:
  p = sub.add_parser("train", help=HELP, description=DESCRIPTION, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--run-dir", required=True, help="where config, checkpoint and logs go")
  p.add_argument("--algorithm", choices=("ppo", "alphazero"), help="default ppo")
  p.add_argument("--actors", type=int, help="actor processes; default 2")
  p.add_argument("--steps", type=int, help="learner updates to reach; default 100")
  p.add_argument("--preset", help="corpus preset of the train and held-out models; default mini")
  p.add_argument("--meshes", help="training meshes separated by ';', default "
                 "'batch=4,model=2;batch=2,model=4'")
  p.add_argument("--models", help="training models, corpus specs separated by ';' (default: "
                 "the train split at --preset with its batch-size variants)")
  p.add_argument("--heldout", help="evaluation models separated by ';' (default: the held-out "
                 "split at --preset)")
  p.add_argument("--batch-per-device", help="weak scaling: each training and "
                 "evaluation model's batch is this many examples per device of its mesh; "
                 "several separated by ',' are drawn per task (evaluation at the first), e.g. "
                 "2,1 (default: the batch its spec or preset names)")
  p.add_argument("--budgets", help="memory budgets of the training tasks separated by ',': "
                 "device (the device's memory) or a fraction from the smallest peak an expert "
                 "strategy reaches (0) to data parallelism's (1); below 0, down to -1, toward "
                 "nothing, where only plans cut into micro-batches fit; default device,0.5")
  p.add_argument("--max-steps", type=int, help="actions per episode; default 12")
  p.add_argument("--checkpoint-every", type=int, help="updates between checkpoints; default 1")
  p.add_argument("--eval-every", type=float, help="seconds between evaluations; default 60")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="an algorithm setting (learning_rate=1e-3, batch_size=4, simulations=8...)")
  p.add_argument("--seed", type=int)
  p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
  p.add_argument("--role", choices=ROLES, default="launcher", help="run one process of the "
                 "layout instead of all of them (default launcher: all, locally)")
  p.add_argument("--reverb", metavar="HOST:PORT", help="the Reverb server (roles other than "
                 "launcher and replay; a launcher given it starts no server of its own)")
  p.add_argument("--port", type=int, help="port of the Reverb server (--role replay)")
  p.add_argument("--actor-id", type=int, default=0)
  p.add_argument("--no-evaluator", action="store_true", help="do not start the evaluator")
  p.add_argument("--max-restarts", type=int, default=3, help="times an actor or the evaluator "
                 "(over Ray: also the learner) that dies is started again before the run "
                 "stops (default 3)")
  p.add_argument("--launcher", choices=("local", "ray"), default="local",
                 help="where the launcher starts the roles: processes on this machine "
                 "(default) or Ray actors on a Ray cluster (see Ray below)")
  p.add_argument("--address", metavar="HOST:PORT|auto", help="--launcher ray: the Ray "
                 "cluster to join (auto: the one this node belongs to; default: start Ray on "
                 "this machine)")
  p.add_argument("--learner-resources", metavar="NAME=AMOUNT,...", help="--launcher ray: "
                 "what the learner needs, e.g. GPU=1 or CPU=4,GPU=1 (Ray places it on a node "
                 "that has it); default CPU=1")
  p.add_argument("--actor-cpus", type=float, default=1.0, help="--launcher ray: CPUs each "
                 "actor and the evaluator ask for (default 1)")
  p.set_defaults(run=run)


def _parse_value(text: str):
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def _budget(text: str) -> float | None:
  from partitioner.errors import ShardzeroError
  text = text.strip()
  if text == "device":
    return None
  try:
    return float(text)
  except ValueError:
    raise ShardzeroError(f"--budgets takes 'device' or fractions, got {text!r}") from None


def _per_device(text: str) -> int | tuple[int, ...]:
  """--batch-per-device: one count, or several drawn from per task."""
  from partitioner.errors import ShardzeroError
  try:
    counts = tuple(int(c) for c in text.split(",") if c.strip())
  except ValueError:
    counts = ()
  if not counts or min(counts) < 1:
    raise ShardzeroError(f"--batch-per-device takes positive counts separated by ',', got "
                         f"{text!r}")
  return counts[0] if len(counts) == 1 else counts


def make_config(args):
  import corpus
  from learners.run_config import RunConfig
  from partitioner.errors import ShardzeroError
  from partitioner.mesh import Mesh
  if args.resume:
    config = RunConfig.load(args.run_dir)
  else:
    if os.path.exists(os.path.join(args.run_dir, "config.json")):
      raise ShardzeroError(f"{args.run_dir} holds a run already: pass --resume to continue it "
                           "or choose another --run-dir")
    config = RunConfig()
  changes = {}
  for name, key in (("algorithm", "algorithm"), ("actors", "actors"), ("steps", "steps"),
                    ("preset", "preset"), ("max_steps", "max_steps"), ("seed", "seed"),
                    ("checkpoint_every", "checkpoint_every"), ("eval_every", "eval_every_s")):
    value = getattr(args, name)
    if value is not None:
      changes[key] = value
  if args.batch_per_device:
    changes["batch_per_device"] = _per_device(args.batch_per_device)
  for name in ("meshes", "models", "heldout"):
    text = getattr(args, name)
    if text:
      changes[name] = tuple(m.strip() for m in text.split(";") if m.strip())
  if args.budgets:
    changes["budget_fractions"] = tuple(_budget(b) for b in args.budgets.split(",") if b.strip())
  if args.resume and "algorithm" in changes and changes["algorithm"] != config.algorithm:
    raise ShardzeroError(f"{args.run_dir} was trained with {config.algorithm}")
  settings = dict(config.settings)
  for item in args.set:
    key, eq, value = item.partition("=")
    if not eq:
      raise ShardzeroError(f"--set takes KEY=VALUE, got {item!r}")
    settings[key.strip()] = _parse_value(value.strip())
  config = dataclasses.replace(config, **changes, settings=settings)
  if config.actors < 1 or config.steps < 0 or config.checkpoint_every < 1:
    raise ShardzeroError("--actors and --checkpoint-every must be positive, --steps not negative")
  config.builder()          # unknown settings fail here, before any process starts
  for mesh in config.meshes + (config.eval_mesh,):
    Mesh.parse(mesh)
  for model in config.models + config.heldout:
    corpus.parse(model)     # an unknown family, preset or knob fails before any process starts
  config.train_tasks()      # so does a budget fraction out of range
  return config


def _require_training_extra() -> None:
  """Training's libraries, checked once the command line is known to be good."""
  from partitioner.errors import ShardzeroError
  missing = [m for m in ("reverb", "rlax") if importlib.util.find_spec(m) is None]
  if missing:
    raise ShardzeroError(
        f"training needs the `train` extra ({', '.join(missing)} missing here): Reverb ties "
        "TensorFlow 2.15 and JAX 0.4.34, so give it its own environment: "
        "pip install -c constraints.txt -e \".[train]\" (make install builds one as .venv)")


def run(args) -> int:
  from learners.run_config import RunConfig
  from launch.training import (run_actor, run_evaluator, run_learner, run_replay)
  from partitioner.errors import ShardzeroError
  if args.launcher == "ray" and args.role != "launcher":
    raise ShardzeroError("--launcher ray starts every role itself: leave out --role")
  if args.launcher != "ray" and (args.address or args.learner_resources):
    raise ShardzeroError("--address and --learner-resources are settings of --launcher ray")
  if args.role == "launcher":
    if args.max_restarts < 0 or args.actor_cpus < 0:
      raise ShardzeroError("--max-restarts and --actor-cpus must not be negative")
    if args.launcher == "ray":
      from launch import ray_run
      if args.reverb:
        raise ShardzeroError("--launcher ray starts its own Reverb server: leave out --reverb")
      ray_run.parse_resources(args.learner_resources)    # fails before anything starts
    config = make_config(args)
    _require_training_extra()
    if args.launcher == "ray":
      return ray_run.launch(config, args)     # saves the config once Ray can place the run
    config.save(args.run_dir)
    return launch(config, args)
  config = RunConfig.load(args.run_dir) if args.role != "replay" or os.path.exists(
      os.path.join(args.run_dir, "config.json")) else make_config(args)
  if args.role == "replay":
    if args.port is None:
      raise ShardzeroError("--role replay needs --port")
    _require_training_extra()
    print(exposure_warning(args.port), flush=True)
    run_replay(config, args.port)
    return 0
  if not args.reverb:
    raise ShardzeroError(f"--role {args.role} needs --reverb HOST:PORT")
  _require_training_extra()
  if args.role == "learner":
    run_learner(config, args.run_dir, args.reverb, resume=args.resume)
  elif args.role == "actor":
    run_actor(config, args.run_dir, args.reverb, args.actor_id)
  else:
    run_evaluator(config, args.run_dir, args.reverb)
  return 0


def launch(config, args) -> int:
  """Starts every role as a process on this machine, shows progress, stops all on Ctrl-C or
  SIGTERM, when the learner is done, or when the learner or the Reverb server dies."""
  from launch import progress
  from launch.processes import (RoleProcess, free_port, stop_in_order, supervise,
                                terminate_all, train_argv)
  from launch.training import stop_on_sigterm
  stop_on_sigterm()      # `kill`, a scheduler's preemption: stop every role as Ctrl-C does
  run_dir = args.run_dir
  logs = os.path.join(run_dir, "logs")
  os.makedirs(logs, exist_ok=True)
  base = ["--run-dir", run_dir]
  procs: list[RoleProcess] = []
  failed = None
  interrupted = False
  try:
    address = args.reverb
    if address is None:
      port = free_port()
      address = f"localhost:{port}"
      print(exposure_warning(port), flush=True)
      procs.append(RoleProcess("replay", train_argv(base + ["--role", "replay", "--port",
                                                            str(port)]),
                               os.path.join(logs, "replay.log")))
    learner = RoleProcess("learner", train_argv(base + ["--role", "learner", "--reverb", address]
                                                + (["--resume"] if args.resume else [])),
                          os.path.join(logs, "learner.log"))
    procs.append(learner)
    for i in range(config.actors):
      procs.append(RoleProcess(f"actor {i}", train_argv(base + [
          "--role", "actor", "--reverb", address, "--actor-id", str(i)]),
          os.path.join(logs, f"actor_{i}.log")))
    if not args.no_evaluator:
      procs.append(RoleProcess("evaluator", train_argv(base + ["--role", "evaluator", "--reverb",
                                                               address]),
                               os.path.join(logs, "evaluator.log")))
    with progress.TrainingProgress(run_dir, config) as bar:
      failed = supervise(procs, learner, args.max_restarts,
                         restartable=lambda p: p.name not in ("replay", "learner"),
                         refresh=bar.refresh)
  except KeyboardInterrupt:
    interrupted = True
  finally:
    stop_in_order(procs, terminate_all)
  return finish(run_dir, failed, interrupted)
