"""Conformance suite over every registered policy, golden cases and brute force."""

from __future__ import annotations

import itertools
import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.policies import (
    DYNAMIC_POLICIES,
    POLICIES,
    Budget,
    get_policy,
    make_plan,
    plan_with,
)
from moebalance.routing.simulate import evaluate, gpu_loads

#: Policies of our own never put two copies of an expert on one GPU (the faithful eplb may).
NO_DUPLICATES = {"contiguous", "greedy", "craft", "grace"}


def _may_refuse(name: str, load: LoadMatrix, cluster: Cluster, budget: Budget) -> bool:
    """Whether ``name`` may legitimately refuse ``budget`` (it must never refuse anything else)."""
    too_few_slots = budget.slots_per_gpu is not None and budget.slots_per_gpu < math.ceil(load.num_experts / cluster.num_gpus)
    if name == "craft":  # a slots budget is read as R = L * (S - E / G) replicas per GPU
        return too_few_slots
    if name == "eplb":  # equal slots per GPU: a replicas budget may be too small for the rounding
        L, E, G = load.num_layers, load.num_experts, cluster.num_gpus
        R = budget.replicas_per_gpu
        return too_few_slots or (isinstance(R, int) and (L * E + R * G) // (L * G) < math.ceil(E / G))
    if name == "grace":  # its replicas need a free slot (slots budget) or R >= 1, unless there is one GPU
        G, S = cluster.num_gpus, budget.slots_per_gpu
        no_room = G > 1 and ((S is not None and S * G == load.num_experts) or budget.replicas_per_gpu == 0)
        return too_few_slots or no_room
    return too_few_slots


def test_registry_names_are_distinct_and_complete() -> None:
    assert {"contiguous", "greedy", "eplb"} <= set(POLICIES)
    assert not set(POLICIES) & set(DYNAMIC_POLICIES)  # docs/design.md's table is checked in test_layout.py
    with pytest.raises(InputError, match="unknown policy 'nope'; choose one of: contiguous"):
        get_policy("nope")


@st.composite
def cases(draw: st.DrawFn) -> tuple[LoadMatrix, Cluster, Budget]:
    nodes, gpn = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    G = nodes * gpn
    groups = draw(st.sampled_from([1, 2, 4]))
    E = groups * draw(st.integers(1, 6))
    L, B = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    alpha = draw(st.sampled_from([0.1, 1.0, 10.0]))
    p = rng.dirichlet(np.full(E, alpha), size=L)
    counts = np.stack([np.stack([rng.multinomial(draw(st.integers(0, 300)), pl) for pl in p]) for _ in range(B)])
    base = math.ceil(E / G)
    if draw(st.booleans()):
        budget = Budget(slots_per_gpu=base + draw(st.integers(0, 2)))
    else:
        budget = Budget(replicas_per_gpu=draw(st.integers(0, 2 * L)))
    return LoadMatrix(counts), Cluster(num_nodes=nodes, gpus_per_node=gpn), budget


def _params(name: str, load: LoadMatrix, cluster: Cluster) -> dict:
    if name == "eplb":  # pick a group count EPLB accepts: it must divide the experts
        return {"num_groups": math.gcd(load.num_experts, cluster.num_nodes * 2)}
    return {}


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(case=cases())
def test_conformance(name: str, case: tuple[LoadMatrix, Cluster, Budget]) -> None:
    load, cluster, budget = case
    if name == "grace":  # GRACE groups by co-activation: counts alone are refused (token-level cases below)
        with pytest.raises(InputError, match="needs a token-level trace"):
            make_plan(name, load, cluster, budget)
        return
    _check_conforms(name, load, cluster, budget, _params(name, load, cluster))


@st.composite
def token_cases(draw: st.DrawFn) -> tuple[LoadMatrix, Cluster, Budget]:
    """Like :func:`cases`, with a token-level trace: each token has one of two topics, and picks its top-k
    experts without replacement from its topic's per-layer popularity (so experts co-activate)."""
    counts_case, cluster, budget = draw(cases())
    B, L, E = counts_case.counts.shape
    k = draw(st.integers(1, min(E, 3)))
    tokens = draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    alpha = draw(st.sampled_from([0.1, 1.0, 10.0]))
    p = rng.dirichlet(np.full(E, alpha), size=(2, L))  # [topic, L, E]
    topic = rng.integers(2, size=B * tokens)
    keys = np.log(p[topic] + 1e-12) + rng.gumbel(size=(B * tokens, L, E))  # Gumbel-top-k
    ids = np.argsort(-keys, axis=2, kind="stable")[:, :, :k]
    trace = RoutingTrace(ids, rng.integers(cluster.num_gpus, size=B * tokens), np.repeat(np.arange(B), tokens),
                         num_experts=E, num_batches=B)
    return LoadMatrix(trace.counts(), trace), cluster, budget


#: GRACE's variants beyond the defaults (Section 5.3's ablation and a fixed ratio).
GRACE_VARIANTS = [{}, {"grouping": "uniform"}, {"replication": "fixed"}, {"replication": "none"}, {"ratio": 0.3},
                  {"node_ratio": 0.2}]


@pytest.mark.parametrize("params", GRACE_VARIANTS)
@given(case=token_cases())
def test_grace_conforms_on_token_level(params: dict, case: tuple[LoadMatrix, Cluster, Budget]) -> None:
    load, cluster, budget = case
    _check_conforms("grace", load, cluster, budget, params)


#: CRAFT's variants beyond the defaults: automatic R, the uniform baseline, the printed weighted objective,
#: a custom ladder.
CRAFT_VARIANTS = [
    ({"auto": True}, {}),
    ({}, {"allocation": "uniform"}),
    ({}, {"objective": "weighted"}),
    ({}, {"replica_counts": [2, 3]}),
]


@pytest.mark.parametrize(("how", "params"), CRAFT_VARIANTS)
@given(case=cases())
def test_craft_variants_conform(how: dict, params: dict, case: tuple[LoadMatrix, Cluster, Budget]) -> None:
    load, cluster, budget = case
    if how.get("auto") and budget.replicas_per_gpu is not None:
        budget = Budget(replicas_per_gpu="auto")
    if "replica_counts" in params and cluster.num_gpus < 3:
        params = {"replica_counts": [1]}
    _check_conforms("craft", load, cluster, budget, params)


def _check_conforms(name: str, load: LoadMatrix, cluster: Cluster, budget: Budget, params: dict) -> None:
    try:
        result = plan_with(name, load, cluster, budget, **params)
    except BudgetError:
        # a policy may refuse a budget it cannot meet, but only then
        assert _may_refuse(name, load, cluster, budget)
        return
    plan = result.placement
    # shape, every expert placed (Placement validates), budget respected
    assert (plan.num_layers, plan.num_experts, plan.num_gpus) == (load.num_layers, load.num_experts, cluster.num_gpus)
    assert np.all(plan.replica_counts() >= 1)
    result.capacity.check(plan, chosen_replicas_per_gpu=result.diagnostics.chosen_replicas_per_gpu)
    if result.capacity.budget != budget:  # only CRAFT converts (slots to replicas), and says so in the plan
        assert name == "craft" and budget.slots_per_gpu is not None and "budget_note" in plan.params
    else:
        budget.check(plan, chosen_replicas_per_gpu=result.diagnostics.chosen_replicas_per_gpu)
    if name in NO_DUPLICATES:
        assert plan.warnings == () and plan.copies.max() == 1
    if plan.weights is not None:  # a static weighted router's shares: each expert's sum to 1
        total = np.zeros((plan.num_layers, plan.num_experts))
        for layer, (wl, pl) in enumerate(zip(plan.weights, plan.gpu_experts, strict=True)):
            for wg, pg in zip(wl, pl, strict=True):
                np.add.at(total[layer], np.asarray(pg, dtype=np.int64), np.asarray(wg, dtype=np.float64))
        assert np.allclose(total, 1.0)
    if name == "craft":  # Alg. 3: memory stays uniform, per-GPU totals over layers differ by at most one
        per_gpu = plan.slots().sum(axis=0)
        assert per_gpu.max() - per_gpu.min() <= 1
        within = plan.slots()
        assert np.all(within.max(axis=1) - within.min(axis=1) <= 1)
    # deterministic
    again, _ = make_plan(name, load, cluster, budget, **params)
    assert again.gpu_experts == plan.gpu_experts
    # load conserved, metrics in (0, 1]
    loads = gpu_loads(plan, load.counts)
    assert np.allclose(loads.sum(axis=2), load.counts.sum(axis=2))
    if load.counts.sum() > 0:
        s = evaluate(plan, load)
        assert 0 < s.balancedness <= 1 + 1e-12 and s.imbalance_ratio >= 1 - 1e-12 and s.lower_bound_gap >= -1e-12
    # plans with equal slots round-trip through EPLB's tensors
    if np.all(plan.slots() == plan.slots()[0, 0]):
        back = Placement.from_eplb(plan.to_eplb().phy2log, cluster, num_experts=plan.num_experts)
        assert back.gpu_experts == plan.gpu_experts


def test_contiguous_golden() -> None:
    # 10 experts on 4 GPUs: blocks of 3, 3, 2, 2
    load = LoadMatrix(np.ones((1, 2, 10), int))
    plan, _ = make_plan("contiguous", load, Cluster(num_nodes=2, gpus_per_node=2), Budget(slots_per_gpu=3))
    assert plan.gpu_experts[0] == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))
    assert plan.gpu_experts[1] == plan.gpu_experts[0]


def test_greedy_golden() -> None:
    # loads 10, 7, 5, 4, 3, 1 on 3 GPUs with 2 slots each, heaviest first to the least loaded GPU with room:
    # e0 -> g0 (10), e1 -> g1 (7), e2 -> g2 (5), e3 -> g2 (9), e4 -> g1 (10), e5 -> g0 (11, the only room left)
    load = LoadMatrix(np.array([[[10, 7, 5, 4, 3, 1]]]))
    plan, _ = make_plan("greedy", load, Cluster(num_nodes=1, gpus_per_node=3), Budget(slots_per_gpu=2))
    assert plan.gpu_experts[0] == ((0, 5), (1, 4), (2, 3))
    assert evaluate(plan, load).balancedness == pytest.approx(10 / 11)


def test_greedy_ties_go_to_lower_ids() -> None:
    load = LoadMatrix(np.array([[[5, 5, 5, 5]]]))
    plan, _ = make_plan("greedy", load, Cluster(num_nodes=1, gpus_per_node=2), Budget(slots_per_gpu=2))
    # e0 -> g0, e1 -> g1, e2 -> g0 (tie, lower id), e3 -> g1
    assert plan.gpu_experts[0] == ((0, 2), (1, 3))


def _best_max_load(w: list[int], G: int, cap: int) -> int:
    """Exact min over all capacity-respecting assignments of the max GPU load (brute force)."""
    best = sum(w)
    for assign in itertools.product(range(G), repeat=len(w)):
        if max(np.bincount(assign, minlength=G)) > cap:
            continue
        best = min(best, max(np.bincount(assign, weights=w, minlength=G)))
    return int(best)


@given(st.lists(st.integers(0, 40), min_size=2, max_size=7), st.integers(2, 3))
def test_greedy_against_brute_force(w: list[int], G: int) -> None:
    E = len(w)
    cap = math.ceil(E / G)
    load = LoadMatrix(np.array([[w]]))
    plan, _ = make_plan("greedy", load, Cluster(num_nodes=1, gpus_per_node=G), Budget(slots_per_gpu=cap))
    greedy_max = gpu_loads(plan, load.counts).max()
    opt = _best_max_load(w, G, cap)
    lower = max(sum(w) / G, max(w))
    # the simulator's lower bound is valid, and greedy never beats the exact optimum
    assert lower <= opt + 1e-9 <= greedy_max + 1e-9


def test_eplb_policy_uses_the_budget() -> None:
    rng = np.random.default_rng(0)
    load = LoadMatrix(rng.integers(0, 100, size=(2, 4, 16)))
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    plan, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=6))
    assert plan.extra_replicas == 4 * (24 - 16) and plan.max_slots_per_gpu == 6
    assert plan.params["mode"] == "global" and plan.params["num_groups"] == 1
    plan, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=6), num_groups=4)
    assert plan.params["mode"] == "hierarchical"
    # replicas_per_gpu R over L = 4 layers: floor(R / L) extra slots per GPU per layer
    plan, _ = make_plan("eplb", load, cluster, Budget(replicas_per_gpu=9))
    assert plan.max_slots_per_gpu == 4 + 2 and plan.extra_replicas == 4 * 8 <= 9 * 4
    plan, _ = make_plan("eplb", load, cluster, Budget(replicas_per_gpu=3))
    assert plan.extra_replicas == 0


def test_eplb_beats_placement_on_skewed_load() -> None:
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(32, 0.2), size=6)
    counts = np.stack([np.stack([rng.multinomial(5000, pl) for pl in p]) for _ in range(4)])
    load = LoadMatrix(counts)
    cluster = Cluster(num_nodes=2, gpus_per_node=4)
    scores = {}
    for name in ("contiguous", "greedy", "eplb"):
        plan, _ = make_plan(name, load, cluster, Budget(slots_per_gpu=6))
        scores[name] = evaluate(plan, load).balancedness
    assert scores["contiguous"] < scores["greedy"] < scores["eplb"]


def test_impossible_budgets() -> None:
    load = LoadMatrix(np.ones((1, 2, 16), int))
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    for name in ("contiguous", "greedy", "eplb"):
        with pytest.raises(BudgetError, match=r"slots_per_gpu \(3\) cannot hold 16 experts on 4 GPUs"):
            make_plan(name, load, cluster, Budget(slots_per_gpu=3))
    with pytest.raises(BudgetError, match="exactly one budget"):
        Budget()
    with pytest.raises(BudgetError, match="exactly one budget"):
        Budget(slots_per_gpu=4, replicas_per_gpu=1)
    with pytest.raises(InputError, match="has no parameter 'x'"):
        make_plan("greedy", load, cluster, Budget(slots_per_gpu=4), x=1)
    # 6 experts on 4 GPUs need 8 equal slots: 2 extra replicas per layer, 4 in all > replicas_per_gpu 0
    with pytest.raises(BudgetError, match="raise it to at least 1"):
        make_plan("eplb", LoadMatrix(np.ones((1, 2, 6), int)), cluster, Budget(replicas_per_gpu=0))


@given(case=cases())
def test_eplb_avoid_duplicates_keeps_replica_counts(case: tuple[LoadMatrix, Cluster, Budget]) -> None:
    load, cluster, budget = case
    params = _params("eplb", load, cluster)
    try:
        ref, _ = make_plan("eplb", load, cluster, budget, **params)
    except BudgetError:
        return
    fixed, _ = make_plan("eplb", load, cluster, budget, avoid_duplicates=True, **params)
    # the same experts get the same number of replicas, with the same slots per GPU
    assert np.array_equal(fixed.replica_counts(), ref.replica_counts())
    assert np.array_equal(fixed.slots(), ref.slots())
    # never worse than the reference, and every surplus copy left has no legal swap partner
    assert (fixed.copies - 1).clip(0).sum() <= (ref.copies - 1).clip(0).sum()
    for layer, e, g in np.argwhere(fixed.copies > 1):
        holds = fixed.copies[layer] > 0  # [E, G]
        for h in range(cluster.num_gpus):
            if h == g or holds[e, h]:
                continue
            partners = [f for f in fixed.gpu_experts[layer][h] if not holds[f, g]]
            assert not partners, f"layer {layer}: expert {e} on GPU {g} could swap with {partners[0]} on GPU {h}"


def test_eplb_avoid_duplicates_removes_the_reference_duplicates() -> None:
    rng = np.random.default_rng(0)
    pop = rng.lognormal(0, 1.5, (6, 64))
    counts = rng.poisson(pop / pop.sum(1, keepdims=True) * 20000, size=(2, 6, 64))
    load, cluster = LoadMatrix(counts), Cluster(num_nodes=2, gpus_per_node=4)
    ref, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=12), num_groups=1)
    fixed, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=12), num_groups=1, avoid_duplicates=True)
    surplus = (fixed.copies - 1).clip(0).sum(axis=2)  # [L, E] copies beyond one per GPU
    # an expert with more replicas than GPUs must double up somewhere; everything else is repaired
    unavoidable = (fixed.replica_counts() - cluster.num_gpus).clip(0)
    assert ref.warnings and (ref.copies - 1).clip(0).sum() > unavoidable.sum()
    assert np.array_equal(surplus, unavoidable)
    assert evaluate(fixed, load).balancedness >= evaluate(ref, load).balancedness - 0.01


def test_budgets_when_gpus_do_not_divide_experts() -> None:
    # 10 experts on 4 GPUs need 3 slots per GPU: 2 extra replicas per layer, 4 in all for 2 layers
    load = LoadMatrix(np.ones((1, 2, 10), int))
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    plan, _ = make_plan("eplb", load, cluster, Budget(replicas_per_gpu=2))  # allows 8 extra replicas
    assert plan.max_slots_per_gpu == 3 and plan.extra_replicas == 4
    with pytest.raises(BudgetError, match="raise it to at least 1"):
        make_plan("eplb", load, cluster, Budget(replicas_per_gpu=0))
    for name in ("contiguous", "greedy"):  # no replicas: always within a replicas budget
        plan, _ = make_plan(name, load, cluster, Budget(replicas_per_gpu=0))
        assert plan.extra_replicas == 0


def test_avoid_duplicates_must_be_a_bool() -> None:
    load = LoadMatrix(np.ones((1, 2, 8), int))
    with pytest.raises(BudgetError, match="avoid_duplicates \\('no'\\) must be true or false"):
        make_plan("eplb", load, Cluster(num_nodes=1, gpus_per_node=2), Budget(slots_per_gpu=5), avoid_duplicates="no")


def test_auto_is_only_for_craft() -> None:
    load = LoadMatrix(np.ones((1, 2, 8), int))
    with pytest.raises(BudgetError, match="cannot choose replicas_per_gpu itself"):
        make_plan("eplb", load, Cluster(num_nodes=1, gpus_per_node=2), Budget(replicas_per_gpu="auto"))
    with pytest.raises(BudgetError, match="cannot choose replicas_per_gpu itself"):
        make_plan("greedy", load, Cluster(num_nodes=1, gpus_per_node=2), Budget(replicas_per_gpu="auto"))
