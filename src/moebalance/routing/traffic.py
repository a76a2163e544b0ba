"""MoETuner's scoring: cross-layer GPU-to-GPU traffic and token-processing load of a plan.

The metrics of "MoETuner: Optimized Mixture of Expert Serving with Balanced Expert Placement and Token
Routing" (arXiv 2502.06643), Sections 4.1 and 5.2; see ``docs/papers/moetuner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.routing.simulate import gpu_loads

__all__ = ["CrossLayerTraffic", "cross_layer_traffic", "processing_load"]

@dataclass(frozen=True, slots=True)
class CrossLayerTraffic:
    """GPU-to-GPU token moves between adjacent layers under MoETuner's model.

    A (token, pick) pair at expert ``i`` of layer ``l`` moves to expert ``j`` of layer ``l + 1``: from
    the GPU hosting ``i`` to the GPU hosting ``j`` (an expert with ``r`` replicas sends and receives a
    ``1 / r`` share from each, the uniform router). Example: 2 GPUs, ``R[0] = [[0, 3], [0, 0]]`` with
    expert 0 on GPU 0 and expert 1 on GPU 1 in both layers gives ``matrix[0] = [[0, 3], [0, 0]]``.
    """

    #: ``float64 [L-1, G, G]``: tokens from GPU ``g1`` (layer ``l``) to GPU ``g2`` (layer ``l + 1``);
    #: the diagonal stays on its GPU.
    matrix: np.ndarray
    #: ``float64 [G, G]``: ``1 / B[g1, g2]`` in s/GB, 0 on the diagonal.
    inverse_bandwidth: np.ndarray

    def pair_tail(self) -> np.ndarray:
        """``float64 [L-1]``: the all-to-all tail, ``max_{g1 != g2}`` tokens sent between one GPU pair."""
        return self._offdiag(self.matrix).max(axis=1, initial=0.0)

    def pair_mean(self) -> np.ndarray:
        """``float64 [L-1]``: mean tokens over the ``G (G - 1)`` ordered GPU pairs."""
        off = self._offdiag(self.matrix)
        return off.mean(axis=1) if off.shape[1] else np.zeros(off.shape[0])

    def cost_tail(self) -> np.ndarray:
        """``float64 [L-1]``: ``max_{g1, g2} tokens / B``, the term of Eq. 8 (tokens / (GB/s))."""
        return (self.matrix * self.inverse_bandwidth).max(axis=(1, 2), initial=0.0)

    def remote(self) -> np.ndarray:
        """``float64 [L-1]``: tokens that change GPU between the layers."""
        return self._offdiag(self.matrix).sum(axis=1)

    @staticmethod
    def _offdiag(m: np.ndarray) -> np.ndarray:
        G = m.shape[-1]
        return m.reshape(m.shape[0], -1)[:, ~np.eye(G, dtype=bool).ravel()]


def cross_layer_traffic(plan: Placement, trace: RoutingTrace) -> CrossLayerTraffic:
    """Per adjacent layer pair, the GPU-to-GPU traffic of ``trace`` under ``plan`` (:class:`CrossLayerTraffic`)."""
    if (trace.num_layers, trace.num_experts) != (plan.num_layers, plan.num_experts):
        raise InputError(f"the trace has {trace.num_layers} layers x {trace.num_experts} experts but the plan has "
                         f"{plan.num_layers} x {plan.num_experts}; score with the same model's data")
    share = plan.copies / plan.replica_counts()[..., None]  # [L, E, G]
    R = trace.transitions().astype(np.float64)
    matrix = np.einsum("lig,lij,ljh->lgh", share[:-1], R, share[1:])
    return CrossLayerTraffic(matrix, 1.0 / plan.cluster.bandwidth_matrix())


def processing_load(plan: Placement, load: LoadMatrix) -> tuple[np.ndarray, np.ndarray]:
    """``(tail, mean)``, each ``float64 [L]``: per layer, the max and the mean over GPUs of the tokens a GPU
    processes, each averaged over batches (Section 5.2's tail and average token-processing latency)."""
    loads = gpu_loads(plan, load.counts)  # [B, L, G]
    return loads.max(axis=2).mean(axis=0), loads.mean(axis=2).mean(axis=0)
