"""The model corpus: training steps with scale knobs, by name (`gpt:small`), split into
training and held-out families, with the expert strategies of each family."""

from corpus.experts import STRATEGIES, experts
from corpus.registry import (FAMILIES, SPLITS, TRAIN_VARIANTS, build, family_of, load, parse,
                             split, train_models)
from corpus.workload import Workload

__all__ = ["FAMILIES", "SPLITS", "STRATEGIES", "TRAIN_VARIANTS", "Workload", "build", "experts",
           "family_of", "load", "parse", "split", "train_models"]
