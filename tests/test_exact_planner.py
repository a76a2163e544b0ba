"""Exact per-layer planning (:mod:`moebalance.algorithms.exact`; its device twin is tested in
``tests/test_exact_device.py``) and the faster prefetcher and rebalancer kernels it is built from.

The contract: the same results as the planning code they replace, on the same inputs. ``tests/ref_exact.py`` is a
frozen copy of that code (the library's own prefetcher and rebalancer as they were before), used here only as
the reference: every field of every plan must be equal, floats bit for bit. Inputs: hypothesis cases, seeded
bulk cases built to hit ties (few distinct demand values, equal loads, copies on many GPUs), full-size layers
(64 GPUs x 256 experts, 8,192 tokens per GPU, top-8) and hand-derived cases whose numbers are in the comments.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ref_exact import ref_gpu_lists, ref_host_lists, ref_plan_layer, ref_prefetch, ref_rebalance

from moebalance.algorithms.exact import BaseLayer, LayerPlan, assign, base_layer, plan_layer
from moebalance.algorithms.minmax import host_lists
from moebalance.algorithms.prefetch import prefetch, prefetch_layers
from moebalance.algorithms.rebalance import gpu_lists, rebalance, route_tokens
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.plan import Placement
from moebalance.policies.libra import LibraConfig, batch_plan, exact_plan
from moebalance.prediction.predictors import (
    EXACT,
    PREDICTORS,
    ExactPredictor,
    OraclePredictor,
    make_predictor,
)

# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def _same(plan: LayerPlan, ref: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]) -> None:
    extras, expected, remote, loads, moves = ref
    assert plan.extras.tolist() == extras.tolist()
    assert plan.expected.tobytes() == expected.tobytes()  # bit for bit
    assert plan.remote.tolist() == remote.tolist()
    assert plan.loads.tolist() == loads.tolist()
    assert plan.moves == moves


def _skewed(G: int, E: int, tokens_per_gpu: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(demand int64 [G, E], copies int64 [E, G])``: a skewed routing of ``tokens_per_gpu`` tokens per GPU, top-``k``
    (each GPU's own expert popularity drawn around a shared one), on a contiguous base placement."""
    rng = np.random.default_rng(seed)
    shared = rng.dirichlet(np.full(E, 0.6))
    demand = np.stack([rng.multinomial(tokens_per_gpu * k, rng.dirichlet(shared * E * 4 + 1e-3)) for _ in range(G)])
    copies = np.zeros((E, G), dtype=np.int64)
    copies[np.arange(E), np.arange(E) * G // E] = 1
    return demand.astype(np.int64), copies


def _random_layer(rng: np.random.Generator, G: int, E: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """``(demand int64 [G, E], copies int64 [E, G])`` of one of several shapes of routing (``kind``)."""
    copies = np.zeros((E, G), dtype=np.int64)
    if kind == "contiguous":
        copies[np.arange(E), np.arange(E) * G // E] = 1
    else:
        for e in range(E):
            wide = kind == "wide" and rng.random() < 0.3
            k = int(rng.integers(1, G + 1)) if wide else int(rng.integers(1, min(G, 3) + 1))
            copies[e, rng.choice(G, size=k, replace=False)] = rng.integers(1, 3, size=k)
    if kind == "ties":
        demand = rng.integers(0, 3, size=(G, E))
    else:
        shared = rng.dirichlet(np.full(E, 0.5))
        demand = np.stack([rng.multinomial(int(rng.integers(0, 400)), rng.dirichlet(shared * E + 0.05))
                           for _ in range(G)])
    return demand.astype(np.int64), copies


@st.composite
def layers(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, float, float, bool]:
    """Small ``(demand, copies, n, alpha, eps, strict)``: every expert has a copy, some GPUs several."""
    G, E = draw(st.integers(1, 7)), draw(st.integers(1, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    copies = np.zeros((E, G), dtype=np.int64)
    for e in range(E):
        k = int(rng.integers(1, G + 1))
        copies[e, rng.choice(G, size=k, replace=False)] = rng.integers(1, 3, size=k)
    hi = draw(st.integers(1, 9))
    demand = rng.integers(0, hi, size=(G, E)) * (rng.random((G, E)) < draw(st.sampled_from([0.3, 0.7, 1.0])))
    return (demand.astype(np.int64), copies, draw(st.integers(0, E)), draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
            draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])), draw(st.booleans()))


# ----------------------------------------------------------------------------------------------------------
# 1. the same plans as the code before
# ----------------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(case=layers())
def test_plan_layer_equals_the_previous_code(case: tuple[np.ndarray, np.ndarray, int, float, float, bool]) -> None:
    demand, copies, n, alpha, eps, strict = case
    _same(plan_layer(demand, copies, n, alpha, eps=eps, strict=strict),
          ref_plan_layer(demand, copies, n, alpha, eps, strict))


@pytest.mark.parametrize("kind", ["contiguous", "spread", "wide", "ties"])
def test_plan_layer_equals_the_previous_code_in_bulk(kind: str) -> None:
    rng = np.random.default_rng({"contiguous": 1, "spread": 2, "wide": 3, "ties": 4}[kind])
    for _ in range(60):
        G = int(rng.choice([2, 3, 8, 16, 32]))
        E = int(rng.choice([G, 2 * G, 4 * G, 64]))
        demand, copies = _random_layer(rng, G, E, kind)
        base = base_layer(copies)
        for n in {0, 1, 2, int(rng.integers(0, min(E, 9) + 1))}:
            alpha = float(rng.choice([0.0, 0.5, 1.0]))
            eps, strict = float(rng.choice([0.0, 0.0, 0.02])), bool(rng.random() < 0.3)
            _same(plan_layer(demand, base, n, alpha, eps=eps, strict=strict),
                  ref_plan_layer(demand, copies, n, alpha, eps, strict))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_plan_layer_equals_the_previous_code_at_full_size(n: int) -> None:
    # 64 GPUs x 256 experts, 8,192 tokens per GPU, top-8: thousands of rebalancer moves per layer
    for seed in range(2):
        demand, copies = _skewed(64, 256, 8192, 8, seed=seed + 10 * n)
        plan = plan_layer(demand, copies, n, 0.5)
        _same(plan, ref_plan_layer(demand, copies, n, 0.5))
        assert plan.moves > 100
    # a base with redundant copies of the hottest experts (an EPLB-like layer)
    rng = np.random.default_rng(n)
    copies[np.argsort(-demand.sum(axis=0))[:64], rng.integers(0, 64, size=64)] += 1
    _same(plan_layer(demand, copies, n, 0.5), ref_plan_layer(demand, copies, n, 0.5))


def test_prefetch_on_fractional_demand_equals_the_previous_code() -> None:
    # predictors give real-valued demand: shares of thirds tie within the tolerance; sums depend on their order
    rng = np.random.default_rng(7)
    for trial in range(400):
        G, E = int(rng.integers(1, 9)), int(rng.integers(1, 14))
        hosted = np.zeros((G, E), dtype=bool)
        for e in range(E):
            hosted[rng.choice(G, size=int(rng.integers(1, G + 1)), replace=False), e] = True
        demand = [rng.integers(0, 3, size=(G, E)) / 3.0, rng.random((G, E)) * 7 * (rng.random((G, E)) < 0.6),
                  rng.integers(0, 5, size=(G, E)).astype(float)][trial % 3]
        n, alpha = int(rng.integers(0, E + 1)), float(rng.choice([0.0, 0.25, 0.5, 1.0]))
        extras, load = prefetch(demand, hosted, n, alpha)
        ref_extras, ref_load = ref_prefetch(demand, hosted, n, alpha)
        assert extras.tolist() == ref_extras.tolist()
        assert load.tobytes() == ref_load.tobytes()
    layers_ = np.stack([rng.random((4, 6)) for _ in range(3)])
    hosted3 = np.ones((3, 4, 6), dtype=bool)
    hosted3[:, 1:, :] = False
    got = prefetch_layers(layers_, hosted3, 2, 0.5)
    assert all(got[i].tolist() == ref_prefetch(layers_[i], hosted3[i], 2, 0.5)[0].tolist() for i in range(3))


def test_rebalance_kernel_equals_the_previous_code() -> None:
    rng = np.random.default_rng(11)
    for _ in range(3000):
        G, E = int(rng.integers(1, 8)), int(rng.integers(1, 8))
        has = np.zeros((E, G), dtype=bool)
        for e in range(E):
            has[e, rng.choice(G, size=int(rng.integers(1, G + 1)), replace=False)] = True
        local = rng.integers(0, int(rng.integers(1, 30)), size=G).astype(np.int64)
        remote = (rng.integers(0, int(rng.integers(1, 30)), size=(G, E)) * has.T).astype(np.int64)
        B = (local.sum() + remote.sum()) / G
        eps, strict = float(rng.choice([0.0, 0.05, 0.3])), bool(rng.integers(2))
        hstart, hosts = ref_host_lists(has)
        gstart, gexp = ref_gpu_lists(hstart, hosts, G)
        got_remote, ref_remote = remote.copy(), remote.copy()
        loads, moves = rebalance(local, got_remote, hstart, hosts, gstart, gexp, B, eps, strict)
        ref_loads, ref_moves = ref_rebalance(local, ref_remote, hstart, hosts, gstart, gexp, B, eps, strict)
        assert (loads.tolist(), got_remote.tolist(), moves) == (ref_loads.tolist(), ref_remote.tolist(), ref_moves)


def test_rebalance_with_loads_too_large_to_pack_equals_the_previous_code() -> None:
    # 1,100 GPUs need 11 bits of id: loads summing past 2**51 cannot share an int64 key with the id, and the
    # kernel finds the busiest GPU by its load alone (still under 2**53, where the integer tests are exact)
    G, E = 1100, 2
    has = np.zeros((E, G), dtype=bool)
    has[0, :10] = has[1, 10:20] = True  # expert 0 on GPUs 0-9, expert 1 on GPUs 10-19
    local = np.full(G, 3 * 2**40, dtype=np.int64)
    remote = np.zeros((G, E), dtype=np.int64)
    remote[0, 0], remote[10, 1] = 5000, 3000
    assert 2**51 < local.sum() + remote.sum() < 2**53
    hstart, hosts = host_lists(has)
    gstart, gexp = gpu_lists(hstart, hosts, G)
    B = (local.sum() + remote.sum()) / G
    got_remote, ref_remote = remote.copy(), remote.copy()
    loads, moves = rebalance(local, got_remote, hstart, hosts, gstart, gexp, B, 0.0, False)
    ref_loads, ref_moves = ref_rebalance(local, ref_remote, hstart, hosts, gstart, gexp, B, 0.0, False)
    assert moves == ref_moves > 0
    assert (loads.tolist(), got_remote.tolist()) == (ref_loads.tolist(), ref_remote.tolist())


def test_assign_equals_the_rebalance_router_on_the_per_batch_layer() -> None:
    # plan_layer's split handed out to tokens is route_tokens on the base copies plus the extras
    rng = np.random.default_rng(3)
    for _ in range(40):
        G, E, K, T = int(rng.choice([2, 4, 8])), int(rng.choice([4, 8, 16])), 2, int(rng.integers(1, 200))
        _, copies = _random_layer(rng, G, E, "spread")
        ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)])
        src = np.sort(rng.integers(0, G, size=T))
        kept = rng.random((T, K)) < 0.9
        counts = np.zeros((G, E), dtype=np.int64)
        np.add.at(counts, (np.repeat(src, K)[kept.ravel()], ids.ravel()[kept.ravel()]), 1)
        n = int(rng.integers(0, 3))
        plan = plan_layer(counts, copies, n, 0.5)
        per_batch = copies.copy()
        g, slot = np.nonzero(plan.extras >= 0)
        per_batch[plan.extras[g, slot], g] += 1
        want = route_tokens(ids, src, np.array([0, T]), per_batch, 2, 0.0, False, kept)
        got = assign(plan, copies, ids, src, kept, 2)
        assert got.tolist() == want.tolist()
        assert np.bincount(got[kept], minlength=G).tolist() == plan.loads.tolist()


# ----------------------------------------------------------------------------------------------------------
# 2. hand-derived cases
# ----------------------------------------------------------------------------------------------------------


def test_a_move_between_two_copies_of_one_gpu() -> None:
    # 3 GPUs, 2 experts: expert 0 twice on GPU 0 and once on GPU 1, expert 1 on GPU 2; GPU 2's tokens pick
    # expert 0 six times, GPU 1's pick expert 1 three times; nothing is local. n = 0.
    # Prefetcher's loads: expert 0's 6 remote picks over its 2 holding GPUs: 3 + 3; expert 1's 3 on GPU 2: 3.
    # Rebalancer: 6 picks dealt to 3 copies, 2 each: GPU 0 4, GPU 1 2; GPU 2 3. B = 9 / 3 = 3.
    # GPU 0 (4 > 3) moves expert 0 to GPU 1: cap = floor(3 - 2) = 1, one pick: loads 3, 3, 3, one move.
    copies = np.array([[2, 1, 0], [0, 0, 1]])
    demand = np.array([[0, 0], [0, 3], [6, 0]])
    plan = plan_layer(demand, copies, 0, 0.5)
    assert plan.extras.shape == (3, 0)
    assert plan.expected.tolist() == [3.0, 3.0, 3.0]
    assert plan.remote.tolist() == [[3, 0], [3, 0], [0, 3]]
    assert plan.loads.tolist() == [3, 3, 3] and plan.moves == 1


def test_the_docstring_example() -> None:
    # experts {0, 1} on GPU 0, {2, 3} on GPU 1; GPU 0's tokens pick 0 once and 2 three times, GPU 1's pick 2 once.
    # n = 1, alpha = 1: GPU 0 takes expert 2 (its most requested remote expert); GPU 1's tokens want nothing it
    # lacks. Every pick is then local: loads 1 + 3 = 4 and 1 (local picks never move), B = 2.5, no move.
    copies = np.array([[1, 0], [1, 0], [0, 1], [0, 1]])
    plan = plan_layer(np.array([[1, 0, 3, 0], [0, 0, 1, 0]]), copies, 1, 1.0)
    assert plan.extras.tolist() == [[2], [-1]]
    assert plan.expected.tolist() == [4.0, 1.0]
    assert not plan.remote.any() and plan.loads.tolist() == [4, 1] and plan.moves == 0


def test_a_source_that_cannot_move_comes_back_when_a_holder_gets_lighter() -> None:
    # GPUs A, B, D = 0, 1, 2; expert x on A and B, y on B and D. Remote picks: A 10 of x, B 9 of y; D has 2
    # local picks. B = 21 / 3 = 7.
    # A (10) first: x's other holder B is at 9: cap = floor(7 - 9) < 1, levelling (10 - 9) // 2 = 0: A cannot.
    # B (9): y to D (2): cap = floor(7 - 2) = 5, moves 5: B 4, D 7.
    # A again: x to B (now 4): cap = 3, moves 3: A 7, B 7. All at B: done, 2 moves.
    has = np.array([[True, True, False], [False, True, True]])
    hstart, hosts = host_lists(has)
    gstart, gexp = gpu_lists(hstart, hosts, 3)
    remote = np.array([[10, 0], [0, 9], [0, 0]], dtype=np.int64)
    loads, moves = rebalance(np.array([0, 0, 2], dtype=np.int64), remote, hstart, hosts, gstart, gexp, 7.0, 0.0, False)
    assert loads.tolist() == [7, 7, 7] and moves == 2
    assert remote.tolist() == [[7, 0], [3, 4], [0, 5]]


# ----------------------------------------------------------------------------------------------------------
# 3. inputs
# ----------------------------------------------------------------------------------------------------------

COPIES = np.array([[1, 0], [0, 1]])


@pytest.mark.parametrize(("demand", "copies", "n", "alpha", "eps", "match"), [
    (np.array([[1, -2], [0, 0]]), COPIES, 1, 0.5, 0.0, r"demand\[0, 1\] is negative"),
    (np.array([[1.5, 0], [0, 0]]), COPIES, 1, 0.5, 0.0, "whole, finite"),
    (np.array([[np.nan, 0], [0, 0]]), COPIES, 1, 0.5, 0.0, "whole, finite"),
    (np.array([["a", "b"], ["c", "d"]]), COPIES, 1, 0.5, 0.0, "must hold numbers"),
    (np.ones((2, 3), dtype=int), COPIES, 1, 0.5, 0.0, r"must be \[G, E\] = \[2, 2\]"),
    (np.ones((2, 2), dtype=int), np.array([[1, 0], [0, 0]]), 1, 0.5, 0.0, "expert 1 has no copy"),
    (np.ones((2, 2), dtype=int), np.array([[1, -1], [0, 1]]), 1, 0.5, 0.0, r"copies\[0, 1\] is negative"),
    (np.ones((2, 2), dtype=int), COPIES.astype(float), 1, 0.5, 0.0, "whole numbers"),
    (np.ones((2, 2), dtype=int), COPIES, 3, 0.5, 0.0, r"n \(3\) exceeds the 2 experts"),
    (np.ones((2, 2), dtype=int), COPIES, -1, 0.5, 0.0, "non-negative integer"),
    (np.ones((2, 2), dtype=int), COPIES, 1, 1.5, 0.0, r"alpha \(1.5\)"),
    (np.ones((2, 2), dtype=int), COPIES, 1, 0.5, 1.0, r"eps \(1.0\)"),
    (np.full((2, 2), 2**51), COPIES, 1, 0.5, 0.0, "picks, more than"),
])
def test_bad_inputs(demand: np.ndarray, copies: np.ndarray, n: int, alpha: float, eps: float, match: str) -> None:
    with pytest.raises(InputError, match=match) as err:
        plan_layer(demand, copies, n, alpha, eps=eps)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("ids", "src", "kept", "match"), [
    ([[0], [1], [7]], [0, 1, 1], None, r"ids must be whole numbers in \[0, 4\)"),  # expert 7 of 4
    ([[0], [1], [2]], [0, 1, 5], None, r"src must be whole numbers in \[0, 2\)"),  # GPU 5 of 2
    ([[0], [1], [2]], [0, 1], None, r"must be \[T, K\], \[T\] and \[T, K\]"),
    ([[0], [1], [2]], [0, 1, 1], np.ones((3, 2), dtype=bool), r"must be \[T, K\], \[T\] and \[T, K\]"),
    ([[0.5], [1], [2]], [0, 1, 1], None, "whole numbers"),
])
def test_assign_refuses_picks_the_plan_was_not_counted_from(ids: list, src: list, kept: Any, match: str) -> None:
    """Out-of-range picks went into the compiled hand-out unchecked (a silent -1, or a read out of bounds)."""
    copies = np.array([[1, 0], [0, 1], [1, 0], [0, 1]])
    plan = plan_layer(np.array([[3, 1, 0, 2], [0, 2, 1, 1]]), copies, 1, 1.0)
    ids_a = np.array(ids)
    kept_a = np.ones(ids_a.shape, dtype=bool) if kept is None else kept
    with pytest.raises(InputError, match=match) as err:
        assign(plan, copies, ids_a, np.array(src), kept_a, 2)
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match=r"copies have shape \[2, 2\]"):
        assign(plan, np.array([[1, 0], [0, 1]]), np.array([[0]]), np.array([0]), np.ones((1, 1), dtype=bool), 2)


def test_a_prepared_base_gives_the_same_plans_and_is_left_unchanged() -> None:
    demand, copies = _skewed(16, 64, 512, 4, seed=1)
    base = base_layer(copies)
    before = [a.copy() for a in (base.copies, base.glist, base.gcount, base.hlist, base.hcount)]
    first = plan_layer(demand, base, 4, 0.5)
    again = plan_layer(demand, base, 4, 0.5)
    _same(first, (again.extras, again.expected, again.remote, again.loads, again.moves))
    _same(first, ref_plan_layer(demand, copies, 4, 0.5))
    after = (base.copies, base.glist, base.gcount, base.hlist, base.hcount)
    assert all(np.array_equal(a[:, :k] if a.ndim == 2 and k else a, b[:, :k] if b.ndim == 2 and k else b)
               for a, b, k in zip(before, after, (0, 0, 0, 0, 0), strict=True))
    assert isinstance(base, BaseLayer)


# ----------------------------------------------------------------------------------------------------------
# 4. the exact predictor and libra's policy path
# ----------------------------------------------------------------------------------------------------------


def test_exact_is_a_predictor_and_oracle_its_alias() -> None:
    assert EXACT == ("exact", "oracle") and set(EXACT) <= set(PREDICTORS)
    assert LibraConfig(predictor="exact").exact and LibraConfig(predictor="oracle").exact
    assert not LibraConfig(predictor="history").exact
    assert make_predictor("exact").name == "exact" and make_predictor("oracle").name == "oracle"
    assert OraclePredictor().name == "oracle" and isinstance(OraclePredictor(), ExactPredictor)
    with pytest.raises(InputError, match="'oracle' or 'exact'"):
        LibraConfig(predictor="truth")
    with pytest.raises(InputError, match="oracle, exact"):
        make_predictor("truth")


def test_exact_predictions_equal_oracle_predictions() -> None:
    from moebalance.core.trace import RoutingTrace

    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(6, size=2, replace=False) for _ in range(24)]).reshape(12, 2, 2)
    tr = RoutingTrace(ids, rng.integers(0, 3, size=12), np.repeat([0, 1], 6), num_experts=6)
    for b in range(2):
        a, o = make_predictor("exact").predict(tr, b, 3), make_predictor("oracle").predict(tr, b, 3)
        assert np.array_equal(a.topk_ids, o.topk_ids) and np.array_equal(a.demand, o.demand)
        assert a.layers.all()


def test_libra_exact_plan_equals_batch_plan_and_the_router_split() -> None:
    rng = np.random.default_rng(4)
    G, E, L = 4, 8, 3
    base = Placement([[[e for e in range(E) if e % G == g] for g in range(G)] for _ in range(L)], E,
                     Cluster(num_nodes=1, gpus_per_node=G))
    counts = rng.integers(0, 20, size=(L, G, E))
    config = LibraConfig(predictor="exact", n=2)
    plan, extras, splits = exact_plan(base, counts, config)
    want_plan, want_extras = batch_plan(base, counts.astype(float), config)
    assert extras.tolist() == want_extras.tolist() and plan.gpu_experts == want_plan.gpu_experts
    for layer in range(L):
        _same(splits[layer], ref_plan_layer(counts[layer], base.copies[layer], 2, 0.5))
    with pytest.raises(InputError, match=r"\[L, G, E\] = \[3, 4, 8\]"):
        exact_plan(base, counts[:, :2], config)
