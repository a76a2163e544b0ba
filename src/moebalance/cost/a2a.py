"""All-to-all time of one MoE layer: dispatch sends each token to the GPUs serving its picks, combine sends the
results back (docs/design.md, "Cost model").

**Kernels** (:data:`KERNELS`; ``auto`` picks by phase, as SGLang's ``--deepep-mode auto``):

- ``per-gpu``: a token goes once to each distinct GPU serving its picks, straight over the link between the two
  GPUs (a plain all-to-all); no fixed cost: a bandwidth lower bound.
- ``normal``: DeepEP's normal kernels (prefill): a token crosses the network once per remote node that serves any of
  its picks, to that node's GPU on its own rail (the same local index), which forwards it over NVLink to the node's
  other GPUs it picked; inside its own node it goes straight to each GPU.
- ``low-latency``: DeepEP's low-latency kernels (decode): one message per pick (per expert, not per GPU), over NVLink
  inside the node and RDMA across nodes.

DeepEP's kernels cost a fixed :data:`LATENCY_US` per phase beside their bytes, measured on NVIDIA GPUs. They run on
NVIDIA GPUs (:mod:`moebalance.cost.hardware`, from DeepEP's README); on AMD GPUs the engines run AMD's MORI EP instead
(SGLang 0.5.23 ``--moe-a2a-backend mori``, vLLM 0.33 ``--all2all-backend mori_high_throughput|mori_low_latency``),
whose costs nothing here measured, so a deployment on another vendor's GPU prices ``per-gpu`` alone
(:func:`kernels_on`, :func:`check_kernel_on`).

**Time.** Per ``(b, l)`` a GPU's intra-node copies go over its NVLink/PCIe share (``Cluster.intra_node_bandwidth``)
and its inter-node copies over its NIC (``inter_node_bandwidth``), in parallel; a phase lasts as long as the busiest
of those links, counting what a GPU sends and what it receives separately (full duplex)::

    t_phase = bytes_per_copy * max_g max(max(send_intra[g], recv_intra[g]) / bw_intra,
                                         max(send_inter[g], recv_inter[g]) / bw_inter)
    a2a = 2 * t_phase (+ 2 * latency)

:func:`a2a_seconds` takes the copies of a token-level replay ``[..., G, G]`` (:func:`moebalance.routing.copies.traffic`
counts them per kernel). :func:`a2a_estimate` takes the per-GPU picks of counts, which carry no tokens: each of a
GPU's ``T / G`` tokens is taken to make its ``K`` picks independently with the layer's per-GPU shares ``p_g``, so a
token reaches GPU ``g`` with probability ``1 - (1 - p_g)^K`` and node ``n`` with ``1 - (1 - p_n)^K``
(``low-latency``: ``K p_g`` messages). Real tokens' picks are correlated (co-activated experts, node-limited
routing), so a trace reaches fewer GPUs and nodes than this. :func:`a2a_per_pick` is the slope of the one-message-
per-pick estimate on one GPU's picks, what the ``metro`` router's kernel adds per pick.
"""

from __future__ import annotations

import numpy as np

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.cost.hardware import VENDORS, GpuSpec

__all__ = ["DEEPEP_KERNELS", "KERNELS", "LATENCY_US", "a2a_estimate", "a2a_per_pick", "a2a_seconds", "check_kernel",
           "check_kernel_on", "kernel_for", "kernels_on"]

#: The all-to-all kernels a deployment names (module docstring); ``auto``: ``normal`` in prefill, ``low-latency`` in
#: decode.
KERNELS = ("per-gpu", "normal", "low-latency", "auto")
#: The kernels that are DeepEP's, which run on NVIDIA GPUs only.
DEEPEP_KERNELS = ("normal", "low-latency", "auto")
#: Fixed microseconds one phase (dispatch or combine) of a kernel costs beside its bytes: launch, signalling and
#: completion across the ranks. DeepEP's: its low-latency dispatch of 128 tokens on EP8 (H800) less those bytes over
#: NVLink at 160 GB/s, the one row of DeepEP's tables the model takes (``bench/fidelity_report.py`` derives it and
#: predicts the other rows).
LATENCY_US = {"per-gpu": 0.0, "normal": 33.0, "low-latency": 33.0}


def check_kernel(kernel: str) -> str:
    """``kernel`` if it is one of :data:`KERNELS`, else a one-line error."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise InputError(f"all-to-all kernel {kernel!r} is unknown; choose one of: {', '.join(KERNELS)}")
    return kernel


def kernels_on(gpu: GpuSpec) -> tuple[str, ...]:
    """The kernels a deployment on ``gpu`` may price, the default (``per-gpu``) first: all of :data:`KERNELS` on an
    NVIDIA GPU, none of DeepEP's (:data:`DEEPEP_KERNELS`) on another vendor's. What chooses or lists kernels for a
    GPU takes them from here."""
    return KERNELS if gpu.vendor == "nvidia" else tuple(k for k in KERNELS if k not in DEEPEP_KERNELS)


def check_kernel_on(kernel: str, gpu: GpuSpec) -> str:
    """``kernel`` if it is one of :data:`KERNELS` that runs on ``gpu`` (:func:`kernels_on`), else a one-line error
    naming the GPU and the fix."""
    if check_kernel(kernel) not in kernels_on(gpu):
        raise InputError(f"--a2a {kernel} prices DeepEP's kernels, which run on NVIDIA GPUs only, not on --gpu "
                         f"{gpu.name} ({VENDORS[gpu.vendor]} {gpu.display_name}), where engines run MORI EP, which "
                         f"moebalance has not measured; give --a2a {' or '.join(kernels_on(gpu))}")
    return kernel


def kernel_for(kernel: str, phase: str | None) -> str:
    """The kernel that moves a ``phase``'s tokens: ``auto`` is ``normal`` in prefill and ``low-latency`` in decode
    (``phase`` None: the load's own batches, priced as decode steps when ``auto``)."""
    if check_kernel(kernel) != "auto":
        return kernel
    return "normal" if phase == "prefill" else "low-latency"


def a2a_seconds(pair_copies: np.ndarray, cluster: Cluster, bytes_per_copy: float) -> np.ndarray:
    """``float64 [...]``: all-to-all seconds (dispatch + combine, no fixed cost) for copies ``[..., G, G]`` (source,
    destination)."""
    kind = cluster.link_kind()
    intra, inter = (kind == 1), (kind == 2)
    m = pair_copies.astype(np.float64)
    t_intra = np.maximum((m * intra).sum(axis=-1), (m * intra).sum(axis=-2)) / cluster.intra_node_bandwidth
    t_inter = np.maximum((m * inter).sum(axis=-1), (m * inter).sum(axis=-2)) / cluster.inter_node_bandwidth
    return 2.0 * bytes_per_copy * np.maximum(t_intra, t_inter).max(axis=-1) / 1e9


def a2a_estimate(gpu_load: np.ndarray, cluster: Cluster, bytes_per_copy: float, *, kernel: str = "per-gpu",
                 top_k: int = 1) -> np.ndarray:
    """``float64 [...]``: all-to-all seconds (no fixed cost) of per-GPU picks ``gpu_load [..., G]`` of tokens with
    ``top_k`` picks each, spread over the GPUs, for ``kernel`` (module docstring; not ``auto``).

    Each GPU holds ``T / G`` of the ``T = sum(gpu_load) / top_k`` tokens; ``c_g`` of them reach GPU ``g`` (``T (1 -
    (1 - p_g)^K)``, or ``K T p_g`` messages for ``low-latency``) and ``c_n`` reach node ``n``. Copies to the token's
    own GPU are free; over ``G = N M`` GPUs::

        per-gpu, low-latency:  recv_intra = c_g (M - 1) / G     send_intra = (c_node(g) - c_g) / G
                               recv_inter = c_g (G - M) / G     send_inter = (c_all - c_node(g)) / G
        normal:                recv_intra = c_g (M - 1) / M     send_intra = (c_node(g) - c_g) / M
                               recv_inter = c_n (N - 1) / G     send_inter = (c_nodes - c_n) / G
    """
    kernel = check_kernel(kernel)
    if kernel == "auto":
        raise InputError("a2a_estimate needs the phase's kernel, not auto (kernel_for resolves it)")
    G, gpn, N = cluster.num_gpus, cluster.gpus_per_node, cluster.num_nodes
    load = np.asarray(gpu_load, dtype=np.float64)
    total = load.sum(axis=-1, keepdims=True)
    tokens = total / top_k
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, load / total, 0.0)  # p_g
    reach = load if kernel == "low-latency" else _reached(tokens, share, top_k)
    by_node = reach.reshape(*reach.shape[:-1], N, gpn).sum(axis=-1)  # [..., N]
    node_of = np.repeat(by_node, gpn, axis=-1)  # [..., G]: what each GPU's node receives
    if kernel == "normal":
        node_share = share.reshape(*share.shape[:-1], N, gpn).sum(axis=-1)
        nodes = _reached(tokens, node_share, top_k)  # [..., N]: tokens reaching node n
        nodes_of = np.repeat(nodes, gpn, axis=-1)
        recv_intra, send_intra = reach * (gpn - 1) / gpn, (node_of - reach) / gpn
        recv_inter = nodes_of * (N - 1) / G
        send_inter = (nodes.sum(axis=-1, keepdims=True) - nodes_of) / G
    else:
        recv_intra, recv_inter = reach * (gpn - 1) / G, reach * (G - gpn) / G
        send_intra, send_inter = (node_of - reach) / G, (reach.sum(axis=-1, keepdims=True) - node_of) / G
    t_intra = np.maximum(recv_intra, send_intra) / cluster.intra_node_bandwidth
    t_inter = np.maximum(recv_inter, send_inter) / cluster.inter_node_bandwidth
    return 2.0 * bytes_per_copy * np.maximum(t_intra, t_inter).max(axis=-1) / 1e9


def _reached(tokens: np.ndarray, share: np.ndarray, top_k: int) -> np.ndarray:
    """Tokens with at least one of their ``top_k`` independent picks in a part of ``share``: ``T (1 - (1 - p)^K)``."""
    with np.errstate(divide="ignore"):  # a part with every pick (p = 1): log1p(-1) = -inf, reached by all
        return tokens * -np.expm1(top_k * np.log1p(-np.clip(share, 0.0, 1.0)))


def a2a_per_pick(cluster: Cluster, bytes_per_copy: float) -> float:
    """Seconds of all-to-all one pick adds to the GPU that serves it when each pick is one message from a GPU drawn
    uniformly (:func:`a2a_estimate` with ``low-latency``: over the intra-node link with probability ``(M - 1) / G``,
    the NIC with ``(G - M) / G``); for the other kernels, which merge a token's picks, an upper bound."""
    G, gpn = cluster.num_gpus, cluster.gpus_per_node
    per = max((gpn - 1) / G / cluster.intra_node_bandwidth, (G - gpn) / G / cluster.inter_node_bandwidth)
    return 2.0 * bytes_per_copy * per / 1e9
