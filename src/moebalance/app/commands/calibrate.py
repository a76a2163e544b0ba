"""``moebalance calibrate``: the compute model's constants fitted to measured grouped-GEMM times."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moebalance.app.console import check_out, err, out
from moebalance.cost.calibrate import fit, read_measurements, write_calibration
from moebalance.cost.hardware import GPUS, get_gpu

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model's compute constants to measured grouped-GEMM times")
    p.add_argument("--measurements", required=True, help="CSV from bench/bench_gemm.py")
    p.add_argument("--gpu", required=True, choices=sorted(GPUS), help="the GPU that was measured")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="the measured GEMMs' precision (default bf16): fp8 fits the shares of the GPU's FP8 peak")
    p.add_argument("--out", required=True, help="calibration .json for cost/compare --calibration")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Fit the compute model's constants to measured grouped-GEMM times and write them as JSON."""
    dest = check_out(args.out, ".json")
    gpu = get_gpu(args.gpu)
    measured = read_measurements(args.measurements)
    calibration, error, (by_flops, by_memory) = fit(measured, gpu, precision=args.precision,
                                                    source=f"fitted to {Path(args.measurements).name} on {gpu.name}")
    write_calibration(dest, calibration, error)
    out.print(f"wrote {dest}: {100 * calibration.flops_efficiency:.1f}% of {gpu.display_name}'s {args.precision.upper()} peak, "
              f"{100 * calibration.bandwidth_efficiency:.1f}% of its memory bandwidth, "
              f"{calibration.launch_us:.1f} us per grouped GEMM; mean |log error| {error:.3f} over "
              f"{measured.seconds.size} runs ({by_flops} bound by FLOPs, {by_memory} by memory). "
              f"Use: moebalance cost ... --calibration {dest}")
    if not by_flops or not by_memory:
        err.print(f"warning: every run is bound by {'memory' if not by_flops else 'FLOPs'}: the "
                  f"{'FLOP/s' if not by_flops else 'bandwidth'} efficiency is not determined (kept at the largest value "
                  "that fits); measure more tokens per expert" + (" (prefill sizes)" if not by_flops else " (fewer)"))
