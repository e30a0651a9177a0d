"""HuggingFace Flax models outside the corpus, each step written as a user writes one, under
every generic hand schedule on 8 CPU devices (`batch=2,model=4`), both lowerings verified
against the unpartitioned step; writes docs/outside_models.md and
benchmarks/results/outside_models.json.

Nothing here is tuned to the partitioner: each function below builds one model from a small
config of its transformers class (random weights), and returns `(train_step, args)` with its
own loss (causal or masked LM, seq2seq, contrastive, CTC, image classification with
BatchNorm statistics carried as state) and optimizer (AdamW; SGD with momentum for the
ResNet). So each is also a `shardzero propose benchmarks/hf_outside.py:gptj --mesh ...` input.
A schedule that does not apply is refused in one line (a ResNet has no weight pairs for
Megatron); a verified schedule matches the unpartitioned step, judged by the float64 program
where the float32 one is missed (`partitioner.verify`). Not in `make bench` (16 models x 12
schedules, each compiled twice: 33 minutes on 2 cores beside the test suite).

  python benchmarks/hf_outside.py                     # every model
  python benchmarks/hf_outside.py --models mt5,clip   # some
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MESH = "batch=2,model=4"
B, S = 8, 16   # examples and tokens per step


def _ce(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


def _adamw_step(loss, tx=None):
  tx = tx or optax.adamw(1e-3)

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step, tx


def _lm(model, seq2seq=False):
  """A (masked or causal) LM's, or a seq2seq model's, cross-entropy step on token batches."""
  def loss(params, batch):
    extra = {"decoder_input_ids": batch["y"]} if seq2seq else {}
    return _ce(model(batch["x"], params=params, **extra).logits, batch["y"])

  step, tx = _adamw_step(loss)
  batch = {"x": jnp.full((B, S), 3, jnp.int32), "y": jnp.ones((B, S), jnp.int32)}
  return step, (model.params, tx.init(model.params), batch)


def _transformers():
  """transformers, with Flax T5's, MT5's and LongT5's `jnp.clip(a_max=...)` (gone in current
  JAX) given `corpus.hf`'s shim."""
  import transformers
  from corpus.hf import _t5_on_this_jax
  _t5_on_this_jax()
  return transformers


def gptj():
  T = _transformers()
  return _lm(T.FlaxGPTJForCausalLM(T.GPTJConfig(
      vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8)))


def xglm():
  T = _transformers()
  return _lm(T.FlaxXGLMForCausalLM(T.XGLMConfig(
      vocab_size=256, max_position_embeddings=64, d_model=64, ffn_dim=128, num_layers=2,
      attention_heads=4)))


def electra():
  T = _transformers()
  return _lm(T.FlaxElectraForMaskedLM(T.ElectraConfig(
      vocab_size=256, embedding_size=32, hidden_size=64, num_hidden_layers=2,
      num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)))


def albert():
  """Every layer shares one set of weights."""
  T = _transformers()
  return _lm(T.FlaxAlbertForMaskedLM(T.AlbertConfig(
      vocab_size=256, embedding_size=32, hidden_size=64, num_hidden_layers=3,
      num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)))


def distilbert():
  T = _transformers()
  return _lm(T.FlaxDistilBertForMaskedLM(T.DistilBertConfig(
      vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64)))


def bigbird():
  T = _transformers()
  return _lm(T.FlaxBigBirdForMaskedLM(T.BigBirdConfig(
      vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=128, max_position_embeddings=64, attention_type="original_full")))


def _seq2seq_config(config_class, **more):
  return config_class(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                      decoder_ffn_dim=128, max_position_embeddings=64, **more)


def marian():
  T = _transformers()
  return _lm(T.FlaxMarianMTModel(_seq2seq_config(T.MarianConfig, pad_token_id=0,
                                                 decoder_start_token_id=0)), seq2seq=True)


def pegasus():
  T = _transformers()
  return _lm(T.FlaxPegasusForConditionalGeneration(_seq2seq_config(T.PegasusConfig)),
             seq2seq=True)


def mbart():
  T = _transformers()
  return _lm(T.FlaxMBartForConditionalGeneration(_seq2seq_config(T.MBartConfig)), seq2seq=True)


def blenderbot():
  T = _transformers()
  return _lm(T.FlaxBlenderbotSmallForConditionalGeneration(
      _seq2seq_config(T.BlenderbotSmallConfig)), seq2seq=True)


def mt5():
  """T5 v1.1: gated GELU, an untied head."""
  T = _transformers()
  return _lm(T.FlaxMT5ForConditionalGeneration(T.MT5Config(
      vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)), seq2seq=True)


def longt5():
  """T5 with local attention in the encoder."""
  T = _transformers()
  return _lm(T.FlaxLongT5ForConditionalGeneration(T.LongT5Config(
      vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, local_radius=4,
      encoder_attention_type="local")), seq2seq=True)


def whisper():
  """Log-mel frames through two convolutions into an encoder-decoder."""
  T = _transformers()
  model = T.FlaxWhisperForConditionalGeneration(T.WhisperConfig(
      vocab_size=256, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
      decoder_ffn_dim=128, max_source_positions=16, max_target_positions=32),
      input_shape=(1, 16, 32))

  def loss(params, batch):
    return _ce(model(batch["mel"], decoder_input_ids=batch["y"], params=params).logits,
               batch["y"])

  step, tx = _adamw_step(loss)
  batch = {"mel": jnp.zeros((B, 16, 32)), "y": jnp.ones((B, S), jnp.int32)}
  return step, (model.params, tx.init(model.params), batch)


def clip():
  """A text and a vision tower under a contrastive loss over the batch."""
  T = _transformers()
  tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
  model = T.FlaxCLIPModel(T.CLIPConfig(
      text_config=dict(vocab_size=256, max_position_embeddings=32, **tower),
      vision_config=dict(image_size=32, patch_size=8, **tower), projection_dim=32))

  def loss(params, batch):
    out = model(input_ids=batch["ids"], pixel_values=batch["px"], params=params)
    xent = optax.softmax_cross_entropy_with_integer_labels
    labels = jnp.arange(B)
    return (xent(out.logits_per_text, labels).mean()
            + xent(out.logits_per_image, labels).mean()) / 2

  step, tx = _adamw_step(loss)
  batch = {"ids": jnp.ones((B, S), jnp.int32), "px": jnp.zeros((B, 3, 32, 32))}
  return step, (model.params, tx.init(model.params), batch)


def resnet():
  """BatchNorm in training mode: its statistics are state the step returns."""
  T = _transformers()
  model = T.FlaxResNetForImageClassification(T.ResNetConfig(
      embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
      input_shape=(1, 32, 32, 3))
  tx = optax.sgd(0.1, momentum=0.9)

  def loss(params, stats, batch):
    out, new = model(batch["px"], params={"params": params, "batch_stats": stats}, train=True)
    return _ce(out.logits, batch["y"]), new["batch_stats"]

  def step(params, stats, opt_state, batch):
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state, value

  params, stats = model.params["params"], model.params["batch_stats"]
  batch = {"px": jnp.zeros((B, 3, 32, 32)), "y": jnp.ones((B,), jnp.int32)}
  return step, (params, stats, tx.init(params), batch)


def wav2vec2():
  """A convolutional feature encoder over raw audio, a transformer, and a CTC loss."""
  T = _transformers()
  model = T.FlaxWav2Vec2ForCTC(T.Wav2Vec2Config(
      vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, do_stable_layer_norm=True,
      feat_extract_norm="layer"), input_shape=(1, 1600))

  def loss(params, batch):
    logits = model(batch["wav"], params=params).logits
    return optax.ctc_loss(logits, jnp.zeros(logits.shape[:2]), batch["y"],
                          jnp.zeros(batch["y"].shape)).mean()

  step, tx = _adamw_step(loss)
  batch = {"wav": jnp.zeros((B, 1600)), "y": jnp.ones((B, 8), jnp.int32)}
  return step, (model.params, tx.init(model.params), batch)


MODELS = {f.__name__: f for f in (gptj, xglm, electra, albert, distilbert, bigbird, marian,
                                  pegasus, mbart, blenderbot, mt5, longt5, whisper, clip,
                                  resnet, wav2vec2)}


def model_rows(name: str) -> list[dict]:
  """Each generic hand schedule of the 2-axis mesh but the pipelined ones (no scanned stack
  here) on one model: verified, refused (one line), or an error."""
  import partitioner as P
  from corpus.experts import experts
  from partitioner.errors import ShardzeroError
  from partitioner.verify import verify
  fn, args = MODELS[name]()
  program = P.trace(fn, *args)
  rows = []
  for strategy, schedule in experts(None, ("batch", "model")).items():
    if "Pipeline" in schedule:
      continue
    row = {"model": name, "ops": len(program.ops), "strategy": strategy, "schedule": schedule}
    start = time.perf_counter()
    try:
      v = verify(P.apply(program, MESH, schedule), args)
      row.update(verified=v.ok, max_abs_err=v.max_abs_err, exact=v.exact, worst=v.worst)
    except ShardzeroError as e:
      row["refused"] = str(e).splitlines()[0]
    row["seconds"] = time.perf_counter() - start
    print(f"{name:10s} {strategy:18s} " + (
        f"refused: {row['refused']}" if "refused" in row else
        f"{'verified' if row['verified'] else 'MISMATCH'} (max error {row['max_abs_err']:.1e}"
        f"{', float64 judged' if row['exact'] else ''})"), flush=True)
    rows.append(row)
  return rows


def write_markdown(rows: list[dict], path: Path) -> None:
  lines = ["# HuggingFace models outside the corpus", "",
           f"Written by `python benchmarks/hf_outside.py` (transformers "
           f"{__import__('transformers').__version__}, JAX {jax.__version__}). Each model's step "
           f"as a user writes it (the functions in that file: small configs, random weights), "
           f"under every generic hand schedule on `{MESH}` (8 CPU devices), both lowerings "
           "against the unpartitioned step (`partitioner.verify`: within 1e-4, or, where the "
           "float32 reference is missed, as close to the float64 program as the reference is).",
           "", "| model | ops | verified | refused | mismatched | largest error | float64 "
           "judged | refusals |", "|---|---:|---:|---:|---:|---:|---:|---|"]
  for name in dict.fromkeys(r["model"] for r in rows):
    rs = [r for r in rows if r["model"] == name]
    ran = [r for r in rs if "verified" in r]
    refusals = sorted({r["refused"] for r in rs if "refused" in r})
    lines.append(
        f"| {name} | {rs[0]['ops']} | {sum(r['verified'] for r in ran)} | "
        f"{len(rs) - len(ran)} | {sum(not r['verified'] for r in ran)} | "
        f"{max((r['max_abs_err'] for r in ran), default=0):.1e} | "
        f"{sum(r['exact'] for r in ran)} | {'; '.join(refusals)} |")
  path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default=",".join(MODELS),
                      help=f"comma-separated, of: {', '.join(MODELS)}")
  parser.add_argument("--out", default=str(ROOT / "docs" / "outside_models.md"))
  args = parser.parse_args(argv)
  names = args.models.split(",")
  unknown = [n for n in names if n not in MODELS]
  if unknown:
    parser.error(f"--models: no model {', '.join(unknown)}; the models are {', '.join(MODELS)}")
  rows = [row for name in names for row in model_rows(name)]
  results = ROOT / "benchmarks" / "results"
  results.mkdir(parents=True, exist_ok=True)
  (results / "outside_models.json").write_text(json.dumps({"mesh": MESH, "rows": rows},
                                                          indent=1, default=float))
  write_markdown(rows, Path(args.out))
  print(f"wrote {args.out}")
  return 0 if all(r.get("verified", True) for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
