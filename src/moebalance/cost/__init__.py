"""The cost model's floor: what a deployment's parts cost in memory and time (``docs/design.md``, "Cost model").

It imports nothing above ``core`` and ``models``; pricing plans with it (replaying a load through a plan and a
router) is :mod:`moebalance.pricing`'s.

- :mod:`~moebalance.cost.hardware`: GPUs' published peaks (BF16 FLOP/s, memory, bandwidth), with sources;
- the model served is a :class:`moebalance.models.ModelSpec`, the one real-model description (its parameter counts
  and KV bytes per token);
- :mod:`~moebalance.cost.memory`: weights as the engine shards them, replicas, KV cache left, concurrency;
- :mod:`~moebalance.cost.time`: the grouped GEMM's roofline (:func:`expert_seconds`), the rest of a step,
  Libra's prefetch;
- :mod:`~moebalance.cost.a2a`: the all-to-all's busiest link;
- :mod:`~moebalance.cost.deployment`: the :class:`Deployment` every price is taken for, and a layer's price;
- :mod:`~moebalance.cost.transfer`: moving experts between plans;
- :mod:`~moebalance.cost.calibrate`: the compute constants fitted to measured grouped-GEMM times, and their file.
"""

from moebalance.cost.a2a import a2a_estimate, a2a_seconds
from moebalance.cost.deployment import Deployment, Workload
from moebalance.cost.hardware import GPUS, GpuSpec, get_gpu
from moebalance.cost.memory import EngineMemory, MemoryReport, memory_per_gpu
from moebalance.cost.time import Calibration, expert_seconds, gemm_seconds, prefetch_seconds, rest_seconds

__all__ = ["GPUS", "Calibration", "Deployment", "EngineMemory", "GpuSpec", "MemoryReport", "Workload", "a2a_estimate",
           "a2a_seconds", "expert_seconds", "gemm_seconds", "get_gpu", "memory_per_gpu", "prefetch_seconds",
           "rest_seconds"]
