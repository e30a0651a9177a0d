"""Fusion models: which values reach HBM, on a softmax and on a product read twice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partitioner as P
from partitioner.cost import CATALOG, HardwareError, simulate
from partitioner.cost.compute import ProgramWork

N, D = 256, 512
FULL = N * D * 4           # one (N, D) float32 array
ROW = N * 4                # one (N,) float32 array


def _program(f, *shapes):
  return P.trace(f, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))


def _hbm(program, fusion):
  hardware = dataclasses.replace(CATALOG["h100"], name=f"h100 ({fusion})", fusion=fusion)
  return simulate(P.apply(program, "a=1", ""), hardware)


def _softmax(x, w):
  e = jnp.exp(x @ w)
  return e / e.sum(-1, keepdims=True)


def test_gpu_fusion_recomputes_a_cheap_result_in_each_kernel_that_reads_it():
  program = _program(_softmax, (N, D), (D, D))
  x, w = N * D * 4, D * D * 4
  # XLA:GPU: exp is recomputed in the reduction and in the division, so only the product, the
  # row sums and the result reach HBM: the matmul writes h; the reduction reads h and writes
  # the sums; the division reads h and the sums and writes y.
  gpu = _hbm(program, "producer")
  assert gpu.hbm_bytes == x + w + FULL + (FULL + ROW) + (FULL + ROW + FULL)
  assert ProgramWork.of(program, "producer").groups == 3
  # In run order (XLA:CPU), exp's result, read by a reduction and another op, is stored. (That
  # model, fitted to XLA:CPU as it is, drops the division's read of the sums through the
  # bitcast that adds their unit dimension.)
  cpu = _hbm(program, "consecutive")
  assert cpu.hbm_bytes == x + w + FULL + 2 * FULL + (FULL + ROW) + (FULL + FULL)
  assert gpu.step_time_s < cpu.step_time_s
  assert gpu.memory.peak_bytes < cpu.memory.peak_bytes    # exp's result never exists


def test_a_result_that_would_cost_more_to_recompute_is_stored_once():
  # x * y read by two reductions: recomputing it in both would read x and y twice (4 arrays)
  # where storing it writes one and reads it twice (3 arrays).
  def f(x, y):
    p = x * y
    return p.sum(0), p.sum(1)
  program = _program(f, (N, D), (N, D))
  work = ProgramWork.of(program, "producer")
  (product,) = {v for op in program.ops if op.name == "mul" for v in op.outputs}
  assert not work.internal[product] and work.groups == 3
  assert _hbm(program, "producer").hbm_bytes == 2 * FULL + FULL + FULL + D * 4 + FULL + ROW


def test_a_source_lives_until_the_last_kernel_that_recomputes_from_it():
  # h = x @ w is read through exp by a reduction and, after another matmul, by a division:
  # recomputing exp in the division keeps h alive until then.
  def f(x, w, v):
    e = jnp.exp(x @ w)
    s = e.sum(-1, keepdims=True) @ v
    return e / s
  program = _program(f, (N, D), (D, D), (1, D))
  work = ProgramWork.of(program, "producer")
  dot = next(op for op in program.ops if op.name == "dot_general")
  exp = next(op for op in program.ops if op.name == "exp")
  div = next(op for op in program.ops if op.name == "div")
  assert work.internal[exp.outputs[0]] and work.last_run[exp.index] == div.index
  sim = P.cost.Simulator(program, P.Mesh.parse("a=1"), "h100")
  live = sim.liveness
  h = dot.outputs[0]
  assert live.end[np.searchsorted(live.buffers, h)] == div.index


def test_hardware_names_its_fusion_model():
  assert CATALOG["h100"].fusion == "producer" and CATALOG["tpu-v4"].fusion == "producer"
  assert CATALOG["cpu"].fusion == "consecutive"
  spec = dict(dataclasses.asdict(CATALOG["h100"]), name="mine", fusion="eager")
  with pytest.raises(HardwareError, match="unknown fusion 'eager'; known: consecutive, producer"):
    CATALOG["h100"].from_dict(spec)
  spec["fusion"] = "consecutive"
  assert CATALOG["h100"].from_dict(spec).fusion == "consecutive"


def _internal(program, name):
  work = ProgramWork.of(program, "consecutive")
  (op,) = [op for op in program.ops if op.name == name]
  return bool(work.internal[op.outputs[0]])


def test_xla_cpu_fuses_into_a_reduction_only_over_the_minor_dimension_and_32_elements():
  square = lambda x, axis: (x * x).sum(axis)
  # Over 32 elements of the minor dimension: the product is computed inside the reduction.
  assert _internal(_program(lambda x: square(x, -1), (N, 32)), "mul")
  # Over 64: XLA:CPU's tree-reduction rewrite puts a reduce-window in front, which fuses
  # nothing, so the product is stored.
  assert not _internal(_program(lambda x: square(x, -1), (N, 64)), "mul")
  # Over the major dimension ("not fusing reductions over major dimensions").
  assert not _internal(_program(lambda x: square(x, 0), (32, N)), "mul")
  # XLA:GPU fuses all three.
  for shape, axis in (((N, 32), -1), ((N, 64), -1), ((32, N), 0)):
    program = _program(lambda x: square(x, axis), shape)
    (mul,) = [op for op in program.ops if op.name == "mul"]
    assert ProgramWork.of(program, "producer").internal[mul.outputs[0]]


@pytest.mark.parametrize("fusion", ["consecutive", "producer"])
def test_a_view_of_a_fused_result_is_what_its_kernel_stores(fusion):
  """tanh(x) reshaped is read by two matmuls and a product after them: the kernel that computes
  tanh writes the reshaped array, which is held across both matmuls (it had no buffer when its
  source, computed inside the kernel, had none)."""
  def f(x, w):
    h = jnp.tanh(x).reshape(2 * N, D // 2)
    y = h @ w
    z = y @ w
    return (z * h).sum()
  program = _program(f, (N, D), (D // 2, D // 2))
  (tanh,) = [op for op in program.ops if op.name == "tanh"]
  assert ProgramWork.of(program, fusion).internal[tanh.outputs[0]]
  peak = _hbm(program, fusion).memory.peak_bytes
  weight = (D // 2) ** 2 * 4
  # At the second matmul: x (an input), w, h, y and z.
  assert peak >= 4 * FULL + weight
