"""The one capacity rule: a budget resolved into what policies consume, and the slots <-> replicas conversion."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from moebalance.core.budget import Budget, resolve_budget, slots_to_replicas
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.policies import make_plan, plan_with


def test_slots_to_replicas_by_hand() -> None:
    # DeepSeek-V3 on 64 GPUs: 5 slots of which 4 hold the 256 experts, one extra per layer and GPU: R = 58
    assert slots_to_replicas(5, 256, 64, 58) == 58
    # 10 experts on 4 GPUs, 3 slots: 2 extra slots per layer over 4 GPUs = 0.5 per GPU and layer; 3 layers: 1.5,
    # rounded down to 1: a budget is a ceiling
    assert slots_to_replicas(3, 10, 4, 3) == 1
    # exactly the experts: no replicas
    assert slots_to_replicas(2, 8, 4, 7) == 0


def test_capacity_of_a_slots_budget() -> None:
    cap = resolve_budget(Budget(slots_per_gpu=5), 256, 64, 58)
    assert (cap.placement_slots, cap.layer_slots, cap.note) == (4, 5, None)
    assert cap.uniform_slots("eplb") == (5, cap)
    R, converted = cap.replicas("craft")
    assert R == 58 and converted.budget == Budget(replicas_per_gpu=58) and converted.layer_slots is None
    assert converted.note is not None and "replicas_per_gpu 58 = L * (S - E / G)" in converted.note and "slots_per_gpu 5" in converted.note


def test_capacity_of_a_replicas_budget() -> None:
    cap = resolve_budget(Budget(replicas_per_gpu=58), 256, 64, 58)
    assert cap.layer_slots is None and cap.replicas("craft") == (58, cap)
    # back: 58 extra replicas per GPU pay for one extra slot per layer: S = 5
    assert cap.uniform_slots("eplb")[0] == 5
    # 57 do not: EPLB gets the 4 slots of a placement without replicas
    assert resolve_budget(Budget(replicas_per_gpu=57), 256, 64, 58).uniform_slots("eplb")[0] == 4


@given(st.integers(1, 8), st.integers(1, 40), st.integers(1, 6), st.integers(0, 4))
def test_conversion_round_trip(G: int, E: int, L: int, extra: int) -> None:
    # S slots -> R never exceeds what S slots hold, and is the most that fits; back to equal slots gives at most S,
    # exactly S (at most E) when the conversion is exact
    S = -(-E // G) + extra
    R = slots_to_replicas(S, E, G, L)
    assert R >= 0 and R * G <= L * (S * G - E) < (R + 1) * G
    if R * G >= L * (-(-E // G) * G - E):  # R pays for a placement: equal slots exist
        back = resolve_budget(Budget(replicas_per_gpu=R), E, G, L).uniform_slots("eplb")[0]
        assert back <= min(S, E)
        if R * G == L * (S * G - E):
            assert back == min(S, E)


def test_refusals_name_the_fix() -> None:
    with pytest.raises(BudgetError, match=r"slots_per_gpu \(3\) cannot hold 16 experts on 4 GPUs; it must be at least 4"):
        resolve_budget(Budget(slots_per_gpu=3), 16, 4, 2)
    with pytest.raises(BudgetError, match="raise it to at least"):
        resolve_budget(Budget(replicas_per_gpu=0), 10, 4, 3).uniform_slots("eplb")
    with pytest.raises(BudgetError, match="cannot choose replicas_per_gpu itself"):
        resolve_budget(Budget(replicas_per_gpu="auto"), 10, 4, 3).replicas("grace")
    with pytest.raises(BudgetError, match="must be a Budget"):
        resolve_budget({"slots_per_gpu": 4}, 16, 4, 2)  # type: ignore[arg-type]


def test_check_counts_memory() -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    # 1 layer, 2 experts: expert 0 on both GPUs -> 1 extra replica, 2 slots on GPU 0
    plan = Placement([[[0, 1], [0]]], 2, cluster)
    resolve_budget(Budget(slots_per_gpu=2), 2, 2, 1).check(plan)
    with pytest.raises(BudgetError, match="puts 2 experts on one GPU in one layer but slots_per_gpu is 1"):
        resolve_budget(Budget(slots_per_gpu=1), 2, 2, 1).check(plan)
    resolve_budget(Budget(replicas_per_gpu=1), 2, 2, 1).check(plan)
    with pytest.raises(BudgetError, match="uses 1 extra replicas but replicas_per_gpu 0 allows 0"):
        resolve_budget(Budget(replicas_per_gpu=0), 2, 2, 1).check(plan)
    with pytest.raises(BudgetError, match="cannot choose"):
        resolve_budget(Budget(replicas_per_gpu="auto"), 2, 2, 1).check(plan)
    resolve_budget(Budget(replicas_per_gpu="auto"), 2, 2, 1).check(plan, chosen_replicas_per_gpu=1)


def test_one_budget_for_every_policy_in_a_comparison() -> None:
    # eplb takes the slots as they are; a replicas budget reaches it as equal slots, and the plan says so
    load = LoadMatrix(np.random.default_rng(0).integers(0, 50, size=(4, 3, 8)))
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    slots = plan_with("eplb", load, cluster, Budget(slots_per_gpu=3))
    assert slots.placement.max_slots_per_gpu == 3 and "budget_note" not in slots.placement.params
    reps = plan_with("eplb", load, cluster, Budget(replicas_per_gpu=3))
    assert reps.placement.max_slots_per_gpu == 3 and reps.placement.params["replicas_per_gpu"] == 3
    assert "read as slots_per_gpu 3 in every layer" in reps.placement.params["budget_note"]


def test_a_custom_policy_with_a_wrong_shape_gets_our_error() -> None:
    load = LoadMatrix(np.ones((1, 2, 4), dtype=np.int64))
    cluster = Cluster(num_nodes=1, gpus_per_node=2)

    def one_layer_short(*, load: LoadMatrix, cluster: Cluster, budget: Budget) -> Placement:
        return Placement([[[0, 1], [2, 3]]], 4, cluster)

    with pytest.raises(PlanError, match=r"returned a plan of \[layers, experts, GPUs\] = \[1, 4, 2\] for a load and "
                                        r"cluster of \[2, 4, 2\]"):
        make_plan(one_layer_short, load, cluster, Budget(slots_per_gpu=2))

    def not_a_plan(*, load: LoadMatrix, cluster: Cluster, budget: Budget) -> object:
        return [[0, 1], [2, 3]]

    with pytest.raises(PlanError, match="returned list, not a Placement"):
        make_plan(not_a_plan, load, cluster, Budget(slots_per_gpu=2))


def test_craft_under_a_slots_budget_stays_within_what_the_slots_hold() -> None:
    # 10 experts on 4 GPUs, 3 layers, 3 slots: at most 3 * (12 - 10) = 6 extra replicas and 9 slots per GPU in all
    load = LoadMatrix(np.random.default_rng(1).integers(0, 100, size=(6, 3, 10)))
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    result = plan_with("craft", load, cluster, Budget(slots_per_gpu=3))
    plan = result.placement
    assert plan.extra_replicas <= 6 and plan.slots().sum(axis=0).max() <= 9
    assert result.capacity.max_extra_replicas == 6 and result.capacity.max_slots_total == 9
    # a plan over those limits is refused even though R * G and L * q + R would allow it
    over = Placement([[[0, 1, 2, 3], [0, 4, 5], [1, 6, 7], [8, 9, 2]]] * 3, 10, cluster)
    assert over.extra_replicas == 9
    with pytest.raises(BudgetError, match="allows 6"):
        result.capacity.check(over)


def test_a_plan_file_under_auto_is_checked_against_the_r_it_records() -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    plan = Placement([[[0, 1], [0]]], 2, cluster, params={"chosen_replicas_per_gpu": 1})
    Budget(replicas_per_gpu="auto").check(plan)
    with pytest.raises(BudgetError, match="integer >= 0"):
        Budget(replicas_per_gpu="auto").check(plan, chosen_replicas_per_gpu=-1)
    Budget(replicas_per_gpu="auto").check(plan, chosen_replicas_per_gpu=np.int64(1))


def test_a_replica_budget_too_small_for_one_more_slot_is_noted_not_dropped() -> None:
    # DeepSeek-V3 on 8x8 GPUs: 58 layers x 256 experts on 64 GPUs is 4 slots each with no spare; one more slot per
    # GPU in every layer is 58 * 64 = 3,712 copies, so R = 29 (1,856 copies) buys nothing for equal slots
    slots, cap = resolve_budget(Budget(replicas_per_gpu=29), 256, 64, 58).uniform_slots("eplb")
    assert slots == 4 and cap.note is not None
    assert "0 of the 1856 extra replicas allowed are used" in cap.note and "replicas_per_gpu >= 58" in cap.note
    # at R = 58 the slot is paid for and there is nothing to note beyond the conversion
    assert resolve_budget(Budget(replicas_per_gpu=58), 256, 64, 58).uniform_slots("eplb")[0] == 5
    # R = 0 asks for no replicas: no note
    assert resolve_budget(Budget(replicas_per_gpu=0), 256, 64, 58).uniform_slots("eplb")[1].note is None
