"""The expert's hand schedules that name a program's own parameters (`stack_schedules`)."""

import pytest

import corpus
import partitioner as P
from agents.search.expert import evaluate_experts, stack_schedules
from environments import PartitioningEnv, Task
from partitioner import roles as R
from partitioner.verify import verify


def _env(model, mesh="batch=4,model=2", hardware="h100"):
  env = PartitioningEnv(Task(model, mesh, hardware))
  env.reset()
  return env


@pytest.mark.parametrize("model", ["gpt:small", "gpt:small,scan=true"])
def test_zero3_stack_tiles_each_layer_matrix_once_and_nothing_else(model):
  """Every weight matrix repeated in every layer (an unrolled stack's `layer_*` or a scanned
  stack's stacked array) tiled over the model axis along its largest dimension, never the
  layer dimension; the embeddings, norms and biases whole. Both lowerings compute what the
  unpartitioned step does."""
  env = _env(model)
  ctx = env.context
  schedules = stack_schedules(ctx, ("batch", "model"))
  assert set(schedules) == {"zero3-stack", "zero3-stack[batch]"}
  tactics = P.parse_schedule(schedules["zero3-stack"])
  assert tactics[:2] == [P.BatchParallel("batch"), P.BatchParallel("model")]
  tiles = tactics[2:]
  assert all(isinstance(t, P.Tile) and t.axis == "model" for t in tiles)
  stacked = R.stacked_dims(ctx.program)
  points = {p.pattern: p for p in ctx.points if p.role == "param"}
  # The layer's four attention projections and two MLP matrices, in every layer.
  layers = "params/gpt/layers/__layer_stack_no_per_layer/" if "scan" in model else \
      "params/gpt/layer_*/"
  assert sorted(t.value for t in tiles) == [
      layers + w for w in ("attn/key/w", "attn/out/w", "attn/query/w", "attn/value/w",
                           "w_in/w", "w_out/w")]
  for t in tiles:
    p = points[t.value]
    layer = stacked.get(p.members[0])
    assert t.dim != layer
    assert p.shape[t.dim] == max(n for d, n in enumerate(p.shape) if d != layer)
  assert not any("embed" in t.value or t.value.endswith("/b") for t in tiles)

  workload = corpus.load(model)
  pp = P.apply(ctx.program, "batch=4,model=2", schedules["zero3-stack"])
  for t in tiles:
    for m in points[t.value].members:
      assert "model" in pp.sharding(ctx.program.name(m)).dims[t.dim]
  whole = [n for n in pp.input_shardings() if n.startswith("params/") and "embed" in n]
  assert whole and all(not any(pp.sharding(n).dims) for n in whole)
  assert verify(pp, workload.args).ok


def test_zero3_stack_leaves_the_embedding_and_head_out_of_the_gathers():
  """HF Llama 1B at 64 H100s: ZeRO-3 over the node gathers the embedding and the head as well,
  at the step's two ends where no layer hides them; sharding only the layers' matrices is
  faster, exposes less communication, and the expert and the guard cost it with the others."""
  env = _env("hf_llama:1b,batch=64", "batch=8,model=8")
  results = {r.name: r for r in evaluate_experts(env)}
  stack, zero3 = results["zero3-stack"].cost, results["zero3"].cost
  assert results["zero3-stack"].fits
  assert stack.step_time_s < 0.8 * zero3.step_time_s
  assert stack.exposed_comm_s < zero3.exposed_comm_s
  assert not any("embed" in t or "lm_head" in t
                 for t in results["zero3-stack"].schedule.split("; "))
  # Played as the task's own actions, as the expert agent and the guard play it.
  assert [env.action_name(a) for a in results["zero3-stack"].actions] == [
      str(t) for t in P.parse_schedule(results["zero3-stack"].schedule)]
