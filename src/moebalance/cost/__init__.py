"""The cost model: what a plan costs in memory and time, and the goodput that leaves (``docs/design.md``, "Cost model").

- :mod:`~moebalance.cost.hardware`: GPUs' published peaks (BF16 FLOP/s, memory, bandwidth), with sources;
- the model served is a :class:`moebalance.models.ModelSpec`, the one real-model description (its parameter counts
  and KV bytes per token);
- :mod:`~moebalance.cost.memory`: weights as the engine shards them, replicas, KV cache left, concurrency;
- :mod:`~moebalance.cost.time`: the grouped GEMM's roofline, the rest of a step, Libra's prefetch;
- :mod:`~moebalance.cost.goodput`: a plan's modelled layer time and goodput on a held-out load;
- :mod:`~moebalance.cost.calibrate`: the compute constants fitted to measured grouped-GEMM times;
- :mod:`~moebalance.cost.auto`: CRAFT's replication factor chosen by modelled goodput.
"""

from moebalance.cost.goodput import PlanCost, Workload, plan_cost
from moebalance.cost.hardware import GPUS, GpuSpec, get_gpu
from moebalance.cost.memory import EngineMemory, MemoryReport, memory_per_gpu
from moebalance.cost.time import Calibration, expert_seconds, prefetch_seconds, rest_seconds

__all__ = ["GPUS", "Calibration", "EngineMemory", "GpuSpec", "MemoryReport", "PlanCost", "Workload", "expert_seconds",
           "get_gpu", "memory_per_gpu", "plan_cost", "prefetch_seconds", "rest_seconds"]
