"""Measure what a profile holds on the user's own machine (``moebalance calibrate --measure``, docs/design.md,
"Cost model"): a grouped-GEMM sweep on the local GPU, and an all-to-all sweep between the ranks of a torchrun launch.

**Grouped GEMM** (:func:`gemm_rows`): for each expert shape ``H x F`` (SwiGLU: ``w1, w3 [H, F]``, ``w2 [F, H]``), each
count of experts and each count of rows per expert (around the M-tile boundaries, where a kernel's time steps), the
median seconds of the three products over all experts: ``torch._grouped_mm`` where the device has it (Hopper and
newer in bf16), else one matrix product per expert. Each run reads a fresh set of experts, so that no run finds
another's weights in cache. The rows are what ``moebalance calibrate`` fits.

**All-to-all** (:func:`link_rows`): every rank sends ``s`` bytes to each peer of one class (its own node's other
ranks, or the other nodes' ranks) in one ``all_to_all_single``, for a sweep of ``s``; a phase lasts as long as its
slowest rank (the max over ranks of the median of repeats). :func:`fit_links` fits ``t = latency + bytes / bandwidth``
per class by least squares over the sizes, ``bytes`` being what one rank sends in the phase.

Nodes are torchrun's: ``LOCAL_WORLD_SIZE`` ranks a node, rank ``r`` on node ``r // LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moebalance.core.errors import InputError

__all__ = ["GEMM_TOKENS", "LINK_BYTES", "LinkFit", "fit_links", "gemm_rows", "link_rows"]

#: Rows per expert the GEMM sweep runs: decode sizes, then both sides of each 128-row tile boundary up to 513, then
#: prefill sizes.
GEMM_TOKENS = (1, 4, 16, 64, 127, 128, 129, 255, 256, 257, 383, 384, 385, 511, 512, 513, 1024, 4096)
#: Bytes a rank sends each peer in the all-to-all sweep (1 KiB to 16 MiB).
LINK_BYTES = tuple(2**k for k in range(10, 25, 2))


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [U * rows, A] @ w[e] [A, B]`` for each expert's block of rows: one grouped kernel where the device has it."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None and x.is_cuda:
        return grouped(x, w, offs=offsets)
    return torch.cat([x[e * rows:(e + 1) * rows] @ w[e] for e in range(w.shape[0])])


def gemm_rows(device: torch.device, dtype: torch.dtype, shapes: Sequence[tuple[int, int]], experts: Sequence[int],
              tokens: Sequence[int], runs: int = 5, on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """One row per ``(H, F)``, experts, rows per expert: ``experts, tokens_per_expert, hidden_size, ffn_size,
    seconds`` (the median of ``runs``), the CSV ``moebalance calibrate`` fits. ``on_done`` is called after each."""
    if runs < 1:
        raise InputError(f"runs ({runs}) must be at least 1")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for H, F in shapes:
        for u in experts:
            # two sets of weights, alternated: a run never finds the last run's experts in cache
            sets = [(torch.randn(u, H, 2 * F, device=device, dtype=dtype) / H**0.5,
                     torch.randn(u, F, H, device=device, dtype=dtype) / F**0.5) for _ in range(2)]
            for t in tokens:
                x = torch.randn(u * t, H, device=device, dtype=dtype)
                offsets = torch.arange(1, u + 1, device=device, dtype=torch.int32) * t

                def once(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor = x, offsets: torch.Tensor = offsets,
                         t: int = t) -> torch.Tensor:
                    gate, up = _grouped(x, w13, offsets, t).chunk(2, dim=-1)
                    return _grouped(torch.nn.functional.silu(gate) * up, w2, offsets, t)

                once(*sets[0])  # warm-up: kernels chosen and compiled
                times = []
                for i in range(runs):
                    sync()
                    t0 = time.perf_counter()
                    once(*sets[(i + 1) % 2])
                    sync()
                    times.append(time.perf_counter() - t0)
                out.append({"experts": u, "tokens_per_expert": t, "hidden_size": H, "ffn_size": F,
                            "seconds": statistics.median(times)})
                if on_done is not None:
                    on_done()
            del sets
    return out


def _classes(rank: int, world_size: int, local_world_size: int) -> dict[str, list[int]]:
    node = rank // local_world_size
    same = [p for p in range(world_size) if p != rank and p // local_world_size == node]
    other = [p for p in range(world_size) if p // local_world_size != node]
    return {"intra_node": same, "inter_node": other}


def link_rows(rank: int, world_size: int, local_world_size: int, device: torch.device, group: Any = None,
              sizes: Sequence[int] = LINK_BYTES, runs: int = 5,
              on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """On every rank of the group: one row per link class present (``intra_node``, ``inter_node``) and size,
    ``link, bytes_per_peer, peers, bytes_sent, seconds``, the seconds the slowest rank took (the same rows on every
    rank). Every rank must call it with the same arguments."""
    import torch.distributed as dist

    if world_size < 2:
        raise InputError("the all-to-all sweep needs at least 2 ranks: run it under torchrun --nproc-per-node 2 or "
                         "more")
    if local_world_size < 1 or world_size % local_world_size:
        raise InputError(f"LOCAL_WORLD_SIZE ({local_world_size}) must divide the {world_size} ranks (ranks per node)")
    mine = _classes(rank, world_size, local_world_size)
    out = []
    for link in ("intra_node", "inter_node"):
        # every rank has the same peers of each class (nodes alike): a class one rank lacks, all lack
        if not mine[link]:
            continue
        for size in sizes:
            n = max(size // 4, 1)  # float32 elements per peer
            splits = [n if p in mine[link] else 0 for p in range(world_size)]
            send = torch.ones(sum(splits), device=device)
            recv = torch.empty(sum(splits), device=device)
            times = []
            for _ in range(runs + 1):  # the first is a warm-up
                dist.barrier(group=group)
                t0 = time.perf_counter()
                dist.all_to_all_single(recv, send, splits, splits, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            slowest = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            out.append({"link": link, "bytes_per_peer": 4 * n, "peers": len(mine[link]),
                        "bytes_sent": 4 * n * len(mine[link]), "seconds": float(slowest.item())})
            if on_done is not None:
                on_done()
    return out


@dataclass(frozen=True, slots=True)
class LinkFit:
    """``t = latency + bytes / bandwidth`` for one link class: GB/s per rank and direction, microseconds."""

    link: str
    gbs: float
    latency_us: float
    #: The mean absolute log error of the fit over the sizes.
    error: float


def fit_links(rows: Sequence[dict[str, Any]]) -> dict[str, LinkFit]:
    """Fit each link class of :func:`link_rows`'s rows (at least two sizes each); a class whose time grows by less
    than 1% of its mean over the sizes is a one-line error (the sizes were too small to see its bandwidth)."""
    fits = {}
    for link in sorted({r["link"] for r in rows}):
        sel = [r for r in rows if r["link"] == link]
        b = np.array([r["bytes_sent"] for r in sel], dtype=np.float64)
        t = np.array([r["seconds"] for r in sel], dtype=np.float64)
        if np.unique(b).size < 2:
            raise InputError(f"{link}: the all-to-all sweep needs at least two message sizes to fit a bandwidth")
        slope, intercept = np.polyfit(b, t, 1)
        if slope * (b.max() - b.min()) < 0.01 * t.mean():  # the bytes add under 1% over the sweep: no bandwidth seen
            raise InputError(f"{link}: the all-to-all's time does not grow with its bytes over "
                             f"{int(b.min()):,}-{int(b.max()):,} bytes: give larger messages (--max-message-kib)")
        latency = max(float(intercept), 0.0)
        modelled = latency + b * slope
        error = float(np.abs(np.log(modelled / t)).mean())
        fits[link] = LinkFit(link=link, gbs=1.0 / slope / 1e9, latency_us=latency * 1e6, error=error)
    return fits
