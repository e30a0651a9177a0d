"""relax_gc raises the young-generation threshold and never lowers one set higher;
collector_paused stops automatic collection inside its block and restores what was set."""

import gc

import pytest

from launch.runtime import YOUNG_THRESHOLD, collector_paused, relax_gc


def test_relax_gc_raises_the_young_threshold_and_keeps_a_higher_one():
  before = gc.get_threshold()
  try:
    gc.set_threshold(700, before[1], before[2])
    relax_gc()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
    gc.set_threshold(2 * YOUNG_THRESHOLD, before[1], before[2])
    relax_gc()
    assert gc.get_threshold()[0] == 2 * YOUNG_THRESHOLD
  finally:
    gc.set_threshold(*before)


def test_collector_paused_disables_collection_inside_and_restores_it():
  was = gc.isenabled()
  try:
    gc.enable()
    with pytest.raises(RuntimeError):
      with collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a decision that fails")
    assert gc.isenabled()
    gc.disable()   # a caller that disabled it keeps it disabled
    with collector_paused():
      assert not gc.isenabled()
    assert not gc.isenabled()
  finally:
    (gc.enable if was else gc.disable)()


def test_a_role_blocked_in_a_native_call_still_ends_after_sigterm():
  """SIGTERM never reaches Python in a thread blocked in native code (an actor in a Reverb
  insert held by the rate limiter); the roles' watchdog ends the process anyway. Here the
  main thread keeps SIGTERM blocked and waits in `system()` for a shell that says "ready":
  it is inside the native call before the signal is sent. (Announcing from Python before a
  `time.sleep` raced: on a loaded machine the main thread could still be between the two,
  run the handler and die of the KeyboardInterrupt, -2, as CI saw.)"""
  import os
  import signal
  import subprocess
  import sys
  import textwrap
  code = textwrap.dedent("""
      import os, signal
      import launch.training as training
      training.SIGTERM_GRACE_S = 0.2
      training.stop_on_sigterm(watchdog=True)
      signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
      os.system("echo ready; exec sleep 60")
  """)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  # A session of its own: no signal sent to the test runner's process group reaches it, and
  # the shell it waits for is killed with it.
  child = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE,
                           env={**os.environ, "PYTHONPATH": root}, start_new_session=True)
  try:
    assert child.stdout.readline().strip() == b"ready"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
  finally:
    try:
      os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    child.wait()
    child.stdout.close()
