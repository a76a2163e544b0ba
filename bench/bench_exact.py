"""Speed of exact per-layer planning (``libra`` with ``predictor=exact``): Libra's prefetcher (phases 1 and 2) and
token rebalancer for one layer, after the gate, on the batch's own routing.

Target: under 100 us per layer (median over layers) for 64 GPUs x 256 experts, 8,192 tokens per GPU, top-8, on
one core, for n = 2, 4 and 8 (alpha = 0.5), with the same plans as the code it replaces.

Workload: DeepSeek-V3-like routing from the synthetic generator (``moebalance.workloads.synth``, token level: one
batch of 8,192 tokens per GPU, 8 MoE layers of 256 experts, top-8), counted by source GPU and expert; the base
placement is libra's default (contiguous homes, 256 / G experts per GPU). Also 8 and 32 GPUs for context.

- **before**: the planning code as it was (the frozen copy in ``tests/ref_exact.py``): the prefetcher, then the
  per-batch copies, the local and remote picks, the ``uniform`` start and the rebalancer, as ``libra`` and the
  ``rebalance`` router ran them one after the other; also its two compiled kernels alone (no glue).
- **now**: :func:`moebalance.algorithms.exact.plan_layer` on a :class:`~moebalance.algorithms.exact.BaseLayer`
  prepared once per base plan (its one-off cost is reported), input checks included.

Every plan is checked equal to before's (extras, expected loads, routing split, loads, moves) in this run.
Per layer: the median of repeated calls after a warm-up call; the table gives the median (and range) over layers.
One core: the process is pinned to one CPU and numba, OpenMP and BLAS get one thread each.
Prints a table and writes docs/results/bench_exact.md. Run: .venv/bin/python bench/bench_exact.py
"""

from __future__ import annotations

import os

for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import dataclasses  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import ROOT, machine, median_seconds  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from ref_exact import (  # noqa: E402  (before's code, frozen)
    ref_gpu_lists,
    ref_host_lists,
    ref_plan_layer,
    ref_prefetch_kernel,
    ref_rebalance,
    ref_start,
)

from moebalance.algorithms.exact import base_layer, plan_layer  # noqa: E402
from moebalance.algorithms.exact_torch import plan_layer_torch  # noqa: E402
from moebalance.models import get_model  # noqa: E402
from moebalance.prediction.predictors import demand_of  # noqa: E402
from moebalance.workloads.synth import synthesize  # noqa: E402

TOKENS_PER_GPU = 8192
LAYERS = 8
RUNS = 50
#: Timed calls per layer of the torch planner (it takes a tenth of a second and more per layer).
TORCH_RUNS = 3
TARGET_US = 100.0
#: Rows of the torch planner's table.
TORCH_ROWS: list[list[str]] = []


def _demand(G: int) -> np.ndarray:
    """``int64 [L, G, E]``: one synthetic DeepSeek-V3-like batch of ``TOKENS_PER_GPU`` tokens per GPU."""
    model = dataclasses.replace(get_model("deepseek-v3"), num_layers=LAYERS, num_dense_layers=0)
    out = synthesize(model, num_batches=1, tokens_per_batch=G * TOKENS_PER_GPU, num_gpus=G, seed=0, token_level=True)
    return demand_of(out["topk_ids"].astype(np.int64), out["src_gpu"], G, model.num_experts).astype(np.int64)


def _kernels_before(demand: np.ndarray, copies: np.ndarray, n: int) -> float:
    """Seconds of before's two compiled kernels alone on one layer: the prefetcher, then the rebalancer."""
    G, E = demand.shape
    d = demand.astype(np.float64)
    hosted = np.ascontiguousarray((copies > 0).T)
    n_local = int(np.floor(n * 0.5 + 1e-12))

    def prefetch() -> None:
        ref_prefetch_kernel(d, hosted, n, n_local, np.full((G, n), -1, dtype=np.int64), np.zeros(G))

    extras = np.full((G, n), -1, dtype=np.int64)
    ref_prefetch_kernel(d, hosted, n, n_local, extras, np.zeros(G))
    cp = copies.copy()
    g, slot = np.nonzero(extras >= 0)
    cp[extras[g, slot], g] += 1
    has = cp > 0
    hstart, hosts = ref_host_lists(has)
    gstart, gexp = ref_gpu_lists(hstart, hosts, G)
    remote = np.zeros((G, E), dtype=np.int64)
    ref_start((demand * ~has.T).sum(axis=0), cp, hstart, hosts, remote)
    local = (demand * has.T).sum(axis=1)
    target = float(demand.sum()) / G
    return (median_seconds(prefetch, RUNS)
            + median_seconds(lambda: ref_rebalance(local, remote.copy(), hstart, hosts, gstart, gexp, target, 0.0,
                                                   False), RUNS))


def _torch_ms(demand: np.ndarray, copies: np.ndarray, n: int) -> float:
    """Median milliseconds of the torch planner on the CPU for one layer, its plan checked equal to now's."""
    d, c = torch.from_numpy(demand), torch.from_numpy(copies)
    got, want = plan_layer_torch(d, c, n, 0.5), plan_layer(demand, copies, n, 0.5)
    assert (np.array_equal(got.extras.numpy(), want.extras) and got.expected.numpy().tobytes() == want.expected.tobytes()
            and np.array_equal(got.remote.numpy(), want.remote) and got.moves == want.moves), n
    return median_seconds(lambda: plan_layer_torch(d, c, n, 0.5), TORCH_RUNS, warmup=False) * 1e3


def _setting(G: int) -> tuple[list[list[str]], dict[int, float], float]:
    """Rows of the table for ``G`` GPUs, the median now per n (us), and base_layer's one-off cost (us)."""
    demand = _demand(G)
    L, _, E = demand.shape
    copies = np.zeros((E, G), dtype=np.int64)
    copies[np.arange(E), np.arange(E) * G // E] = 1  # contiguous homes
    base = base_layer(copies)
    prepare = median_seconds(lambda: base_layer(copies), RUNS) * 1e6
    rows, medians = [], {}
    for n in (2, 4, 8):
        before, kernels, now, moves = [], [], [], []
        for layer in range(L):
            d = np.ascontiguousarray(demand[layer])
            plan = plan_layer(d, base, n, 0.5)
            want = ref_plan_layer(d, copies, n, 0.5)
            assert (np.array_equal(plan.extras, want[0]) and plan.expected.tobytes() == want[1].tobytes()
                    and np.array_equal(plan.remote, want[2]) and np.array_equal(plan.loads, want[3])
                    and plan.moves == want[4]), (G, n, layer)
            moves.append(plan.moves)
            before.append(median_seconds(lambda d=d, n=n: ref_plan_layer(d, copies, n, 0.5), RUNS) * 1e6)
            kernels.append(_kernels_before(d, copies, n) * 1e6)
            now.append(median_seconds(lambda d=d, n=n: plan_layer(d, base, n, 0.5), RUNS) * 1e6)
        med = {k: float(np.median(v)) for k, v in (("before", before), ("kernels", kernels), ("now", now))}
        medians[n] = med["now"]
        met = "yes" if med["now"] < TARGET_US else "no"
        torch_ms = [_torch_ms(np.ascontiguousarray(demand[layer]), copies, n) for layer in range(L)] if G == 64 else []
        TORCH_ROWS.append([f"{G} x {E}", str(n), f"{np.median(torch_ms):.0f} ({min(torch_ms):.0f}-{max(torch_ms):.0f})"]
                          if torch_ms else [])
        rows.append([f"{G} x {E}", str(n), f"{int(np.median(moves)):,} ({min(moves):,}-{max(moves):,})",
                     f"{med['before']:.0f} ({min(before):.0f}-{max(before):.0f})",
                     f"{med['kernels']:.0f} ({min(kernels):.0f}-{max(kernels):.0f})",
                     f"{med['now']:.0f} ({min(now):.0f}-{max(now):.0f})", f"{med['before'] / med['now']:.1f}x",
                     f"{med['kernels'] / med['now']:.1f}x", met if G == 64 else ""])
    return rows, medians, prepare


def main() -> None:
    torch.set_num_threads(1)
    desc = machine()
    load_before = os.getloadavg()[0]
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError):
        pass
    rows, prepares, headline = [], {}, {}
    for G in (64, 8, 32):
        got, medians, prepares[G] = _setting(G)
        rows += got
        if G == 64:
            headline = medians
    met = all(v < TARGET_US for v in headline.values())
    lines = [
        "# Exact per-layer planning: speed",
        "",
        f"Machine: {desc}; this process pinned to one core, numba/OpenMP/BLAS with one thread (load average of",
        f"the machine, shared with other work: {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after).",
        "Command: `.venv/bin/python bench/bench_exact.py`. Workload: one synthetic DeepSeek-V3-like batch",
        f"(`moebalance.workloads.synth`, token level) of {TOKENS_PER_GPU:,} tokens per GPU, top-8, {LAYERS} MoE layers of",
        "256 experts, counted by source GPU and expert; base placement: contiguous homes (libra's default);",
        "alpha = 0.5. Per layer: median of repeated calls after a warm-up call; each cell: median over the layers,",
        "range in brackets, in us. Every plan (extras, expected loads, routing split, loads, moves) was checked",
        "equal to before's in this run.",
        "",
        "- before: the planning code as it was (the frozen copy in tests/ref_exact.py), prefetcher then rebalancer",
        "  with the glue between them; before, kernels: its two compiled kernels alone.",
        "- now: `moebalance.algorithms.exact.plan_layer` on a `BaseLayer` prepared once per base plan, input",
        "  checks included. Preparing the base layer (`base_layer`, once per base plan): "
        + ", ".join(f"{prepares[G]:.0f} us at {G} GPUs" for G in (64, 8, 32)) + ".",
        "",
        "| GPUs x experts | n | rebalancer moves | before | before, kernels | now | speed-up | vs kernels |"
        " under 100 us |",
        "|---|---|---|---|---|---|---|---|---|",
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
        f"Target: under {TARGET_US:.0f} us per layer (median) at 64 GPUs x 256 experts for n = 2, 4 and 8: "
        + ("met" if met else "not met") + " ("
        + ", ".join(f"n = {n}: {v:.0f} us" for n, v in headline.items()) + ").",
        "",
        "## The torch planner",
        "",
        "`moebalance.algorithms.exact_torch.plan_layer_torch` plans on the routing's device with the same result",
        "(checked equal here on every layer). It makes the rebalancer's moves one at a time, each a few small tensor",
        f"operations, so it is bound by their dispatch. On this CPU, one thread, median of {TORCH_RUNS} calls per layer,",
        "over the same layers, in ms:",
        "",
        "| GPUs x experts | n | torch planner, CPU |",
        "|---|---|---|",
        *["| " + " | ".join(r) + " |" for r in TORCH_ROWS if r],
        "",
        "On a GPU, `time_torch_planner(device)` times it (one layer of its own skewed routing, checked equal to",
        "`plan_layer`); for speed, planning on the host from the layer's `[G, E]` counts remains the fast path.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "docs" / "results" / "bench_exact.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
