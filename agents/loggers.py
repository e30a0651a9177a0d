"""Loggers (Acme's `acme.utils.loggers`): write a dict of scalars per call, to the terminal
or a CSV file, at most every `time_delta` seconds."""

from __future__ import annotations

import abc
import csv
import os
import time
from typing import Any, Callable, Mapping

import numpy as np


class Logger(abc.ABC):
  @abc.abstractmethod
  def write(self, data: Mapping[str, Any]) -> None:
    """Writes one record."""

  def close(self) -> None:
    """Flushes and releases what the logger holds."""


def _scalar(value):
  if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0:
    return value.item()
  return value


def _format(value) -> str:
  value = _scalar(value)
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


class _Throttled(Logger):
  def __init__(self, time_delta: float):
    self._time_delta = time_delta
    self._last = -float("inf")

  def write(self, data):
    now = time.time()
    if now - self._last < self._time_delta:
      return
    self._last = now
    self._write(data)

  @abc.abstractmethod
  def _write(self, data) -> None:
    ...


class TerminalLogger(_Throttled):
  """`[Label] key = value | key = value`, one line per record."""

  def __init__(self, label: str = "", print_fn: Callable[[str], None] = print,
               time_delta: float = 0.0):
    super().__init__(time_delta)
    self._label = label
    self._print = print_fn

  def _write(self, data):
    body = " | ".join(f"{k.replace('_', ' ').title()} = {_format(v)}"
                      for k, v in sorted(data.items()))
    self._print(f"[{self._label.replace('_', ' ').title()}] {body}" if self._label else body)


def _complete_length(path: str) -> int:
  """The length of the file's complete lines: a process killed mid-write leaves a torn row."""
  with open(path, "rb") as f:
    data = f.read()
  return data.rfind(b"\n") + 1


def truncate_csv(path: str, column: str, last: float) -> int:
  """Cuts the CSV file at `path` before its first row whose `column` exceeds `last`, in place
  (a process appending to it keeps writing at the new end). A resumed learner drops the rows
  of the updates its checkpoint lost, so they are not logged twice. Returns the rows cut."""
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    lines = f.read()[:_complete_length(path)].splitlines(keepends=True)
  if not lines:
    return 0
  header = next(csv.reader([lines[0].decode()]))
  if column not in header:
    return 0
  index = header.index(column)
  offset = len(lines[0])
  for i, line in enumerate(lines[1:]):
    row = next(csv.reader([line.decode()]))
    if float(row[index]) > last:
      os.truncate(path, offset)
      return len(lines) - 1 - i
    offset += len(line)
  os.truncate(path, offset)
  return 0


class CSVLogger(_Throttled):
  """Appends records to `directory/label.csv` (or to a `.csv` path). The header is the first
  record's keys; records with new keys are an error rather than a silently ragged file. A torn
  last row (its writer was killed mid-row) is dropped when the file is opened again."""

  def __init__(self, directory_or_file: str, label: str = "logs", time_delta: float = 0.0):
    super().__init__(time_delta)
    path = directory_or_file
    if not path.endswith(".csv"):
      os.makedirs(path, exist_ok=True)
      path = os.path.join(path, f"{label}.csv")
    self.file_path = path
    self._fields: list[str] | None = None
    if os.path.exists(path):
      os.truncate(path, _complete_length(path))
    if os.path.exists(path) and os.path.getsize(path) > 0:
      with open(path, newline="") as f:
        self._fields = next(csv.reader(f))  # resume: keep the existing columns
    self._file = open(path, "a", newline="")

  def _write(self, data):
    if self._fields is None:
      self._fields = list(data)
      csv.writer(self._file).writerow(self._fields)
    unknown = set(data) - set(self._fields)
    if unknown:
      raise ValueError(f"{self.file_path}: new columns {sorted(unknown)} after the header "
                       f"{self._fields}")
    csv.DictWriter(self._file, self._fields).writerow(
        {k: _scalar(v) for k, v in data.items()})
    self._file.flush()

  def close(self):
    self._file.close()


class Dispatcher(Logger):
  """Writes every record to several loggers."""

  def __init__(self, loggers):
    self._loggers = list(loggers)

  def write(self, data):
    for logger in self._loggers:
      logger.write(data)

  def close(self):
    for logger in self._loggers:
      logger.close()


class InMemoryLogger(Logger):
  """Keeps every record (tests, evaluation)."""

  def __init__(self):
    self.data: list[dict] = []

  def write(self, data):
    self.data.append(dict(data))
