"""Alpha-beta costs of collectives, with the cheapest decomposition over the two link levels.

One level (a ring over n devices, bandwidth B, latency a):
  all-reduce      2 (n-1)/n * S / B + 2 (n-1) a
  all-gather      (n-1)/n * S / B + (n-1) a      (S: the gathered result)
  reduce-scatter  (n-1)/n * S / B + (n-1) a      (S: the input)
  all-to-all      (n-1)/n * S / B + (n-1) a
An all-reduce may also run as a pipelined tree (NCCL's double binary tree; on a torus, rings
per dimension behave alike): 2 S / B + 2 ceil(log2 n) a, which wins for small tensors over
large groups, where a ring's latency grows with n.
A group with n1 devices in each of n2 nodes can run as one flat ring (bottlenecked by the slow
link) or be decomposed, e.g. an all-reduce as reduce-scatter inside the node, all-reduce across
nodes on 1/n1 of the data, all-gather inside: the cheapest option is chosen and named.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from partitioner.cost.hardware import Hardware, Link
from partitioner.cost.topology import Group


class CollectiveTime(NamedTuple):
  seconds: float
  decomposition: str


def _ring(kind: str, nbytes: float, n: int, link: Link, efficiency: float) -> float:
  if n <= 1:
    return 0.0
  bw = link.bandwidth * efficiency
  frac = (n - 1) / n
  if kind == "all-reduce":
    return 2 * frac * nbytes / bw + 2 * (n - 1) * link.latency
  if kind == "collective-permute":
    return nbytes / bw + link.latency
  return frac * nbytes / bw + (n - 1) * link.latency


def _tree_all_reduce(nbytes: float, n: int, link: Link, efficiency: float) -> float:
  return 2 * nbytes / (link.bandwidth * efficiency) + 2 * math.ceil(math.log2(n)) * link.latency


def _one_level(kind, nbytes, n, link, eff) -> CollectiveTime:
  ring = _ring(kind, nbytes, n, link, eff)
  if kind == "all-reduce" and n > 2:
    tree = _tree_all_reduce(nbytes, n, link, eff)
    if tree < ring:
      return CollectiveTime(tree, f"all-reduce tree({link.name})")
  return CollectiveTime(ring, f"{kind}({link.name})")


def collective_time(kind: str, nbytes: float, group: Group, hw: Hardware) -> CollectiveTime:
  """Seconds for one collective of `nbytes` per device (the larger side) over `group`."""
  eff = hw.efficiency["collective"]
  n1, n2 = group.intra, group.inter
  if group.size <= 1:
    return CollectiveTime(0.0, "none")
  if n2 == 1:
    return _one_level(kind, nbytes, n1, hw.intra, eff)
  if n1 == 1:
    return _one_level(kind, nbytes, n2, hw.inter, eff)
  intra = lambda k, s: _one_level(k, s, n1, hw.intra, eff).seconds
  inter = lambda k, s: _one_level(k, s, n2, hw.inter, eff).seconds
  i, o = hw.intra.name, hw.inter.name
  options = {f"flat {kind} ring over {o}": _ring(kind, nbytes, group.size, hw.inter, eff)}
  if kind == "all-reduce":
    options[f"flat all-reduce tree over {o}"] = _tree_all_reduce(nbytes, group.size, hw.inter,
                                                                 eff)
    options[f"reduce-scatter({i}) + all-reduce({o}) + all-gather({i})"] = (
        intra("reduce-scatter", nbytes) + inter("all-reduce", nbytes / n1) +
        intra("all-gather", nbytes))
    options[f"all-reduce({i}) + all-reduce({o})"] = (intra("all-reduce", nbytes) +
                                                    inter("all-reduce", nbytes))
  elif kind == "all-gather":
    options[f"all-gather({o}) + all-gather({i})"] = (inter("all-gather", nbytes / n1) +
                                                    intra("all-gather", nbytes))
  elif kind == "reduce-scatter":
    options[f"reduce-scatter({i}) + reduce-scatter({o})"] = (
        intra("reduce-scatter", nbytes) + inter("reduce-scatter", nbytes / n1))
  elif kind == "all-to-all":
    options[f"all-to-all({i}) + all-to-all({o})"] = (intra("all-to-all", nbytes) +
                                                    inter("all-to-all", nbytes))
  name = min(options, key=options.get)
  return CollectiveTime(options[name], name)
