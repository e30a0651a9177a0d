"""The simulator: collective decompositions, compute, overlap, memory, and agreement with XLA."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import corpus
import partitioner as P
from partitioner.cost import CATALOG, Group, Simulator, collective_time, simulate

GiB = 2**30


@functools.lru_cache(maxsize=None)
def traced(spec):
  workload = corpus.load(spec)
  return workload, P.trace(workload.fn, *workload.args)


def test_a_ring_across_nodes_crosses_at_every_gpu_s_nic():
  """NCCL's rings span nodes flat, one channel through each GPU's NIC: a node's data crosses
  at 8 NICs' worth, not one's."""
  h100 = CATALOG["h100"]
  chosen = collective_time("all-reduce", 1 << 30, Group(64, 8, 8), h100)
  assert chosen.decomposition == "ring all-reduce, Simple (NVLink + InfiniBand)"
  one_nic = 2 * 63 / 64 * (1 << 30) / (h100.inter.bandwidth * 0.8)
  assert one_nic / chosen.seconds > 4
  inside = collective_time("all-reduce", 1 << 30, Group(8, 8, 1), h100)
  across = collective_time("all-reduce", 1 << 30, Group(8, 1, 8), h100)
  assert across.seconds / inside.seconds > 8


def test_nccl_picks_its_protocol_by_size_and_prices_it_with_its_own_constants():
  """An 8-byte all-reduce inside an 8-GPU node is NCCL's LL ring: 6.6 us base and 14 steps of
  0.6 us (src/graph/tuning.cc). A 1 GiB one is Simple, at the bandwidth the links reach."""
  h100 = CATALOG["h100"]
  small = collective_time("all-reduce", 8, Group(8, 8, 1), h100)
  assert small.decomposition == "ring all-reduce, LL (NVLink)"
  assert small.seconds == pytest.approx(6.6e-6 + 14 * 0.6e-6, rel=1e-3)
  big = collective_time("all-reduce", 1 << 30, Group(8, 8, 1), h100)
  assert big.decomposition == "ring all-reduce, Simple (NVLink)"
  bandwidth = 2 * 7 / 8 * (1 << 30) / (big.seconds - 8.4e-6 - 14 * 3.4e-6)
  assert bandwidth == pytest.approx(h100.intra.bandwidth * 0.8)
  # Small all-reduces across nodes run as trees; all-gathers have no tree.
  assert collective_time("all-reduce", 1 << 20, Group(256, 8, 32), h100).decomposition == (
      "tree all-reduce, LL (NVLink + InfiniBand)")
  assert collective_time("all-gather", 1 << 20, Group(256, 8, 32), h100).decomposition == (
      "ring all-gather, LL (NVLink + InfiniBand)")


def test_a_ring_s_latency_grows_with_its_ranks_not_its_nodes():
  """A small all-gather over 1536 GPUs in 192 nodes takes 1535 ring steps: 1344 inside nodes
  (each waiting on the NIC's proxy thread, 2 us on the A100's AMD hosts) and 191 across. Over
  192 GPUs, one per node, it takes 191 steps, all across (at 5 us: NCCL prices a ring with one
  GPU per node at its tree's network latency): a third of the time. Ring latency is why FSDP
  over thousands of GPUs gathers few, large tensors."""
  a100 = CATALOG["a100-80gb"]
  wide = collective_time("all-gather", 1 << 10, Group(1536, 8, 192), a100)
  narrow = collective_time("all-gather", 1 << 10, Group(192, 1, 192), a100)
  assert wide.seconds == pytest.approx(6.6e-6 + 1344 * 2e-6 + 191 * 2.7e-6, rel=0.01)
  assert narrow.seconds == pytest.approx(6.6e-6 + 191 * 5.0e-6, rel=0.01)
  assert wide.seconds > 3 * narrow.seconds
  # The alpha-beta model (TPUs) gathers hierarchically instead: few steps across the slow level.
  tpu = CATALOG["tpu-v4"]
  assert "+" in collective_time("all-gather", 1 << 30, Group(8192, 4096, 2), tpu).decomposition


def test_small_all_reduces_over_large_groups_run_as_trees():
  tpu = CATALOG["tpu-v4"]
  small = collective_time("all-reduce", 4e6, Group(256, 256, 1), tpu)
  assert small.decomposition == "all-reduce tree(ICI)"
  ring_latency = 2 * 255 * tpu.intra.latency
  assert small.seconds < ring_latency / 4  # log2(256) latency steps instead of 255
  big = collective_time("all-reduce", 4e9, Group(8, 8, 1), tpu)
  assert big.decomposition == "all-reduce(ICI)"  # a ring moves 2 (n-1)/n of the data, a tree 2
  gather = collective_time("all-gather", 4e6, Group(256, 256, 1), tpu)
  assert gather.decomposition == "all-gather(ICI)"


@pytest.mark.slow
def test_megatron_inside_a_node_beats_megatron_across_nodes():
  workload = corpus.load("gpt:1.3b")
  program = P.trace(workload.fn, *workload.args)
  pp = P.apply(program, "batch=8,model=8", "BatchParallel(batch); Megatron(model)")
  inside = simulate(pp, "h100")
  across = simulate(pp, "h100", order=["model", "batch"])
  assert inside.placement == {"batch": "inter", "model": "intra"}
  assert across.exposed_comm_s > 3 * inside.exposed_comm_s
  assert across.step_time_s > 1.5 * inside.step_time_s
  assert {d["decomposition"].split(" (")[1] for d in across.decompositions()
          if d["axes"] == ["model"]} == {"InfiniBand)"}


def test_independent_gradient_all_reduces_combine_up_to_the_threshold():
  _, program = traced("mlp:mini")
  pp = P.apply(program, "batch=8", "BatchParallel(batch)")
  h100 = CATALOG["h100"]
  alone, combined, small = (simulate(pp, h100.combining(t)) for t in (0, 30 << 20, 20 << 10))
  grads = combined.collectives
  assert [c.kind for c in grads] == ["all-reduce"] * 7
  # Made in the backward pass, read by the update: in the order they are ready, buckets of at
  # most 30 MiB (16 MiB + 4 KiB + 16 KiB, then 64 MiB alone, ...). The loss is awaited at once.
  assert [c.combined for c in grads] == [1, 3, 3, 3, 1, 2, 2]
  bucket = [c for c in grads if c.combined == 3]
  assert sum(c.bytes for c in bucket) <= 30 << 20
  whole = collective_time("all-reduce", sum(c.bytes for c in bucket), Group(8, 8, 1),
                          CATALOG["h100"])
  assert sum(c.seconds for c in bucket) == pytest.approx(whole.seconds)   # shared by bytes
  assert combined.comm_s < alone.comm_s and combined.step_time_s < alone.step_time_s
  assert sum(d["launches"] for d in combined.decompositions()) == pytest.approx(4)
  # Under 20 KiB the two small gradients would fit one bucket, but a 16 MiB one between them
  # closes it (buckets are filled in order): nothing combines.
  assert [c.combined for c in small.collectives] == [1] * 7
  assert small.comm_s == pytest.approx(alone.comm_s)


def test_a_collective_awaited_before_the_next_is_ready_does_not_combine():
  def forward(x, ws):
    for w in ws:
      x = jnp.tanh(x @ w)
    return x
  program = P.trace(forward, jax.ShapeDtypeStruct((64, 256), jnp.float32),
                    [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 6)
  # Each weight split on its contracted dimension: every layer ends in a reduction of a
  # partial sum that the next layer reads before the next one is made.
  pp = P.apply(program, "model=8", "; ".join(f"Tile(ws/{i}, 0, model)" for i in range(6)))
  combined, alone = simulate(pp, "h100"), simulate(pp, CATALOG["h100"].combining(0))
  assert len(combined.collectives) >= 6
  assert all(c.combined == 1 for c in combined.collectives)
  assert combined.step_time_s == pytest.approx(alone.step_time_s)


def test_local_flops_divide_by_the_sharding_and_elementwise_chains_fuse():
  f = lambda x, w: jnp.tanh(jnp.exp(x @ w) * 2.0)
  program = P.trace(f, jax.ShapeDtypeStruct((64, 256), jnp.float32),
                    jax.ShapeDtypeStruct((256, 512), jnp.float32))
  whole = simulate(P.apply(program, "a=8", ""), "h100")
  split = simulate(P.apply(program, "a=8", "Tile(x, 0, a)"), "h100")
  assert whole.flops == 2 * 64 * 256 * 512 + 3 * 64 * 512
  assert split.flops == whole.flops / 8
  # The matmul reads x and w and writes its product; exp, mul and tanh are one kernel that
  # reads the product once and writes the result: exp's and mul's outputs never hit memory.
  x, w, out = 64 * 256 * 4 / 8, 256 * 512 * 4, 64 * 512 * 4 / 8
  assert split.hbm_bytes == x + w + out + out + out + 4  # and the literal 2.0


def test_each_kernel_launch_costs_the_hardware_s_launch_time():
  # Two kernels (the matmul; exp, mul and tanh fused), each 4 us on a GPU beside its roofline;
  # a loop's body launches once per iteration.
  h100 = CATALOG["h100"]
  free = h100.launching(0.0)
  assert h100.kernel_launch_s == 4e-6 and CATALOG["cpu"].kernel_launch_s == 0
  f = lambda x, w: jnp.tanh(jnp.exp(x @ w) * 2.0)
  pp = P.apply(P.trace(f, _f32(64, 256), _f32(256, 512)), "a=8", "Tile(x, 0, a)")
  assert Simulator(pp.program, pp.mesh, h100).work.groups == 2
  assert simulate(pp, h100).compute_s == pytest.approx(simulate(pp, free).compute_s + 8e-6)

  def loop(x, w):
    return jax.lax.fori_loop(0, 10, lambda i, y: jnp.tanh(y @ w), x)
  pp = P.apply(P.trace(loop, _f32(64, 256), _f32(256, 256)), "a=8", "Tile(x, 0, a)")
  extra = simulate(pp, h100).compute_s - simulate(pp, free).compute_s
  # The loop's entry and exit once; its counter, matmul and tanh ten times each.
  assert extra == pytest.approx(32 * h100.kernel_launch_s)


def _f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def _adam_step_of_biased_layers(add_bias):
  tx = optax.adam(1e-3)

  def loss(params, x):
    for w, b in params:
      x = jnp.tanh(add_bias(x @ w, b))
    return jnp.mean(x ** 2)

  def step(params, opt, x):
    updates, opt = tx.update(jax.grad(loss)(params, x), opt, params)
    return optax.apply_updates(params, updates), opt
  params = [(_f32(2048, 2048), _f32(2048))] * 8
  return P.trace(step, params, jax.eval_shape(tx.init, params), _f32(64, 512, 2048))


def test_a_reduction_over_unit_dimensions_is_a_bitcast_that_waits_with_the_update():
  """`x + b` (HF GPT-2's `Conv1D`, the corpus GPT) traces a vector bias's gradient as a sum over
  the batch, then a sum over the unit dimensions of the bias as broadcast, which XLA's
  simplifier drops. Read as a kernel right after the first sum, it held the bias gradient's
  all-reduce, and the bucket it combines into, on the backward pass's critical path."""
  def unit_sum(x):
    return jnp.sum(jnp.sum(x, axis=(0, 1)).reshape(1, 1, -1), axis=(0, 1))
  hlo = jax.jit(unit_sum).lower(jnp.ones((4, 8, 16))).compile().as_text()
  assert hlo.count(" reduce(") == 1
  explicit = _adam_step_of_biased_layers(
      lambda y, b: y + jax.lax.broadcast_in_dim(b, y.shape, (2,)))   # one sum per bias
  implicit = _adam_step_of_biased_layers(lambda y, b: y + b)
  count = lambda program: sum(op.name == "reduce_sum" for op in program.ops)
  assert count(implicit) == count(explicit) + 8
  dp = [simulate(P.apply(p, "batch=64", "BatchParallel(batch)"), "h100")
        for p in (explicit, implicit)]
  assert dp[1].step_time_s == pytest.approx(dp[0].step_time_s, rel=1e-9)
  assert dp[1].exposed_comm_s == pytest.approx(dp[0].exposed_comm_s, rel=1e-9)
  assert dp[1].exposed_comm_s < 0.8 * dp[1].comm_s


@pytest.mark.slow
def test_gradient_all_reduce_overlaps_megatron_all_reduce_does_not():
  workload = corpus.load("gpt:1.3b")
  program = P.trace(workload.fn, *workload.args)
  dp = simulate(P.apply(program, "batch=64", "BatchParallel(batch)"), "h100")
  tp = simulate(P.apply(program, "model=8", "Megatron(model)"), "h100")
  # Gradient all-reduces run beside the backward pass; only the last ones (the embedding's) are
  # exposed (0.06 of the time on both stacks; 0.38-0.61 while bias gradients' sums over unit
  # dimensions were kernels that awaited them). Megatron's all-reduces sit on the critical path.
  assert dp.exposed_comm_s < 0.15 * dp.comm_s
  assert tp.exposed_comm_s > 0.75 * tp.comm_s
  for c in dp.collectives + tp.collectives:  # a wait is charged to what runs during it
    assert 0 <= c.exposed_seconds <= c.seconds * (1 + 1e-9)
  cpu = simulate(P.apply(program, "batch=64", "BatchParallel(batch)"), "cpu")
  assert cpu.exposed_comm_s == pytest.approx(cpu.comm_s)  # no async collectives on the host


@pytest.mark.slow
def test_memory_follows_the_strategy():
  workload = corpus.load("gpt:1.3b,remat=false")  # activations kept for the backward
  program = P.trace(workload.fn, *workload.args)
  mem = lambda s, mesh="batch=8": simulate(P.apply(program, mesh, s), "a100-80gb").memory
  dp = mem("BatchParallel(batch)")
  zero1 = mem("ZeRO(batch, stage=1)")
  zero3 = mem("ZeRO(batch, stage=3)")
  assert zero1.breakdown["optimizer_state"] < dp.breakdown["optimizer_state"] / 7
  assert zero1.breakdown["parameters"] == dp.breakdown["parameters"]
  assert zero3.argument_bytes < dp.argument_bytes / 7
  assert dp.breakdown["activations"] > dp.breakdown["parameters"]
  tp = mem("BatchParallel(batch); Megatron(model)", "batch=8,model=8")
  assert tp.breakdown["activations"] < dp.breakdown["activations"] / 4


def test_donated_state_counts_once():
  _, program = traced("mlp:small,width=2048,batch=8")  # memory is all parameters and Adam
  pp = P.apply(program, "batch=8", "BatchParallel(batch)")
  donated = simulate(pp, "h100").memory
  kept = simulate(pp, "h100", donate=False).memory
  state = donated.breakdown["parameters"] + donated.breakdown["optimizer_state"]
  # Without donation the step ends holding old and new state; with it, state counts once and
  # the peak is state plus the gradients in flight.
  assert kept.peak_bytes >= kept.argument_bytes + kept.output_bytes >= 2 * state
  assert donated.peak_bytes < kept.peak_bytes
  assert donated.peak_bytes == state + sum(v for k, v in donated.breakdown.items()
                                           if k not in ("parameters", "optimizer_state"))


@pytest.mark.slow
def test_pure_data_parallel_does_not_fit_a_6_7b_gpt_and_fsdp_does():
  workload = corpus.load("gpt:6.7b,batch=64,seq=1024,scan=True")   # one layer traced
  program = P.trace(workload.fn, *workload.args)
  dp = simulate(P.apply(program, "batch=64", "BatchParallel(batch)"), "a100-40gb")
  fsdp = simulate(P.apply(program, "batch=64", "ZeRO(batch, stage=3)"), "a100-40gb")
  assert not dp.fits and dp.memory.breakdown["parameters"] > 20 * GiB
  assert fsdp.fits


STRATEGIES = [("batch=8", "BatchParallel(batch)"), ("model=8", "Megatron(model)"),
              ("batch=2,model=4", "BatchParallel(batch); Megatron(model)"),
              ("batch=8", "ZeRO(batch, stage=3)"),
              ("batch=4,model=2", "BatchParallel(batch); Megatron(model); ZeRO(batch, stage=1)")]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,schedule", STRATEGIES)
def test_memory_agrees_with_xla(mesh, schedule):
  """Arguments per device are exact; the peak footprint is within the band measured in
  docs/validation.md (0.6-1.1 of XLA's arguments + outputs + temporaries)."""
  workload, program = traced("gpt:small")
  pp = P.apply(program, mesh, schedule)
  compiled = jax.jit(pp.lower_spmd(pp.mesh.to_jax())).lower(*workload.args).compile()
  xla = compiled.memory_analysis()
  predicted = simulate(pp, "cpu", donate=False).memory
  assert predicted.argument_bytes == xla.argument_size_in_bytes
  footprint = (xla.argument_size_in_bytes + xla.output_size_in_bytes + xla.temp_size_in_bytes -
               xla.alias_size_in_bytes)
  assert 0.6 <= predicted.peak_bytes / footprint <= 1.1
  # XLA's outputs add a pointer table of 8 bytes per output leaf.
  assert xla.output_size_in_bytes == predicted.output_bytes + 8 * len(program.outputs)


def test_views_and_conversions_have_no_buffer_of_their_own():
  """A reshape of x and x * 2, made before a matmul and read after it: XLA bitcasts the one
  and computes the other inside the reduction that reads it, so across the matmul only x, w
  and its result are held (not two more copies of x)."""
  def step(x, w):
    y, z = x.reshape(256, 4096), x * 2.0
    h = x @ w
    return h.sum() + y.sum() + z.sum()
  x = w = jnp.ones((1024, 1024), jnp.float32)
  memory = simulate(P.apply(P.trace(step, x, w), "batch=8", ""), "cpu").memory
  assert memory.peak_bytes <= 3 * x.nbytes + 1024


def test_donated_memory_agrees_with_xla_where_activations_count():
  """gpt:small at batch 32 x 64 under data parallelism, parameters and optimizer state
  donated on both sides: within 10% of XLA's footprint (docs/validation.md has every family)."""
  workload = corpus.load("gpt:small,batch=32,seq=64", abstract=True)
  program = P.trace(workload.fn, *workload.args)
  pp = P.apply(program, "batch=8", "BatchParallel(batch)")
  xla = pp.jit(pp.mesh.to_jax(), donate=True).lower(*workload.args).compile().memory_analysis()
  assert xla.alias_size_in_bytes >= 0.99 * xla.argument_size_in_bytes   # the state is donated
  footprint = (xla.argument_size_in_bytes + xla.output_size_in_bytes + xla.temp_size_in_bytes -
               xla.alias_size_in_bytes)
  assert 0.9 <= simulate(pp, "cpu").memory.peak_bytes / footprint <= 1.1
