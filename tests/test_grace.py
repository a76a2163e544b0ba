"""GRACE-MoE: affinity, Alg. 1-2 grouping, the knee, Eq. 2-3 replication, the policy.

Hand-computed cases carry their derivation in comments; property tests use hypothesis. The conformance suite
over all policies (tests/test_policies.py) runs ``grace`` on random token-level cases as well.
"""

from __future__ import annotations

import json
import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from moebalance.algorithms.grace.grouping import (
    RATIO_GRID,
    affinity,
    alg2_bounds,
    controlled_grouping,
    cut_affinity,
    knee_index,
    mixed_affinity,
    refine_groups,
    size_deviation,
    spectral_clustering,
    utilization,
)
from moebalance.algorithms.grace.plan import GracePlan, grace_plan
from moebalance.algorithms.grace.replication import (
    hot_experts,
    place_copies,
    predict_loads,
    replica_count,
    replica_shares,
    skew_ratio,
)
from moebalance.core.budget import Capacity, resolve_budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, InputError
from moebalance.core.load import LoadMatrix, read_load
from moebalance.core.options import check_choice
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.policies import Budget, make_plan
from moebalance.policies.base import run_policy
from moebalance.policies.grace import GRACE, GraceDiagnostics
from moebalance.routing.simulate import evaluate
from moebalance.workloads.synth import synthesize


def _partition(labels: np.ndarray) -> set[frozenset[int]]:
    return {frozenset(np.flatnonzero(labels == g).tolist()) for g in np.unique(labels)}


def _shares_per_expert(plan: Placement) -> np.ndarray:
    assert plan.weights is not None
    total = np.zeros((plan.num_layers, plan.num_experts))
    for layer, (wl, pl) in enumerate(zip(plan.weights, plan.gpu_experts, strict=True)):
        for wg, pg in zip(wl, pl, strict=True):
            np.add.at(total[layer], np.asarray(pg, dtype=np.int64), np.asarray(wg))
    return total


def _cap(budget: Budget, weight: np.ndarray, cluster: Cluster) -> Capacity:
    """The capacity of ``budget`` for a planning load ``[L, E]`` on ``cluster``."""
    L, E = np.shape(weight)
    return resolve_budget(budget, E, cluster.num_gpus, L)


def _plan(weight: np.ndarray, affinity: np.ndarray | None, cluster: Cluster, budget: Budget,
          **options: object) -> Placement:
    """:func:`grace_plan`'s placement within ``budget``."""
    out = grace_plan(weight=weight, affinity=affinity, cluster=cluster, capacity=_cap(budget, weight, cluster),
                     **options)  # type: ignore[arg-type]
    assert isinstance(out, GracePlan)
    return out.placement


@pytest.fixture(scope="module")
def olmoe() -> LoadMatrix:
    """A small token-level OLMoE-like trace with topic (co-activation) clusters, on 4 ranks."""
    return LoadMatrix.from_arrays(synthesize("olmoe-1b-7b", num_batches=6, tokens_per_batch=256, num_gpus=4,
                                             seed=3, token_level=True))


# ----- Eq. 2: replica count and hot experts --------------------------------------------------------------------

@pytest.mark.parametrize(("group_load", "expected"), [
    ([10, 2, 2, 2], 2),    # mean 4, rho 2.5 -> floor 2
    ([5, 5, 5, 5], 1),     # rho 1 -> max(1, 1) = 1
    ([19, 1], 1),          # mean 10, rho 1.9 -> 1
    ([100, 0, 0, 0], 3),   # rho 4 -> capped at n_gpu - 1 = 3
    ([9, 3, 0], 2),        # mean 4, rho 2.25 -> 2 = n_gpu - 1
    # rho = 9 / (18 / 14) = 14 * 9 / 18 = 7 exactly; in floats 9 / mean is 6.999999999999999, floored to 6
    ([9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], 7),
    ([7], 0),              # one GPU: nowhere to replicate to
    ([0, 0, 0], 0),        # no load
])
def test_replica_count_eq2(group_load: list[int], expected: int) -> None:
    assert replica_count(np.array(group_load)) == expected
    assert replica_count(np.array(group_load, dtype=np.float64)) == expected


def test_skew_is_exact_in_the_policy() -> None:
    # 14 experts on 1 node x 14 GPUs, one per GPU (Vanilla): W = [9, 1 x 9, 0 x 4], rho = 14 * 9 / 18 = 7, so
    # Eq. 2 wants n = 7 (not 6) and params["skew"] records 7.0. Hot: 9 > 9 * 7 / 8 -> expert 0 alone, copied to
    # the 7 least-loaded GPUs other than GPU 0: the idle 10-13, then 1, 2, 3 (ties: lowest id).
    assert skew_ratio(np.array([9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0])) == 7
    assert skew_ratio(np.zeros(3)) == 0
    load = LoadMatrix(np.array([[[9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]]]))
    plan, _ = make_plan("grace", load, Cluster(num_nodes=1, gpus_per_node=14), Budget(slots_per_gpu=2),
                        grouping="uniform")
    assert plan.params["skew"] == [7.0] and plan.params["replicas_wanted"] == [7] and plan.params["replicas"] == [7]
    assert plan.params["hot_experts"] == [[0]]
    assert [g for g in range(14) if 0 in plan.gpu_experts[0][g]] == [0, 1, 2, 3, 10, 11, 12, 13]


@pytest.mark.parametrize(("loads", "ids", "n", "expected"), [
    # W_max = 100; n = 1: threshold 50; 50 does not exceed it, 50 + 30 = 80 does -> the first two
    ([50, 30, 15, 5], [0, 1, 2, 3], 1, [0, 1]),
    # n = 2: threshold 66.7; 80 > 66.7 -> the first two
    ([50, 30, 15, 5], [0, 1, 2, 3], 2, [0, 1]),
    # n = 3: threshold 75; 80 > 75 -> the first two; n = 9: threshold 90; 95 > 90 -> three
    ([50, 30, 15, 5], [0, 1, 2, 3], 3, [0, 1]),
    ([50, 30, 15, 5], [0, 1, 2, 3], 9, [0, 1, 2]),
    # n = 1: threshold 50; 60 > 50 -> the heaviest alone
    ([60, 30, 10], [4, 5, 6], 1, [4]),
    # ranking by load, whatever the order given: expert 3 (50) then expert 4 (30)
    ([5, 50, 30, 15], [7, 3, 4, 9], 1, [3, 4]),
    # ties rank by id: 0, 1, 2 (5 + 5 = 10 does not exceed 10; 15 does)
    ([5, 5, 5, 5], [3, 1, 2, 0], 1, [0, 1, 2]),
    ([0, 0], [0, 1], 1, []),
])
def test_hot_experts_threshold(loads: list[int], ids: list[int], n: int, expected: list[int]) -> None:
    assert hot_experts(np.array(loads), np.array(ids), n).tolist() == expected


def test_eq3_predicted_loads_conserve_tokens() -> None:
    # W = [60, 10, 10, 10]; the hot expert of GPU 0 carries W_r = 45 and goes to GPUs 1 and 2 (n = 2):
    # W_p = 45 / 3 = 15; GPU 0 keeps 60 - 45 + 15 = 30, GPUs 1, 2 get 10 + 15 = 25. (The printed
    # W_p = W_max / 3 = 20 would predict 35, 30, 30, 10: 105 tokens out of 90.)
    w = np.array([60.0, 10, 10, 10])
    out = predict_loads(w, 0, [np.array([1, 2])], np.array([45.0]))
    assert out.tolist() == [30, 25, 25, 10] and out.sum() == w.sum()
    # shares 1/30 : 1/25 : 1/25 = 5 : 6 : 6
    assert np.allclose(replica_shares(out, np.array([0, 1, 2])), [5 / 17, 6 / 17, 6 / 17])
    assert predict_loads(w, 0, [np.array([], dtype=np.int64)], np.array([45.0])).tolist() == w.tolist()
    # per hot expert: 30 to GPU 1 and 15 to GPUs 2 and 3 (two copies): W_p = 15 and 5, GPU 0 keeps
    # 60 - 30 + 15 - 15 + 5 = 35
    out = predict_loads(w, 0, [np.array([1]), np.array([2, 3])], np.array([30.0, 15.0]))
    assert out.tolist() == [35, 25, 15, 15] and out.sum() == w.sum()


def _hand_load() -> LoadMatrix:
    # 12 experts on 4 GPUs, Vanilla blocks of 3: GPU 0 = {0, 1, 2} with loads 45, 10, 5 (W = 60); the other
    # GPUs hold loads 4, 3, 3 (W = 10 each)
    return LoadMatrix(np.array([[[45, 10, 5, 4, 3, 3, 4, 3, 3, 4, 3, 3]]]))


def test_dynamic_replication_hand_case() -> None:
    # mean W = 22.5, rho = 2.67 -> n = 2. Hot: threshold 60 * 2 / 3 = 40; 45 > 40 -> expert 0 alone.
    # Targets: the two least-loaded GPUs other than GPU 0, all tied at 10 -> GPUs 1 and 2.
    # Eq. 3 as in the test above: predicted [30, 25, 25, 10], expert 0's shares 5/17, 6/17, 6/17.
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    plan, _ = make_plan("grace", _hand_load(), cluster, Budget(slots_per_gpu=4), grouping="uniform")
    assert plan.gpu_experts[0] == ((0, 1, 2), (0, 3, 4, 5), (0, 6, 7, 8), (9, 10, 11))
    assert plan.params["replicas_wanted"] == [2] and plan.params["replicas"] == [2]
    assert plan.params["hot_experts"] == [[0]] and plan.params["skew"] == [2.6667]
    assert plan.params["predicted_gpu_load"] == [[30.0, 25.0, 25.0, 10.0]]
    assert plan.weights is not None
    assert np.allclose(plan.weights[0][0], [5 / 17, 1, 1]) and np.allclose(plan.weights[0][1], [6 / 17, 1, 1, 1])
    assert np.allclose(plan.weights[0][2], [6 / 17, 1, 1, 1]) and plan.weights[0][3] == (1.0, 1.0, 1.0)


def test_fixed_replication_hand_case() -> None:
    # FR: n = 1. Hot: threshold 60 / 2 = 30; 45 > 30 -> expert 0, to the least-loaded GPU (tie: GPU 1).
    # W_p = 45 / 2 = 22.5: predicted [37.5, 32.5, 10, 10].
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    plan, _ = make_plan("grace", _hand_load(), cluster, Budget(slots_per_gpu=4), grouping="uniform",
                        replication="fixed")
    assert plan.gpu_experts[0] == ((0, 1, 2), (0, 3, 4, 5), (6, 7, 8), (9, 10, 11))
    assert plan.params["predicted_gpu_load"] == [[37.5, 32.5, 10.0, 10.0]]
    assert plan.weights is not None and np.isclose(plan.weights[0][0][0], (1 / 37.5) / (1 / 37.5 + 1 / 32.5))
    none, _ = make_plan("grace", _hand_load(), cluster, Budget(slots_per_gpu=4), grouping="uniform",
                        replication="none")
    assert none.extra_replicas == 0 and none.params["replicas"] == [0]


def test_slots_budget_lowers_n_to_what_fits() -> None:
    # 13 experts on 4 GPUs with 4 slots: Vanilla blocks 4, 3, 3, 3, so GPU 0 (the heaviest) is full and the
    # others have one free slot. Expert 0 is hot; Eq. 2 asks for n = 2 (rho = 64 / 25.75 = 2.49).
    load = LoadMatrix(np.array([[[40, 10, 10, 4, 4, 3, 3, 4, 3, 3, 7, 3, 3]]]))
    plan, _ = make_plan("grace", load, Cluster(num_nodes=1, gpus_per_node=4), Budget(slots_per_gpu=4),
                        grouping="uniform")
    # W = [64, 10, 10, 13]; threshold 64 * 2 / 3 = 42.7 -> hot = {0 (40), 1 (10)}: two slots needed, but every
    # GPU has one. n = 1: threshold 32 -> hot = {0}: fits on the least-loaded GPU 1.
    assert plan.params["replicas_wanted"] == [2] and plan.params["replicas"] == [1]
    assert plan.params["hot_experts"] == [[0]] and plan.gpu_experts[0][1] == (0, 4, 5, 6)
    assert plan.max_slots_per_gpu == 4


def test_replicas_budget_goes_to_the_most_skewed_layers() -> None:
    # 8 experts on 2 GPUs (q = 4), replicas_per_gpu 1: 2 extra replicas, at most 2 * 4 + 1 = 9 experts per GPU.
    # Layer 0: W = [33, 20], rho 1.25; layer 1: W = [103, 4], rho 1.93. Each wants expert 0 copied to GPU 1,
    # but GPU 1 has room for one more expert only: the more skewed layer 1 gets it.
    counts = np.array([[[30, 1, 1, 1, 5, 5, 5, 5], [100, 1, 1, 1, 1, 1, 1, 1]]])
    plan, _ = make_plan("grace", LoadMatrix(counts), Cluster(num_nodes=1, gpus_per_node=2),
                        Budget(replicas_per_gpu=1), grouping="uniform")
    assert plan.params["replicas_wanted"] == [1, 1] and plan.params["replicas"] == [0, 1]
    assert plan.gpu_experts[1][1] == (0, 4, 5, 6, 7) and plan.extra_replicas == 1


def test_hot_experts_spread_over_free_slots() -> None:
    # 12 experts on 4 GPUs with 4 slots: Vanilla blocks of 3, one free slot on every GPU. GPU 0 holds experts
    # 0, 1, 2 with loads 30, 30, 4 (W = 64); the others 4, 3, 3 (W = 10). rho = 64 / 23.5 = 2.72 -> Eq. 2's n = 2.
    # n = 2: threshold 64 * 2 / 3 = 42.7 -> hot {0, 1} (30 + 30 = 60); expert 0 takes GPUs 1 and 2 (least
    # loaded, ties by id), expert 1 finds one free slot (GPU 3) for two copies: n = 2 does not fit.
    # n = 1: threshold 32 -> hot {0, 1} again (30 is not above 32); expert 0 -> GPU 1, expert 1 -> GPU 2, one
    # slot each. (Requiring every target to hold the whole hot set, two slots, replicated nothing here.)
    # Eq. 3 per expert: W_p = 15 each; GPU 0 keeps 64 - 30 + 15 - 30 + 15 = 34, GPUs 1 and 2 get 25.
    # Shares 1/34 : 1/25 -> 25/59 on GPU 0 and 34/59 on the copy, for both experts.
    load = LoadMatrix(np.array([[[30, 30, 4, 4, 3, 3, 4, 3, 3, 4, 3, 3]]]))
    plan, _ = make_plan("grace", load, Cluster(num_nodes=1, gpus_per_node=4), Budget(slots_per_gpu=4),
                        grouping="uniform")
    assert plan.params["replicas_wanted"] == [2] and plan.params["replicas"] == [1]
    assert plan.params["hot_experts"] == [[0, 1]] and plan.params["hot_left_out"] == [0]
    assert plan.gpu_experts[0] == ((0, 1, 2), (0, 3, 4, 5), (1, 6, 7, 8), (9, 10, 11))
    assert plan.params["predicted_gpu_load"] == [[34.0, 25.0, 25.0, 10.0]]
    assert plan.weights is not None
    assert np.allclose(plan.weights[0][0], [25 / 59, 25 / 59, 1]) and np.isclose(plan.weights[0][1][0], 34 / 59)
    assert np.isclose(plan.weights[0][2][0], 34 / 59) and plan.extra_replicas == 2


def test_hot_experts_copied_while_slots_last() -> None:
    # 14 experts on 4 GPUs with 4 slots: blocks 4, 4, 3, 3, so only GPUs 2 and 3 have a free slot. GPU 0 holds
    # four experts of load 10 (W = 40); GPU 1 four of 1, GPUs 2 and 3 three of 1: W = [40, 4, 3, 3], rho = 3.2.
    # n = 3 (hot: 4 experts, 30 is not above 30) and n = 2 (hot: 3 experts) need 3 and 2 GPUs with room per
    # expert: no. n = 1: hot {0, 1, 2} (30 > 20), two free slots: experts 0 -> GPU 2 and 1 -> GPU 3 (least loaded,
    # ties by id); expert 2 is left out, and the record says so. Eq. 3: W_p = 5 each.
    load = LoadMatrix(np.array([[[10, 10, 10, 10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]]]))
    plan, _ = make_plan("grace", load, Cluster(num_nodes=1, gpus_per_node=4), Budget(slots_per_gpu=4),
                        grouping="uniform")
    assert plan.params["replicas_wanted"] == [3] and plan.params["replicas"] == [1]
    assert plan.params["hot_experts"] == [[0, 1]] and plan.params["hot_left_out"] == [1]
    assert plan.gpu_experts[0][2] == (0, 8, 9, 10) and plan.gpu_experts[0][3] == (1, 11, 12, 13)
    assert plan.params["predicted_gpu_load"] == [[30.0, 4.0, 8.0, 8.0]]


def test_place_copies() -> None:
    order = np.array([2, 1, 3])
    # one copy each: the first GPU of the order with a free slot
    assert [t.tolist() for t in place_copies(np.array([5, 6]), 1, order, np.array([0, 1, 1, 1]))] == [[2], [1]]
    # two copies each, room for three copies in all: the second expert does not fit
    assert [t.tolist() for t in place_copies(np.array([5, 6]), 2, order, np.array([0, 1, 1, 1]))] == [[1, 2]]
    # without memory limits every hot expert gets the same n least-loaded GPUs (Section 4.2)
    big = np.full(4, 10)
    assert [t.tolist() for t in place_copies(np.array([5, 6, 7]), 2, order, big)] == [[1, 2]] * 3
    # a cap on the copies in all
    assert len(place_copies(np.array([5, 6, 7]), 2, order, big, limit=5)) == 2


# ----- Alg. 2 -----------------------------------------------------------------------------------------------

def test_alg2_bounds() -> None:
    assert alg2_bounds(64, 8, 0.3) == (8, 2, 6, 10)  # delta = round(2.4) = 2
    assert alg2_bounds(64, 8, 0.0) == (8, 1, 7, 9)  # delta is at least 1
    assert alg2_bounds(9, 3, 0.5) == (3, 2, 1, 5)  # round(1.5) = 2 (half to even); num_min at least 1
    assert alg2_bounds(3, 8, 0.5) == (0, 1, 0, 1)  # fewer experts than groups: some groups stay empty


def _sym(n: int, pairs: dict[tuple[int, int], float]) -> np.ndarray:
    a = np.zeros((n, n))
    for (i, j), v in pairs.items():
        a[i, j] = a[j, i] = v
    return a


def test_alg2_steps_6_to_21_hand_case() -> None:
    # 9 experts, 3 groups, r = 0.5: E = 3, delta = 2, sizes in [1, 5]. Initial clusters C0 = {0..5},
    # C1 = {6, 7, 8}, C2 = {} (spectral clustering may leave one empty).
    pairs = {(i, j): 4.0 for i in range(5) for j in range(i + 1, 5)}  # 0-4 densely tied
    pairs.update({(0, 5): 1.0, (5, 6): 2.0, (6, 7): 3.0, (7, 8): 3.0, (6, 8): 1.0})
    a = _sym(9, pairs)
    labels = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1])
    # line 8: C0 has 6 > 5; within-C0 scores: e0 17, e1-e4 16, e5 1 -> peel e5, keep 0-4, Omega = [5]
    # line 14: e5's gain to C1 is A[5,6] = 2 > 0 for C2 -> C1 = {5, 6, 7, 8}
    # line 17: need = [0, 0, 1]; line 19: the weakest in its group among groups above num_min: e5 (2 < 4 < 6, 16)
    # line 20: e5 -> C2
    out = refine_groups(a, labels, 3, 1, 5)
    assert out.tolist() == [0, 0, 0, 0, 0, 2, 1, 1, 1]


def test_alg2_line_14_gain_versus_printed_score() -> None:
    # 10 experts, 3 groups, r = 0.5: sizes in [1, 5]. C0 = {0..5} (0-3 dense, 4 and 5 weak), C1 = {6, 7, 8}
    # dense, C2 = {9}. Trimming C0 pushes expert 5 (affinity 2 to expert 9 only). By the gain it joins
    # expert 9; the printed IntraScore(L_d u {e}) ranks C1 first (intra 30 + 0 > 0 + 4).
    pairs = {(i, j): 4.0 for i in range(4) for j in range(i + 1, 4)}
    pairs.update({(i, j): 5.0 for i in range(6, 9) for j in range(i + 1, 9)})
    pairs.update({(0, 4): 1.0, (1, 5): 0.5, (5, 9): 2.0})
    a = _sym(10, pairs)
    labels = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 2])
    assert refine_groups(a, labels, 3, 1, 5, "gain")[5] == 2
    assert refine_groups(a, labels, 3, 1, 5, "printed")[5] == 1


@st.composite
def affinities(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    n = draw(st.integers(1, 40))
    d = draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["dense", "sparse", "blocks", "zero"]))
    a = rng.random((n, n))
    if kind == "sparse":
        a *= rng.random((n, n)) < 0.1
    elif kind == "blocks":
        block = rng.integers(draw(st.integers(1, 6)), size=n)
        a *= np.where(block[:, None] == block[None, :], 10.0, 0.1)
    elif kind == "zero":
        a[:] = 0
    return np.triu(a, 1) + np.triu(a, 1).T, d


@given(case=affinities(), r=st.sampled_from(RATIO_GRID), seed=st.integers(0, 3), slack=st.integers(0, 3))
def test_alg2_sizes_within_bounds(case: tuple[np.ndarray, int], r: float, seed: int, slack: int) -> None:
    a, d = case
    n = a.shape[0]
    e, delta, lo, hi = alg2_bounds(n, d, r)
    cap = math.ceil(n / d) + slack
    groups = controlled_grouping(a, d, r, seed=seed, cap=cap)
    assert groups.shape == (n,) and groups.min() >= 0 and groups.max() < d  # every expert in exactly one group
    sizes = np.bincount(groups, minlength=d)
    assert sizes.sum() == n
    assert np.all(sizes >= lo) and np.all(sizes <= min(hi, cap))
    assert np.all(sizes >= e - delta) and np.all(sizes <= e + delta)
    # deterministic
    assert np.array_equal(groups, controlled_grouping(a, d, r, seed=seed, cap=cap))


@given(case=affinities(), data=st.data())
def test_refine_fixes_any_initial_clusters(case: tuple[np.ndarray, int], data: st.DataObject) -> None:
    # Alg. 2 lines 6-21 must reach the bounds from any start, e.g. everything in one cluster
    a, d = case
    n = a.shape[0]
    labels = np.array(data.draw(st.lists(st.integers(0, d - 1), min_size=n, max_size=n)))
    _, _, lo, hi = alg2_bounds(n, d, data.draw(st.sampled_from(RATIO_GRID)))
    sizes = np.bincount(refine_groups(a, labels, d, lo, hi), minlength=d)
    assert sizes.sum() == n and np.all((sizes >= lo) & (sizes <= hi))


def _block_affinity(sizes: list[int], seed: int, noise: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    block = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))  # block of each expert, ids shuffled
    a = np.where(block[:, None] == block[None, :], rng.uniform(1, 2, (n, n)), noise * rng.random((n, n)))
    a = np.triu(a, 1)
    return a + a.T, block


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_spectral_recovers_block_diagonal_affinity(noise: float) -> None:
    a, block = _block_affinity([3, 5, 4, 4], seed=0, noise=noise)
    labels = spectral_clustering(a, 4, seed=0)
    assert _partition(labels) == _partition(block)
    # block sizes 3-5 lie within Alg. 2's bounds even at r = 0 ([3, 5] around 16 / 4 = 4): nothing moves
    assert _partition(controlled_grouping(a, 4, 0.0, seed=1)) == _partition(block)
    # a tighter cap moves exactly one expert out of the block of 5
    capped = controlled_grouping(a, 4, 0.0, seed=1, cap=4)
    assert np.bincount(capped).tolist() == [4, 4, 4, 4]
    assert utilization(a, capped) < utilization(a, block)


def test_spectral_is_seeded_and_deterministic() -> None:
    # same inputs and seed (an integer or the policy's (seed, layer, node)), same labels; a clear block
    # structure comes out whatever the seed; labels are numbered by smallest expert id
    a, block = _block_affinity([4, 6, 5], seed=3, noise=0.1)
    first = spectral_clustering(a, 3, seed=(7, 2, 1))
    assert np.array_equal(first, spectral_clustering(a, 3, seed=(7, 2, 1)))
    assert _partition(first) == _partition(block) == _partition(spectral_clustering(a, 3, seed=11))
    _, firsts = np.unique(first, return_index=True)
    assert first[np.sort(firsts)].tolist() == [0, 1, 2]
    # integer counts (as affinity() returns) work as well as floats
    assert _partition(spectral_clustering(np.round(100 * a).astype(np.int64), 3)) == _partition(block)


@pytest.mark.parametrize(("n", "k"), [(3, 2), (128, 16)])
def test_spectral_is_deterministic_on_degenerate_affinity(n: int, k: int) -> None:
    # a uniform affinity has one eigenvalue repeated n - 1 times, so any basis of it is an embedding; ARPACK
    # (scikit-learn's SpectralClustering) restarted from its own saved random state here and split these in
    # different ways from call to call (and warned "ARPACK has failed" for 128 / 16). Dense eigh does not,
    # and k-means on duplicate points (an empty cluster) stays silent.
    a = np.ones((n, n))
    labels = {tuple(spectral_clustering(a, k).tolist()) for _ in range(30)}
    assert len(labels) == 1
    assert len(np.unique(next(iter(labels)))) <= k


def test_spectral_edge_cases() -> None:
    a, _ = _block_affinity([2, 2], seed=1)
    assert spectral_clustering(a, 1).tolist() == [0, 0, 0, 0]
    assert spectral_clustering(a, 4).tolist() == [0, 1, 2, 3]
    assert spectral_clustering(a, 9).tolist() == [0, 1, 2, 3]
    # no co-activation at all (top-1 routing): id order
    assert spectral_clustering(np.zeros((6, 6)), 3).tolist() == [0, 0, 1, 1, 2, 2]
    # an expert that nobody co-activates with still gets a cluster
    b = np.zeros((5, 5))
    b[0, 1] = b[1, 0] = b[2, 3] = b[3, 2] = 1.0
    assert sorted(np.bincount(spectral_clustering(b, 2), minlength=2)) == [2, 3]


# ----- Eq. 1 and the knee ------------------------------------------------------------------------------------

def test_utilization_and_size_deviation() -> None:
    a = _sym(4, {(0, 1): 3.0, (2, 3): 1.0, (0, 2): 1.0})
    assert utilization(a, np.array([0, 0, 1, 1])) == pytest.approx(4 / 5)
    assert cut_affinity(a, np.array([0, 0, 1, 1])) == pytest.approx(1.0)
    assert utilization(np.zeros((3, 3)), np.array([0, 0, 1])) == 0.0
    assert size_deviation(np.array([0, 0, 0, 1]), 2) == pytest.approx(1.0)  # sizes 3, 1 around 2
    assert size_deviation(np.array([0, 1, 0, 1]), 2) == 0.0


def test_knee_index() -> None:
    # normalised chord y = x; distances 0, .8 - 1/3, .9 - 2/3, 0 -> index 1
    assert knee_index([0, 1, 2, 3], [0, 0.8, 0.9, 1.0]) == 1
    # a convex curve has nothing above the chord: the most uniform candidate
    assert knee_index([0, 1, 2, 3], [0, 0.1, 0.3, 1.0]) == 0
    # repeated candidates (same delta) tie: the lower index (smaller r)
    assert knee_index([0, 0, 1, 1, 2], [0, 0, 0.9, 0.9, 1.0]) == 2
    # all sizes equal, or more non-uniformity buying nothing: the best U, ties to the lower index
    assert knee_index([1, 1, 1], [0.2, 0.5, 0.5]) == 1
    assert knee_index([0, 1, 2], [0.5, 0.6, 0.4]) == 1
    assert knee_index([0.5], [0.3]) == 0


def _two_topics_and_a_straggler() -> np.ndarray:
    """16 experts: a core topic 0-9 (pairs 10), expert 10 tied to each core expert by 1, a topic 11-15 (pairs 10).

    Total pairwise affinity: 45 * 10 + 10 * 1 + 10 * 10 = 560. Spectral clustering into 2 gives {0..10} and
    {11..15} (no affinity between them).
    """
    a = np.zeros((16, 16))
    a[:10, :10] = 10.0
    a[10, :10] = a[:10, 10] = 1.0
    a[11:, 11:] = 10.0
    np.fill_diagonal(a, 0.0)
    return a


# Alg. 2 on the affinity above, 2 groups (E = 8), cap 12, by r (delta = max(1, round(8 r))):
#   r = 0, 0.1  (delta 1, sizes 7-9):  cluster {0..10} has 11 > 9: peel 10 (score 10), then 0 (score 90, ties:
#               lowest id) to the other group -> sizes 9, 7; S = 1, U = (36 * 10 + 100 + A[0,10] = 1) / 560 = 461/560
#   r = 0.2, 0.3 (delta 2, sizes 6-10): peel 10 only -> sizes 10, 6; S = 2, U = (450 + 100) / 560 = 550/560
#   r >= 0.4    (delta >= 3, up to 11): nothing moves -> sizes 11, 5; S = 3, U = 1
# Kneedle: chord from (1, 461/560) to (3, 1); at S = 2: (550 - 461) / (560 - 461) - 1/2 = 0.399 > 0, and 0 at
# both ends -> the knee is the first r with S = 2: r = 0.2, interior on both axes.
_KNEE_S = [1.0, 1.0, 2.0, 2.0] + [3.0] * 7
_KNEE_U = [461 / 560] * 2 + [550 / 560] * 2 + [1.0] * 7


def test_knee_index_interior_golden() -> None:
    assert knee_index(_KNEE_S, _KNEE_U) == 2
    a = _two_topics_and_a_straggler()
    labels = spectral_clustering(a, 2)
    assert labels.tolist() == [0] * 11 + [1] * 5
    groups = [controlled_grouping(a, 2, r, cap=12, labels=labels) for r in RATIO_GRID]
    assert [size_deviation(g, 2) for g in groups] == _KNEE_S
    assert [utilization(a, g) for g in groups] == pytest.approx(_KNEE_U)


def test_policy_uses_the_knee_golden() -> None:
    # the case above as one layer on 1 node x 2 GPUs with 12 slots (cap 12 > 11: the cap does not bind): the
    # policy must record r = 0.2 and group {0..9} | {10..15}. Always taking the largest r would give 11 / 5 and
    # 1.0; always r = 0 would give 9 / 7 and 0.0.
    plan = _plan(np.ones((1, 16)), _two_topics_and_a_straggler()[None], Cluster(num_nodes=1, gpus_per_node=2),
                 Budget(slots_per_gpu=12), replication="none")
    assert plan.params["chosen_ratio"] == [0.2]
    assert set(plan.gpu_experts[0]) == {tuple(range(10)), tuple(range(10, 16))}


def test_capped_sizes_record_no_ratio() -> None:
    # the same case with 8 slots: every r gives sizes 8, 8 (S(r) = 0 throughout), so no knee exists and the
    # plan records None rather than a misleading 0.0
    plan = _plan(np.ones((1, 16)), _two_topics_and_a_straggler()[None], Cluster(num_nodes=1, gpus_per_node=2),
                 Budget(slots_per_gpu=8), replication="none")
    assert plan.params["chosen_ratio"] == [None]
    assert plan.slots().tolist() == [[8, 8]]
    fixed = _plan(np.ones((1, 16)), _two_topics_and_a_straggler()[None], Cluster(num_nodes=1, gpus_per_node=2),
                  Budget(slots_per_gpu=8), replication="none", ratio=0.5)
    assert fixed.params["chosen_ratio"] == [0.5]  # a given ratio is recorded as given


# ----- affinity -------------------------------------------------------------------------------------------

def test_affinity_matches_coactivation(olmoe: LoadMatrix) -> None:
    assert olmoe.trace is not None
    a = affinity(olmoe.trace)
    full = olmoe.trace.coactivation()
    idx = np.arange(olmoe.num_experts)
    full[:, idx, idx] = 0
    assert np.array_equal(a, full)


def _trace(pairs: list[tuple[int, int]], num_experts: int = 4) -> RoutingTrace:
    ids = np.array(pairs)[:, None, :]  # one layer, top-2
    return RoutingTrace(ids, np.zeros(len(pairs), int), np.zeros(len(pairs), int), num_experts=num_experts)


def test_mixed_affinity() -> None:
    t1 = _trace([(0, 1)] * 10)
    t2 = _trace([(2, 3)])
    # normalised per trace (each layer sums to 1), averaged: 0.5 * 1/2 at [0, 1] and [1, 0], same at [2, 3]
    m = mixed_affinity([t1, t2])
    assert m[0, 0, 1] == m[0, 1, 0] == m[0, 2, 3] == pytest.approx(0.25) and m.sum() == pytest.approx(1.0)
    m = mixed_affinity([t1, t2], weights=[3, 1])
    assert m[0, 0, 1] == pytest.approx(0.375) and m[0, 2, 3] == pytest.approx(0.125)
    # pooled counts: the bigger dataset dominates
    m = mixed_affinity([t1, LoadMatrix(t2.counts(), t2)], normalize=False)
    assert m[0, 0, 1] == pytest.approx(5.0) and m[0, 2, 3] == pytest.approx(0.5)
    with pytest.raises(InputError, match="one weight per trace"):
        mixed_affinity([t1, t2], weights=[1])
    with pytest.raises(InputError, match="not all zero"):
        mixed_affinity([t1, t2], weights=[-1, 2])
    with pytest.raises(InputError, match="mix traces of one model"):
        mixed_affinity([t1, _trace([(0, 4)], num_experts=5)])
    with pytest.raises(InputError, match="counts only"):
        mixed_affinity([LoadMatrix(t1.counts())])
    with pytest.raises(InputError, match="at least one trace"):
        mixed_affinity([])


# ----- the policy -------------------------------------------------------------------------------------------

def _node_cut(plan: Placement, a: np.ndarray, cluster: Cluster, level: str) -> float:
    """Affinity split across nodes (or GPUs) by a plan without replicas."""
    total = 0.0
    for layer in range(plan.num_layers):
        gpu = plan.copies[layer].argmax(axis=1)
        total += cut_affinity(a[layer], gpu // cluster.gpus_per_node if level == "node" else gpu)
    return total


def test_hierarchical_grouping_cuts_less_affinity_than_uniform(olmoe: LoadMatrix) -> None:
    assert olmoe.trace is not None
    a = affinity(olmoe.trace).astype(float)
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    budget = Budget(slots_per_gpu=24)  # 64 experts, 16 per GPU plus room for non-uniform groups
    hier, _ = make_plan("grace", olmoe, cluster, budget, replication="none")
    vanilla, _ = make_plan("grace", olmoe, cluster, budget, grouping="uniform", replication="none")
    assert hier.extra_replicas == vanilla.extra_replicas == 0
    for level in ("node", "gpu"):
        assert _node_cut(hier, a, cluster, level) < 0.9 * _node_cut(vanilla, a, cluster, level), level
    assert all(r is None or r in RATIO_GRID for r in hier.params["chosen_ratio"])
    assert any(r is not None for r in hier.params["chosen_ratio"])
    assert np.all(np.sum(hier.params["node_experts"], axis=1) == 64)


def _clique_trace(sizes: list[int], tokens: int, seed: int) -> LoadMatrix:
    """One layer whose tokens each pick 2 experts of one clique: experts 0..sizes[0]-1 form the first, and so on;
    a clique is picked in proportion to its size."""
    rng = np.random.default_rng(seed)
    starts = np.cumsum([0, *sizes])
    clique = rng.choice(len(sizes), size=tokens, p=np.array(sizes) / sum(sizes))
    first = rng.integers(0, np.array(sizes)[clique])
    second = (first + rng.integers(1, np.array(sizes)[clique])) % np.array(sizes)[clique]
    ids = (starts[clique][:, None] + np.stack([first, second], axis=1))[:, None, :]
    trace = RoutingTrace(ids, np.zeros(tokens, int), np.zeros(tokens, int), num_experts=int(starts[-1]))
    return LoadMatrix(trace.counts(), trace)


def test_gpu_groups_bounded_across_nodes() -> None:
    # A 12-expert clique and a 4-expert clique on 2 nodes x 2 GPUs, replicas budget (no per-layer cap), r = 0.
    # Section 4.1 bounds GPU groups to E / D +- delta with E the experts of the layer: 16 / 4 = 4, delta = 1,
    # so 3 to 5 experts on every GPU, and a node holds 6 to 10. Spectral node groups are the cliques, 12 and 4;
    # Alg. 2's lines 6-21 trim the 12 to 10. (Bounding inside each node only, by its own experts, put 6 + 6
    # on the GPUs of one node and 2 + 2 on the other.)
    load = _clique_trace([12, 4], tokens=3000, seed=0)
    plan, _ = make_plan("grace", load, Cluster(num_nodes=2, gpus_per_node=2), Budget(replicas_per_gpu=8),
                        replication="none", ratio=0.0)
    assert plan.slots().min() >= 3 and plan.slots().max() <= 5
    assert sorted(plan.params["node_experts"][0]) == [6, 10]
    # the knee chooses r per layer over the same bounds, whatever r it picks
    knee, _ = make_plan("grace", load, Cluster(num_nodes=2, gpus_per_node=2), Budget(replicas_per_gpu=8),
                        replication="none")
    r = knee.params["chosen_ratio"][0]
    _, _, lo, hi = alg2_bounds(16, 4, 0.0 if r is None else r)
    assert lo <= knee.slots().min() and knee.slots().max() <= hi


@pytest.mark.parametrize(("nodes", "gpn", "experts", "r"), [(2, 2, 16, 0.0), (2, 4, 64, 0.3), (4, 2, 30, 0.5),
                                                         (3, 1, 10, 0.2), (2, 4, 6, 0.0)])
@pytest.mark.parametrize("budget", [Budget(slots_per_gpu=40), Budget(replicas_per_gpu=40)], ids=["slots", "replicas"])
def test_every_gpu_group_within_the_layer_bound(nodes: int, gpn: int, experts: int, r: float, budget: Budget) -> None:
    # random skewed affinities (a few heavy pairs): whatever the spectral node clusters, every GPU group of every
    # layer holds E / G +- delta experts (alg2_bounds with the layer's E and G), nodes their GPUs' share
    rng = np.random.default_rng(experts)
    a = rng.pareto(1.0, size=(3, experts, experts))
    a = a + a.transpose(0, 2, 1)
    cluster = Cluster(num_nodes=nodes, gpus_per_node=gpn)
    plan = _plan(np.ones((3, experts)), a, cluster, budget, replication="none", ratio=r)
    _, _, lo, hi = alg2_bounds(experts, cluster.num_gpus, r)
    assert plan.slots().min() >= lo and plan.slots().max() <= hi
    node_sizes = plan.slots().reshape(3, nodes, gpn).sum(axis=2)
    assert node_sizes.tolist() == plan.params["node_experts"]


def _block_trace(num_blocks: int, block_size: int, tokens: int, seed: int) -> tuple[LoadMatrix, np.ndarray]:
    """Tokens that each pick 2 experts of one block (topic), expert ids shuffled; returns the block of each expert."""
    rng = np.random.default_rng(seed)
    E = num_blocks * block_size
    block = rng.permutation(np.repeat(np.arange(num_blocks), block_size))
    members = np.argsort(block, kind="stable").reshape(num_blocks, block_size)
    topic = rng.integers(num_blocks, size=tokens)
    pick = np.argsort(rng.random((tokens, block_size)), axis=1)[:, :2]
    ids = members[topic[:, None], pick][:, None, :]  # [T, 1 layer, 2]
    trace = RoutingTrace(ids, np.zeros(tokens, int), np.zeros(tokens, int), num_experts=E)
    return LoadMatrix(trace.counts(), trace), block


def test_golden_blocks_land_on_one_gpu_each() -> None:
    # 4 topics of 4 experts on 1 node x 4 GPUs with 4 slots: every topic on its own GPU, no affinity cut
    load, block = _block_trace(4, 4, tokens=2000, seed=0)
    plan, _ = make_plan("grace", load, Cluster(num_nodes=1, gpus_per_node=4), Budget(slots_per_gpu=4),
                        replication="none")
    assert {frozenset(g) for g in plan.gpu_experts[0]} == _partition(block)
    # 2 topics of 8 experts on 2 nodes x 1 GPU: the node level splits them
    load, block = _block_trace(2, 8, tokens=2000, seed=1)
    plan, _ = make_plan("grace", load, Cluster(num_nodes=2, gpus_per_node=1), Budget(slots_per_gpu=8),
                        replication="none")
    assert {frozenset(g) for g in plan.gpu_experts[0]} == _partition(block)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_golden_capped_node_groups_keep_topics_whole(seed: int) -> None:
    # 4 topics of 4 experts on 2 nodes x 2 GPUs with 4 slots: spectral clustering into 2 node groups may pair
    # the topics 3 + 1; the node cap (8) then peels one whole topic off (Alg. 2 line 8 as we read it) and
    # moves it to the other node, so every topic still lands on one GPU
    load, block = _block_trace(4, 4, tokens=2000, seed=seed)
    plan, _ = make_plan("grace", load, Cluster(num_nodes=2, gpus_per_node=2), Budget(slots_per_gpu=4),
                        replication="none")
    assert {frozenset(g) for g in plan.gpu_experts[0]} == _partition(block)
    # 6 topics on 2 x 2 GPUs with 8 slots and r = 0.5 (GPU groups of 6 +- 3, at most 8; nodes of 6 to 16): no
    # co-activation crosses a GPU (two topics on each GPU of one node, one on each of the other). The knee
    # would choose r = 0 here: its curve has two points only, (S, U) = (1, 0.79) for r <= 0.2 and (2, 1) above,
    # no point lies above the chord, and ties go to the smaller r
    load, block = _block_trace(6, 4, tokens=3000, seed=seed)
    plan, _ = make_plan("grace", load, Cluster(num_nodes=2, gpus_per_node=2), Budget(slots_per_gpu=8),
                        replication="none", ratio=0.5)
    assert load.trace is not None
    assert cut_affinity(affinity(load.trace)[0], plan.copies[0].argmax(axis=1)) == 0


@pytest.mark.parametrize("grouping", ["hierarchical", "uniform"])
@pytest.mark.parametrize("replication", ["dynamic", "fixed", "none"])
@pytest.mark.parametrize("budget", [Budget(slots_per_gpu=20), Budget(replicas_per_gpu=6)], ids=["slots", "replicas"])
def test_variants_make_valid_plans(olmoe: LoadMatrix, grouping: str, replication: str, budget: Budget) -> None:
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    plan, _ = make_plan("grace", olmoe, cluster, budget, grouping=grouping, replication=replication)
    budget.check(plan)
    assert plan.copies.max() == 1 and plan.warnings == ()
    assert np.allclose(_shares_per_expert(plan), 1.0)
    assert (plan.extra_replicas > 0) == (replication != "none")
    if replication != "none":
        assert max(plan.params["replicas"]) >= 1
    if replication == "fixed":
        assert max(plan.params["replicas_wanted"]) == 1
    # predicted loads conserve the planning load, layer by layer
    assert np.allclose(np.sum(plan.params["predicted_gpu_load"], axis=1), olmoe.total().sum(axis=1), atol=0.01)
    # params are JSON; the plan round-trips with its weights
    back = Placement.from_json_dict(json.loads(json.dumps(plan.to_json_dict())))
    assert back.gpu_experts == plan.gpu_experts and back.weights == plan.weights
    again, _ = make_plan("grace", olmoe, cluster, budget, grouping=grouping, replication=replication)
    assert again.gpu_experts == plan.gpu_experts and again.weights == plan.weights


def test_dynamic_replication_cuts_grouping_deviation_on_esft() -> None:
    # Real routing (DeepSeek's ESFT release, bundled:esft-law; docs/synth.md): 26 layers x 64 experts, the first
    # 4 batches (2,048 tokens), 1 node x 8 GPUs with 9 slots (one free slot per GPU and layer). GRACE
    # Section 5.3 reports that dynamic replication with weighted round-robin cuts grouping's load deviation by
    # 45-58%. Copies that had to share one target GPU fitted 33 replicas and cut it by 21%; one free slot per
    # copy fits a replica in every layer and cuts it by 41%. (GRACE stays below contiguous blocks in
    # balancedness on this trace: docs/results/grace_real.md.)
    load = read_load("bundled:esft-law").select_batches(0, 4)
    cluster = Cluster(num_nodes=1, gpus_per_node=8)
    grouped, _ = make_plan("grace", load, cluster, Budget(slots_per_gpu=9), replication="none")
    full, _ = make_plan("grace", load, cluster, Budget(slots_per_gpu=9))
    assert all(n >= 1 for n in full.params["replicas"]) and full.extra_replicas >= 80
    hg, dr = evaluate(grouped, load, "uniform").load_std, evaluate(full, load, "wrr").load_std
    assert dr <= 0.65 * hg


def test_typed_diagnostics(olmoe: LoadMatrix) -> None:
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    result = run_policy(GRACE, olmoe, cluster, Budget(slots_per_gpu=20), {})
    d = result.diagnostics
    assert isinstance(d, GraceDiagnostics)
    assert len(d.replicas) == len(d.skew) == len(d.predicted_gpu_load) == olmoe.num_layers
    assert d.chosen_ratio is not None and d.node_experts is not None
    for key, value in d.as_params().items():  # the plan's params hold the record field by field
        assert result.placement.params[key] == value
    direct = grace_plan(weight=olmoe.total(), affinity=affinity(olmoe.trace), cluster=cluster,  # type: ignore[arg-type]
                        capacity=_cap(Budget(slots_per_gpu=20), olmoe.total(), cluster))
    assert direct.record.replicas == d.replicas and direct.placement.gpu_experts == result.placement.gpu_experts
    vanilla = grace_plan(weight=olmoe.total(), affinity=None, cluster=cluster, grouping="uniform",
                         capacity=_cap(Budget(slots_per_gpu=20), olmoe.total(), cluster))
    assert vanilla.record.chosen_ratio is None and vanilla.record.node_experts is None


def test_check_choice() -> None:
    assert check_choice("grouping", "uniform", ("hierarchical", "uniform")) == "uniform"
    for value in ("spectral", 1, None):
        with pytest.raises(InputError, match=r"grouping \(.*\) must be 'hierarchical' or 'uniform'$"):
            check_choice("grouping", value, ("hierarchical", "uniform"))
    with pytest.raises(BudgetError, match=r"x \('d'\) must be 'a', 'b' or 'c'$"):
        check_choice("x", "d", ("a", "b", "c"), BudgetError)
    with pytest.raises(InputError, match=r"x \('d'\) must be 'a'$"):
        check_choice("x", "d", ("a",))


def test_replicas_budget_keeps_per_gpu_memory(olmoe: LoadMatrix) -> None:
    # R = 2 over 16 layers: 8 extra replicas in all and at most 16 * 16 + 2 experts on a GPU
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    plan, _ = make_plan("grace", olmoe, cluster, Budget(replicas_per_gpu=2))
    assert 0 < plan.extra_replicas <= 8
    assert plan.slots().sum(axis=0).max() <= 16 * 16 + 2
    assert plan.params["replicas"] != plan.params["replicas_wanted"]  # the budget binds, and it says so


def test_fixed_ratio_is_used(olmoe: LoadMatrix) -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    plan, _ = make_plan("grace", olmoe, cluster, Budget(slots_per_gpu=24), ratio=0.25, replication="none")
    assert plan.params["ratio"] == 0.25 and set(plan.params["chosen_ratio"]) == {0.25}
    # 64 experts in 4 groups: E = 16, delta = round(4) = 4 -> sizes in [12, 20]
    sizes = plan.slots()
    assert sizes.min() >= 12 and sizes.max() <= 20


def test_node_ratio_bounds_node_groups(olmoe: LoadMatrix) -> None:
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    free, _ = make_plan("grace", olmoe, cluster, Budget(replicas_per_gpu=8))
    bounded, _ = make_plan("grace", olmoe, cluster, Budget(replicas_per_gpu=8), node_ratio=0.1)
    # 64 experts on 2 nodes: E = 32, delta = round(3.2) = 3 -> node groups of 29 to 35 experts
    sizes = np.array(bounded.params["node_experts"])
    assert sizes.min() >= 29 and sizes.max() <= 35 and bounded.params["node_ratio"] == 0.1
    assert np.ptp(free.params["node_experts"], axis=1).max() > 6 and free.params["node_ratio"] is None


def test_grace_plan_takes_any_affinity(olmoe: LoadMatrix) -> None:
    assert olmoe.trace is not None
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    mixed = mixed_affinity([olmoe.trace, olmoe.select_batches(0, 3)])
    plan = _plan(olmoe.total(), mixed, cluster, Budget(slots_per_gpu=20))
    Budget(slots_per_gpu=20).check(plan)
    with pytest.raises(InputError, match="needs an affinity"):
        _plan(olmoe.total(), None, cluster, Budget(slots_per_gpu=20))
    # the capacity must be resolved for this load and cluster
    with pytest.raises(InputError, match=r"resolved for \[L, E, G\] = \[16, 64, 8\] but the load and cluster are "
                                         r"\[16, 64, 4\]") as info:
        grace_plan(weight=olmoe.total(), affinity=mixed, cluster=cluster,
                   capacity=resolve_budget(Budget(slots_per_gpu=20), 64, 8, 16))
    _one_line(info)


def test_inputs_refused() -> None:
    counts_only = LoadMatrix(np.ones((1, 2, 8), int))
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    with pytest.raises(InputError, match="token-level trace") as info:
        make_plan("grace", counts_only, cluster, Budget(slots_per_gpu=5))
    assert "\n" not in str(info.value)
    make_plan("grace", counts_only, cluster, Budget(slots_per_gpu=5), grouping="uniform")  # Vanilla: counts suffice
    for key, value, match in [("grouping", "spectral", "grouping .'spectral'. must be 'hierarchical' or 'uniform'"),
                              ("replication", "all", "must be 'dynamic', 'fixed' or 'none'"),
                              ("ratio", -0.1, r"ratio \(-0.1\) must be a finite non-negative number .* or None for the knee"),
                              ("ratio", True, "ratio"),
                              ("node_ratio", "x", r"node_ratio \('x'\) must be a finite non-negative number"),
                              ("seed", -1, r"seed \(-1\) must be a non-negative integer")]:
        with pytest.raises(InputError, match=match):
            make_plan("grace", counts_only, cluster, Budget(slots_per_gpu=5), **{"grouping": "uniform", key: value})
    with pytest.raises(InputError, match="has no parameter 'r'"):
        make_plan("grace", counts_only, cluster, Budget(slots_per_gpu=5), r=0.3)


def _one_line(info: pytest.ExceptionInfo[InputError]) -> None:
    assert "\n" not in str(info.value)


def test_grace_plan_refuses_bad_weight_and_affinity(olmoe: LoadMatrix) -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    w = np.ones((1, 8))
    a = np.ones((1, 8, 8))
    cases: list[tuple[object, object, str]] = [
        (np.full((1, 8), np.nan), a, r"weight has 8 NaN, infinite or negative entries .* give finite counts >= 0"),
        (-w, a, r"weight has 8 NaN, infinite or negative entries \(the first, -1.0, at \[0, 0\]\)"),
        (np.ones(8), a, r"weight has shape \[8\]; give the planning load \[L, E\]"),
        (w, np.full((1, 8, 8), np.inf), r"affinity has 64 NaN, infinite or negative entries"),
        (w, -a, "affinity has 64 NaN, infinite or negative entries"),
        (w, np.ones((8, 8)), r"affinity has shape \[8, 8\]; give co-activation counts \[L, E, E\] = \[1, 8, 8\]"),
        (w, np.ones((1, 8, 7)), r"needs an affinity \[L, E, E\] = \[1, 8, 8\] to match weight"),
        ("x", a, "weight .str. is not a numeric array"),
    ]
    for weight, aff, match in cases:
        with pytest.raises(InputError, match=match) as info:
            grace_plan(weight=weight, affinity=aff, cluster=cluster,  # type: ignore[arg-type]
                       capacity=resolve_budget(Budget(slots_per_gpu=5), 8, 2, 1))
        _one_line(info)
    with pytest.raises(InputError, match="weight has"):  # Vanilla checks the weight too
        _plan(-w, None, cluster, Budget(slots_per_gpu=5), grouping="uniform")
    with pytest.raises(InputError, match=r"group_load has 1 NaN"):
        replica_count(np.array([1.0, np.nan]))


def test_grouping_functions_refuse_bad_input() -> None:
    a = _sym(4, {(0, 1): 1.0, (2, 3): 1.0})
    nan = a.copy()
    nan[0, 1] = np.nan
    neg = a.copy()
    neg[2, 3] = -1.0
    calls = [
        (lambda: spectral_clustering(nan, 2), r"affinity has 1 NaN or infinite entries \(the first, nan, at \[0, 1\]\)"),
        (lambda: spectral_clustering(neg, 2), r"affinity has 1 negative entries \(the first, -1.0, at \[2, 3\]\)"),
        (lambda: spectral_clustering(np.ones((3, 4)), 2), r"affinity has shape \[3, 4\]; give a square \[n, n\]"),
        (lambda: spectral_clustering(a, 0), r"num_clusters \(0\) must be an integer >= 1"),
        (lambda: spectral_clustering(a, 2, seed=-1), r"seed \(-1\) must be a non-negative integer"),
        (lambda: controlled_grouping(a, 2, 0.5, cap=1), r"cap \(1\) must be an integer of at least ceil\(4 experts / 2 groups\) = 2"),
        (lambda: controlled_grouping(a, 2, 0.5, cap=2.5), r"cap \(2.5\) must be an integer"),  # type: ignore[arg-type]
        (lambda: controlled_grouping(a, 2, 0.5, cap=True), r"cap \(True\)"),
        (lambda: controlled_grouping(a, 2, -0.5), r"ratio \(-0.5\) must be a finite non-negative number"),
        (lambda: controlled_grouping(a, 2, float("nan")), r"ratio \(nan\)"),
        (lambda: controlled_grouping(a, 0, 0.5), r"num_groups \(0\) must be an integer >= 1"),
        (lambda: controlled_grouping(inf_a(a), 2, 0.5), "NaN or infinite"),
        (lambda: alg2_bounds(8, 0, 0.3), r"num_groups \(0\) must be an integer >= 1"),
        (lambda: refine_groups(a, np.array([0, 0, 1]), 2, 1, 3), r"labels has shape \[3\] .* \(shape \[4\]\)"),
        (lambda: refine_groups(a, np.array([0, 0, 1, 2]), 2, 1, 3), r"labels holds ids from 0 to 2; ids must lie in \[0, 2\)"),
        (lambda: refine_groups(a, np.array([0, 0, 1, 1]), 2, 3, 3), r"4 experts cannot form 2 groups of num_min \[3, 3\]"),
        (lambda: refine_groups(a, np.array([0, 0, 1, 1]), 2, 3, 2), r"num_min \[3, 3\] exceeds num_max \[2, 2\]"),
        (lambda: refine_groups(a, np.array([0, 0, 1, 1]), 2, -1, 4), r"num_min \(-1\) must be a non-negative integer"),
        (lambda: refine_groups(a, np.array([0, 0, 1, 1]), 2, 1, [3, 3, 3]), r"num_max .* one per group \(2 of them\)"),  # type: ignore[arg-type]
        (lambda: refine_groups(a, np.array([0, 0, 1, 1]), 2, 1, 3, "best"), r"assign \('best'\) must be 'gain' or 'printed'"),  # type: ignore[arg-type]
        (lambda: utilization(a, np.array([0, 1])), r"groups has shape \[2\]"),
        (lambda: cut_affinity(nan, np.array([0, 0, 1, 1])), "NaN or infinite"),
        (lambda: size_deviation(np.array([0, 2]), 2), r"groups holds ids from 0 to 2"),
        (lambda: knee_index([0, 1], [0.5]), r"S has shape \[2\] and U \[1\]"),
        (lambda: knee_index([], []), "at least one"),
        (lambda: knee_index([0, np.nan], [0, 1]), "must be finite"),
    ]
    for call, match in calls:
        with pytest.raises(InputError, match=match) as info:
            call()
        _one_line(info)


def inf_a(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    out[1, 0] = np.inf
    return out


def test_budgets_refused() -> None:
    load = LoadMatrix(np.ones((1, 2, 8), int))
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    kw = {"grouping": "uniform"}
    with pytest.raises(BudgetError, match=r"slots_per_gpu \(3\) cannot hold 8 experts on 2 GPUs"):
        make_plan("grace", load, cluster, Budget(slots_per_gpu=3), **kw)
    with pytest.raises(BudgetError, match=r"slots_per_gpu \(4\) fills all 2 GPUs .* give at least 5, or replication='none'"):
        make_plan("grace", load, cluster, Budget(slots_per_gpu=4), **kw)
    with pytest.raises(BudgetError, match=r"replicas_per_gpu \(0\) leaves no memory .* give at least 1"):
        make_plan("grace", load, cluster, Budget(replicas_per_gpu=0), **kw)
    with pytest.raises(BudgetError, match="cannot choose replicas_per_gpu itself"):
        make_plan("grace", load, cluster, Budget(replicas_per_gpu="auto"), **kw)
    # without replication both tight budgets are fine; one GPU never replicates
    for budget in (Budget(slots_per_gpu=4), Budget(replicas_per_gpu=0)):
        plan, _ = make_plan("grace", load, cluster, budget, replication="none", **kw)
        assert plan.extra_replicas == 0
    plan, _ = make_plan("grace", load, Cluster(num_nodes=1, gpus_per_node=1), Budget(slots_per_gpu=8), **kw)
    assert plan.extra_replicas == 0


def test_qwen3_sized_plan_fits_the_slots() -> None:
    # 48 layers x 128 experts, top-8, 32 x 512 tokens on 16 ranks, 2 nodes x 8 GPUs (speed: bench/, not here)
    load = LoadMatrix.from_arrays(synthesize("qwen3-30b-a3b", num_batches=32, tokens_per_batch=512, num_gpus=16,
                                             seed=0, token_level=True))
    plan, _ = make_plan("grace", load, Cluster(num_nodes=2, gpus_per_node=8), Budget(slots_per_gpu=10))
    assert plan.max_slots_per_gpu <= 10 and plan.extra_replicas > 0
