"""Expert grouping by co-activation affinity (GRACE-MoE, seed paper 001, Section 4.1 and Appendix A.2).

Legend: ``L`` layers, ``E`` experts per layer, ``T`` tokens, ``K`` top-k, ``n`` experts being grouped (a
layer's, or one node's), ``D`` groups, ``r`` the non-uniformity ratio.

GRACE's affinity between experts ``i != j`` of a layer is the number of tokens that picked both (Section 4,
Figure 2a); the diagonal (an expert's own load) is no affinity and is set to 0 everywhere here. The pieces:

- :func:`affinity` and :func:`mixed_affinity` (Section 5.4's joint sampling over datasets);
- :func:`spectral_clustering` -- "fully non-uniform" groups with sizes set by affinity alone (Section 4.1):
  scikit-learn's ``SpectralClustering`` method (normalised-Laplacian embedding, k-means) in numpy, seeded;
- :func:`refine_groups` -- Alg. 2 steps 6-21 on given initial clusters, with per-group size bounds;
- :func:`alg2_bounds` and :func:`controlled_grouping` -- Alg. 2 whole (``r`` -> bounds -> clusters -> refine);
- :func:`utilization`, :func:`size_deviation` and :func:`knee_index` -- Eq. 1's ``U(r)``, ``S(r)`` and the knee
  of the ``(S(r), U(r))`` curve that picks ``r``.

Readings where the paper is ambiguous (written down as the guide asks):

- **Spectral clustering.** Alg. 2 line 5 calls ``SpectralClustering(A, D)`` (scikit-learn's name, affinity
  precomputed). We implement scikit-learn's method in numpy, with no new dependency: the embedding is
  ``D^-1/2 x`` for the ``D`` leading eigenvectors ``x`` of ``D^-1/2 A D^-1/2`` (``spectral_embedding`` with
  the normalised Laplacian, first vector kept), then k-means (k-means++ seeding, 10 restarts, the best
  inertia kept). We do not normalise rows to unit length (Ng, Jordan and Weiss): when a layer has more
  co-activation clusters than groups, a cluster that the leading eigenvectors miss embeds near the origin,
  and row normalisation would blow that noise up and scatter the cluster over all groups; unnormalised, it
  stays together. A layer without any co-activation (top-1 routing, no tokens) has no affinity to cluster
  by: its experts are split in id order. A vanishing ``1e-9 * max(A)`` is added between all pairs so that an
  expert no token shares with any other still has a defined embedding.
- **Alg. 2 line 8**, "keep top-``num_max`` by ``sum_{j in C_d} A_ij``; push rest to ``Omega``": we *peel*,
  dropping one expert at a time, each time the one with the smallest affinity to the members still kept
  (ties: lowest id), rather than ranking once against the whole of ``C_d``. Both keep the most attached
  experts; they differ when ``C_d`` holds a weakly attached sub-cluster, which a one-shot ranking cuts in
  pieces (each piece still scores on the others) and peeling removes whole, so that lines 13-16 can move it
  together. Example: a node cluster of three disconnected topics of 4 experts capped at 8 sheds one whole
  topic, where ranking once would shed the 4 least connected experts of any topics. ``Omega`` keeps the
  peeling order, groups in order, and is placed in that order (line 13 says "for each").
- **Alg. 2 line 14**, ``argmax_d IntraScore(A, L_d u {e})`` over groups with room. Alg. 1's score is said to
  "evaluate candidate assignments"; comparing the assignment of ``e`` to ``d`` with its assignment to ``d'``
  by the whole grouping's intra-group affinity (``sum_d IntraScore(L_d)`` after the move) ranks groups by the
  *gain* ``IntraScore(L_d u {e}) - IntraScore(L_d) = 2 * sum_{j in L_d} A_ej``. Taken in isolation the printed
  score would also add ``IntraScore(L_d)`` itself and so send every leftover expert to the densest group with
  room, whatever its affinity to it. We rank by the gain (``assign="gain"``, default); ``assign="printed"``
  keeps the literal score for comparison. Ties go to the smaller group, then the lower group index.
- **Alg. 2 lines 17-21**, "collect weakest affinity experts from ``|L_d| > num_min``": we collect
  ``S = sum_d need[d]`` experts one at a time, each time the expert with the smallest affinity to the rest of
  its own group (``sum_{j in L_d, j != e} A_ej``; ties: lowest id) among the groups still above ``num_min``
  (a group stops giving at ``num_min``), updating the scores after each removal. Then each collected expert,
  in the order collected, goes to the group with unmet need that maximises the score of line 14; this fills
  every need exactly.
- ``round`` in line 2 is Python's (half to even), as the pseudocode reads like Python. When fewer experts
  than groups are left (``n < D``), ``E = 0`` and ``num_min`` is 0, not 1: some groups must stay empty.
- **Knee.** Section 4.1 picks "the knee point" of the ``(S(r), U(r))`` plot without naming a rule; we use
  Kneedle's: the candidate farthest above the chord from the least to the most non-uniform candidate, in
  coordinates normalised so that the chord runs from (0, 0) to (1, 1). Ties, and curves with no point above
  the chord, go to the smaller ``r`` (the more uniform grouping). See :func:`knee_index`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from moebalance.errors import InputError
from moebalance.load import LoadMatrix
from moebalance.trace import RoutingTrace

__all__ = [
    "RATIO_GRID",
    "Assign",
    "affinity",
    "alg2_bounds",
    "blas_single_thread",
    "controlled_grouping",
    "cut_affinity",
    "knee_index",
    "mixed_affinity",
    "refine_groups",
    "size_deviation",
    "spectral_clustering",
    "utilization",
]

Assign = Literal["gain", "printed"]

#: Candidate non-uniformity ratios ``r`` for the knee search: from ``delta = 1`` (near uniform) to ``r = 1``
#: (sizes from 1 to twice the ideal, close to fully non-uniform).
RATIO_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))

# k-means restarts (scikit-learn's default n_init for spectral clustering) and iteration cap.
_N_INIT = 10
_MAX_ITER = 100


def blas_single_thread() -> contextlib.AbstractContextManager[Any]:
    """A context in which BLAS/LAPACK use one thread (``threadpoolctl``; a no-op where it is not installed).

    GRACE makes hundreds of small ``eigh`` calls (matrices of 16 to 256 experts). Multi-threaded OpenBLAS
    spends far more time synchronising its threads than computing on such sizes, and far more still when
    the cores are shared (``pytest -n 2``, a benchmark alongside): on 2 busy cores a 128 x 128 ``eigh`` took
    15 ms with two threads and 1.3 ms with one.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency; planning is only slower without it
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


# ----- affinity ------------------------------------------------------------------------------------------------

def affinity(trace: RoutingTrace) -> np.ndarray:
    """``int64 [L, E, E]``: tokens that picked both ``i`` and ``j`` in layer ``l``, with a zero diagonal.

    Equal to ``trace.coactivation()`` off the diagonal, computed one layer at a time (``T * K * K`` indices
    per layer instead of ``T * L * K * K`` at once: 0.25 s and 8 MB instead of 1.5 s and 400 MB for 16k
    tokens of a 48-layer, 128-expert, top-8 model).
    """
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    out = np.zeros((L, E, E), dtype=np.int64)
    if trace.num_tokens == 0 or K < 2:
        return out
    dtype = np.int32 if E * E < 2**31 else np.int64
    for layer in range(L):
        ids: np.ndarray = trace.topk_ids[:, layer, :].astype(dtype)
        flat = (ids[:, :, None] * E + ids[:, None, :]).ravel()
        out[layer] = np.bincount(flat, minlength=E * E).reshape(E, E)
    idx = np.arange(E)
    out[:, idx, idx] = 0
    return out


def mixed_affinity(traces: Sequence[RoutingTrace | LoadMatrix], weights: Sequence[float] | None = None, *,
                   normalize: bool = True) -> np.ndarray:
    """``float64 [L, E, E]``: affinity from several traces (datasets) combined (GRACE Section 5.4).

    Section 5.4 builds "expert affinity matrices with joint sampling across multiple datasets" and finds they
    generalise better than any single dataset's. With ``normalize=True`` (default) each trace's affinity is
    divided, per layer, by its total (so a layer's matrix sums to 1 and a dataset counts by its weight, not by
    its token count), and the results are averaged with ``weights`` (default: equal). With
    ``normalize=False`` the raw co-activation counts are summed with the weights: with equal weights that is
    pooling all tokens, i.e. sampling the datasets in proportion to their sizes. A layer in which a trace has
    no co-activation contributes nothing from that trace.

    Example: two traces of one layer whose only co-activations are ``(0, 1)`` 10 times and ``(2, 3)`` once give,
    normalised and equally weighted, ``0.25`` at ``[0, 0, 1]`` and ``[0, 2, 3]`` (and their mirrors).
    """
    if len(traces) == 0:
        raise InputError("mixed_affinity needs at least one trace")
    parts = []
    for i, tr in enumerate(traces):
        if isinstance(tr, LoadMatrix):
            if tr.trace is None:
                raise InputError(f"traces[{i}] has counts only; affinity needs a token-level trace (topk_ids)")
            tr = tr.trace
        if not isinstance(tr, RoutingTrace):
            raise InputError(f"traces[{i}] is a {type(tr).__name__}; give RoutingTrace or token-level LoadMatrix")
        parts.append(tr)
    shape = (parts[0].num_layers, parts[0].num_experts)
    for i, tr in enumerate(parts):
        if (tr.num_layers, tr.num_experts) != shape:
            raise InputError(f"traces[{i}] has [L, E] = {[tr.num_layers, tr.num_experts]} but traces[0] has "
                             f"{list(shape)}; mix traces of one model")
    w = np.ones(len(parts)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(parts),):
        raise InputError(f"weights has {w.size} entries for {len(parts)} traces; give one weight per trace")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise InputError(f"weights {w.tolist()} must be finite, non-negative and not all zero")
    w = w / w.sum()
    out = np.zeros((shape[0], shape[1], shape[1]))
    for wi, tr in zip(w, parts, strict=True):
        a = affinity(tr).astype(np.float64)
        if normalize:
            total = a.sum(axis=(1, 2), keepdims=True)
            a = np.divide(a, total, out=np.zeros_like(a), where=total > 0)
        out += wi * a
    return out


# ----- spectral clustering ---------------------------------------------------------------------------------------

def _symmetric_offdiag(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    assert a.ndim == 2 and a.shape[0] == a.shape[1], a.shape
    a = (a + a.T) / 2
    np.fill_diagonal(a, 0.0)
    return a


def _kmeans(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Labels ``int64 [n]`` of the best of ``_N_INIT`` k-means runs (k-means++ seeding), all run at once."""
    n = x.shape[0]
    R = _N_INIT
    sq = (x * x).sum(axis=1)

    def dist(c: np.ndarray) -> np.ndarray:  # [R, n, k'] squared distances to centres c [R, k', dim]
        return np.maximum(sq[None, :, None] - 2 * np.einsum("nd,rkd->rnk", x, c) + (c * c).sum(axis=2)[:, None, :], 0)

    centres = np.empty((R, k, x.shape[1]))
    centres[:, 0] = x[rng.integers(n, size=R)]
    d2 = dist(centres[:, :1])[:, :, 0]
    for c in range(1, k):
        total = d2.sum(axis=1, keepdims=True)
        p = np.where(total > 0, d2 / np.where(total > 0, total, 1), 1.0 / n)
        pick = (p.cumsum(axis=1) < rng.random((R, 1))).sum(axis=1).clip(0, n - 1)
        centres[:, c] = x[pick]
        d2 = np.minimum(d2, dist(centres[:, c:c + 1])[:, :, 0])
    labels = np.zeros((R, n), dtype=np.int64)
    for _ in range(_MAX_ITER):
        labels = np.argmin(dist(centres), axis=2)
        onehot = labels[:, :, None] == np.arange(k)[None, None, :]
        size = onehot.sum(axis=1)
        new = np.einsum("rnk,nd->rkd", onehot.astype(np.float64), x)
        new = np.where(size[:, :, None] > 0, new / np.maximum(size, 1)[:, :, None], centres)  # empty: keep
        if np.allclose(new, centres, rtol=0, atol=1e-12):
            break
        centres = new
    d = dist(centres)
    labels = np.argmin(d, axis=2)
    inertia = np.take_along_axis(d, labels[:, :, None], axis=2).sum(axis=(1, 2))
    return labels[int(np.argmin(inertia))]


def _canonical(labels: np.ndarray, k: int) -> np.ndarray:
    """Renumber labels in order of first appearance (by expert id), so equal partitions compare equal."""
    first = np.full(k, labels.size, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(labels.size))
    rank = np.empty(k, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(k)
    return rank[labels]


def spectral_clustering(affinity: np.ndarray, num_clusters: int, seed: int | Sequence[int] = 0) -> np.ndarray:
    """``int64 [n]``: cluster of each expert, ``num_clusters`` clusters with sizes set by affinity alone.

    ``affinity [n, n]`` is symmetrised and its diagonal ignored. Clusters are numbered in order of their
    smallest expert id; a cluster may come out empty (k-means), which Alg. 2 then fills. ``seed`` seeds the
    k-means restarts (``numpy.random.default_rng(seed)``), so the result is deterministic.

    Example: a block-diagonal affinity with blocks ``{0, 2}`` and ``{1, 3}`` gives ``[0, 1, 0, 1]``.
    """
    a = _symmetric_offdiag(affinity)
    n = a.shape[0]
    k = int(num_clusters)
    assert k >= 1
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    top = a.max(initial=0.0)
    if top <= 0:  # no co-activation to cluster by: id order
        return (np.arange(n) * k) // n
    a = a + 1e-9 * top * (1.0 - np.eye(n))
    inv = 1.0 / np.sqrt(a.sum(axis=1))
    m = inv[:, None] * a * inv[None, :]
    with blas_single_thread():
        _, vecs = np.linalg.eigh(m)
    u = vecs[:, -k:] * inv[:, None]  # scikit-learn's spectral_embedding: u = D^-1/2 x
    u = u / np.abs(u).max()  # scale-free k-means tolerances
    return _canonical(_kmeans(u, k, np.random.default_rng(seed)), k)


# ----- Alg. 2 ------------------------------------------------------------------------------------------------

def alg2_bounds(num_experts: int, num_groups: int, ratio: float) -> tuple[int, int, int, int]:
    """Alg. 2 lines 2-3: ``(E, delta, num_min, num_max)`` for ``n`` experts in ``D`` groups with ratio ``r``.

    ``E = floor(n / D)``, ``delta = max(1, round(E * r))``, ``num_min = max(1, E - delta)`` (0 when ``n < D``),
    ``num_max = E + delta``. Example: 64 experts, 8 groups, ``r = 0.3``: ``(8, 2, 6, 10)``.
    """
    e = num_experts // num_groups
    delta = max(1, round(e * ratio))
    num_min = max(1, e - delta) if num_experts >= num_groups else 0
    return e, delta, num_min, e + delta


def refine_groups(affinity: np.ndarray, labels: np.ndarray, num_groups: int, num_min: int | np.ndarray,
                  num_max: int | np.ndarray, assign: Assign = "gain") -> np.ndarray:
    """Alg. 2 lines 6-21: ``int64 [n]`` groups with ``num_min[d] <= |L_d| <= num_max[d]`` from initial clusters.

    ``labels [n]`` are the initial clusters ``C_d``, ids in ``[0, num_groups)`` (some may be empty); the bounds
    are one number or one per group (GRACE's node level caps each node by its memory, see the policy).
    Needs ``sum(num_min) <= n <= sum(num_max)``. The readings of lines 14 and 19-20 are in the module docstring.

    Example: see ``tests/test_grace.py::test_alg2_steps_6_to_21_hand_case``, derived line by line.
    """
    a = _symmetric_offdiag(affinity)
    n = a.shape[0]
    labels = np.asarray(labels, dtype=np.int64)
    D = int(num_groups)
    hi = np.broadcast_to(np.asarray(num_max, dtype=np.int64), (D,))
    lo = np.broadcast_to(np.asarray(num_min, dtype=np.int64), (D,))
    assert labels.shape == (n,) and (n == 0 or 0 <= labels.min() <= labels.max() < D)
    assert lo.sum() <= n <= hi.sum() and np.all(lo <= hi), (lo.tolist(), hi.tolist(), n)
    group = labels.copy()
    omega: list[int] = []
    for d in range(D):  # lines 6-12: trim clusters above num_max, keeping the most attached experts (peeling)
        members = np.flatnonzero(group == d)
        if members.size > hi[d]:
            sub = a[np.ix_(members, members)]
            score = sub.sum(axis=1)
            alive = np.ones(members.size, dtype=bool)
            for _ in range(members.size - int(hi[d])):
                cand = np.flatnonzero(alive)
                i = int(cand[np.lexsort((members[cand], score[cand]))[0]])
                alive[i] = False
                score -= sub[:, i]
                group[members[i]] = -1
                omega.append(int(members[i]))
    onehot = np.zeros((n, D))
    live = group >= 0
    onehot[np.flatnonzero(live), group[live]] = 1.0
    to_group = a @ onehot  # [n, D]: sum_{j in L_d} A_ej
    intra = (onehot * to_group).sum(axis=0)  # [D]: IntraScore(L_d)
    sizes = np.bincount(group[live], minlength=D)

    def rank(e: int) -> np.ndarray:  # line 14's score of putting e in each group
        gain = 2.0 * to_group[e]
        return gain if assign == "gain" else intra + gain

    def move(e: int, d: int) -> None:
        intra[d] += 2.0 * to_group[e, d]
        group[e] = d
        sizes[d] += 1
        to_group[:, d] += a[:, e]

    def best(e: int, allowed: np.ndarray) -> int:
        cand = np.flatnonzero(allowed)
        s = rank(e)[cand]
        return int(cand[np.lexsort((cand, sizes[cand], -s))[0]])

    for e in omega:  # lines 13-16
        move(e, best(e, sizes < hi))
    need = np.maximum(0, lo - sizes)  # line 17
    if need.sum() > 0:  # lines 18-21
        collected = []
        for _ in range(int(need.sum())):
            donor = (group >= 0) & (sizes[np.maximum(group, 0)] > lo[np.maximum(group, 0)])
            cand = np.flatnonzero(donor)
            own = to_group[cand, group[cand]]
            e = int(cand[np.lexsort((cand, own))[0]])
            d = int(group[e])
            intra[d] -= 2.0 * to_group[e, d]
            group[e] = -1
            sizes[d] -= 1
            to_group[:, d] -= a[:, e]
            collected.append(e)
        for e in collected:
            d = best(e, need > 0)
            move(e, d)
            need[d] -= 1
    assert np.all(group >= 0) and np.all((sizes >= lo) & (sizes <= hi))
    return group


def controlled_grouping(affinity: np.ndarray, num_groups: int, ratio: float, seed: int | Sequence[int] = 0,
                        cap: int | None = None, labels: np.ndarray | None = None,
                        assign: Assign = "gain") -> np.ndarray:
    """Alg. 2: ``int64 [n]`` group of each expert, sizes within ``[E - delta, E + delta]`` (:func:`alg2_bounds`).

    ``cap`` lowers ``num_max`` to what memory allows (the policy's budget; it must be at least
    ``ceil(n / D)``). ``labels`` skips line 5 with given initial clusters (the knee search clusters once and
    refines for every candidate ``r``).
    """
    a = np.asarray(affinity, dtype=np.float64)
    n, D = a.shape[0], int(num_groups)
    _, _, lo, hi = alg2_bounds(n, D, ratio)
    if cap is not None:
        assert cap * D >= n, (cap, D, n)
        hi = min(hi, int(cap))
    if labels is None:
        labels = spectral_clustering(a, D, seed)
    return refine_groups(a, labels, D, lo, hi, assign)


# ----- Eq. 1 and the knee ------------------------------------------------------------------------------------

def utilization(affinity: np.ndarray, groups: np.ndarray) -> float:
    """Eq. 1's ``U``: the share of all pairwise affinity ``sum_{i<j} A_ij`` that lies within groups (0 if none)."""
    a = _symmetric_offdiag(affinity)
    total = a.sum()
    if total <= 0:
        return 0.0
    g = np.asarray(groups)
    return float(a[g[:, None] == g[None, :]].sum() / total)


def size_deviation(groups: np.ndarray, num_groups: int) -> float:
    """Eq. 1's ``S``: the root-mean-square deviation of group sizes from the ideal ``n / D`` (real-valued)."""
    g = np.asarray(groups)
    sizes = np.bincount(g, minlength=num_groups)
    return float(np.sqrt(np.mean((sizes - g.size / num_groups) ** 2)))


def knee_index(s: Sequence[float], u: Sequence[float]) -> int:
    """Index of the knee of the curve ``(S_i, U_i)``, candidates given in increasing ``r`` (Kneedle).

    Points are ordered by ``S`` (ties: by index); with the least non-uniform point ``(S_0, U_0)`` and the most
    non-uniform ``(S_1, U_1)``, the knee maximises ``(U - U_0) / (U_1 - U_0) - (S - S_0) / (S_1 - S_0)``: the
    farthest above the chord. Ties go to the lower index. If all ``S`` are equal, or ``U_1 <= U_0`` (more
    non-uniformity buys no affinity), the candidate with the largest ``U`` wins (ties: lower index).

    Example: ``S = [0, 1, 2, 3]``, ``U = [0, .8, .9, 1]`` -> distances ``[0, .47, .23, 0]`` -> index 1.
    """
    x = np.asarray(s, dtype=np.float64)
    y = np.asarray(u, dtype=np.float64)
    assert x.shape == y.shape and x.size >= 1
    order = np.lexsort((np.arange(x.size), x))
    x0, y0 = x[order[0]], y[order[0]]
    x1, y1 = x[order[-1]], y[order[-1]]
    if x1 <= x0 or y1 <= y0:
        return int(np.flatnonzero(y == y.max())[0])
    dist = (y - y0) / (y1 - y0) - (x - x0) / (x1 - x0)
    return int(np.flatnonzero(dist >= dist.max() - 1e-12)[0])


def cut_affinity(affinity: np.ndarray, groups: np.ndarray) -> float:
    """``sum_{i<j, g_i != g_j} A_ij``: the co-activation split across groups (tokens sent to two places)."""
    a = _symmetric_offdiag(affinity)
    g = np.asarray(groups)
    return float(a[g[:, None] != g[None, :]].sum() / 2)
