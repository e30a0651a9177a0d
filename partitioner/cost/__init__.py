"""The cost model: a hierarchy-aware simulator of step time and memory per device."""

from partitioner.cost.communication import CollectiveTime, collective_time
from partitioner.cost.hardware import CATALOG, Hardware, HardwareError, Link, load_hardware
from partitioner.cost.memory import MemoryReport
from partitioner.cost.simulator import CollectiveCost, CostReport, Simulator, simulate
from partitioner.cost.topology import Group, Placement

__all__ = ["CATALOG", "CollectiveCost", "CollectiveTime", "CostReport", "Group", "Hardware",
           "HardwareError", "Link", "MemoryReport", "Placement", "Simulator", "collective_time",
           "load_hardware", "simulate"]
