"""All-to-all time of one MoE layer: dispatch sends each token copy to the GPU serving its picks, combine sends it
back (docs/design.md, "Metrics" and "Cost model").

Per ``(b, l)`` a GPU's intra-node copies go over its NVLink/PCIe share (``Cluster.intra_node_bandwidth``) and its
inter-node copies over its NIC (``inter_node_bandwidth``), in parallel; a phase lasts as long as the busiest of
those links, counting what a GPU sends and what it receives separately (full duplex)::

    t_phase = bytes_per_copy * max_g max(max(send_intra[g], recv_intra[g]) / bw_intra,
                                         max(send_inter[g], recv_inter[g]) / bw_inter)
    a2a = 2 * t_phase

:func:`a2a_seconds` takes the copies of a token-level replay ``[..., G, G]``; :func:`a2a_estimate` the per-GPU
picks of counts, which carry no sources: every pick's token on a GPU drawn uniformly, sent once per pick;
:func:`a2a_per_pick` is that estimate's slope on one GPU's picks, what the ``metro`` router's kernel adds per pick.
No latency term: a bandwidth lower bound that ranks plans the way traffic does.
"""

from __future__ import annotations

import numpy as np

from moebalance.core.cluster import Cluster

__all__ = ["a2a_estimate", "a2a_per_pick", "a2a_seconds"]


def a2a_seconds(pair_copies: np.ndarray, cluster: Cluster, bytes_per_copy: int) -> np.ndarray:
    """``float64 [...]``: all-to-all seconds (dispatch + combine) for copies ``[..., G, G]`` (source, dest)."""
    kind = cluster.link_kind()
    intra, inter = (kind == 1), (kind == 2)
    m = pair_copies.astype(np.float64)
    t_intra = np.maximum((m * intra).sum(axis=-1), (m * intra).sum(axis=-2)) / cluster.intra_node_bandwidth
    t_inter = np.maximum((m * inter).sum(axis=-1), (m * inter).sum(axis=-2)) / cluster.inter_node_bandwidth
    return 2.0 * bytes_per_copy * np.maximum(t_intra, t_inter).max(axis=-1) / 1e9


def a2a_estimate(gpu_load: np.ndarray, cluster: Cluster, bytes_per_copy: int) -> np.ndarray:
    """``float64 [...]``: all-to-all seconds for per-GPU picks ``[..., G]`` when every pick's token lives on a GPU
    drawn uniformly and is sent once per pick (counts carry no sources; a token's picks on one GPU are not merged,
    so it counts more copies than the trace behind the counts would)."""
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    load = np.asarray(gpu_load, dtype=np.float64)
    total = load.sum(axis=-1, keepdims=True)
    node = load.reshape(*load.shape[:-1], cluster.num_nodes, gpn).sum(axis=-1)  # [..., N]
    node_of = np.repeat(node, gpn, axis=-1)  # [..., G]: the load of each GPU's node
    recv_intra, recv_inter = load * (gpn - 1) / G, load * (G - gpn) / G
    send_intra, send_inter = (node_of - load) / G, (total - node_of) / G
    t_intra = np.maximum(recv_intra, send_intra) / cluster.intra_node_bandwidth
    t_inter = np.maximum(recv_inter, send_inter) / cluster.inter_node_bandwidth
    return 2.0 * bytes_per_copy * np.maximum(t_intra, t_inter).max(axis=-1) / 1e9


def a2a_per_pick(cluster: Cluster, bytes_per_copy: int) -> float:
    """Seconds of all-to-all one pick adds to the GPU that serves it in :func:`a2a_estimate` (its token from a GPU
    drawn uniformly: over the intra-node link with probability ``(M - 1) / G``, the NIC with ``(G - M) / G``)."""
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    per = max((gpn - 1) / G / cluster.intra_node_bandwidth, (G - gpn) / G / cluster.inter_node_bandwidth)
    return 2.0 * bytes_per_copy * per / 1e9
