"""The two starts of the ``metro`` search (:mod:`moebalance.algorithms.metro`) that need no cost model: the order
experts are placed in, and whole experts with the fewest experts per GPU.

Legend: ``E`` experts, ``G`` GPUs, ``M`` loaded experts, ``P`` host entries (an expert and a GPU holding a copy);
``hstart, hosts`` list each expert's GPUs (:func:`moebalance.algorithms.minmax.host_lists`), ``expert, gstart,
gent`` each entry's expert and each GPU's entries (``metro._entries``), ``take [P]`` a split, ``n [G]`` picks and
``u [G]`` experts touched per GPU.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["fewest_touched", "fits_key", "order"]

#: Loads, copies and experts below these fit one sort key (:func:`order`).
_KEY_LOAD, _KEY_COUNT = np.int64(1) << 31, np.int64(1) << 16


@njit(cache=True, nogil=True)
def order(W: np.ndarray, hstart: np.ndarray, packed: bool) -> np.ndarray:
    """``int64 [M]``: the loaded experts, fewest copies first, then the most loaded, then the lower id.

    ``packed``: one sort of keys ``copies | (2**31 - 1 - load) | expert`` (distinct, so any sort orders them
    alike); else two stable sorts (loads or counts too large for the key)."""
    E = W.shape[0]
    M = 0
    for e in range(E):
        if W[e] > 0:
            M += 1
    loaded = np.empty(M, np.int64)
    k = 0
    for e in range(E):
        if W[e] > 0:
            loaded[k] = e
            k += 1
    if packed:
        keys = np.empty(M, np.int64)
        for i in range(M):
            e = loaded[i]
            keys[i] = ((hstart[e + 1] - hstart[e]) << 47) | ((_KEY_LOAD - 1 - W[e]) << 16) | e
        keys.sort()
        for i in range(M):
            loaded[i] = keys[i] & (_KEY_COUNT - 1)
        return loaded
    by_load = loaded[np.argsort(-W[loaded], kind="mergesort")]
    copies = np.empty(M, np.int64)
    for i in range(M):
        e = by_load[i]
        copies[i] = hstart[e + 1] - hstart[e]
    return by_load[np.argsort(copies, kind="mergesort")]


@njit(cache=True, nogil=True)
def fits_key(W: np.ndarray, G: int) -> bool:
    """Whether :func:`order` can sort ``W``'s experts by one packed key."""
    return bool(W.shape[0] < _KEY_COUNT and G < _KEY_COUNT and W.max() < _KEY_LOAD)


@njit(cache=True, nogil=True)
def fewest_touched(W: np.ndarray, order: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, expert: np.ndarray,
                    gstart: np.ndarray, gent: np.ndarray, take: np.ndarray, n: np.ndarray, u: np.ndarray) -> None:
    """Start 2: whole experts with the least possible ``max_g u_g``.

    Each expert of ``order`` goes to the copy on the GPU touching fewest experts (then fewest picks); then,
    while a path ``g_0 -e_1-> g_1 -e_2-> ... g_k`` exists from a GPU at the most experts ``U`` to one at ``U - 2``
    or fewer, where ``e_i`` is served on ``g_{i-1}`` and has a copy on ``g_i``, every ``e_i`` moves one step along
    it (``g_0`` loses one expert, ``g_k`` gains one). With no such path ``U`` is least: the GPUs the paths
    reach keep every expert they serve among themselves and serve more than ``U - 1`` each on average.
    (A semi-matching's cost-reducing path: Harvey, Ladner, Lovasz and Tamir, "Semi-matchings for bipartite
    graphs and load balancing", J. Algorithms 2006.) One breadth-first search per moved path."""
    G = n.shape[0]
    take[:] = 0
    n[:] = 0
    u[:] = 0
    for i in range(order.shape[0]):
        e = order[i]
        pick = -1
        for j in range(hstart[e], hstart[e + 1]):
            g = hosts[j]
            if pick < 0 or u[g] < u[hosts[pick]] or (u[g] == u[hosts[pick]] and n[g] < n[hosts[pick]]):
                pick = j
        take[pick] = W[e]
        n[hosts[pick]] += W[e]
        u[hosts[pick]] += 1
    via = np.empty(G, np.int64)  # the entry a search reached each GPU by (-1: not reached)
    queue = np.empty(G, np.int64)
    while True:
        U = u.max()
        if U < 2:
            return
        via[:] = -1
        head, tail = 0, 0
        for g in range(G):
            if u[g] == U:
                via[g] = -2  # a source
                queue[tail] = g
                tail += 1
        end = -1
        while head < tail and end < 0:
            x = queue[head]
            head += 1
            for p in range(gstart[x], gstart[x + 1]):
                j = gent[p]
                if take[j] == 0:
                    continue
                e = expert[j]
                for j2 in range(hstart[e], hstart[e + 1]):
                    y = hosts[j2]
                    if via[y] != -1:
                        continue
                    via[y] = j2
                    if u[y] <= U - 2:
                        end = y
                        break
                    queue[tail] = y
                    tail += 1
                if end >= 0:
                    break
        if end < 0:
            return
        y = end
        while via[y] != -2:  # walk back: the expert served on the previous GPU moves to y
            j2 = via[y]
            e = expert[j2]
            for j in range(hstart[e], hstart[e + 1]):
                if take[j] > 0:
                    break
            x = hosts[j]
            w = take[j]
            take[j] = 0
            take[j2] = w
            n[x] -= w
            n[y] += w
            u[x] -= 1
            u[y] += 1
            y = x
