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
  knots every 8 batches and interpolated linearly. Plans made on early batches are good but not
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

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.limits import MAX_TOKENS, check_alloc
from moebalance.models import MODELS, ModelSpec, get_model
from moebalance.workloads.batches import (
    drift_knots,
    gpu_topic_mixtures,
    sample_count_level,
    sample_token_level,
)
from moebalance.workloads.profiles import PROFILES, RoutingProfile, routing_profile
from moebalance.workloads.structure import build_structure

__all__ = ["PROFILES", "RoutingProfile", "routing_profile", "synthesize"]

# Token-level traces above this many expert picks (N * L * K) are refused: topk_ids alone would take GBs.
_MAX_TOKEN_LEVEL_PICKS = 1 << 30
# Picks of one batch (T * K): the count sampler rounds float64 cumulative sums, exact below this.
_MAX_BATCH_PICKS = 2**53


def _check_args(num_batches: object, tokens_per_batch: object, num_gpus: object, seed: object) -> None:
    for name, value in (("num_batches", num_batches), ("tokens_per_batch", tokens_per_batch),
                        ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise InputError(f"{name} ({value!r}) must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise InputError(f"seed ({seed!r}) must be an integer >= 0")


def _check_sizes(model: ModelSpec, prof: RoutingProfile, num_batches: int, tokens: int, num_gpus: int) -> None:
    """Refuse, before drawing anything, a trace that could not be read back as a load or whose arrays cannot fit
    in memory (Python ints: no product wraps)."""
    L, E, K, B, T, G = model.num_layers, model.num_experts, model.top_k, num_batches, tokens, num_gpus
    if T * K >= _MAX_BATCH_PICKS:
        raise InputError(f"tokens_per_batch {T:,} x top-{K} is {T * K:,} picks per batch; the count sampler is exact "
                         "below 2**53 (float64); use fewer tokens per batch")
    if B * T * L * K >= MAX_TOKENS:
        raise InputError(f"{B:,} batches x {T:,} tokens x {L} layers x top-{K} are {B * T * L * K:,} picks; a load "
                         "holds fewer than 2**62 (int64 sums); use fewer batches or tokens per batch")
    check_alloc((B, L, E), 8, "counts [B, L, E]", "use fewer batches")
    check_alloc((B, G, prof.num_topics), 32, "the per-rank topic mixtures [B, G, C] (four float64 working copies)",
                "use fewer batches or GPUs")
    check_alloc((L, prof.num_topics, prof.num_route_states, E), 8, "the routing model's logits [L, C, S, E]",
                "use fewer topics or route states in the RoutingProfile")


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
        progress: called with the number of batches just finished, after every chunk of batches; with
            ``token_level``, as each layer of a chunk finishes, with its share of the chunk's batches (whole
            batches, none reported twice: the calls add up to ``num_batches``).
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
    num_batches, tokens_per_batch, num_gpus = int(num_batches), int(tokens_per_batch), int(num_gpus)  # no wrap
    prof = routing_profile(model) if profile is None else profile
    if token_level:
        picks = num_batches * tokens_per_batch * model.num_layers * model.top_k
        if picks > _MAX_TOKEN_LEVEL_PICKS:
            raise InputError(f"a token-level trace of {num_batches} batches x {tokens_per_batch} tokens x "
                             f"{model.num_layers} layers x top-{model.top_k} has {picks:,} expert picks "
                             f"(limit {_MAX_TOKEN_LEVEL_PICKS:,}); use fewer batches or tokens per batch")
    _check_sizes(model, prof, num_batches, tokens_per_batch, num_gpus)
    struct_rng, batch_rng = np.random.default_rng(seed).spawn(2)
    structure = build_structure(model, prof, struct_rng)
    knots = drift_knots(batch_rng, num_batches, (model.num_layers, model.num_experts), prof)
    mixtures = gpu_topic_mixtures(batch_rng, num_batches, num_gpus, structure, prof)
    args = (model, prof, structure, knots, mixtures, num_batches, tokens_per_batch, num_gpus, batch_rng, progress)
    out = sample_token_level(*args) if token_level else sample_count_level(*args)
    out["preset"] = np.array(model.name)
    return out
