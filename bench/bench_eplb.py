"""Speed of ``moebalance.eplb.rebalance_experts`` against a layer-at-a-time baseline (bench/eplb_baseline.py).

Load: 58 layers x 256 experts (DeepSeek-V3/R1), integer token counts; 320 physical slots on 64 GPUs in
8 nodes (5 slots per GPU). ``num_groups=8`` selects the hierarchical policy (8 nodes divide 8 groups);
``num_groups=4`` selects the global one (8 nodes do not divide 4 groups). Both implementations get the
same torch tensor, and their outputs are checked to be identical before anything is timed.

Prints a table and writes docs/results/bench_eplb.md. Run from the repository root:
    .venv/bin/python bench/bench_eplb.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from _common import ROOT, machine, median_seconds
from eplb_baseline import baseline_rebalance

try:
    from moebalance import eplb
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(ROOT / "src"))
    from moebalance import eplb

NUM_LAYERS, NUM_EXPERTS = 58, 256
NUM_REPLICAS, NUM_NODES, NUM_GPUS = 320, 8, 64
POLICIES = [("hierarchical", 8), ("global", 4)]  # (name, num_groups)


def skewed_load(seed: int = 0) -> torch.Tensor:
    """[58, 256] int64 token counts: 8,192 tokens x top-8 per layer over Zipf-like expert popularity.

    Each layer ranks its experts in a random order and gives rank ``r`` popularity ``1 / (r + 1) ** 0.9``
    times lognormal noise, then draws the counts from a multinomial.
    """
    rng = np.random.default_rng(seed)
    tokens = 8192 * 8
    counts = np.empty((NUM_LAYERS, NUM_EXPERTS), dtype=np.int64)
    for layer in range(NUM_LAYERS):
        popularity = (1.0 / np.arange(1, NUM_EXPERTS + 1) ** 0.9) * rng.lognormal(0.0, 0.5, NUM_EXPERTS)
        popularity = popularity[rng.permutation(NUM_EXPERTS)]
        counts[layer] = rng.multinomial(tokens, popularity / popularity.sum())
    return torch.from_numpy(counts)


def median_ms(fn: Callable[[], object], runs: int) -> float:
    return median_seconds(fn, runs) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-runs", type=int, default=5)
    parser.add_argument("--fast-runs", type=int, default=50)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "bench_eplb.md")
    args = parser.parse_args()

    weight = skewed_load()
    rows = []
    for policy, num_groups in POLICIES:
        call = (NUM_REPLICAS, num_groups, NUM_NODES, NUM_GPUS)
        want = baseline_rebalance(weight, *call)
        got = eplb.rebalance_experts(weight, *call)
        identical = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        identical_np = all(
            np.array_equal(a, b.numpy())
            for a, b in zip(eplb.rebalance_experts(weight.numpy(), *call), want, strict=True)
        )
        if not (identical and identical_np):
            sys.exit(f"{policy}: moebalance.eplb and the baseline return different plans; nothing timed")
        base_ms = median_ms(partial(baseline_rebalance, weight, *call), args.baseline_runs)
        fast_ms = median_ms(partial(eplb.rebalance_experts, weight, *call), args.fast_runs)
        rows.append((policy, num_groups, base_ms, fast_ms))

    header = "| policy | num_groups | baseline ms | fast ms | speedup | outputs identical |"
    lines = [header, "|---|---:|---:|---:|---:|---|"]
    for policy, num_groups, base_ms, fast_ms in rows:
        lines.append(
            f"| {policy} | {num_groups} | {base_ms:.1f} | {fast_ms:.2f} | {base_ms / fast_ms:.0f}x | yes |"
        )
    table = "\n".join(lines)
    print(table)

    machine_line = f"{machine()}, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    report = f"""# EPLB `rebalance_experts`: moebalance's against a layer-at-a-time baseline

Load: {NUM_LAYERS} layers x {NUM_EXPERTS} experts, integer token counts (8,192 tokens x top-8 per layer,
Zipf-like popularity with lognormal noise, seed 0). Cluster: {NUM_REPLICAS} physical slots on
{NUM_GPUS} GPUs in {NUM_NODES} nodes. `num_groups=8` selects the hierarchical policy (8 nodes divide 8
groups), `num_groups=4` the global one. Median of {args.baseline_runs} baseline runs and
{args.fast_runs} fast runs, after one warm-up each. "Outputs identical": `phy2log`, `log2phy` and
`logcnt` are equal element for element (torch in, torch out; and numpy in, numpy out); the bench stops
before timing anything if they are not.

The baseline is `bench/eplb_baseline.py`: the same algorithm written plainly for this project, one layer
at a time (Python loops over layers, nodes, extra slots and items, numpy float32 scalars as pack loads).
It is neither DeepSeek's code nor a copy of it, and DeepSeek's own code was not run here; the speedup is
over this baseline only. The fast version is `moebalance.eplb`: the packing and replication loops compiled
with numba (a min-heap of the open packs, a max-heap of the experts by load per replica), numpy around them,
torch only for the item sort and the group sums. Targets: the global plan under 3 ms, the hierarchical under 2.

{table}

Machine: {machine_line}.

Times are wall-clock on whatever else the machine runs at the time (on a shared VM,
absolute times vary by tens of percent between runs; the speedup is the figure to compare).

Reproduce: `.venv/bin/python bench/bench_eplb.py`
"""
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".md.tmp")
    tmp.write_text(report)
    tmp.replace(args.output)
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")


if __name__ == "__main__":
    main()
