"""HF's own blocks under `nn.scan` (`stack=scan`, and `remat=true`): the step a user who wants a
pipeline writes is HF's unrolled step on the same weights, stacked. Not marked slow: the tiny
models compile in seconds, and current JAX runs them too (`make test-current`)."""

import jax
import pytest

import corpus
import partitioner as P
from partitioner.errors import WorkloadError


def _restacked(tree, layers: int):
  """An HF model's parameters (or optimizer state) in `stack=scan`'s structure: the blocks
  `.../0 .. .../L-1` stacked by layer under `.../layers/block`."""
  import jax.numpy as jnp
  if hasattr(tree, "keys"):
    tree = dict(tree)
    if set(tree) == {str(i) for i in range(layers)}:
      blocks = [_restacked(tree[str(i)], layers) for i in range(layers)]
      return {"layers": {"block": jax.tree_util.tree_map(lambda *a: jnp.stack(a), *blocks)}}
    return {k: _restacked(v, layers) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(_restacked(v, layers) for v in tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(_restacked(v, layers) for v in tree)
  return tree


@pytest.mark.parametrize("family, extra", [("hf_gpt2", ""), ("hf_llama", ""), ("hf_mistral", ""),
                                           ("hf_llama", ",remat=true")])
def test_blocks_under_nn_scan_are_hf_s_own_step(family, extra):
  """`stack=scan` runs HF's own block (GPT-2's fused q/k/v; Llama's and Mistral's grouped
  key/value heads, RMSNorm, SwiGLU and rotary positions) under nn.scan, with `remat=true`
  each block under nn.remat (the backward loop computes the block again): on the same weights
  (stacked) the training step computes what HF's unrolled model does, loss and updated state,
  judged as `verify` judges a lowering: against the unrolled step in float64, no further from
  it than the float32 unrolled step's own rounding (which AdamW's first step amplifies to +-lr
  where a gradient is zero but for rounding) allows."""
  from partitioner.verify import _close_to_exact, exact_outputs
  leaves = jax.tree_util.tree_leaves
  unrolled = corpus.load(f"{family}:small,layers=3")
  scanned = corpus.load(f"{family}:small,layers=3,stack=scan{extra}")
  args = _restacked(unrolled.args, 3)
  assert jax.tree_util.tree_structure(args) == jax.tree_util.tree_structure(scanned.args)
  got = jax.jit(scanned.fn)(*args)
  out = jax.jit(unrolled.fn)(*unrolled.args)
  exact = exact_outputs(P.trace(unrolled.fn, *unrolled.args), leaves(unrolled.args))
  assert exact is not None, "the unrolled step has no float64 form to judge by"
  exact = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out), exact)
  assert _close_to_exact(leaves(_restacked(out, 3)), leaves(got), leaves(_restacked(exact, 3)),
                         rtol=1e-4, atol=1e-5)
  if extra:   # the backward loop runs the block's matmuls again
    dots = lambda w: sum(op.primitive.name == "dot_general"
                         for op in P.trace(w.fn, *w.args, loops="keep").ops)
    assert dots(scanned) > dots(corpus.load(f"{family}:small,layers=3,stack=scan"))


def test_a_stack_that_cannot_be_scanned_is_refused():
  with pytest.raises(WorkloadError, match="stack must be one of unrolled, scan"):
    corpus.load("hf_gpt2:small,stack=loop")
  with pytest.raises(WorkloadError, match="hf_opt: stack=scan is written for hf_gpt2, hf_llama"):
    corpus.load("hf_opt:small,stack=scan")
  with pytest.raises(WorkloadError, match="remat=true needs stack=scan"):
    corpus.load("hf_llama:small,remat=true")
