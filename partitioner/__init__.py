"""The shardzero partitioner: trace a JAX function into an IR, apply tactics, propagate
shardings, lower to SPMD JAX. Imports neither TensorFlow nor Reverb."""

from partitioner.errors import (MeshError, PatternError, ScheduleError, ShardingError,
                                ShardzeroError, WorkloadError)
from partitioner.ir import Op, Program, Value
from partitioner.mesh import Mesh
from partitioner.partition import PartitionedProgram, apply
from partitioner.sharding import Sharding
from partitioner.tactics import (Auto, BatchParallel, EmbeddingSharding, ExpertParallel, Megatron,
                                 Microbatch, Pipeline, Remat, Replicate, SequenceParallel,
                                 StageScatter, Tactic, Tile, ZeRO, parse_schedule)
from partitioner.tracing import trace


def lower_spmd(partitioned, jax_mesh=None):
  """The partitioned program as an explicit per-device `shard_map` program."""
  from partitioner.lowering import lower_spmd as lower
  return lower(partitioned, jax_mesh)


def to_jax_shardings(partitioned, jax_mesh=None):
  """`NamedSharding`s for inputs/outputs and a constrained function for `jax.jit`."""
  from partitioner.lowering import to_jax_shardings as shardings
  return shardings(partitioned, jax_mesh)


__all__ = [
    "Auto", "BatchParallel", "EmbeddingSharding", "ExpertParallel", "Megatron", "Mesh", "MeshError",
    "Microbatch",
    "Op", "Pipeline", "PartitionedProgram", "PatternError", "Program", "Remat", "Replicate", "ScheduleError",
    "SequenceParallel", "Sharding", "ShardingError", "ShardzeroError", "StageScatter", "Tactic",
    "Tile", "Value",
    "WorkloadError", "ZeRO", "apply", "lower_spmd", "parse_schedule", "to_jax_shardings", "trace",
]
