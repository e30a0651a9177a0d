"""What every benchmark ends with: a right-aligned table on stdout and its rows as JSON."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Iterable, Sequence


def print_table(header: Sequence[str], rows: Iterable[Sequence], width: int, sep: str = "",
                trail: Iterable[str] | None = None) -> None:
  """`header` and each row of cells right-aligned in `width` columns; `trail` (one string per
  row, and one for the header) is appended unaligned."""
  trail = list(trail) if trail is not None else None
  lines = [header, *rows]
  for i, cells in enumerate(lines):
    line = sep.join(f"{str(c):>{width}}" for c in cells)
    print(line + (trail[i] if trail else ""))


def write_results(path: str, benchmark: str, rows: list, **meta) -> None:
  """Writes `{"benchmark", **meta, "machine", "python", "rows"}` to `path`."""
  out = Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"benchmark": benchmark, **meta, "machine": platform.machine(),
                             "python": platform.python_version(), "rows": rows}, indent=2) + "\n")
  print(f"wrote {out}")
