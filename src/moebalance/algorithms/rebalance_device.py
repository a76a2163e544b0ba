"""Libra's Adaptive Token Rebalancer (Alg. 2) on the routing's device: one Triton program per ``(batch, layer)``.

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs, ``T`` tokens, ``K`` picks per token.

The ``rebalance`` router as device code, for an engine that balances where its routing is: the count-level split
(:func:`split_counts`, equal to :func:`moebalance.algorithms.rebalance.split_counts`) and the token routes of a
layer (:func:`route_tokens`, equal to :func:`moebalance.algorithms.rebalance.route_tokens`). The inputs stay on
their device; the start (each expert's picks dealt over its copies in GPU order, the ``uniform`` router's
whole-token deal) and the hand-out of shares to tokens are batched torch operations whose masks weigh and select
but never shape a tensor, and the moves run in one kernel launch with a program per ``(batch, layer)``: no host
synchronisation, so a call can be captured in a CUDA graph. Results equal the CPU path's, ties included
(``tests/test_rebalance_device.py``).

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

__all__ = ["compile_kernel", "float_launch", "hand_out", "kernel", "moves", "pow2", "route_tokens", "split_counts", "start_split"]


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


def _alg2(remote_ptr, local_ptr, copies_ptr, loads_ptr, moves_ptr, t0_ptr, limit_ptr, L, G, E,
          strict: tl.constexpr, GP: tl.constexpr, EP: tl.constexpr):  # pragma: no cover - a Triton kernel
    """One ``(batch, layer)`` per program: ``remote [G, E]`` moved in place (``local [G]`` stays), ``loads [G]``
    and the number of moves out."""
    pid = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: B * L * G * E may pass 2**31
    g = tl.arange(0, GP)
    e = tl.arange(0, EP)
    gm = g < G
    em = e < E
    m2 = gm[:, None] & em[None, :]
    tile = g[:, None] * E + e[None, :]
    remote = tl.load(remote_ptr + pid * G * E + tile, mask=m2, other=0)
    holds = tl.load(copies_ptr + (pid % L) * G * E + tile, mask=m2, other=0) > 0
    movable = tl.sum(holds.to(tl.int32), axis=0) >= 2  # [EP]: only experts with another holder move
    loads = tl.load(local_ptr + pid * G + g, mask=gm, other=0) + tl.sum(remote, axis=1)  # [GP]
    t0 = tl.load(t0_ptr + pid)
    limit = tl.load(limit_ptr + pid)
    big = 1 << 62
    aside = g < 0  # sources set aside since the last move: none
    moves = tl.sum(tl.zeros([GP], dtype=tl.int64), axis=0)
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
        moves += moved.to(tl.int64)
        go = found & (tl.sum(((loads > limit) & gm).to(tl.int32), axis=0) > 0)
    tl.store(loads_ptr + pid * G + g, loads, mask=gm)
    tl.store(moves_ptr + pid, moves)
    tl.store(remote_ptr + pid * G * E + tile, remote, mask=m2)


def compile_kernel(fn: Any, interpret: bool) -> Any:
    """The Triton kernel ``fn`` compiled for a GPU or, with ``interpret``, run by Triton's interpreter (CPU tensors);
    a one-line error without Triton, or where Triton was imported in the other mode. The device kernels'
    (:mod:`moebalance.algorithms.exact_device`, :mod:`moebalance.algorithms.metro_device`) one factory."""
    if tl is None:
        raise InputError("moebalance's device kernels need Triton: pip install 'moebalance[device]' (Linux x86-64 or "
                         "aarch64; or plan and route on the host)")
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if interpret != bool(triton.knobs.runtime.interpret):
        raise InputError("moebalance's device kernels run on CPU tensors only in Triton's interpreter and on GPU "
                         "tensors only without it; Triton chose when it was imported (TRITON_INTERPRET="
                         f"{os.environ.get('TRITON_INTERPRET', '')!r}): give tensors on "
                         f"{'a GPU' if not interpret else 'the CPU'}, or set TRITON_INTERPRET before importing Triton")
    return InterpretedFunction(fn) if interpret else triton.jit(fn)


@functools.cache
def kernel(interpret: bool) -> Any:
    """Alg. 2's kernel (:func:`compile_kernel`)."""
    return compile_kernel(_alg2, interpret)


def pow2(x: int) -> int:
    """The least power of two ``>= x`` (at least 1): a tile's side."""
    return 1 << max(0, (x - 1).bit_length())


def float_launch(device: torch.device) -> dict[str, Any]:
    """Launch options of a kernel that computes in floats: on a GPU no fused multiply-add, so that it rounds as the
    compiled CPU path does (the interpreter never fuses)."""
    return {} if device.type == "cpu" else {"enable_fp_fusion": False}


def moves(remote: torch.Tensor, local: torch.Tensor, copies: torch.Tensor, picks: torch.Tensor, eps: float,
          strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2 on every ``(batch, layer)``: ``remote int64 [B, L, G, E]`` moved in place, ``local int64 [B, L, G]``
    never moved, ``copies [L, E, G]`` (only whether a GPU holds an expert counts here), ``picks [B, L]`` the picks
    Libra's mean is taken over; ``(loads int64 [B, L, G], moves int64 [B, L])``."""
    import torch

    B, L, G, E = remote.shape
    if eps < 0:
        raise InputError(f"eps ({eps}) must be >= 0")
    target = picks.to(torch.float64) / G  # [B, L]: Libra's B, the mean load
    t0 = torch.floor(target).to(torch.int64).reshape(-1).contiguous()
    limit = torch.floor((1.0 + eps) * target).to(torch.int64).reshape(-1).contiguous()
    held = copies.to(torch.int64).permute(0, 2, 1).contiguous()  # [L, G, E]
    loads = torch.empty(B * L * G, dtype=torch.int64, device=remote.device)
    count = torch.zeros(B * L, dtype=torch.int64, device=remote.device)
    if B * L:
        kernel(remote.device.type == "cpu")[(B * L,)](remote, local.contiguous(), held, loads, count, t0, limit, L, G,
                                                      E, strict=bool(strict), GP=pow2(G), EP=pow2(E))
    return loads.reshape(B, L, G), count.reshape(B, L)


def split_counts(counts: torch.Tensor, copies: torch.Tensor, eps: float = 0.0, strict: bool = False) -> torch.Tensor:
    """``int64 [B, L, G]``: the GPU loads after Alg. 2 of counts ``int [B, L, E]`` on copies ``int [L, E, G]``, on
    their device (equal to :func:`moebalance.algorithms.rebalance.split_counts`: counts carry no source GPU, so
    every pick is remote).

    No host synchronisation: the call can be captured in a CUDA graph. ``eps`` and ``strict`` as the ``rebalance``
    router takes them."""
    import torch

    if counts.dim() != 3 or copies.dim() != 3 or counts.shape[1:] != copies.shape[:2]:
        raise InputError(f"counts [B, L, E] {tuple(counts.shape)} and copies [L, E, G] {tuple(copies.shape)} do not "
                         "match")
    if counts.device != copies.device:
        raise InputError(f"counts are on {counts.device} and copies on {copies.device}; give both on one device")
    remote = start_split(counts, copies).contiguous()  # [B, L, G, E]
    local = torch.zeros(remote.shape[:3], dtype=torch.int64, device=counts.device)
    return moves(remote, local, copies, counts.to(torch.int64).sum(dim=2), eps, strict)[0]


def _rank(key: torch.Tensor) -> torch.Tensor:
    """``int64 [P]``: each entry's rank among the entries of its key, in their order."""
    import torch

    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    first = torch.searchsorted(sorted_key, sorted_key, right=False)  # where each key's run starts
    rank = torch.empty_like(key)
    rank[order] = torch.arange(key.numel(), device=key.device) - first
    return rank


def route_tokens(ids: torch.Tensor, src: torch.Tensor, batch: torch.Tensor, num_batches: int, copies: torch.Tensor,
                 gpus_per_node: int, kept: torch.Tensor, eps: float = 0.0, strict: bool = False) -> torch.Tensor:
    """``int64 [T, K]``: a GPU for every kept pick of one layer (the others -1), batch by batch, on the picks'
    device (equal to :func:`moebalance.algorithms.rebalance.route_tokens`).

    ``ids int [T, K]``, ``src int [T]`` each token's GPU, ``batch int [T]`` its batch (non-decreasing, below
    ``num_batches``), ``copies int [E, G]``, ``kept bool [T, K]``. A pick whose expert has a copy on the token's GPU
    stays there; the others start as ``uniform`` deals them and Alg. 2 moves them (:func:`split_counts`'s kernel,
    with the local picks fixed); each GPU's share of an expert then goes to picks in token order, first to picks
    from its own node, then to any: the ``r``-th such pick of an expert takes the GPU (in GPU order) where the
    shares' running sum first exceeds ``r``, so the hand-out is two sorts and a count, not a loop. Masks weigh and
    select but never shape a tensor: no host synchronisation."""
    import torch

    T, K = ids.shape
    E, G = copies.shape
    dev = ids.device
    B = int(num_batches)
    ids, src = ids.to(torch.int64).reshape(-1), src.to(torch.int64)
    b = batch.to(torch.int64)[:, None].expand(T, K).reshape(-1)  # [P]: every pick, in (token, k) order
    own = src[:, None].expand(T, K).reshape(-1)
    kept = kept.reshape(-1)
    at_home = kept & (copies[ids, own] > 0)
    away = kept & ~at_home  # masks are weights and selectors below, never shapes: no host synchronisation
    local = torch.zeros(B * G, dtype=torch.int64, device=dev).index_add_(0, b * G + own, at_home.to(torch.int64))
    n_remote = torch.zeros(B * E, dtype=torch.int64, device=dev).index_add_(0, b * E + ids, away.to(torch.int64))
    picks = torch.zeros(B, dtype=torch.int64, device=dev).index_add_(0, b, kept.to(torch.int64))
    remote = start_split(n_remote.reshape(B, 1, E), copies[None]).contiguous()  # [B, 1, G, E]
    moves(remote, local.reshape(B, 1, G), copies[None], picks[:, None], eps, strict)
    return hand_out(ids, own, b, at_home, away, remote[:, 0].permute(0, 2, 1), gpus_per_node).reshape(T, K)


def hand_out(ids: torch.Tensor, own: torch.Tensor, b: torch.Tensor, at_home: torch.Tensor, away: torch.Tensor,
             share: torch.Tensor, gpus_per_node: int) -> torch.Tensor:
    """``int64 [P]``: a GPU for every pick (-1 for those neither ``at_home`` nor ``away``): ``ids``, ``own`` (the
    token's GPU) and ``b`` (its batch) ``int64 [P]`` in token order, ``share int64 [B, E, G]`` what each GPU serves
    of each expert's ``away`` picks. A pick at home stays on its GPU; the ``r``-th away pick of an expert from one
    node takes the node's GPU where the node's running sum of shares first exceeds ``r``, and the picks left take
    what is left anywhere, in GPU order, the same way."""
    import torch

    B, E, G = share.shape
    dev = ids.device
    N = -(-G // gpus_per_node)
    one = torch.ones_like(b)
    node = own // gpus_per_node
    # pass 0: the picks of an expert from one node take its GPUs on that node, in GPU order
    padded = torch.zeros(B, E, N * gpus_per_node, dtype=torch.int64, device=dev)
    padded[:, :, :G] = share
    per_node = padded.reshape(B, E, N, gpus_per_node).cumsum(dim=3)  # [B, E, N, gpn]
    r = _rank(torch.where(away, (b * E + ids) * N + node, -one))
    slot = (per_node[b, ids, node] <= r[:, None]).sum(dim=1)  # gpn where the node's shares ran out
    hit = away & (slot < gpus_per_node)
    first = node * gpus_per_node + slot
    taken = torch.zeros(B * E * G, dtype=torch.int64, device=dev)
    taken.index_add_(0, torch.where(hit, (b * E + ids) * G + first, 0 * one), hit.to(torch.int64))
    # pass 1: what is left anywhere, in GPU order, to the picks still without a GPU
    left = (share.reshape(-1) - taken).reshape(B, E, G).cumsum(dim=2)
    q = _rank(torch.where(away & ~hit, b * E + ids, -one))
    anywhere = (left[b, ids] <= q[:, None]).sum(dim=1)
    dest = torch.where(at_home, own, torch.where(hit, first, torch.where(away, anywhere, -one)))
    return dest
