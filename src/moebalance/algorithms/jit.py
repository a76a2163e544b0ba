"""Compiled kernels: a warm-up that compiles every numba kernel once, into numba's cache.

DeepSeek's EPLB (its packing and replication loops), the load-aware routers (``rebalance``, ``minmax``, ``metro``),
Libra's prefetcher and the exact per-layer planner (``moebalance.algorithms.exact``), and the trace counters
(``moebalance.core.tally``: every token-level load is checked and counted by them) run numba kernels
(``@njit(cache=True)``). The first call of a kernel in a fresh install compiles it, which takes seconds; later
processes load the compiled code from numba's cache (``__pycache__`` beside the sources, or a user-wide folder
where that is read-only). Calling :func:`warm_up` once after installing -- ``make install`` does, ``python -m
moebalance.algorithms.jit`` by hand -- moves that cost out of the first evaluation and out of every rank of a
multi-process run, which would otherwise each compile the same code at once. It compiles the signatures the routers
use: C-contiguous ``int64`` loads and ids, ``bool`` copy masks, ``int64`` copy counts; the prefetcher's on
``float64`` demand (predictions) and the exact planner's on ``int64`` counts; and the counters' for ``int16`` and
``int32`` expert ids (the two compact types a trace holds), with the uniform router's round-robin. """

from __future__ import annotations

import time

import numpy as np

from moebalance.algorithms import eplb, exact, metro, minmax, prefetch, rebalance, split
from moebalance.core import tally

__all__ = ["warm_up"]


def warm_up() -> float:
    """Compile (or load from the cache) every router kernel on a tiny input; returns the seconds it took."""
    t0 = time.perf_counter()
    copies = np.array([[[1, 1], [0, 1], [1, 0]]], dtype=np.int64)  # [L=1, E=3, G=2], expert 0 on both GPUs
    has = copies > 0
    counts = np.array([[[3, 1, 2]]], dtype=np.int64)  # [B=1, L=1, E=3]
    ids = np.array([[0], [1], [0], [2]], dtype=np.int64)  # [T=4, K=1]
    src = np.array([0, 0, 1, 1], dtype=np.int64)
    starts = np.array([0, 4], dtype=np.int64)
    kept = np.ones(ids.shape, dtype=bool)
    minmax.split_counts(counts, has)
    minmax.max_loads(counts, has, False)
    minmax.route_tokens(ids, src, starts, np.ascontiguousarray(has[0]), 1, kept)
    rebalance.split_counts(counts, copies, 0.0, False)
    rebalance.route_tokens(ids, src, starts, np.ascontiguousarray(copies[0]), 1, 0.0, False, kept)
    demand = np.array([[1, 1, 0], [1, 0, 1]], dtype=np.int64)  # [G=2, E=3]: the picks of ids by src
    prefetch.prefetch(demand.astype(np.float64), has[0].T, 1, 1.0)
    layer = exact.plan_layer(demand, exact.base_layer(copies[0]), 1, 1.0)
    exact.assign(layer, copies[0], ids, src, kept, 1)
    cost = np.array([1e-9, 1e-6, 1e-10, 0.0, 1e-10])  # metro's roofline terms (any positive values compile it)
    metro.split_counts(counts, has, cost)
    weight = np.array([[4.0, 1.0, 2.0, 3.0]], dtype=np.float32)  # EPLB's packing and replication loops
    eplb.rebalance_experts(weight, 6, 2, 2, 2)  # hierarchical
    eplb.rebalance_experts(weight, 6, 1, 1, 2)  # global
    metro.route_tokens(ids, src, starts, np.ascontiguousarray(has[0]), 1, kept, cost)
    variants = []
    for dtype in (tally.id_dtype(3), tally.id_dtype(1 << 15)):  # int16 ids, then int32
        picks = ids[:, :, None].astype(dtype)  # [T=4, L=1, K=1], E = 3
        frozen = picks.copy()
        frozen.setflags(write=False)  # memory-mapped traces are read-only: numba types them apart
        variants += [picks, frozen]
    for picks in variants:
        tally.check_picks(picks, 3)
        tally.count_picks(picks, np.zeros(4, dtype=np.int64), 1, 3)
        tally.pair_counts(picks, 3)
        tally.transition_counts(picks, 3)
        tally.demand_counts(picks, src, 2, 3)
        tally.distinct_served(np.zeros(picks.shape, dtype=np.int64), picks, np.zeros(4, dtype=np.int64), 1, 3, 2)
        split.round_robin_gpus(picks, np.zeros(4, dtype=np.int64), np.array([[[0, 1], [0, -1], [1, -1]]], dtype=np.int64),
                               np.array([[2, 1, 1]], dtype=np.int64))
    tally.top_k(np.ones((2, 3)), 2)  # the path predictor's ranking
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"numba kernels compiled or loaded from numba's cache in {warm_up():.1f} s")
