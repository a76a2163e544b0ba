"""Speed of the routers: every router side by side on DeepSeek-V3-like decode batches, then the load-aware kernels,
Libra's rebalancer (``rebalance``) and the exact min-max split (``minmax``), against their baselines.

Side by side: each router as a command calls it (``split_counts`` on counts, ``assign_tokens`` on tokens), on the
same held-out decode batches of a synthetic DeepSeek-V3 trace (64 GPUs x 256 experts, 8 and 32 tokens per GPU,
EPLB plans with 64 and 256 redundant experts made on other batches), per (batch, layer); ``metro`` prices on
DeepSeek-V3 on H100s in bf16 at the published peaks. Target: ``metro`` at most 1.5x ``rebalance`` on counts
and 5x on tokens.

Targets: ``rebalance`` on one layer's counts for 8 GPUs x 128 experts (Libra's Qwen3 setting) under 50 us and
for 64 GPUs x 256 experts under 500 us; exact ``minmax`` on 64 x 256 counts under 5 ms per layer; token-level
``minmax`` for 16,384 tokens x top-8 on 8 GPUs under 20 ms per layer.

Baselines in the same run: the ``uniform`` router on the same counts (what ``rebalance`` replaces) and, for
``minmax``, SciPy's HiGHS solving the same problem as a linear program (the min-max LP on counts; on tokens the
min-cost transportation LP with GPU capacities ``ceil(t*)``, whose optimum HiGHS finds at a vertex, integral).

Per layer means per (batch, layer) problem: "batched" runs every problem of the trace in one compiled call
and divides; "one call" calls the router's kernel from Python for one (batch, layer), dispatch included.
Prints tables and writes docs/results/bench_routing.md. Run: .venv/bin/python bench/bench_routing.py
"""

from __future__ import annotations

import functools

import numpy as np
from _common import ROOT, machine, median_seconds
from scipy.optimize import linprog

from moebalance.algorithms import minmax as mm
from moebalance.algorithms import rebalance as rb
from moebalance.algorithms.split import apply_shares
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix, read_load
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.policies import Budget, make_plan
from moebalance.routing import get_router
from moebalance.routing.base import Router
from moebalance.routing.basic import share_matrix
from moebalance.routing.metro import with_deployment
from moebalance.workloads.synth import synthesize


def _lp_minmax(W: np.ndarray, has: np.ndarray) -> float:
    """min t s.t. every expert's tokens are split over its GPUs and no GPU carries more than t (HiGHS)."""
    E, G = has.shape
    e_idx, g_idx = np.nonzero(has)
    n = e_idx.size
    c = np.zeros(n + 1)
    c[-1] = 1.0
    a_eq = np.zeros((E, n + 1))
    a_eq[e_idx, np.arange(n)] = 1.0
    a_ub = np.zeros((G, n + 1))
    a_ub[g_idx, np.arange(n)] = 1.0
    a_ub[:, -1] = -1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=W.astype(float), method="highs")
    return float(res.fun)


def _lp_tokens(ids: np.ndarray, src: np.ndarray, has: np.ndarray, gpn: int, cap: float) -> float:
    """The token-level problem as HiGHS sees it: picks of (source GPU, expert) classes to GPUs at cost 0 / 1 / 2,
    every GPU at most ``cap``; returns the least cost."""
    E, G = has.shape
    key = src[:, None] * E + ids
    cls, count = np.unique(key.ravel(), return_counts=True)
    rows = []
    for c_i, c in enumerate(cls):
        s, e = divmod(int(c), E)
        for g in np.flatnonzero(has[e]):
            rows.append((c_i, int(g), 0 if g == s else (1 if g // gpn == s // gpn else 2)))
    arr = np.array(rows)
    n = arr.shape[0]
    a_eq = np.zeros((cls.size, n))
    a_eq[arr[:, 0], np.arange(n)] = 1.0
    a_ub = np.zeros((G, n))
    a_ub[arr[:, 1], np.arange(n)] = 1.0
    res = linprog(arr[:, 2].astype(float), A_ub=a_ub, b_ub=np.full(G, cap), A_eq=a_eq, b_eq=count.astype(float),
                  method="highs")
    return float(res.fun)


def _per(seconds: float, n: int) -> str:
    us = seconds / n * 1e6
    return f"{us:,.1f} us" if us < 1000 else f"{us / 1000:,.2f} ms"


def _counts_rows(label: str, load: LoadMatrix, cluster: Cluster, budget: Budget,
                 params: dict[str, int]) -> list[tuple[str, str, str, str, str]]:
    """Count-level timings of one setting: rebalance against uniform, minmax against HiGHS."""
    train, test = load.split(0.5)
    plan, _ = make_plan("eplb", train, cluster, budget, **params)
    counts = np.ascontiguousarray(test.counts, dtype=np.int64)
    B, L, _ = counts.shape
    n = B * L
    copies, has = plan.copies, plan.copies > 0
    shares = share_matrix(plan)
    uniform = median_seconds(lambda: apply_shares(counts, shares), 5)
    reb = median_seconds(lambda: rb.split_counts(counts, copies, 0.0, False), 5)
    reb_strict = median_seconds(lambda: rb.split_counts(counts, copies, 0.0, True), 5)
    b1, l1 = B // 2, L // 2
    one = median_seconds(lambda: rb.split_counts(counts[b1:b1 + 1, l1:l1 + 1], copies[l1:l1 + 1], 0.0, False), 50)
    lex = median_seconds(lambda: mm.split_counts(counts, has), 3)
    value = median_seconds(lambda: mm.max_loads(counts, has, False), 3)
    sample = [(b, layer) for b in range(0, B, max(1, B // 4)) for layer in range(0, L, max(1, L // 6))]
    lp = median_seconds(lambda: [_lp_minmax(counts[b, layer], has[layer]) for b, layer in sample], 3) / len(sample)
    for b, layer in sample:  # the bound is exact: the LP's optimum, to solver tolerance
        want = _lp_minmax(counts[b, layer], has[layer])
        got = mm.max_loads(counts[b:b + 1, layer:layer + 1], has[layer:layer + 1], False)[0, 0]
        assert abs(got - want) <= 1e-6 * max(1.0, want), (label, b, layer, got, want)
    return [
        (label, "rebalance (eps=0), batched", _per(reb, n), f"uniform {_per(uniform, n)}", f"{reb / uniform:.1f}x"),
        (label, "rebalance (strict=true), batched", _per(reb_strict, n), f"uniform {_per(uniform, n)}",
         f"{reb_strict / uniform:.1f}x"),
        (label, "rebalance, one call from Python", _per(one, 1), "", ""),
        (label, "minmax split (lexicographic), batched", _per(lex, n), f"HiGHS LP {_per(lp, 1)}",
         f"{lp / (lex / n):.0f}x faster"),
        (label, "minmax bound t* only (routing gap), batched", _per(value, n), f"HiGHS LP {_per(lp, 1)}",
         f"{lp / (value / n):.0f}x faster"),
    ]


def _token_rows(tokens: LoadMatrix, nodes: int, gpn: int) -> list[tuple[str, str, str, str, str]]:
    """Token-level timings: the whole trace as one batch per layer, minmax against HiGHS, rebalance."""
    tr = tokens.trace
    assert tr is not None
    T, L, K = tr.topk_ids.shape
    cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn)
    plan, _ = make_plan("eplb", tokens, cluster, Budget(slots_per_gpu=18), num_groups=1)
    has = plan.copies > 0
    starts = np.array([0, T], dtype=np.int64)
    kept = np.ones((T, K), dtype=bool)
    ids = [np.ascontiguousarray(tr.topk_ids[:, layer, :], dtype=np.int64) for layer in range(L)]  # as the routers pass them
    src = tr.src_gpu
    sec = median_seconds(lambda: [mm.route_tokens(ids[layer], src, starts, has[layer], gpn, kept)
                                  for layer in range(L)], 3) / L
    reb = median_seconds(lambda: [rb.route_tokens(ids[layer], src, starts, plan.copies[layer], gpn, 0.0, False, kept)
                                  for layer in range(L)], 3) / L
    sample = list(range(0, L, 8))
    caps = [float(mm.max_loads(np.bincount(ids[layer].ravel(), minlength=tr.num_experts)[None, None],
                               has[layer:layer + 1], True)[0, 0]) for layer in sample]
    pairs = list(zip(sample, caps, strict=True))
    lp = median_seconds(lambda: [_lp_tokens(ids[layer], src, has[layer], gpn, cap) for layer, cap in pairs],
                        3) / len(sample)
    for layer, cap in pairs:  # the same least traffic cost as HiGHS, at the least possible straggler
        dest = mm.route_tokens(ids[layer], src, starts, has[layer], gpn, kept)
        assert np.bincount(dest.ravel(), minlength=cluster.num_gpus).max() == cap
        own = np.broadcast_to(src[:, None], dest.shape)
        cost = int(np.sum(np.where(dest == own, 0, np.where(dest // gpn == own // gpn, 1, 2))))
        assert abs(cost - _lp_tokens(ids[layer], src, has[layer], gpn, cap)) < 0.5, (layer, cost)
    label = f"Qwen3-30B-A3B-like tokens, {T:,} x top-{K}, {nodes} x {gpn} GPUs, EPLB 18 slots/GPU"
    return [(label, "minmax on tokens (least traffic at ceil(t*))", _per(sec, 1), f"HiGHS LP {_per(lp, 1)}",
             f"{lp / sec:.0f}x faster"),
            (label, "rebalance on tokens (eps=0)", _per(reb, 1), "", "")]


SIDE_BY_SIDE = ["uniform", "random", "rebalance", "minmax", "metro"]
PRICED = Deployment(model=get_model("deepseek-v3"), gpu=get_gpu("h100-80gb"), precision="bf16")


def _route(router: Router, plan: Placement, what: np.ndarray | RoutingTrace) -> np.ndarray:
    """The router as a command calls it: ``split_counts`` on counts, ``assign_tokens`` on a trace."""
    if isinstance(what, RoutingTrace):
        return router.assign_tokens(plan, what, np.random.default_rng(0))
    return router.split_counts(plan, what, np.random.default_rng(0))


def _side_by_side() -> list[str]:
    """Rows ``| setting | input | router times ... | metro / rebalance |`` of every router on the same decode batches."""
    rows = []
    cluster = Cluster(num_nodes=8, gpus_per_node=8)
    routers = {name: with_deployment(get_router(name), PRICED) for name in SIDE_BY_SIDE}
    for per_gpu in (8, 32):
        arrays = synthesize("deepseek-v3", num_batches=12, tokens_per_batch=per_gpu * 64, num_gpus=64, seed=per_gpu,
                            token_level=True)
        full = LoadMatrix.from_arrays(arrays, source="synth")
        held = full.select_batches(8, 12)
        counts = np.ascontiguousarray(held.counts, dtype=np.int64)
        tr = held.trace
        assert tr is not None
        B, L, _ = counts.shape
        for slots in (5, 8):
            plan = make_plan("eplb", full.select_batches(0, 8), cluster, Budget(slots_per_gpu=slots))[0]
            label = f"{per_gpu} tokens per GPU, EPLB {slots * 64 - 256} redundant"
            for what, reps in (("counts", 5), ("tokens", 3)):
                sec = {name: median_seconds(functools.partial(_route, routers[name], plan, counts if what == "counts"
                                                              else tr), reps) / (B * L) for name in SIDE_BY_SIDE}
                cells = " | ".join(_per(sec[name], 1) for name in SIDE_BY_SIDE)
                rows.append(f"| {label} | {what} | {cells} | {sec['metro'] / sec['rebalance']:.1f}x |")
    return rows


def main() -> None:
    side = _side_by_side()
    rows: list[tuple[str, str, str, str, str]] = []  # setting, what, per layer, baseline, ratio
    # counts: Libra's Qwen3 setting (synthetic Qwen3-235B-A22B, 128 experts, top-8) on 8 GPUs of one node, and
    # DeepSeek-V3 on 8 x 8 GPUs
    qwen = LoadMatrix.from_arrays(synthesize("qwen3-235b-a22b", num_batches=16, tokens_per_batch=16384, num_gpus=8,
                                             seed=0), source="synth")
    deepseek = read_load("bundled:deepseek-v3-8x8")
    rows += _counts_rows("Qwen3-235B-like, 8 GPUs x 128 experts, EPLB 18 slots/GPU", qwen,
                         Cluster(num_nodes=1, gpus_per_node=8), Budget(slots_per_gpu=18), {"num_groups": 1})
    rows += _counts_rows("DeepSeek-V3-like, 64 GPUs x 256 experts, EPLB hierarchical 5 slots/GPU", deepseek,
                         Cluster(num_nodes=8, gpus_per_node=8), Budget(slots_per_gpu=5), {})
    rows += _counts_rows("DeepSeek-V3-like, 64 GPUs x 256 experts, EPLB global 5 slots/GPU", deepseek,
                         Cluster(num_nodes=8, gpus_per_node=8), Budget(slots_per_gpu=5), {"num_groups": 1})
    # tokens: the bundled Qwen3-30B-A3B-like trace as one batch of 16,384 tokens x top-8 on 8 GPUs
    tokens = read_load("bundled:qwen3-30b-a3b-tokens")
    for nodes, gpn in ((1, 8), (2, 4)):
        rows += _token_rows(tokens, nodes, gpn)

    lines = [
        "# Router speed",
        "",
        f"Machine: {machine()}.",
        "Command: `.venv/bin/python bench/bench_routing.py` (median of repeated runs after a warm-up call).",
        "",
        "## Every router on the same decode batches",
        "",
        "DeepSeek-V3-like, 64 GPUs x 256 experts, 4 held-out batches x 58 layers; EPLB plans made on 8 other",
        "batches. Per (batch, layer), each router as a command calls it (counts: `split_counts`; tokens:",
        "`assign_tokens`), Python included; `metro` prices on DeepSeek-V3 on H100s in bf16 (published peaks)",
        "and, per (batch, layer), also computes `uniform`'s and `rebalance`'s answers to keep the fastest.",
        "",
        "| setting | input | " + " | ".join(SIDE_BY_SIDE) + " | metro / rebalance |",
        "|---|---|" + "---|" * len(SIDE_BY_SIDE) + "---|",
        *side,
        "",
        "## The load-aware kernels against their baselines",
        "",
        "Counts: held-out half of each trace, plans made on the other half; tokens: the whole trace as one batch per",
        "layer, plan made on it. Per layer = per (batch, layer) problem: batched runs every problem in one compiled call;",
        "one call includes Python's call into numba.",
        "The minmax bound was checked against the HiGHS LP on the sampled layers, and the token split's traffic",
        "cost against HiGHS's optimum, in this run.",
        "",
        "| setting | what | per layer | baseline per layer | ratio |",
        "|---|---|---|---|---|",
        *[f"| {s} | {w} | {t} | {b} | {r} |" for s, w, t, b, r in rows],
        "",
        "Targets: rebalance under 50 us (8 x 128) and 500 us (64 x 256) per layer; minmax under 5 ms (64 x 256",
        "counts) and 20 ms (16,384 tokens x top-8 on 8 GPUs) per layer; metro at most 1.5x rebalance on counts and",
        "5x on tokens (first table).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "docs" / "results" / "bench_routing.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
