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

That is the model for TPUs and the host CPU. GPUs (`Hardware.collectives == "nccl"`) are priced
as NCCL runs them instead (`_nccl`): NCCL has no hierarchical all-gather or reduce-scatter, and
its rings span nodes flat, so a ring's latency grows with every rank in it, not with the nodes.
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


class Protocol(NamedTuple):
  """One of NCCL's three wire protocols: its fixed latency per collective, its latency per ring
  or tree step over NVLink and over the network, and the share of the link's bandwidth it
  reaches (LL sends 8 bytes of flags with every 8 of data; LL128 8 of every 128)."""
  name: str
  base: float          # s per collective (ring; trees alike)
  ring_nvlink: float   # s per ring step inside a node
  ring_net: float      # s per ring step across nodes
  tree_nvlink: float   # s per tree step inside a node
  tree_net: float      # s per tree step across nodes
  ring_share: float    # of Simple's bus bandwidth, on rings
  tree_share: float    # of the bus bandwidth, on trees


# NCCL's own tuning model, `ncclTunerConstantsDefaults` and `ncclTopoTuneModel` in
# src/graph/tuning.cc (NVIDIA/nccl at 5067397, 2026-06): base latencies (Tree, Ring), hardware
# latencies per step (NVLink and NET rows), and the bandwidth refinements (ring LL x0.5, LL128
# x0.92; tree Simple x0.92, LL x1/3.8, LL128 x120/128 across nodes). NCCL picks, per call, the
# algorithm and protocol its model says is fastest; so does this.
_US = 1e-6
PROTOCOLS = (
    Protocol("LL", 6.6 * _US, 0.6 * _US, 2.7 * _US, 0.6 * _US, 5.0 * _US, 0.5, 1 / 3.8),
    Protocol("LL128", 14.0 * _US, 1.9 * _US, 4.0 * _US, 1.25 * _US, 8.5 * _US, 0.92, 120 / 128),
    Protocol("Simple", 8.4 * _US, 3.4 * _US, 14.0 * _US, 4.0 * _US, 14.0 * _US, 1.0, 0.92),
)


def _nccl(kind: str, nbytes: float, group: Group, hw: Hardware) -> CollectiveTime:
  """NCCL's ring (every collective) and tree (all-reduce) over `n1` GPUs in each of `n2` nodes.

  - Bus bandwidth: NVLink inside one node. Across nodes, every rank's NIC carries a channel of
    the ring (rail-optimised fabrics, one NIC per GPU), so a node's rings cross at n1 NICs'
    worth, and no faster than NVLink within the node.
  - A ring of n ranks takes n-1 steps (all-gather, reduce-scatter) or 2(n-1) (all-reduce): n2-1
    (or 2(n2-1)) of them cross nodes at the network's latency, the rest at NVLink's, but
    no faster than the proxy thread that feeds the NIC (`Hardware.net_overhead_s`, three
    times that for Simple). With one GPU per node, the network latency is the tree's.
  - A tree all-reduce takes 2((n1-1) NVLink + log2(n2) network) steps and moves 2 S.
  - All-to-all and point-to-point are sends to peers, all in flight at once: one step, the
    data bound for other nodes through the rank's own NIC.
  """
  eff = hw.efficiency["collective"]
  n, n1, n2 = group.size, group.intra, group.inter
  nvlink, net = hw.intra, hw.inter
  bus = nvlink.bandwidth if n2 == 1 else min(n1 * net.bandwidth, nvlink.bandwidth)
  where = (nvlink.name if n2 == 1 else net.name if n1 == 1 else
           f"{nvlink.name} + {net.name}")
  if kind in ("all-to-all", "collective-permute"):
    p = PROTOCOLS[-1]
    if kind == "collective-permute":
      link = nvlink if n2 == 1 else net
      return CollectiveTime(p.base + nbytes / (link.bandwidth * eff) + (
          p.ring_nvlink if n2 == 1 else p.ring_net), f"send/recv, Simple ({link.name})")
    inside = (n1 - 1) / n * nbytes / (nvlink.bandwidth * eff)
    outside = (n - n1) / n * nbytes / (net.bandwidth * eff)
    return CollectiveTime(p.base + max(inside, outside) + (p.ring_nvlink if n2 == 1 else
                                                           p.ring_net),
                          f"all-to-all send/recv, Simple ({where})")
  all_reduce = kind == "all-reduce"
  steps = (2 if all_reduce else 1) * (n - 1)
  net_steps = 0 if n2 == 1 else (2 if all_reduce else 1) * (n2 - 1)
  moved = steps / n * nbytes
  options = {}
  for p in PROTOCOLS:
    inner = p.ring_nvlink
    if n2 > 1:
      inner = max(inner, hw.net_overhead_s * (3 if p.name == "Simple" else 1))
    outer = p.tree_net if n1 == 1 else p.ring_net
    latency = p.base + (steps - net_steps) * inner + net_steps * outer
    options[f"ring {kind}, {p.name} ({where})"] = latency + moved / (bus * eff * p.ring_share)
    if all_reduce:
      latency = p.base + 2 * ((n1 - 1) * p.tree_nvlink + (n2.bit_length() - 1) * p.tree_net)
      options[f"tree all-reduce, {p.name} ({where})"] = latency + 2 * nbytes / (
          bus * eff * p.tree_share)
  name = min(options, key=options.get)
  return CollectiveTime(options[name], name)


def collective_time(kind: str, nbytes: float, group: Group, hw: Hardware) -> CollectiveTime:
  """Seconds for one collective of `nbytes` per device (the larger side) over `group`."""
  if group.size <= 1:
    return CollectiveTime(0.0, "none")
  if hw.collectives == "nccl":
    return _nccl(kind, nbytes, group, hw)
  eff = hw.efficiency["collective"]
  n1, n2 = group.intra, group.inter
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
