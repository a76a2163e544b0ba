"""The all-to-all copies of routed picks, and their time (docs/design.md, "Metrics").

Legend: ``B`` batches, ``L`` layers, ``G`` GPUs, ``T`` tokens, ``K`` top-k.

A token picked by top-k is sent once to each distinct GPU serving at least one of its picks (GRACE, DeepEP); to its
own GPU it is local, to another GPU of its node intra-node, else inter-node. Timed by
:func:`moebalance.cost.a2a.a2a_seconds` for one of the kernels of :mod:`moebalance.cost.a2a` (how the copies travel):
the busiest link, dispatch and combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.cost.a2a import a2a_seconds, check_kernel

__all__ = ["Traffic", "traffic"]


@dataclass(frozen=True, slots=True)
class Traffic:
    """All-to-all dispatch copies of a token-level replay (combine mirrors dispatch).

    A token picked by top-k is sent once to each distinct GPU serving at least one of its picks.
    """

    #: Copies to the token's own GPU (free).
    local: int
    #: Copies to another GPU of the token's node.
    intra_node: int
    #: Copies to a GPU of another node.
    inter_node: int
    #: Inter-node copies counted once per destination node (DeepEP node-level forwarding).
    inter_node_dedup: int
    #: ``int64 [G, G]``: copies from source GPU to destination GPU, summed over batches and layers.
    matrix: np.ndarray
    #: ``float64 [B, L]``: all-to-all seconds (dispatch + combine) per batch and layer; ``None`` without bytes.
    a2a_seconds: np.ndarray | None = None

    @staticmethod
    def total(parts: list[Traffic]) -> Traffic:
        """The traffic of consecutive batch ranges together (copies summed, per-batch times one after another)."""
        seconds = [p.a2a_seconds for p in parts if p.a2a_seconds is not None]
        return Traffic(
            local=sum(p.local for p in parts), intra_node=sum(p.intra_node for p in parts),
            inter_node=sum(p.inter_node for p in parts), inter_node_dedup=sum(p.inter_node_dedup for p in parts),
            matrix=np.sum([p.matrix for p in parts], axis=0),
            a2a_seconds=np.concatenate(seconds, axis=0) if len(seconds) == len(parts) else None)

    def as_dict(self, bytes_per_copy: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"local": self.local, "intra_node": self.intra_node, "inter_node": self.inter_node,
                               "inter_node_dedup": self.inter_node_dedup}
        if bytes_per_copy:
            # dispatch and combine both move each copy once
            out["bytes"] = {"intra_node": 2 * self.intra_node * bytes_per_copy,
                            "inter_node": 2 * self.inter_node * bytes_per_copy,
                            "inter_node_dedup": 2 * self.inter_node_dedup * bytes_per_copy}
        if self.a2a_seconds is not None and self.a2a_seconds.size:
            out["a2a_us_per_layer"] = round(float(self.a2a_seconds.mean()) * 1e6, 3)
            out["a2a_ms_per_batch"] = round(float(self.a2a_seconds.sum(axis=1).mean()) * 1e3, 6)
        return out


def traffic(plan: Placement, trace: RoutingTrace, dest: np.ndarray, bytes_per_copy: float | None = None, *,
            kernel: str = "per-gpu", seconds_only: bool = False) -> Traffic:
    """Count dispatch copies for ``dest [T, L, K]``, the GPU serving each (token, pick); with
    ``bytes_per_copy``, also the all-to-all time of every ``(b, l)``. ``seconds_only`` (with ``bytes_per_copy``)
    computes the times alone and leaves the copy counts and the matrix at zero (a step's price needs no more).

    ``kernel`` (:data:`moebalance.cost.a2a.KERNELS`, not ``auto``) says how the copies travel when timed:
    ``per-gpu`` straight to each destination GPU; ``normal`` as DeepEP's normal kernels and GRACE's dispatch move
    tokens: a token crosses the network once per destination node, to the GPU of that node with its own local index
    (the same rail), which forwards it to the node's other destination GPUs over the intra-node link;
    ``low-latency`` as DeepEP's low-latency kernels: one message per pick (two picks on one GPU are two messages).
    The copy counts (``local``, ``intra_node``, ``inter_node``, ``inter_node_dedup``) are the same for all.
    """
    if check_kernel(kernel) == "auto":
        raise InputError("traffic needs the phase's kernel, not auto (moebalance.cost.a2a.kernel_for resolves it)")
    node_forwarding = kernel == "normal"
    cluster = plan.cluster
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    B, L = trace.num_batches, dest.shape[1]
    src = trace.src_gpu
    local = intra = inter = inter_dedup = 0
    matrix = np.zeros(G * G, dtype=np.int64)
    seconds = np.zeros((B, L)) if bytes_per_copy else None
    for layer in range(L):
        d = np.sort(dest[:, layer, :], axis=1)
        first = np.ones(d.shape, dtype=bool)
        first[:, 1:] = d[:, 1:] != d[:, :-1]
        counts = not (seconds_only and bytes_per_copy)
        if counts or node_forwarding:
            same_gpu = d == src[:, None]
            same_node = (d // gpn) == (src // gpn)[:, None]
            nodes = np.sort(d // gpn, axis=1)
            first_node = np.ones(nodes.shape, dtype=bool)
            first_node[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
        if counts:
            local += int(np.count_nonzero(first & same_gpu))
            intra += int(np.count_nonzero(first & same_node & ~same_gpu))
            inter += int(np.count_nonzero(first & ~same_node))
            inter_dedup += int(np.count_nonzero(first_node & (nodes != (src // gpn)[:, None])))
            pairs = (src[:, None] * G + d)[first]
            matrix += np.bincount(pairs, minlength=G * G)
        if seconds is not None and bytes_per_copy:
            b = trace.batch[:, None]
            if kernel == "low-latency":  # every pick a message, the token's own GPU free
                per_batch = ((b * G + src[:, None]) * G + d)[d != src[:, None]]
            elif node_forwarding:
                src_node, lane = (src // gpn)[:, None], (src % gpn)[:, None]
                rail = (d // gpn) * gpn + lane  # the destination node's GPU on the token's rail
                to_node = first_node & (nodes != src_node)
                forward = first & ~same_node & (d != rail)
                per_batch = np.concatenate([
                    ((b * G + src[:, None]) * G + d)[first & same_node & ~same_gpu],  # inside the token's node
                    ((b * G + src[:, None]) * G + nodes * gpn + lane)[to_node],  # once per remote node
                    ((b * G + rail) * G + d)[forward]])  # from the rail GPU to the others on that node
            else:
                per_batch = ((b * G + src[:, None]) * G + d)[first]
            copies = np.bincount(per_batch, minlength=B * G * G).reshape(B, G, G)
            seconds[:, layer] = a2a_seconds(copies, cluster, bytes_per_copy)
    return Traffic(local, intra, inter, inter_dedup, matrix.reshape(G, G), seconds)
