"""The model corpus by name: `gpt:small`, `gpt:layers=24,d_model=2048`, `mlp:small,width=512`."""

from __future__ import annotations

import importlib.util
import re
from typing import Callable, NamedTuple

import jax

from corpus import bert, gnn, gpt, hf, mlp, moe, resnet, ssm, t5, unet, vit, vmoe
from corpus.workload import Workload, abstractify, load_user, parameter_count, replace_config
from partitioner.errors import WorkloadError

# Above this many parameters example arguments are abstract unless asked otherwise.
ABSTRACT_ABOVE = 50_000_000


class Family(NamedTuple):
  name: str
  make: Callable          # config -> (train_step, init)
  presets: dict
  default: str
  split: str              # "train" or "heldout"
  description: str


def _family(module, split: str, description: str) -> Family:
  name = module.__name__.rsplit(".", 1)[-1]
  return Family(name, module.make, module.PRESETS, "small", split, description)


# Training families cover the building blocks (dense layers, self-attention, embeddings,
# convolutions with batch norm, gather/scatter message passing, routed experts in an encoder);
# the held-out families recombine them in ways the training set never shows: cross-attention
# between two stacks, routed experts in a causal language model, a U-shaped conv net with long
# skips, a recurrence over time.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    _family(mlp, "train", "multi-layer perceptron, MSE, Adam"),
    _family(gpt, "train", "GPT decoder: causal attention, pre-LN, tied embeddings, Adam + clip"),
    _family(bert, "train", "BERT encoder: post-LN, masked-LM head on masked positions, AdamW"),
    _family(vit, "train", "Vision Transformer: patch embedding, class token, AdamW"),
    _family(resnet, "train", "ResNet: convolutions, batch norm, max pool, SGD + Nesterov"),
    _family(gnn, "train", "graph network: encode-process-decode, gather/scatter over edges"),
    _family(vmoe, "train", "V-MoE: a Vision Transformer with routed experts in every other block"),
    _family(t5, "heldout", "T5 encoder-decoder: cross-attention, shared embeddings, ReLU FFN"),
    _family(moe, "heldout", "MoE decoder: top-k router, expert capacity, load-balancing loss"),
    _family(unet, "heldout", "diffusion UNet: res blocks, group norm, skips, noise prediction"),
    _family(ssm, "heldout", "state-space LM: diagonal linear recurrence with lax.scan, GLU"),
    # The real-models tier: HuggingFace Flax models as their users write them (corpus/hf.py).
    _family(hf.hf_gpt2, "real", "HF Flax GPT-2: fused q/k/v (c_attn), Conv1D kernels, AdamW"),
    _family(hf.hf_bert, "real", "HF Flax BERT masked LM: post-LN, tied decoder, AdamW"),
    _family(hf.hf_t5, "real", "HF Flax T5: relative position buckets, RMS norm, AdamW"),
    _family(hf.hf_vit, "real", "HF Flax ViT: patch convolution, class token, AdamW"),
    # The external tier: more HuggingFace Flax models, never trained on, at published shapes;
    # how policies carry over to programs written elsewhere is measured on these.
    _family(hf.hf_llama, "external", "HF Flax Llama: RMSNorm, SwiGLU, rotary positions, "
            "grouped-query attention, AdamW"),
    _family(hf.hf_mistral, "external", "HF Flax Mistral: Llama's blocks with sliding-window "
            "attention and 8 key/value heads, AdamW"),
    _family(hf.hf_opt, "external", "HF Flax OPT: learned positions, ReLU FFN, AdamW"),
    _family(hf.hf_gptneo, "external", "HF Flax GPT-Neo: alternating global and local "
            "attention, AdamW"),
    _family(hf.hf_bart, "external", "HF Flax BART: encoder-decoder, learned positions, AdamW"),
    _family(hf.hf_roberta, "external", "HF Flax RoBERTa masked LM: BERT's encoder with "
            "padding-offset positions, AdamW"),
    _family(hf.hf_bloom, "external", "HF Flax BLOOM: ALiBi, fused query_key_value, 250k "
            "vocabulary, AdamW"),
    _family(hf.hf_gemma, "external", "HF Flax Gemma: multi-query attention, 256-wide heads, "
            "GeGLU, 256k vocabulary, AdamW"),
)}

SPLITS = ("train", "heldout", "real", "external")

# At one preset each train family has one best expert strategy, so the training tasks would
# demonstrate only a few strategy families (ZeRO-2, Megatron, dp) and never the Megatron
# mixtures that small batches want. These batch sizes make another family win on
# batch=4,model=2 with H100's collective combining, with either axis of that node as the
# model axis (mini: gpt at 4 and 8 and bert at 8 and 16 sequences: Megatron with
# vocabulary-parallel embeddings over the 4-way axis; vit at 16: hybrid ZeRO-2; an MLP at 2k
# examples: Megatron with ZeRO-3; resnet at a large batch: hybrid ZeRO-2, where at 256
# nothing beats leaving it unpartitioned; an MLP at 32k: ZeRO-3). The best strategy follows
# the work a step does per parameter byte, not the family, and a policy that sees both sides
# of a boundary learns that instead of the family's name.
TRAIN_VARIANTS = {"mini": ("gpt:mini,batch=4", "bert:mini,batch=8", "vit:mini,batch=16",
                           "resnet:mini,batch=1024", "gpt:mini,batch=8", "bert:mini,batch=16",
                           "mlp:mini,batch=2048", "mlp:mini,batch=32768")}


def split(name: str) -> list[str]:
  """The family names of a split: "train" (to learn from), "heldout" (to evaluate on), "real"
  (HuggingFace models, written by others) or "external" (more of them, never trained on)."""
  if name not in SPLITS:
    raise WorkloadError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
  return [f.name for f in FAMILIES.values() if f.split == name]


def train_models(preset: str) -> list[str]:
  """The train split at `preset`, then its variants (`TRAIN_VARIANTS`): what policies learn
  from."""
  return [f"{name}:{preset}" for name in split("train")] + list(TRAIN_VARIANTS.get(preset, ()))


def family_of(spec: str) -> str | None:
  """The corpus family a model spec names; None for a user's `module:function`."""
  head = spec.partition(":")[0]
  return head if head in FAMILIES else None


def parse(spec: str):
  """(family, config) of a corpus spec."""
  family_name, _, rest = spec.partition(":")
  family = FAMILIES.get(family_name)
  if family is None:
    raise WorkloadError(f"unknown model family {family_name!r}; corpus: {', '.join(FAMILIES)}")
  preset, overrides = family.default, {}
  for part in filter(None, (p.strip() for p in rest.split(","))):
    key, eq, val = part.partition("=")
    if eq:
      overrides[key.strip()] = val.strip()
    elif part in family.presets:
      preset = part
    else:
      raise WorkloadError(f"{family_name} has no preset {part!r}; presets: "
                          f"{', '.join(family.presets)} (or knobs like layers=4)")
  return family, replace_config(family.presets[preset], overrides, family_name)


def build(spec: str, abstract: bool | None = None) -> Workload:
  """The training step of a corpus entry with example arguments (abstract for large sizes)."""
  family, config = parse(spec)
  train_step, init = family.make(config)
  key = jax.random.PRNGKey(config.seed)
  shapes = jax.eval_shape(init, key)
  if abstract is None:
    abstract = parameter_count(shapes[0]) > ABSTRACT_ABOVE
  args = shapes if abstract else init(key)
  return Workload(spec, train_step, tuple(args))


def check_name(spec: str) -> None:
  """Refuses, without tracing or importing anything, a spec that names neither a corpus entry
  (bad presets and knobs included) nor a plausible `module:function` / `path.py:function`."""
  head = spec.partition(":")[0]
  if head in FAMILIES:
    parse(spec)
    return
  if ":" not in spec:
    raise WorkloadError(f"unknown model {spec!r}; use a corpus name ({', '.join(FAMILIES)}) "
                        "or module:function / path.py:function")
  if re.fullmatch(r"[A-Za-z_]\w*", head) and importlib.util.find_spec(head) is None:
    raise WorkloadError(f"unknown model {spec!r}: {head!r} is neither a corpus family "
                        f"({', '.join(FAMILIES)}) nor an importable module")


def load(spec: str, abstract: bool | None = None) -> Workload:
  """A corpus name, or a user's `module:function` / `path.py:function`."""
  check_name(spec)
  if spec.partition(":")[0] in FAMILIES:
    return build(spec, abstract)
  workload = load_user(spec)
  return workload._replace(args=abstractify(workload.args)) if abstract else workload
