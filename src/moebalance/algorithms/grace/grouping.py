"""Expert grouping by co-activation affinity (GRACE-MoE, Section 4.1 and Appendix A.2).

Legend: ``L`` layers, ``E`` experts per layer, ``T`` tokens, ``K`` top-k, ``n`` experts being grouped (a
layer's, or one node's), ``D`` groups, ``r`` the non-uniformity ratio.

GRACE's affinity between experts ``i != j`` of a layer is the number of tokens that picked both (Section 4,
Figure 2a); the diagonal (an expert's own load) is no affinity and is set to 0 everywhere here. The pieces:

- :func:`affinity` and :func:`mixed_affinity` (Section 5.4's joint sampling over datasets);
- :func:`spectral_clustering` -- "fully non-uniform" groups with sizes set by affinity alone (Section 4.1):
  scikit-learn's method (normalised-Laplacian embedding by SciPy's ``eigh``, scikit-learn's ``KMeans``),
  seeded and deterministic;
- :func:`refine_groups` -- Alg. 2 steps 6-21 on given initial clusters, with per-group size bounds;
- :func:`alg2_bounds` and :func:`controlled_grouping` -- Alg. 2 whole (``r`` -> bounds -> clusters -> refine);
- :func:`utilization`, :func:`size_deviation` and :func:`knee_index` -- Eq. 1's ``U(r)``, ``S(r)`` and the knee
  of the ``(S(r), U(r))`` curve that picks ``r``.

After "GRACE-MoE: Grouping and Replication with Locality-Aware Routing for Efficient Distributed MoE
Inference". Our readings where the paper leaves room (spectral clustering by SciPy's ``eigh`` and seeded
k-means, Alg. 2's peeling at line 8, the gain score at line 14, the collection at lines 17-21, rounding, the
Kneedle rule for the knee) are in ``docs/papers/grace.md``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.options import check_choice, check_int
from moebalance.core.trace import RoutingTrace

__all__ = [
    "RATIO_GRID",
    "Assign",
    "affinity",
    "alg2_bounds",
    "blas_single_thread",
    "check_ratio",
    "controlled_grouping",
    "cut_affinity",
    "import_spectral",
    "knee_index",
    "mixed_affinity",
    "refine_groups",
    "size_deviation",
    "spectral_clustering",
    "spectral_clustering_in_context",
    "utilization",
]

Assign = Literal["gain", "printed"]

#: Candidate non-uniformity ratios ``r`` for the knee search: from ``delta = 1`` (near uniform) to ``r = 1``
#: (sizes from 1 to twice the ideal, close to fully non-uniform).
RATIO_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))


def blas_single_thread() -> contextlib.AbstractContextManager[Any]:
    """A context in which BLAS/LAPACK and OpenMP use one thread (``threadpoolctl``; a no-op where it is missing).

    GRACE makes hundreds of small ``eigh`` and k-means calls (matrices of 16 to 256 experts). Multi-threaded
    OpenBLAS spends far more time synchronising its threads than computing on such sizes, and far more still
    when the cores are shared (parallel tests, a benchmark alongside); scikit-learn's k-means (OpenMP) alike.
    Only libraries loaded when the context is entered are limited (see ``import_spectral``).
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency; planning is only slower without it
        return contextlib.nullcontext()
    return threadpool_limits(limits=1)


# ----- affinity ------------------------------------------------------------------------------------------------

def affinity(trace: RoutingTrace) -> np.ndarray:
    """``int64 [L, E, E]``: tokens that picked both ``i`` and ``j`` in layer ``l``, with a zero diagonal.

    ``trace.coactivation()`` without its diagonal (which is each expert's load, not an affinity).
    """
    out = trace.coactivation()
    idx = np.arange(trace.num_experts)
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

def _check_affinity(affinity: object, name: str = "affinity") -> np.ndarray:
    """``float64 [n, n]``: a user's affinity, symmetrised with a zero diagonal; refuses what is no affinity."""
    try:
        a = np.asarray(affinity, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{name} ({type(affinity).__name__}) is not a numeric array; give a square [n, n] "
                         f"matrix of co-activation counts") from None
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise InputError(f"{name} has shape {list(a.shape)}; give a square [n, n] matrix (one layer's "
                         f"co-activation counts)")
    _check_values(a, name)
    a = (a + a.T) / 2
    np.fill_diagonal(a, 0.0)
    return a


def _check_values(a: np.ndarray, name: str) -> None:
    """Refuse NaN, infinite or negative entries of a count-like array ``a`` (named ``name`` in the error)."""
    bad = ~np.isfinite(a)
    if bad.any():
        where = [int(i) for i in np.argwhere(bad)[0]]
        raise InputError(f"{name} has {int(bad.sum())} NaN or infinite entries (the first, {a[tuple(where)]}, "
                         f"at {where}); give finite counts")
    if (a < 0).any():
        where = [int(i) for i in np.argwhere(a < 0)[0]]
        raise InputError(f"{name} has {int((a < 0).sum())} negative entries (the first, {a[tuple(where)]}, "
                         f"at {where}); counts must be >= 0")


def _check_groups(groups: object, n: int | None, num_groups: int | None, name: str = "groups") -> np.ndarray:
    """``int64 [n]``: one group id in ``[0, num_groups)`` per expert (any ``n`` / no upper bound when None)."""
    g = np.asarray(groups)
    size = g.size if n is None else n
    if g.shape != (size,) or (size > 0 and not np.issubdtype(g.dtype, np.integer)):
        raise InputError(f"{name} has shape {list(g.shape)} and dtype {g.dtype}; give one integer group id per "
                         f"expert (shape [{size}])")
    g = g.astype(np.int64)
    if size > 0 and (g.min() < 0 or (num_groups is not None and g.max() >= num_groups)):
        raise InputError(f"{name} holds ids from {int(g.min())} to {int(g.max())}; ids must lie in "
                         f"[0, {'any' if num_groups is None else num_groups})")
    return g


def _check_bound(name: str, value: object, num_groups: int) -> np.ndarray:
    """``int64 [D]``: a group-size bound given as one integer or one per group."""
    v = np.asarray(value)
    if v.ndim > 1 or (v.ndim == 1 and v.size != num_groups) or v.dtype == bool \
            or not np.issubdtype(v.dtype, np.integer) or np.any(v < 0):
        raise InputError(f"{name} ({value!r}) must be a non-negative integer or one per group "
                         f"({num_groups} of them)")
    return np.broadcast_to(v.astype(np.int64), (num_groups,))


def check_ratio(name: str, value: object, none_means: str | None = None) -> float | None:
    """A finite non-negative ratio (GRACE's ``r``) as a ``float``; None is accepted when ``none_means`` says
    what it stands for, else refused."""
    if value is None and none_means is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) \
            or not math.isfinite(value) or value < 0:
        alternative = "" if none_means is None else f", or None for {none_means}"
        raise InputError(f"{name} ({value!r}) must be a finite non-negative number (GRACE's r, e.g. 0.3)"
                         f"{alternative}")
    return float(value)


def _canonical(labels: np.ndarray, k: int) -> np.ndarray:
    """Renumber labels in order of first appearance (by expert id), so equal partitions compare equal."""
    first = np.full(k, labels.size, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(labels.size))
    rank = np.empty(k, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(k)
    return rank[labels]


def _random_state(seed: object) -> int:
    """scikit-learn's ``random_state`` (a 32-bit integer) derived from a seed or a tuple of seeds."""
    try:
        return int(np.random.SeedSequence(seed).generate_state(1)[0])  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(f"seed ({seed!r}) must be a non-negative integer or a sequence of them") from None


def spectral_clustering(affinity: np.ndarray, num_clusters: int, seed: int | Sequence[int] = 0) -> np.ndarray:
    """``int64 [n]``: cluster of each expert, ``num_clusters`` clusters with sizes set by affinity alone.

    ``affinity [n, n]`` (finite, non-negative) is symmetrised and its diagonal ignored. scikit-learn's method
    (see the module docstring): the embedding ``D^-1/2 x`` of the leading eigenvectors ``x`` of
    ``D^-1/2 A D^-1/2``, by SciPy's dense ``eigh``, then scikit-learn's ``KMeans`` (10 restarts), with BLAS and
    OpenMP on one thread. ``seed`` (an integer or a tuple of them) seeds the restarts through
    ``numpy.random.SeedSequence``; the result is deterministic. Clusters are numbered in order of their
    smallest expert id, and one may come out empty, which Alg. 2 then fills. Fewer experts than clusters: one
    expert per cluster; no affinity at all: id order.

    Example: a block-diagonal affinity with blocks ``{0, 2}`` and ``{1, 3}`` gives ``[0, 1, 0, 1]``.
    """
    a = _check_affinity(affinity)
    k = check_int("num_clusters", num_clusters, minimum=1)
    random_state = _random_state(seed)
    import_spectral()  # before threads are limited, so that the limit reaches SciPy's BLAS and OpenMP too
    with blas_single_thread():
        return _spectral_labels(a, k, random_state)


def import_spectral() -> tuple[Any, Any]:
    """``(scipy.linalg.eigh, sklearn.cluster.KMeans)``, imported on first use.

    ``blas_single_thread`` limits the libraries loaded when it is entered: a caller that clusters inside it
    (the GRACE policy) calls this first, so that SciPy's BLAS and scikit-learn's OpenMP are loaded by then.
    """
    from scipy.linalg import eigh
    from sklearn.cluster import KMeans

    return eigh, KMeans


def _spectral_labels(a: np.ndarray, k: int, random_state: int) -> np.ndarray:
    """:func:`spectral_clustering` on a checked affinity (symmetric, zero diagonal), in the caller's thread limits."""
    n = a.shape[0]
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    top = a.max(initial=0.0)
    if top <= 0:  # no co-activation to cluster by: id order
        return (np.arange(n) * k) // n
    a = a / top + 1e-9 * (1.0 - np.eye(n))  # connected, and every expert has some affinity
    eigh, kmeans = import_spectral()
    inv = 1.0 / np.sqrt(a.sum(axis=1))
    _, x = eigh(inv[:, None] * a * inv[None, :], subset_by_index=[n - k, n - 1], driver="evr")
    u = x * inv[:, None]  # scikit-learn's spectral_embedding: u = D^-1/2 x, rows not normalised
    with warnings.catch_warnings():  # fewer distinct points than clusters: an empty cluster, which Alg. 2 fills
        warnings.filterwarnings("ignore", message="Number of distinct clusters")
        labels = kmeans(n_clusters=k, n_init=10, random_state=random_state).fit(u).labels_
    return _canonical(np.asarray(labels, dtype=np.int64), k)


def spectral_clustering_in_context(affinity: np.ndarray, num_clusters: int, seed: int | Sequence[int]) -> np.ndarray:
    """:func:`spectral_clustering` for a caller already in ``blas_single_thread``, entered after
    :func:`import_spectral`, so that one context serves many clusterings."""
    return _spectral_labels(_check_affinity(affinity), check_int("num_clusters", num_clusters, minimum=1),
                            _random_state(seed))


# ----- Alg. 2 ------------------------------------------------------------------------------------------------

def alg2_bounds(num_experts: int, num_groups: int, ratio: float) -> tuple[int, int, int, int]:
    """Alg. 2 lines 2-3: ``(E, delta, num_min, num_max)`` for ``n`` experts in ``D`` groups with ratio ``r``.

    ``E = floor(n / D)``, ``delta = max(1, round(E * r))``, ``num_min = max(1, E - delta)`` (0 when ``n < D``),
    ``num_max = E + delta``. Example: 64 experts, 8 groups, ``r = 0.3``: ``(8, 2, 6, 10)``.
    """
    n = check_int("num_experts", num_experts, minimum=0)
    e = n // check_int("num_groups", num_groups, minimum=1)
    delta = max(1, round(e * float(check_ratio("ratio", ratio) or 0.0)))
    num_min = max(1, e - delta) if num_experts >= num_groups else 0
    return e, delta, num_min, e + delta


def refine_groups(affinity: np.ndarray, labels: np.ndarray, num_groups: int, num_min: int | np.ndarray,
                  num_max: int | np.ndarray, assign: Assign = "gain") -> np.ndarray:
    """Alg. 2 lines 6-21: ``int64 [n]`` groups with ``num_min[d] <= |L_d| <= num_max[d]`` from initial clusters.

    ``labels [n]`` are the initial clusters ``C_d``, ids in ``[0, num_groups)`` (some may be empty); the bounds
    are one number or one per group (GRACE's node level: what a node's GPUs may hold).
    Needs ``sum(num_min) <= n <= sum(num_max)``. The readings of lines 14 and 19-20 are in the module docstring.

    Example: see ``tests/test_grace.py::test_alg2_steps_6_to_21_hand_case``, derived line by line.
    """
    a = _check_affinity(affinity)
    n = a.shape[0]
    D = check_int("num_groups", num_groups, minimum=1)
    labels = _check_groups(labels, n, D, "labels")
    hi = _check_bound("num_max", num_max, D)
    lo = _check_bound("num_min", num_min, D)
    if np.any(lo > hi):
        raise InputError(f"num_min {lo.tolist()} exceeds num_max {hi.tolist()} for some group; give "
                         f"num_min <= num_max")
    if not lo.sum() <= n <= hi.sum():
        raise InputError(f"{n} experts cannot form {D} groups of num_min {lo.tolist()} to num_max {hi.tolist()}; "
                         f"give bounds with sum(num_min) ({int(lo.sum())}) <= {n} <= sum(num_max) ({int(hi.sum())})")
    check_choice("assign", assign, ("gain", "printed"))
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

    ``cap`` lowers ``num_max`` to what memory allows (the policy's budget; an integer of at least
    ``ceil(n / D)``). ``labels`` skips line 5 with given initial clusters (the knee search clusters once and
    refines for every candidate ``r``).
    """
    a = _check_affinity(affinity)
    n = a.shape[0]
    D = check_int("num_groups", num_groups, minimum=1)
    _, _, lo, hi = alg2_bounds(n, D, ratio)
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int | np.integer) or cap * D < n:
            raise InputError(f"cap ({cap!r}) must be an integer of at least ceil({n} experts / {D} groups) = "
                             f"{-(-n // D)}, or None for no memory cap")
        hi = min(hi, int(cap))
    if labels is None:
        labels = spectral_clustering(a, D, seed)
    return refine_groups(a, labels, D, lo, hi, assign)


# ----- Eq. 1 and the knee ------------------------------------------------------------------------------------

def utilization(affinity: np.ndarray, groups: np.ndarray) -> float:
    """Eq. 1's ``U``: the share of all pairwise affinity ``sum_{i<j} A_ij`` that lies within groups (0 if none)."""
    a = _check_affinity(affinity)
    g = _check_groups(groups, a.shape[0], None)
    total = a.sum()
    if total <= 0:
        return 0.0
    return float(a[g[:, None] == g[None, :]].sum() / total)


def size_deviation(groups: np.ndarray, num_groups: int) -> float:
    """Eq. 1's ``S``: the root-mean-square deviation of group sizes from the ideal ``n / D`` (real-valued)."""
    D = check_int("num_groups", num_groups, minimum=1)
    g = _check_groups(groups, None, D)
    sizes = np.bincount(g, minlength=D)
    return float(np.sqrt(np.mean((sizes - g.size / D) ** 2)))


def knee_index(s: Sequence[float], u: Sequence[float]) -> int:
    """Index of the knee of the curve ``(S_i, U_i)``, candidates given in increasing ``r`` (Kneedle).

    Points are ordered by ``S`` (ties: by index); with the least non-uniform point ``(S_0, U_0)`` and the most
    non-uniform ``(S_1, U_1)``, the knee maximises ``(U - U_0) / (U_1 - U_0) - (S - S_0) / (S_1 - S_0)``: the
    farthest above the chord. Ties go to the lower index. If all ``S`` are equal, or ``U_1 <= U_0`` (more
    non-uniformity buys no affinity), the candidate with the largest ``U`` wins (ties: lower index).

    Example: ``S = [0, 1, 2, 3]``, ``U = [0, .8, .9, 1]`` -> distances ``[0, .47, .23, 0]`` -> index 1.
    """
    try:
        x = np.asarray(s, dtype=np.float64)
        y = np.asarray(u, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError("knee_index needs two equal-length sequences of numbers, S(r) and U(r)") from None
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise InputError(f"S has shape {list(x.shape)} and U {list(y.shape)}; give one (S, U) pair per candidate "
                         f"r, at least one")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise InputError(f"S {x.tolist()} and U {y.tolist()} must be finite")
    order = np.lexsort((np.arange(x.size), x))
    x0, y0 = x[order[0]], y[order[0]]
    x1, y1 = x[order[-1]], y[order[-1]]
    if x1 <= x0 or y1 <= y0:
        return int(np.flatnonzero(y == y.max())[0])
    dist = (y - y0) / (y1 - y0) - (x - x0) / (x1 - x0)
    return int(np.flatnonzero(dist >= dist.max() - 1e-12)[0])


def cut_affinity(affinity: np.ndarray, groups: np.ndarray) -> float:
    """``sum_{i<j, g_i != g_j} A_ij``: the co-activation split across groups (tokens sent to two places)."""
    a = _check_affinity(affinity)
    g = _check_groups(groups, a.shape[0], None)
    return float(a[g[:, None] != g[None, :]].sum() / 2)
