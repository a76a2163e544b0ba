"""The per-batch processes of a synthetic routing trace and its two samplers (:mod:`moebalance.workloads.synth`).

Legend: ``B`` batches, ``L`` MoE layers, ``E`` routed experts per layer, ``K`` experts picked per token (top-k),
``T`` tokens per batch, ``G`` GPUs (data-parallel ranks), ``C`` latent topics, ``S`` latent route states.

Per batch: the popularity drift (:func:`drift_knots`, interpolated between knots) and each rank's topic mixture
(:func:`gpu_topic_mixtures`). :func:`sample_count_level` samples ``counts [B, L, E]`` without simulating tokens;
:func:`sample_token_level` simulates every token's picks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moebalance.core.tally import count_picks, id_dtype
from moebalance.models import ModelSpec
from moebalance.workloads.profiles import RoutingProfile
from moebalance.workloads.structure import Structure, water_fill

__all__ = ["drift_knots", "gpu_topic_mixtures", "sample_count_level", "sample_token_level", "tokens_per_gpu"]

# The drift is drawn on knots every this many batches and interpolated in between.
_DRIFT_KNOT = 8
# Batches per chunk: bounds memory and sets how often ``progress`` is called.
_CHUNK_BATCHES = 64


def drift_knots(rng: np.random.Generator, num_batches: int, shape: tuple[int, int],
                profile: RoutingProfile) -> np.ndarray:
    """AR(1) log-popularity drift on knots every ``_DRIFT_KNOT`` batches, ``float64 [num_knots, L, E]``."""
    num_knots = num_batches // _DRIFT_KNOT + 2
    phi = float(np.exp(-_DRIFT_KNOT / profile.drift_timescale))
    innovations = rng.standard_normal((num_knots, *shape)) * profile.drift_sigma
    knots = np.empty_like(innovations)
    knots[0] = innovations[0]
    scale = np.sqrt(1.0 - phi * phi)
    for j in range(1, num_knots):
        knots[j] = phi * knots[j - 1] + scale * innovations[j]
    return knots


def _interpolate(knots: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Linear interpolation of knot values ``[num_knots, ...]`` at batches ``start..stop-1``."""
    b = np.arange(start, stop)
    j = b // _DRIFT_KNOT
    frac = ((b % _DRIFT_KNOT) / _DRIFT_KNOT).reshape(-1, *([1] * (knots.ndim - 1)))
    return knots[j] * (1.0 - frac) + knots[j + 1] * frac


def gpu_topic_mixtures(rng: np.random.Generator, num_batches: int, num_gpus: int,
                       structure: Structure, profile: RoutingProfile) -> np.ndarray:
    """Per-rank topic mixtures ``float64 [B, G, C]``.

    Each rank has a *home* mixture (Dirichlet around the global topic popularity, concentration
    ``gpu_topic_concentration`` per topic): the kind of requests a data-parallel rank keeps getting, e.g.
    through session- or prefix-affine request routing. Every batch a fraction ``request_turnover`` of the
    rank's mixture is replaced by new requests drawn around its home (concentration
    ``request_concentration`` per topic).
    """
    num_topics = len(structure.topic_pop)
    home = rng.dirichlet(profile.gpu_topic_concentration * num_topics * structure.topic_pop, size=num_gpus)
    shape = np.maximum(profile.request_concentration * num_topics * home, 1e-2)
    gamma = rng.standard_gamma(shape, size=(num_batches, num_gpus, num_topics))
    total = gamma.sum(axis=2, keepdims=True)
    fresh = np.where(total > 0, gamma / np.where(total > 0, total, 1.0), home)
    mix = np.empty_like(fresh)
    mix[0] = fresh[0]
    lam = profile.request_turnover
    for b in range(1, num_batches):
        mix[b] = (1.0 - lam) * mix[b - 1] + lam * fresh[b]
    return mix


def tokens_per_gpu(tokens_per_batch: int, num_gpus: int) -> np.ndarray:
    """``int64 [G]``: rank ``g`` holds the tokens ``i`` with ``i * G // T == g``, i.e. ``g * T / G <= i <
    (g + 1) * T / G``: ``ceil((g + 1) * T / G) - ceil(g * T / G)`` of them, computed without a ``[T]`` array.

    ``g * T / G = g * q + g * r / G`` with ``T = q * G + r``, so no product exceeds ``max(T, G * G)`` (int64).
    """
    q, r = divmod(int(tokens_per_batch), int(num_gpus))
    g = np.arange(num_gpus + 1, dtype=np.int64)
    first = g * q - (-(g * r) // num_gpus)  # ceil(g * T / G): the first token of rank g
    return np.diff(first)


def _sample_counts(rng: np.random.Generator, expected: np.ndarray, tokens: int, k: int,
                   noise_sigma: np.ndarray) -> np.ndarray:
    """Counts ``int64 [R, E]`` with rows summing to ``tokens * k`` and entries in ``[0, tokens]``.

    ``expected [R, E]`` are inclusion probabilities (rows summing to about ``k``). Log-normal noise with
    ``noise_sigma [E]`` (chosen for binomial variance) is renormalised, capped at ``tokens`` by water
    filling, and rounded by systematic sampling (one uniform per row): each count is the floor or the ceiling
    of its real value, its expectation is that value, and the row sum is exact.
    """
    total = tokens * k
    noise = np.exp(noise_sigma * rng.standard_normal(expected.shape, dtype=np.float32) - 0.5 * noise_sigma**2)
    x = expected * noise.astype(np.float64)
    x *= total / x.sum(axis=1, keepdims=True)
    over = np.flatnonzero((x > tokens).any(axis=1))
    if over.size:
        x[over] = water_fill(x[over], np.full(over.size, float(total)), float(tokens))
    cum = np.cumsum(x, axis=1)
    cum[:, -1] = total
    cum += rng.random((x.shape[0], 1))
    counts = np.diff(np.floor(cum).astype(np.int64), axis=1, prepend=0)
    # Round-off can put a count one past [0, tokens]; move such units to the expert that lacks most.
    for row in np.flatnonzero((counts < 0).any(axis=1) | (counts > tokens).any(axis=1)):
        c = np.clip(counts[row], 0, tokens)
        for _ in range(abs(total - int(c.sum()))):
            if c.sum() < total:
                c[np.argmax(np.where(c < tokens, x[row] - c, -np.inf))] += 1
            else:
                c[np.argmax(np.where(c > 0, c - x[row], -np.inf))] -= 1
        counts[row] = c
    assert counts.min() >= 0 and counts.max() <= tokens and np.all(counts.sum(axis=1) == total)
    return counts


def sample_count_level(model: ModelSpec, prof: RoutingProfile, structure: Structure, knots: np.ndarray,
                       mixtures: np.ndarray, num_batches: int, tokens: int, num_gpus: int, rng: np.random.Generator,
                       progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
    """``{"counts": int64 [B, L, E]}`` sampled batch by batch without simulating tokens (the count path of
    :mod:`moebalance.workloads.synth`); ``counts[b, l]`` sums to ``T * K`` with at most ``T`` per expert."""
    L, E, K = model.num_layers, model.num_experts, model.top_k
    counts = np.empty((num_batches, L, E), dtype=np.int64)
    per_gpu = tokens_per_gpu(tokens, num_gpus)
    # The drift acts on logits; on inclusion probabilities it acts with gain g = d log p / d logit. The
    # -g^2 sigma^2 / 2 term makes the multiplier mean-one, so drift leaves the average skew as calibrated.
    gain = structure.drift_gain
    knot_mult = np.exp(knots * gain - 0.5 * (gain * prof.drift_sigma) ** 2).astype(np.float32)
    incl_topic = structure.incl_topic.astype(np.float32)
    p = np.clip(structure.mean_incl, 1e-9, 1.0)
    noise_sigma = np.sqrt(np.log1p((1.0 - p) / (tokens * p))).astype(np.float32)  # [L, E]
    for start in range(0, num_batches, _CHUNK_BATCHES):
        stop = min(num_batches, start + _CHUNK_BATCHES)
        nb = stop - start
        # How many of each rank's tokens have each topic, then the batch's topic weights [nb, C].
        topic_counts = rng.multinomial(np.broadcast_to(per_gpu, (nb, num_gpus)), mixtures[start:stop])
        weights = (topic_counts.sum(axis=1) / tokens).astype(np.float32)
        expected = np.einsum("bc,lce->ble", weights, incl_topic)
        expected *= _interpolate(knot_mult, start, stop)
        rows = _sample_counts(rng, expected.reshape(nb * L, E), tokens, K,
                              np.broadcast_to(noise_sigma[None], (nb, L, E)).reshape(nb * L, E))
        counts[start:stop] = rows.reshape(nb, L, E)
        if progress is not None:
            progress(nb)
    return {"counts": counts}


def sample_token_level(model: ModelSpec, prof: RoutingProfile, structure: Structure, knots: np.ndarray,
                       mixtures: np.ndarray, num_batches: int, tokens: int, num_gpus: int, rng: np.random.Generator,
                       progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
    """Every token's picks (Gumbel-top-k on its logits): ``topk_ids [B*T, L, K]``, ``src_gpu int32 [B*T]``,
    ``batch int32 [B*T]`` and the ``counts [B, L, E]`` they imply."""
    L, E, K = model.num_layers, model.num_experts, model.top_k
    S = prof.num_route_states
    n_total = num_batches * tokens
    topk_ids = np.empty((n_total, L, K), dtype=id_dtype(E))
    rank_of = (np.arange(tokens) * num_gpus // tokens).astype(np.int32)
    src_gpu = np.tile(rank_of, num_batches)
    batch = np.repeat(np.arange(num_batches, dtype=np.int32), tokens)
    base = structure.base.astype(np.float32)
    topic_off = structure.topic.astype(np.float32)
    route_off = structure.route.astype(np.float32)
    # Same mean-one correction as the count path: -g sigma^2 / 2 on the logit is -g^2 sigma^2 / 2 on log p.
    knots32 = (knots - 0.5 * structure.drift_gain * prof.drift_sigma**2).astype(np.float32)
    cdf = np.cumsum(mixtures, axis=2)
    cdf[:, :, -1] = 1.0
    chunk = max(1, min(_CHUNK_BATCHES, (1 << 24) // (tokens * E)))  # at most ~16M logits per chunk
    for start in range(0, num_batches, chunk):
        stop = min(num_batches, start + chunk)
        nb = stop - start
        lo, hi = start * tokens, stop * tokens
        local_batch = batch[lo:hi] - start
        gpu = src_gpu[lo:hi]
        # Topic of every token, drawn from its rank's mixture in its batch (inverse CDF).
        u = rng.random(hi - lo)
        topic = (u[:, None] > cdf[start + local_batch, gpu]).sum(axis=1)
        z = rng.integers(0, S, hi - lo)
        drift = _interpolate(knots32, start, stop)  # [nb, L, E]
        C = topic_off.shape[1]
        for layer in range(L):
            # Logits of every (batch, topic, route state) combination, then one gather per token.
            table = (base[layer] + drift[:, layer, None, None, :] + topic_off[layer][None, :, None, :]
                     + route_off[layer][None, None, :, :]).reshape(-1, E)
            logits = table[(local_batch * C + topic) * S + z]
            # Gumbel-top-k as an exponential race: top-k of logit - log(Exp(1)).
            with np.errstate(divide="ignore"):  # an Exp(1) draw of exactly 0 just wins the race
                logits -= np.log(rng.standard_exponential(logits.shape, dtype=np.float32))
            if K < E:
                pick = np.argpartition(-logits, K - 1, axis=1)[:, :K]
            else:
                pick = np.broadcast_to(np.arange(E), logits.shape).copy()
            order = np.argsort(-np.take_along_axis(logits, pick, axis=1), axis=1)
            topk_ids[lo:hi, layer] = np.take_along_axis(pick, order, axis=1)
            if layer + 1 < L:
                keep = rng.random(hi - lo) < prof.route_persistence
                z = np.where(keep, structure.route_perm[layer, z], rng.integers(0, S, hi - lo))
            # the chunk's batches told as its layers finish (one chunk may hold every batch): whole batches, nb in all
            if progress is not None and (done := nb * (layer + 1) // L - nb * layer // L):
                progress(done)
    counts = count_picks(topk_ids, batch.astype(np.int64), num_batches, E)
    return {"counts": counts, "topk_ids": topk_ids, "src_gpu": src_gpu, "batch": batch}
