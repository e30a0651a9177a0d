"""The Reverb data plane's exposure, as documented: the pinned dm-reverb binds every interface
(it has no way to bind the loopback address only), so `shardzero train` says so, in --help and
with the port at start. If a Reverb upgrade changes the binding, this test says the docs are
out of date."""

import socket
import time

import pytest
import reverb

from launch import cli, processes


def _listeners(port: int) -> list[str]:
  """Local addresses (hex, as /proc/net shows them) listening on `port`."""
  found = []
  for table in ("/proc/net/tcp6", "/proc/net/tcp"):
    try:
      lines = open(table).read().splitlines()[1:]
    except OSError:
      continue
    for line in lines:
      local, state = line.split()[1], line.split()[3]
      if state == "0A" and local.endswith(f":{port:04X}"):
        found.append(local.rsplit(":", 1)[0])
  return found


def test_pinned_reverb_listens_on_every_interface_and_training_says_so(capsys):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  server = reverb.Server([reverb.Table.queue("q", 10)], port=port)
  try:
    deadline = time.time() + 10
    while not _listeners(port) and time.time() < deadline:
      time.sleep(0.1)
    addresses = _listeners(port)
    assert addresses and all(set(a) == {"0"} for a in addresses), addresses   # [::] / 0.0.0.0
  finally:
    server.stop()
  assert str(port) in processes.exposure_warning(port)
  with pytest.raises(SystemExit):
    cli.main(["train", "--help"])
  text = capsys.readouterr().out
  assert "listens on every interface" in text and "private network" in text


WAITING_LEARNER = """
import signal, sys, time
import reverb
from learners.builders import ReverbIterator
server = reverb.Server([reverb.Table.queue("q", 10)], port=None)
client = reverb.Client(f"localhost:{server.port}")
def stop(*_):
  raise KeyboardInterrupt
signal.signal(signal.SIGALRM, stop)
signal.alarm(2)
start = time.time()
try:
  next(ReverbIterator(client, "q", 4, {"x": 0}))
except KeyboardInterrupt:
  print(f"stopped after {time.time() - start:.1f} s", flush=True)
  sys.exit(0)
"""


def test_a_learner_waiting_for_data_still_stops_on_a_signal():
  """Reverb's sample call blocks in C++, where Python signal handlers cannot run: the learner's
  iterator waits on it from Python, so a SIGTERM (here an alarm) stops a learner that waits
  for data on an empty table (or a dead server) and lets it checkpoint."""
  import subprocess
  import sys
  done = subprocess.run([sys.executable, "-c", WAITING_LEARNER], capture_output=True, text=True,
                        timeout=60)
  assert done.returncode == 0, done.stderr[-2000:]
  assert float(done.stdout.split()[2]) < 5
