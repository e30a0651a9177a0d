"""A V-MoE classification step (Riquelme et al. 2021): a Vision Transformer whose every other
block's feed-forward is a set of routed experts (`moe.block`: top-k router, capacity,
load-balancing loss). It is a train family so that policies learn from routed experts; the
held-out `moe` family puts them in a causal language model instead."""

from __future__ import annotations

import dataclasses

import haiku as hk

from corpus import layers as L
from corpus import moe, vit


@dataclasses.dataclass(frozen=True)
class VMoEConfig(vit.ViTConfig):
  experts: int = 4
  top_k: int = 2
  capacity_factor: float = 1.25
  moe_every: int = 2       # every n-th block (the last of each n) is a MoE block
  aux_weight: float = 0.01


PRESETS = {
    "small": VMoEConfig(),
    # two layers at realistic widths, the second with 8 experts
    "mini": VMoEConfig(layers=2, d_model=1024, heads=16, image=224, patch=16, classes=1000,
                       batch=128, experts=8),
    # V-MoE-B/16: 12 layers, 32 experts in every other block
    "base": VMoEConfig(layers=12, d_model=768, heads=12, image=224, patch=16, classes=1000,
                       batch=1024, experts=32, remat=True),
}


def _forward(c: VMoEConfig):
  def forward(images):
    with hk.name_scope("vmoe"):
      x, aux = vit.embed_patches(c, images), 0.0
      for i in range(c.layers):
        with hk.name_scope(f"layer_{i}"):
          x, a = L.checkpointed(moe.block, c.remat, c=c, causal=False,
                                experts=(i + 1) % c.moe_every == 0)(x)
          aux = aux + a
      return vit.classify(c, x), aux
  return hk.without_apply_rng(hk.transform(forward))


def make(config: VMoEConfig):
  """(train_step, init) for the config; init(key) -> (params, opt_state, batch)."""
  return vit.classifier_step(_forward(config), config, config.aux_weight)
