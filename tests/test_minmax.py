"""The ``minmax`` router, checked against answers computed independently of its flow algorithm.

- Counts (fractional): the straggler equals the optimum of the LP ``min t`` solved by SciPy's HiGHS; the load
  vector is the lexicographically smallest one, certified two ways: by Fujishige's theorem on the load vector
  alone (every set of GPUs is able to carry what is confined to it, and every upper level set carries
  exactly what is confined to it), and by an iterated HiGHS LP (minimise the max, fix the GPUs forced to it,
  repeat).
- Tokens (whole picks): on tiny cases every assignment of every pick to a host is enumerated; the router's
  straggler is the least possible and its traffic cost the least among the assignments reaching it.
- Every other registered router is at least as loaded on every ``(batch, layer)``; ``routing_gap`` agrees.
- Dropped picks (``assign_kept``) get -1 and the kept picks alone reach their own optimum.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import random_replica_layers
from hypothesis import given
from scipy.optimize import linprog

from moebalance.algorithms import minmax as kernel
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.routing import ROUTERS
from moebalance.routing.minmax import least_max_load
from moebalance.routing.simulate import evaluate

MINMAX = ROUTERS["minmax"]
#: Every registered router ready to run: metro models expert time, so it gets a GPU and a model.
READY = {n: r.with_params(gpu="h100-80gb", model="deepseek-v3") if n == "metro" else r for n, r in ROUTERS.items()}
#: HiGHS's default feasibility tolerances are 1e-7 absolute; tighter ones keep the reference LPs near-exact
HIGHS = {"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}
RNG = np.random.default_rng(0)  # the minmax router ignores its rng; the others get a fresh seeded one


# ---------------------------------------------------------------------------------------------------------
# independent references
# ---------------------------------------------------------------------------------------------------------


def _lp_rows(W: np.ndarray, has: np.ndarray) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray, np.ndarray]:
    """The split LP's pieces: variables ``x[e, g]`` for every copy of an expert with load, the equality rows
    ``sum_g x[e, g] = W[e]`` and the ``[G, n]`` matrix mapping ``x`` to GPU loads."""
    E, G = has.shape
    pairs = [(e, g) for e in range(E) for g in range(G) if has[e, g] and W[e] > 0]
    loaded = [e for e in range(E) if W[e] > 0]
    A_eq = np.zeros((len(loaded), len(pairs)))
    for j, (e, _g) in enumerate(pairs):
        A_eq[loaded.index(e), j] = 1.0
    to_gpu = np.zeros((G, len(pairs)))
    for j, (_e, g) in enumerate(pairs):
        to_gpu[g, j] = 1.0
    return pairs, A_eq, np.asarray([W[e] for e in loaded], dtype=float), to_gpu


def lp_optimum(W: np.ndarray, has: np.ndarray) -> float:
    """``t*`` by HiGHS: ``min t`` s.t. ``sum_g x[e, g] = W[e]``, ``sum_e x[e, g] <= t``, ``x >= 0`` only on copies."""
    if not np.any(W > 0):
        return 0.0
    pairs, A_eq, b_eq, to_gpu = _lp_rows(W, has)
    n, G = len(pairs), has.shape[1]
    c = np.zeros(n + 1)
    c[-1] = 1.0
    A_ub = np.hstack([to_gpu, -np.ones((G, 1))])
    res = linprog(c, A_ub=A_ub, b_ub=np.zeros(G), A_eq=np.hstack([A_eq, np.zeros((A_eq.shape[0], 1))]), b_eq=b_eq,
                  bounds=(0, None), method="highs", options=HIGHS)
    assert res.status == 0, res.message
    return float(res.fun)


def lex_loads_by_lp(W: np.ndarray, has: np.ndarray) -> np.ndarray:
    """The lexicographically smallest load vector (``[G]``), by iterated HiGHS LPs.

    Level by level: minimise ``t`` with every free GPU at most ``t`` (fixed GPUs held at their values); a free
    GPU is *forced* to ``t`` if even minimising its own load (others still within ``t``) cannot bring it under
    ``t``. The optimal splits form a convex set, so the free GPUs that are not forced can all be below ``t``
    at once; fixing the forced ones and repeating gives the lexicographic optimum."""
    G = has.shape[1]
    out = np.full(G, np.nan)
    if not np.any(W > 0):
        return np.zeros(G)
    pairs, A_eq, b_eq, to_gpu = _lp_rows(W, has)
    n = len(pairs)
    scale = max(1.0, float(W.sum()))
    slack = 1e-9 * scale  # fixed loads may move by this much (LP answers are exact only to HiGHS's tolerance)
    free = list(range(G))
    while free:
        fixed = [g for g in range(G) if g not in free]
        # variables [x, t]
        rows = [np.append(to_gpu[g], -1.0) for g in free]
        rhs = [0.0] * len(free)
        for g in fixed:
            rows += [np.append(to_gpu[g], 0.0), np.append(-to_gpu[g], 0.0)]
            rhs += [out[g] + slack, -out[g] + slack]
        A_eq_t = np.hstack([A_eq, np.zeros((A_eq.shape[0], 1))])
        c = np.zeros(n + 1)
        c[-1] = 1.0
        res = linprog(c, A_ub=np.array(rows), b_ub=np.array(rhs), A_eq=A_eq_t, b_eq=b_eq, bounds=(0, None),
                      method="highs", options=HIGHS)
        assert res.status == 0, res.message
        t = float(res.fun)
        forced = []
        for g in free:
            # min load[g] with every free GPU within t (t is now a constant: its column is bounded to [t, t + slack])
            c = np.append(to_gpu[g], 0.0)
            bounds = [(0, None)] * n + [(t, t + slack)]
            res = linprog(c, A_ub=np.array(rows), b_ub=np.array(rhs), A_eq=A_eq_t, b_eq=b_eq, bounds=bounds,
                          method="highs", options=HIGHS)
            assert res.status == 0, res.message
            if res.fun >= t - 1e-7 * scale:
                forced.append(g)
        assert forced, "every level forces at least one GPU"
        for g in forced:
            out[g] = t
            free.remove(g)
    return out


def _subset_sums(y: np.ndarray) -> np.ndarray:
    """``[2^G]``: ``y(S)`` for every GPU set ``S`` (bit ``g`` of ``S`` is GPU ``g``)."""
    sums = np.zeros(1)
    for v in y:
        sums = np.concatenate([sums, sums + v])
    return sums


def _confined(W: np.ndarray, has: np.ndarray) -> np.ndarray:
    """``[2^G]``: ``h(S)``, the load of the experts whose copies all lie in ``S`` (experts with load only)."""
    E, G = has.shape
    S = np.arange(1 << G, dtype=np.int64)
    h = np.zeros(1 << G)
    for e in range(E):
        if W[e] > 0:
            mask = int(sum(1 << g for g in range(G) if has[e, g]))
            h += np.where((mask & ~S) == 0, float(W[e]), 0.0)
    return h


def check_lex_certificate(y: np.ndarray, W: np.ndarray, has: np.ndarray) -> None:
    """Assert that ``y [G]`` is the lexicographically smallest load vector of ``W [E]`` over ``has [E, G]``.

    Feasibility (max-flow min-cut on source -> expert -> GPU -> sink with GPU capacities ``y``): some split gives
    exactly the loads ``y`` iff ``y >= 0``, ``y(all) = W(all)`` and ``y(S) >= h(S)`` for every GPU set ``S``.
    Optimality (Fujishige 1980, the min-norm = lexicographically optimal base): a feasible ``y`` is the optimum
    iff every upper level set ``U = {g: y_g >= v}`` is tight, ``y(U) = h(U)``: those GPUs carry only what is
    confined to them (if ``U`` took load that could go below ``v``, moving a little of it would lower the
    sorted vector). A min-max-only answer with uneven non-max GPUs fails the second condition.
    """
    G = has.shape[1]
    scale = max(1.0, float(W.sum()))
    tol = 1e-9 * scale
    h = _confined(W, has)
    ys = _subset_sums(y)
    assert np.all(y >= -tol)
    assert ys[-1] == pytest.approx(h[-1], rel=1e-12, abs=tol)
    worst = int(np.argmin(ys - h))
    assert ys[worst] >= h[worst] - tol, f"GPUs {worst:b} carry {ys[worst]} < {h[worst]} confined to them: infeasible"
    for v in np.unique(y):
        U = int(sum(1 << g for g in range(G) if y[g] >= v - tol))
        assert ys[U] == pytest.approx(h[U], abs=tol), \
            f"loads {y}: the GPUs {U:b} at >= {v} carry {ys[U]} but only {h[U]} is confined to them"


def _node_cost(src: np.ndarray, dest: np.ndarray, gpn: int) -> np.ndarray:
    """Traffic cost of serving picks from GPUs ``src`` on GPUs ``dest``: 0 same GPU, 1 same node, 2 other node."""
    return np.where(dest == src, 0, np.where(dest // gpn == src // gpn, 1, 2))


def brute_force_tokens(experts: np.ndarray, src: np.ndarray, has: np.ndarray, gpn: int) -> tuple[int, int]:
    """``(least max load, least cost among the assignments reaching it)`` over every assignment of every pick
    (expert ``experts[i]`` of a token on GPU ``src[i]``) to a GPU holding its expert."""
    G = has.shape[1]
    if experts.size == 0:
        return 0, 0
    choices = [np.flatnonzero(has[e]) for e in experts]
    grid = np.stack(np.meshgrid(*choices, indexing="ij"), axis=-1).reshape(-1, len(choices))  # [N, picks]
    loads = np.stack([(grid == g).sum(axis=1) for g in range(G)], axis=1)
    peak = loads.max(axis=1)
    cost = _node_cost(src[None, :], grid, gpn).sum(axis=1)
    best = int(peak.min())
    return best, int(cost[peak == best].min())


def _pick_loads(dest: np.ndarray, batch: np.ndarray, B: int, G: int) -> np.ndarray:
    """``int64 [B, L, G]``: picks served per GPU (picks with GPU -1 count nowhere)."""
    L = dest.shape[1]
    flat = (batch[:, None, None] * L + np.arange(L)[None, :, None]) * G + dest
    return np.bincount(flat[dest >= 0].ravel(), minlength=B * L * G).reshape(B, L, G)


# ---------------------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------------------


def _random_counts(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Loads with zeros (about a third), small and large values and the odd hot expert."""
    counts = rng.integers(0, 20, size=shape) * (rng.random(shape) < 0.65)
    return counts + rng.integers(20, 200, size=shape) * (rng.random(shape) < 0.1)


@st.composite
def count_cases(draw: st.DrawFn, max_nodes: int = 3, max_gpn: int = 3, max_experts: int = 9
                ) -> tuple[Placement, np.ndarray]:
    """A random plan (every expert on a random non-empty set of GPUs) and counts ``[B, L, E]`` with zeros."""
    nodes, gpn = draw(st.integers(1, max_nodes)), draw(st.integers(1, max_gpn))
    E, L, B = draw(st.integers(1, max_experts)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    plan = Placement(random_replica_layers(rng, L, E, nodes * gpn), E, Cluster(num_nodes=nodes, gpus_per_node=gpn))
    return plan, _random_counts(rng, (B, L, E))


def _random_trace(rng: np.random.Generator, plan: Placement, T: int, K: int, B: int) -> RoutingTrace:
    L, E = plan.num_layers, plan.num_experts
    topk = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)]).reshape(T, L, K)
    batch = np.sort(rng.integers(0, B, T))
    return RoutingTrace(topk, rng.integers(0, plan.num_gpus, T), batch, num_experts=E, num_batches=B)


@st.composite
def token_cases(draw: st.DrawFn, max_picks: int = 8) -> tuple[Placement, RoutingTrace]:
    """A tiny plan (at most 4 GPUs) and a trace of at most ``max_picks`` picks per (batch, layer)."""
    nodes, gpn = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2)]))
    E = draw(st.integers(1, 4))
    K = draw(st.integers(1, min(2, E)))
    T = draw(st.integers(1, max_picks // K))
    L, B = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    plan = Placement(random_replica_layers(rng, L, E, nodes * gpn), E, Cluster(num_nodes=nodes, gpus_per_node=gpn))
    return plan, _random_trace(rng, plan, T, K, B)


# ---------------------------------------------------------------------------------------------------------
# 1. counts: the LP optimum, conservation, support
# ---------------------------------------------------------------------------------------------------------


def _check_split_against_lp(plan: Placement, counts: np.ndarray) -> None:
    loads = MINMAX.split_counts(plan, counts, RNG)
    B, L, _E = counts.shape
    has = plan.copies > 0
    assert loads.shape == (B, L, plan.num_gpus) and loads.dtype == np.float64
    assert np.all(loads >= 0)
    assert np.allclose(loads.sum(axis=2), counts.sum(axis=2), rtol=1e-12, atol=1e-9)  # no token lost or invented
    hosts_load = np.einsum("ble,leg->blg", counts, has.astype(np.int64)) > 0
    assert np.all(loads[~hosts_load] == 0)  # a GPU serves only experts it holds that have load
    best = least_max_load(plan, counts, integral=False)
    best_int = least_max_load(plan, counts, integral=True)
    for b in range(B):
        for layer in range(L):
            t = lp_optimum(counts[b, layer], has[layer])
            assert loads[b, layer].max() == pytest.approx(t, rel=1e-7, abs=1e-7), (b, layer)
            assert best[b, layer] == pytest.approx(t, rel=1e-7, abs=1e-7)
            assert best_int[b, layer] == np.ceil(t - 1e-7 * max(1.0, t))  # whole tokens: ceil(t*)


@given(case=count_cases())
def test_split_counts_reaches_the_lp_optimum(case: tuple[Placement, np.ndarray]) -> None:
    """The busiest GPU of every (b, l) carries exactly HiGHS's LP optimum: a split that is feasible but not
    optimal (too high) or that loses/misplaces tokens (too low, or load on a GPU without the expert) fails."""
    _check_split_against_lp(*case)


@pytest.mark.parametrize("seed", range(4))
def test_split_counts_reaches_the_lp_optimum_on_larger_components(seed: int) -> None:
    """Components of 10-16 GPUs with many experts are past the subset enumeration (``2^A * items > 4096``),
    so this exercises the Newton iteration on max flows and the residual-graph tight sets."""
    rng = np.random.default_rng(100 + seed)
    nodes, gpn = [(2, 5), (3, 4), (4, 4), (2, 8)][seed]
    G, E, L = nodes * gpn, 24, 2
    plan = Placement(random_replica_layers(rng, L, E, G), E, Cluster(num_nodes=nodes, gpus_per_node=gpn))
    counts = _random_counts(rng, (3, L, E))
    _check_split_against_lp(plan, counts)
    loads = MINMAX.split_counts(plan, counts, RNG)
    for b in range(3):
        for layer in range(L):
            check_lex_certificate(loads[b, layer], counts[b, layer], plan.copies[layer] > 0)


def test_zero_load_gives_zero_everywhere() -> None:
    plan = Placement([[[0, 1], [1]], [[0], [0, 1]]], 2, Cluster(num_nodes=1, gpus_per_node=2))
    counts = np.zeros((2, 2, 2), dtype=np.int64)
    assert MINMAX.split_counts(plan, counts, RNG).tolist() == np.zeros((2, 2, 2)).tolist()
    assert least_max_load(plan, counts, integral=True).tolist() == [[0.0, 0.0], [0.0, 0.0]]


# ---------------------------------------------------------------------------------------------------------
# 2. counts: the lexicographically smallest load vector
# ---------------------------------------------------------------------------------------------------------


@given(case=count_cases())
def test_split_counts_passes_the_lexicographic_certificate(case: tuple[Placement, np.ndarray]) -> None:
    """Every (b, l)'s loads are a feasible load vector whose upper level sets are tight (Fujishige): the
    certificate depends only on the loads, so it catches a split that is optimal in its max but spreads the
    rest unevenly, and a 'load vector' no split can produce."""
    plan, counts = case
    loads = MINMAX.split_counts(plan, counts, RNG)
    for b in range(counts.shape[0]):
        for layer in range(counts.shape[1]):
            check_lex_certificate(loads[b, layer], counts[b, layer], plan.copies[layer] > 0)


@given(case=count_cases(max_nodes=2, max_gpn=2, max_experts=5))
def test_split_counts_equals_the_iterated_lp_on_tiny_cases(case: tuple[Placement, np.ndarray]) -> None:
    """On at most 4 GPUs the loads equal, GPU by GPU, the lexicographic optimum found by iterated HiGHS LPs
    (a different route to the same unique vector: the loads of a lex-optimal split are unique)."""
    plan, counts = case
    loads = MINMAX.split_counts(plan, counts, RNG)
    b, layer = 0, counts.shape[1] - 1  # one (b, l) per example keeps the LP count small
    ref = lex_loads_by_lp(counts[b, layer], plan.copies[layer] > 0)
    assert loads[b, layer] == pytest.approx(ref, abs=1e-7 * max(1.0, float(counts[b, layer].sum())))


def test_the_references_reject_wrong_answers() -> None:
    """The references themselves, on the chain of the golden cases (section 3): expert 0 (6) on GPU 0, expert 1
    (2) on GPUs 0, 1, expert 2 (5) on GPUs 1, 2; the lexicographic optimum is [6, 3.5, 3.5]."""
    W = np.array([6, 2, 5])
    has = np.array([[True, False, False], [True, True, False], [False, True, True]])
    assert lp_optimum(W, has) == pytest.approx(6.0)
    assert lex_loads_by_lp(W, has) == pytest.approx([6.0, 3.5, 3.5])
    check_lex_certificate(np.array([6.0, 3.5, 3.5]), W, has)
    with pytest.raises(AssertionError, match=r"GPUs 101 at >= 5.0 carry 11.0 but only 6.0 is confined"):
        check_lex_certificate(np.array([6.0, 2.0, 5.0]), W, has)  # feasible, optimal max, uneven below it
    with pytest.raises(AssertionError, match="infeasible"):
        check_lex_certificate(np.array([5.0, 4.5, 3.5]), W, has)  # GPU 0 must carry expert 0's 6
    with pytest.raises(AssertionError):
        check_lex_certificate(np.array([6.0, 3.5, 3.0]), W, has)  # loses half a token
    # the brute force: 2 picks of an expert on GPUs 0 and 1 from GPU 0 -> max 1, one pick leaves (cost 1)
    assert brute_force_tokens(np.array([0, 0]), np.array([0, 0]), np.array([[True, True]]), 2) == (1, 1)


def test_lex_loads_returns_exact_fractions() -> None:
    """The kernel's ``(num, den)`` are the exact fractions: 3 experts of load 1 on both of 2 GPUs -> 3/2 each."""
    has = np.ones((3, 2), dtype=bool)
    hstart, hosts = kernel.host_lists(has)
    assert hstart.tolist() == [0, 2, 4, 6] and hosts.tolist() == [0, 1, 0, 1, 0, 1]
    num, den = kernel.lex_loads(np.array([1, 1, 1], dtype=np.int64), hstart, hosts, 2)
    assert [n / d for n, d in zip(num.tolist(), den.tolist(), strict=True)] == [1.5, 1.5]
    assert [n * 2 for n in num.tolist()] == [3 * d for d in den.tolist()]  # exactly 3/2, not a rounding of it
    p, q = kernel.minmax_value(np.array([1, 1, 1], dtype=np.int64), hstart, hosts, 2)
    assert p * 2 == 3 * q


# ---------------------------------------------------------------------------------------------------------
# 3. hand-derived golden cases
# ---------------------------------------------------------------------------------------------------------


def _loads_of(layer: list[list[int]], W: list[int]) -> list[float]:
    """Router loads of one (batch, layer): ``layer`` lists the experts on each GPU, ``W`` the expert loads."""
    plan = Placement([layer], len(W), Cluster(num_nodes=1, gpus_per_node=len(layer)))
    return MINMAX.split_counts(plan, np.array([[W]]), RNG)[0, 0].tolist()


def test_golden_shared_expert_levels_two_gpus() -> None:
    # experts [6, 2]; expert 0 on GPUs 0 and 1, expert 1 on GPU 1 only. total 8 over 2 GPUs: t* >= 4, and
    # expert 0 sends 4 to GPU 0 and 2 to GPU 1 (2 + 2 = 4): loads [4, 4]
    assert _loads_of([[0], [0, 1]], [6, 2]) == [4.0, 4.0]
    has = np.array([[True, True], [False, True]])
    hstart, hosts = kernel.host_lists(has)
    num, den = kernel.lex_loads(np.array([6, 2], dtype=np.int64), hstart, hosts, 2)
    assert (num / den).tolist() == [4.0, 4.0]
    p, q = kernel.minmax_value(np.array([6, 2], dtype=np.int64), hstart, hosts, 2)
    assert p == 4 * q


def test_golden_hot_single_copy_expert_then_water_filling() -> None:
    # 3 GPUs. Expert 0 (load 10) only on GPU 0; expert 1 (load 4) on all three; expert 2 (load 3) on GPU 1 only.
    # t* = 10, not total / G = 17 / 3: GPU 0 carries expert 0 whatever the split, and expert 1 can avoid it.
    # Next level: expert 1's 4 tokens over GPUs 1 (already 3) and 2 (0): (x - 3) + x = 4 -> x = 3.5 each.
    # A split with the right max but uneven rest, e.g. [10, 5, 2] or [10, 3, 4], is lexicographically worse.
    assert _loads_of([[0, 1], [1, 2], [1]], [10, 4, 3]) == [10.0, 3.5, 3.5]
    # with expert 2 gone, expert 1 splits 2 + 2 over GPUs 1 and 2 and stays off GPU 0
    assert _loads_of([[0, 1], [1, 2], [1]], [10, 4, 0]) == [10.0, 2.0, 2.0]


def test_golden_chain_where_lex_matters_below_the_max() -> None:
    # chain of 3 GPUs: expert 0 (6) on GPU 0 only; expert 1 (2) on GPUs 0, 1; expert 2 (5) on GPUs 1, 2.
    # t* = max(6 / 1, (6 + 2) / 2, 13 / 3) = 6: GPU 0 holds 6 and expert 1 must go to GPU 1 entirely.
    # GPUs 1 and 2 then share expert 2 on top of GPU 1's 2 tokens: 2 + x = 5 - x -> 3.5 each.
    # Any split with expert 1 on GPU 1 has max 6 ([6, 7, 0] has 7; [6, 2, 5] has max 6 but is lex-worse).
    assert _loads_of([[0, 1], [1, 2], [2]], [6, 2, 5]) == [6.0, 3.5, 3.5]
    # the same chain with expert 2's 5 tokens too few to level GPU 1's 4: GPU 1 = 4, GPU 2 = 3 (all of expert 2)
    assert _loads_of([[0, 1], [1, 2], [2]], [6, 4, 3]) == [6.0, 4.0, 3.0]


def test_golden_two_components_and_an_idle_gpu() -> None:
    # GPUs 0, 1 share expert 0 (load 5); GPUs 2, 3 share expert 1 (load 2) and GPU 3 also holds expert 2 (3);
    # GPU 4 holds only expert 3, with no load. Component {0, 1}: 2.5 each; component {2, 3}: GPU 3 has 3 fixed,
    # so expert 1 goes to GPU 2 entirely (2 < 3): [2, 3]; GPU 4 idle. t* = 3 > total / G = 10 / 5 = 2.
    assert _loads_of([[0], [0], [1], [1, 2], [3]], [5, 2, 3, 0]) == [2.5, 2.5, 2.0, 3.0, 0.0]


def test_golden_tokens_prefer_own_gpu_then_own_node() -> None:
    """Whole picks: the straggler carries ceil(t*) picks; then the fewest picks leave their GPU, then their node."""
    # 1 node x 2 GPUs, expert 0 on both; 4 tokens on GPU 0 pick expert 0: t* = 2, so 2 stay (cost 0) and 2 go
    # to GPU 1 (cost 1 each); the first ones in token order take the first GPU of the class's flow
    plan = Placement([[[0], [0]]], 1, Cluster(num_nodes=1, gpus_per_node=2))
    tr = RoutingTrace(np.zeros((4, 1, 1), int), np.zeros(4, int), np.zeros(4, int), num_experts=1)
    dest = MINMAX.assign_tokens(plan, tr, RNG)[:, 0, 0]
    assert sorted(dest.tolist()) == [0, 0, 1, 1]
    # 2 nodes x 2 GPUs, expert 0 on GPUs 1 (node 0) and 2 (node 1). One token on GPU 0: either GPU gives max 1,
    # GPU 1 is on its node (cost 1 < 2). Two tokens on GPU 0: ceil(2 / 2) = 1 forces one of them across nodes.
    plan = Placement([[[1], [0], [0], [1]]], 2, Cluster(num_nodes=2, gpus_per_node=2))
    one = RoutingTrace(np.zeros((1, 1, 1), int), [0], [0], num_experts=2)
    assert MINMAX.assign_tokens(plan, one, RNG).ravel().tolist() == [1]
    two = RoutingTrace(np.zeros((2, 1, 1), int), [0, 0], [0, 0], num_experts=2)
    assert sorted(MINMAX.assign_tokens(plan, two, RNG).ravel().tolist()) == [1, 2]
    # a token on GPU 2 (node 1) with one on GPU 0: each keeps to its own node, [1, 2] in token order
    mixed = RoutingTrace(np.zeros((2, 1, 1), int), [0, 2], [0, 0], num_experts=2)
    assert MINMAX.assign_tokens(plan, mixed, RNG).ravel().tolist() == [1, 2]
    # the two tokens on GPU 0 in two batches: each batch is balanced on its own, so both stay on node 0
    apart = RoutingTrace(np.zeros((2, 1, 1), int), [0, 0], [0, 1], num_experts=2)
    assert MINMAX.assign_tokens(plan, apart, RNG).ravel().tolist() == [1, 1]


# ---------------------------------------------------------------------------------------------------------
# 4. tokens: brute force on tiny cases
# ---------------------------------------------------------------------------------------------------------


@given(case=token_cases())
def test_assign_tokens_is_the_brute_force_optimum(case: tuple[Placement, RoutingTrace]) -> None:
    """Enumerating every assignment of the (<= 8) picks of a (batch, layer) to hosts: the router's straggler
    is the least any assignment allows (= ceil of HiGHS's t*), and among the assignments reaching it none has
    a smaller traffic cost (0 own GPU, 1 same node, 2 other node) than the router's."""
    plan, tr = case
    dest = MINMAX.assign_tokens(plan, tr, RNG)
    G, gpn, B, L = plan.num_gpus, plan.cluster.gpus_per_node, tr.num_batches, tr.num_layers
    has = plan.copies > 0
    layer_idx = np.arange(L)[None, :, None]
    assert dest.shape == tr.topk_ids.shape
    assert np.all(has[layer_idx, tr.topk_ids, dest])  # every pick on a GPU holding its expert
    loads = _pick_loads(dest, tr.batch, B, G)
    counts = tr.counts()
    for b in range(B):
        rows = tr.batch == b
        for layer in range(L):
            experts = tr.topk_ids[rows, layer, :].ravel()
            src = np.repeat(tr.src_gpu[rows], tr.top_k)
            best, cheapest = brute_force_tokens(experts, src, has[layer], gpn)
            assert loads[b, layer].max(initial=0) == best, (b, layer)
            cost = int(_node_cost(src, dest[rows, layer, :].ravel(), gpn).sum())
            assert cost == cheapest, (b, layer, cost, cheapest)
            t = lp_optimum(counts[b, layer], has[layer])
            assert best == np.ceil(t - 1e-7 * max(1.0, t))  # the integral optimum is ceil(t*)


def test_route_tokens_kernel_skips_empty_batches() -> None:
    """``route_tokens`` straight: batch 1 has no tokens (``batch_start`` repeats); batch 2's tokens are
    balanced on their own, not with batch 0's."""
    has = np.array([[True, True]])
    ids = np.zeros((4, 1), dtype=np.int64)
    src = np.zeros(4, dtype=np.int64)
    starts = np.array([0, 2, 2, 4], dtype=np.int64)
    dest = kernel.route_tokens(ids, src, starts, has, 2, np.ones((4, 1), dtype=bool))
    assert sorted(dest[:2, 0].tolist()) == [0, 1] and sorted(dest[2:, 0].tolist()) == [0, 1]


# ---------------------------------------------------------------------------------------------------------
# 5. never worse than another router
# ---------------------------------------------------------------------------------------------------------


@given(case=count_cases(), seed=st.integers(0, 2**31))
def test_no_router_beats_minmax_on_counts(case: tuple[Placement, np.ndarray], seed: int) -> None:
    """On counts no registered router's split has a smaller busiest GPU on any (b, l) than minmax's
    (locality needs token GPUs, so it is skipped here and covered on tokens)."""
    plan, counts = case
    ours = MINMAX.split_counts(plan, counts, RNG).max(axis=2)
    tol = 1e-9 * max(1.0, float(counts.sum()))
    for name, router in READY.items():
        if name in ("minmax", "locality"):
            continue
        other = router.split_counts(plan, counts, np.random.default_rng(seed)).max(axis=2)
        assert np.all(ours <= other + tol), (name, ours, other)


@given(case=count_cases(), T=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_no_router_beats_minmax_on_tokens(case: tuple[Placement, np.ndarray], T: int, seed: int) -> None:
    """On token traces every router assigns whole picks; minmax's per-(b, l) straggler is never above any
    other router's (each of theirs is an assignment, so it is >= ceil(t*), which minmax reaches)."""
    p = case[0]
    rng = np.random.default_rng(seed)
    tr = _random_trace(rng, p, T, min(2, p.num_experts), 3)
    G, B = p.num_gpus, tr.num_batches
    ours = _pick_loads(MINMAX.assign_tokens(p, tr, RNG), tr.batch, B, G)
    assert np.array_equal(ours.max(axis=2), least_max_load(p, tr.counts(), integral=True))
    for name, router in READY.items():
        if name == "minmax":
            continue
        other = _pick_loads(router.assign_tokens(p, tr, np.random.default_rng(seed)), tr.batch, B, G)
        assert np.all(ours.max(axis=2) <= other.max(axis=2)), name


@given(case=count_cases(), seed=st.integers(0, 2**31))
def test_routing_gap_is_non_negative_and_zero_for_minmax(case: tuple[Placement, np.ndarray], seed: int) -> None:
    """``evaluate(..., routing_gap=True)`` measures each router against minmax's bound: never below it, and
    minmax itself exactly on it; on counts (fractional) and on a token trace (whole picks)."""
    plan, counts = case
    if counts.sum() == 0:
        counts = counts.copy()
        counts[0, 0, 0] = 1  # evaluate refuses an all-zero load
    rng = np.random.default_rng(seed)
    tr = _random_trace(rng, plan, 30, min(2, plan.num_experts), 2)
    for load in (LoadMatrix(counts), LoadMatrix(tr.counts(), tr)):
        for name in ROUTERS:
            if name == "locality" and load.trace is None:
                continue
            gap = evaluate(plan, load, READY[name], seed=seed, routing_gap=True).routing_gap
            assert gap is not None and gap >= -1e-12, (name, gap)
            if name == "minmax":
                assert gap == 0.0


# ---------------------------------------------------------------------------------------------------------
# 6. dropped picks
# ---------------------------------------------------------------------------------------------------------


@given(case=token_cases(max_picks=8), seed=st.integers(0, 2**31))
def test_assign_kept_routes_only_the_kept_picks_optimally(case: tuple[Placement, RoutingTrace], seed: int) -> None:
    """Dropped picks get -1; the kept ones go to hosts and reach the brute-force optimum of the kept picks alone
    (a router that still counted the dropped picks would balance the wrong load and could exceed it)."""
    plan, tr = case
    rng = np.random.default_rng(seed)
    kept = rng.random(tr.topk_ids.shape) < 0.6
    assert MINMAX.assign_kept is not None
    dest = MINMAX.assign_kept(plan, tr, kept, RNG)
    assert np.all(dest[~kept] == -1)
    has = plan.copies > 0
    L, G, gpn = tr.num_layers, plan.num_gpus, plan.cluster.gpus_per_node
    layer_idx = np.broadcast_to(np.arange(L)[None, :, None], kept.shape)
    assert np.all(has[layer_idx[kept], tr.topk_ids[kept], dest[kept]])
    loads = _pick_loads(dest, tr.batch, tr.num_batches, G)
    for b in range(tr.num_batches):
        rows = tr.batch == b
        for layer in range(L):
            k = kept[rows, layer, :].ravel()
            experts = tr.topk_ids[rows, layer, :].ravel()[k]
            src = np.repeat(tr.src_gpu[rows], tr.top_k)[k]
            best, cheapest = brute_force_tokens(experts, src, has[layer], gpn)
            assert loads[b, layer].max(initial=0) == best
            d = dest[rows, layer, :].ravel()[k]
            assert int(_node_cost(src, d, gpn).sum()) == cheapest


def test_assign_kept_on_a_larger_trace_matches_the_lp_of_the_kept_picks() -> None:
    """8 GPUs, 3 batches, 2 layers, top-2: kept picks reach ceil(t*) of the kept counts (HiGHS), a fully
    dropped batch routes nothing."""
    rng = np.random.default_rng(7)
    E, L = 12, 2
    plan = Placement(random_replica_layers(rng, L, E, 8), E, Cluster(num_nodes=2, gpus_per_node=4))
    tr = _random_trace(rng, plan, 120, 2, 3)
    kept = rng.random(tr.topk_ids.shape) < 0.5
    kept[tr.batch == 1] = False
    dest = MINMAX.assign_kept(plan, tr, kept, RNG)  # type: ignore[misc]
    assert np.all(dest[~kept] == -1) and np.all(dest[tr.batch == 1] == -1)
    loads = _pick_loads(dest, tr.batch, 3, 8)
    kept_tr = np.zeros((3, L, E), dtype=np.int64)  # counts of the kept picks
    layer = np.arange(L)[None, :, None]
    np.add.at(kept_tr, (np.broadcast_to(tr.batch[:, None, None], kept.shape)[kept],
                        np.broadcast_to(layer, kept.shape)[kept], tr.topk_ids[kept]), 1)
    assert np.array_equal(loads.sum(axis=2), kept_tr.sum(axis=2))
    for b in range(3):
        for li in range(L):
            t = lp_optimum(kept_tr[b, li], plan.copies[li] > 0)
            assert loads[b, li].max() == np.ceil(t - 1e-7 * max(1.0, t)), (b, li)


def test_enumeration_helpers_agree_with_itertools() -> None:
    """The brute-force helper enumerates every assignment (checked against itertools on a fixed case)."""
    has = np.array([[True, True, False], [False, True, True], [True, False, True]])
    experts = np.array([0, 1, 2, 0])
    src = np.array([0, 2, 1, 1])
    best, cheapest = brute_force_tokens(experts, src, has, 1)
    results = []
    for combo in itertools.product(*[np.flatnonzero(has[e]).tolist() for e in experts]):
        d = np.array(combo)
        results.append((int(np.bincount(d, minlength=3).max()), int(_node_cost(src, d, 1).sum())))
    assert best == min(r[0] for r in results)
    assert cheapest == min(r[1] for r in results if r[0] == best)
