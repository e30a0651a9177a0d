"""Accelerator specs: peak compute, memory, and the two levels of interconnect.

The catalog holds public spec-sheet figures (dense peak, per device). A spec can also be read
from a YAML or JSON file with the same fields, so users can describe their own machines.
Bandwidths are bytes/s per device in one direction as a ring collective sees them; latencies
are seconds per collective step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

from partitioner.cost.fusion import MODELS as FUSION_MODELS
from partitioner.errors import ShardzeroError

GiB = 2**30


class HardwareError(ShardzeroError):
  """An unknown hardware name or a malformed spec file."""


@dataclasses.dataclass(frozen=True)
class Link:
  name: str
  bandwidth: float   # bytes/s per device, one direction
  latency: float     # seconds per collective step


DEFAULT_EFFICIENCY = {
    "matmul": 0.7,       # fraction of peak FLOP/s reached by dot_general
    "conv": 0.6,
    "vector": 0.5,       # elementwise / reduction arithmetic
    "memory": 0.8,       # fraction of HBM bandwidth reached
    "collective": 0.8,   # fraction of link bandwidth reached
}


COLLECTIVE_MODELS = ("nccl", "alpha-beta")
COMBINE_THRESHOLD = 30 * 2**20   # XLA:GPU's default for each of the three combiners


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  description: str
  peak_flops: Mapping[str, float]   # dtype name -> FLOP/s (bfloat16, float16, float32, ...)
  hbm_bytes: int
  hbm_bandwidth: float              # bytes/s
  node_size: int                    # devices joined by the fast interconnect
  intra: Link                       # NVLink, ICI
  inter: Link                       # InfiniBand, DCN
  efficiency: Mapping[str, float] = dataclasses.field(
      default_factory=lambda: dict(DEFAULT_EFFICIENCY))
  overlap_collectives: bool = True  # collectives run beside compute (async) or not
  # Independent all-reduces, all-gathers or reduce-scatters over the same devices are combined
  # into one of at most this many bytes (XLA's combiner passes; FSDP and DDP buckets); 0: never.
  combine_threshold_bytes: int = COMBINE_THRESHOLD
  # How XLA fuses ops into kernels there (partitioner/cost/fusion.py): "producer" (XLA:GPU,
  # measured on an H100; TPUs assumed alike) or "consecutive" (XLA:CPU).
  fusion: str = "producer"
  # Seconds each kernel launch adds beside its roofline time: the gap between kernels and the
  # floor of a small one. XLA:GPU programs at a few examples per device launch thousands of
  # kernels a step, and there this is most of the step (on an H100, 4-9 us a kernel in the
  # traces of docs/validation.md). 0 where not measured (TPUs, the host CPU).
  kernel_launch_s: float = 0.0
  # How collectives run (partitioner/cost/communication.py): "nccl" (GPUs: NCCL's rings and
  # trees, its protocols and latencies per step) or "alpha-beta" (rings and trees over the two
  # link levels with the links' own latencies, and hierarchical decompositions: TPUs, the CPU).
  collectives: str = "alpha-beta"
  # NCCL's proxy-thread overhead per network step (its getNetOverhead: 1 us on Intel hosts,
  # 2 us on AMD ones); an inter-node ring's NVLink steps wait on it too.
  net_overhead_s: float = 1e-6

  def __hash__(self) -> int:  # the mappings are not hashable; equal specs share a name
    return hash(self.name)

  def flops(self, dtype: str) -> float:
    """Peak FLOP/s for a dtype; types without an entry use float32's rate."""
    if dtype in self.peak_flops:
      return self.peak_flops[dtype]
    return self.peak_flops.get("float32", min(self.peak_flops.values()))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def combining(self, threshold_bytes: int) -> "Hardware":
    """This hardware with another combiner threshold (0: collectives never combine), under a
    name of its own (specs are cached by name)."""
    return dataclasses.replace(self, name=f"{self.name} (combining {threshold_bytes} B)",
                               combine_threshold_bytes=threshold_bytes)

  def launching(self, seconds: float) -> "Hardware":
    """This hardware with another cost per kernel launch (0: only the roofline), under a name
    of its own."""
    return dataclasses.replace(self, name=f"{self.name} (launch {seconds * 1e6:g} us)",
                               kernel_launch_s=seconds)

  @classmethod
  def from_dict(cls, data: Mapping, source: str = "spec") -> "Hardware":
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
      raise HardwareError(f"{source}: unknown field(s) {', '.join(sorted(unknown))}; "
                          f"fields: {', '.join(fields)}")
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and
                f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
      raise HardwareError(f"{source}: missing field(s) {', '.join(missing)}")
    try:
      values = dict(data)
      for key in ("intra", "inter"):
        link = values[key]
        if not isinstance(link, Mapping) or set(link) != {"name", "bandwidth", "latency"}:
          raise HardwareError(f"{source}: {key} needs name, bandwidth and latency")
        values[key] = Link(str(link["name"]), _positive(link["bandwidth"], f"{key}.bandwidth"),
                           _positive(link["latency"], f"{key}.latency", allow_zero=True))
      values["peak_flops"] = {str(k): _positive(v, f"peak_flops.{k}")
                              for k, v in dict(values["peak_flops"]).items()}
      if not values["peak_flops"]:
        raise HardwareError(f"{source}: peak_flops is empty")
      values["hbm_bytes"] = int(_positive(values["hbm_bytes"], "hbm_bytes"))
      values["hbm_bandwidth"] = _positive(values["hbm_bandwidth"], "hbm_bandwidth")
      values["node_size"] = int(_positive(values["node_size"], "node_size"))
      efficiency = dict(DEFAULT_EFFICIENCY)
      for k, v in dict(values.get("efficiency", {})).items():
        if k not in DEFAULT_EFFICIENCY:
          raise HardwareError(f"{source}: unknown efficiency {k!r}; known: "
                              f"{', '.join(DEFAULT_EFFICIENCY)}")
        efficiency[k] = _positive(v, f"efficiency.{k}")
      values["efficiency"] = efficiency
      values["overlap_collectives"] = bool(values.get("overlap_collectives", True))
      values["combine_threshold_bytes"] = int(_positive(
          values.get("combine_threshold_bytes", COMBINE_THRESHOLD), "combine_threshold_bytes",
          allow_zero=True))
      values["kernel_launch_s"] = _positive(values.get("kernel_launch_s", 0.0),
                                            "kernel_launch_s", allow_zero=True)
      values["net_overhead_s"] = _positive(values.get("net_overhead_s", 1e-6),
                                           "net_overhead_s", allow_zero=True)
      values["collectives"] = str(values.get("collectives", "alpha-beta"))
      if values["collectives"] not in COLLECTIVE_MODELS:
        raise HardwareError(f"{source}: unknown collectives {values['collectives']!r}; known: "
                            f"{', '.join(COLLECTIVE_MODELS)}")
      values["fusion"] = str(values.get("fusion", "producer"))
      if values["fusion"] not in FUSION_MODELS:
        raise HardwareError(f"{source}: unknown fusion {values['fusion']!r}; known: "
                            f"{', '.join(FUSION_MODELS)}")
      values["name"], values["description"] = str(values["name"]), str(values["description"])
    except (TypeError, ValueError, AttributeError) as e:
      raise HardwareError(f"{source}: {e}") from None
    return cls(**values)


def _positive(value, what, allow_zero=False) -> float:
  try:
    x = float(value)
  except (TypeError, ValueError):
    raise HardwareError(f"{what} must be a number, got {value!r}") from None
  if x < 0 or (x == 0 and not allow_zero):
    raise HardwareError(f"{what} must be positive, got {value!r}")
  return x


# Fitted to the single-GPU steps measured on an H100 (docs/validation.md; HF BERT's contended
# scatter aside): 4 us per predicted kernel takes predicted over measured from a geometric mean
# of 0.74 (0.19 to 1.28) to 1.03 (0.61 to 1.58) over those 20 steps.
GPU_KERNEL_LAUNCH_S = 4e-6


def _gpu(name, description, bf16, f32, hbm_gib, hbm_bw, nvlink, ib, net_overhead_s):
  # The links' latencies are unused under NCCL's model (its own per-step latencies apply);
  # they stay for specs that switch to "alpha-beta".
  return Hardware(name, description, {"bfloat16": bf16, "float16": bf16, "float32": f32},
                  hbm_gib * GiB, hbm_bw, 8, Link("NVLink", nvlink, 5e-6),
                  Link("InfiniBand", ib, 10e-6), kernel_launch_s=GPU_KERNEL_LAUNCH_S,
                  collectives="nccl", net_overhead_s=net_overhead_s)


# NCCL's getNetOverhead (src/graph/tuning.cc): DGX A100 nodes have AMD EPYC hosts, DGX H100
# and H200 nodes Intel Xeon ones.
AMD_HOST, INTEL_HOST = 2e-6, 1e-6


def _tpu(name, description, bf16, hbm_gib, hbm_bw, ici, pod, dcn):
  # f32 matmuls run as 3 bf16 passes at JAX's "high" precision.
  return Hardware(name, description, {"bfloat16": bf16, "float32": bf16 / 3}, hbm_gib * GiB,
                  hbm_bw, pod, Link("ICI", ici, 2e-6), Link("DCN", dcn, 20e-6))


CATALOG: dict[str, Hardware] = {h.name: h for h in [
    _tpu("tpu-v3", "Cloud TPU v3 chip: 123 TFLOP/s bf16, 32 GiB HBM at 900 GB/s, 1024-chip pods",
         123e12, 32, 900e9, 70e9, 1024, 6.25e9),
    _tpu("tpu-v4", "Cloud TPU v4 chip: 275 TFLOP/s bf16, 32 GiB HBM at 1.2 TB/s, 4096-chip pods",
         275e12, 32, 1228e9, 150e9, 4096, 6.25e9),
    # DCN: 50 Gb/s per chip (Cloud TPU's v5p page, docs.cloud.google.com/tpu/docs/v5p).
    _tpu("tpu-v5p", "Cloud TPU v5p chip: 459 TFLOP/s bf16, 95 GiB HBM at 2.8 TB/s, 8960-chip pods",
         459e12, 95, 2765e9, 300e9, 8960, 6.25e9),
    _gpu("a100-40gb", "NVIDIA A100 SXM 40 GB: 312 TFLOP/s bf16 (156 TF32), 1.6 TB/s, 8 per "
         "node with NVLink 3, 200 Gb/s InfiniBand per GPU", 312e12, 156e12, 40, 1555e9, 300e9,
         25e9, AMD_HOST),
    _gpu("a100-80gb", "NVIDIA A100 SXM 80 GB: 312 TFLOP/s bf16 (156 TF32), 2.0 TB/s, 8 per "
         "node with NVLink 3, 200 Gb/s InfiniBand per GPU", 312e12, 156e12, 80, 2039e9, 300e9,
         25e9, AMD_HOST),
    # float32 is the TF32 rate: JAX's default matmul precision runs f32 dots on TF32 tensor
    # cores on Ampere and Hopper (the H100 does 67 TFLOP/s at precision=HIGHEST).
    _gpu("h100", "NVIDIA H100 SXM 80 GB: 989 TFLOP/s bf16 (494 TF32, which f32 matmuls get at "
         "JAX's default precision), 3.35 TB/s, 8 per node with NVLink 4, 400 Gb/s InfiniBand "
         "per GPU", 989e12, 494e12, 80, 3350e9, 450e9, 50e9, INTEL_HOST),
    _gpu("h200", "NVIDIA H200 SXM 141 GB: the H100's compute (989 TFLOP/s bf16, 494 TF32) with "
         "141 GB of HBM3e at 4.8 TB/s, 8 per node with NVLink 4, 400 Gb/s InfiniBand per GPU",
         989e12, 494e12, 131, 4800e9, 450e9, 50e9, INTEL_HOST),
    Hardware("cpu", "host CPU devices (--xla_force_host_platform_device_count): a rough "
             "per-device share of a small machine, for checking orderings locally",
             {"float32": 20e9, "bfloat16": 5e9}, 8 * GiB, 10e9, 64,
             Link("memory", 5e9, 20e-6), Link("memory", 5e9, 20e-6),
             overlap_collectives=False, combine_threshold_bytes=0,    # XLA:CPU combines none
             fusion="consecutive"),
]}

ALIASES = {"a100": "a100-80gb", "h100-80gb": "h100", "v3": "tpu-v3", "v4": "tpu-v4",
           "v5p": "tpu-v5p"}


def load_hardware(name_or_path: str | Hardware) -> Hardware:
  """A catalog name (`h100`, `tpu-v4`) or a YAML/JSON spec file."""
  if isinstance(name_or_path, Hardware):
    return name_or_path
  key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
  if key in CATALOG:
    return CATALOG[key]
  path = Path(name_or_path)
  if path.suffix.lower() not in (".json", ".yaml", ".yml"):
    raise HardwareError(f"unknown hardware {name_or_path!r}; catalog: {', '.join(CATALOG)} "
                        "(or a .yaml/.json spec file)")
  if not path.is_file():
    raise HardwareError(f"no such hardware spec file {name_or_path!r}")
  text = path.read_text()
  try:
    if path.suffix.lower() == ".json":
      data = json.loads(text)
    else:
      import yaml
      data = yaml.safe_load(text)
  except Exception as e:  # the parsers' own messages say where
    raise HardwareError(f"{path}: not valid {path.suffix[1:].upper()}: "
                        f"{str(e).splitlines()[0]}") from None
  if not isinstance(data, Mapping):
    raise HardwareError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
  return Hardware.from_dict(data, str(path))
