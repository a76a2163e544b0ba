"""Grouped-GEMM time against tokens per expert: the measurements ``moebalance calibrate`` fits the compute model to.

For each number of experts touched (1, 8, 32) and tokens per expert (1 to 1,024 in powers of four on a GPU), the
experts run their gated FFNs as one grouped GEMM: batched matrix products over the experts (``x @ W_gate``,
``x @ W_up``, SiLU, product, ``@ W_down``: three kernels whatever the number of experts, as a fused MoE kernel
launches once), timed as the median of repeated runs (CUDA events on a GPU). The shapes default to DeepSeek-V3's
experts (H = 7168, F = 2048) in bf16 on a GPU; on a machine without one the script runs in float32 on the CPU with a
smaller FFN and fewer tokens, which calibrates nothing but checks the script end to end.

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


def grouped_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``x [u, n, H]`` through ``u`` gated FFNs ``gate, up [u, H, F]``, ``down [u, F, H]``: three batched products."""
    return torch.bmm(torch.nn.functional.silu(torch.bmm(x, gate)) * torch.bmm(x, up), down)


def measure(experts: int, tokens: int, hidden: int, ffn: int, device: torch.device, dtype: torch.dtype,
            runs: int) -> float:
    gate, up = (torch.randn(experts, hidden, ffn, device=device, dtype=dtype) for _ in range(2))
    down = torch.randn(experts, ffn, hidden, device=device, dtype=dtype)
    x = torch.randn(experts, tokens, hidden, device=device, dtype=dtype)

    def once() -> None:
        grouped_ffn(x, gate, up, down)

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
    max_tokens = 1024 if cuda else 64
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
