"""Replay traffic through a plan and score it (docs/design.md, "Metrics").

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs, ``T`` tokens, ``K`` top-k.

For each batch ``b`` and layer ``l`` the router turns the expert load ``W[b, l, :]`` into per-GPU load
``gpu_load[b, l, :]``. Under expert parallelism every layer waits for its most loaded GPU (the straggler
model, docs/papers/routing.md), so we report

- balancedness ``mean_g / max_g`` (CRAFT Section 3.1, vLLM's ``log_balancedness``; 1.0 is perfect),
- imbalance ratio ``max_g / mean_g`` (Libra),
- the gap of ``max_g`` to the lower bound ``max(total / G, max_e W_e / r_e)`` that no placement with these
  replica counts can beat,

each averaged over the ``(b, l)`` with non-zero load, plus per-layer means, and the routing gap: how much
the mean straggler load exceeds what the ``minmax`` router achieves on the same plan and batches (0 for a
router that splits optimally; :mod:`moebalance.routing.minmax`). For token-level traces we also
count the copies the all-to-all dispatch sends: a token goes once to each distinct GPU serving any of its
picks (GRACE, DeepEP); to its own GPU it is local, to another GPU of its node intra-node, else inter-node.

All-to-all time (GRACE Section 5.3 reports it next to traffic): per ``(b, l)``, dispatch sends every copy
once and combine sends it back, so each phase moves the same bytes. A GPU's intra-node copies go over its
NVLink/PCIe share (``Cluster.intra_node_bandwidth``) and its inter-node copies over its NIC
(``inter_node_bandwidth``), in parallel; a phase lasts as long as the busiest of those links, counting what
a GPU sends and what it receives separately (full duplex)::

    t_phase[b, l] = bytes_per_copy * max_g max(send_intra[g], recv_intra[g]) / bw_intra,
                                           max(send_inter[g], recv_inter[g]) / bw_inter)
    a2a[b, l] = 2 * t_phase[b, l]

No latency term and no node-level deduplication (``inter_node_dedup`` is reported separately): a
bandwidth lower bound that ranks plans the way traffic does. GRACE's two load metrics come from the same
replay: GPU idle time ``sum_g (max_g' load - load_g)`` (in tokens: the work the other GPUs could have done
while waiting for the straggler) and the standard deviation of GPU load, both per ``(b, l)``.

MoETuner's metrics (MoETuner Section 5.2) score a plan on its own traffic model, where a token moves
from the GPU of its expert in layer ``l`` straight to the GPU of its expert in layer ``l + 1``
(:func:`cross_layer_traffic`: GPU-pair tail and mean, tokens that change GPU) and on per-layer token
processing (:func:`processing_load`: the most loaded GPU's tokens and the mean).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.tally import release
from moebalance.routing import Router, get_router
from moebalance.routing.base import check_routes
from moebalance.routing.copies import Traffic, traffic
from moebalance.routing.minmax import least_max_load
from moebalance.routing.touched import hosted_touched, pick_tally, split_touched

#: Picks routed at once when a token-level trace is replayed (bounds the per-pick temporaries; 128 MB of GPU ids).
_CHUNK_PICKS = 1 << 24

__all__ = ["Replay", "Score", "evaluate", "gpu_loads", "layer_metrics", "replay_loads",
           "replay_picks", "traffic"]


def check_compatible(plan: Placement, load: LoadMatrix) -> None:
    """Raise if the plan and the load disagree on layers or experts."""
    if (plan.num_layers, plan.num_experts) != (load.num_layers, load.num_experts):
        raise PlanError(
            f"the plan has {plan.num_layers} layers x {plan.num_experts} experts but the load has "
            f"{load.num_layers} x {load.num_experts}; plan and score with the same model's data"
        )


def gpu_loads(plan: Placement, counts: np.ndarray, router: str | Router = "uniform",
              rng: np.random.Generator | None = None) -> np.ndarray:
    """``float64 [B, L, G]``: tokens each GPU serves, replaying ``counts [B, L, E]`` through ``plan``."""
    return get_router(router).split_counts(plan, counts, rng if rng is not None else np.random.default_rng(0))


@dataclass(frozen=True, slots=True)
class LayerMetrics:
    """Per-(batch, layer) metrics of one replay; all arrays ``float64 [B, L]``, nan where a layer had no load."""

    balancedness: np.ndarray
    imbalance: np.ndarray
    #: ``max_g gpu_load``: the straggler's tokens.
    max_load: np.ndarray
    #: ``max(total / G, max_e W_e / r_e)``.
    lower_bound: np.ndarray


def layer_metrics(gpu_load: np.ndarray, counts: np.ndarray, replicas: np.ndarray) -> LayerMetrics:
    """Metrics per ``(b, l)`` from ``gpu_load [B, L, G]``, ``counts [B, L, E]`` and ``replicas [L, E]``."""
    G = gpu_load.shape[2]
    total = gpu_load.sum(axis=2)
    peak = gpu_load.max(axis=2)
    mean = total / G
    active = peak > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        bal = np.where(active, mean / np.where(active, peak, 1.0), np.nan)
        imb = np.where(active, peak / np.where(active, mean, 1.0), np.nan)
    # max_e W_e / r_e, in chunks of batches so that no [B, L, E] float temporary is made at once
    inv_r = 1.0 / replicas
    per_replica = np.empty(total.shape, dtype=np.float64)
    for lo in range(0, counts.shape[0], 64):
        per_replica[lo:lo + 64] = (counts[lo:lo + 64] * inv_r).max(axis=2)
    bound = np.maximum(total / G, per_replica)
    return LayerMetrics(bal, imb, np.where(active, peak, np.nan), np.where(active, bound, np.nan))


def _nanmean(x: np.ndarray, axis: int | None = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan slices (layers that never have load) -> nan
        return np.nanmean(x, axis=axis)


@dataclass(frozen=True, slots=True)
class Score:
    """How well a plan balances a load (docs/design.md, "Metrics"). Means are over ``(b, l)`` with non-zero load."""

    balancedness: float
    imbalance_ratio: float
    #: Mean of ``max_load / lower_bound - 1``; 0 means no plan with these replica counts does better.
    lower_bound_gap: float
    #: ``float64 [L]`` mean balancedness per layer (nan for a layer that never has load).
    per_layer_balancedness: np.ndarray
    #: ``float64 [L]`` mean imbalance ratio per layer.
    per_layer_imbalance: np.ndarray
    #: Mean straggler load in tokens, over ``(b, l)``.
    mean_max_load: float
    #: GRACE's GPU idle time in tokens: mean over ``(b, l)`` of ``sum_g (max load - load_g)``.
    gpu_idle: float
    #: GRACE's load deviation: mean over ``(b, l)`` of the standard deviation of GPU load, in tokens.
    load_std: float
    extra_replicas: int
    max_slots_per_gpu: int
    num_batches: int
    router: str
    traffic: Traffic | None = None
    bytes_per_copy: float | None = None
    #: ``mean_max_load / (minmax's mean max load) - 1`` on the same plan and batches, at the granularity of
    #: this router's loads (whole tokens when they come from assigned picks, else fractions); ``None`` if not
    #: computed.
    routing_gap: float | None = None
    #: The router's options (``--router-set``), empty for a router without options.
    router_params: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The ``evaluate --json`` object (docs/design.md, "Metrics")."""
        def clean(x: np.ndarray) -> list[float | None]:
            return [None if np.isnan(v) else round(float(v), 6) for v in x]

        out: dict[str, Any] = {
            "balancedness": round(self.balancedness, 6),
            "imbalance_ratio": round(self.imbalance_ratio, 6),
            "lower_bound_gap": round(self.lower_bound_gap, 6),
            "per_layer_balancedness": clean(self.per_layer_balancedness),
            "per_layer_imbalance_ratio": clean(self.per_layer_imbalance),
            "mean_max_load": round(self.mean_max_load, 3),
            "gpu_idle_tokens": round(self.gpu_idle, 3),
            "load_std": round(self.load_std, 3),
            "extra_replicas": self.extra_replicas,
            "max_slots_per_gpu": self.max_slots_per_gpu,
            "num_batches": self.num_batches,
            "router": self.router,
        }
        if self.router_params:
            out["router_params"] = dict(self.router_params)
        if self.routing_gap is not None:
            out["routing_gap"] = round(self.routing_gap, 6)
        if self.traffic is not None:
            out["traffic"] = self.traffic.as_dict(self.bytes_per_copy)
            out["traffic_matrix"] = self.traffic.matrix.tolist()
        return out


@dataclass(frozen=True, slots=True)
class Replay:
    """A load replayed through a plan with a router (:func:`replay_picks`)."""

    #: ``float64 [B, L, G]``: picks each GPU serves.
    loads: np.ndarray
    #: ``float64 [B, L, G]``: distinct experts those picks touch (:mod:`moebalance.routing.touched`), if asked.
    touched: np.ndarray | None
    traffic: Traffic | None
    #: Whether ``loads`` count whole picks (assigned ones) rather than a fractional split.
    whole_tokens: bool


def replay_picks(plan: Placement, load: LoadMatrix, router: Router, rng: np.random.Generator, *,
                 with_touched: bool = False, with_traffic: bool = False, bytes_per_copy: float | None = None,
                 kernel: str = "per-gpu", on_batches: Callable[[int], None] | None = None,
                 seconds_only: bool = False) -> Replay:
    """``load`` replayed through ``plan``: each GPU's picks, with ``with_touched`` the experts they touch.

    A token-level load is routed per token (each pick's GPU, checked against the plan); the loads then count
    whole picks, except for ``uniform``, whose loads stay its exact fractional split (``whole_tokens``
    False). With ``with_traffic`` the same picks are counted as all-to-all copies (:func:`traffic`; with
    ``seconds_only``, timed only). Experts touched come from the picks where loads count them, else from the
    counts (:func:`moebalance.routing.touched.split_touched`).

    The trace is routed a few batches at a time (:meth:`RoutingTrace.batch_chunks`), so the per-pick
    temporaries (``int64`` GPUs) are bounded by a chunk whatever the trace's length; a trace of up to 16M
    picks is one chunk. The ``random`` family draws its picks chunk after chunk from the one ``rng``. ``on_batches``
    is called with the number of batches after each chunk (a progress bar's advance).
    """
    trace = load.trace
    if trace is None:
        if with_touched:
            return Replay(*split_touched(router, plan, load.counts, rng), None, False)
        return Replay(router.split_counts(plan, load.counts, rng), None, None, False)
    trace.check_gpus(plan.num_gpus)
    whole_tokens = router.name != "uniform"
    B, L, G = load.num_batches, load.num_layers, plan.num_gpus
    loads = np.zeros((B, L, G)) if whole_tokens else None
    touched = np.zeros((B, L, G)) if whole_tokens and with_touched else None
    parts = []
    for start, stop in trace.batch_chunks(_CHUNK_PICKS):
        sub = trace.select_batches(start, stop)
        dest = router.assign_tokens(plan, sub, rng)
        for layer in range(plan.num_layers):  # a custom router's answer is checked before it is counted
            check_routes(dest[:, layer, :], sub.topk_ids[:, layer, :], plan.copies[layer], router.name)
        if loads is not None:
            picks, reached = pick_tally(dest, sub.topk_ids if touched is not None else None, sub.batch,
                                        stop - start, plan.num_experts, G)
            loads[start:stop] = picks
            if touched is not None and reached is not None:
                touched[start:stop] = reached
        if with_traffic:
            parts.append(traffic(plan, sub, dest, bytes_per_copy, kernel=kernel,
                                 seconds_only=seconds_only))
        if on_batches is not None:
            on_batches(stop - start)
        release(sub.topk_ids)  # a memory-mapped trace's pages go back once the chunk is counted
    if loads is None:  # uniform: its fractional split, which gives every copy of a loaded expert a share
        loads = router.split_counts(plan, load.counts, rng)
        touched = hosted_touched(plan, load.counts) if with_touched else None
    return Replay(loads, touched, Traffic.total(parts) if with_traffic else None, whole_tokens)


def replay_loads(plan: Placement, load: LoadMatrix, router: Router, rng: np.random.Generator, *,
                 with_traffic: bool = False, bytes_per_copy: float | None = None, kernel: str = "per-gpu",
                 on_batches: Callable[[int], None] | None = None,
                 seconds_only: bool = False) -> tuple[np.ndarray, Traffic | None, bool]:
    """``(gpu_load [B, L, G], traffic or None, whole_tokens)``: :func:`replay_picks` without experts touched."""
    r = replay_picks(plan, load, router, rng, with_traffic=with_traffic, bytes_per_copy=bytes_per_copy,
                     kernel=kernel, on_batches=on_batches, seconds_only=seconds_only)
    return r.loads, r.traffic, r.whole_tokens


def evaluate(plan: Placement, load: LoadMatrix, router: str | Router = "uniform", *, seed: int = 0,
             bytes_per_copy: float | None = None, routing_gap: bool = False, kernel: str = "per-gpu",
             on_batches: Callable[[int], None] | None = None) -> Score:
    """Replay ``load`` through ``plan`` with ``router`` and score it.

    For a token-level load the routers are applied per token (so GPU loads and traffic come from the same
    picks); ``uniform`` keeps its exact fractional split for loads and uses its round-robin token
    realisation for traffic. ``routing_gap=True`` also measures the router against the ``minmax`` bound: one
    small flow problem per batch and layer, a cost of the order of the replay itself
    (``bench/bench_replay.py`` times both). ``kernel`` says how the all-to-all's copies travel when timed
    (:func:`traffic`).
    """
    check_compatible(plan, load)
    r = get_router(router)
    loads, moved, whole_tokens = replay_loads(plan, load, r, np.random.default_rng(seed), with_traffic=True,
                                              bytes_per_copy=bytes_per_copy, kernel=kernel,
                                              on_batches=on_batches)
    m = layer_metrics(loads, load.counts, plan.replica_counts())
    if not np.any(np.isfinite(m.balancedness)):
        raise InputError("the load is zero in every batch and layer; there is nothing to score")
    gap = m.max_load / m.lower_bound - 1.0
    active = np.isfinite(m.balancedness)
    idle = (loads.max(axis=2, keepdims=True) - loads).sum(axis=2)[active]
    std = loads.std(axis=2)[active]
    gap_to_minmax = None
    if routing_gap:
        best = least_max_load(plan, load.counts, integral=whole_tokens)
        gap_to_minmax = float(np.mean(m.max_load[active]) / np.mean(best[active]) - 1.0)
    return Score(
        balancedness=float(_nanmean(m.balancedness)),
        imbalance_ratio=float(_nanmean(m.imbalance)),
        lower_bound_gap=float(_nanmean(gap)),
        per_layer_balancedness=_nanmean(m.balancedness, axis=0),
        per_layer_imbalance=_nanmean(m.imbalance, axis=0),
        mean_max_load=float(_nanmean(m.max_load)),
        gpu_idle=float(idle.mean()),
        load_std=float(std.mean()),
        extra_replicas=plan.extra_replicas,
        max_slots_per_gpu=plan.max_slots_per_gpu,
        num_batches=load.num_batches,
        router=r.name,
        traffic=moved,
        bytes_per_copy=bytes_per_copy,
        routing_gap=gap_to_minmax,
        router_params=r.params,
    )
