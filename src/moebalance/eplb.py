"""DeepSeek's Expert Parallelism Load Balancer, drop-in: the reference module's functions with its arguments and
outputs (torch tensors in and out when given torch tensors), and the same results bit for bit.

- ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus) -> (phy2log, log2phy, logcnt)``;
- ``rebalance_experts_hierarchical(weight, num_physical_experts, num_groups, num_nodes, num_gpus) -> (phy2log,
  phyrank, logcnt)``, the hierarchical policy alone;
- ``replicate_experts(weight, num_phy) -> (phy2log, rank, logcnt)`` and ``balanced_packing(weight, num_packs) ->
  (pack_index, rank_in_pack)``, its two steps, which SGLang's and vLLM's EPLB tests call.

The algorithm lives in :mod:`moebalance.algorithms.eplb`; this module is its stable public name.
"""

from moebalance.algorithms.eplb import (
    EplbArgumentError,
    EplbResult,
    balanced_packing,
    eplb_plan,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
)

__all__ = ["EplbArgumentError", "EplbResult", "balanced_packing", "eplb_plan", "rebalance_experts",
           "rebalance_experts_hierarchical", "replicate_experts"]
