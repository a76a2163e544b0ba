"""CRAFT planning speed: benefit estimation (Alg. 1) and the allocation DP (Alg. 2).

Setting of CRAFT Section 5.5: DeepSeek-R1 (58 layers x 256 experts), 3000 profiled batches, 64 GPUs in
8 nodes, replica counts 1, 2, 4, ..., 64 (K = 7, plus the placement-only replay). Targets:
benefit estimation under 5 s on this machine (the paper reports about 10 s), the DP under 50 ms.
Prints a table and writes docs/results/bench_craft.md. Run: .venv/bin/python bench/bench_craft.py
"""

from __future__ import annotations

import time

from _common import ROOT, machine, median_seconds

from moebalance.algorithms.craft import allocate_replicas, benefit_table
from moebalance.core.cluster import Cluster
from moebalance.workloads.synth import synthesize


def main() -> None:
    t0 = time.perf_counter()
    counts = synthesize("deepseek-r1", num_batches=3000, tokens_per_batch=4096, num_gpus=64, seed=0)["counts"]
    synth_s = time.perf_counter() - t0
    cluster = Cluster(num_nodes=8, gpus_per_node=8)
    table = benefit_table(counts, cluster)
    benefit_s = median_seconds(lambda: benefit_table(counts, cluster), 3)
    dp_s = median_seconds(lambda: allocate_replicas(table, 8 * 64), 20)
    dp_big_s = median_seconds(lambda: allocate_replicas(table, 58 * 64), 5)
    rows = [
        ("benefit estimation (Alg. 1), 8 replays of 3000 x 58 x 256", benefit_s, 3, "< 5 s"),
        ("allocation DP (Alg. 2), R = 8 (C = 512)", dp_s, 20, "< 50 ms"),
        ("allocation DP (Alg. 2), R = 58 (C = 3712)", dp_big_s, 5, ""),
    ]
    lines = [
        "# CRAFT planning benchmark",
        "",
        f"DeepSeek-R1-like synthetic load (`synthesize('deepseek-r1', 3000 batches x 4096 tokens, seed 0)`, "
        f"generated in {synth_s:.1f} s), 64 GPUs in 8 nodes, replica counts {table.replica_counts.tolist()}.",
        f"Machine: {machine()}.",
        "Command: `.venv/bin/python bench/bench_craft.py` (median of the given repeats, after one warm-up).",
        "",
        "| step | median | repeats | target |",
        "|---|---|---|---|",
        *[f"| {w} | {s * 1000:.1f} ms | {r} | {t} |" for w, s, r, t in rows],
        "",
        "Mean gain over placement only (in-sample), by replicas per layer: "
        + ", ".join(f"r={r}: {g:+.3f}" for r, g in zip(table.replica_counts.tolist(), table.gain.mean(axis=1), strict=True)),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "docs" / "results" / "bench_craft.md").write_text(text)


if __name__ == "__main__":
    main()
