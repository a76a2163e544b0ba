"""Libra's Adaptive Token Rebalancer (Libra Appendix C, Alg. 2; our readings in docs/papers/libra.md).

Legend: ``E`` experts, ``G`` GPUs, ``T`` tokens, ``K`` picks per token; ``hstart, hosts`` list the GPUs
holding each expert (:func:`moebalance.algorithms.minmax.host_lists`).

Input of one ``(batch, layer)``: ``local [G]``, the picks served on their own GPU (their expert has a copy
there: Libra's MoE_local, never moved), ``remote [G, E]``, the remote picks of expert ``e`` that GPU ``g``
serves, the target ``B`` (the mean GPU load) and the tolerance ``eps``. Alg. 2, with whole tokens::

    G[g] = local[g] + sum_e remote[g, e]
    while max_g G[g] > (1 + eps) B:
        for g_s in GPUs with G[g_s] > B, most loaded first:
            for e with remote[g_s, e] > 0, largest first:
                C = GPUs other than g_s holding e
                if C: g_d = argmin_{g in C} G[g]; cap = floor(B - G[g_d])
                      (not strict, and cap < 1: cap = floor((G[g_s] - G[g_d]) / 2))
                      if cap >= 1: move min(remote[g_s, e], cap) from g_s to g_d; restart the while loop
        if nothing moved: stop

Readings (docs/papers/libra.md): after a move the search restarts at the most loaded GPU, as the paper's prose
says twice (the printed ``break`` leaves only the inner loop); ties go to the lower GPU or expert id; tokens
are whole, so ``cap`` is rounded down and ``g_d`` never passes ``B``. The printed ``cap = B - G[g_d]`` is not
positive when every candidate is at or above ``B``: ``strict`` then skips the expert as printed; by default a
transfer that is still "beneficial" (the paper's word) is made, levelling ``g_s`` and ``g_d``. Every move
lowers the sum of squared loads by at least 2, so the loop ends.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moebalance.algorithms.minmax import host_lists

__all__ = ["gpu_lists", "rebalance", "route_tokens", "split_counts"]


@njit(cache=True, nogil=True)
def gpu_lists(hstart: np.ndarray, hosts: np.ndarray, G: int) -> tuple[np.ndarray, np.ndarray]:
    """``(gstart [G + 1], gexp [.])``: the experts with copies on two or more GPUs that GPU ``g`` holds,
    ``gexp[gstart[g]:gstart[g + 1]]`` (only they can move)."""
    E = hstart.shape[0] - 1
    gstart = np.zeros(G + 1, np.int64)
    for e in range(E):
        if hstart[e + 1] - hstart[e] > 1:
            for j in range(hstart[e], hstart[e + 1]):
                gstart[hosts[j] + 1] += 1
    for g in range(G):
        gstart[g + 1] += gstart[g]
    pos = gstart[:G].copy()
    gexp = np.empty(gstart[G], np.int64)
    for e in range(E):
        if hstart[e + 1] - hstart[e] > 1:
            for j in range(hstart[e], hstart[e + 1]):
                g = hosts[j]
                gexp[pos[g]] = e
                pos[g] += 1
    return gstart, gexp


@njit(cache=True, nogil=True)
def _reposition(by_load: np.ndarray, where: np.ndarray, loads: np.ndarray, g: int) -> None:
    """Keep ``by_load`` sorted (most loaded first, the lower id on ties) after ``loads[g]`` changed."""
    p = where[g]
    while p > 0 and (loads[by_load[p - 1]] < loads[g] or (loads[by_load[p - 1]] == loads[g] and by_load[p - 1] > g)):
        by_load[p] = by_load[p - 1]
        where[by_load[p]] = p
        p -= 1
    n = by_load.shape[0]
    while p < n - 1 and (loads[by_load[p + 1]] > loads[g] or (loads[by_load[p + 1]] == loads[g] and by_load[p + 1] < g)):
        by_load[p] = by_load[p + 1]
        where[by_load[p]] = p
        p += 1
    by_load[p] = g
    where[g] = p


@njit(cache=True, nogil=True)
def rebalance(local: np.ndarray, remote: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, gstart: np.ndarray,
              gexp: np.ndarray, target: float, eps: float, strict: bool) -> tuple[np.ndarray, int]:
    """Alg. 2 on one ``(batch, layer)``; moves picks in ``remote int64 [G, E]`` in place.

    ``local int64 [G]``, ``target`` = B, the mean load. Returns ``(loads int64 [G], moves)``.
    """
    G, E = remote.shape
    loads = local.copy()
    for e in range(E):
        for j in range(hstart[e], hstart[e + 1]):
            loads[hosts[j]] += remote[hosts[j], e]
    order = np.empty(max(gexp.shape[0], 1), np.int64)
    by_load = np.argsort(-loads, kind="mergesort")  # most loaded first, the lower id on ties
    where = np.empty(G, np.int64)
    for p in range(G):
        where[by_load[p]] = p
    moves = 0
    while True:
        if loads[by_load[0]] <= (1.0 + eps) * target:
            break
        moved = False
        for si in range(G):
            g_s = by_load[si]
            if loads[g_s] <= target:
                break
            # its movable experts with remote picks, largest first (insertion sort; the lower id on ties)
            n = 0
            for j in range(gstart[g_s], gstart[g_s + 1]):
                e = gexp[j]
                r = remote[g_s, e]
                if r <= 0:
                    continue
                i = n
                while i > 0 and (remote[g_s, order[i - 1]] < r
                                 or (remote[g_s, order[i - 1]] == r and order[i - 1] > e)):
                    order[i] = order[i - 1]
                    i -= 1
                order[i] = e
                n += 1
            for i in range(n):
                e = order[i]
                g_d = -1
                for j in range(hstart[e], hstart[e + 1]):
                    g = hosts[j]
                    if g != g_s and (g_d < 0 or loads[g] < loads[g_d]):
                        g_d = g
                cap = np.int64(np.floor(target - loads[g_d]))
                if cap < 1 and not strict:
                    cap = (loads[g_s] - loads[g_d]) // 2
                if cap < 1:
                    continue
                amount = min(remote[g_s, e], cap)
                remote[g_s, e] -= amount
                remote[g_d, e] += amount
                loads[g_s] -= amount
                loads[g_d] += amount
                _reposition(by_load, where, loads, g_s)
                _reposition(by_load, where, loads, g_d)
                moves += 1
                moved = True
                break
            if moved:
                break
        if not moved:
            break
    return loads, moves


@njit(cache=True, nogil=True)
def _start(n_remote: np.ndarray, copies: np.ndarray, hstart: np.ndarray, hosts: np.ndarray,
           remote: np.ndarray) -> None:
    """Add each expert's remote picks to ``remote [G, E]`` as the ``uniform`` router splits them on tokens:
    round-robin over its copies in GPU order (copy ``j`` of ``r`` takes ``n // r``, one more if
    ``j < n mod r``; a GPU with two copies takes two shares)."""
    for e in range(n_remote.shape[0]):
        n = n_remote[e]
        if n == 0:
            continue
        r = 0
        for j in range(hstart[e], hstart[e + 1]):
            r += copies[e, hosts[j]]
        c = 0
        for j in range(hstart[e], hstart[e + 1]):
            g = hosts[j]
            for _ in range(copies[e, g]):
                remote[g, e] += n // r + (1 if c < n % r else 0)
                c += 1


@njit(cache=True, nogil=True)
def split_counts(counts: np.ndarray, copies: np.ndarray, eps: float, strict: bool) -> np.ndarray:
    """``float64 [B, L, G]``: GPU loads of counts ``int64 [B, L, E]`` (``copies int64 [L, E, G]``).

    Counts carry no source GPU, so every pick is remote (Libra's local load is zero): each expert's picks
    start as the ``uniform`` router deals them out as whole tokens, then Alg. 2 moves them.
    """
    B, L, E = counts.shape
    G = copies.shape[2]
    out = np.zeros((B, L, G), np.float64)
    local = np.zeros(G, np.int64)
    remote = np.zeros((G, E), np.int64)
    for layer in range(L):
        cp = copies[layer]
        hstart, hosts = host_lists(cp > 0)
        gstart, gexp = gpu_lists(hstart, hosts, G)
        for b in range(B):
            total = counts[b, layer].sum()
            if total == 0:
                continue
            remote[:] = 0
            _start(counts[b, layer], cp, hstart, hosts, remote)
            loads, _moves = rebalance(local, remote, hstart, hosts, gstart, gexp, total / G, eps, strict)
            for g in range(G):
                out[b, layer, g] = loads[g]
    return out


@njit(cache=True, nogil=True)
def route_tokens(ids: np.ndarray, src: np.ndarray, batch_start: np.ndarray, copies: np.ndarray,
                 gpus_per_node: int, eps: float, strict: bool, kept: np.ndarray) -> np.ndarray:
    """``int64 [T, K]``: a GPU for every kept pick (``kept bool [T, K]``; the others -1) of one layer, batch
    by batch (``copies int64 [E, G]``).

    A pick whose expert has a copy on the token's GPU stays there. The other picks of each expert start as
    the ``uniform`` router deals them (:func:`_start`), Alg. 2 moves them, and each GPU's share is then handed
    out in token order: first to picks from its own node, then to the rest (less traffic, the same loads).
    """
    T, K = ids.shape
    E, G = copies.shape
    hstart, hosts = host_lists(copies > 0)
    gstart, gexp = gpu_lists(hstart, hosts, G)
    dest = np.full((T, K), -1, np.int64)
    local = np.zeros(G, np.int64)
    remote = np.zeros((G, E), np.int64)
    n_remote = np.zeros(E, np.int64)
    for b in range(batch_start.shape[0] - 1):
        lo, hi = batch_start[b], batch_start[b + 1]
        if hi == lo:
            continue
        local[:] = 0
        n_remote[:] = 0
        remote[:] = 0
        n_picks = 0
        for i in range(lo, hi):
            s = src[i]
            for k in range(K):
                if not kept[i, k]:
                    continue
                n_picks += 1
                e = ids[i, k]
                if copies[e, s] > 0:
                    dest[i, k] = s
                    local[s] += 1
                else:
                    n_remote[e] += 1
        _start(n_remote, copies, hstart, hosts, remote)
        rebalance(local, remote, hstart, hosts, gstart, gexp, n_picks / G, eps, strict)
        for pass_ in range(2):  # 0: only GPUs of the token's node; 1: any GPU with share left
            for i in range(lo, hi):
                node = src[i] // gpus_per_node
                for k in range(K):
                    if dest[i, k] >= 0 or not kept[i, k]:
                        continue
                    e = ids[i, k]
                    for j in range(hstart[e], hstart[e + 1]):
                        g = hosts[j]
                        if remote[g, e] > 0 and (pass_ == 1 or g // gpus_per_node == node):
                            remote[g, e] -= 1
                            dest[i, k] = g
                            break
    return dest
