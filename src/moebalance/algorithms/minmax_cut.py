"""The least straggler load ``t*`` of one ``(batch, layer)`` and the lexicographically optimal split, by minimum
cuts (docs/papers/routing.md, "The min-max split"): the solver behind :mod:`moebalance.algorithms.minmax`.

Legend: ``E`` experts, ``G`` GPUs, ``P`` host entries (copies on distinct GPUs); ``has [E, G]`` says which
GPUs hold a copy of which expert (one layer), ``W [E]`` the expert loads.

The least possible straggler load is ``t* = max over GPU sets S of W(experts whose copies all lie in S) / |S|``
(the max-flow min-cut theorem on the network source -> expert -> GPU -> sink with GPU capacities ``t``).
Experts with one copy are fixed load; the others join their GPUs into connected components, each solved on
its own. A component's ``t*`` is found by Newton's method on the cut: start from a lower bound (the mean, and
the densities of a few small sets); while a maximum flow cannot route everything, take the GPUs ``S`` on the
source side of a minimum cut and set ``t = W(experts inside S) / |S|``, which rises strictly and reaches
``t*`` in at most ``G`` steps. Capacities are scaled by the denominator, so every flow is integral and ``t*``
is an exact fraction. A small component (``2^A`` GPU subsets times its experts at most ``_ENUMERATE``) is
solved by the definition instead, trying every subset. With ``lex``, the largest set of GPUs that must carry
``t*`` takes exactly ``t*``, the experts confined to it are settled, and the rest is solved again
(:func:`lex_loads`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moebalance.algorithms.flow import build_into, max_flow, reach_from, reaches

__all__ = ["host_lists", "lex_loads", "minmax_value", "solve_loads", "solve_value", "workspace"]


@njit(cache=True)
def host_lists(has: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hstart int64 [E + 1], hosts int64 [P])``: the GPUs holding expert ``e`` are
    ``hosts[hstart[e]:hstart[e + 1]]``, ascending (``has bool [E, G]``; two copies on one GPU count once)."""
    E, G = has.shape
    hstart = np.zeros(E + 1, np.int64)
    for e in range(E):
        hstart[e + 1] = hstart[e]
        for g in range(G):
            if has[e, g]:
                hstart[e + 1] += 1
    hosts = np.empty(hstart[E], np.int64)
    k = 0
    for e in range(E):
        for g in range(G):
            if has[e, g]:
                hosts[k] = g
                k += 1
    return hstart, hosts


#: Positions of the workspace's arrays (:func:`workspace`): integer arrays, then boolean ones.
(_LOCAL, _POS, _W, _ITEM_START, _ITEM_HOSTS, _EXTRA, _TAIL, _HEAD, _COST, _CAP, _ARC_HEAD, _ARC_COST,
 _RES, _START, _ADJ, _BPOS, _LEVEL, _PTR, _QUEUE, _PATH, _ALONE, _FIXED, _PARENT, _ROOT, _SIZE,
 _N_EXP, _MULTI, _GPUS, _EXPERTS) = range(29)
(_ACTIVE, _SETTLED, _SEEN, _OK, _TIGHT) = range(5)


@njit(cache=True)
def workspace(E: int, G: int, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Work arrays for :func:`lex_loads` and :func:`minmax_value` on a layer of ``E`` experts, ``G`` GPUs and
    ``P`` host entries, reused across batches: one flow problem per component and level allocates nothing.

    A network has a source, at most ``E + G`` items (experts with a choice, and one item per GPU for the
    load without a choice), the GPUs and a sink; edges go source -> item, item -> GPU, GPU -> sink. Returns
    ``(ints, int_offsets, bools, bool_offsets)``: array ``k`` of each kind is ``ints[int_offsets[k]:
    int_offsets[k + 1]]`` (positions ``_LOCAL`` ...), one flat buffer each, which compiles much faster than a
    tuple of arrays.
    """
    n = E + 2 * G + 2
    m = (E + G) + (P + G) + G
    sizes = np.array([G, G, E + G, E + G + 1, P + G, G, m, m, m, m, 2 * m, 2 * m, 2 * m, n + 1, 2 * m, n,
                      n, n, n, n, G, G, G, G, G, G, E, G, E], np.int64)
    int_offsets = np.zeros(sizes.shape[0] + 1, np.int64)
    int_offsets[1:] = np.cumsum(sizes)
    bool_sizes = np.array([G, E, n, 2 * m, G], np.int64)
    bool_offsets = np.zeros(bool_sizes.shape[0] + 1, np.int64)
    bool_offsets[1:] = np.cumsum(bool_sizes)
    bools = np.zeros(bool_offsets[-1], np.bool_)
    bools[bool_offsets[_OK]:bool_offsets[_OK + 1]] = True  # every arc admitted: plain maximum flows
    return np.zeros(int_offsets[-1], np.int64), int_offsets, bools, bool_offsets


#: A level with ``2^A * items`` up to this is solved by trying every GPU subset instead of by flows.
_ENUMERATE = 4096


@njit(cache=True)
def _level_by_subsets(n_items: int, A: int, w: np.ndarray, item_start: np.ndarray, item_hosts: np.ndarray,
                      tight: np.ndarray) -> tuple[np.int64, np.int64]:
    """:func:`_level` on a small level by the definition: ``t* = max_S W(items inside S) / |S|`` over all GPU
    subsets ``S``, and the tight set is the union of the maximisers (they are closed under union)."""
    masks = np.zeros(n_items, np.int64)
    for i in range(n_items):
        for j in range(item_start[i], item_start[i + 1]):
            masks[i] |= np.int64(1) << item_hosts[j]
    p, q = np.int64(0), np.int64(1)
    union = np.int64(0)
    for subset in range(1, np.int64(1) << A):
        S = np.int64(subset)
        inside = np.int64(0)
        for i in range(n_items):
            if masks[i] & ~S == 0:
                inside += w[i]
        size = np.int64(0)
        x = S
        while x:
            x &= x - 1
            size += 1
        if inside * q > p * size:
            p, q, union = inside, size, S
        elif inside * q == p * size:
            union |= S
    for a in range(A):
        tight[a] = (union >> a) & 1 == 1
    return p, q


@njit(cache=True)
def _level(n_items: int, A: int, ints: np.ndarray, io: np.ndarray, bools: np.ndarray, bo: np.ndarray
           ) -> tuple[np.int64, np.int64]:
    """The bottleneck of one level: ``(p, q)`` with ``t* = p / q``; ``tight`` (in the workspace) marks the
    largest set of the ``A`` GPUs that must carry exactly ``t*``.

    Items ``0 .. n_items - 1`` of the workspace: load ``w[i]`` (positive), GPUs
    ``item_hosts[item_start[i]:item_start[i + 1]]`` (numbered ``0 .. A - 1``). Newton's method starts from the
    best of a few set densities (each a lower bound of ``t*``, so the iteration still rises to ``t*`` from
    below): the mean, each GPU's items without a choice, and each item with the choiceless items on its GPUs.
    """
    w, item_start, item_hosts, alone = ints[io[_W]:io[_W + 1]], ints[io[_ITEM_START]:io[_ITEM_START + 1]], ints[io[_ITEM_HOSTS]:io[_ITEM_HOSTS + 1]], ints[io[_ALONE]:io[_ALONE + 1]]
    tail, head, cost, cap = ints[io[_TAIL]:io[_TAIL + 1]], ints[io[_HEAD]:io[_HEAD + 1]], ints[io[_COST]:io[_COST + 1]], ints[io[_CAP]:io[_CAP + 1]]
    arc_head, arc_cost, res, start, adj = ints[io[_ARC_HEAD]:io[_ARC_HEAD + 1]], ints[io[_ARC_COST]:io[_ARC_COST + 1]], ints[io[_RES]:io[_RES + 1]], ints[io[_START]:io[_START + 1]], ints[io[_ADJ]:io[_ADJ + 1]]
    queue = ints[io[_QUEUE]:io[_QUEUE + 1]]
    seen, ok, tight = bools[bo[_SEEN]:bo[_SEEN + 1]], bools[bo[_OK]:bo[_OK + 1]], bools[bo[_TIGHT]:bo[_TIGHT + 1]]
    if A <= 12 and (np.int64(1) << A) * n_items <= _ENUMERATE:
        return _level_by_subsets(n_items, A, w, item_start, item_hosts, tight)
    n = n_items + A + 2
    s, t = 0, n_items + A + 1
    k = 0
    for i in range(n_items):
        tail[k], head[k] = s, 1 + i
        k += 1
        for j in range(item_start[i], item_start[i + 1]):
            tail[k], head[k] = 1 + i, 1 + n_items + item_hosts[j]
            k += 1
    for a in range(A):
        tail[k], head[k] = 1 + n_items + a, t
        k += 1
    m = k
    build_into(n, m, tail, head, cap, cost, arc_head, arc_cost, res, start, adj, ints[io[_BPOS]:io[_BPOS + 1]])
    work = (ints[io[_LEVEL]:io[_LEVEL + 1]], ints[io[_PTR]:io[_PTR + 1]], queue, ints[io[_PATH]:io[_PATH + 1]])
    total = np.int64(0)
    alone[:A] = 0  # load of the items with one GPU, per GPU
    for i in range(n_items):
        total += w[i]
        if item_start[i + 1] - item_start[i] == 1:
            alone[item_hosts[item_start[i]]] += w[i]
    p, q = total, np.int64(A)
    for a in range(A):
        if alone[a] * q > p:
            p, q = alone[a], np.int64(1)
    for i in range(n_items):
        h = item_start[i + 1] - item_start[i]
        if h > 1:
            inside = w[i]
            for j in range(item_start[i], item_start[i + 1]):
                inside += alone[item_hosts[j]]
            if inside * q > p * h:
                p, q = inside, np.int64(h)
    while True:
        k = 0
        for i in range(n_items):
            res[2 * k], res[2 * k + 1] = w[i] * q, 0
            k += 1
            for _ in range(item_start[i], item_start[i + 1]):
                res[2 * k], res[2 * k + 1] = w[i] * q, 0
                k += 1
        for _ in range(A):
            res[2 * k], res[2 * k + 1] = p, 0
            k += 1
        f = max_flow(n, arc_head, res, start, adj, ok, s, t, work)
        if f == total * q:
            reaches(n, arc_head, res, start, adj, t, seen, queue)
            for a in range(A):
                tight[a] = not seen[1 + n_items + a]
            return p, q
        reach_from(n, arc_head, res, start, adj, s, seen, queue)
        p_new = np.int64(0)
        for i in range(n_items):
            if seen[1 + i]:
                p_new += w[i]
        q_new = np.int64(0)
        for a in range(A):
            if seen[1 + n_items + a]:
                q_new += 1
        p, q = p_new, q_new


@njit(cache=True)
def _find(parent: np.ndarray, g: int) -> int:
    while parent[g] != g:
        parent[g] = parent[parent[g]]
        g = parent[g]
    return g


@njit(cache=True)
def _component(W: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, X: int, A: int, lex: bool,
               num: np.ndarray, den: np.ndarray, ints: np.ndarray, io: np.ndarray, bools: np.ndarray,
               bo: np.ndarray) -> None:
    """Loads of one connected component (the workspace's ``gpus[:A]``, the multi-copy ``experts[:X]`` joining
    them, ``fixed`` load of single-copy experts per GPU), level by level (module docstring), into ``num / den``.
    Without ``lex``, only the first level: every GPU of the component gets ``t*`` (its straggler, an upper
    bound)."""
    local, pos, w, item_start, item_hosts = ints[io[_LOCAL]:io[_LOCAL + 1]], ints[io[_POS]:io[_POS + 1]], ints[io[_W]:io[_W + 1]], ints[io[_ITEM_START]:io[_ITEM_START + 1]], ints[io[_ITEM_HOSTS]:io[_ITEM_HOSTS + 1]]
    extra, fixed, gpus, experts = ints[io[_EXTRA]:io[_EXTRA + 1]], ints[io[_FIXED]:io[_FIXED + 1]], ints[io[_GPUS]:io[_GPUS + 1]], ints[io[_EXPERTS]:io[_EXPERTS + 1]]
    active, settled, tight = bools[bo[_ACTIVE]:bo[_ACTIVE + 1]], bools[bo[_SETTLED]:bo[_SETTLED + 1]], bools[bo[_TIGHT]:bo[_TIGHT + 1]]
    for a in range(A):
        local[gpus[a]] = a
        active[a] = True
    settled[:X] = False
    while True:
        n_active = 0
        for a in range(A):
            if active[a]:
                pos[a] = n_active
                n_active += 1
                extra[a] = fixed[gpus[a]]
            else:
                pos[a] = -1
        if n_active == 0:
            return
        n_items = 0
        k = 0
        item_start[0] = 0
        for x in range(X):
            if settled[x]:
                continue
            e = experts[x]
            n_hosts = 0
            last = -1
            for j in range(hstart[e], hstart[e + 1]):
                a = local[hosts[j]]
                if active[a]:
                    n_hosts += 1
                    last = a
            if n_hosts == 0:
                settled[x] = True
            elif n_hosts == 1:  # no choice left: its other copies sit on GPUs already at their level
                extra[last] += W[e]
            else:
                w[n_items] = W[e]
                for j in range(hstart[e], hstart[e + 1]):
                    a = local[hosts[j]]
                    if active[a]:
                        item_hosts[k] = pos[a]
                        k += 1
                n_items += 1
                item_start[n_items] = k
        for a in range(A):
            if active[a] and extra[a] > 0:
                w[n_items] = extra[a]
                item_hosts[k] = pos[a]
                k += 1
                n_items += 1
                item_start[n_items] = k
        if n_items == 0:  # nothing left to carry
            for a in range(A):
                if active[a]:
                    num[gpus[a]], den[gpus[a]] = 0, 1
            return
        p, q = _level(n_items, n_active, ints, io, bools, bo)
        found = False
        for a in range(A):
            if active[a] and (tight[pos[a]] or not lex):
                num[gpus[a]], den[gpus[a]] = p, q
                active[a] = False
                found = True
        if not found:
            raise RuntimeError("minmax: a level without a tight GPU set (a bug)")


@njit(cache=True)
def solve_loads(W: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, G: int, lex: bool,
                ints: np.ndarray, io: np.ndarray, bools: np.ndarray, bo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(num, den)``: every GPU's load (``lex``) or an upper bound whose maximum is ``t*`` (not ``lex``).

    Experts with one copy add a fixed load; experts with several join their GPUs into connected components,
    each solved on its own (:func:`_component`); a GPU outside every component carries its fixed load.
    """
    fixed, parent, root, size = ints[io[_FIXED]:io[_FIXED + 1]], ints[io[_PARENT]:io[_PARENT + 1]], ints[io[_ROOT]:io[_ROOT + 1]], ints[io[_SIZE]:io[_SIZE + 1]]
    n_exp, multi, gpus, experts = ints[io[_N_EXP]:io[_N_EXP + 1]], ints[io[_MULTI]:io[_MULTI + 1]], ints[io[_GPUS]:io[_GPUS + 1]], ints[io[_EXPERTS]:io[_EXPERTS + 1]]
    E = W.shape[0]
    fixed[:] = 0
    for g in range(G):
        parent[g] = g
    n_multi = 0
    for e in range(E):
        if W[e] == 0:
            continue
        lo, hi = hstart[e], hstart[e + 1]
        if hi - lo == 1:
            fixed[hosts[lo]] += W[e]
        else:
            multi[n_multi] = e
            n_multi += 1
            r0 = _find(parent, hosts[lo])
            for j in range(lo + 1, hi):
                r = _find(parent, hosts[j])
                if r != r0:
                    parent[r] = r0
    num = fixed.copy()
    den = np.ones(G, np.int64)
    if n_multi == 0:
        return num, den
    size[:] = 0
    n_exp[:] = 0
    for g in range(G):
        root[g] = _find(parent, g)
        size[root[g]] += 1
    for x in range(n_multi):
        n_exp[root[hosts[hstart[multi[x]]]]] += 1
    for r in range(G):
        if n_exp[r] == 0:
            continue
        A = 0
        for g in range(G):
            if root[g] == r:
                gpus[A] = g
                A += 1
        X = 0
        for x in range(n_multi):
            if root[hosts[hstart[multi[x]]]] == r:
                experts[X] = multi[x]
                X += 1
        _component(W, hstart, hosts, X, A, lex, num, den, ints, io, bools, bo)
    return num, den


@njit(cache=True)
def lex_loads(W: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, G: int) -> tuple[np.ndarray, np.ndarray]:
    """The lexicographically optimal fractional GPU loads of one ``(batch, layer)``, as exact fractions.

    ``W int64 [E]`` expert loads (non-negative) and the :func:`host_lists` of the layer (every expert with
    load has a copy). Returns ``(num int64 [G], den int64 [G])``: GPU ``g`` carries ``num[g] / den[g]``
    tokens; the largest is the LP optimum ``t*``. Example: experts ``[6, 2]``, expert 0 on GPUs 0 and 1,
    expert 1 on GPU 1 only: loads ``[4, 4]`` (expert 0 sends 4 to GPU 0 and 2 to GPU 1).
    """
    E = W.shape[0]
    ints, io, bools, bo = workspace(E, G, hosts.shape[0])
    return solve_loads(W, hstart, hosts, G, True, ints, io, bools, bo)


@njit(cache=True)
def minmax_value(W: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, G: int) -> tuple[np.int64, np.int64]:
    """``(p, q)``: the least possible straggler load ``t* = p / q`` of one ``(batch, layer)`` (fractional)."""
    ints, io, bools, bo = workspace(W.shape[0], G, hosts.shape[0])
    return solve_value(W, hstart, hosts, G, ints, io, bools, bo)


@njit(cache=True)
def solve_value(W: np.ndarray, hstart: np.ndarray, hosts: np.ndarray, G: int, ints: np.ndarray, io: np.ndarray,
                bools: np.ndarray, bo: np.ndarray) -> tuple[np.int64, np.int64]:
    """:func:`minmax_value` in a given :func:`workspace`: ``(p, q)`` with ``t* = p / q``."""
    num, den = solve_loads(W, hstart, hosts, G, False, ints, io, bools, bo)
    p, q = np.int64(0), np.int64(1)
    for g in range(G):
        if num[g] * q > p * den[g]:
            p, q = num[g], den[g]
    return p, q
