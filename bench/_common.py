"""Helpers shared by the benchmarks: timing and a description of the machine."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["ROOT", "fold_ranks", "machine", "median_seconds"]

ROOT = Path(__file__).resolve().parent.parent


def median_seconds(fn: Callable[[], object], runs: int, warmup: bool = True) -> float:
    """Median wall time of ``runs`` calls of ``fn`` (after one untimed warm-up call)."""
    if warmup:
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    """One line: CPU model, cores, numpy and Python versions."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{model}, {len(os.sched_getaffinity(0))} cores, numpy {np.__version__}, "
            f"Python {sys.version.split()[0]}")


def fold_ranks(load, num_gpus: int):  # type: ignore[no-untyped-def]
    """The same tokens with data-parallel ranks merged contiguously onto ``num_gpus`` GPUs (rank ``s`` goes to
    GPU ``s * num_gpus // ranks``), for a bundled trace recorded on more ranks than the cluster has GPUs."""
    from moebalance.core.load import LoadMatrix
    from moebalance.core.trace import RoutingTrace

    tr = load.trace
    assert tr is not None
    ranks = int(tr.src_gpu.max()) + 1
    if ranks <= num_gpus:
        return load
    src = tr.src_gpu * num_gpus // ranks
    folded = RoutingTrace(tr.topk_ids, src, tr.batch, num_experts=tr.num_experts, num_batches=tr.num_batches)
    return LoadMatrix(load.counts, folded, load.preset)
