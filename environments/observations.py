"""Observations: the IR as padded graph arrays a jitted network can consume.

Nodes are the program's values (tensors carry shardings); an edge joins each operand of an op
to each of its results, given in both directions. What does not depend on the sharding (node
and edge arrays, action features) is built once per task; the sharding features are updated
from the values a step changed. Sizes are padded up to powers of two (size buckets), so tasks
of similar size share shapes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
from dm_env import specs

from environments.actions import ENDINGS, ROLES, TACTIC_KINDS, Action, DecisionPoint, batch_cut
from partitioner import roles as R
from partitioner.cost.compute import REDUCTIONS, OpWork, op_work
from partitioner.cost.hardware import Hardware
from partitioner.cost.topology import Placement
from partitioner.errors import WorkloadError
from partitioner.ir import Program
from partitioner.mesh import Mesh
from partitioner.rules.elementwise import PER_OPERAND
from partitioner.tactics import tactic_footprint

MAX_RANK = 6      # dimensions beyond this share the last slot
MAX_AXES = 4      # mesh axes an observation can describe
# The version of this encoding: a policy is played only on the version it was trained on
# (`learners.policies.load_policy` checks the run's). Bump it when a feature changes.
# 3: mesh axes take slots by where they land (`Placement.slots`), not by their written order,
# and each slot says how many nodes its axis spans.
# 4: `Microbatch` actions (a kind and their count) and the inputs' share of the budget.
# 5: `Remat` actions (a kind).
OBSERVATION_VERSION = 5

# Node kind ids, fixed: 0 padding, 1 an input, 2 a primitive not in the table, then the table
# in order. New primitives are appended (the test of the table fails until they are), so the
# ids of a trained policy never move; NUM_KINDS leaves room for them. The ends of a loop region
# are nodes of kind `scan`.
NODE_KINDS = (
    'abs', 'acos', 'acosh', 'add', 'add_any', 'and', 'argmax', 'argmin', 'asin', 'asinh',
    'atan', 'atan2', 'atanh', 'bessel_i0e', 'bessel_i1e', 'broadcast_in_dim', 'cbrt', 'ceil',
    'clamp', 'clz', 'complex', 'concatenate', 'cond', 'conj', 'conv_general_dilated',
    'convert_element_type', 'copy', 'cos', 'cosh', 'cumlogsumexp', 'cummax', 'cummin',
    'cumprod', 'cumsum', 'device_put', 'digamma', 'div', 'dot_general', 'dynamic_slice',
    'dynamic_update_slice', 'eq', 'erf', 'erf_inv', 'erfc', 'exp', 'exp2', 'expm1', 'floor',
    'gather', 'ge', 'gt', 'igamma', 'igamma_grad_a', 'igammac', 'imag', 'integer_pow', 'iota',
    'is_finite', 'le', 'lgamma', 'log', 'log1p', 'logistic', 'lt', 'max', 'min', 'mul', 'ne',
    'neg', 'nextafter', 'not', 'optimization_barrier', 'or', 'pad', 'polygamma',
    'population_count', 'pow', 'random_gamma_grad', 'real', 'reduce_and', 'reduce_max',
    'reduce_min', 'reduce_or', 'reduce_precision', 'reduce_prod', 'reduce_sum',
    'reduce_window_max', 'reduce_window_min', 'reduce_window_sum', 'reduce_xor',
    'regularized_incomplete_beta', 'rem', 'reshape', 'rev', 'round', 'rsqrt', 'scan',
    'scatter-add', 'select_and_gather_add', 'select_and_scatter_add', 'select_n',
    'sharding_constraint', 'shift_left', 'shift_right_arithmetic', 'shift_right_logical',
    'sign', 'sin', 'sinh', 'slice', 'sort', 'sqrt', 'square', 'squeeze', 'stop_gradient', 'sub',
    'tan', 'tanh', 'threefry2x32', 'top_k', 'transpose', 'while', 'xor', 'zeta',
    'stage_shift', 'stage_view')
NUM_KINDS = 256
KIND_IDS = {p: i + 3 for i, p in enumerate(NODE_KINDS)}
LOOP_MARKERS = ("scan_enter", "scan_exit")
KIND_IDS.update({m: KIND_IDS["scan"] for m in LOOP_MARKERS})
assert len(NODE_KINDS) + 3 <= NUM_KINDS

NODE_FEATURES = MAX_RANK + 7 + len(ROLES)
SHARDING_FEATURES = MAX_RANK * MAX_AXES + 1


class ActionColumns:
  """Where each feature of an action row lies: the kind one-hot (`TACTIC_KINDS`), ZeRO's stage,
  the micro-batch count, the axis' slot one-hot, its size and the nodes it spans, the
  dimension one-hot and its size, and the tiled (or cut) values' bytes by role, their total,
  their count and their share of all inputs."""
  KIND = slice(0, len(TACTIC_KINDS))
  STAGE = len(TACTIC_KINDS)
  MICROBATCHES = STAGE + 1
  AXIS = MICROBATCHES + 1                # MAX_AXES one-hot, then the axis size and nodes
  AXIS_SIZE = AXIS + MAX_AXES
  AXIS_NODES = AXIS_SIZE + 1
  DIM = AXIS_NODES + 1                   # MAX_RANK one-hot, then the dimension's size
  DIM_SIZE = DIM + MAX_RANK
  ROLE = DIM_SIZE + 1                    # len(ROLES) shares of the bytes
  BYTES = ROLE + len(ROLES)
  COUNT = BYTES + 1
  SHARE = COUNT + 1
  WIDTH = SHARE + 1


def is_manual_tactic(actions: np.ndarray) -> np.ndarray:
  """Per action row, whether it applies a manual tactic (neither a tile, a rewrite that ends
  the episode nor finish)."""
  kinds = actions[..., ActionColumns.KIND]
  manual = [i for i, k in enumerate(TACTIC_KINDS) if k not in ("tile", *ENDINGS, "finish")]
  return kinds[..., manual].sum(-1) > 0


ACTION_FEATURES = ActionColumns.WIDTH
PROGRAM_FEATURES = 13
SHARED_FEATURES = len(ROLES) * MAX_AXES
# What changes with every step (`dynamic_features`), in this order.
DYNAMIC_FEATURES = ("peak_over_budget", "log_budget", "step_time", "compute", "comm",
                    "exposed_comm", "progress", "fits", "inputs_over_budget")
MESH_FEATURES = 2 * MAX_AXES + 1 + 7     # per slot: size and nodes; devices; the hardware
GLOBAL_FEATURES = MESH_FEATURES + PROGRAM_FEATURES + SHARED_FEATURES + len(DYNAMIC_FEATURES)
TOUCHED = 8       # values of an action's footprint the network reads (spread over all of them)


class Sizes(NamedTuple):
  nodes: int
  edges: int
  actions: int

  @classmethod
  def bucket(cls, nodes: int, edges: int, actions: int) -> "Sizes":
    up = lambda n, least: max(least, 1 << math.ceil(math.log2(max(n, 1))))
    return cls(up(nodes, 256), up(edges, 512), up(actions, 64))

  def covers(self, other: "Sizes") -> bool:
    return all(a >= b for a, b in zip(self, other))


# The padding training runs use unless told otherwise: every corpus task at `mini` and `small`
# fits it, so one compilation of the network serves all of them.
DEFAULT_SIZES = Sizes(4096, 8192, 512)


NODE_KEYS = ("node_kind", "nodes", "node_sharding", "node_mask")
EDGE_KEYS = ("senders", "receivers", "edge_direction", "edge_mask")


def trimmed(observation: dict, nodes: int = 512, edges: int = 1024) -> dict:
  """One observation with its node and edge padding cut to the next multiple of `nodes` and
  `edges` that holds the real ones. Padding is masked, so a network gives the same output on
  it, and a search that evaluates tasks padded to a corpus-wide size (4096 nodes for programs
  of 2000 to 2400 values) pays for the real graph only, at one compilation per size. The
  actions keep their padding, so the output's action axis does not change."""
  if observation["node_mask"].ndim != 1:
    return observation
  full_n, full_e = len(observation["node_mask"]), len(observation["edge_mask"])
  up = lambda count, step: max(step, -(-count // step) * step)
  n = min(full_n, up(int(observation["node_mask"].sum()), nodes))
  e = min(full_e, up(int(observation["edge_mask"].sum()), edges))
  if (n, e) == (full_n, full_e):
    return observation
  out = dict(observation)
  out.update({k: observation[k][:n] for k in NODE_KEYS})
  out.update({k: observation[k][:e] for k in EDGE_KEYS})
  return out


def _log(x, scale):
  return np.log2(np.asarray(x, np.float64) + 1.0) / scale


def observation_spec(sizes: Sizes) -> dict:
  n, e, a = sizes
  f32 = np.float32
  return {
      "node_kind": specs.BoundedArray((n,), np.int32, 0, NUM_KINDS - 1, "node_kind"),
      "nodes": specs.Array((n, NODE_FEATURES), f32, "nodes"),
      "node_sharding": specs.Array((n, SHARDING_FEATURES), f32, "node_sharding"),
      "node_mask": specs.Array((n,), bool, "node_mask"),
      "senders": specs.BoundedArray((e,), np.int32, 0, n - 1, "senders"),
      "receivers": specs.BoundedArray((e,), np.int32, 0, n - 1, "receivers"),
      "edge_direction": specs.BoundedArray((e,), np.int32, 0, 1, "edge_direction"),
      "edge_mask": specs.Array((e,), bool, "edge_mask"),
      "actions": specs.Array((a, ACTION_FEATURES), f32, "actions"),
      "action_nodes": specs.BoundedArray((a, TOUCHED), np.int32, 0, n - 1, "action_nodes"),
      "action_nodes_mask": specs.Array((a, TOUCHED), bool, "action_nodes_mask"),
      "action_mask": specs.Array((a,), bool, "action_mask"),
      "globals": specs.Array((GLOBAL_FEATURES,), f32, "globals"),
  }


def dynamic_features(cost, start_step_time_s: float, budget: int, progress: float) -> np.ndarray:
  """`DYNAMIC_FEATURES` of a state: its peak memory over the budget (capped at 4), the budget,
  its step time and its parts relative to the unpartitioned step's, the share of the episode's
  steps taken, whether it fits, and its inputs' bytes (parameters, optimizer state, batch)
  over the budget (capped at 4): what of the peak cutting the batch into micro-batches does
  not shrink."""
  c0 = start_step_time_s
  return np.array([min(cost.peak_memory_bytes / budget, 4.0), np.log2(budget + 1) / 40,
                   cost.step_time_s / c0, cost.compute_s / c0, cost.comm_s / c0,
                   cost.exposed_comm_s / c0, progress, float(cost.peak_memory_bytes <= budget),
                   min(cost.memory.argument_bytes / budget, 4.0)], np.float32)


def program_features(program: Program, work: list[OpWork], roles) -> np.ndarray:
  """What kind of model this is: shares of its ops and FLOPs by kind, its sizes, and its FLOPs
  per parameter byte. Averaged node embeddings blur this (a few convolutions or attention
  matmuls among thousands of elementwise ops), and it is what decides between families of
  strategies: data parallelism pays for its gradient all-reduce with compute, so where a
  step does little work per parameter byte (small batches, short sequences) tensor
  parallelism wins."""
  ops, values = program.ops, program.values
  n = max(len(ops), 1)
  kinds = [w.kind for w in work]
  flops = np.array([w.flops for w in work], np.float64)
  total = max(flops.sum(), 1.0)
  is_kind = lambda k: np.array([x == k for x in kinds], bool)
  matmul, conv = is_kind("matmul"), is_kind("conv")
  batched = sum(1 for op in ops if op.name == "dot_general"
                and op.params["dimension_numbers"][1][0])  # attention-like: batch dims
  nbytes = lambda ids: sum(values[v].nbytes for v in ids)
  weights = nbytes(roles.weights)
  return np.array([
      matmul.sum() / n, conv.sum() / n, is_kind("vector").sum() / n, is_kind("memory").sum() / n,
      flops[matmul].sum() / total, flops[conv].sum() / total,
      sum(op.name in REDUCTIONS for op in ops) / n, batched / max(matmul.sum(), 1),
      _log(len(ops), 16), _log(weights, 40), _log(nbytes(roles.data), 40),
      _log(total, 60), _log(total / max(weights, 1), 20)], np.float32)


class StaticGraph:
  """The sharding-independent arrays of one task's observation."""

  def __init__(self, program: Program, mesh: Mesh, hardware: Hardware,
               points: Sequence[DecisionPoint], actions: Sequence[Action],
               pad_to: Sizes | None = None):
    if len(mesh.names) > MAX_AXES:
      raise WorkloadError(f"observations describe meshes of at most {MAX_AXES} axes; "
                          f"{mesh} has {len(mesh.names)}")
    self.program, self.mesh = program, mesh
    # Axes take slots by where they land, so that names and written order do not matter.
    placement = Placement(mesh, hardware)
    slots = placement.slots()
    self.axis_index = {a: i for i, a in enumerate(slots)}
    nodes = {a: placement.nodes(a) for a in mesh.names}
    values, ops = program.values, program.ops
    # An edge from each operand to each result; an op that passes operand i to result i alone
    # (a checkpoint's optimization barrier over 30 values) has those edges only, not 30 x 30.
    pairs = [pair for op in ops for pair in (
        zip(op.inputs, op.outputs) if op.name in PER_OPERAND else
        ((i, o) for i in dict.fromkeys(op.inputs) for o in op.outputs))]
    need = Sizes(len(values), 2 * len(pairs), len(actions))
    self.sizes = pad_to or Sizes.bucket(*need)
    if not self.sizes.covers(need):
      raise WorkloadError(f"this task needs observation sizes {tuple(need)}, more than the "
                          f"padding {tuple(self.sizes)}")
    n, e, a = self.sizes
    # Nodes.
    kind = np.zeros(n, np.int32)
    feats = np.zeros((n, NODE_FEATURES), np.float32)
    role = {}
    roles = R.roles(program)
    for r, ids in zip(ROLES, (roles.weights, roles.opt_state, roles.data)):
      role.update({v: r for v in ids})
    work = op_work(program)
    outputs = set(program.outputs)
    for v in values:
      kind[v.id] = 1 if v.producer is None else KIND_IDS.get(ops[v.producer].name, 2)
      row = feats[v.id]
      for d, size in enumerate(v.shape):
        row[min(d, MAX_RANK - 1)] += _log(size, 20)
      flops = work[v.producer].flops if v.producer is not None else 0
      row[MAX_RANK:MAX_RANK + 7] = (v.rank / MAX_RANK, v.dtype.itemsize / 8, _log(v.nbytes, 40),
                                    _log(flops, 60), v.producer is None, v.id in outputs,
                                    v.is_const)
      if v.id in role:
        row[MAX_RANK + 7 + ROLES.index(role[v.id])] = 1
    self.node_kind, self.nodes = kind, feats
    self.node_mask = np.arange(n) < len(values)
    # Edges: operand -> result, then result -> operand.
    senders = np.zeros(e, np.int32)
    receivers = np.zeros(e, np.int32)
    direction = np.zeros(e, np.int32)
    if pairs:
      src, dst = np.array(pairs, np.int32).T
      m = len(pairs)
      senders[:m], receivers[:m] = src, dst
      senders[m:2 * m], receivers[m:2 * m], direction[m:2 * m] = dst, src, 1
    self.senders, self.receivers, self.edge_direction = senders, receivers, direction
    self.edge_mask = np.arange(e) < 2 * len(pairs)
    # Actions, each with the values it tiles: a decision point's members, a manual tactic's
    # footprint on the unpartitioned program. The network reads up to TOUCHED of them, spread
    # evenly, and the features give their bytes by role.
    self.footprints = {i: tactic_footprint(action.tactic, program, mesh)
                       for i, action in enumerate(actions)
                       if action.kind not in ("tile", *ENDINGS, "finish")}
    cut = batch_cut(program) if any(a.kind == "Microbatch" for a in actions) else None
    batch = R.batch_inputs(program, roles.data)[0] if any(
        a.kind == "Remat" for a in actions) else ()
    all_bytes = max(sum(values[v].nbytes for v in role), 1)
    act = np.zeros((a, ACTION_FEATURES), np.float32)
    touched = np.zeros((a, TOUCHED), np.int32)
    touched_mask = np.zeros((a, TOUCHED), bool)
    C = ActionColumns
    for i, action in enumerate(actions):
      row = act[i]
      row[C.KIND.start + TACTIC_KINDS.index(action.kind)] = 1
      if action.kind == "ZeRO":
        row[C.STAGE] = action.tactic.stage / 3
      if action.kind == "Microbatch":
        row[C.MICROBATCHES] = math.log2(action.tactic.k) / 6
      if action.axis is not None:
        row[C.AXIS + self.axis_index[action.axis]] = 1
        row[C.AXIS_SIZE] = _log(mesh.size(action.axis), 12)
        row[C.AXIS_NODES] = _log(nodes[action.axis], 12)
      if action.point >= 0:
        point = points[action.point]
        row[C.DIM + min(action.dim, MAX_RANK - 1)] = 1
        row[C.DIM_SIZE] = _log(point.shape[action.dim], 20)
        members = sorted(point.members)
      elif action.kind == "Microbatch":   # the inputs it cuts
        members = sorted(cut.inputs)
      elif action.kind == "Remat":   # the inputs its activations grow with
        members = sorted(batch)
      else:   # the inputs it tiles (their updated outputs follow them)
        members = sorted(v for v in self.footprints.get(i, ()) if v in role)
      if not members:
        continue
      by_role = np.zeros(len(ROLES))
      for m in members:
        by_role[ROLES.index(role[m])] += values[m].nbytes
      nbytes = sum(values[m].nbytes for m in members)
      row[C.ROLE:C.BYTES] = by_role / max(nbytes, 1)
      row[C.BYTES] = _log(nbytes, 40)
      row[C.COUNT] = _log(len(members), 10)
      row[C.SHARE] = nbytes / all_bytes
      spread = sorted({members[j] for j in np.linspace(0, len(members) - 1, TOUCHED).round()
                       .astype(int)})
      touched[i, :len(spread)], touched_mask[i, :len(spread)] = spread, True
    self.actions, self.action_nodes, self.action_nodes_mask = act, touched, touched_mask
    # Per role, the inputs' bytes: the share sharded over each axis is a global feature.
    ids = [np.array(sorted(x), np.int64) for x in (roles.weights, roles.opt_state, roles.data)]
    self._role_values = np.concatenate(ids)
    weights = np.zeros((len(ROLES), len(self._role_values)), np.float32)
    start = 0
    for r, members in enumerate(ids):
      sizes = np.array([values[v].nbytes for v in members], np.float64)
      weights[r, start:start + len(members)] = sizes / max(sizes.sum(), 1.0)
      start += len(members)
    self._role_weights = weights
    # Globals that do not change: the mesh, the hardware and what kind of model it is.
    g = np.zeros(MESH_FEATURES, np.float32)
    for i, a in enumerate(slots):
      g[i], g[MAX_AXES + i] = _log(mesh.size(a), 12), _log(nodes[a], 12)
    g[2 * MAX_AXES] = _log(mesh.device_count, 12)
    g[2 * MAX_AXES + 1:] = (_log(hardware.flops("float32"), 60),
                            _log(hardware.flops("bfloat16"), 60),
                            _log(hardware.hbm_bytes, 40), _log(hardware.hbm_bandwidth, 40),
                            _log(hardware.intra.bandwidth, 40),
                            _log(hardware.inter.bandwidth, 40), _log(hardware.node_size, 12))
    self.static_globals = np.concatenate([g, program_features(program, work, roles)])
    self._rows: dict = {}

  def empty_sharding(self) -> np.ndarray:
    """Sharding features of every value, nothing sharded. States keep them unpadded and as
    bytes (they are 0 or 1); the padded float32 rows exist only in an observation."""
    return np.zeros((len(self.program.values), SHARDING_FEATURES), np.uint8)

  def sharding_rows(self, dims_list: Sequence, layout_ids: Sequence[int], ids: Sequence[int],
                    decided: Sequence[bool], into: np.ndarray) -> None:
    """Writes the sharding features of values `ids` (one-hot dim x axis, decided flag);
    `layout_ids` names each value's dims (`ShardingState.layout_ids`)."""
    rows = self._rows
    for vid, flag in zip(ids, decided):
      key = (layout_ids[vid], flag)
      row = rows.get(key)
      if row is None:
        row = np.zeros(SHARDING_FEATURES, np.uint8)
        for d, axes in enumerate(dims_list[vid]):
          for a in axes:
            row[min(d, MAX_RANK - 1) * MAX_AXES + self.axis_index[a]] = 1
        row[-1] = flag
        rows[key] = row
      into[vid] = row

  def shared(self, sharding: np.ndarray) -> np.ndarray:
    """Per role (parameters, optimizer state, data) and mesh axis, the share of the role's
    bytes sharded over the axis: what the strategy so far has done, which a mean over
    thousands of node embeddings blurs."""
    rows = sharding[self._role_values, :MAX_RANK * MAX_AXES].reshape(-1, MAX_RANK, MAX_AXES)
    return (self._role_weights @ rows.max(1)).ravel()

  def observation(self, sharding: np.ndarray, mask: np.ndarray, dynamic: np.ndarray) -> dict:
    """`sharding`: the state's rows from `empty_sharding`/`sharding_rows`; `dynamic`: from
    `dynamic_features`."""
    padded = np.zeros((self.sizes.nodes, SHARDING_FEATURES), np.float32)
    padded[:len(sharding)] = sharding
    return {
        "node_kind": self.node_kind, "nodes": self.nodes, "node_sharding": padded,
        "node_mask": self.node_mask, "senders": self.senders, "receivers": self.receivers,
        "edge_direction": self.edge_direction, "edge_mask": self.edge_mask,
        "actions": self.actions, "action_nodes": self.action_nodes,
        "action_nodes_mask": self.action_nodes_mask, "action_mask": mask,
        "globals": np.concatenate([self.static_globals, self.shared(sharding),
                                   np.asarray(dynamic, np.float32)]),
    }
