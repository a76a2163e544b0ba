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

__all__ = [
    "ROOT",
    "batches_load",
    "esft_batches",
    "esft_folder",
    "esft_from_args",
    "esft_sequences",
    "fold_ranks",
    "machine",
    "median_seconds",
]

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


# A fresh parent per command, so that its children's ru_maxrss is that command's own peak.
_WRAP = ("import resource, subprocess, sys; "
         "r = subprocess.run([sys.executable, *sys.argv[1:]], capture_output=True, text=True); "
         "sys.stderr.write(r.stderr); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def peak_run(argv: list[str]) -> tuple[float, float]:
    """``(seconds, peak GB)`` of ``python argv`` in a fresh process (its own ``ru_maxrss``); a failure exits."""
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WRAP, *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"python {' '.join(argv)} failed: {proc.stderr.strip()}")
    return seconds, int(proc.stdout.split()[-1]) / 1024 / 1024


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


def esft_folder(given: Path | None) -> Path | None:
    """The folder of DeepSeek's ESFT routing (``law_topk.npz``, ``translation_topk.npz``): ``given``, else
    ``$MOEBALANCE_ESFT_DIR``; ``None`` when the files are not there."""
    folder = given if given is not None else (Path(os.environ["MOEBALANCE_ESFT_DIR"])
                                              if os.environ.get("MOEBALANCE_ESFT_DIR") else None)
    if folder is None or not all((folder / f"{t}_topk.npz").is_file() for t in ("law", "translation")):
        return None
    return folder


def esft_sequences(path: Path) -> list[np.ndarray]:
    """One ESFT task's sequences, each ``int64 [T, L, K]``, picks in gate order (restored from the weights)."""
    import itertools

    with np.load(path, allow_pickle=False) as f:
        ids, weights, offsets = f["expert_ids"].astype(np.int64), f["gate_weights"], f["seq_offsets"]
    order = np.argsort(-weights, axis=2, kind="stable")  # picks in gate order: the top-1 first
    ids = np.take_along_axis(ids, order, axis=2).transpose(1, 0, 2)  # [L, T, K] -> [T, L, K]
    return [ids[a:b] for a, b in itertools.pairwise(offsets)]


def esft_batches(seqs: list[np.ndarray], batch_tokens: int, gpus: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The sequences' tokens concatenated and cut into batches of ``batch_tokens``, each batch's tokens dealt to
    the ``gpus`` ranks in contiguous blocks: ``[(topk_ids [T, L, K], src_gpu [T])]`` (a partial tail is dropped)."""
    ids = np.concatenate(seqs)
    src = np.arange(batch_tokens) * gpus // batch_tokens
    return [(ids[i * batch_tokens:(i + 1) * batch_tokens], src) for i in range(len(ids) // batch_tokens)]


def batches_load(parts: list[tuple[np.ndarray, np.ndarray]], num_experts: int):  # type: ignore[no-untyped-def]
    """A token-level load from ``(topk_ids [T, L, K], src_gpu [T])`` batches, in order."""
    from moebalance.core.load import LoadMatrix
    from moebalance.core.trace import RoutingTrace

    ids = np.concatenate([p[0] for p in parts])
    src = np.concatenate([p[1] for p in parts])
    batch = np.repeat(np.arange(len(parts)), [len(p[0]) for p in parts])
    tr = RoutingTrace(ids, src, batch, num_experts=num_experts)
    return LoadMatrix(tr.counts(), tr)


def esft_from_args(doc: str, report: str) -> Path | None:
    """``--esft DIR`` (default ``$MOEBALANCE_ESFT_DIR``) from the command line; ``None``, having said that
    ``report`` is left as it is, when the ESFT files are not there."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--esft", type=Path,
                        help="folder with law_topk.npz and translation_topk.npz (default: $MOEBALANCE_ESFT_DIR)")
    folder = esft_folder(parser.parse_args().esft)
    if folder is None:
        print(f"{Path(sys.argv[0]).stem}: skipped, no ESFT routing (give --esft DIR or MOEBALANCE_ESFT_DIR); "
              f"{report} left as it is")
    return folder
