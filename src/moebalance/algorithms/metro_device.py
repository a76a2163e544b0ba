"""The ``metro`` split on the routing's device: the search of :mod:`moebalance.algorithms.metro` as one Triton program
per ``(batch, layer)``.

Legend: ``B`` batches, ``L`` layers, ``E`` experts, ``G`` GPUs.

:func:`split_counts` gives what :func:`moebalance.algorithms.metro.split_counts` gives: each GPU's picks and the
experts it touches after the search (two starts, each kept and improved twice by local search and levelling, the
best by the modelled layer time), with the same ties, computed on the device of the counts in one launch and
without a host synchronisation, so a call can be captured in a CUDA graph. A program holds each GPU's picks ``n``
and experts touched ``u`` in registers and the split ``take [G, E]`` (copies of the start and of the best split
beside it) in a scratch in memory; each step reads the rows and columns it needs:

- the order (fewest copies, most loaded, lower id) is one packed key per expert, the next expert the least key left;
- the greedy start takes, for each expert, the least ``(time after, time before, GPU)`` over its holders; the
  fewest-touched start the least ``(experts, picks, GPU)``, then cost-reducing paths found breadth-first a level at
  a time: a GPU reached in a level gets the key ``(rank of the GPU it was reached from, expert, GPU)``, the order in
  which the printed queue would reach it, so the path found is the printed search's;
- the local search walks the slowest GPU's experts in id order and prices every other holder of each at once (the
  even split's binary search runs on all holders together), keeping the first strict improvement in the printed
  order; chains of two moves walk the holders and their experts in the same order, with the same pruning.

The router's last step, keeping the fastest of this split, ``uniform``'s and ``rebalance``'s by the cost model's
layer time, stays on the host (:mod:`moebalance.routing.metro`). On a CPU tensor the kernel runs in Triton's
interpreter (for tests; slow).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from moebalance.algorithms import rebalance_device
from moebalance.core.errors import InputError

if TYPE_CHECKING:
    import torch

try:  # after rebalance_device, which chooses Triton's interpreter when no GPU is present
    import triton
    import triton.language as tl
except ImportError:  # an optional dependency: kernel() says how to install it
    tl = None

__all__ = ["kernel", "split_counts"]

#: Loads up to this fit the packed order key (as :func:`moebalance.algorithms.metro_starts.fits_key` requires).
MAX_LOAD = (1 << 31) - 1


def _jit(fn: Any) -> Any:
    return fn if tl is None else triton.jit(fn)


@_jit
def _t(n, u, c_ptr, kappa):  # pragma: no cover - a Triton function
    """Seconds of a GPU serving ``n`` picks touching ``u`` experts: the grouped GEMM, plus ``kappa`` per pick."""
    nf = n.to(tl.float64)
    x = tl.maximum(tl.load(c_ptr) * nf, tl.load(c_ptr + 1) * u.to(tl.float64) + tl.load(c_ptr + 2) * nf) \
        + tl.load(c_ptr + 3)
    return tl.where(n <= 0, 0.0, x + kappa * nf)


@_jit
def _at(v, g, i):  # pragma: no cover - a Triton function
    """``v[i]`` of a vector over ``g``."""
    return tl.sum(tl.where(g == i, v, 0), axis=0)


@_jit
def _shift(take_ptr, g, gm, E, n, u, src, dst, x, m):  # pragma: no cover - a Triton function
    """Move ``m`` picks of expert ``x`` from GPU ``src`` to ``dst`` in the scratch; the new ``(n, u)``."""
    col = tl.load(take_ptr + g * E + x, mask=gm, other=0)
    u = u + tl.where((g == dst) & (col == 0), 1, 0)
    col = col - tl.where(g == src, m, 0) + tl.where(g == dst, m, 0)
    n = n - tl.where(g == src, m, 0) + tl.where(g == dst, m, 0)
    u = u - tl.where((g == src) & (col == 0), 1, 0)
    tl.debug_barrier()
    tl.store(take_ptr + g * E + x, col, mask=gm)
    tl.debug_barrier()
    return n, u


@_jit
def _next(row, e, em, after, EP: tl.constexpr):  # pragma: no cover - a Triton function
    """The least expert above ``after`` with picks in ``row`` (``EP`` if none)."""
    return tl.min(tl.where((row > 0) & em & (e > after), e, EP), axis=0)


@_jit
def _better(v, g, best, mx, mg, x, GP: tl.constexpr):  # pragma: no cover - a Triton function
    """The least of ``v`` over GPUs ``g`` (the lowest GPU among equals) against the ``best`` so far, kept only if
    strictly less (the printed scan's rule: the first of equals wins): ``(best, expert, GPU, that GPU, better)``."""
    vmin = tl.min(v, axis=0)
    at = tl.min(tl.where(v == vmin, g, GP), axis=0)
    better = vmin < best
    return tl.where(better, vmin, best), tl.where(better, x, mx), tl.where(better, at, mg), at, better


@_jit
def _improve(take_ptr, has_ptr, c_ptr, kappa, n, u, g, gm, e, em, G, E, max_moves,
             GP: tl.constexpr, EP: tl.constexpr):  # pragma: no cover - a Triton function
    """The local search (one move, else a chain of two) on the scratch split; the new ``(n, u)``."""
    it = 0
    go = max_moves > 0
    while go:
        t = tl.where(gm, _t(n, u, c_ptr, kappa), -1.0)
        ts = tl.max(t, axis=0)
        s = tl.min(tl.where(t == ts, g, GP), axis=0)
        best = ts * (1.0 - 1e-12)
        ns, us = _at(n, g, s), _at(u, g, s)
        row = tl.load(take_ptr + s * E + e, mask=em, other=0)
        mx = s - s - 1  # the move: expert, destination and picks (-1: none yet)
        mg = mx
        mm = ns - ns
        x = _next(row, e, em, -1, EP)
        while (x < E) & (ts > 0.0):
            w = _at(row, e, x)
            col = tl.load(take_ptr + g * E + x, mask=gm, other=0)
            cand = (tl.load(has_ptr + g * E + x, mask=gm, other=0) > 0) & gm & (g != s)
            u2 = u + tl.where(col == 0, 1, 0)
            whole = tl.maximum(_t(ns - w, us - 1, c_ptr, kappa), _t(n + w, u2, c_ptr, kappa))
            lo = n * 0 + 1  # the even split: the least m with t(n2 + m) >= t(ns - m), or w - 1
            hi = n * 0 + w - 1
            active = cand & (lo < hi)
            while tl.sum(active.to(tl.int32), axis=0) > 0:
                mid = (lo + hi) // 2
                up = _t(n + mid, u2, c_ptr, kappa) >= _t(ns - mid, us, c_ptr, kappa)
                hi = tl.where(active & up, mid, hi)
                lo = tl.where(active & (up == 0), mid + 1, lo)
                active = cand & (lo < hi)
            part = tl.maximum(_t(ns - lo, us, c_ptr, kappa), _t(n + lo, u2, c_ptr, kappa))
            down = tl.maximum(_t(ns - (lo - 1), us, c_ptr, kappa), _t(n + (lo - 1), u2, c_ptr, kappa))
            lower = (lo > 1) & (down < part)
            m = tl.where(lower, lo - 1, lo)
            part = tl.where(lower, down, part)
            part = tl.where(w >= 2, part, float("inf"))
            v = tl.where(cand, tl.minimum(whole, part), float("inf"))
            best, mx, mg, at, better = _better(v, g, best, mx, mg, x, GP)
            mm = tl.where(better, tl.where(_at(part < whole, g, at) > 0, _at(m, g, at), w), mm)
            x = _next(row, e, em, x, EP)
        if mx >= 0:
            n, u = _shift(take_ptr, g, gm, E, n, u, s, mg, mx, mm)
        else:  # a chain of two whole moves: s -> h (expert x), then h -> k (another expert f)
            cx, ch, cf, ck = mx, mx, mx, mx
            x = _next(row, e, em, -1, EP)
            while (x < E) & (ts > 0.0):
                w = _at(row, e, x)
                t1 = _t(ns - w, us - 1, c_ptr, kappa)
                if t1 < best:
                    colx = tl.load(take_ptr + g * E + x, mask=gm, other=0)
                    holds = (tl.load(has_ptr + g * E + x, mask=gm, other=0) > 0) & gm & (g != s)
                    h = tl.min(tl.where(holds, g, GP), axis=0)
                    while h < G:
                        nh = _at(n, g, h) + w
                        uh = _at(u, g, h) + tl.where(_at(colx, g, h) == 0, 1, 0)
                        rowh = tl.load(take_ptr + h * E + e, mask=em, other=0)
                        rowh = tl.where(e == x, 0, rowh)
                        f = _next(rowh, e, em, -1, EP)
                        while f < E:
                            y = _at(rowh, e, f)
                            th = _t(nh - y, uh - 1, c_ptr, kappa)
                            if th < best:
                                colf = tl.load(take_ptr + g * E + f, mask=gm, other=0)
                                add = tl.where(colf == 0, 1, 0)
                                ks = (tl.load(has_ptr + g * E + f, mask=gm, other=0) > 0) & gm & (g != h)
                                swap = tl.maximum(th, _t(ns - w + y, us - 1 + add, c_ptr, kappa))
                                on = tl.maximum(t1, tl.maximum(th, _t(n + y, u + add, c_ptr, kappa)))
                                v = tl.where(ks, tl.where(g == s, swap, on), float("inf"))
                                vmin = tl.min(v, axis=0)
                                better = vmin < best
                                best = tl.where(better, vmin, best)
                                cx = tl.where(better, x, cx)
                                ch = tl.where(better, h, ch)
                                cf = tl.where(better, f, cf)
                                ck = tl.where(better, tl.min(tl.where(v == vmin, g, GP), axis=0), ck)
                            f = _next(rowh, e, em, f, EP)
                        h = tl.min(tl.where(holds & (g > h), g, GP), axis=0)
                x = _next(row, e, em, x, EP)
            if cx >= 0:
                y = tl.load(take_ptr + ch * E + cf)
                n, u = _shift(take_ptr, g, gm, E, n, u, s, ch, cx, _at(row, e, cx))
                n, u = _shift(take_ptr, g, gm, E, n, u, ch, ck, cf, y)
            else:
                ts = ts * 0.0  # nothing helps: the search ends
        it += 1
        go = (ts > 0.0) & (it < max_moves)
    return n, u


@_jit
def _level_picks(take_ptr, has_ptr, c_ptr, n, u, g, gm, e, em, G, E, max_moves,
                 GP: tl.constexpr, EP: tl.constexpr):  # pragma: no cover - a Triton function
    """Lower the most picks on a GPU while no grouped GEMM passes the slowest one's; the new ``(n, u)``."""
    big = 1 << 62
    cap = tl.max(tl.where(gm, _t(n, u, c_ptr, 0.0), 0.0), axis=0)
    it = 0
    go = max_moves > 0
    while go:
        nm = tl.where(gm, n, -1)
        ns = tl.max(nm, axis=0)
        s = tl.min(tl.where(nm == ns, g, GP), axis=0)
        best = ns
        mx = s - s - 1
        mg = mx
        mm = ns - ns
        row = tl.load(take_ptr + s * E + e, mask=em, other=0)
        x = _next(row, e, em, -1, EP)
        while x < E:
            w = _at(row, e, x)
            col = tl.load(take_ptr + g * E + x, mask=gm, other=0)
            cand = (tl.load(has_ptr + g * E + x, mask=gm, other=0) > 0) & gm & (g != s) & (n + 1 < ns)
            u2 = u + tl.where(col == 0, 1, 0)
            lo = n * 0
            hi = tl.where(cand, tl.minimum(w, (ns - n) // 2), 0)
            active = lo < hi
            while tl.sum(active.to(tl.int32), axis=0) > 0:
                mid = (lo + hi + 1) // 2
                fits = _t(n + mid, u2, c_ptr, 0.0) <= cap
                lo = tl.where(active & fits, mid, lo)
                hi = tl.where(active & (fits == 0), mid - 1, hi)
                active = lo < hi
            v = tl.where(cand & (lo >= 1), tl.maximum(ns - lo, n + lo), big)
            best, mx, mg, at, better = _better(v, g, best, mx, mg, x, GP)
            mm = tl.where(better, _at(lo, g, at), mm)
            x = _next(row, e, em, x, EP)
        if mx >= 0:
            n, u = _shift(take_ptr, g, gm, E, n, u, s, mg, mx, mm)
        it += 1
        go = (mx >= 0) & (it < max_moves)
    return n, u


@_jit
def _start(take_ptr, has_ptr, c_ptr, kappa, W, key, g, gm, e, em, m2, tile, E, FEWEST: tl.constexpr,
           GP: tl.constexpr, EP: tl.constexpr):  # pragma: no cover - a Triton function
    """Whole experts in key order, each to its greedy copy (least time after, then before, then GPU) or, with
    ``FEWEST``, its least-touched copy (experts, then picks, then GPU); ``(n, u)``."""
    big = 1 << 62
    tl.store(take_ptr + tile, tl.zeros([GP, EP], dtype=tl.int64), mask=m2)
    tl.debug_barrier()
    n = tl.zeros([GP], dtype=tl.int64)
    u = tl.zeros([GP], dtype=tl.int64)
    left = key
    k = tl.min(left, axis=0)
    while k < big:
        x = k & 0xFFFF
        left = tl.where(e == x, big, left)
        w = _at(W, e, x)
        holds = (tl.load(has_ptr + g * E + x, mask=gm, other=0) > 0) & gm
        if FEWEST:
            first = tl.where(holds, u, big)
            second = tl.where(holds, n, big)
        else:
            first = tl.where(holds, _t(n + w, u + 1, c_ptr, kappa), float("inf"))
            second = tl.where(holds, _t(n, u, c_ptr, kappa), float("inf"))
        tie = holds & (first == tl.min(first, axis=0))
        second = tl.where(tie, second, tl.max(second, axis=0))
        pick = tl.min(tl.where(tie & (second == tl.min(second, axis=0)), g, GP), axis=0)
        tl.store(take_ptr + g * E + x, g * 0 + w, mask=g == pick)
        n += tl.where(g == pick, w, 0)
        u += tl.where(g == pick, 1, 0)
        k = tl.min(left, axis=0)
    tl.debug_barrier()
    return n, u


@_jit
def _paths(take_ptr, has_ptr, W, n, u, g, gm, e, em, m2, tile, G, E,
           GP: tl.constexpr, EP: tl.constexpr):  # pragma: no cover - a Triton function
    """The fewest-touched start's cost-reducing paths, found a BFS level at a time; the new ``(n, u)``."""
    big = 1 << 62
    has = tl.load(has_ptr + tile, mask=m2, other=0) > 0
    gg = tl.arange(0, GP)
    go = tl.max(tl.where(gm, u, 0), axis=0) >= 2
    while go:
        U = tl.max(tl.where(gm, u, 0), axis=0)
        owner = tl.min(tl.where(tl.load(take_ptr + tile, mask=m2, other=0) > 0, g[:, None], GP), axis=0)  # [EP]
        source = gm & (u == U)
        level = source
        seen = source
        rank = tl.cumsum(level.to(tl.int64), axis=0) - 1
        via = (g * 0 - 1).to(tl.int64)  # the expert each GPU was reached through
        end = U - U - 1
        searching = U >= 2
        while searching:
            oseq = tl.min(tl.where((g[:, None] == owner[None, :]) & level[:, None], rank[:, None], big), axis=0)
            reach = tl.min(tl.where(has & (oseq[None, :] < big), oseq[None, :] * EP + e[None, :], big), axis=1)
            new = gm & (seen == 0) & (reach < big)
            order = reach * GP + g
            last = tl.min(tl.where(new & (u <= U - 2), order, big), axis=0)
            found = last < big
            end = tl.where(found, last % GP, end)
            via = tl.where(new, reach % EP, via)
            seen = seen | new
            before = (order[None, :] < order[:, None]) & new[None, :]  # [GP, GP]: those reached earlier
            rank = tl.sum(tl.where(before & (gg[None, :] >= 0), 1, 0), axis=1).to(tl.int64)
            level = new
            searching = (tl.sum(new.to(tl.int32), axis=0) > 0) & (found == 0)
        y = end
        while y >= 0:
            if _at(source.to(tl.int32), g, y) > 0:
                y = y - y - 1
            else:
                x = _at(via, g, y)
                src = tl.min(tl.where(tl.load(take_ptr + g * E + x, mask=gm, other=0) > 0, g, GP), axis=0)
                n, u = _shift(take_ptr, g, gm, E, n, u, src, y, x, _at(W, e, x))
                y = src.to(tl.int64)
        go = (end >= 0) & (tl.max(tl.where(gm, u, 0), axis=0) >= 2)
    return n, u


@_jit
def _layer_time(n, u, gm, c_ptr):  # pragma: no cover - a Triton function
    slowest = tl.max(tl.where(gm, _t(n, u, c_ptr, 0.0), 0.0), axis=0)
    return slowest + tl.load(c_ptr + 4) * tl.max(tl.where(gm, n, 0), axis=0).to(tl.float64)


def _metro(counts_ptr, has_ptr, cost_ptr, take_ptr, start_ptr, best_ptr, picks_ptr, touched_ptr, L, G, E,
           GP: tl.constexpr, EP: tl.constexpr):  # pragma: no cover - a Triton kernel
    """One ``(batch, layer)`` per program: ``counts [E]`` and the layer's ``has [G, E]`` in, ``picks [G]`` and
    ``touched [G]`` out; ``take``, ``start`` and ``best`` are its ``[G, E]`` scratch."""
    pid = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: B * L * G * E may pass 2**31
    big = 1 << 62
    g = tl.arange(0, GP)
    e = tl.arange(0, EP)
    gm = g < G
    em = e < E
    m2 = gm[:, None] & em[None, :]
    tile = g[:, None] * E + e[None, :]
    hp = has_ptr + (pid % L) * G * E
    base = pid * G * E
    W = tl.load(counts_ptr + pid * E + e, mask=em, other=0)
    copies = tl.sum((tl.load(hp + tile, mask=m2, other=0) > 0).to(tl.int64), axis=0)
    max_moves = 8 * (tl.sum(copies, axis=0) + G)
    key = tl.where((W > 0) & em, (copies << 47) | ((((1 << 31) - 1) - W) << 16) | e, big)
    kappa = tl.load(cost_ptr + 4)
    total = tl.sum(W, axis=0)
    best = total.to(tl.float64) * 0.0 + float("inf")
    for start in tl.static_range(2):
        n, u = _start(take_ptr + base, hp, cost_ptr, kappa, W, key, g, gm, e, em, m2, tile, E, start == 1, GP, EP)
        if start == 1:
            if total > 0:
                n, u = _paths(take_ptr + base, hp, W, n, u, g, gm, e, em, m2, tile, G, E, GP, EP)
        tl.store(start_ptr + base + tile, tl.load(take_ptr + base + tile, mask=m2, other=0), mask=m2)
        tl.debug_barrier()
        for improve in tl.static_range(3):
            if improve > 0:
                first = tl.load(start_ptr + base + tile, mask=m2, other=0)
                tl.store(take_ptr + base + tile, first, mask=m2)
                tl.debug_barrier()
                n = tl.sum(first, axis=1)
                u = tl.sum((first > 0).to(tl.int64), axis=1)
                n, u = _improve(take_ptr + base, hp, cost_ptr, tl.where(improve == 1, kappa, 0.0), n, u, g, gm, e,
                                em, G, E, tl.where(total > 0, max_moves, 0), GP, EP)
                n, u = _level_picks(take_ptr + base, hp, cost_ptr, n, u, g, gm, e, em, G, E,
                                    tl.where(total > 0, max_moves, 0), GP, EP)
            t = _layer_time(n, u, gm, cost_ptr)
            if t < best:
                best = t
                tl.store(best_ptr + base + tile, tl.load(take_ptr + base + tile, mask=m2, other=0), mask=m2)
                tl.debug_barrier()
    out = tl.load(best_ptr + base + tile, mask=m2, other=0)
    out = tl.where(total > 0, out, 0)
    tl.store(picks_ptr + pid * G + g, tl.sum(out, axis=1).to(tl.float64), mask=gm)
    tl.store(touched_ptr + pid * G + g, tl.sum((out > 0).to(tl.float64), axis=1), mask=gm)


@functools.cache
def kernel(interpret: bool) -> Any:
    """The search's kernel (:func:`moebalance.algorithms.rebalance_device.compile_kernel`)."""
    return rebalance_device.compile_kernel(_metro, interpret)


def split_counts(counts: torch.Tensor, has: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(picks float64 [B, L, G], touched float64 [B, L, G])``: every ``(batch, layer)`` of ``counts int [B, L, E]``
    split by the search over the copies ``has [L, E, G]`` (non-zero: a copy) with the roofline ``cost float64 [5]``
    (:func:`moebalance.algorithms.metro.split_counts`' arguments, as tensors on one device); equal to it.

    Loads of a batch's layer must stay under ``2**31`` picks per expert and ``E`` under 65,536 (the order's packed
    key; the CPU search takes more). No host synchronisation: the call can be captured in a CUDA graph."""
    import torch

    if counts.dim() != 3 or has.dim() != 3 or counts.shape[1:] != has.shape[:2]:
        raise InputError(f"counts [B, L, E] {tuple(counts.shape)} and has [L, E, G] {tuple(has.shape)} do not match")
    if cost.shape != (5,) or not cost.dtype.is_floating_point:
        raise InputError(f"cost must be 5 floats [alpha, beta, gamma, launch, kappa], got {cost.dtype} "
                         f"{tuple(cost.shape)}")
    if len({counts.device, has.device, cost.device}) != 1:
        raise InputError(f"counts ({counts.device}), has ({has.device}) and cost ({cost.device}) must be on one device")
    B, L, E = counts.shape
    G = has.shape[2]
    if E >= 1 << 16 or G >= 1 << 16:
        raise InputError(f"{E} experts on {G} GPUs: the device search orders experts by one packed key (under 65,536 "
                         "each); split on the host")
    dev = counts.device
    c = counts.to(torch.int64).contiguous()
    h = (has != 0).permute(0, 2, 1).to(torch.int8).contiguous()  # [L, G, E]
    picks = torch.zeros((B, L, G), dtype=torch.float64, device=dev)
    touched = torch.zeros((B, L, G), dtype=torch.float64, device=dev)
    if B * L * G * E:
        scratch = [torch.empty((B * L, G, E), dtype=torch.int64, device=dev) for _ in range(3)]
        kernel(dev.type == "cpu")[(B * L,)](c, h, cost.to(torch.float64).contiguous(), *scratch, picks, touched, L, G,
                                            E, GP=rebalance_device.pow2(G), EP=rebalance_device.pow2(E),
                                            **rebalance_device.float_launch(dev))
    return picks, touched
