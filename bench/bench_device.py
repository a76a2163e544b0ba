"""The device rebalancer's and exact planner's time per layer on a GPU, in and out of a CUDA graph, beside the CPU.

DeepSeek-V3-like counts (64 GPUs x 256 experts, EPLB with 64 and 256 redundant experts, 58 layers, one batch of
8 and 256 tokens per GPU: decode and prefill), on the GPU: :func:`moebalance.algorithms.rebalance_device.split_counts`
called directly (a kernel launch and its torch set-up per call), then the same call captured once in a CUDA graph
and replayed; per layer = per call / 58. Beside it the compiled CPU kernel
(:func:`moebalance.algorithms.rebalance.split_counts`) on the same counts. Every result is checked equal to the
CPU's first. The token routes (:func:`moebalance.algorithms.rebalance_device.route_tokens`) of one decode layer
(8 tokens per GPU, top-8) are timed the same way, beside the CPU router's kernel. Capturing a call in a CUDA
graph fails if it synchronises with the host, so the graph rows also check that it does not. Goal: under 100 us
per layer.

The exact planner (:func:`moebalance.algorithms.exact_device.plan`: prefetch phases 1 and 2, then the rebalancer)
is timed on the workload of ``bench/bench_exact.py`` (one DeepSeek-V3-like batch of 8,192 tokens per GPU, 8 MoE
layers, 64 GPUs x 256 experts, contiguous homes, alpha = 0.5) for n = 2, 4 and 8: all 8 layers in one call,
per layer = per call / 8, beside the compiled CPU planner (:func:`moebalance.algorithms.exact.plan_layer`) per
layer; the loads and extras are checked equal to the CPU's first. ``metro``'s search
(:func:`moebalance.algorithms.metro_device.split_counts`) is timed on DeepSeek-V3 decode counts (8 and 32 tokens
per GPU, EPLB with 64 and 256 redundant experts, 58 layers) beside the CPU search, checked equal first.

Needs a CUDA GPU and Triton; elsewhere it says so and exits. Writes docs/results/bench_device.md.
Run: .venv/bin/python bench/bench_device.py
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch
from _common import ROOT, machine

from moebalance.algorithms import rebalance as cpu
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.policies import Budget, make_plan
from moebalance.workloads.synth import synthesize


def _median_cuda(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return float(np.median(times))


def _direct_and_graphed(call, want: np.ndarray) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds of ``call()`` launched directly and replayed from a CUDA graph (a capture fails if the call
    synchronises with the host), each result checked equal to the CPU's ``want`` first."""
    assert np.array_equal(call().cpu().numpy(), want), "the device result differs from the CPU's"
    direct = _median_cuda(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(out.cpu().numpy(), want), "the captured graph's result differs from the CPU's"
    return direct, _median_cuda(graph.replay)


def _token_row(cluster: Cluster) -> str:
    """``| direct | graph | CPU |`` of one layer's token routes at 8 tokens per GPU, checked equal first."""
    from moebalance.algorithms import rebalance_device as device

    arrays = synthesize("deepseek-v3", num_batches=9, tokens_per_batch=8 * 64, num_gpus=64, seed=0, token_level=True)
    load = LoadMatrix.from_arrays(arrays)
    plan = make_plan("eplb", load.select_batches(0, 8), cluster, Budget(slots_per_gpu=5))[0]
    tr = load.select_batches(8, 9).trace
    assert tr is not None
    ids = np.ascontiguousarray(tr.topk_ids[:, 0, :], dtype=np.int64)
    src, copies = tr.src_gpu.astype(np.int64), plan.copies[0].astype(np.int64)
    kept = np.ones(ids.shape, dtype=bool)
    starts = np.array([0, ids.shape[0]], dtype=np.int64)
    want = cpu.route_tokens(ids, src, starts, copies, 8, 0.0, False, kept)
    args = [torch.from_numpy(a).cuda() for a in (ids, src, np.zeros(ids.shape[0], dtype=np.int64))]
    call = functools.partial(device.route_tokens, *args, 1, torch.from_numpy(copies).cuda(), 8,
                             torch.from_numpy(kept).cuda())
    direct, graphed = _direct_and_graphed(call, want)
    t0 = time.perf_counter()
    for _ in range(20):
        cpu.route_tokens(ids, src, starts, copies, 8, 0.0, False, kept)
    host = (time.perf_counter() - t0) / 20
    return f"| {direct * 1e6:.1f} us | {graphed * 1e6:.1f} us | {host * 1e6:.1f} us |"


def _planner_rows() -> list[str]:
    """``| n | direct | graph | CPU |`` rows of the exact planner at 64 x 256, checked equal first."""
    import dataclasses

    from moebalance.algorithms import exact_device
    from moebalance.algorithms.exact import base_layer, plan_layer
    from moebalance.models import get_model
    from moebalance.prediction.predictors import demand_of

    G, L = 64, 8
    model = dataclasses.replace(get_model("deepseek-v3"), num_layers=L, num_dense_layers=0)
    out = synthesize(model, num_batches=1, tokens_per_batch=G * 8192, num_gpus=G, seed=0, token_level=True)
    demand = demand_of(out["topk_ids"].astype(np.int64), out["src_gpu"], G, model.num_experts).astype(np.int64)
    E = demand.shape[2]
    copies = np.zeros((E, G), dtype=np.int64)
    copies[np.arange(E), np.arange(E) * G // E] = 1
    base = base_layer(copies)
    d_dev = torch.from_numpy(demand)[None].cuda()  # [1, L, G, E]
    c_dev = torch.from_numpy(np.repeat(copies[None], L, axis=0)).cuda()
    rows = []
    for n in (2, 4, 8):
        plans = [plan_layer(np.ascontiguousarray(demand[layer]), base, n, 0.5) for layer in range(L)]
        got = exact_device.plan(d_dev, c_dev, n, 0.5)
        assert np.array_equal(got.extras[0].cpu().numpy(), np.stack([p.extras for p in plans])), n
        want = np.stack([p.loads for p in plans])[None]
        call = functools.partial(lambda n: exact_device.plan(d_dev, c_dev, n, 0.5, validate=False).loads, n)
        direct, graphed = _direct_and_graphed(call, want)
        t0 = time.perf_counter()
        for _ in range(5):
            for layer in range(L):
                plan_layer(np.ascontiguousarray(demand[layer]), base, n, 0.5)
        host = (time.perf_counter() - t0) / 5 / L
        rows.append(f"| {n} | {direct / L * 1e6:.1f} us | {graphed / L * 1e6:.1f} us | {host * 1e6:.1f} us |")
    return rows


def _metro_rows(cluster: Cluster) -> list[str]:
    """``| tokens per GPU | redundant | direct | graph | CPU |`` rows of metro's search on DeepSeek-V3 decode counts
    (one batch of 58 layers), checked equal first; the first call compiles the kernel (slow at this size; untimed)."""
    from moebalance.algorithms import metro as cpu_metro
    from moebalance.algorithms import metro_device
    from moebalance.cost.deployment import Deployment
    from moebalance.cost.hardware import get_gpu
    from moebalance.models import get_model

    cost = Deployment(model=get_model("deepseek-v3"), gpu=get_gpu("h100-80gb"), precision="bf16").cost_vector(cluster)
    rows = []
    for per_gpu in (8, 32):
        arrays = synthesize("deepseek-v3", num_batches=9, tokens_per_batch=per_gpu * 64, num_gpus=64, seed=0)
        load = LoadMatrix(arrays["counts"], None, "deepseek-v3")
        counts = np.ascontiguousarray(load.counts[8:9], dtype=np.int64)
        for slots in (5, 8):
            plan = make_plan("eplb", load.select_batches(0, 8), cluster, Budget(slots_per_gpu=slots))[0]
            has = plan.copies > 0
            want = cpu_metro.split_counts(counts, has, cost)
            args = (torch.from_numpy(counts).cuda(), torch.from_numpy(has).cuda(), torch.from_numpy(cost).cuda())
            assert np.array_equal(metro_device.split_counts(*args)[1].cpu().numpy(), want[1])
            direct, graphed = _direct_and_graphed(lambda args=args: metro_device.split_counts(*args)[0], want[0])
            t0 = time.perf_counter()
            cpu_metro.split_counts(counts, has, cost)
            host = time.perf_counter() - t0
            L = counts.shape[1]
            rows.append(f"| {per_gpu} | {slots * 64 - 256} | {direct / L * 1e6:.1f} us | {graphed / L * 1e6:.1f} us | "
                        f"{host / L * 1e6:.1f} us |")
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_device.py needs a CUDA GPU: run it where one is (the device rebalancer's timing)")
    from moebalance.algorithms import rebalance_device as device

    rows = []
    cluster = Cluster(num_nodes=8, gpus_per_node=8)
    for per_gpu in (8, 256):
        arrays = synthesize("deepseek-v3", num_batches=9, tokens_per_batch=per_gpu * 64, num_gpus=64, seed=0)
        load = LoadMatrix(arrays["counts"], None, "deepseek-v3")
        counts = np.ascontiguousarray(load.counts[8:9], dtype=np.int64)  # [1, 58, 256]
        for slots in (5, 8):
            plan = make_plan("eplb", load.select_batches(0, 8), cluster, Budget(slots_per_gpu=slots))[0]
            copies = plan.copies.astype(np.int64)
            want = cpu.split_counts(counts, copies, 0.0, False)
            c_dev, cp_dev = torch.from_numpy(counts).cuda(), torch.from_numpy(copies).cuda()
            direct, graphed = _direct_and_graphed(functools.partial(device.split_counts, c_dev, cp_dev), want)
            t0 = time.perf_counter()
            for _ in range(5):
                cpu.split_counts(counts, copies, 0.0, False)
            host = (time.perf_counter() - t0) / 5
            L = counts.shape[1]
            rows.append(f"| {per_gpu} | {slots * 64 - 256} | {direct / L * 1e6:.1f} us | {graphed / L * 1e6:.1f} us | "
                        f"{host / L * 1e6:.1f} us |")
    tokens = _token_row(cluster)
    planner = _planner_rows()
    metro = _metro_rows(cluster)
    lines = ["# The device rebalancer, exact planner and metro search on a GPU", "", f"Machine: {machine()}; {torch.cuda.get_device_name()}.",
             "Command: `.venv/bin/python bench/bench_device.py` (median of 50 calls, CUDA events). DeepSeek-V3-like",
             "counts, 64 GPUs x 256 experts, one batch of 58 layers; per layer = per call / 58.", "",
             "| tokens per GPU | redundant experts | direct call | in a CUDA graph | CPU kernel (numba) |",
             "|---|---|---|---|---|", *rows, "", "Token routes of one decode layer (8 tokens per GPU x 64 GPUs, top-8, "
             "EPLB 64 redundant):", "", "| direct call | in a CUDA graph | CPU kernel (numba) |", "|---|---|---|",
             tokens, "", "The exact planner (prefetch phases 1-2 and the rebalancer), 64 GPUs x 256 experts, 8,192 tokens per "
             "GPU, top-8, 8 layers in one call, alpha = 0.5:", "",
             "| n | direct call, per layer | in a CUDA graph, per layer | CPU planner (numba), per layer |",
             "|---|---|---|---|", *planner, "", "metro's search (`metro_device.split_counts`), DeepSeek-V3 decode counts, "
             "one batch of 58 layers, H100 roofline:", "",
             "| tokens per GPU | redundant experts | direct call | in a CUDA graph | CPU kernel (numba) |",
             "|---|---|---|---|---|", *metro, ""]
    (ROOT / "docs" / "results" / "bench_device.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
