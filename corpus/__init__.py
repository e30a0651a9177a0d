"""The model corpus: training steps with scale knobs, by name (`gpt:small`)."""

from corpus.registry import FAMILIES, build, load, parse
from corpus.workload import Workload

__all__ = ["FAMILIES", "Workload", "build", "load", "parse"]
