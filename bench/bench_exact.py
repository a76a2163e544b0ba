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
import time  # noqa: E402

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

from moebalance.algorithms import exact_device  # noqa: E402
from moebalance.algorithms.exact import base_layer, plan_layer  # noqa: E402
from moebalance.algorithms.prefetch import TOL  # noqa: E402
from moebalance.models import get_model  # noqa: E402
from moebalance.prediction.predictors import demand_of  # noqa: E402
from moebalance.workloads.synth import synthesize  # noqa: E402

TOKENS_PER_GPU = 8192
LAYERS = 8
RUNS = 50
TARGET_US = 100.0
#: Layers the device planner is checked on (in Triton's interpreter a 64 x 256 layer takes about 40 s).
DEVICE_LAYERS = 2
#: Rows of the device planner's table.
DEVICE_ROWS: list[list[str]] = []


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


def _device_check(demand: np.ndarray, copies: np.ndarray, n: int) -> tuple[int, float]:
    """``(layers equal, seconds)``: the device planner on every layer of ``demand [L, G, E]`` in one call (on CPU
    tensors: Triton's interpreter), each layer checked against the compiled planner: extras, split, loads and moves
    identical, expected loads within the planner's tie tolerance."""
    L = demand.shape[0]
    t0 = time.perf_counter()
    got = exact_device.plan(torch.from_numpy(demand)[None], torch.from_numpy(np.repeat(copies[None], L, axis=0)), n,
                            0.5)
    seconds = time.perf_counter() - t0
    equal = 0
    for layer in range(L):
        want = plan_layer(np.ascontiguousarray(demand[layer]), copies, n, 0.5)
        equal += bool(np.array_equal(got.extras[0, layer].numpy(), want.extras)
                      and np.abs(got.expected[0, layer].numpy() - want.expected).max(initial=0.0) <= TOL
                      and np.array_equal(got.remote[0, layer].numpy(), want.remote)
                      and np.array_equal(got.loads[0, layer].numpy(), want.loads)
                      and int(got.moves[0, layer]) == want.moves)
    assert equal == L, (n, equal, L)
    return equal, seconds


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
        if G == 64:
            equal, seconds = _device_check(demand[:DEVICE_LAYERS], copies, n)
            DEVICE_ROWS.append([f"{G} x {E}", str(n), f"{equal} of {DEVICE_LAYERS}", f"{seconds:.1f}"])
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
        "## The device planner",
        "",
        "`moebalance.algorithms.exact_device.plan` plans every (batch, layer) at once on the routing's device: Triton",
        "programs for the prefetcher and the rebalancer, one per (batch, layer), with no host synchronisation. Here,",
        f"without a GPU, its kernels run in Triton's interpreter on the first {DEVICE_LAYERS} of the same layers in one call, and",
        "each layer is checked against `plan_layer` (extras, split, loads and moves identical; expected loads within the",
        "planner's tie tolerance). The interpreter's seconds say nothing of GPU speed (`bench/bench_device.py` times",
        "the planner on a GPU):",
        "",
        "| GPUs x experts | n | layers equal | seconds in the interpreter, one call |",
        "|---|---|---|---|",
        *["| " + " | ".join(r) + " |" for r in DEVICE_ROWS],
        "",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "docs" / "results" / "bench_exact.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
