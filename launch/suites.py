"""Evaluation suites: agents and task groups, bundled (`quick`, `scales`) or read from YAML.

A YAML suite:

    description: held-out models at two scales
    agents: [expert, greedy, "mcts:64", ilp]
    tasks:
      - models: [t5:mini, moe:mini]          # corpus names, families, splits, module:function
        meshes: ["batch=4,model=2", "batch=8,model=8"]
        hardware: [h100]                     # optional; default h100
        budgets: [device, 0.5]               # optional; device, bytes, or a tight fraction
        batch_per_device: 2                  # optional: weak scaling, batch = 2 x devices

`batch_per_device` appends a `batch=` knob to corpus models, so the work per device stays the
same from mesh to mesh (Alpa's weak-scaling yardstick).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from launch.evaluation import EvalTask, check_budget, expand_models
from partitioner.errors import WorkloadError


class Suite(NamedTuple):
  name: str
  description: str
  agents: tuple[str, ...]
  tasks: tuple[EvalTask, ...]


def task_group(models, meshes, hardware=("h100",), budgets=("device",),
               batch_per_device=None, preset: str = "mini") -> list[EvalTask]:
  """Every (model, mesh, hardware, budget) of the lists; `batch_per_device` scales each corpus
  model's batch with the mesh."""
  from environments.tasks import weak_scaled
  if isinstance(models, str) or isinstance(meshes, str):
    raise WorkloadError("a suite's models and meshes are lists")
  out = []
  for mesh in meshes:
    for model in expand_models(models, preset):
      model = weak_scaled(model, mesh, batch_per_device)
      for hw in hardware:
        out += [EvalTask(model, mesh, hw, check_budget(b)) for b in budgets]
  return out


def _quick() -> Suite:
  """Held-out families at `mini` on one H100 node, and two of them at 64 and 256 devices: a
  few minutes on 2 cores with every non-learned agent."""
  tasks = (task_group(["heldout"], ["batch=4,model=2"]) +
           task_group(["moe:mini", "t5:mini"], ["batch=8,model=8", "batch=32,model=8"],
                      batch_per_device=2))
  return Suite("quick", "held-out minis on 8 H100s; MoE and T5 at 64 and 256 (weak scaling)",
               ("expert", "greedy", "mcts:64", "ilp"), tuple(tasks))


_H100 = ["batch=2,model=4", "batch=8,model=8", "batch=32,model=8", "batch=128,model=8",
         "batch=512,model=8"]
_V5P = ["batch=64,model=4", "batch=256,model=16"]


def _scales() -> Suite:
  """Alpa's yardstick (GPT 350M to 6.7B, MoE, a Wide-ResNet-like convnet; weak scaling)
  extended to 4096 devices, on H100 nodes of 8 and TPU v5p pods, with the held-out families
  beside."""
  models = ["gpt:350m", "gpt:1.3b", "gpt:6.7b", "moe:base", "resnet:50,width=128", "t5:large",
            "unet:base", "ssm:large"]
  tasks = (task_group(models, _H100, batch_per_device=2) +
           task_group(["gpt:1.3b", "moe:base", "t5:large"], _V5P, ["tpu-v5p"],
                      batch_per_device=2))
  return Suite("scales", "GPT 350M-6.7B, MoE, wide ResNet and the held-out families, 8 to "
               "4096 devices", ("expert", "greedy", "mcts:100", "ilp"), tuple(tasks))


def _external() -> Suite:
  """Programs nobody here wrote, never trained on (the corpus' external split: HuggingFace
  Flax Llama, Mistral, OPT, GPT-Neo, BART, RoBERTa, BLOOM and Gemma at published shapes), at
  64, 256 and 1024 H100s and on a three-axis mesh with names of its own, one sequence or
  image per device: where a policy's proposals for users' programs are measured."""
  models = ["hf_llama:1b", "hf_llama:7b", "hf_mistral:7b", "hf_opt:1.3b", "hf_gptneo:1.3b",
            "hf_bart:large", "hf_roberta:large", "hf_bloom:560m", "hf_gemma:2b"]
  tasks = task_group(models, ["batch=8,model=8", "batch=32,model=8", "batch=128,model=8",
                              "data=4,fsdp=8,tensor=8"], batch_per_device=1)
  return Suite("external", "HuggingFace Flax models never trained on, at published shapes, 64 "
               "to 1024 H100s (weak scaling, one example per device)",
               ("expert", "mcts:100", "ilp"), tuple(tasks))


SUITES = {"quick": _quick, "scales": _scales, "external": _external}   # built when asked for


def load_suite(name: str) -> Suite:
  """A bundled suite by name, or a YAML file."""
  if name in SUITES:
    return SUITES[name]()
  if not os.path.exists(name):
    raise WorkloadError(f"unknown suite {name!r}: neither a bundled suite "
                        f"({', '.join(SUITES)}) nor a YAML file")
  import yaml
  try:
    with open(name) as f:
      data = yaml.safe_load(f)
  except yaml.YAMLError as e:
    raise WorkloadError(f"{name}: not valid YAML ({str(e).splitlines()[0]})") from None
  if not isinstance(data, dict) or not isinstance(data.get("tasks"), list):
    raise WorkloadError(f"{name}: a suite is a mapping with a list of task groups under 'tasks'")
  tasks = []
  for i, g in enumerate(data["tasks"]):
    unknown = set(g) - {"models", "meshes", "hardware", "budgets", "batch_per_device", "preset"} \
        if isinstance(g, dict) else None
    if unknown or not isinstance(g, dict) or "models" not in g or "meshes" not in g:
      raise WorkloadError(f"{name}: task group {i} needs models and meshes"
                          + (f"; unknown keys {sorted(unknown)}" if unknown else ""))
    tasks += task_group(**{k: ([str(x) for x in v] if isinstance(v, list) else v)
                       for k, v in g.items()})
  agents = tuple(str(a) for a in data.get("agents", ("expert", "greedy", "mcts:64")))
  return Suite(os.path.basename(name), str(data.get("description", "")), agents, tuple(tasks))
