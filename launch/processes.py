"""A role of a training run as a child process, and the loop that watches a run's roles: the
local launcher runs them on this machine, the Ray launcher on Ray's nodes (`launch/ray_run.py`),
with the same restarts, stop order and messages."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Protocol, Sequence

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
  """In the child, before exec: SIGTERM when the process that started it ends (a Ray worker
  killed with its node or its driver must not leave the role running)."""
  ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
  """A port free on every interface of this machine (Reverb binds them all)."""
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def train_argv(args: Sequence[str]) -> list[str]:
  """The command line of one role: `shardzero train ARGS` with this interpreter."""
  return [sys.executable, "-m", "launch.cli", "train", *args]


class Role(Protocol):
  """What the supervising loop needs of a running role, wherever it runs."""
  name: str
  restarts: int
  log_path: str

  def poll(self) -> Optional[int]: ...
  def cause(self) -> str: ...
  def tail(self, lines: int = 15) -> str: ...
  def restart(self) -> None: ...


class RoleProcess:
  """One role as a child process in its own session, its output appended to `log_path`."""

  def __init__(self, name: str, argv: list[str], log_path: str,
               restart_argv: Optional[list[str]] = None, die_with_parent: bool = False):
    self.name = name
    self.log_path = log_path
    self.restarts = 0
    self._restart_argv = restart_argv or argv
    self._die_with_parent = die_with_parent
    self._log = open(log_path, "a")
    self.popen = self._start(argv)

  def _start(self, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=_die_with_parent if self._die_with_parent else None)

  @property
  def pid(self) -> int:
    return self.popen.pid

  def poll(self) -> Optional[int]:
    return self.popen.poll()

  def restart(self) -> None:
    self.restarts += 1
    self._log.write(f"--- started again by the launcher (restart {self.restarts}) ---\n")
    self._log.flush()
    self.popen = self._start(self._restart_argv)

  def cause(self) -> str:
    code = self.popen.returncode
    if code is not None and code < 0:
      return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"

  def tail(self, lines: int = 15) -> str:
    with open(self.log_path, errors="replace") as f:
      return "".join(f.readlines()[-lines:])

  def signal(self, sig=signal.SIGTERM) -> None:
    if self.popen.poll() is None:
      self.popen.send_signal(sig)

  def terminate(self, timeout_s: float = 20.0) -> None:
    terminate_all([self], timeout_s)


def terminate_all(procs: Sequence[RoleProcess], timeout_s: float = 20.0) -> None:
  """SIGTERM to each, then SIGKILL to those still running after `timeout_s`."""
  for p in procs:
    p.signal()
  deadline = time.time() + timeout_s
  for p in procs:
    try:
      p.popen.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      p.signal(signal.SIGKILL)
      p.popen.wait()


def supervise(roles: Sequence[Role], learner: Role, max_restarts: int,
              restartable: Callable[[Role], bool], refresh: Callable[[], None] = lambda: None,
              poll_s: float = 1.0) -> Optional[Role]:
  """Watches the roles until the learner is done (returns None) or a role dies that may not
  be started again, or has been `max_restarts` times (returns it). Raises KeyboardInterrupt on
  Ctrl-C or SIGTERM, for the caller to stop the roles."""
  while True:
    refresh()
    if learner.poll() == 0:
      return None
    # A dead Reverb server is named first: the learner and actors fail because of it.
    dead = sorted((r for r in roles if r.poll() is not None),
                  key=lambda r: (r.name != "replay", r.name != "learner"))
    for r in dead:
      if not restartable(r) or r.restarts >= max_restarts:
        return r
      print(f"shardzero train: the {r.name} process {r.cause()}; starting it again "
            f"({r.restarts + 1} of {max_restarts}). Last lines of {r.log_path}:\n"
            f"{r.tail(5)}", file=sys.stderr, flush=True)
      r.restart()
    time.sleep(poll_s)


def stop_in_order(roles: Sequence[Role], terminate: Callable[[Sequence[Role]], None]) -> None:
  """The learner first, while actors still feed it (it checkpoints on SIGTERM once its sample
  returns); then the Reverb server, whose end fails the calls that actors waiting for the
  learner are blocked in; then actors and evaluator together."""
  terminate([r for r in roles if r.name == "learner"])
  terminate([r for r in roles if r.name == "replay"])
  terminate([r for r in roles if r.name not in ("learner", "replay")])


def exposure_warning(port: int) -> str:
  return (f"replay: Reverb listens on port {port} of every network interface of "
          f"{socket.gethostname()} (dm-reverb 0.14 cannot bind the loopback address only); "
          "keep that port closed to other machines (see 'shardzero train --help', Network)")


def finish(run_dir: str, failed, interrupted: bool) -> int:
  """The launcher's last words and exit code: 0 done, 1 a role failed, 130 stopped."""
  if failed is not None:
    print(f"shardzero train: the {failed.name} process {failed.cause()}; stopped the others. "
          f"Last lines of {failed.log_path}:\n{failed.tail()}\n"
          f"continue with: shardzero train --run-dir {run_dir} --resume", file=sys.stderr)
    return 1
  if interrupted:
    print(f"stopped; continue with: shardzero train --run-dir {run_dir} --resume",
          file=sys.stderr)
    return 130
  print(f"done: {run_dir} (checkpoint, logs/*.csv, tb/); plot with: shardzero plot {run_dir}")
  return 0
