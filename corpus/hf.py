"""The real-models tier: HuggingFace Flax models built from configs (random weights, nothing
downloaded) as training steps with an optax optimizer, written the way their users write them.

These programs are not in the corpus' house style: Flax parameter trees (`kernel`, `bias`,
`Dense_0`), GPT-2's fused q/k/v projection (`c_attn`), T5's relative position buckets, ViT's
patch convolution. Each family's `style` knob spells the same step three ways:
`named` (`train_step(params, opt_state, batch)`), `short` (`step(p, o, t)`) and `train_state`
(`train_step(state, batch)` with a Flax `TrainState` whose step count is a Python int and whose
`apply_fn`/`tx` are static fields). `dtype=bfloat16` keeps parameters and activations in bf16;
with `param_dtype=float32` too, the parameters and optimizer state stay f32 (master weights)
and the models compute in bf16. HF writes every layer stack as a Python loop over blocks (one
set of parameters per layer); `stack=scan` runs HF's own block (`FlaxGPT2Block`,
`FlaxLlamaDecoderLayer`, `FlaxMistralDecoderLayer`) under Flax's `nn.scan` instead (parameters
stacked by layer), as a user who wants a pipeline rewrites the stack; other families refuse it.
`remat=true` puts each scanned block under `nn.remat` (`jax.checkpoint`).

Presets: `small` (tiny, for tests), `mini` (two layers at published widths) and the published
sizes: hf_gpt2 `124m`/`355m`, hf_bert `base`/`large`, hf_t5 `60m` (t5-small)/`220m` (t5-base),
hf_vit `base`; and for the external tier (never trained on) hf_llama `1b`/`7b`, hf_mistral
`7b`, hf_opt and hf_gptneo `125m`/`1.3b`, hf_bart and hf_roberta `base`/`large`, hf_bloom
`560m`, hf_gemma `2b`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from partitioner.errors import WorkloadError

STYLES = ("named", "short", "train_state")
STACKS = ("unrolled", "scan")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class HFConfig:
  layers: int = 2
  d_model: int = 64
  heads: int = 4
  ffn: int = 256
  vocab: int = 512
  seq: int = 32
  batch: int = 8
  image: int = 32          # ViT: image side
  patch: int = 8           # ViT: patch side
  classes: int = 10        # ViT: labels
  kv_heads: int = 0        # key/value heads of grouped-query attention (0: as many as heads)
  head_dim: int = 0        # Gemma: per-head width (0: d_model / heads)
  style: str = "named"
  stack: str = "unrolled"      # "scan": the blocks under nn.scan (hf_gpt2, hf_llama, hf_mistral)
  remat: bool = False          # with stack=scan: each block under nn.remat (jax.checkpoint)
  dtype: str = "float32"       # activations (the models' computation dtype)
  param_dtype: str = ""        # parameters and optimizer state ("": dtype; float32: master)
  lr: float = 1e-3
  seed: int = 0


def _presets(**published) -> dict:
  return {"small": HFConfig(), **published}


GPT2_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=768, heads=12, ffn=3072, vocab=50257, seq=512, batch=16),
    **{"124m": HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=50257, seq=1024,
                        batch=32),
       "355m": HFConfig(layers=24, d_model=1024, heads=16, ffn=4096, vocab=50257, seq=1024,
                        batch=32)})
BERT_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=768, heads=12, ffn=3072, vocab=30522, seq=512, batch=16),
    base=HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=30522, seq=512, batch=32),
    large=HFConfig(layers=24, d_model=1024, heads=16, ffn=4096, vocab=30522, seq=512, batch=32))
T5_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=512, heads=8, ffn=2048, vocab=32128, seq=512, batch=16),
    **{"60m": HFConfig(layers=6, d_model=512, heads=8, ffn=2048, vocab=32128, seq=512, batch=32),
       "220m": HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=32128, seq=512,
                        batch=32)})
VIT_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=768, heads=12, ffn=3072, image=224, patch=16, classes=1000,
                  batch=32),
    base=HFConfig(layers=12, d_model=768, heads=12, ffn=3072, image=224, patch=16, classes=1000,
                  batch=64))


# The external tier: programs that no policy trains on (`corpus.registry`'s "external" split),
# at the published shapes of models people train: Llama 3.2 1B (with an untied head, as HF's
# Flax Llama has no tying: 1.5B parameters) and Llama 2 7B, Mistral 7B, OPT 125M and 1.3B,
# GPT-Neo 125M and 1.3B, BART base and large, RoBERTa base and large, BLOOM 560M, Gemma 2B.
LLAMA_PRESETS = _presets(
    small=HFConfig(heads=4, kv_heads=2),
    mini=HFConfig(layers=2, d_model=2048, heads=32, kv_heads=8, ffn=8192, vocab=32000, seq=2048,
                  batch=8),
    **{"1b": HFConfig(layers=16, d_model=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                      seq=2048, batch=64),
       "7b": HFConfig(layers=32, d_model=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
                      seq=4096, batch=64)})
MISTRAL_PRESETS = _presets(
    small=HFConfig(heads=4, kv_heads=1),
    mini=HFConfig(layers=2, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                  seq=4096, batch=8),
    **{"7b": HFConfig(layers=32, d_model=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                      seq=4096, batch=256)})
OPT_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=2048, heads=32, ffn=8192, vocab=50272, seq=2048, batch=8),
    **{"125m": HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=50272, seq=2048,
                        batch=32),
       "1.3b": HFConfig(layers=24, d_model=2048, heads=32, ffn=8192, vocab=50272, seq=2048,
                        batch=64)})
GPTNEO_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=2048, heads=16, ffn=8192, vocab=50257, seq=2048, batch=8),
    **{"125m": HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=50257, seq=2048,
                        batch=32),
       "1.3b": HFConfig(layers=24, d_model=2048, heads=16, ffn=8192, vocab=50257, seq=2048,
                        batch=64)})
BART_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=1024, heads=16, ffn=4096, vocab=50265, seq=1024, batch=16),
    base=HFConfig(layers=6, d_model=768, heads=12, ffn=3072, vocab=50265, seq=1024, batch=32),
    large=HFConfig(layers=12, d_model=1024, heads=16, ffn=4096, vocab=50265, seq=1024,
                   batch=32))
ROBERTA_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=1024, heads=16, ffn=4096, vocab=50265, seq=512, batch=32),
    base=HFConfig(layers=12, d_model=768, heads=12, ffn=3072, vocab=50265, seq=512, batch=64),
    large=HFConfig(layers=24, d_model=1024, heads=16, ffn=4096, vocab=50265, seq=512,
                   batch=64))
BLOOM_PRESETS = _presets(
    mini=HFConfig(layers=2, d_model=1024, heads=16, ffn=4096, vocab=250880, seq=2048, batch=8),
    **{"560m": HFConfig(layers=24, d_model=1024, heads=16, ffn=4096, vocab=250880, seq=2048,
                        batch=64)})
GEMMA_PRESETS = _presets(
    small=HFConfig(heads=4, kv_heads=1, head_dim=16),
    mini=HFConfig(layers=2, d_model=2048, heads=8, kv_heads=1, head_dim=256, ffn=16384,
                  vocab=256000, seq=2048, batch=8),
    **{"2b": HFConfig(layers=18, d_model=2048, heads=8, kv_heads=1, head_dim=256, ffn=16384,
                      vocab=256000, seq=2048, batch=64)})


def _check(config: HFConfig) -> None:
  if config.style not in STYLES:
    raise WorkloadError(f"style must be one of {', '.join(STYLES)}, got {config.style!r}")
  if config.stack not in STACKS:
    raise WorkloadError(f"stack must be one of {', '.join(STACKS)}, got {config.stack!r}")
  if config.remat and config.stack != "scan":
    raise WorkloadError("remat=true needs stack=scan (it checkpoints the scanned block); an "
                        "unrolled step recomputes under the Remat() tactic")
  for knob, allowed in (("dtype", DTYPES), ("param_dtype", ("",) + DTYPES)):
    if getattr(config, knob) not in allowed:
      raise WorkloadError(f"{knob} must be float32 or bfloat16, got {getattr(config, knob)!r}")
  if config.d_model % config.heads and not config.head_dim:
    raise WorkloadError(f"d_model {config.d_model} does not divide into {config.heads} heads")
  if config.kv_heads and config.heads % config.kv_heads:
    raise WorkloadError(f"{config.heads} heads do not divide into {config.kv_heads} key/value "
                        "heads")


def _cross_entropy(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _loss(model, inputs: str, labels: str, **keyword_inputs: str):
  """Cross-entropy of the model's logits on `batch[inputs]` (and keyword arguments taken from
  the batch) against `batch[labels]`."""
  def loss(params, batch):
    kwargs = {k: batch[v] for k, v in keyword_inputs.items()}
    return _cross_entropy(model(batch[inputs], params=params, **kwargs).logits, batch[labels])
  return loss


def _tokens(key, shape, vocab):
  return jax.random.randint(key, shape, 0, vocab, jnp.int32)


# Each model: config -> (the transformers model, input_shape for init_weights, loss(params,
# batch), batch(key)).
def _causal(model, c: HFConfig):
  """A causal LM's loss on next tokens and its batch."""
  def loss(params, batch):
    logits = model(batch["tokens"], params=params).logits
    return _cross_entropy(logits[:, :-1], batch["tokens"][:, 1:])

  batch = lambda key: {"tokens": _tokens(key, (c.batch, c.seq), c.vocab)}
  return model, (1, c.seq), loss, batch


def _seq2seq(model, c: HFConfig):
  """An encoder-decoder's loss on targets half the inputs' length, fed its decoder inputs,
  and its batch."""
  def batch(key):
    k1, k2, k3 = jax.random.split(key, 3)
    half = max(c.seq // 2, 1)
    return {"inputs": _tokens(k1, (c.batch, c.seq), c.vocab),
            "decoder_inputs": _tokens(k2, (c.batch, half), c.vocab),
            "targets": _tokens(k3, (c.batch, half), c.vocab)}
  loss = _loss(model, "inputs", "targets", decoder_input_ids="decoder_inputs")
  return model, (1, c.seq), loss, batch


def _gpt2(c: HFConfig, dtype):
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  cfg = GPT2Config(vocab_size=c.vocab, n_positions=c.seq, n_embd=c.d_model, n_layer=c.layers,
                   n_head=c.heads, n_inner=c.ffn, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0)
  model_class = _scanned_gpt2(c.remat) if c.stack == "scan" else FlaxGPT2LMHeadModel
  return _causal(model_class(cfg, dtype=dtype, _do_init=False), c)


def _scanned_blocks(block_class, length: int, remat: bool = False):
  """HF's own `block_class` under Flax's `nn.scan` in place of HF's Python loop over blocks:
  parameters stacked by layer under `layers/block`, called as HF's layer collections are (the
  hidden states, the attention mask, GPT-2's encoder states (none), the position ids where the
  block takes them), returning what they return without per-layer hidden states or
  attentions. With `remat`, each block runs under `nn.remat` (`jax.checkpoint`), as scanned
  stacks are written to recompute their activations."""
  import flax.linen as nn

  class Layer(nn.Module):
    config: object
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden_states, attention_mask, position_ids):
      block = block_class(self.config, dtype=self.dtype, name="block")
      where = {} if position_ids is None else {"position_ids": position_ids}
      return block(hidden_states, attention_mask, **where)[0], None

  class Blocks(nn.Module):
    config: object
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden_states, attention_mask=None, *encoder_states, position_ids=None,
                 output_hidden_states=False, output_attentions=False, **kwargs):
      if output_hidden_states or output_attentions:
        raise WorkloadError("a scanned stack returns neither hidden states nor attentions")
      if any(e is not None for e in encoder_states):
        raise WorkloadError("a scanned stack does not cross-attend")
      layer = nn.remat(Layer, prevent_cse=False) if remat else Layer
      stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=nn.broadcast, length=length)
      hidden_states, _ = stack(self.config, self.dtype, name="layers")(
          hidden_states, attention_mask, position_ids)
      return hidden_states, None, None, None
  return Blocks


@functools.cache
def _scanned_gpt2(remat: bool):
  """HF's FlaxGPT2LMHeadModel with its blocks scanned (`_scanned_blocks`, parameters under
  `h/layers/block`); everything else is HF's."""
  import flax.linen as nn
  from transformers.models.gpt2 import modeling_flax_gpt2 as gpt2

  # HF's two setups, with the scanned blocks in place of FlaxGPT2BlockCollection.
  class Module(gpt2.FlaxGPT2Module):
    def setup(self):
      c, init = self.config, jax.nn.initializers.normal(stddev=self.config.initializer_range)
      self.embed_dim = c.hidden_size
      self.wte = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=init, dtype=self.dtype)
      self.wpe = nn.Embed(c.max_position_embeddings, c.hidden_size, embedding_init=init,
                          dtype=self.dtype)
      self.dropout = nn.Dropout(rate=c.embd_pdrop)
      self.h = _scanned_blocks(gpt2.FlaxGPT2Block, c.num_hidden_layers, remat)(
          c, dtype=self.dtype)
      self.ln_f = nn.LayerNorm(epsilon=c.layer_norm_epsilon, dtype=self.dtype)

  class LMHead(gpt2.FlaxGPT2LMHeadModule):
    def setup(self):
      self.transformer = Module(self.config, dtype=self.dtype)
      self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype,
                              kernel_init=jax.nn.initializers.normal(
                                  stddev=self.config.initializer_range))

  class Model(gpt2.FlaxGPT2LMHeadModel):
    module_class = LMHead
  return Model


@functools.cache
def _scanned_decoder(family: str, remat: bool):
  """HF's Flax Llama or Mistral causal LM (`family`: "llama", "mistral") with its decoder
  layers scanned (`_scanned_blocks`, parameters under `model/layers/layers/block`): grouped
  key/value heads, RMSNorm, SwiGLU and rotary positions are HF's own."""
  import importlib

  import flax.linen as nn
  hf = importlib.import_module(f"transformers.models.{family}.modeling_flax_{family}")
  name = {"llama": "Llama", "mistral": "Mistral"}[family]
  base, head, model = (getattr(hf, f"Flax{name}{part}")
                       for part in ("Module", "ForCausalLMModule", "ForCausalLM"))

  # HF's two setups, with the scanned layers in place of its layer collection.
  class Module(base):
    def setup(self):
      c = self.config
      self.hidden_size = c.hidden_size
      self.embed_tokens = nn.Embed(
          c.vocab_size, c.hidden_size, dtype=self.dtype,
          embedding_init=jax.nn.initializers.normal(stddev=c.initializer_range))
      self.layers = _scanned_blocks(getattr(hf, f"Flax{name}DecoderLayer"),
                                    c.num_hidden_layers, remat)(c, dtype=self.dtype)
      self.norm = getattr(hf, f"Flax{name}RMSNorm")(c, dtype=self.dtype)

  class LMHead(head):
    def setup(self):
      self.model = Module(self.config, dtype=self.dtype)
      self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype,
                              kernel_init=jax.nn.initializers.normal(
                                  stddev=self.config.initializer_range))

  class Model(model):
    module_class = LMHead
  return Model


def _bert(c: HFConfig, dtype):
  from transformers import BertConfig, FlaxBertForMaskedLM
  cfg = BertConfig(vocab_size=c.vocab, hidden_size=c.d_model, num_hidden_layers=c.layers,
                   num_attention_heads=c.heads, intermediate_size=c.ffn,
                   max_position_embeddings=c.seq, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0)
  model = FlaxBertForMaskedLM(cfg, dtype=dtype, _do_init=False)

  def batch(key):
    k1, k2 = jax.random.split(key)
    return {"tokens": _tokens(k1, (c.batch, c.seq), c.vocab),
            "labels": _tokens(k2, (c.batch, c.seq), c.vocab)}
  return model, (1, c.seq), _loss(model, "tokens", "labels"), batch


class _NumpyShim:
  """jax.numpy with what transformers' Flax models call and JAX lacks, given to such a module
  alone as its `jnp`: `clip` with NumPy's old keywords `a_min`/`a_max`, which current JAX
  removed (it spells them `min`/`max`) and Flax T5 still passes (its relative position
  buckets; the last 4.x release too, and version 5 has no Flax models); and `cat`, PyTorch's
  name for `concatenate`, which Flax BLOOM's ALiBi slopes call for a head count that is not a
  power of two (BLOOM-176B's 112), in every release."""

  def __getattr__(self, name):
    return getattr(jnp, name)

  @staticmethod
  def clip(x, a_min=None, a_max=None, *, min=None, max=None):  # noqa: A002 (JAX's names)
    return jnp.clip(x, a_min if min is None else min, a_max if max is None else max)

  cat = staticmethod(jnp.concatenate)


@functools.cache
def _t5_on_this_jax() -> None:
  """Flax T5's module (MT5 runs it too) and LongT5's, given the shim where JAX needs it."""
  import inspect

  from transformers.models.longt5 import modeling_flax_longt5
  from transformers.models.t5 import modeling_flax_t5
  if "a_max" not in inspect.signature(jnp.clip).parameters:
    modeling_flax_t5.jnp = modeling_flax_longt5.jnp = _NumpyShim()


@functools.cache
def _bloom_on_this_jax() -> None:
  from transformers.models.bloom import modeling_flax_bloom
  if not hasattr(jnp, "cat"):
    modeling_flax_bloom.jnp = _NumpyShim()


def _t5(c: HFConfig, dtype):
  from transformers import FlaxT5ForConditionalGeneration, T5Config
  _t5_on_this_jax()
  cfg = T5Config(vocab_size=c.vocab, d_model=c.d_model, d_kv=c.d_model // c.heads, d_ff=c.ffn,
                 num_layers=c.layers, num_decoder_layers=c.layers, num_heads=c.heads,
                 dropout_rate=0.0)
  return _seq2seq(FlaxT5ForConditionalGeneration(cfg, dtype=dtype, _do_init=False), c)


def _vit(c: HFConfig, dtype):
  from transformers import FlaxViTForImageClassification, ViTConfig
  if c.image % c.patch:
    raise WorkloadError(f"image {c.image} does not divide into patches of {c.patch}")
  cfg = ViTConfig(image_size=c.image, patch_size=c.patch, hidden_size=c.d_model,
                  num_hidden_layers=c.layers, num_attention_heads=c.heads,
                  intermediate_size=c.ffn, num_labels=c.classes, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
  model = FlaxViTForImageClassification(cfg, dtype=dtype, _do_init=False)

  def batch(key):
    k1, k2 = jax.random.split(key)
    # The model's __call__ takes NCHW pixels (its init_weights NHWC).
    return {"images": jax.random.normal(k1, (c.batch, 3, c.image, c.image), dtype),
            "labels": jax.random.randint(k2, (c.batch,), 0, c.classes, jnp.int32)}
  return model, (1, c.image, c.image, 3), _loss(model, "images", "labels"), batch


def _llama(c: HFConfig, dtype):
  from transformers import FlaxLlamaForCausalLM, LlamaConfig
  cfg = LlamaConfig(vocab_size=c.vocab, hidden_size=c.d_model, intermediate_size=c.ffn,
                    num_hidden_layers=c.layers, num_attention_heads=c.heads,
                    num_key_value_heads=c.kv_heads or c.heads, max_position_embeddings=c.seq)
  model_class = _scanned_decoder("llama", c.remat) if c.stack == "scan" else FlaxLlamaForCausalLM
  return _causal(model_class(cfg, dtype=dtype, _do_init=False), c)


def _mistral(c: HFConfig, dtype):
  from transformers import FlaxMistralForCausalLM, MistralConfig
  cfg = MistralConfig(vocab_size=c.vocab, hidden_size=c.d_model, intermediate_size=c.ffn,
                      num_hidden_layers=c.layers, num_attention_heads=c.heads,
                      num_key_value_heads=c.kv_heads or c.heads, max_position_embeddings=c.seq,
                      sliding_window=max(c.seq // 2, 1))
  model_class = (_scanned_decoder("mistral", c.remat) if c.stack == "scan" else
                 FlaxMistralForCausalLM)
  return _causal(model_class(cfg, dtype=dtype, _do_init=False), c)


def _opt(c: HFConfig, dtype):
  from transformers import FlaxOPTForCausalLM, OPTConfig
  cfg = OPTConfig(vocab_size=c.vocab, hidden_size=c.d_model, num_hidden_layers=c.layers,
                  ffn_dim=c.ffn, num_attention_heads=c.heads, max_position_embeddings=c.seq,
                  word_embed_proj_dim=c.d_model, dropout=0.0, attention_dropout=0.0)
  return _causal(FlaxOPTForCausalLM(cfg, dtype=dtype, _do_init=False), c)


def _gptneo(c: HFConfig, dtype):
  from transformers import FlaxGPTNeoForCausalLM, GPTNeoConfig
  # Alternating global and local (windowed) attention, as the released models.
  types = [[["global", "local"], c.layers // 2]] + ([[["global"], 1]] if c.layers % 2 else [])
  cfg = GPTNeoConfig(vocab_size=c.vocab, max_position_embeddings=c.seq, hidden_size=c.d_model,
                     num_layers=c.layers, attention_types=types, num_heads=c.heads,
                     intermediate_size=c.ffn, window_size=max(c.seq // 8, 1),
                     embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
  return _causal(FlaxGPTNeoForCausalLM(cfg, dtype=dtype, _do_init=False), c)


def _bloom(c: HFConfig, dtype):
  from transformers import BloomConfig, FlaxBloomForCausalLM
  _bloom_on_this_jax()
  cfg = BloomConfig(vocab_size=c.vocab, hidden_size=c.d_model, n_layer=c.layers, n_head=c.heads,
                    hidden_dropout=0.0, attention_dropout=0.0)
  return _causal(FlaxBloomForCausalLM(cfg, dtype=dtype, _do_init=False), c)


def _gemma(c: HFConfig, dtype):
  from transformers import FlaxGemmaForCausalLM, GemmaConfig
  cfg = GemmaConfig(vocab_size=c.vocab, hidden_size=c.d_model, intermediate_size=c.ffn,
                    num_hidden_layers=c.layers, num_attention_heads=c.heads,
                    num_key_value_heads=c.kv_heads or c.heads,
                    head_dim=c.head_dim or c.d_model // c.heads, max_position_embeddings=c.seq)
  return _causal(FlaxGemmaForCausalLM(cfg, dtype=dtype, _do_init=False), c)


def _bart(c: HFConfig, dtype):
  from transformers import BartConfig, FlaxBartForConditionalGeneration
  cfg = BartConfig(vocab_size=c.vocab, max_position_embeddings=c.seq, d_model=c.d_model,
                   encoder_layers=c.layers, decoder_layers=c.layers, encoder_ffn_dim=c.ffn,
                   decoder_ffn_dim=c.ffn, encoder_attention_heads=c.heads,
                   decoder_attention_heads=c.heads, dropout=0.0, attention_dropout=0.0,
                   activation_dropout=0.0)
  return _seq2seq(FlaxBartForConditionalGeneration(cfg, dtype=dtype, _do_init=False), c)


def _roberta(c: HFConfig, dtype):
  from transformers import FlaxRobertaForMaskedLM, RobertaConfig
  # RoBERTa's positions start after the padding index: two more than the sequence.
  cfg = RobertaConfig(vocab_size=c.vocab, hidden_size=c.d_model, num_hidden_layers=c.layers,
                      num_attention_heads=c.heads, intermediate_size=c.ffn,
                      max_position_embeddings=c.seq + 2, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
  model = FlaxRobertaForMaskedLM(cfg, dtype=dtype, _do_init=False)

  def batch(key):
    k1, k2 = jax.random.split(key)
    # Token ids from 2 up: 1 is the padding id, which RoBERTa's positions skip.
    return {"tokens": jax.random.randint(k1, (c.batch, c.seq), 2, c.vocab, jnp.int32),
            "labels": _tokens(k2, (c.batch, c.seq), c.vocab)}
  return model, (1, c.seq), _loss(model, "tokens", "labels"), batch


def _make(build: Callable, config: HFConfig):
  """(train_step, init) for one model in the config's style; init(key) -> the arguments."""
  _check(config)
  dtype = jnp.dtype(config.dtype)
  param_dtype = jnp.dtype(config.param_dtype or config.dtype)
  model, input_shape, loss, make_batch = build(config, dtype)
  tx = optax.adamw(config.lr, weight_decay=0.01)

  def init_params(key):
    params = model.init_weights(key, input_shape)
    return jax.tree_util.tree_map(lambda x: x.astype(param_dtype), params)

  if config.style == "train_state":
    from flax.training import train_state

    def train_step(state, batch):
      value, grads = jax.value_and_grad(loss)(state.params, batch)
      return state.apply_gradients(grads=grads), value

    def init(key):
      k1, k2 = jax.random.split(key)
      state = train_state.TrainState.create(apply_fn=model.__call__, params=init_params(k1),
                                            tx=tx)
      return state, make_batch(k2)
    return train_step, init

  def step(p, o, t):
    value, grads = jax.value_and_grad(loss)(p, t)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o, value

  if config.style == "named":
    def train_step(params, opt_state, batch):
      return step(params, opt_state, batch)
  else:
    train_step = step

  def init(key):
    k1, k2 = jax.random.split(key)
    params = init_params(k1)
    return params, tx.init(params), make_batch(k2)
  return train_step, init


SCANNED = ("hf_gpt2", "hf_llama", "hf_mistral")   # the families `stack=scan` rewrites


def _make_family(name: str, build: Callable, config: HFConfig):
  if config.stack == "scan" and name not in SCANNED:
    raise WorkloadError(f"{name}: stack=scan is written for {', '.join(SCANNED)} only (HF's "
                        f"blocks under nn.scan); {name} keeps HF's Python loop over layers")
  return _make(build, config)


class _Family:
  """A module-like record for the registry: `make`, `PRESETS`."""

  def __init__(self, name, build, presets):
    self.__name__ = f"corpus.{name}"
    self.make = functools.partial(_make_family, name, build)
    self.PRESETS = presets


hf_gpt2 = _Family("hf_gpt2", _gpt2, GPT2_PRESETS)
hf_bert = _Family("hf_bert", _bert, BERT_PRESETS)
hf_t5 = _Family("hf_t5", _t5, T5_PRESETS)
hf_vit = _Family("hf_vit", _vit, VIT_PRESETS)
hf_llama = _Family("hf_llama", _llama, LLAMA_PRESETS)
hf_mistral = _Family("hf_mistral", _mistral, MISTRAL_PRESETS)
hf_opt = _Family("hf_opt", _opt, OPT_PRESETS)
hf_gptneo = _Family("hf_gptneo", _gptneo, GPTNEO_PRESETS)
hf_bart = _Family("hf_bart", _bart, BART_PRESETS)
hf_roberta = _Family("hf_roberta", _roberta, ROBERTA_PRESETS)
hf_bloom = _Family("hf_bloom", _bloom, BLOOM_PRESETS)
hf_gemma = _Family("hf_gemma", _gemma, GEMMA_PRESETS)
