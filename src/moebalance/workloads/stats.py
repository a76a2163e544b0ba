"""Per-layer statistics of routing: expert-load skew, drift, locality, affinity and cross-layer dependency.

Legend: ``B`` batches, ``L`` MoE layers, ``E`` experts per layer, ``K`` experts picked per token (top-k),
``N`` tokens, ``G`` GPUs (data-parallel ranks).

:func:`layer_skew` reads a load matrix ``counts [B, L, E]``. The other functions read a token-level trace
(``topk_ids [N, L, K]``, ``src_gpu [N]``) and measure what the papers exploit: per-GPU demand that differs
from the global one (Libra's local hot experts), experts picked together by one token (GRACE-MoE's affinity)
and experts picked in consecutive layers by one token (MoETuner's inter-layer dependency).

The mutual-information and locality numbers carry a finite-sample bias: even independent routing gives a
small positive value that shrinks as tokens grow. Compare against a control with the same marginals (shuffle
tokens across GPUs, or shuffle one side of the pairs across tokens) rather than against 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core import tally
from moebalance.core.errors import InputError

__all__ = ["HIGH_SKEW_PEAK_TO_MEAN", "LayerSkew", "coactivation_strength", "layer_skew", "locality",
           "transition_strength"]

#: CRAFT (Section 3.2, Observation 1) calls a layer high-skew when its hottest expert exceeds 10x the mean.
HIGH_SKEW_PEAK_TO_MEAN = 10.0


@dataclass(frozen=True, slots=True)
class LayerSkew:
    """Skew of every layer's expert load, summed over batches (``drift`` looks at batches separately).

    Example: one batch, one layer, loads ``[6, 1, 1, 0]`` (mean 2) gives ``peak_to_mean [3.0]``,
    ``top2_share [0.875]``, ``cv [1.17]``, ``drift [0.0]``, ``hot_experts [1]`` and ``high_skew [False]``.
    A layer with no load at all reads as a uniform one: peak/mean 1, top-2 share ``min(2, E) / E``,
    CV 0, drift 0, no hot experts.
    """

    #: ``float64 [L]``: max expert load / mean expert load (1 is uniform; at most ``E / K`` under top-k).
    peak_to_mean: np.ndarray
    #: ``float64 [L]``: fraction of the layer's load taken by its two hottest experts.
    top2_share: np.ndarray
    #: ``float64 [L]``: coefficient of variation (population std / mean) of the expert loads.
    cv: np.ndarray
    #: ``float64 [L]``: mean over experts of std / mean of the expert's share of the batch load, across
    #: batches (batches with no load in the layer skipped; experts never loaded count 0; 0 for one batch).
    #: It includes sampling noise: cold experts with few tokens per batch raise it.
    drift: np.ndarray
    #: ``int64 [L]``: experts whose load exceeds ``hot_factor`` (default 2) times the mean: the experts a
    #: placement must pair with cold ones or replicate.
    hot_experts: np.ndarray
    #: ``bool [L]``: ``peak_to_mean > 10`` (CRAFT's high-skew, replication-effective layers).
    high_skew: np.ndarray


def _load_array(counts: object) -> np.ndarray:
    arr = np.asarray(counts)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise InputError(f"counts has dtype {arr.dtype}; it must hold token counts (integers)")
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise InputError(f"counts has shape {arr.shape}; expected [B, L, E] (or [L, E] for one batch)")
    if 0 in arr.shape:
        raise InputError(f"counts has shape {arr.shape}; it needs at least one batch, layer and expert")
    if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
        raise InputError("counts holds NaN or infinite values; loads must be finite token counts")
    if np.any(arr < 0):
        raise InputError(f"counts holds a negative load ({arr.min()}); loads must be >= 0")
    return arr.astype(np.float64, copy=False)


def layer_skew(counts: np.ndarray, *, hot_factor: float = 2.0) -> LayerSkew:
    """Skew statistics of every layer of ``counts [B, L, E]`` (or ``[L, E]``, one batch).

    ``hot_factor`` sets which experts count as hot (load above ``hot_factor`` times the mean).
    """
    if not hot_factor > 0:
        raise InputError(f"hot_factor ({hot_factor}) must be positive")
    w = _load_array(counts)
    num_experts = w.shape[2]
    load = w.sum(axis=0)  # [L, E]
    total = load.sum(axis=1)
    mean = total / num_experts
    loaded = total > 0
    safe_mean = np.where(loaded, mean, 1.0)
    peak_to_mean = np.where(loaded, load.max(axis=1) / safe_mean, 1.0)
    top2 = -np.partition(-load, 1, axis=1)[:, :2].sum(axis=1) if num_experts > 1 else load[:, 0]
    top2_share = np.where(loaded, top2 / np.where(loaded, total, 1.0), min(2, num_experts) / num_experts)
    cv = np.where(loaded, load.std(axis=1) / safe_mean, 0.0)
    hot = np.where(loaded[:, None], load > hot_factor * mean[:, None], False).sum(axis=1)
    return LayerSkew(peak_to_mean=peak_to_mean, top2_share=top2_share, cv=cv, drift=_drift(w),
                     hot_experts=hot.astype(np.int64), high_skew=peak_to_mean > HIGH_SKEW_PEAK_TO_MEAN)


def _drift(w: np.ndarray) -> np.ndarray:
    """``[L]``: mean over experts of std / mean, across loaded batches, of the expert's share of the load."""
    totals = w.sum(axis=2, keepdims=True)  # [B, L, 1]
    valid = totals > 0
    share = np.where(valid, w / np.where(valid, totals, 1.0), 0.0)
    n = valid.sum(axis=0)  # [L, 1]
    safe_n = np.maximum(n, 1)
    mean = share.sum(axis=0) / safe_n  # [L, E]
    var = (np.where(valid, share - mean, 0.0) ** 2).sum(axis=0) / safe_n
    ratio = np.where(mean > 0, np.sqrt(var) / np.where(mean > 0, mean, 1.0), 0.0)
    return np.where(n[:, 0] > 1, ratio.mean(axis=1), 0.0)


# ----- token-level statistics ------------------------------------------------------------------------------

def _topk(topk_ids: object, num_experts: int) -> np.ndarray:
    """``topk_ids`` checked (shape, range) and in the compact id type that the counting kernels take."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int | np.integer) or num_experts < 1:
        raise InputError(f"num_experts ({num_experts!r}) must be a positive integer")
    ids = np.asarray(topk_ids)
    if ids.ndim != 3 or ids.shape[0] == 0 or ids.shape[1] == 0 or ids.shape[2] == 0:
        raise InputError(f"topk_ids has shape {ids.shape}; expected [N, L, K] with N, L, K >= 1")
    return tally.as_ids(ids, int(num_experts))  # checks the dtype and the range


def locality(topk_ids: np.ndarray, src_gpu: np.ndarray, num_experts: int) -> np.ndarray:
    """How far each GPU's expert demand is from the global one, per layer: ``float64 [L]`` in ``[0, 1]``.

    For layer ``l`` and GPU ``g``, ``p_g`` is the distribution of the experts picked by ``g``'s tokens and
    ``p`` that of all tokens; the result is the token-weighted mean over GPUs of the total-variation distance
    ``0.5 * sum_e |p_g[e] - p[e]|``. 0 means every GPU wants the same experts (no local hot experts); it is
    small but positive for finite samples even without locality (compare with ``src_gpu`` shuffled).

    Args:
        topk_ids: ``int [N, L, K]``, the experts each token picked.
        src_gpu: ``int [N]``, each token's GPU (data-parallel rank), ``>= 0``.
        num_experts: ``E``.
    """
    ids = _topk(topk_ids, num_experts)
    src = np.asarray(src_gpu)
    if src.shape != (ids.shape[0],) or not np.issubdtype(src.dtype, np.integer):
        raise InputError(f"src_gpu has shape {src.shape} and dtype {src.dtype}; expected integers of shape "
                         f"[{ids.shape[0]}], one GPU per token")
    if int(src.min()) < 0:
        raise InputError(f"src_gpu holds rank {int(src.min())}; ranks must be >= 0")
    src = src.astype(np.int64)
    demand = tally.demand_counts(ids, src, int(src.max()) + 1, int(num_experts)).astype(np.float64)  # [L, G, E]
    per_gpu = demand.sum(axis=2, keepdims=True)
    p_g = demand / np.maximum(per_gpu, 1.0)
    p = demand.sum(axis=1, keepdims=True) / demand.sum(axis=(1, 2), keepdims=True)
    tv = 0.5 * np.abs(p_g - p).sum(axis=2)  # [L, G]
    weight = per_gpu[..., 0] / per_gpu.sum(axis=1)
    return (tv * weight).sum(axis=1)


def _mutual_information(joint: np.ndarray) -> np.ndarray:
    """Mutual information in bits of joint counts ``[..., E, E]`` (rows one variable, columns the other)."""
    total = joint.sum(axis=(-2, -1), keepdims=True)
    p = joint / np.maximum(total, 1.0)
    row = p.sum(axis=-1, keepdims=True)
    col = p.sum(axis=-2, keepdims=True)
    outer = row * col
    nz = p > 0
    terms = np.where(nz, p * np.log2(np.where(nz, p, 1.0) / np.where(nz, outer, 1.0)), 0.0)
    return np.maximum(terms.sum(axis=(-2, -1)), 0.0)


def coactivation_strength(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Affinity: mutual information (bits) between two experts picked by the same token, per layer ``[L]``.

    Every unordered pair of a token's ``K`` experts counts once in both orders, which gives a symmetric
    joint distribution over ``E x E`` (GRACE-MoE's co-activation matrix, normalised). Independent routing
    gives about 0 (a little more, since a token's experts are distinct and samples are finite); experts that
    are picked together give more. ``K = 1`` gives 0.
    """
    ids = _topk(topk_ids, num_experts)
    if ids.shape[2] < 2:
        return np.zeros(ids.shape[1])
    joint = tally.pair_counts(ids, int(num_experts))  # [L, E, E]: ordered pairs of a token's picks, (k, k) too
    load = tally.count_picks(ids, np.zeros(ids.shape[0], dtype=np.int64), 1, int(num_experts))[0]  # [L, E]
    diagonal = np.arange(num_experts)
    joint[:, diagonal, diagonal] -= load  # a pick with itself is not a pair (a repeated expert still is)
    return _per_layer_mi(joint)


def _per_layer_mi(joint: np.ndarray) -> np.ndarray:
    """:func:`_mutual_information` of each ``[E, E]`` block of ``joint [L, E, E]``, one layer's float copy at a time."""
    return np.array([_mutual_information(block.astype(np.float64)) for block in joint], dtype=np.float64)


def transition_strength(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Cross-layer dependency: mutual information (bits) between an expert a token picks in layer ``l`` and
    one it picks in layer ``l + 1``, over all ``K x K`` such pairs; ``float64 [L - 1]``.

    The joint counts are MoETuner's inter-layer token-routing dependency table. Independent layers give
    about 0 (finite-sample bias aside).
    """
    ids = _topk(topk_ids, num_experts)
    return _per_layer_mi(tally.transition_counts(ids, int(num_experts)))
