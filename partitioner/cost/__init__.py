"""The cost model: a hierarchy-aware simulator of step time and memory per device."""

# Bumped when predictions change (2: collectives combine; 3: views and cheap one-operand
# elementwise results have no buffers; 4: partial sums deferred through linear ops; 5: GPUs and
# TPUs fuse as XLA:GPU does; 6: each GPU kernel launch costs `Hardware.kernel_launch_s`; 7: the
# programs priced hold fused projections interleaved and odd vocabularies padded,
# partitioner/layouts.py; 8: GPU collectives priced as NCCL runs them, its rings, trees,
# protocols and latencies per step, partitioner/cost/communication.py; 9: a gather reads the
# rows it gathers and an update in place moves the update, not the whole buffer; 10: a loop's
# entry and exit move nothing, its body reads the slices it uses; 11: a stacked sum cast up as
# it leaves an inner loop stays partial into the outer loop's float32 accumulator: bf16 layer
# gradients reduced once after a pipeline's loops, not in every iteration; 12: `StageScatter`
# gathers a hand-over where a stage's layers read it, and the layers stay sharded as before,
# where the split features used to run through the layers; a scatter-add updates in place and,
# on GPUs, fuses the producers of its updates; 13: a view of a value computed inside a kernel
# (a concatenation or a bias reshaped, held to the backward pass) is what that kernel stores,
# where it had no buffer at all; XLA:CPU's reductions fuse what they read only over the minor
# dimension and 32 elements or fewer, partitioner/cost/fusion.py; 14: `Megatron` splits an
# untied output head by its vocabulary, partitioner/roles.py `output_heads`, padded where it
# divides by nothing as tables are, so a schedule naming it costs what its plan now is; 15:
# `ExpertParallel` acts before the tactics that split the tokens over its axis also where it is
# written after them, partitioner/partition.py `_acts_before`, so such a schedule moves the
# tokens to their experts and costs what GShard's order does; 16: a reduction over dimensions of
# size 1 is a bitcast, as XLA's simplifier makes it, and waits with the update for the gradient
# it reads, where it held every gradient's reduction of its bucket on the backward pass's
# critical path, partitioner/cost/compute.py `_unit_reduction`), so that stored evaluations made
# with another model are redone rather than compared with these.
COST_MODEL_VERSION = 16

from partitioner.cost.communication import CollectiveTime, collective_time
from partitioner.cost.hardware import CATALOG, Hardware, HardwareError, Link, load_hardware
from partitioner.cost.memory import MemoryReport
from partitioner.cost.simulator import CollectiveCost, CostReport, Simulator, simulate
from partitioner.cost.topology import Group, Placement

__all__ = ["CATALOG", "CollectiveCost", "CollectiveTime", "CostReport", "Group", "Hardware",
           "HardwareError", "Link", "MemoryReport", "Placement", "Simulator", "collective_time",
           "load_hardware", "simulate"]
