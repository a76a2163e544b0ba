"""``moebalance calibrate``: the compute model's constants fitted to measured grouped-GEMM times, from a file or
measured here (``--measure``: the local GPU's grouped GEMM and, under torchrun, the all-to-all between the ranks)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from moebalance.app.console import check_out, err, out, progress
from moebalance.core.errors import InputError
from moebalance.cost.calibrate import fit, read_measurements, write_calibration
from moebalance.cost.hardware import GPUS, GpuSpec, get_gpu
from moebalance.cost.time import Calibration

__all__ = ["add_parser", "run"]

#: The expert shapes the GEMM sweep measures, ``(H, F)``: DeepSeek-V3's, Qwen3-30B-A3B's, DeepSeek-V2-Lite's.
SWEEP_SHAPES = ((7168, 2048), (2048, 768), (2048, 1408))
SWEEP_EXPERTS = (1, 8, 32)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model's compute constants to measured grouped-GEMM times, or "
                                         "measure them here (--measure)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--measurements", help="CSV from bench/bench_gemm.py")
    source.add_argument("--measure", action="store_true",
                        help="measure here: the grouped GEMM on this machine's GPU (bf16) and, under torchrun, the "
                             "all-to-all between the ranks (link bandwidths and latency); writes a profile")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the GPU that was measured (required but for a links-only "
                                                      "--measure on CPU ranks)")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="the measured GEMMs' precision (default bf16): fp8 fits the shares of the GPU's FP8 peak")
    p.add_argument("--max-message-kib", type=int, default=16384,
                   help="--measure: the largest message a rank sends each peer in the all-to-all sweep (default 16384)")
    p.add_argument("--runs", type=int, default=5, help="--measure: repeats of each run, the median kept (default 5)")
    p.add_argument("--out", required=True, help="calibration .json for --calibration of every command that prices")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Fit the compute model's constants to measured grouped-GEMM times and write them as JSON."""
    dest = check_out(args.out, ".json")
    if args.measure:
        _measure(args, dest)
        return
    if args.gpu is None:
        raise InputError("--measurements needs --gpu: the GPU that was measured")
    gpu = get_gpu(args.gpu)
    measured = read_measurements(args.measurements)
    calibration, error, regimes = fit(measured, gpu, precision=args.precision, label=repr(str(args.measurements)),
                                      source=f"fitted to {Path(args.measurements).name} on {gpu.name}")
    write_calibration(dest, calibration, error)
    _report(dest, gpu, calibration, error, regimes, measured.seconds.size, args.precision)


def _report(dest: Path, gpu: GpuSpec, calibration: Calibration, error: float, regimes: tuple[int, int], runs: int,
            precision: str) -> None:
    by_flops, by_memory = regimes
    tile = f"{calibration.tile_rows}-row tiles" if calibration.tile_rows else "no tiles"
    out.print(f"wrote {dest}: {100 * calibration.flops_efficiency:.1f}% of {gpu.display_name}'s {precision.upper()} "
              f"peak, {100 * calibration.bandwidth_efficiency:.1f}% of its memory bandwidth, "
              f"{calibration.launch_us:.1f} us per grouped GEMM, {tile}; mean |log error| {error:.3f} over "
              f"{runs} runs ({by_flops} bound by FLOPs, {by_memory} by memory). "
              f"Use: moebalance cost ... --calibration {dest}")
    if not by_flops or not by_memory:
        err.print(f"warning: every run is bound by {'memory' if not by_flops else 'FLOPs'}: the "
                  f"{'FLOP/s' if not by_flops else 'bandwidth'} efficiency is not determined (kept at the largest value "
                  "that fits); measure more tokens per expert" + (" (prefill sizes)" if not by_flops else " (fewer)"))


def _measure(args: argparse.Namespace, dest: Path) -> None:
    """``--measure``: the GEMM sweep where there is a GPU, the all-to-all sweep under torchrun; rank 0 writes."""
    import torch

    from moebalance.runtime.launch import guarded, init_from_env, torchrun_env
    from moebalance.runtime.measure import GEMM_TOKENS, LINK_BYTES, fit_links, gemm_rows, link_rows

    if args.runs < 1 or args.max_message_kib < 2:
        raise InputError("--runs must be at least 1 and --max-message-kib at least 2")
    distributed = torchrun_env()
    cuda = torch.cuda.is_available()
    if not cuda and not distributed:
        raise InputError("calibrate --measure found no CUDA GPU here: the grouped-GEMM sweep needs one (run it on the "
                         "GPU machine), and the all-to-all sweep needs torchrun (torchrun --nproc-per-node N -m "
                         "moebalance calibrate --measure ...)")
    if cuda and args.gpu is None:
        raise InputError(f"--measure on a GPU needs --gpu, the spec its peaks are taken from "
                         f"({torch.cuda.get_device_name()} here; one of: {', '.join(sorted(GPUS))})")
    if args.precision != "bf16":
        raise InputError("--measure sweeps bf16 GEMMs; an FP8 sweep is not implemented: measure FP8 with your own "
                         "kernel and give the CSV with --measurements and --precision fp8")
    links = None
    rank = 0
    if distributed:
        import torch.distributed as dist

        rank, world, device = init_from_env()
        sizes = [s for s in LINK_BYTES if s <= args.max_message_kib * 1024] or [1024, 2048]
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        classes = int(local > 1) + int(world > local)  # intra-node peers, other nodes
        with progress() as bar, guarded():
            task = bar.add_task("all-to-all sweep", total=classes * len(sizes))
            rows = link_rows(rank, world, local, device, sizes=sizes, runs=args.runs,
                             on_done=lambda: bar.advance(task))
        dist.destroy_process_group()
        links = fit_links(rows)
        if rank != 0:
            return
    cal = Calibration(source="published peaks; links measured" if not cuda else "measured")
    error: float | None = None  # links only: no GEMM fitted, no error to record
    regimes, runs = (0, 0), 0
    if cuda:
        gpu = get_gpu(args.gpu)
        device = torch.device("cuda", torch.cuda.current_device())
        total = len(SWEEP_SHAPES) * len(SWEEP_EXPERTS) * len(GEMM_TOKENS)
        with progress() as bar:
            task = bar.add_task("grouped-GEMM sweep", total=total)
            rows = gemm_rows(device, torch.bfloat16, SWEEP_SHAPES, SWEEP_EXPERTS, GEMM_TOKENS, args.runs,
                             on_done=lambda: bar.advance(task))
        with tempfile.TemporaryDirectory(prefix="moebalance-measure-") as tmp:
            csv_path = Path(tmp) / "gemm.csv"
            csv_path.write_text("experts,tokens_per_expert,hidden_size,ffn_size,seconds\n" + "".join(
                f"{r['experts']},{r['tokens_per_expert']},{r['hidden_size']},{r['ffn_size']},{r['seconds']!r}\n"
                for r in rows))
            measured = read_measurements(csv_path)
        cal, error, regimes = fit(measured, gpu, source=f"measured on {gpu.name}")
        runs = measured.seconds.size
    if links is not None:
        intra, inter = links.get("intra_node"), links.get("inter_node")
        latencies = [f.latency_us for f in links.values()]
        cal = dataclasses.replace(cal, intra_node_gbs=intra.gbs if intra else 0.0,
                                  inter_node_gbs=inter.gbs if inter else 0.0, a2a_latency_us=max(latencies))
        for f in links.values():
            out.print(f"{f.link.replace('_', '-')}: {f.gbs:.2f} GB/s per rank and direction, {f.latency_us:.1f} us "
                      f"per phase (mean |log error| {f.error:.3f})")
    write_calibration(dest, cal, error)
    if cuda and error is not None:
        _report(dest, get_gpu(args.gpu), cal, error, regimes, runs, "bf16")
    else:
        out.print(f"wrote {dest}: links measured between the ranks; the grouped GEMM stays at the published peaks (no "
                  f"GPU here). Use: --calibration {dest}")
