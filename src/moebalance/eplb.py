"""DeepSeek's Expert Parallelism Load Balancer, drop-in: ``rebalance_experts`` with the reference's arguments and
outputs (torch tensors in and out when given torch tensors), and the same result bit for bit.

The algorithm lives in :mod:`moebalance.algorithms.eplb`; this module is its stable public name.
"""

from moebalance.algorithms.eplb import EplbArgumentError, EplbResult, eplb_plan, rebalance_experts

__all__ = ["EplbArgumentError", "EplbResult", "eplb_plan", "rebalance_experts"]
