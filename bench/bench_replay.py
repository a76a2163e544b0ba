"""Replay speed: 3000 batches x 58 layers x 256 experts on 64 GPUs (DeepSeek-R1 on 8 x 8, CRAFT's setting).

Target: the full uniform-router replay and scoring (`moebalance.routing.simulate.evaluate`) under 2 s.
Prints a table and writes docs/results/bench_replay.md. Run: .venv/bin/python bench/bench_replay.py
"""

from __future__ import annotations

import numpy as np
from _common import ROOT, machine, median_seconds

from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.policies import Budget, make_plan
from moebalance.routing.simulate import evaluate, gpu_loads


def main() -> None:
    B, L, E, G = 3000, 58, 256, 64
    rng = np.random.default_rng(0)
    # Skewed per-layer expert popularity (lognormal), Poisson noise per batch: ~4096 tokens x top-8 per batch.
    popularity = rng.lognormal(0.0, 1.0, size=(L, E))
    popularity /= popularity.sum(axis=1, keepdims=True)
    counts = rng.poisson(popularity[None] * 4096 * 8, size=(B, L, E))
    load = LoadMatrix(counts)
    cluster = Cluster(num_nodes=8, gpus_per_node=8)
    plan, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=5), num_groups=8)
    rows = []
    for what, fn, repeat in [
        ("gpu_loads, uniform router", lambda: gpu_loads(plan, load.counts, "uniform"), 7),
        ("evaluate (loads + metrics), uniform", lambda: evaluate(plan, load, "uniform"), 7),
        ("evaluate, random router", lambda: evaluate(plan, load, "random"), 3),
        ("evaluate, uniform, with the routing gap (minmax bound)",
         lambda: evaluate(plan, load, "uniform", routing_gap=True), 3),
    ]:
        rows.append((what, median_seconds(fn, repeat), repeat))
    lines = [
        "# Replay benchmark",
        "",
        f"{B} batches x {L} layers x {E} experts, {G} GPUs (8 x 8), EPLB plan with 5 slots per GPU.",
        f"Machine: {machine()}.",
        "Command: `.venv/bin/python bench/bench_replay.py` (median of the given repeats, after one warm-up).",
        "",
        "| step | median | repeats |",
        "|---|---|---|",
        *[f"| {w} | {s:.3f} s | {r} |" for w, s, r in rows],
        "",
        "Target: the uniform-router replay with scoring under 2 s. The routing gap (`evaluate(..., routing_gap=True)`,",
        "what `moebalance evaluate` and `compare` report) adds one exact min-max flow problem per batch and layer.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "docs" / "results" / "bench_replay.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
