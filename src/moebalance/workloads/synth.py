"""Synthetic routing traces for real MoE models, calibrated to published routing measurements.

Legend: ``B`` batches, ``L`` MoE layers, ``E`` routed experts per layer, ``K`` experts picked per token
(top-k), ``T`` tokens per batch, ``N = B * T`` tokens in all, ``G`` GPUs (data-parallel ranks),
``C`` latent topics, ``S`` latent route states.

:func:`synthesize` returns the arrays of a trace ``.npz`` file (``docs/design.md``, "Data formats"): always
``counts int64 [B, L, E]`` and ``preset`` (0-d unicode array); with ``token_level=True`` also
``topk_ids [N, L, K]``, ``src_gpu int32 [N]`` and ``batch int32 [N]``. The models' shapes (``L``, ``E``,
``K``, ...) are published facts in :mod:`moebalance.models`; this module holds only the routing calibration.

The generative routing model
----------------------------
Each token ``n`` has a latent *topic* ``c_n`` (kept through all layers) and a latent *route state*
``z_{n,l}`` (a Markov chain over layers). Its gate logits in layer ``l`` of batch ``b`` are::

    logit[n, l, e] = base[l, e] + drift[b, l, e] + topic[l, c_n, e] + route[l, z_{n,l}, e]

and it picks the ``K`` experts with the largest ``logit + Gumbel noise`` (Gumbel-top-k: a draw without
replacement from ``softmax(logit)``, so the ``K`` experts are distinct). Each piece reproduces one published
observation:

* ``base[l]`` -- per-layer skew (CRAFT, "Observation 1", Section 3.2). Every layer is drawn, from the seed,
  as *balanced* (log-normal popularity, peak/mean about 2.5x, like CRAFT's layer 20), *moderate* (one warm
  expert, 3x-8x) or *high-skew* (two or three "super experts" picked by 40%-93% of the tokens; CRAFT's
  layer 51 has the hottest expert at >27x the mean and its top two at about 20% of the load; CRAFT calls a
  layer high-skew above 10x). The most skewed layer of each preset is pinned to the published numbers.
  For Mixtral the pinned layer reproduces MoETuner's Figure 4 (two experts take about 64% of a layer's
  load). ``base`` is solved so that the population-average share of every expert meets its target.
* ``drift[b]`` -- popularity drifts slowly from batch to batch: an AR(1) process on log-popularity with
  stationary standard deviation ``drift_sigma`` and correlation time ``drift_timescale`` batches, drawn on
  knots every ``_DRIFT_KNOT`` batches and interpolated linearly. Plans made on early batches are good but not
  perfect on later ones.
* ``topic[l, c]`` -- co-activation affinity (GRACE-MoE, Section 3): each topic raises the logits of a cluster
  of experts in every layer, so experts of one cluster are picked together by the same token.
* ``route[l, z]`` and topic persistence -- cross-layer dependency (MoETuner, Section 3.2): the topic is
  shared by all layers and the route state moves as ``z_{l+1} = perm_l[z_l]`` with probability
  ``route_persistence`` (else uniformly at random), so the experts a token picks in layer ``l`` make some
  experts of layer ``l + 1`` more likely. The route state is uniform in every layer, whatever the topic.
* per-GPU topic mixtures -- locality (Libra, Section 3.2: each GPU has its own "local hot experts"): each
  data-parallel rank has a *home* topic mixture (Dirichlet around the global topic popularity, as if
  requests were routed to ranks by session or prefix) and draws its tokens' topics from a current mixture
  that is renewed slowly around the home one (a fraction ``request_turnover`` per batch, like requests
  that finish and are replaced), so per-GPU demand differs from the global one.

Token level (``token_level=True``) simulates exactly that, token by token. The count-only path must be fast
(DeepSeek-V3, 3000 batches of 4096 tokens in a few seconds), so it simulates no tokens. Per batch it samples
how many tokens of each rank have each topic, mixes the per-topic expected inclusion probabilities
(computed once with a mean-field approximation of Gumbel-top-k: ``p_e = 1 - exp(-w_e * tau)``,
``w = exp(logit)``, ``tau`` chosen so that the ``p_e`` sum to ``K``), applies the drift, and then samples
``counts[b, l]`` with ``T * K`` picks in all and at most ``T`` per expert (log-normal noise with binomial
variance, then unbiased systematic rounding). Both paths share the structure drawn from the seed, but their
random streams differ, so ``token_level=True`` and ``False`` give different counts for one seed.

Not modelled: DeepSeek-V3's group-limited routing (top-4 of 8 groups), token dropping, and the shared
experts (they see every token and need no placement).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.tally import count_picks, id_dtype
from moebalance.models import MODELS, ModelSpec, get_model

__all__ = ["PROFILES", "RoutingProfile", "routing_profile", "synthesize"]

# Largest share of a batch's tokens one expert may be expected to receive; keeps logits finite.
_PI_MAX = 0.95
# The drift is drawn on knots every this many batches and interpolated in between.
_DRIFT_KNOT = 8
# Batches per chunk: bounds memory and sets how often ``progress`` is called.
_CHUNK_BATCHES = 64
# Token-level traces above this many expert picks (N * L * K) are refused: topk_ids alone would take GBs.
_MAX_TOKEN_LEVEL_PICKS = 1 << 30


@dataclass(kw_only=True, frozen=True, slots=True)
class RoutingProfile:
    """Knobs of the generative routing model (see the module docstring); defaults suit large MoE models.

    Inclusion probabilities (``pinned_hot``, ``high_hot_range``) are the fraction of a batch's tokens that
    pick an expert: an expert picked by a fraction ``p`` of the tokens has ``p * E / K`` times the mean load.
    """

    #: Fraction of layers that are high-skew (at least one layer when positive).
    high_skew_fraction: float = 0.15
    #: Fraction of layers that are balanced (at least one layer when positive); the rest are moderate.
    balanced_fraction: float = 0.2
    #: Inclusion probabilities of the two hottest experts of the most skewed layer.
    pinned_hot: tuple[float, float] = (0.93, 0.68)
    #: Range of the hottest expert's inclusion probability in the other high-skew layers.
    high_hot_range: tuple[float, float] = (0.4, 0.9)
    #: Peak/mean range of the warm expert of moderate layers.
    moderate_peak_range: tuple[float, float] = (3.0, 8.0)
    #: Log-normal sigma of the other experts' popularity in balanced layers.
    balanced_sigma: float = 0.3
    #: Log-normal sigma of the other experts' popularity in moderate and high-skew layers.
    skewed_sigma: float = 0.6
    #: ``C``: latent topics.
    num_topics: int = 16
    #: Logit boost of a topic's expert cluster.
    topic_strength: float = 2.0
    #: ``S``: latent route states.
    num_route_states: int = 8
    #: Logit boost of a route state's expert cluster.
    route_strength: float = 1.5
    #: Probability that the route state follows the layer's fixed permutation rather than resetting.
    route_persistence: float = 0.8
    #: Dirichlet concentration (per topic) of a rank's topic mixture; small means specialised ranks.
    gpu_topic_concentration: float = 0.5
    #: Dirichlet concentration (per topic) of a batch's new requests around their rank's home mixture.
    request_concentration: float = 2.0
    #: Fraction of a rank's topic mixture renewed each batch.
    request_turnover: float = 0.05
    #: Stationary standard deviation of the log-popularity drift.
    drift_sigma: float = 0.3
    #: Correlation time of the drift, in batches.
    drift_timescale: float = 400.0

    def __post_init__(self) -> None:
        for field in ("high_skew_fraction", "balanced_fraction", "route_persistence", "request_turnover"):
            value = getattr(self, field)
            if not 0.0 <= value <= 1.0:
                raise InputError(f"RoutingProfile.{field} ({value}) must lie in [0, 1]")
        if self.high_skew_fraction + self.balanced_fraction > 1.0:
            raise InputError(f"RoutingProfile.high_skew_fraction + balanced_fraction "
                             f"({self.high_skew_fraction + self.balanced_fraction}) must be at most 1")
        for field in ("pinned_hot", "high_hot_range"):
            lo_hi = getattr(self, field)
            if len(lo_hi) != 2 or not all(0.0 < v <= 0.93 for v in lo_hi):
                raise InputError(f"RoutingProfile.{field} ({lo_hi}) must be two probabilities in (0, 0.93]")
        if self.high_hot_range[0] > self.high_hot_range[1]:
            raise InputError(f"RoutingProfile.high_hot_range ({self.high_hot_range}) must be (low, high)")
        lo, hi = self.moderate_peak_range
        if not 1.0 <= lo <= hi:
            raise InputError(f"RoutingProfile.moderate_peak_range ({self.moderate_peak_range}) must be "
                             "(low, high) with 1 <= low <= high")
        for field in ("num_topics", "num_route_states"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise InputError(f"RoutingProfile.{field} ({value!r}) must be a positive integer")
        for field in ("balanced_sigma", "skewed_sigma", "topic_strength", "route_strength", "drift_sigma"):
            if getattr(self, field) < 0:
                raise InputError(f"RoutingProfile.{field} ({getattr(self, field)}) must be >= 0")
        for field in ("gpu_topic_concentration", "request_concentration", "drift_timescale"):
            if not getattr(self, field) > 0:
                raise InputError(f"RoutingProfile.{field} ({getattr(self, field)}) must be positive")


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


# Routing profiles are our modelling choices, not published per-model numbers (docs/synth.md says which
# published number each knob reproduces). Models trained with strong load balancing get fewer skewed layers.
PROFILES: dict[str, RoutingProfile] = {
    "deepseek-v3": RoutingProfile(),
    "deepseek-r1": RoutingProfile(),
    "kimi-k2": RoutingProfile(),
    "qwen3-235b-a22b": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
    "qwen3-30b-a3b": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
    "glm-4.5": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
    # MoETuner Fig. 4: in Mixtral's skewed layers two experts take ~64% of the load.
    # MoETuner Fig. 6: tokens of one expert in layer 14 go predominantly to one expert in layer 15.
    "mixtral-8x7b": RoutingProfile(high_skew_fraction=0.25, balanced_fraction=0.25, pinned_hot=(0.72, 0.56),
                                   high_hot_range=(0.45, 0.72), num_topics=8, num_route_states=4,
                                   route_strength=3.5, route_persistence=0.9),
    "olmoe-1b-7b": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.4),
    "deepseek-v2-lite": RoutingProfile(high_skew_fraction=0.1, balanced_fraction=0.3),
}




def routing_profile(model: ModelSpec) -> RoutingProfile:
    """The routing profile of ``model``: its entry in :data:`PROFILES`, else the defaults."""
    return PROFILES.get(model.name, RoutingProfile())


# ----- the structure drawn from the seed -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Structure:
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


def _water_fill(weights: np.ndarray, mass: np.ndarray, cap: float) -> np.ndarray:
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
    ranked = _water_fill(ranked, K - hot.sum(axis=1), _PI_MAX)
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


def _structure(preset: ModelSpec, profile: RoutingProfile, rng: np.random.Generator) -> _Structure:
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
    return _Structure(base=base, topic=topic, route=route, route_perm=route_perm, topic_pop=topic_pop,
                      incl_topic=incl_topic, drift_gain=drift_gain, mean_incl=mean_incl)


# ----- per-batch processes ---------------------------------------------------------------------------------

def _drift_knots(rng: np.random.Generator, num_batches: int, shape: tuple[int, int],
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


def _gpu_topic_mixtures(rng: np.random.Generator, num_batches: int, num_gpus: int,
                        structure: _Structure, profile: RoutingProfile) -> np.ndarray:
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


def _tokens_per_gpu(tokens_per_batch: int, num_gpus: int) -> np.ndarray:
    """``int64 [G]``: rank ``g`` holds the tokens ``i`` with ``i * G // T == g``."""
    ranks = np.arange(tokens_per_batch) * num_gpus // tokens_per_batch
    return np.bincount(ranks, minlength=num_gpus)


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
        x[over] = _water_fill(x[over], np.full(over.size, float(total)), float(tokens))
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


# ----- the generator ---------------------------------------------------------------------------------------

def _check_args(num_batches: object, tokens_per_batch: object, num_gpus: object, seed: object) -> None:
    for name, value in (("num_batches", num_batches), ("tokens_per_batch", tokens_per_batch),
                        ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise InputError(f"{name} ({value!r}) must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise InputError(f"seed ({seed!r}) must be an integer >= 0")


def synthesize(
    preset: str | ModelSpec,
    *,
    num_batches: int,
    tokens_per_batch: int,
    num_gpus: int,
    seed: int,
    token_level: bool = False,
    progress: Callable[[int], None] | None = None,
    profile: RoutingProfile | None = None,
) -> dict[str, np.ndarray]:
    """Generate a synthetic routing trace for ``preset``; the arrays of a trace ``.npz`` file.

    Args:
        preset: a name in :data:`moebalance.models.MODELS` or a :class:`~moebalance.models.ModelSpec`.
        num_batches: ``B``.
        tokens_per_batch: ``T``, tokens of one batch over all ``num_gpus`` data-parallel ranks.
        num_gpus: ``G``, data-parallel ranks; token ``i`` of a batch lives on rank ``i * G // T``.
        seed: seeds ``numpy.random.default_rng``; the per-layer skew and expert clusters depend only on the
            seed and the preset, not on ``B``, ``T``, ``G`` or ``token_level``.
        token_level: also simulate every token (slower; returns ``topk_ids``, ``src_gpu``, ``batch``).
        progress: called with the number of batches just finished, after every chunk of batches.
        profile: knobs of the routing model; defaults to :func:`routing_profile` of the preset.

    Returns:
        ``counts``: ``int64 [B, L, E]``, ``counts[b, l].sum() == T * K`` and ``counts <= T``;
        ``preset``: 0-d unicode array with the preset name; with ``token_level``: ``topk_ids [B*T, L, K]``
        (``int16`` when ``E < 32768``, else ``int32``; distinct within a token, best gate score first),
        ``src_gpu int32 [B*T]``, ``batch int32 [B*T]`` (non-decreasing), and ``counts`` equal to what
        ``topk_ids`` implies.

    Example: ``synthesize("mixtral-8x7b", num_batches=4, tokens_per_batch=256, num_gpus=8, seed=0)["counts"]``
    has shape ``(4, 32, 8)`` and every ``[b, l]`` row sums to 512.
    """
    model = get_model(preset) if isinstance(preset, str) else preset
    if not isinstance(model, ModelSpec):
        raise InputError(f"preset ({preset!r}) must be a model name or a ModelSpec; "
                         f"known models: {', '.join(sorted(MODELS))}")
    _check_args(num_batches, tokens_per_batch, num_gpus, seed)
    prof = routing_profile(model) if profile is None else profile
    if token_level:
        picks = num_batches * tokens_per_batch * model.num_layers * model.top_k
        if picks > _MAX_TOKEN_LEVEL_PICKS:
            raise InputError(f"a token-level trace of {num_batches} batches x {tokens_per_batch} tokens x "
                             f"{model.num_layers} layers x top-{model.top_k} has {picks:,} expert picks "
                             f"(limit {_MAX_TOKEN_LEVEL_PICKS:,}); use fewer batches or tokens per batch")
    struct_rng, batch_rng = np.random.default_rng(seed).spawn(2)
    structure = _structure(model, prof, struct_rng)
    knots = _drift_knots(batch_rng, num_batches, (model.num_layers, model.num_experts), prof)
    mixtures = _gpu_topic_mixtures(batch_rng, num_batches, num_gpus, structure, prof)
    args = (model, prof, structure, knots, mixtures, num_batches, tokens_per_batch, num_gpus, batch_rng, progress)
    out = _token_level(*args) if token_level else _count_level(*args)
    out["preset"] = np.array(model.name)
    return out


def _count_level(model: ModelSpec, prof: RoutingProfile, structure: _Structure, knots: np.ndarray,
                 mixtures: np.ndarray, num_batches: int, tokens: int, num_gpus: int, rng: np.random.Generator,
                 progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
    L, E, K = model.num_layers, model.num_experts, model.top_k
    counts = np.empty((num_batches, L, E), dtype=np.int64)
    per_gpu = _tokens_per_gpu(tokens, num_gpus)
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


def _token_level(model: ModelSpec, prof: RoutingProfile, structure: _Structure, knots: np.ndarray,
                 mixtures: np.ndarray, num_batches: int, tokens: int, num_gpus: int, rng: np.random.Generator,
                 progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
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
        if progress is not None:
            progress(nb)
    counts = count_picks(topk_ids, batch.astype(np.int64), num_batches, E)
    return {"counts": counts, "topk_ids": topk_ids, "src_gpu": src_gpu, "batch": batch}
