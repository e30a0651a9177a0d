"""Rendering results for people: tables with rich, sizes in readable units."""

from __future__ import annotations

import json
import re
import sys
from typing import Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} TiB"


_INDEX = re.compile(r"(?<=_)\d+(?=/|$)")


def group_rows(rows: Iterable[tuple[str, tuple, str]]) -> list[tuple[str, tuple, str, int]]:
  """Folds names that differ only in a `name_N` index (layer_3) when shape and sharding agree:
  `params/gpt/layer_*/w_in/w`, count 12."""
  groups: dict[tuple, list] = {}
  for name, shape, sharding in rows:
    key = (_INDEX.sub("*", name), shape, sharding)
    groups.setdefault(key, []).append(name)
  out = []
  for (pattern, shape, sharding), names in groups.items():
    out.append((names[0] if len(names) == 1 else pattern, shape, sharding, len(names)))
  return out


def console() -> Console:
  """A console that does not fold tables at 80 columns when the output is not a terminal."""
  width = None if sys.stdout.isatty() else 160
  return Console(highlight=False, soft_wrap=True, width=width)


def table(title: str, columns: list[str], rows: Iterable[Iterable], justify=None) -> Table:
  t = Table(title=title, title_justify="left", show_edge=False, header_style="bold")
  for i, c in enumerate(columns):
    t.add_column(c, justify=(justify or {}).get(i, "left"))
  for r in rows:
    t.add_row(*[Text(str(x)) for x in r])
  return t


def write_json(data: dict, path: str) -> None:
  text = json.dumps(data, indent=2, default=str)
  if path == "-":
    sys.stdout.write(text + "\n")
  else:
    with open(path, "w") as f:
      f.write(text + "\n")
