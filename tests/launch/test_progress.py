"""Progress of long commands: lines on a pipe, even while one unit of work runs for long."""

import time

from launch.progress import Ticker


def test_ticker_prints_lines_when_not_a_terminal_even_without_updates(capsys):
  with Ticker("work", 3, every=0.2, unit=" items") as ticker:
    ticker.update(1, "first done")
    time.sleep(0.7)             # one long item: the heartbeat keeps printing
    ticker.update(3, "all done")
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) >= 3
  assert all(line.startswith("work: ") for line in lines)
  assert sum("work: 1/3 items" in line and "first done" in line for line in lines) >= 2
  assert lines[-1].startswith("work: 3/3 items") and lines[-1].endswith("all done")
