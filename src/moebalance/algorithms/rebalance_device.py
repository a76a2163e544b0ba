"""Libra's Adaptive Token Rebalancer (Alg. 2) on the routing's device: one Triton program per ``(batch, layer)``.

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs.

The ``rebalance`` router's count-level split (:func:`moebalance.algorithms.rebalance.split_counts`, compiled for
the CPU) as a device kernel, for an engine that balances where its routing is: the counts ``[B, L, E]`` and the
plan's copies ``[L, E, G]`` stay on their device, the start (each expert's picks dealt over its copies in GPU
order, the ``uniform`` router's whole-token deal) is a few batched torch operations, and the moves run in one
kernel launch with a program per ``(batch, layer)``: no host synchronisation inside, so the call can be captured
in a CUDA graph. The loads equal the CPU path's, ties included (``tests/test_rebalance_device.py``).

Each program follows the printed loop of Alg. 2 over whole ``[G, E]`` tiles held by the program: the most loaded
GPU above ``floor(B)`` not yet set aside is the source ``g_s``; for every expert at once, the least loaded other
holder ``g_d`` (the lower id on ties) and the move's cap (``floor(B) - load[g_d]``, else, not strict, half the
gap); the expert moved is the one with most of ``g_s``'s remote picks among those whose cap is at least one (the
lower id on ties), by ``min(picks, cap)``; a move restarts the search at the most loaded GPU, and a source with no
such expert is set aside until the next move. The loop ends when no GPU is above ``floor((1 + eps) B)`` or no
source can move. (The CPU kernel finds the same moves with sorted lists and a tournament tree; a GPU program
does the plain search on a tile per step.)

On a CPU tensor the same kernel runs in Triton's interpreter (slow: for tests, not for serving). Triton is an
optional dependency (``pip install moebalance[device]``); without it the call is a one-line error.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any

from moebalance.core.errors import InputError

if TYPE_CHECKING:
    import torch

__all__ = ["kernel", "split_counts", "start_split"]


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


if "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") is None and not _cuda():
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: Triton's library kernels must load as the interpreter runs them
try:
    import triton.language as tl
except ImportError:  # an optional dependency: kernel() says how to install it
    tl = None



def start_split(counts: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """``int64 [B, L, G, E]``: each expert's picks ``counts [B, L, E]`` dealt over its copies ``copies [L, E, G]`` in
    GPU order as whole picks: copy ``j`` of ``r`` takes ``n // r``, one more if ``j < n mod r`` (a GPU with two
    copies takes two shares); the start of :func:`moebalance.algorithms.rebalance.start_split`, batched."""
    import torch

    cp = copies.to(torch.int64).permute(0, 2, 1)  # [L, G, E]
    held = torch.clamp(cp.sum(dim=1), min=1)[None, :, None, :]  # [1, L, 1, E]
    before = (torch.cumsum(cp, dim=1) - cp)[None]  # copies on lower GPUs
    n = counts.to(torch.int64)[:, :, None, :]  # [B, L, 1, E]
    extra = torch.minimum(torch.clamp(n % held - before, min=0), cp[None])
    return cp[None] * (n // held) + extra


def _alg2(remote_ptr, copies_ptr, loads_ptr, t0_ptr, limit_ptr, L, G, E,
          strict: tl.constexpr, GP: tl.constexpr, EP: tl.constexpr):  # pragma: no cover - a Triton kernel
    """One ``(batch, layer)`` per program: ``remote [G, E]`` moved in place, ``loads [G]`` out."""
    pid = tl.program_id(0)
    g = tl.arange(0, GP)
    e = tl.arange(0, EP)
    gm = g < G
    em = e < E
    m2 = gm[:, None] & em[None, :]
    tile = g[:, None] * E + e[None, :]
    remote = tl.load(remote_ptr + pid * G * E + tile, mask=m2, other=0)
    holds = tl.load(copies_ptr + (pid % L) * G * E + tile, mask=m2, other=0) > 0
    movable = tl.sum(holds.to(tl.int32), axis=0) >= 2  # [EP]: only experts with another holder move
    loads = tl.sum(remote, axis=1)  # [GP]
    t0 = tl.load(t0_ptr + pid)
    limit = tl.load(limit_ptr + pid)
    big = 1 << 62
    aside = g < 0  # sources set aside since the last move: none
    go = tl.sum(((loads > limit) & gm).to(tl.int32), axis=0) > 0
    while go:
        cand = (loads > t0) & gm & (aside == 0)
        found = tl.sum(cand.to(tl.int32), axis=0) > 0
        most = tl.max(tl.where(cand, loads, -1), axis=0)
        s = tl.min(tl.where(cand & (loads == most), g, GP), axis=0)  # the source: most loaded, lower id
        ls = tl.sum(tl.where(g == s, loads, 0), axis=0)
        r = tl.sum(tl.where(g[:, None] == s, remote, 0), axis=0)  # [EP]: the source's remote picks
        other = holds & (g[:, None] != s)
        ld = tl.min(tl.where(other, loads[:, None], big), axis=0)  # [EP]: least loaded other holder's load
        d = tl.min(tl.where(other & (loads[:, None] == ld[None, :]), g[:, None], GP), axis=0)
        cap = t0 - ld
        if not strict:
            cap = tl.where(cap < 1, (ls - ld) // 2, cap)
        valid = (r > 0) & movable & (cap >= 1) & em
        top = tl.max(tl.where(valid, r, -1), axis=0)
        x = tl.min(tl.where(valid & (r == top), e, EP), axis=0)  # the expert: most picks, lower id
        moved = found & (top > 0)
        amount = tl.where(moved, tl.sum(tl.where(e == x, tl.minimum(r, cap), 0), axis=0), 0)
        dx = tl.sum(tl.where(e == x, d, 0), axis=0)
        at = e[None, :] == x
        remote = remote - tl.where((g[:, None] == s) & at, amount, 0) + tl.where((g[:, None] == dx) & at,
                                                                               amount, 0)
        loads = loads - tl.where(g == s, amount, 0) + tl.where(g == dx, amount, 0)
        aside = tl.where(moved, g < 0, aside | ((g == s) & found))
        go = found & (tl.sum(((loads > limit) & gm).to(tl.int32), axis=0) > 0)
    tl.store(loads_ptr + pid * G + g, loads, mask=gm)
    tl.store(remote_ptr + pid * G * E + tile, remote, mask=m2)



@functools.cache
def kernel(interpret: bool) -> Any:
    """The Triton kernel, compiled for a GPU or, with ``interpret``, run by Triton's interpreter (CPU tensors)."""
    if tl is None:
        raise InputError("the device rebalancer needs Triton: pip install 'moebalance[device]' (Linux x86-64 or "
                         "aarch64; or route on the host with the rebalance router)")
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if interpret != bool(triton.knobs.runtime.interpret):
        raise InputError("the device rebalancer runs on CPU tensors only in Triton's interpreter and on GPU tensors "
                         "only without it; Triton chose when it was imported (TRITON_INTERPRET="
                         f"{os.environ.get('TRITON_INTERPRET', '')!r}): give tensors on "
                         f"{'a GPU' if not interpret else 'the CPU'}, or set TRITON_INTERPRET before importing Triton")
    return InterpretedFunction(_alg2) if interpret else triton.jit(_alg2)


def split_counts(counts: torch.Tensor, copies: torch.Tensor, eps: float = 0.0, strict: bool = False) -> torch.Tensor:
    """``int64 [B, L, G]``: the GPU loads after Alg. 2 of counts ``int [B, L, E]`` on copies ``int [L, E, G]``, on
    their device (equal to :func:`moebalance.algorithms.rebalance.split_counts`).

    No host synchronisation: the call can be captured in a CUDA graph. ``eps`` and ``strict`` as the ``rebalance``
    router takes them."""
    import torch

    if counts.dim() != 3 or copies.dim() != 3 or counts.shape[1:] != copies.shape[:2]:
        raise InputError(f"counts [B, L, E] {tuple(counts.shape)} and copies [L, E, G] {tuple(copies.shape)} do not "
                         "match")
    if counts.device != copies.device:
        raise InputError(f"counts are on {counts.device} and copies on {copies.device}; give both on one device")
    if eps < 0:
        raise InputError(f"eps ({eps}) must be >= 0")
    B, L, E = counts.shape
    G = copies.shape[2]
    remote = start_split(counts, copies).contiguous()  # [B, L, G, E]
    target = counts.to(torch.float64).sum(dim=2) / G  # [B, L]: Libra's B, the mean load
    t0 = torch.floor(target).to(torch.int64).reshape(-1).contiguous()
    limit = torch.floor((1.0 + eps) * target).to(torch.int64).reshape(-1).contiguous()
    held = copies.to(torch.int64).permute(0, 2, 1).contiguous()  # [L, G, E]
    loads = torch.empty(B * L * G, dtype=torch.int64, device=counts.device)
    if B * L:
        gp, ep = 1 << max(0, (G - 1).bit_length()), 1 << max(0, (E - 1).bit_length())
        kernel(counts.device.type == "cpu")[(B * L,)](remote, held, loads, t0, limit, L, G, E, strict=bool(strict),
                                                      GP=gp, EP=ep)
    return loads.reshape(B, L, G)
