"""The network-flow kernels (:mod:`moebalance.algorithms.flow`) against independent solvers on random graphs.

- Maximum flow: the value equals SciPy's :func:`scipy.sparse.csgraph.maximum_flow` (another algorithm and
  another implementation); the flow respects every capacity and is conserved at every inner node; the
  residual network certifies optimality (the nodes reachable from the source form a cut whose capacity is the
  value, the sink is not among them, and the nodes that reach the sink exclude the source).
- Minimum-cost flow: the amount sent is ``min(demand, maximum flow)``, the flow is feasible, and its cost
  equals the optimum of the flow LP with that amount, solved by SciPy's HiGHS (the constraint matrix is a
  network matrix, so the LP optimum is the integral one).

Graphs are small (up to 12 nodes) and drawn by a seeded generator: parallel edges, antiparallel pairs,
isolated nodes, zero capacities and zero costs all occur.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linprog
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from moebalance.algorithms.flow import build, max_flow, min_cost_flow, reach_from, reaches, scratch

SEEDS = range(60)


def _graph(seed: int, max_cost: int = 6) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(n, tail, head, cap, cost)``: a random multigraph on ``n`` nodes, source 0, sink ``n - 1``."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 13))
    m = int(rng.integers(0, 6 * n))
    tail = rng.integers(0, n, m)
    head = rng.integers(0, n - 1, m)
    head = np.where(head >= tail, head + 1, head)  # no self-loops
    cap = rng.integers(0, 10, m)
    cost = rng.integers(0, max_cost + 1, m)
    return n, tail.astype(np.int64), head.astype(np.int64), cap.astype(np.int64), cost.astype(np.int64)


def _scipy_max_flow(n: int, tail: np.ndarray, head: np.ndarray, cap: np.ndarray, s: int, t: int) -> int:
    if tail.size == 0:
        return 0
    # csr_matrix sums parallel edges, which leaves the maximum flow unchanged
    graph = csr_matrix((cap.astype(np.int32), (tail, head)), shape=(n, n))
    return int(maximum_flow(graph, s, t).flow_value)


def _edge_flow(res: np.ndarray, m: int) -> np.ndarray:
    """The flow on each edge: the residual capacity of its reverse arc (module doc of flow.py)."""
    return res[1:2 * m:2].copy()


def _assert_feasible(n: int, tail: np.ndarray, head: np.ndarray, cap: np.ndarray, flow: np.ndarray, s: int, t: int,
                     value: int) -> None:
    assert np.all(flow >= 0) and np.all(flow <= cap)
    net = np.zeros(n, dtype=np.int64)  # outflow - inflow
    np.add.at(net, tail, flow)
    np.add.at(net, head, -flow)
    inner = np.ones(n, dtype=bool)
    inner[[s, t]] = False
    assert np.all(net[inner] == 0)
    assert net[s] == value and net[t] == -value


@pytest.mark.parametrize("seed", SEEDS)
def test_max_flow_equals_scipy_and_is_certified_by_a_cut(seed: int) -> None:
    n, tail, head, cap, cost = _graph(seed)
    s, t = 0, n - 1
    arc_head, _arc_cost, res, start, adj = build(n, tail, head, cap, cost)
    ok = np.ones(res.size, dtype=np.bool_)
    value = max_flow(n, arc_head, res, start, adj, ok, s, t, scratch(n))
    assert value == _scipy_max_flow(n, tail, head, cap, s, t)
    flow = _edge_flow(res, tail.size)
    _assert_feasible(n, tail, head, cap, flow, s, t, value)
    seen, queue = np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.int64)
    reach_from(n, arc_head, res, start, adj, s, seen, queue)
    assert seen[s] and not seen[t]
    crossing = seen[tail] & ~seen[head]
    assert int(cap[crossing].sum()) == value  # the cut's capacity: max-flow = min-cut
    assert np.all(flow[crossing] == cap[crossing]) and np.all(flow[~seen[tail] & seen[head]] == 0)
    reaches(n, arc_head, res, start, adj, t, seen, queue)
    assert seen[t] and not seen[s]
    # a second call finds nothing more to push
    assert max_flow(n, arc_head, res, start, adj, ok, s, t, scratch(n)) == 0


def test_max_flow_respects_the_admitted_arcs() -> None:
    """Arcs outside ``ok`` carry nothing: with the direct edge barred, only the two-edge path counts."""
    tail, head = np.array([0, 0, 1], np.int64), np.array([2, 1, 2], np.int64)
    cap, cost = np.array([5, 3, 2], np.int64), np.zeros(3, np.int64)
    arc_head, _c, res, start, adj = build(3, tail, head, cap, cost)
    ok = np.ones(6, dtype=np.bool_)
    ok[[0, 1]] = False  # edge 0 and its reverse
    assert max_flow(3, arc_head, res, start, adj, ok, 0, 2, scratch(3)) == 2
    assert list(_edge_flow(res, 3)) == [0, 2, 2]


def _lp_cost(n: int, tail: np.ndarray, head: np.ndarray, cap: np.ndarray, cost: np.ndarray, s: int, t: int,
             value: int) -> float:
    """The least cost of a flow of ``value`` from ``s`` to ``t``, by linear programming (HiGHS)."""
    m = tail.size
    if m == 0:
        assert value == 0
        return 0.0
    A = np.zeros((n, m))
    A[tail, np.arange(m)] += 1.0
    A[head, np.arange(m)] -= 1.0
    b = np.zeros(n)
    b[s], b[t] = value, -value
    res = linprog(cost.astype(float), A_eq=A, b_eq=b, bounds=list(zip([0] * m, cap.tolist(), strict=True)),
                  method="highs")
    assert res.status == 0, res.message
    return float(res.fun)


@pytest.mark.parametrize("seed", SEEDS)
def test_min_cost_flow_equals_the_lp_optimum(seed: int) -> None:
    n, tail, head, cap, cost = _graph(1000 + seed)
    s, t = 0, n - 1
    best = _scipy_max_flow(n, tail, head, cap, s, t)
    demand = int(np.random.default_rng(seed).integers(0, best + 3))
    # the kernel's contract: the network cannot carry more than the demand (a source arc of that capacity)
    tail2, head2 = np.append(tail + 1, 0), np.append(head + 1, 1)
    cap2, cost2 = np.append(cap, demand), np.append(cost, 0)
    arc_head, arc_cost, res, start, adj = build(n + 1, tail2, head2, cap2, cost2)
    sent = min_cost_flow(n + 1, arc_head, arc_cost, res, start, adj, 0, t + 1, demand)
    assert sent == min(demand, best)
    flow = _edge_flow(res, tail2.size)
    _assert_feasible(n + 1, tail2, head2, cap2, flow, 0, t + 1, sent)
    got = int(flow @ cost2)
    assert got == round(_lp_cost(n, tail, head, cap, cost, s, t, sent))


@pytest.mark.parametrize("seed", SEEDS[:30])
def test_min_cost_flow_beyond_the_maximum_is_a_cheapest_maximum_flow(seed: int) -> None:
    """A demand no network can meet: the kernel sends the maximum flow, at the least cost of any maximum flow."""
    n, tail, head, cap, cost = _graph(2000 + seed, max_cost=2)  # the minmax router's costs: 0, 1, 2
    s, t = 0, n - 1
    best = _scipy_max_flow(n, tail, head, cap, s, t)
    arc_head, arc_cost, res, start, adj = build(n, tail, head, cap, cost)
    sent = min_cost_flow(n, arc_head, arc_cost, res, start, adj, s, t, int(cap.sum()) + 1)
    assert sent == best
    flow = _edge_flow(res, tail.size)
    _assert_feasible(n, tail, head, cap, flow, s, t, sent)
    assert int(flow @ cost) == round(_lp_cost(n, tail, head, cap, cost, s, t, sent))


def test_min_cost_flow_takes_the_cheap_path_first() -> None:
    """Hand-derived: a source arc 0 -> 1 of capacity 3, then two routes 1 -> 2 -> 4 (cost 1 + 1, capacity 2)
    and 1 -> 3 -> 4 (cost 0 + 5, capacity 4); the 3 units go 2 on the cheap route (cost 4) and 1 on the dear
    one (cost 5): total 9."""
    tail, head = np.array([0, 1, 2, 1, 3], np.int64), np.array([1, 2, 4, 3, 4], np.int64)
    cap, cost = np.array([3, 2, 2, 4, 4], np.int64), np.array([0, 1, 1, 0, 5], np.int64)
    arc_head, arc_cost, res, start, adj = build(5, tail, head, cap, cost)
    assert min_cost_flow(5, arc_head, arc_cost, res, start, adj, 0, 4, 3) == 3
    flow = _edge_flow(res, 5)
    assert list(flow) == [3, 2, 2, 1, 1] and int(flow @ cost) == 9
