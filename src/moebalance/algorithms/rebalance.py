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

__all__ = ["gpu_lists", "hand_out", "host_copies", "rebalance", "route_tokens", "split_counts", "start_split"]


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


@njit(cache=True, nogil=True, inline="always")
def _cap(t0: int | np.integer, l_src: int | np.integer, l_dst: int | np.integer, strict: bool) -> int:
    """Picks a move may take from a source at ``l_src`` to a holder at ``l_dst``: ``floor(B - G[g_d])``, else
    (not strict) ``floor((G[g_s] - G[g_d]) / 2)``. ``t0 = floor(B)``: for whole loads under 2**53,
    ``floor(B - x) == floor(B) - x`` wherever either is at least 1, so the integer form decides alike."""
    c = t0 - l_dst
    if c < 1 and not strict:
        c = (l_src - l_dst) // 2
    return int(c)


@njit(cache=True, nogil=True, inline="always")
def _key(load: int | np.integer, g: int | np.integer, bits: int, packed: bool) -> int | np.integer:
    """A source's sort key: larger is earlier (more loaded, then the lower id when ``packed``)."""
    return (load << bits) | ((1 << bits) - 1 - g) if packed else load


@njit(cache=True, nogil=True, inline="always")
def _climb(tree: np.ndarray, P: int, g: int | np.integer, value: int | np.integer) -> None:
    """Set leaf ``g`` of the tournament tree ``tree [2P]`` to ``value`` and replay the matches above it: each
    node holds the largest key below it (the most loaded candidate, the lower id on ties)."""
    i = P + g
    tree[i] = value
    while i > 1:
        value = max(value, tree[i ^ 1])
        i >>= 1
        tree[i] = value


@njit(cache=True, nogil=True, inline="always")
def _unfail(g: int | np.integer, flist: np.ndarray, fpos: np.ndarray, nfailed: int) -> int:
    """Remove ``g`` from the list of failed sources; returns the new count."""
    p = fpos[g]
    nfailed -= 1
    last = flist[nfailed]
    flist[p] = last
    fpos[last] = p
    fpos[g] = -1
    return nfailed


@njit(cache=True, nogil=True)
def rebalance(local: np.ndarray, remote: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, gstart: np.ndarray,
              gexp: np.ndarray, target: float, eps: float, strict: bool) -> tuple[np.ndarray, int]:
    """Alg. 2 on one ``(batch, layer)``; moves picks in ``remote int64 [G, E]`` in place.

    ``local int64 [G]``, ``target`` = B, the mean load. Returns ``(loads int64 [G], moves)``.

    The moves are those of the printed loop (module docstring), found with less work:

    - the next source has the largest key (-1 for a GPU that is no candidate): with loads small enough the key
      holds the load and the id (ties to the lower id), and a tournament tree over the keys gives the largest
      at once; else the key is the load alone, and a vectorised pass finds it;
    - each GPU keeps its movable experts sorted by remote picks (the printed order), updated by each move;
    - a source none of whose experts can move (every holder gives ``cap < 1``) is set aside: only a lower load
      on a GPU sharing an expert with it, or a change of its own load or picks, can let it move again, and
      then it comes back. A source the printed loop would skip is skipped at no cost.
    """
    G, E = remote.shape
    loads = local.copy()
    for e in range(E):
        for j in range(hstart[e], hstart[e + 1]):
            loads[hosts[j]] += remote[hosts[j], e]
    t0 = np.int64(np.floor(target))  # whole loads: load > B  <=>  load > floor(B)
    limit = np.int64(np.floor((1.0 + eps) * target))
    P, bits = 1, 0
    while P < G:
        P *= 2
        bits += 1
    packed = G > 0 and loads.sum() < (np.int64(1) << (62 - bits))
    key = np.full(P, -1, np.int64)
    over = 0  # GPUs above (1 + eps) B: the loop ends when there are none
    for g in range(G):
        if loads[g] > t0:
            key[g] = _key(loads[g], g, bits, packed)
        over += loads[g] > limit
    tree = np.empty(2 * P, np.int64)
    tree[P:] = key
    for i in range(P - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    # each GPU's movable experts, most remote picks first (the lower id on ties), with those picks
    oe = gexp.copy()
    orr = np.empty(gexp.shape[0], np.int64)
    span = np.zeros(G, np.int64)  # holders summed over a GPU's movable experts
    for g in range(G):
        lo, hi = gstart[g], gstart[g + 1]
        for j in range(lo, hi):
            e = oe[j]
            r = remote[g, e]
            span[g] += hstart[e + 1] - hstart[e]
            i = j
            while i > lo and (orr[i - 1] < r or (orr[i - 1] == r and oe[i - 1] > e)):
                oe[i] = oe[i - 1]
                orr[i] = orr[i - 1]
                i -= 1
            oe[i] = e
            orr[i] = r
    holds = np.zeros((G, E), np.bool_)
    for e in range(E):
        for j in range(hstart[e], hstart[e + 1]):
            holds[hosts[j], e] = True
    flist = np.empty(G, np.int64)  # the sources set aside
    fpos = np.full(G, -1, np.int64)
    nfailed = 0
    moves = 0
    while over > 0:
        if packed:
            m = tree[1]
            if m < 0:
                break
            g_s = int(P - 1 - (m & (P - 1)))
        else:
            m = np.int64(-1)
            for g in range(P):
                m = max(m, key[g])
            if m < 0:
                break
            g_s = 0
            while key[g_s] != m:
                g_s += 1
        lo, hi = gstart[g_s], gstart[g_s + 1]
        ls = loads[g_s]
        bi, g_d, cap = -1, -1, 0
        for j in range(lo, hi):
            if orr[j] <= 0:
                break
            e = oe[j]
            k0 = hstart[e]
            if hstart[e + 1] - k0 == 2:  # the other holder
                d = hosts[k0] + hosts[k0 + 1] - g_s
                ld = loads[d]
            else:
                d, ld = -1, 0
                for k in range(k0, hstart[e + 1]):
                    g = hosts[k]
                    if g != g_s and (d < 0 or loads[g] < ld):
                        d, ld = g, loads[g]
            c = _cap(t0, ls, ld, strict)
            if c >= 1:
                bi, g_d, cap = j, d, c
                break
        if bi < 0:
            fpos[g_s] = nfailed
            flist[nfailed] = g_s
            nfailed += 1
            key[g_s] = -1
            if packed:
                _climb(tree, P, g_s, key[g_s])
            continue
        e, r = oe[bi], orr[bi]
        amount = min(r, cap)
        ld = loads[g_d]
        over -= (ls > limit) + (ld > limit)
        ls -= amount
        ld += amount
        loads[g_s], loads[g_d] = ls, ld
        over += (ls > limit) + (ld > limit)
        moves += 1
        # e went down on g_s and up on g_d: keep both lists sorted
        r -= amount
        i = bi
        while i + 1 < hi and (orr[i + 1] > r or (orr[i + 1] == r and oe[i + 1] < e)):
            oe[i], orr[i] = oe[i + 1], orr[i + 1]
            i += 1
        oe[i], orr[i] = e, r
        lo_d = gstart[g_d]
        i = lo_d
        while oe[i] != e:
            i += 1
        r = orr[i] + amount
        while i > lo_d and (orr[i - 1] < r or (orr[i - 1] == r and oe[i - 1] > e)):
            oe[i], orr[i] = oe[i - 1], orr[i - 1]
            i -= 1
        oe[i], orr[i] = e, r
        key[g_s] = _key(ls, g_s, bits, packed) if ls > t0 else -1
        if packed:
            _climb(tree, P, g_s, key[g_s])
        if fpos[g_d] >= 0:
            nfailed = _unfail(g_d, flist, fpos, nfailed)
        key[g_d] = _key(ld, g_d, bits, packed) if ld > t0 else -1
        if packed:
            _climb(tree, P, g_d, key[g_d])
        # g_s is lighter: a source set aside that shares an expert with it may now move picks there (the
        # cheaper of two walks: over the sources set aside, or over the holders of g_s's experts)
        if nfailed > 0 and nfailed * 4 < span[g_s]:
            q = 0
            while q < nfailed:
                h = flist[q]
                freed = False
                if _cap(t0, loads[h], ls, strict) >= 1:
                    for j in range(gstart[h], gstart[h + 1]):
                        if orr[j] <= 0:
                            break
                        if holds[g_s, oe[j]]:
                            freed = True
                            break
                if freed:
                    nfailed = _unfail(h, flist, fpos, nfailed)
                    key[h] = _key(loads[h], h, bits, packed)
                    if packed:
                        _climb(tree, P, h, key[h])
                else:
                    q += 1
        elif nfailed > 0:
            for j in range(lo, hi):
                x = oe[j]
                for k in range(hstart[x], hstart[x + 1]):
                    h = hosts[k]
                    if fpos[h] >= 0 and _cap(t0, loads[h], ls, strict) >= 1:
                        i = gstart[h]
                        while oe[i] != x:
                            i += 1
                        if orr[i] > 0:
                            nfailed = _unfail(h, flist, fpos, nfailed)
                            key[h] = _key(loads[h], h, bits, packed)
                            if packed:
                                _climb(tree, P, h, key[h])
    for g in range(G):
        for j in range(gstart[g], gstart[g + 1]):
            remote[g, oe[j]] = orr[j]
    return loads, moves


@njit(cache=True, nogil=True)
def host_copies(copies: np.ndarray, hstart: np.ndarray, hosts: np.ndarray) -> np.ndarray:
    """``int64 [P]``: the copies each entry of the host lists stands for (``copies int64 [E, G]``)."""
    mult = np.empty(hosts.shape[0], np.int64)
    for e in range(hstart.shape[0] - 1):
        for j in range(hstart[e], hstart[e + 1]):
            mult[j] = copies[e, hosts[j]]
    return mult


@njit(cache=True, nogil=True)
def start_split(n_remote: np.ndarray, mult: np.ndarray, hstart: np.ndarray, hosts: np.ndarray,
                remote: np.ndarray) -> None:
    """Add each expert's remote picks ``n_remote [E]`` to ``remote [G, E]`` as the ``uniform`` router splits
    them on tokens: round-robin over its copies in GPU order (copy ``j`` of ``r`` takes ``n // r``, one more if
    ``j < n mod r``; a GPU with two copies, ``mult`` of its host entry, takes two shares)."""
    for e in range(n_remote.shape[0]):
        n = n_remote[e]
        if n == 0:
            continue
        r = 0
        for j in range(hstart[e], hstart[e + 1]):
            r += mult[j]
        c = 0
        for j in range(hstart[e], hstart[e + 1]):
            g = hosts[j]
            for _ in range(mult[j]):
                remote[g, e] += n // r + (1 if c < n % r else 0)
                c += 1


@njit(cache=True, nogil=True)
def hand_out(ids: np.ndarray, src: np.ndarray, lo: int, hi: int, kept: np.ndarray, hstart: np.ndarray,
             hosts: np.ndarray, remote: np.ndarray, gpus_per_node: int, dest: np.ndarray) -> None:
    """Give tokens ``lo .. hi - 1`` their remote picks' GPUs from the split ``remote [G, E]`` (used up): in token
    order, first from GPUs of the token's node, then from any GPU with share left. ``dest [T, K]`` holds the
    local picks already (the other kept picks -1)."""
    K = ids.shape[1]
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
        mult = host_copies(cp, hstart, hosts)
        for b in range(B):
            total = counts[b, layer].sum()
            if total == 0:
                continue
            remote[:] = 0
            start_split(counts[b, layer], mult, hstart, hosts, remote)
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
    the ``uniform`` router deals them (:func:`start_split`), Alg. 2 moves them, and each GPU's share is then handed
    out in token order: first to picks from its own node, then to the rest (less traffic, the same loads).
    """
    T, K = ids.shape
    E, G = copies.shape
    hstart, hosts = host_lists(copies > 0)
    gstart, gexp = gpu_lists(hstart, hosts, G)
    mult = host_copies(copies, hstart, hosts)
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
        start_split(n_remote, mult, hstart, hosts, remote)
        rebalance(local, remote, hstart, hosts, gstart, gexp, n_picks / G, eps, strict)
        hand_out(ids, src, lo, hi, kept, hstart, hosts, remote, gpus_per_node, dest)
    return dest
