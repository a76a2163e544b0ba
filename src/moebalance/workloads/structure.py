"""The structure of a synthetic routing model drawn from the seed (:mod:`moebalance.workloads.synth`).

Legend: ``L`` MoE layers, ``E`` routed experts per layer, ``K`` experts picked per token, ``C`` latent topics,
``S`` latent route states.

:func:`build_structure` draws, once per seed and model, the per-layer skew targets, the topic and route-state
expert clusters and the base logits solved so that every expert's population-average inclusion probability meets
its target; :func:`water_fill` is the capped proportional share used here and by the count sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.models import ModelSpec
from moebalance.workloads.profiles import RoutingProfile

__all__ = ["Structure", "build_structure", "water_fill"]

# Largest share of a batch's tokens one expert may be expected to receive; keeps logits finite.
_PI_MAX = 0.95


@dataclass(frozen=True, slots=True)
class Structure:
    """The routing model's fixed part for one seed and model (shapes in the field comments)."""

    base: np.ndarray  # float64 [L, E] base logits
    topic: np.ndarray  # float64 [L, C, E] topic logit offsets
    route: np.ndarray  # float64 [L, S, E] route-state logit offsets
    route_perm: np.ndarray  # int64 [L, S] route-state map from layer l to l + 1
    topic_pop: np.ndarray  # float64 [C] global topic popularity
    incl_topic: np.ndarray  # float64 [L, C, E] expected inclusion per topic (mean over route states), sums to K
    drift_gain: np.ndarray  # float64 [L, E] d(log inclusion)/d(logit) at the average inclusion
    mean_incl: np.ndarray  # float64 [L, E] population-average inclusion


def _inclusion(logits: np.ndarray, k: int, tau: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mean-field inclusion probabilities of Gumbel-top-``k`` over the last axis ``[..., E]``, and ``tau``.

    Gumbel-top-k is an exponential race: expert ``e`` arrives at ``Exp(w_e)``, ``w = exp(logit)``, and the
    first ``k`` arrivals win. Replacing the ``k``-th arrival time by a constant ``tau`` gives
    ``p_e = 1 - exp(-w_e * tau)`` with ``sum_e p_e = k``. Newton from ``tau = k / sum(w)`` (where the sum is
    below ``k``) climbs monotonically to the root, since the sum is concave in ``tau``. ``tau [..., 1]`` from
    an earlier call on nearby logits is a warm start (it is clipped to that safe side first).
    """
    num_experts = logits.shape[-1]
    if k >= num_experts:
        return np.ones_like(logits), np.ones((*logits.shape[:-1], 1))
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    start = k / w.sum(axis=-1, keepdims=True)
    if tau is not None:  # keep the warm start only where it lies left of the root
        warm = np.maximum(start, tau)
        below = num_experts - np.exp(-w * warm).sum(axis=-1, keepdims=True) - k <= 0
        start = np.where(below, warm, start)
    tau = start
    for _ in range(100):
        ewt = np.exp(-w * tau)
        f = num_experts - ewt.sum(axis=-1, keepdims=True) - k
        if np.all(np.abs(f) < 1e-9 * k):
            break
        tau = tau - f / (w * ewt).sum(axis=-1, keepdims=True)
    return -np.expm1(-w * tau), tau


def water_fill(weights: np.ndarray, mass: np.ndarray, cap: float) -> np.ndarray:
    """``min(cap, s * weights)`` per row of ``[R, E]`` with ``s`` chosen so each row sums to ``mass [R]``."""
    out = np.zeros_like(weights)
    free = np.ones(weights.shape, dtype=bool)
    for _ in range(weights.shape[-1] + 1):
        fixed_mass = np.where(free, 0.0, out).sum(axis=-1)
        free_w = np.where(free, weights, 0.0).sum(axis=-1)
        scale = (mass - fixed_mass) / np.maximum(free_w, 1e-300)
        out = np.where(free, weights * scale[:, None], out)
        over = free & (out > cap)
        if not over.any():
            break
        out = np.where(over, cap, out)
        free &= ~over
    return out


def _layer_targets(rng: np.random.Generator, preset: ModelSpec, profile: RoutingProfile) -> np.ndarray:
    """Population-average inclusion probability of every expert, ``float64 [L, E]``, rows summing to ``K``."""
    L, E, K = preset.num_layers, preset.num_experts, preset.top_k
    if K / E > 0.75 * _PI_MAX:  # nearly dense routing leaves no room for skew
        return np.full((L, E), K / E)
    n_high = min(L, max(1, round(profile.high_skew_fraction * L))) if profile.high_skew_fraction > 0 else 0
    n_bal = min(L - n_high, max(1, round(profile.balanced_fraction * L))) if profile.balanced_fraction > 0 else 0
    kinds = np.array([2] * n_high + [0] * n_bal + [1] * (L - n_high - n_bal))  # 0 balanced, 1 moderate, 2 high
    kinds = kinds[rng.permutation(L)]
    order = np.argsort(rng.random((L, E)), axis=1)  # a random expert ranking per layer: hot ones first
    num_hot = min(3, E - 1)
    hot = np.zeros((L, 3))
    lo, hi = profile.high_hot_range
    pinned = int(np.flatnonzero(kinds == 2)[0]) if n_high else -1
    for layer in range(L):
        if kinds[layer] == 2:
            if layer == pinned:
                hot[layer, :2] = profile.pinned_hot
            else:
                first = rng.uniform(lo, hi)
                hot[layer, :2] = first, first * rng.uniform(0.5, 0.9)
                if rng.random() < 0.3:
                    hot[layer, 2] = hot[layer, 1] * rng.uniform(0.4, 0.8)
        elif kinds[layer] == 1:
            hot[layer, 0] = min(rng.uniform(*profile.moderate_peak_range) * K / E, 0.5)
    hot = hot[:, :num_hot]
    # Leave the other experts at least a fifth of a uniform share on average.
    n_rest = E - np.count_nonzero(hot, axis=1)
    room = K - 0.2 * K * n_rest / E
    hot *= np.minimum(1.0, room / np.maximum(hot.sum(axis=1), 1e-12))[:, None]
    sigma = np.where(kinds == 0, profile.balanced_sigma, profile.skewed_sigma)
    ranked = np.exp(sigma[:, None] * rng.standard_normal((L, E)))  # log-normal popularity of the others
    is_hot = np.zeros((L, E), dtype=bool)
    is_hot[:, :num_hot] = hot > 0
    ranked[is_hot] = 0.0
    ranked = water_fill(ranked, K - hot.sum(axis=1), _PI_MAX)
    ranked[is_hot] = hot[hot > 0]
    targets = np.empty((L, E))
    np.put_along_axis(targets, order, ranked, axis=1)
    return targets


def _clusters(rng: np.random.Generator, num_layers: int, num_clusters: int, size: int, num_experts: int) -> np.ndarray:
    """Boolean ``[L, num_clusters, E]``: per layer, clusters cut from back-to-back random permutations of the
    experts, so every expert belongs to about the same number of clusters (no extra popularity skew)."""
    reps = -(-num_clusters * size // num_experts)
    perms = np.argsort(rng.random((num_layers, reps, num_experts)), axis=2).reshape(num_layers, -1)
    members = perms[:, : num_clusters * size].reshape(num_layers, num_clusters, size)
    mask = np.zeros((num_layers, num_clusters, num_experts), dtype=bool)
    np.put_along_axis(mask, members, True, axis=2)
    return mask


def build_structure(preset: ModelSpec, profile: RoutingProfile, rng: np.random.Generator) -> Structure:
    """The routing model's fixed part for ``preset``, drawn from ``rng`` (the seed's structure stream)."""
    L, E, K = preset.num_layers, preset.num_experts, preset.top_k
    C, S = profile.num_topics, profile.num_route_states
    targets = _layer_targets(rng, preset, profile)
    size = min(E, max(K, 2 * E // C))
    topic = profile.topic_strength * _clusters(rng, L, C, size, E) * rng.uniform(0.5, 1.5, (L, C, E))
    route_size = min(E, max(K, E // S))
    route = profile.route_strength * _clusters(rng, L, S, route_size, E) * rng.uniform(0.5, 1.5, (L, S, E))
    route_perm = np.argsort(rng.random((L, S)), axis=1)
    topic_pop = rng.dirichlet(np.full(C, 4.0))

    tau: np.ndarray | None = None

    def expected(base: np.ndarray) -> np.ndarray:  # [L, C, E]: mean over route states
        nonlocal tau
        logits = base[:, None, None, :] + topic[:, :, None, :] + route[:, None, :, :]
        incl, tau = _inclusion(logits, K, tau)
        return incl.mean(axis=2)

    def w_of(p: np.ndarray) -> np.ndarray:
        return -np.log1p(-np.minimum(p, 1.0 - 1e-12))

    if K >= E:
        base = np.zeros((L, E))
        incl_topic = np.ones((L, C, E))
    else:
        # Fixed point: raise or lower each expert's base logit until its population-average inclusion
        # (over topics weighted by popularity and over route states) meets the target.
        # Stops when every expert's average load is within 0.05 mean loads of its target; the step is
        # over-relaxed by 1.3, which about halves the iterations on the presets (4 instead of 6).
        base = np.log(w_of(targets))
        for _ in range(20):
            incl_topic = expected(base)
            mean = np.einsum("c,lce->le", topic_pop, incl_topic)
            if np.max(np.abs(mean - targets)) * E / K < 0.05:
                break
            base = base + 1.3 * np.log(w_of(targets) / w_of(mean))
    mean_incl = np.einsum("c,lce->le", topic_pop, incl_topic)
    p = np.clip(mean_incl, 1e-12, 1.0 - 1e-12)
    drift_gain = (1.0 - p) * (-np.log1p(-p)) / p  # d log p / d logit under p = 1 - exp(-w tau)
    return Structure(base=base, topic=topic, route=route, route_perm=route_perm, topic_pop=topic_pop,
                      incl_topic=incl_topic, drift_gain=drift_gain, mean_incl=mean_incl)
