"""CRAFT: the DP against brute force, Alg. 3 invariants, the Figure 10 example, placement."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from moebalance.algorithms.craft import (
    BenefitTable,
    allocate_replicas,
    benefit_table,
    interleaved_capacity,
    place,
    replica_ladder,
    replicate,
)
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError
from moebalance.core.load import LoadMatrix
from moebalance.policies import Budget, make_plan, plan_with
from moebalance.routing.simulate import evaluate


def test_replica_ladder() -> None:
    assert replica_ladder(64) == (1, 2, 4, 8, 16, 32, 64)  # K = log2(64) + 1 = 7
    assert replica_ladder(1) == (1,)
    assert replica_ladder(12) == (1, 2, 4, 8, 12)


def test_figure_10_interleaved_assignment() -> None:
    # CRAFT Figure 10: 4 GPUs (2 nodes), 8 experts, replicas per layer [2, 2, 4, 0] (R = 2, r = 8).
    # Layer 1's two extra experts go to GPUs 0 and 2 (one per node), layer 2's to GPUs 1 and 3,
    # layer 3's four to every GPU; every GPU ends with 2 + 3 + 3 + 2 ... = 10 experts in all.
    A = interleaved_capacity(8, 4, np.array([2, 2, 4, 0]))
    assert A.tolist() == [[3, 2, 3, 2], [2, 3, 2, 3], [3, 3, 3, 3], [2, 2, 2, 2]]
    assert A.sum(axis=0).tolist() == [10, 10, 10, 10]


@given(st.integers(1, 40), st.integers(1, 16), st.lists(st.integers(0, 40), min_size=1, max_size=12))
def test_interleaved_capacity_invariants(E: int, G: int, extra: list[int]) -> None:
    x = np.array(extra)
    A = interleaved_capacity(E, G, x)
    assert np.array_equal(A.sum(axis=1), E + x)  # every slot of every layer is placed
    assert np.all(A.max(axis=1) - A.min(axis=1) <= 1)  # within a layer, capacities differ by at most one
    totals = A.sum(axis=0)
    assert totals.max() - totals.min() <= 1  # per-GPU memory over layers differs by at most one ...
    if (E * x.size + x.sum()) % G == 0:
        assert totals.min() == totals.max()  # ... and is equal when the slots divide evenly


def test_replicate_by_load_per_replica() -> None:
    # loads 9, 4, 1 and 3 extra replicas: 9 -> 4.5 (r=2), then 4.5 -> 3 (r=3), then 4 > 3 -> expert 1 (r=2)
    assert replicate(np.array([[9.0, 4.0, 1.0]]), np.array([3]), 8).tolist() == [[3, 2, 1]]
    # capped at the number of GPUs: expert 0 stops at 2 replicas on 2 GPUs, the rest go elsewhere
    assert replicate(np.array([[100.0, 1.0, 1.0]]), np.array([3]), 2).tolist() == [[2, 2, 2]]


def _brute_force(table: BenefitTable, total: int, weighted: bool) -> float:
    options = [0, *table.replica_counts.tolist()]
    L = table.gain.shape[1]
    best = -np.inf
    for x in itertools.product(options, repeat=L):
        if sum(x) != total:
            continue
        value = 0.0
        for layer, r in enumerate(x):
            if r:
                k = options.index(r) - 1
                value += (r if weighted else 1) * table.gain[k, layer]
        best = max(best, value)
    return best


@given(st.integers(1, 4), st.sampled_from([2, 4, 8]), st.integers(0, 2**31), st.booleans())
def test_dp_is_exact(L: int, G: int, seed: int, weighted: bool) -> None:
    rng = np.random.default_rng(seed)
    ladder = np.array(replica_ladder(G))
    gain = rng.normal(0.1, 0.1, size=(ladder.size, L))  # gains may be negative (noise)
    table = BenefitTable(ladder, gain, np.full(L, 0.5))
    for total in range(0, L * G + 1, max(1, G // 2)):
        x = allocate_replicas(table, total, "weighted" if weighted else "gain")
        assert x.sum() == total and set(x.tolist()) <= {0, *ladder.tolist()}
        k = np.searchsorted(ladder, x)
        got = sum((r if weighted else 1) * gain[k[i], i] for i, r in enumerate(x) if r)
        assert got == pytest.approx(_brute_force(table, total, weighted))


def test_dp_without_exact_budget_takes_the_best_reachable_total() -> None:
    # a ladder without 1 cannot spend 6 replicas over two layers exactly; the best total <= 6 is 4
    table = BenefitTable(np.array([4, 8]), np.array([[0.3, 0.1], [0.5, 0.2]]), np.zeros(2))
    assert allocate_replicas(table, 6).tolist() == [4, 0]
    assert allocate_replicas(table, 8).tolist() == [8, 0]  # 0.5 beats 4 + 4 (0.3 + 0.1)


def test_replicate_stops_when_every_gpu_holds_every_expert() -> None:
    # a huge budget must neither hang nor overshoot: 3 experts on 4 GPUs take at most 3 * 3 extras
    counts = replicate(np.array([[5.0, 3.0, 1.0]]), np.array([10**15]), max_replicas=4)
    assert counts.tolist() == [[4, 4, 4]]


def test_dp_prefers_layers_with_benefit() -> None:
    # layer 0 gains a lot from 4 replicas, layer 1 nothing: all 4 go to layer 0
    table = BenefitTable(np.array([1, 2, 4]), np.array([[0.1, 0.0], [0.2, 0.0], [0.5, 0.01]]), np.zeros(2))
    assert allocate_replicas(table, 4).tolist() == [4, 0]
    assert allocate_replicas(table, 5).tolist() == [4, 1]


@given(st.integers(0, 2**31), st.sampled_from([(1, 4), (2, 2), (2, 4)]), st.integers(1, 6))
def test_place_has_no_same_gpu_copies_and_respects_capacity(seed: int, shape: tuple[int, int], R: int) -> None:
    nodes, gpn = shape
    G = nodes * gpn
    rng = np.random.default_rng(seed)
    L, E = 3, 16
    weight = rng.lognormal(0, 1.5, size=(L, E))
    x = rng.integers(0, G + 1, size=L)
    reps = replicate(weight, x, G)
    cap = interleaved_capacity(E, G, reps.sum(axis=1) - E)
    gpu, expert = place(weight, reps, cap, gpn)
    for layer in range(L):
        live = gpu[layer] >= 0
        pairs = set(zip(gpu[layer, live].tolist(), expert[layer, live].tolist(), strict=True))
        assert len(pairs) == live.sum()  # no (gpu, expert) twice
        assert np.array_equal(np.bincount(gpu[layer, live], minlength=G), cap[layer])
        assert np.array_equal(np.bincount(expert[layer, live], minlength=E), reps[layer])


def _skewed_load(seed: int = 0, B: int = 8, L: int = 6, E: int = 32) -> LoadMatrix:
    rng = np.random.default_rng(seed)
    alphas = np.where(np.arange(L) % 3 == 0, 0.05, 5.0)  # every third layer very skewed, the rest balanced
    p = np.stack([rng.dirichlet(np.full(E, a)) for a in alphas])
    return LoadMatrix(np.stack([np.stack([rng.multinomial(4000, pl) for pl in p]) for _ in range(B)]))


def test_benefit_table_and_allocation_follow_skew() -> None:
    load = _skewed_load()
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    table = benefit_table(load.counts, cluster)
    assert table.gain.shape == (4, 6) and table.replica_counts.tolist() == [1, 2, 4, 8]
    skewed = np.arange(6) % 3 == 0
    assert table.gain[-1, skewed].min() > table.gain[-1, ~skewed].max()  # replicas pay in skewed layers
    plan, _ = make_plan("craft", load, cluster, Budget(replicas_per_gpu=2))
    x = np.array(plan.params["layer_replicas"])
    assert x.sum() == 16 and x[skewed].sum() > x[~skewed].sum()
    assert plan.extra_replicas == 16 and plan.warnings == ()
    # memory stays uniform: every GPU holds the same number of experts over all layers
    assert len(set(plan.slots().sum(axis=0).tolist())) == 1


def test_craft_beats_placement_and_uniform_on_skewed_layers() -> None:
    load = _skewed_load(B=10)
    train, test = load.split(0.5)
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    greedy, _ = make_plan("greedy", train, cluster, Budget(replicas_per_gpu=2))
    craft, _ = make_plan("craft", train, cluster, Budget(replicas_per_gpu=2))
    uniform, _ = make_plan("craft", train, cluster, Budget(replicas_per_gpu=2), allocation="uniform")
    b = {name: evaluate(p, test).balancedness for name, p in [("g", greedy), ("c", craft), ("u", uniform)]}
    assert craft.extra_replicas == uniform.extra_replicas == 16
    assert b["c"] - b["g"] > 1.2 * (b["u"] - b["g"]) > 0


def test_craft_budget_errors() -> None:
    load = _skewed_load()
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    with pytest.raises(BudgetError, match="replica_counts"):
        make_plan("craft", load, cluster, Budget(replicas_per_gpu=1), replica_counts=[1, 8])
    with pytest.raises(BudgetError, match="allocation"):
        make_plan("craft", load, cluster, Budget(replicas_per_gpu=1), allocation="even")
    for bad in ([], [True], ["2"], [1.5], [0, 1], 4, None.__class__):
        with pytest.raises(BudgetError, match=r"replica_counts .* must be a non-empty list of integers in \[1, 4\]"):
            make_plan("craft", load, cluster, Budget(replicas_per_gpu=1), replica_counts=bad)


def test_slots_budget_is_read_as_replicas() -> None:
    # S = 9 slots per GPU for E = 32 experts on G = 4 GPUs and L layers: R = L * (9 - 32 / 4) = L replicas per GPU
    load = _skewed_load()
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    L, E, G = load.num_layers, load.num_experts, cluster.num_gpus
    result = plan_with("craft", load, cluster, Budget(slots_per_gpu=9))
    R = L * (9 - E // G)
    assert R == L and result.capacity.budget == Budget(replicas_per_gpu=R) and result.capacity.layer_slots is None
    plan = result.placement
    assert plan.params["slots_per_gpu"] == 9 and plan.params["replicas_per_gpu"] == R
    assert "slots_per_gpu 9 read as replicas_per_gpu" in plan.params["budget_note"]
    assert 0 < plan.extra_replicas <= R * G
    Budget(replicas_per_gpu=R).check(plan)  # the plan meets the converted budget ...
    # ... and is the plan of that budget given directly
    direct, _ = make_plan("craft", load, cluster, Budget(replicas_per_gpu=R))
    assert direct.gpu_experts == plan.gpu_experts


def test_auto_replication_factor_is_recorded() -> None:
    load = _skewed_load()
    result = plan_with("craft", load, Cluster(num_nodes=2, gpus_per_node=2), Budget(replicas_per_gpu="auto"))
    plan = result.placement
    R = result.diagnostics.chosen_replicas_per_gpu  # typed, as the budget check reads it
    assert R == plan.params["chosen_replicas_per_gpu"] and plan.params["replicas_per_gpu"] == "auto"
    assert R in (1, 2, 4) and plan.extra_replicas == R * 4
    assert len(plan.params["auto_curve"]) == 3  # R = 1, 2, 4 for L = 6 layers


def test_sweep_progress_counts_every_step_and_points_use_actual_replicas() -> None:
    from moebalance.app.sweep import sweep, sweep_steps

    load = _skewed_load(B=6)
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    L = load.num_layers
    calls = []
    policies, replicas = ["craft", "craft-uniform", "eplb", "greedy"], [0, 1, 2 * L]
    result = sweep(load, cluster, policies, replicas, on_step=lambda: calls.append(1))
    assert len(calls) == sweep_steps(load, cluster, policies, replicas) == 4 + 3 + 3 + 4 + 3
    point = {(p.policy, p.replicas_per_gpu): p for p in result.points}
    # CRAFT gives a layer at most G replicas, so at R = 2L it spends L * G, not 2L * G; uniform spends it all
    assert point[("craft", 2 * L)].extra_replicas == L * 4
    assert point[("craft-uniform", 2 * L)].extra_replicas == 2 * L * 4
    assert point[("greedy", 1)].extra_replicas == 0 and result.skipped == []
