"""What balancing costs in time: ``online --gpu`` on DeepSeek's ESFT routing, every policy priced as forward steps.

The real routing of DeepSeek-V2-Lite (ESFT's ``law`` and ``translation`` tasks, 26 MoE layers of 64 experts, top-6;
the source is in docs/results/online_time.md and ../shared/real-traces/README.md) on one node of 8 H100s (preset
``h100-80gb``) joined by NVLink 4 (the default intra-node link, 450 GB/s per GPU and direction), priced with the
``deepseek-v2-lite`` preset (:mod:`moebalance.pricing.step`).

Each task's sequences in order; the first 40% are its build split (the warm-up and the path predictor's table),
the rest its evaluation split (the served batches). Two workloads:

- **domain-pure**: each split's tokens concatenated and cut into 512-token batches, one task per batch; the
  evaluation batches of both tasks served in a seeded random order (the workload shifts from batch to batch);
- **mixed**: the sequences of both tasks shuffled together (seeded) before they are cut, so a batch holds both.

At 8,192 tokens per batch a batch joins 16 of the 512-token batches above, drawn with replacement from the same
pool (one task's batches for domain-pure, all for mixed): the evaluation splits hold about 10 batches of 512 tokens
per task, too few for distinct 8,192-token batches, so these batches reuse tokens, and say how skew shrinks as a
batch grows, not how a predictor generalises. A batch's tokens are dealt to the 8 ranks in contiguous blocks.

Policies: static EPLB planned on the warm-up with one extra slot per GPU and layer; periodic EPLB re-planned every
``K`` served batches on the last ``W`` (sync and async rearrangement), each re-plan laid onto the plan in service
``fresh`` (as planned), ``aligned`` (the fresh plan's per-GPU sets given to the GPUs that keep the most in place) or
``bounded`` (at most ``MAX_MOVES`` copies into each GPU per re-plan; docs/design.md, "Priced in time"); Libra (path
predictor and the batch's true routing, ``n`` = 2, 4, 8 extra experts per GPU and layer); contiguous homes (no
replicas, no balancing) as the floor.
Each with the uniform router and with ``rebalance`` (load-aware sharding of a replicated expert's tokens); libra's
uniform-router variant is Libra's Lina-like ablation.

Writes docs/results/online_time.md and online_time.png. Run: .venv/bin/python bench/online_time.py --esft DIR
(or MOEBALANCE_ESFT_DIR=DIR), DIR holding law_topk.npz and translation_topk.npz.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import online_time_v3 as v3
from _common import ROOT, batches_load, esft_batches, esft_from_args, esft_sequences, machine

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.io import save_png
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.online.rearrange import DEFAULT_OVERHEAD_MS, Replanning
from moebalance.online.replay import OnlineResult, replay
from moebalance.prediction.predictors import PredictorInputs
from moebalance.pricing.step import StepPricing

G, E = 8, 64
SMALL, JOIN = 512, 16  # 8,192 tokens = 16 batches of 512
SERVED_LARGE = 24  # served 8,192-token batches per workload
K, W = 4, 4  # periodic EPLB: re-plan every K served batches on the last W
# bounded migration: copies one GPU may receive per re-plan, summed over the 26 layers (one per layer on average, of
# its 26 x 9 = 234 slots); fresh re-plans move far more (the report states how many)
MAX_MOVES = 26
MIGRATIONS = ("fresh", "aligned", "bounded")
NS = (2, 4, 8)
SWEEP = (2, 4, 8)  # batches of 1,024, 2,048 and 4,096 tokens, a few policies only
SWEEP_POLICIES = ("contiguous (no replicas)", "static EPLB", "Libra (path, n = 2)", "Libra (path, n = 4)",
                  "Libra (oracle, n = 2)")
SEED = 0
TASKS = ("law", "translation")
Batch = tuple[np.ndarray, np.ndarray]


# ----- workloads ------------------------------------------------------------------------------------------------

def _join(blocks: list[Batch]) -> Batch:
    """One batch of the blocks' tokens, dealt to the ``G`` ranks in contiguous blocks."""
    ids = np.concatenate([b[0] for b in blocks])
    return ids, np.arange(len(ids)) * G // len(ids)


def workloads(folder: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """``{(workload, tokens per batch): {"load", "warm", "build", "labels"}}`` (module docstring)."""
    rng = np.random.default_rng(SEED)
    seqs = {t: esft_sequences(folder / f"{t}_topk.npz") for t in TASKS}
    cut = {t: int(len(seqs[t]) * 0.4) for t in TASKS}
    build = {t: esft_batches(seqs[t][:cut[t]], SMALL, G) for t in TASKS}
    evals = {t: esft_batches(seqs[t][cut[t]:], SMALL, G) for t in TASKS}
    build_all = batches_load([b for t in TASKS for b in build[t]], E)

    def mixed(evaluation: bool) -> list[Batch]:
        chosen = [s for t in TASKS for s in (seqs[t][cut[t]:] if evaluation else seqs[t][:cut[t]])]
        return esft_batches([chosen[i] for i in rng.permutation(len(chosen))], SMALL, G)

    mix_build, mix_eval = mixed(False), mixed(True)
    order = [(t, i) for t in TASKS for i in range(len(evals[t]))]
    order = [order[j] for j in rng.permutation(len(order))]
    out: dict[tuple[str, int], dict[str, Any]] = {}
    # 512 tokens: the warm-up is two build batches of each task (domain-pure) or four mixed build batches
    warm = [b for t in TASKS for b in build[t][:2]]
    out["domain-pure", SMALL] = {"parts": warm + [evals[t][i] for t, i in order], "warm": len(warm),
                                 "labels": [t for t, _ in order]}
    out["mixed", SMALL] = {"parts": mix_build[:4] + mix_eval, "warm": 4, "labels": ["mixed"] * len(mix_eval)}
    # 8,192 tokens: 16 blocks of 512 drawn with replacement; warm-up one joined build batch per task (or two mixed)

    def draw(pool: list[Batch]) -> Batch:
        return _join([pool[i] for i in rng.integers(0, len(pool), JOIN)])

    tasks = [TASKS[i % 2] for i in rng.permutation(SERVED_LARGE)]
    out["domain-pure", SMALL * JOIN] = {"parts": [draw(build[t]) for t in TASKS] + [draw(evals[t]) for t in tasks],
                                        "warm": 2, "labels": tasks}
    out["mixed", SMALL * JOIN] = {"parts": [draw(mix_build) for _ in range(2)] +
                                  [draw(mix_eval) for _ in range(SERVED_LARGE)], "warm": 2,
                                  "labels": ["mixed"] * SERVED_LARGE}
    for j in SWEEP:  # the batch-size sweep: j blocks of 512 per batch, drawn as above
        tasks = [TASKS[i % 2] for i in rng.permutation(SERVED_LARGE)]
        out["domain-pure", SMALL * j] = {"parts": [_join([build[t][i] for i in rng.integers(0, len(build[t]), j)])
                                                   for t in TASKS] +
                                         [_join([evals[t][i] for i in rng.integers(0, len(evals[t]), j)])
                                          for t in tasks], "warm": 2, "labels": tasks, "sweep": True}
        out["mixed", SMALL * j] = {"parts": [_join([mix_build[i] for i in rng.integers(0, len(mix_build), j)])
                                             for _ in range(2)] +
                                   [_join([mix_eval[i] for i in rng.integers(0, len(mix_eval), j)])
                                    for _ in range(SERVED_LARGE)], "warm": 2, "labels": ["mixed"] * SERVED_LARGE,
                                   "sweep": True}
    for w in out.values():
        w["load"] = batches_load(w.pop("parts"), E)
        w["build"] = build_all
    return out


# ----- runs -----------------------------------------------------------------------------------------------------

def periodic(mode: str, migration: str) -> str:
    """The label of periodic EPLB with rearrangement ``mode`` (sync, async) and ``migration``."""
    how = f"bounded M = {MAX_MOVES}" if migration == "bounded" else migration
    return f"periodic EPLB {mode}, {how} (every {K} on {W})"


def specs() -> list[tuple[str, dict[str, Any]]]:
    """``(label, replay arguments)`` of every policy, each with the uniform and the rebalance router."""
    homes, eplb = Budget(slots_per_gpu=E // G), Budget(slots_per_gpu=E // G + 1)
    one = {"num_groups": 1}
    base: list[tuple[str, dict[str, Any]]] = [
        ("contiguous (no replicas)", {"policy": "contiguous", "budget": homes}),
        ("static EPLB", {"policy": "eplb", "budget": eplb, "params": one}),
    ]
    base += [(periodic(mode, mig), {"policy": "eplb", "budget": eplb, "params": one, "replan_every": K, "window": W,
                                    "rearrange": mode, "migration": mig,
                                    "max_moves": MAX_MOVES if mig == "bounded" else None})
             for mode in ("sync", "async") for mig in MIGRATIONS]
    base += [(f"Libra ({pred}, n = {n})", {"policy": "libra", "budget": homes,
                                          "params": {"n": n, "alpha": 0.5, "predictor": pred}})
             for pred in ("path", "oracle") for n in NS]
    out: list[tuple[str, dict[str, Any]]] = []
    for label, spec in base:
        routers = ["uniform"] if spec["policy"] == "contiguous" else ["uniform", "rebalance"]
        out += [(label, {**spec, "router": r}) for r in routers]
    return out


def run_cell(work: dict[str, Any]) -> list[tuple[str, OnlineResult]]:
    """Every policy of :func:`specs` (the sweep's cells: only ``SWEEP_POLICIES`` with rebalance) on one workload."""
    cluster = Cluster(num_nodes=1, gpus_per_node=G)  # NVLink 4 inside the node (the default intra-node link)
    pricing = StepPricing(deployment=Deployment(model=get_model("deepseek-v2-lite"), gpu=get_gpu("h100-80gb")))
    out = []
    for label, spec in specs():
        if work.get("sweep") and (label not in SWEEP_POLICIES or (spec["router"] == "uniform" and
                                  spec["policy"] != "contiguous")):
            continue
        replanning = Replanning(every=spec.get("replan_every"), window=spec.get("window"),
                                migration=spec.get("migration", "fresh"), max_moves=spec.get("max_moves"),
                                rearrange=spec.get("rearrange", "sync"))
        r = replay(work["load"], cluster, spec["budget"], spec["policy"], spec.get("params", {}),
                   warmup=(0, work["warm"]), router=spec["router"], replanning=replanning,
                   inputs=PredictorInputs(build=work["build"]), pricing=pricing)
        out.append((label, r))
    return out


# ----- report ---------------------------------------------------------------------------------------------------

def _table(runs: list[tuple[str, OnlineResult]]) -> list[str]:
    floor = next(r for label, r in runs if label.startswith("contiguous")).time
    assert floor is not None
    lines = ["| policy | router | mean imbalance | step ms mean | step ms p99 | tokens/s | vs contiguous | moved GiB | "
             "exposed ms | of which router | rearrangements |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(runs, key=lambda lr: -lr[1].time["tokens_per_s"])  # type: ignore[index]
    for label, r in rows:
        t = r.time
        assert t is not None
        lines.append(f"| {label} | {r.router} | {r.mean_imbalance_ratio:.3f} | {t['step_ms_mean']:.2f} | "
                     f"{t['step_ms_p99']:.2f} | {t['tokens_per_s']:,.0f} | "
                     f"{t['tokens_per_s'] / floor['tokens_per_s']:.3f} | {t['moved_gib']:.1f} | "
                     f"{t['exposed_balancing_ms']:.1f} | {t['exposed_router_ms']:.1f} | {t['rearrangements']} |")
    return lines


def _plot(cells: dict[tuple[str, int], list[tuple[str, OnlineResult]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 8.5), dpi=100, sharey=True)
    labels = [f"{label}, {r.router}" for label, r in next(iter(cells.values()))]
    for ax, ((work, tokens), runs) in zip(np.atleast_1d(axes), cells.items(), strict=True):
        floor = runs[0][1].time["tokens_per_s"]  # type: ignore[index]
        rel = [r.time["tokens_per_s"] / floor for _, r in runs]  # type: ignore[index]
        ax.barh(np.arange(len(rel)), rel, color=["tab:green" if v >= 1 else "tab:red" for v in rel])
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{work}, {tokens:,} tokens/batch", fontsize=9)
        ax.set_xlabel("tokens/s over contiguous (log)")
    ax0 = np.atleast_1d(axes)[0]
    ax0.set_yticks(np.arange(len(labels)))
    ax0.set_yticklabels(labels, fontsize=7)
    ax0.invert_yaxis()
    fig.suptitle("DeepSeek-V2-Lite on ESFT routing (law + translation), 1 x 8 H100, NVLink 4: throughput after what "
                 "balancing costs", fontsize=10)
    save_png(fig, path)


def _get(runs: list[tuple[str, OnlineResult]], label: str, router: str) -> OnlineResult:
    return next(r for lab, r in runs if lab == label and r.router == router)


def _tps(r: OnlineResult) -> float:
    assert r.time is not None
    return float(r.time["tokens_per_s"])


def findings(cells: dict[tuple[str, int], list[tuple[str, OnlineResult]]]) -> list[str]:
    """Where balancing pays, from the numbers (each sentence computed)."""
    model = get_model("deepseek-v2-lite")
    mb = model.expert_params() * 2 / 1e6
    gpu = get_gpu("h100-80gb")
    picks = {t: t * model.top_k / model.num_experts for _, t in cells}
    read_us = mb * 1e6 / (gpu.memory_bandwidth * 1e9) * 1e6

    def mul_us(t: int) -> float:
        return 2 * picks[t] * model.expert_params() / (gpu.bf16_tflops * 1e12) * 1e6

    w: list[str] = [
        f"A routed expert of DeepSeek-V2-Lite is {mb:.1f} MB of bf16 weights: {read_us:.1f} us to read at the H100's "
        f"peak bandwidth. A batch of 512 tokens gives an expert {picks[SMALL]:.0f} picks on average "
        f"({mul_us(SMALL):.1f} us of multiplication at peak), one of {SMALL * JOIN:,} tokens "
        f"{picks[SMALL * JOIN]:.0f} ({mul_us(SMALL * JOIN):.1f} us): at 512 "
        "tokens the grouped GEMM's roofline is set by the weights read, so a GPU's expert phase "
        "follows the experts it touches more than its tokens, and a replica (another expert touched) or a prefetched "
        "copy costs more than the tokens it takes off the busiest GPU. Per cell:", ""]
    for (work, tokens), runs in cells.items():
        floor = _tps(runs[0][1])
        best_label, best = max(((f"{lab} ({r.router})", r) for lab, r in runs), key=lambda lr: _tps(lr[1]))
        static = max((_get(runs, "static EPLB", rt) for rt in ("uniform", "rebalance")), key=_tps)
        libra = [(lab, r) for lab, r in runs if lab.startswith("Libra (path")]
        lb_label, lb = max(libra, key=lambda lr: _tps(lr[1]))
        ora = [(lab, r) for lab, r in runs if lab.startswith("Libra (oracle")]
        ol_label, ol = max(ora, key=lambda lr: _tps(lr[1]))
        sync = _get(runs, periodic("sync", "fresh"), "rebalance")
        asy = _get(runs, periodic("async", "fresh"), "rebalance")
        assert lb.time is not None and ol.time is not None and sync.time is not None
        w.append(f"- **{work}, {tokens:,} tokens per batch.** Fastest: {best_label}, {_tps(best) / floor:.3f}x "
                 f"contiguous. Static EPLB (best router) {_tps(static) / floor:.3f}x. Periodic EPLB (fresh) with "
                 "rebalance: "
                 f"sync {_tps(sync) / floor:.3f}x ({sync.time['exposed_balancing_ms']:.0f} ms exposed over "
                 f"{sync.time['rearrangements']} rearrangements), async {_tps(asy) / floor:.3f}x. Libra (path) at its "
                 f"best ({lb_label}, {lb.router}) {_tps(lb) / floor:.3f}x with {lb.time['exposed_balancing_ms']:.1f} ms "
                 f"exposed and imbalance {lb.mean_imbalance_ratio:.3f}; Libra with the true routing at its best "
                 f"({ol_label}, {ol.router}) {_tps(ol) / floor:.3f}x, imbalance {ol.mean_imbalance_ratio:.3f} but "
                 f"{ol.time['exposed_balancing_ms']:.1f} ms exposed.")
    return w


def crossover(cells: dict[tuple[str, int], list[tuple[str, OnlineResult]]]) -> list[str]:
    """Per workload and batch size: tokens/s of static EPLB over contiguous, and of per-batch balancing over static
    EPLB (all with the rebalance router)."""
    w = ["| workload | tokens per batch | static EPLB / contiguous | Libra (path, n = 2) / static EPLB | Libra (path, "
         "n = 4) / static EPLB | Libra (oracle, n = 2) / static EPLB | Libra (path, n = 2): exposed ms per batch, "
         "step ms |", "|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for work in ("domain-pure", "mixed"):
        for tokens in sorted(t for wk, t in cells if wk == work):
            runs = cells[work, tokens]
            floor, static = _tps(runs[0][1]), _tps(_get(runs, "static EPLB", "rebalance"))
            lib = _get(runs, "Libra (path, n = 2)", "rebalance")
            assert lib.time is not None
            ratios = " | ".join(f"{_tps(_get(runs, lab, 'rebalance')) / static:.3f}"
                                for lab in ("Libra (path, n = 2)", "Libra (path, n = 4)", "Libra (oracle, n = 2)"))
            w.append(f"| {work} | {tokens:,} | {static / floor:.3f} | {ratios} | "
                     f"{lib.time['exposed_balancing_ms'] / lib.batches.size:.2f}, {lib.time['step_ms_mean']:.2f} |")
    for work in ("domain-pure", "mixed"):
        sizes = sorted(t for wk, t in cells if wk == work)
        for lab in ("Libra (path, n = 2)", "Libra (oracle, n = 2)"):
            wins = [t for t in sizes if _tps(_get(cells[work, t], lab, "rebalance")) >
                    _tps(_get(cells[work, t], "static EPLB", "rebalance"))]
            first = next((t for t in sizes if all(u in wins for u in sizes if u >= t)), None)
            notes.append(f"- {work}, {lab} with rebalance: " +
                         (f"beats static EPLB from {first:,} tokens per batch up." if first is not None else
                          f"does not beat static EPLB at any size up to {sizes[-1]:,} tokens per batch."))
    return [*w, "", *notes]


def async_note(cells: dict[tuple[str, int], list[tuple[str, OnlineResult]]]) -> list[str]:
    """Why async periodic EPLB moves nothing at 512 tokens: a re-plan's transfer outlasts K steps."""
    w = []
    for (work, tokens), runs in cells.items():
        sync = _get(runs, periodic("sync", "fresh"), "rebalance").time
        asy = _get(runs, periodic("async", "fresh"), "rebalance").time
        static = _get(runs, "static EPLB", "rebalance").time
        assert sync is not None and asy is not None and static is not None
        transfer = (sync["exposed_balancing_ms"] - sync["exposed_router_ms"]
                    - sync["rearrangements"] * DEFAULT_OVERHEAD_MS) / sync["rearrangements"]
        w.append(f"- {work}, {tokens:,} tokens: a re-plan's transfer takes {transfer:.1f} ms against a step of "
                 f"{static['step_ms_mean']:.2f} ms, so an async re-plan needs about "
                 f"{math.ceil(transfer / static['step_ms_mean'])} step(s) of serving before it lands, and the next "
                 f"re-plan comes {K} steps after it; async moved "
                 f"{asy['moved_gib']:.1f} GiB over {asy['rearrangements']} re-plans"
                 + (": every re-plan was abandoned by the next before it landed, so async periodic EPLB served the "
                    "warm-up plan throughout (its row is static EPLB's but for the router's measured host time)." if asy["moved_gib"] == 0 else "."))
    return w


def migration_note(cells: dict[tuple[str, int], list[tuple[str, OnlineResult]]]) -> list[str]:
    """What ``aligned`` and ``bounded`` change against ``fresh`` (periodic EPLB, rebalance router), per cell."""
    deployment = Deployment(model=get_model("deepseek-v2-lite"), gpu=get_gpu("h100-80gb"))
    overhead_ms = Replanning().overhead_ms  # the replay's (periodic EPLB's) host overhead per re-plan
    gib = deployment.bytes_per_expert / 2 ** 30
    slots = deployment.model.num_layers * (E // G + 1)

    def t(runs: list[tuple[str, OnlineResult]], mode: str, mig: str) -> dict[str, Any]:
        r = _get(runs, periodic(mode, mig), "rebalance")
        assert r.time is not None
        return {**r.time, "imb": r.mean_imbalance_ratio}

    def per_replan(x: dict[str, Any]) -> tuple[float, float]:
        """(copies received per GPU per re-plan, transfer ms per re-plan) of a sync row."""
        n = max(x["rearrangements"], 1)
        transfer = x["exposed_balancing_ms"] - x["exposed_router_ms"] - x["rearrangements"] * overhead_ms
        return x["moved_gib"] / gib / n / G, transfer / n

    fresh_copies = [per_replan(t(runs, "sync", "fresh"))[0] for runs in cells.values()]
    w = [f"Migration-aware re-planning (periodic EPLB, rebalance router). A fresh re-plan moves "
         f"{min(fresh_copies):.0f}-{max(fresh_copies):.0f} expert copies into each GPU (of its {slots} slots: "
         f"{deployment.model.num_layers} layers x {E // G + 1}); `bounded` here allows M = {MAX_MOVES} per GPU and "
         f"re-plan, one per layer on average, {MAX_MOVES / max(fresh_copies):.0%}-{MAX_MOVES / min(fresh_copies):.0%} "
         "of that. Per cell, fresh / aligned / bounded:", ""]
    for (work, tokens), runs in cells.items():
        floor = _tps(runs[0][1])
        rows = {(mode, mig): t(runs, mode, mig) for mode in ("sync", "async") for mig in MIGRATIONS}
        sync = [per_replan(rows["sync", mig]) for mig in MIGRATIONS]

        def three(key: str, fmt: str, mode: str, rows: dict[tuple[str, str], dict[str, Any]] = rows) -> str:
            return " / ".join(format(rows[mode, mig][key], fmt) for mig in MIGRATIONS)

        def rel(mode: str, rows: dict[tuple[str, str], dict[str, Any]] = rows, floor: float = floor) -> str:
            return " / ".join(f"{rows[mode, mig]['tokens_per_s'] / floor:.3f}x" for mig in MIGRATIONS)

        f_gib, a_gib = rows["sync", "fresh"]["moved_gib"], rows["sync", "aligned"]["moved_gib"]
        host = rows["sync", "fresh"]["rearrangements"] * overhead_ms
        w.append(f"- **{work}, {tokens:,} tokens.** Sync: moved {three('moved_gib', '.1f', 'sync')} GiB "
                 f"(aligned {1 - a_gib / f_gib:.0%} fewer than fresh; copies received per GPU and "
                 f"re-plan {' / '.join(f'{c:.0f}' for c, _ in sync)}), transfer per re-plan "
                 f"{' / '.join(f'{m:.1f}' for _, m in sync)} ms, exposed "
                 f"{three('exposed_balancing_ms', '.0f', 'sync')} ms of which {host:.0f} ms is host overhead, so "
                 f"tokens/s {three('tokens_per_s', ',.0f', 'sync')} ({rel('sync')} contiguous). Async: moved "
                 f"{three('moved_gib', '.1f', 'async')} GiB, tokens/s {three('tokens_per_s', ',.0f', 'async')} "
                 f"({rel('async')}), imbalance {three('imb', '.3f', 'async')}.")
    w += ["", *migration_summary(cells, t)]
    return w


def migration_summary(cells: dict[tuple[str, int], list[tuple[str, OnlineResult]]],
                      t: Callable[[list[tuple[str, OnlineResult]], str, str], dict[str, Any]]) -> list[str]:
    """The sentences that sum :func:`migration_note` up over the cells (``t``: a row's ``time`` and imbalance)."""
    def change(mode: str, mig: str) -> str:
        x = [t(runs, mode, mig)["tokens_per_s"] / t(runs, mode, "fresh")["tokens_per_s"] - 1 for runs in cells.values()]
        lo, hi = f"{min(x):+.1%}", f"{max(x):+.1%}"
        return lo if lo == hi else f"{lo} to {hi}"

    host = min(t(runs, "sync", "fresh")["rearrangements"] * DEFAULT_OVERHEAD_MS /
               t(runs, "sync", "fresh")["exposed_balancing_ms"] for runs in cells.values())
    cut = [1 - t(runs, "sync", "bounded")["moved_gib"] / t(runs, "sync", "fresh")["moved_gib"]
           for runs in cells.values()]
    w = [f"So: synchronous, the {DEFAULT_OVERHEAD_MS:g} ms host overhead per re-plan is at least {host:.1%} of fresh's "
         f"exposed time, and moving fewer weights changes tokens/s by {change('sync', 'aligned')} (aligned) and "
         f"{change('sync', 'bounded')} (bounded, {min(cut):.0%}-{max(cut):.0%} fewer GiB): the stall is the host's, "
         "not the links'. Asynchronous, aligned serves fresh's balance with fewer GiB (tokens/s "
         f"{change('async', 'aligned')}); bounded serves a plan between the old and the fresh one, tokens/s "
         f"{change('async', 'bounded')} against fresh."]
    for (work, tokens), runs in cells.items():
        fresh, bnd = t(runs, "async", "fresh"), t(runs, "async", "bounded")
        if fresh["moved_gib"] == 0 and bnd["moved_gib"] > 0:
            others = "fresh's and aligned's never do" if t(runs, "async", "aligned")["moved_gib"] == 0 else \
                "fresh's never does"
            w[0] += (f" At {work}, {tokens:,} tokens, bounded's smaller transfer lands before the next re-plan "
                     f"({others}), and the plan it lands, fit to the last {W} batches, serves the next ones at "
                     f"imbalance {bnd['imb']:.3f} against the warm-up plan's {fresh['imb']:.3f}.")
    return w


def v3_section(drift: dict[int, list[tuple[str, OnlineResult]]], failed: list[tuple[str, OnlineResult]]) -> list[str]:
    """The drifting DeepSeek-V3-like trace on 8 x 8 H100, and losing a GPU (bench/online_time_v3.py)."""
    w = ["## A drifting DeepSeek-V3-like workload on 8 x 8 H100", "",
         f"A synthetic counts-level trace (`moebalance synth`'s routing model for DeepSeek-V3: 58 MoE layers x 256 "
         f"experts, top-8) with its popularity drifting fast (AR(1) log-popularity, standard deviation "
         f"{v3.DRIFT_SIGMA}, correlation time {v3.DRIFT_TIMESCALE:g} batches), {v3.WARM} warm-up and {v3.SERVED} "
         "served batches, priced with the `deepseek-v3` preset on 8 nodes x 8 H100 (NVLink 4 inside a node, the "
         "default inter-node link). Static EPLB is hierarchical (8 groups) with 5 slots per GPU and layer (64 "
         f"redundant experts); periodic EPLB re-plans every {v3.K} on the last {v3.W} (bounded: M = {v3.M}); Libra "
         "keeps 4 homes per GPU and prefetches n extras from the history predictor (a counts-level trace has no "
         "token paths) or the batch's true routing. Details in `bench/online_time_v3.py`.", ""]
    for per_gpu, runs in drift.items():
        floor = _tps(runs[0][1])
        static = _get(runs, "static EPLB", "rebalance")
        best_label, best = max(((lab, r) for lab, r in runs), key=lambda lr: _tps(lr[1]))
        sync = _get(runs, f"periodic EPLB sync, fresh (every {v3.K} on {v3.W})", "rebalance")
        asy = _get(runs, f"periodic EPLB async, aligned (every {v3.K} on {v3.W})", "rebalance")
        w += [f"### {per_gpu:,} tokens per GPU ({per_gpu * v3.G:,} per batch)", "", *_table(runs), "",
              f"Fastest: {best_label}, {_tps(best) / floor:.3f}x contiguous, {_tps(best) / _tps(static):.3f}x static "
              f"EPLB. Static EPLB ages with the drift (imbalance {static.mean_imbalance_ratio:.3f}); periodic EPLB "
              f"sync recovers balance ({sync.mean_imbalance_ratio:.3f}) but pays {_tps(sync) / _tps(static):.3f}x "
              f"static's tokens/s for its stalls; async aligned {_tps(asy) / _tps(static):.3f}x at imbalance "
              f"{asy.mean_imbalance_ratio:.3f}.", ""]
    w += [f"### Losing a GPU ({v3.PER_GPU[0]:,} tokens per GPU)", "",
          f"GPU {v3.FAIL_GPU} is gone from served batch {v3.FAIL_AT} on (`online --fail "
          f"{v3.FAIL_GPU}@{v3.WARM + v3.FAIL_AT}`): static policies re-plan on the 63 survivors with aligned moves "
          "and reload the experts whose only copy was lost over PCIe 5; Libra re-plans its base. Recovery: served "
          "batches after the failure until the mean imbalance is within 2% of its level before the failure.", "",
          *v3.failure_table(failed), ""]
    return w


def main() -> None:
    folder = esft_from_args(__doc__, "docs/results/online_time.md")
    if folder is None:
        return
    t0 = time.perf_counter()
    res = ROOT / "docs" / "results"
    works = workloads(folder)
    cells: dict[tuple[str, int], list[tuple[str, OnlineResult]]] = {}
    for key, work in works.items():
        t = time.perf_counter()
        cells[key] = run_cell(work)
        print(f"{key[0]}, {key[1]} tokens: {len(cells[key])} runs in {time.perf_counter() - t:.0f} s", flush=True)
    full = {k: v for k, v in cells.items() if not works[k].get("sweep")}
    drift = {}
    for per_gpu in v3.PER_GPU:
        t = time.perf_counter()
        drift[per_gpu] = v3.run(v3.trace(per_gpu))
        print(f"DeepSeek-V3, {per_gpu} tokens per GPU: {len(drift[per_gpu])} runs in {time.perf_counter() - t:.0f} s",
              flush=True)
    failed = v3.run(v3.trace(v3.PER_GPU[0]), fail=True)
    _plot(full, res / "online_time.png")
    seconds = time.perf_counter() - t0
    w = ["# What balancing costs in time: online replay priced as forward steps", "",
         "<!-- Generated by bench/online_time.py; do not edit by hand. -->", "",
         "Reproduce: `.venv/bin/python bench/online_time.py --esft ../shared/real-traces/esft-deepseek-v2-lite` "
         "(or `MOEBALANCE_ESFT_DIR=DIR make bench`), DIR holding `law_topk.npz` and `translation_topk.npz`.", "",
         "Real routing, not written by this project: DeepSeek's ESFT repository (github.com/deepseek-ai/ESFT, commit "
         "579a7711e4b332b4c57b47e378a0cf240d85caa6, MIT licence for the code, `results/expert_scores/"
         "{law,translation}/expert_weights_{1..26}.txt`, made by its `scripts/expert/get_expert_scores.py` with "
         "teacher-forced passes of ESFT-vanilla-lite, a DeepSeek-V2-Lite-architecture model: 26 MoE layers, 64 routed "
         "experts, top-6), as described in the shared `real-traces/README.md`.", "",
         f"Machine: {machine()}. Whole report: {seconds:.0f} s.", "",
         "## Method", "",
         "Every served batch is priced as a forward step (`moebalance online --gpu h100-80gb --model "
         "deepseek-v2-lite --calibration peaks`; docs/design.md, \"Priced in time\"): per MoE layer the slowest GPU's grouped GEMM "
         "(roofline on its picks and the experts it touches) plus the all-to-all, plus the rest of the model read as "
         "a prefill, plus what balancing exposes: a synchronous re-plan's transfer (rounds in which each GPU sends "
         f"and receives at most one expert) plus {DEFAULT_OVERHEAD_MS:g} ms of host overhead; an asynchronous "
         "re-plan exposes nothing and serves the old plan until its transfer has had the steps it needs; Libra's "
         "prefetch of each layer's extras over NVLink 4, hidden under the previous layer's expert phase where it "
         "fits, and exposed in full with the batch's true routing (the copy cannot start before the gate); the "
         "`rebalance` router's CPU time, measured on this machine per batch and layer, exposed where it outlasts "
         "each GPU's local phase (Libra's two-stage execution; column \"of which router\"). 1 node x 8 H100-SXM5-80GB, NVLink 4 (450 GB/s per GPU and "
         "direction), bf16 weights, the published peaks, all default engine settings.", "",
         f"Workloads (details in `bench/online_time.py`'s docstring): the first 40% of each task's sequences are the "
         f"build split (warm-up and the path predictor's table), the rest are served. Domain-pure: one task per batch, "
         f"batches of both tasks in a seeded random order. Mixed: both tasks' sequences shuffled together before they "
         f"are cut. At {SMALL * JOIN:,} tokens a batch joins {JOIN} of the 512-token batches drawn with replacement "
         f"(the evaluation splits hold about 10 per task), {SERVED_LARGE} served batches: these batches reuse tokens, "
         "so they show how skew shrinks with batch size, not how a predictor generalises.", "",
         f"Policies: contiguous homes (8 experts per GPU, no replicas: the floor); static EPLB (9 slots per GPU and "
         f"layer, planned once on the warm-up); periodic EPLB re-planned every K = {K} served batches on the last "
         f"W = {W}: vLLM's defaults (`EPLBConfig.step_interval` = 3000 steps, `window_size` = 1000, "
         "docs.vllm.ai, vllm.config.parallel) exceed these traces (under 30 served batches), so periodic EPLB would "
         "never re-plan; K and W here are ours. Libra: 8 home experts per GPU plus a double-buffered prefetch "
         "of n = 2, 4, 8 extras per GPU and layer, from the path predictor (built on the build split) or the batch's "
         "true routing (oracle). Each policy with the uniform router and with `rebalance` (libra with uniform is "
         "Libra's Lina-like ablation). Periodic EPLB lays each re-plan onto the plan in service `fresh` (as planned), "
         "`aligned` (the fresh plan's per-GPU expert sets given to the GPUs that keep the most of them in place, "
         "same balance) or `bounded` (`--migration bounded --max-moves M`: at most M = "
         f"{MAX_MOVES} copies into each GPU per re-plan, summed over the 26 layers, the moves that buy the most "
         "balance first; it reaches the aligned plan over several re-plans).", "",
         "Columns: mean imbalance = busiest GPU over mean GPU load per (batch, layer), averaged; step ms = the "
         "modelled forward step of one batch, with what balancing exposes; tokens/s = served tokens over the summed "
         "steps; vs contiguous = tokens/s over the contiguous floor's; moved GiB = expert weights received over all "
         "GPUs and served batches; exposed ms = balancing time on the critical path, summed over served batches; "
         "rearrangements = re-plans whose copies landed (static; an async one abandoned before it landed is not "
         "counted) or batches whose prefetch loaded any (libra). Rows "
         "sorted by tokens/s.", ""]
    for (name, tokens), runs in full.items():
        cell = works[name, tokens]
        w += [f"## {name}, {tokens:,} tokens per batch", "",
              f"{cell['load'].num_batches - cell['warm']} served batches after a warm-up of {cell['warm']}.", "",
              *_table(runs), ""]
    w += ["![tokens/s over contiguous](online_time.png)", "", "## Where balancing pays", "", *findings(full), "",
          "Periodic EPLB's asynchronous mode at these intervals (fresh re-plans):", "", *async_note(full), "",
          *migration_note(full), "",
          "## Batch size: where per-batch balancing starts to pay", "",
          f"The same workloads at 1,024, 2,048 and 4,096 tokens per batch ({', '.join(str(j) for j in SWEEP)} of the "
          f"512-token batches joined, drawn with replacement as at 8,192; {SERVED_LARGE} served batches), with a few "
          "policies, all with the rebalance router; tokens/s ratios:", "", *crossover(cells), "",
          *v3_section(drift, failed)]
    (res / "online_time.md").write_text("\n".join(w))
    print(f"wrote {res / 'online_time.md'} in {seconds:.0f} s")


if __name__ == "__main__":
    main()
