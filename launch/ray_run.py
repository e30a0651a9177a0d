"""A training run on a Ray cluster (`shardzero train --launcher ray`) and evaluation units
fanned out over one (`shardzero evaluate --launcher ray`).

Each role of a run (Reverb server, learner, actors, evaluator) is a Ray actor, a `RoleHost`,
placed by Ray on a node with the resources asked for it; the host runs the role as a child
process, the same command the local launcher starts, so the roles' code, signals, checkpoints
and logs are those of a local run. Reverb stays the data plane: the replay host starts the
server and the launcher hands its address to the others. The run directory must be a path
that the driver and every node see (a shared file system).

Faults: a role process that dies, or a host lost with its Ray worker or node, is started again
(Ray places a new host where the resources are) at most `max_restarts` times; the learner comes
back with `--resume` from its last checkpoint. A lost Reverb server takes the replay contents
with it: every role is started again on a new server (the learner from its checkpoint, the
actors refilling replay), at most `max_restarts` times too.

Ray is imported only here, and only when asked for: `pip install -e ".[ray]"`.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
from typing import Optional

from partitioner.errors import ShardzeroError

PLACEMENT_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 60.0


def _ray():
  try:
    import ray
  except ImportError:
    raise ShardzeroError("--launcher ray needs Ray: pip install -c constraints.txt -e '.[ray]'")
  return ray


def connect(address: Optional[str], cpus: Optional[float] = None) -> bool:
  """Joins the Ray cluster at `address` ('auto': the one this node belongs to), or starts a
  Ray instance on this machine when `address` is None, with `cpus` logical CPUs (default the
  machine's). Returns whether it connected (False if Ray was initialised already)."""
  ray = _ray()
  if ray.is_initialized():
    return False
  if address not in (None, "auto"):
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise ShardzeroError(f"--address takes HOST:PORT or auto, got {address!r}")
    try:      # Ray itself retries an address nobody answers at for minutes
      socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
      raise ShardzeroError(f"no Ray cluster answers at {address} ({e.strerror or e})") from None
  import logging
  try:
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING,
             num_cpus=None if address or cpus is None else max(1, math.ceil(cpus)))
  except ConnectionError as e:
    raise ShardzeroError(f"cannot join the Ray cluster at {address}: {e}") from None
  return True


def parse_resources(text: Optional[str]) -> dict:
  """'GPU=1,CPU=4,accelerator_type:H100=0.01' -> Ray actor options (num_gpus, num_cpus and
  custom resources)."""
  options: dict = {}
  for item in filter(None, (t.strip() for t in (text or "").split(","))):
    key, eq, value = item.partition("=")
    try:
      amount = float(value)
    except ValueError:
      amount = -1.0
    if not eq or not key or amount < 0:
      raise ShardzeroError(f"a resource is NAME=AMOUNT (e.g. GPU=1,CPU=4), got {item!r}")
    if key == "CPU":
      options["num_cpus"] = amount
    elif key == "GPU":
      options["num_gpus"] = amount
    else:
      options.setdefault("resources", {})[key] = amount
  return options


def _demand(options: dict) -> dict[str, float]:
  demand = dict(options.get("resources", {}))
  for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
    if options.get(key):
      demand[name] = options[key]
  return demand


def total_demand(requests: dict[str, tuple[dict, int]]) -> dict[str, float]:
  total: dict[str, float] = {}
  for options, count in requests.values():
    for k, v in _demand(options).items():
      total[k] = total.get(k, 0.0) + v * count
  return total


def check_placeable(requests: dict[str, tuple[dict, int]]) -> None:
  """Fails at once if no live node of the cluster could hold what a role asks for, or the
  run's roles together ask for more than the cluster has free: Ray would wait forever."""
  ray = _ray()
  nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
  free = ray.available_resources()
  short = {k: (v, free.get(k, 0.0)) for k, v in total_demand(requests).items()
           if free.get(k, 0.0) + 1e-9 < v}
  if short:
    raise ShardzeroError(
        "the run asks Ray for more than its cluster has free: " + ", ".join(
            f"{k}={need:g} (free {have:g})" for k, (need, have) in short.items()) +
        "; use fewer --actors, a smaller --actor-cpus (0.5 shares a CPU between two actors) "
        "or --learner-resources, or a bigger cluster")
  for role, (options, _) in requests.items():
    demand = _demand(options)
    if not any(all(node.get(k, 0.0) >= v for k, v in demand.items()) for node in nodes):
      have = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(n.items())
                                 if not k.startswith("node:") and k != "object_store_memory"
                                 and k != "memory") for n in nodes)
      raise ShardzeroError(f"no node of the Ray cluster has what the {role} asks for "
                           f"({', '.join(f'{k}={v:g}' for k, v in demand.items())}); "
                           f"its nodes have: {have}")


class RoleHost:
  """A Ray actor that runs one role as its child process on the node Ray placed it on."""

  def __init__(self, name: str, log_path: str):
    self._name, self._log_path = name, log_path
    self._proc = None

  def where(self) -> dict:
    import ray
    return {"node": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}

  def free_port(self) -> int:
    from launch.processes import free_port
    return free_port()

  def start(self, args: list[str], restart_args: list[str]) -> int:
    from launch.processes import RoleProcess, train_argv
    os.makedirs(os.path.dirname(self._log_path), exist_ok=True)
    self._proc = RoleProcess(self._name, train_argv(args), self._log_path,
                             restart_argv=train_argv(restart_args), die_with_parent=True)
    return self._proc.pid

  def restart(self) -> int:
    self._proc.restart()
    return self._proc.pid

  def poll(self) -> Optional[int]:
    return self._proc.poll()

  def cause(self) -> str:
    return self._proc.cause()

  def tail(self, lines: int) -> str:
    return self._proc.tail(lines)

  def terminate(self, timeout_s: float) -> None:
    if self._proc is not None:
      self._proc.terminate(timeout_s)


def _lost_cause(error) -> str:
  """The sentence of Ray's long actor-death message that says why."""
  text = " ".join(str(error).split())
  found = re.search(r"Worker exit detail: [^.]*|[^.]*\bnode\b[^.]*(died|dead|lost|removed)[^.]*",
                    text)
  return found.group(0).strip() if found else text[:200]


class RayRole:
  """The launcher's handle on a role that runs under a `RoleHost` somewhere in the cluster;
  the same interface as a local `RoleProcess` (`launch.processes.Role`)."""

  def __init__(self, name: str, options: dict, log_path: str):
    self.name, self.log_path, self.restarts = name, log_path, 0
    self.pid: Optional[int] = None
    self._options = options
    self._restart_args: list[str] = []
    self._lost: Optional[str] = None
    self._spawn()

  def _spawn(self) -> None:
    ray = _ray()
    host = ray.remote(RoleHost).options(max_restarts=0, **self._options)
    self._host = host.remote(self.name, self.log_path)
    self.where = ray.get(self._host.where.remote(), timeout=PLACEMENT_TIMEOUT_S)

  def free_port(self) -> int:
    return _ray().get(self._host.free_port.remote(), timeout=CALL_TIMEOUT_S)

  def start(self, args: list[str], restart_args: Optional[list[str]] = None) -> None:
    self._restart_args = restart_args or args
    self.pid = _ray().get(self._host.start.remote(args, self._restart_args),
                          timeout=CALL_TIMEOUT_S)
    self._announce()

  def _announce(self) -> None:
    print(f"ray: {self.name} runs as pid {self.pid} on node {self.where['node'][:12]} "
          f"({self.where['host']}, {self.where['ip']})", flush=True)

  def _call(self, method: str, *args):
    ray = _ray()
    return ray.get(getattr(self._host, method).remote(*args), timeout=CALL_TIMEOUT_S)

  def poll(self) -> Optional[int]:
    if self._lost:
      return -1
    ray = _ray()
    try:
      return self._call("poll")
    except ray.exceptions.RayActorError as e:
      self._lost = _lost_cause(e)
    except ray.exceptions.GetTimeoutError:
      self._lost = f"its Ray worker did not answer within {CALL_TIMEOUT_S:.0f} s"
    return -1

  def cause(self) -> str:
    if not self._lost:
      try:
        return self._call("cause")
      except Exception as e:      # the host went meanwhile
        self._lost = _lost_cause(e)
    return f"was lost with its Ray worker or node ({self._lost})"

  def tail(self, lines: int = 15) -> str:
    if not self._lost:
      try:
        return self._call("tail", lines)
      except Exception:
        pass
    try:      # the run directory is shared: the log outlives its node
      with open(self.log_path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    except OSError:
      return f"(no log at {self.log_path} from here)\n"

  def restart(self) -> None:
    self.restarts += 1
    if self._lost is None:
      self.pid = self._call("restart")
    else:
      _ray().kill(self._host, no_restart=True)
      self._spawn()
      with open(self.log_path, "a") as f:
        f.write(f"--- started again on another Ray worker (restart {self.restarts}) ---\n")
      self.pid = _ray().get(self._host.start.remote(self._restart_args, self._restart_args),
                            timeout=CALL_TIMEOUT_S)
      self._lost = None
    self._announce()


  @staticmethod
  def terminate_all(roles, timeout_s: float = 20.0) -> None:
    """Stops the roles together: SIGTERM to each child, SIGKILL after `timeout_s`; then the
    hosts go."""
    ray = _ray()
    pending = [r._host.terminate.remote(timeout_s) for r in roles if not r._lost]
    try:
      if pending:
        ray.wait(pending, num_returns=len(pending), timeout=timeout_s + CALL_TIMEOUT_S)
    finally:
      for r in roles:
        ray.kill(r._host, no_restart=True)


def launch(config, args) -> int:
  """`shardzero train --launcher ray`: places the roles on the cluster, shows progress, and
  stops them all on Ctrl-C or SIGTERM, when the learner is done, or when a role has died more
  than `--max-restarts` times. A lost Reverb server takes its contents with it: the run
  starts again on a new one, the learner from its checkpoint, and the actors refill it."""
  from launch import progress
  from launch.processes import finish, stop_in_order, supervise
  from launch.training import stop_on_sigterm
  ray = _ray()
  actor = {"num_cpus": args.actor_cpus}
  requests = {"replay": ({"num_cpus": 1.0}, 1),
              "learner": (parse_resources(args.learner_resources) or {"num_cpus": 1.0}, 1),
              "actors": (actor, config.actors),
              "evaluator": (actor, 0 if args.no_evaluator else 1)}
  # Ray on this machine gets as many logical CPUs as the run asks for: the local launcher,
  # too, runs every role whatever the number of cores.
  started = connect(args.address, total_demand(requests).get("CPU", 1.0))
  stop_on_sigterm()      # after ray.init, whose own handler would end the driver at once
  roles: list[RayRole] = []
  failed, interrupted, new_servers = None, False, 0
  try:
    check_placeable(requests)
    config.save(args.run_dir)
    learner = _place(roles, config, args, requests, args.resume)
    with progress.TrainingProgress(args.run_dir, config) as bar:
      while True:
        failed = supervise(roles, learner, args.max_restarts,
                           restartable=lambda r: r.name != "replay", refresh=bar.refresh)
        if failed is None or failed.name != "replay" or new_servers >= args.max_restarts:
          break
        new_servers += 1
        print(f"shardzero train: the replay process {failed.cause()}, and the Reverb "
              "server's contents with it; starting the run again on a new server, the learner "
              f"from its checkpoint ({new_servers} of {args.max_restarts}). Last lines of "
              f"{failed.log_path}:\n{failed.tail(5)}", file=sys.stderr, flush=True)
        stop_in_order(roles, RayRole.terminate_all)
        roles.clear()
        failed = None
        learner = _place(roles, config, args, requests, resume=True)
  except KeyboardInterrupt:
    interrupted = True
  except ray.exceptions.GetTimeoutError:
    raise ShardzeroError(f"Ray did not place a role within {PLACEMENT_TIMEOUT_S:.0f} s: the "
                         "cluster's resources are taken by other work") from None
  finally:
    stop_in_order(roles, RayRole.terminate_all)
    if started:
      ray.shutdown()
  return finish(args.run_dir, failed, interrupted)


def _place(roles: list, config, args, requests, resume: bool) -> RayRole:
  """Places and starts every role, appending each to `roles` as it starts (so that a failure
  half-way stops those); returns the learner."""
  from launch.processes import exposure_warning
  run_dir = os.path.abspath(args.run_dir)
  logs = os.path.join(run_dir, "logs")
  os.makedirs(logs, exist_ok=True)
  base = ["--run-dir", run_dir]
  replay = RayRole("replay", requests["replay"][0], os.path.join(logs, "replay.log"))
  roles.append(replay)
  port = replay.free_port()
  print(exposure_warning(port).replace("replay:", f"replay on {replay.where['host']}:"),
        flush=True)
  replay.start(base + ["--role", "replay", "--port", str(port)])
  address = f"{replay.where['ip']}:{port}"
  learner = RayRole("learner", requests["learner"][0], os.path.join(logs, "learner.log"))
  roles.append(learner)
  learner_args = base + ["--role", "learner", "--reverb", address]
  # Started again, the learner resumes from its last checkpoint (or starts afresh if it died
  # before writing one).
  learner.start(learner_args + (["--resume"] if resume else []), learner_args + ["--resume"])
  actor = requests["actors"][0]
  for i in range(config.actors):
    roles.append(RayRole(f"actor {i}", actor, os.path.join(logs, f"actor_{i}.log")))
    roles[-1].start(base + ["--role", "actor", "--reverb", address, "--actor-id", str(i)])
  if not args.no_evaluator:
    roles.append(RayRole("evaluator", actor, os.path.join(logs, "evaluator.log")))
    roles[-1].start(base + ["--role", "evaluator", "--reverb", address])
  return learner


def run_units(function, units, finished, address: Optional[str], jobs: int,
              cpus: float = 1.0) -> None:
  """Evaluates `function(unit)` for every unit as Ray tasks of `cpus` CPUs each over the
  cluster at `address` (None: a Ray instance on this machine running `jobs` at a time),
  calling `finished(unit, result)` as each one arrives. A task whose worker or node is lost is run again (twice at
  most); one that raises fails the whole call."""
  ray = _ray()
  started = connect(address, cpus * jobs)
  try:
    task = ray.remote(num_cpus=cpus, max_retries=2)(function)
    refs = {task.remote(u): u for u in units}
    while refs:
      ready, _ = ray.wait(list(refs), num_returns=1)
      for ref in ready:
        finished(refs.pop(ref), ray.get(ref))
  finally:
    if started:
      ray.shutdown()

