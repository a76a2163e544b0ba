"""Grouped-GEMM time against tokens per expert: the measurements ``moebalance calibrate`` fits the compute model to.

For each expert shape (``--shape``: a model preset's routed expert, ``H x F``), each number of experts touched
(1, 8, 32 by default) and each number of tokens per expert (1 to 1,024 in powers of four on a GPU), the experts run
their gated FFNs as one grouped GEMM, timed as the median of repeated runs (CUDA events on a GPU). Two kernels
(``--kernel``):

- ``bmm``: batched matrix products over the experts (``x @ W_gate``, ``x @ W_up``, SiLU, product, ``@ W_down``:
  three kernels whatever the number of experts, as a fused MoE kernel launches once), every expert on the same
  number of tokens (a ragged batch is padded to its largest expert);
- ``grouped_mm``: torch's grouped matrix product over rows sorted by expert with their group offsets
  (``torch.nn.functional.grouped_mm`` or ``torch._grouped_mm``), which takes a different number of tokens per expert
  without padding; on a GPU it needs bf16 and a recent torch, and :func:`check_kernel` says whether it runs here.

Each timed run reads weights that the previous runs did not leave in the GPU's cache: the weights are allocated in
as many copies as make up :data:`FLUSH_BYTES`, used in turn (a real decode step reads each layer's experts once,
cold). The shapes default to DeepSeek-V3's experts (H = 7168, F = 2048) in bf16 on a GPU; on a machine without one
the script runs in float32 on the CPU with a smaller FFN and fewer tokens, which calibrates nothing but checks the
script end to end.

Writes a CSV with columns experts,tokens_per_expert,hidden_size,ffn_size,seconds (what ``moebalance calibrate``
reads), then kernel and shape. Run on the GPU to model:
    python bench/bench_gemm.py --out gemm.csv [--shape deepseek-v3 --shape qwen3-30b-a3b]
    moebalance calibrate --measurements gemm.csv --gpu h100-80gb --out calibration.json
(``bench/gpu_check.py`` runs both, and more, in one command.)
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: Weights of the timed kernels are spread over at least this many bytes (about four times an H100's or H200's
#: L2 cache), so that no run finds the previous run's weights cached.
FLUSH_BYTES = 256 * 2**20
#: Kernel names, in order of preference for ragged groups.
KERNELS = ("grouped_mm", "bmm")
#: Columns of the measurement CSV: ``moebalance calibrate``'s, then the kernel and the shape's name.
CSV_COLUMNS = ("experts", "tokens_per_expert", "hidden_size", "ffn_size", "seconds", "kernel", "shape")


@dataclass(frozen=True, slots=True)
class Shape:
    """A routed expert's size: ``hidden`` (H) and ``ffn`` (F), with a name for reports."""

    name: str
    hidden: int
    ffn: int


def preset_shape(name: str) -> Shape:
    """``name`` as a model preset (its routed expert's ``H x F``), or literally ``HxF`` (e.g. ``1024x256``)."""
    if "x" in name and all(p.isdigit() for p in name.split("x", 1)):
        h, f = (int(p) for p in name.split("x", 1))
        if h < 1 or f < 1:
            raise SystemExit(f"--shape {name}: sizes must be positive")
        return Shape(name, h, f)
    from moebalance.models import MODELS

    spec = MODELS.get(name)
    if spec is None:
        raise SystemExit(f"--shape {name!r}: not a model preset ({', '.join(sorted(MODELS))}) nor HxF")
    return Shape(name, spec.hidden_size, spec.moe_intermediate_size)


def grouped_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``x [u, n, H]`` through ``u`` gated FFNs ``gate, up [u, H, F]``, ``down [u, F, H]``: three batched products."""
    return torch.bmm(torch.nn.functional.silu(torch.bmm(x, gate)) * torch.bmm(x, up), down)


def _grouped_mm() -> Callable[..., torch.Tensor] | None:
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


class WeightPool:
    """Weights of gated FFNs for timing, ``gate, up [N, H, F]``, ``down [N, F, H]`` (views of ``[N, F, H]`` /
    ``[N, H, F]`` storage when ``transposed``: the column-major layout grouped kernels prefer).

    :meth:`take` returns ``u`` consecutive experts, each call the next ``u`` of the pool (from the start again where
    they would run past its end). On a GPU the pool holds ``experts`` plus as many experts as make up ``flush_bytes``,
    so that between two reads of one expert at least ``flush_bytes`` of other weights were read: nothing a run reads
    was left in the cache by an earlier one. On the CPU it holds ``experts``."""

    def __init__(self, experts: int, hidden: int, ffn: int, device: torch.device, dtype: torch.dtype, *,
                 transposed: bool = False, flush_bytes: int = FLUSH_BYTES) -> None:
        per_expert = 3 * hidden * ffn * torch.tensor([], dtype=dtype).element_size()
        extra = math.ceil(flush_bytes / per_expert) if device.type == "cuda" else 0
        self.size = experts + extra
        N = self.size

        def make(rows: int, cols: int, scale: float) -> torch.Tensor:
            if transposed:  # [N, cols, rows] storage seen as [N, rows, cols]
                return (torch.randn(N, cols, rows, device=device, dtype=dtype) * scale).transpose(1, 2)
            return torch.randn(N, rows, cols, device=device, dtype=dtype) * scale

        self.gate, self.up = make(hidden, ffn, hidden ** -0.5), make(hidden, ffn, hidden ** -0.5)
        self.down = make(ffn, hidden, ffn ** -0.5)
        self._next = 0

    def take(self, u: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next ``u`` experts' ``(gate, up, down)``."""
        if not 0 < u <= self.size:
            raise ValueError(f"{u} experts asked of a pool of {self.size}")
        start = self._next if self._next + u <= self.size else 0
        self._next = start + u
        return self.gate[start:start + u], self.up[start:start + u], self.down[start:start + u]


def ragged_ffn(x_NH: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """Rows ``x [N, H]`` sorted by expert, expert ``i`` taking rows ``offs[i-1]:offs[i]`` (``int32 [u]``), through
    the ``u`` gated FFNs ``gate, up [u, H, F]``, ``down [u, F, H]``: three grouped products. ``[N, H]``."""
    mm = _grouped_mm()
    if mm is None:
        raise RuntimeError("this torch has no grouped_mm (torch.nn.functional.grouped_mm or torch._grouped_mm)")
    h = torch.nn.functional.silu(mm(x_NH, gate, offs=offs)) * mm(x_NH, up, offs=offs)
    return mm(h, down, offs=offs)


def reference_ffn(x_NH: torch.Tensor, tokens: Sequence[int], gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """:func:`ragged_ffn` one expert at a time, in float32: the check of the grouped kernels."""
    out, lo = [], 0
    for i, n in enumerate(tokens):
        x = x_NH[lo:lo + n].float()
        out.append((torch.nn.functional.silu(x @ gate[i].float()) * (x @ up[i].float())) @ down[i].float())
        lo += n
    return torch.cat(out)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a kernel is fed where it runs: weights stored transposed (``[N, F, H]`` seen as ``[N, H, F]``), and for
    ``grouped_mm`` one spare row after the last group's (for a build that wants the last offset below the rows)."""

    transposed: bool
    pad_row: bool = False


#: Layouts tried, in order, by :func:`usable_kernels`.
LAYOUTS = (Layout(True), Layout(False), Layout(True, True), Layout(False, True))


class RaggedRun:
    """One grouped GEMM over ``tokens[i]`` rows for expert ``i`` (``tokens`` all positive), with ``kernel``, its
    inputs prepared once so that :meth:`__call__` launches only the GEMM's kernels. ``x_pool`` holds at least
    ``sum(tokens) + 1`` rows (``bmm``: ``len(tokens) * max(tokens)``)."""

    def __init__(self, kernel: str, tokens: Sequence[int], x_pool: torch.Tensor,
                 weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, pad_row: bool = False) -> None:
        self.kernel = kernel
        self.weights = weights
        n, H = int(sum(tokens)), x_pool.shape[-1]
        if kernel == "grouped_mm":
            self.x = x_pool.reshape(-1, H)[:n + int(pad_row)]
            self.offs = torch.tensor(list(_cumsum(tokens)), dtype=torch.int32, device=x_pool.device)
        elif kernel == "bmm":  # every expert padded to the largest
            self.x = x_pool.reshape(-1, H)[:len(tokens) * max(tokens)].reshape(len(tokens), max(tokens), H)
        else:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")

    def __call__(self) -> torch.Tensor:
        gate, up, down = self.weights
        if self.kernel == "grouped_mm":
            return ragged_ffn(self.x, self.offs, gate, up, down)
        return grouped_ffn(self.x, gate, up, down)


def _cumsum(values: Iterable[int]) -> Iterable[int]:
    total = 0
    for v in values:
        total += int(v)
        yield total


def check_kernel(kernel: str, device: torch.device, dtype: torch.dtype, layout: Layout) -> str | None:
    """``None`` if ``kernel`` runs here on ragged groups with ``layout`` and matches :func:`reference_ffn`, else why
    not (one line)."""
    try:
        H, F, tokens = 64, 32, [3, 1, 7, 5]
        n = sum(tokens)
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(n + 1, H, generator=gen).to(device, dtype)
        w = WeightPool(len(tokens), H, F, device, dtype, transposed=layout.transposed,
                       flush_bytes=0).take(len(tokens))
        if kernel == "bmm":
            pad = torch.zeros(len(tokens), max(tokens), H, device=device, dtype=dtype)
            lo = 0
            for i, n in enumerate(tokens):
                pad[i, :n] = x[lo:lo + n]
                lo += n
            y = grouped_ffn(pad, *w)
            got = torch.cat([y[i, :n] for i, n in enumerate(tokens)])
        else:
            got = RaggedRun(kernel, tokens, x, w, pad_row=layout.pad_row)()[:n]
        want = reference_ffn(x, tokens, *w)
        if got.shape != want.shape:
            return f"{kernel}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        err = float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6))
        tol = 0.05 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        return None if err <= tol else f"{kernel}: relative error {err:.3g} against the per-expert reference"
    except Exception as exc:  # any failure means: not usable here
        text = str(exc).strip().splitlines()
        return f"{kernel}: {type(exc).__name__}: {text[0] if text else ''}"[:300]


def usable_kernels(device: torch.device, dtype: torch.dtype) -> tuple[dict[str, Layout], dict[str, str]]:
    """``({kernel: its layout}, {kernel: why not})`` for the kernels that run here, preferred first; each kernel
    with the first of :data:`LAYOUTS` that runs (``bmm`` needs no spare row)."""
    ok: dict[str, Layout] = {}
    why: dict[str, str] = {}
    for kernel in KERNELS:
        errors = []
        for layout in LAYOUTS if kernel == "grouped_mm" else LAYOUTS[:2]:
            e = check_kernel(kernel, device, dtype, layout)
            if e is None:
                ok[kernel] = layout
                break
            errors.append(e)
        else:
            why[kernel] = " / ".join(errors)
    return ok, why


def median_seconds(fn: Callable[[], object], device: torch.device, runs: int) -> float:
    """Median of ``runs`` timed calls after one untimed one (CUDA events on a GPU, wall time on the CPU)."""
    fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_grid(shapes: Sequence[Shape], experts: Sequence[int], tokens: Sequence[int], kernels: dict[str, Layout],
                 device: torch.device, dtype: torch.dtype, runs: int, *, deadline: float = math.inf,
                 log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], bool]:
    """One row (:data:`CSV_COLUMNS`) per shape, kernel, experts and tokens per expert, and whether the grid was
    cut short by ``deadline`` (a ``time.monotonic()`` value). Weights are made once per shape, kernel and number
    of experts; inputs once per shape and number of experts."""
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for u in experts:
            x_pool = torch.randn(u * max(tokens) + 1, shape.hidden, device=device, dtype=dtype)
            for kernel, layout in kernels.items():
                if time.monotonic() > deadline:
                    return rows, True
                weights = WeightPool(u, shape.hidden, shape.ffn, device, dtype, transposed=layout.transposed)
                for n in tokens:
                    if time.monotonic() > deadline:
                        return rows, True
                    run = RaggedRun(kernel, [n] * u, x_pool, weights.take(u), pad_row=layout.pad_row)

                    def once(run: RaggedRun = run, weights: WeightPool = weights, u: int = u) -> None:
                        run.weights = weights.take(u)  # experts the last runs did not touch
                        run()

                    seconds = median_seconds(once, device, runs)
                    rows.append({"experts": u, "tokens_per_expert": n, "hidden_size": shape.hidden,
                                 "ffn_size": shape.ffn, "seconds": seconds, "kernel": kernel, "shape": shape.name})
                    log(f"{shape.name} {kernel}: {u} experts x {n} tokens: {seconds * 1e6:.1f} us")
                del weights
            del x_pool
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, False


def write_rows(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """The measurement CSV (:data:`CSV_COLUMNS`); seconds with 9 significant digits."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow([r["experts"], r["tokens_per_expert"], r["hidden_size"], r["ffn_size"], f"{r['seconds']:.9g}",
                        r["kernel"], r["shape"]])


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive whole numbers")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", required=True, help="CSV to write")
    parser.add_argument("--shape", action="append", help="a model preset (its routed expert) or HxF; repeatable "
                                                         "(default deepseek-v3 on a GPU, 1024x256 on the CPU)")
    parser.add_argument("--hidden", type=int, help="hidden size of one HxF shape (overrides --shape)")
    parser.add_argument("--ffn", type=int, help="expert FFN size of that shape")
    parser.add_argument("--experts", type=_ints, help="experts touched, comma-separated (default 1,8,32)")
    parser.add_argument("--tokens", type=_ints, help="tokens per expert, comma-separated (default 1,4,...,1024 on a "
                                                     "GPU, 1,8,64 on the CPU)")
    parser.add_argument("--kernel", choices=KERNELS, action="append", help="kernels to time (default bmm)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.hidden or args.ffn:
        hidden, ffn = args.hidden or (7168 if cuda else 1024), args.ffn or (2048 if cuda else 256)
        shapes = [Shape(f"{hidden}x{ffn}", hidden, ffn)]
    else:
        shapes = [preset_shape(s) for s in (args.shape or (["deepseek-v3"] if cuda else ["1024x256"]))]
    tokens = args.tokens or ([4**i for i in range(6)] if cuda else [1, 8, 64])
    usable, why = usable_kernels(device, dtype)
    kernels = {}
    for k in args.kernel or ["bmm"]:
        if k not in usable:
            raise SystemExit(f"kernel {k} does not run here: {why.get(k, '')}")
        kernels[k] = usable[k]
    rows, _ = measure_grid(shapes, args.experts or [1, 8, 32], tokens, kernels, device, dtype, args.runs)
    write_rows(args.out, rows)
    print(f"wrote {args.out} ({device.type}, {dtype})")


if __name__ == "__main__":
    main()
