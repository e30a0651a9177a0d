"""The Reverb data plane's exposure, as documented: the pinned dm-reverb binds every interface
(it has no way to bind the loopback address only), so `shardzero train` says so, in --help and
with the port at start. If a Reverb upgrade changes the binding, this test says the docs are
out of date."""

import socket
import time

import pytest
import reverb

from launch import cli, train_command


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
  assert str(port) in train_command.exposure_warning(port)
  with pytest.raises(SystemExit):
    cli.main(["train", "--help"])
  text = capsys.readouterr().out
  assert "listens on every interface" in text and "private network" in text
