"""Grouped-GEMM time against tokens per expert: the measurements ``moebalance calibrate`` fits the compute model to.

For each number of experts touched (1, 8, 32) and tokens per expert (1 to 2,048, powers of two), every expert runs
its gated FFN (``x @ W_gate``, ``x @ W_up``, SiLU, product, ``@ W_down``) on its tokens, one expert after another as
a grouped GEMM without a fused kernel does; the time of all of them together is the median of repeated runs
(CUDA events on a GPU). The shapes default to DeepSeek-V3's experts (H = 7168, F = 2048) in bf16 on a GPU; on a
machine without one the script runs in float32 on the CPU with a smaller FFN, which calibrates nothing but checks
the script end to end.

Writes a CSV with columns experts,tokens_per_expert,hidden_size,ffn_size,seconds. Run on the GPU to model:
    python bench/bench_gemm.py --out gemm.csv
    moebalance calibrate --measurements gemm.csv --gpu h100-80gb --out calibration.json
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down


def measure(experts: int, tokens: int, hidden: int, ffn: int, device: torch.device, dtype: torch.dtype,
            runs: int) -> float:
    weights = [(torch.randn(hidden, ffn, device=device, dtype=dtype), torch.randn(hidden, ffn, device=device, dtype=dtype),
                torch.randn(ffn, hidden, device=device, dtype=dtype)) for _ in range(experts)]
    xs = [torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(experts)]

    def once() -> None:
        for x, (g, u, d) in zip(xs, weights, strict=True):
            expert_ffn(x, g, u, d)

    once()  # warm-up
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="CSV to write")
    parser.add_argument("--hidden", type=int, help="hidden size (default 7168 on a GPU, 1024 on the CPU)")
    parser.add_argument("--ffn", type=int, help="expert FFN size (default 2048 on a GPU, 256 on the CPU)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden = args.hidden or (7168 if cuda else 1024)
    ffn = args.ffn or (2048 if cuda else 256)
    max_tokens = 2048 if cuda else 64
    rows = []
    for experts in (1, 8, 32):
        tokens = 1
        while tokens <= max_tokens:
            seconds = measure(experts, tokens, hidden, ffn, device, dtype, args.runs)
            rows.append((experts, tokens, hidden, ffn, seconds))
            print(f"{experts} experts x {tokens} tokens: {seconds * 1e6:.1f} us", flush=True)
            tokens *= 4 if cuda else 8
    with open(args.out, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["experts", "tokens_per_expert", "hidden_size", "ffn_size", "seconds"])
        w.writerows(rows)
    print(f"wrote {args.out} ({device.type}, {dtype})")


if __name__ == "__main__":
    main()
