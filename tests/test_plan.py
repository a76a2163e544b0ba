"""Placement validation, derived arrays, EPLB conversions and the plan file."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from moebalance.core.cluster import Cluster
from moebalance.core.errors import PlanError
from moebalance.core.plan import Placement, read_plan, write_plan

C12 = Cluster(num_nodes=1, gpus_per_node=2)


def test_worked_example() -> None:
    # 1 layer, 4 experts, GPU 0 hosts {0, 1}, GPU 1 hosts {0, 2, 3}: expert 0 has two replicas.
    p = Placement([[[0, 1], [0, 2, 3]]], 4, C12)
    assert p.replica_counts().tolist() == [[2, 1, 1, 1]]
    assert p.slots().tolist() == [[2, 3]]
    assert p.extra_replicas == 1
    assert p.max_slots_per_gpu == 3
    assert p.replica_gpus().tolist() == [[[0, 1], [0, -1], [1, -1], [1, -1]]]
    assert p.warnings == ()


@pytest.mark.parametrize(
    ("layers", "fragment"),
    [
        ([[[0, 1], [2]]], "expert 3 of layer 0 has no replica"),
        ([[[0, 1], [2, 4]]], "holds expert 4"),
        ([[[0, 1], [2, -1]]], "holds expert -1"),
        ([[[0, 1, 2, 3]]], "has 1 GPU lists but the cluster has 2"),
        ([[[0, 1], [2, 3.0]]], "expert ids are integers"),
        ([], "non-empty list"),
        ([[[0, 1], "23"]], "must be a list of expert ids"),
    ],
)
def test_bad_placements(layers: list, fragment: str) -> None:
    with pytest.raises(PlanError, match=fragment):
        Placement(layers, 4, C12)


def test_duplicate_on_one_gpu_is_a_warning_not_an_error() -> None:
    p = Placement([[[0, 0, 1], [2, 3]]], 4, C12)
    assert p.replica_counts().tolist() == [[2, 1, 1, 1]]
    assert len(p.warnings) == 1 and "two copies" in p.warnings[0]


def test_eplb_round_trip_worked_example() -> None:
    # GPU 0: [0, 1], GPU 1: [2, 0]  ->  phy2log [0, 1, 2, 0]; expert 0 in slots 0 and 3.
    p = Placement([[[0, 1], [2, 0]]], 3, C12)
    t = p.to_eplb()
    assert t.phy2log.tolist() == [[0, 1, 2, 0]]
    assert t.log2phy.tolist() == [[[0, 3], [1, -1], [2, -1]]]
    assert t.logcnt.tolist() == [[2, 1, 1]]
    assert Placement.from_eplb(t.phy2log, C12, num_experts=3).gpu_experts == p.gpu_experts


def test_unequal_slots_have_no_eplb_form() -> None:
    with pytest.raises(PlanError, match="equal slots"):
        Placement([[[0, 1], [0, 2, 3]]], 4, C12).to_eplb()


@st.composite
def equal_slot_plans(draw: st.DrawFn) -> tuple[np.ndarray, Cluster, int]:
    nodes = draw(st.integers(1, 2))
    gpn = draw(st.integers(1, 3))
    G = nodes * gpn
    E = draw(st.integers(1, 8))
    S = draw(st.integers(-(-E // G), -(-E // G) + 2))
    L = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(L):
        extra = rng.integers(0, E, size=S * G - E)
        rows.append(rng.permutation(np.concatenate([np.arange(E), extra])))
    return np.stack(rows), Cluster(num_nodes=nodes, gpus_per_node=gpn), E


@given(equal_slot_plans())
def test_eplb_conversions_are_inverses(case: tuple[np.ndarray, Cluster, int]) -> None:
    phy2log, cluster, E = case
    p = Placement.from_eplb(phy2log, cluster, num_experts=E)
    t = p.to_eplb()
    assert np.array_equal(t.phy2log, phy2log)
    assert np.array_equal(t.logcnt.sum(axis=1), np.full(phy2log.shape[0], phy2log.shape[1]))
    # log2phy lists every slot of an expert exactly once, padded with -1.
    L, P = phy2log.shape
    for layer in range(L):
        for e in range(E):
            slots = t.log2phy[layer, e]
            real = slots[slots >= 0]
            assert sorted(real.tolist()) == np.flatnonzero(phy2log[layer] == e).tolist()
            assert np.all(slots[len(real):] == -1)
    assert Placement.from_eplb(t.phy2log, cluster, num_experts=E).gpu_experts == p.gpu_experts
    assert p.extra_replicas == L * (P - E)


def test_plan_file_round_trip(tmp_path) -> None:
    p = Placement([[[0, 1], [0, 2, 3]], [[3, 2], [1, 0]]], 4, C12, policy="x", params={"a": 1},
                  weights=[[[0.5, 1.0], [0.5, 1.0, 1.0]], [[1, 1], [1, 1]]])
    path = tmp_path / "p.json"
    write_plan(path, p)
    doc = json.loads(path.read_text())
    assert doc["format"] == "moebalance.plan" and doc["version"] == 1
    assert doc["cluster"] == {"num_nodes": 1, "gpus_per_node": 2}
    assert doc["num_layers"] == 2 and doc["num_experts"] == 4
    q = read_plan(path)
    assert q.gpu_experts == p.gpu_experts and q.params == {"a": 1} and q.weights == p.weights
    assert [f.name for f in tmp_path.iterdir()] == ["p.json"]  # no temporary left behind


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.pop("placement"), "lacks the key 'placement'"),
        (lambda d: d.update(num_layers=3), "placement has 2 layers but num_layers is 3"),
        (lambda d: d.update(cluster={"num_nodes": 1, "gpus_per_node": 3}), "cluster has 3 GPUs"),
        (lambda d: d.update(num_experts=0), "num_experts"),
        (lambda d: d["cluster"].update(num_gpus=2), r"^plan: 'cluster' has unknown keys \['num_gpus'\]; it holds only "
                                                    r"num_nodes and gpus_per_node$"),
        (lambda d: d.update(weights=[[[1.0], [1.0]]]), "weights has 1 layers"),
    ],
)
def test_bad_plan_documents(mutate, fragment: str) -> None:
    doc = Placement([[[0, 1], [2, 3]], [[0, 1], [2, 3]]], 4, C12).to_json_dict()
    mutate(doc)
    with pytest.raises(PlanError, match=fragment):
        Placement.from_json_dict(doc)


def test_truncated_plan_file(tmp_path) -> None:
    path = tmp_path / "p.json"
    write_plan(path, Placement([[[0, 1], [2, 3]]], 4, C12))
    path.write_text(path.read_text()[:20])
    with pytest.raises(PlanError, match="not valid JSON"):
        read_plan(path)


def test_to_eplb_log2phy_numbers_replicas_by_slot() -> None:
    """``to_eplb`` lists an expert's slots in slot order; the reference numbers them by creation (phyrank).

    Both index the same slots, so an engine dispatching over ``log2phy[l, e, :logcnt]`` sees the same set.
    """
    from moebalance.eplb import rebalance_experts

    weight = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                       [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    t = Placement.from_eplb(phy2log, Cluster(num_nodes=2, gpus_per_node=4), num_experts=12).to_eplb()
    assert np.array_equal(t.phy2log, phy2log) and np.array_equal(t.logcnt, logcnt)
    assert np.array_equal(np.sort(t.log2phy, axis=2), np.sort(log2phy, axis=2))
    real = t.log2phy[t.log2phy >= 0]
    assert real.size == 2 * 16
    # in slot order: each expert's list is increasing
    for layer in range(2):
        for e in range(12):
            slots = t.log2phy[layer, e, : t.logcnt[layer, e]]
            assert np.all(np.diff(slots) > 0)


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d.update(version=True), "version"),
        (lambda d: d.update(version=1.0), "version"),
        (lambda d: d.update(policy=["x"]), "'policy' must be a string"),
        (lambda d: d.update(weights=[[[0.0, 0.0], [1.0, 1.0]]]), "expert 0 a total share of 0"),
    ],
)
def test_more_bad_plan_documents(mutate, fragment: str) -> None:
    doc = Placement([[[0, 1], [2, 3]]], 4, C12).to_json_dict()
    mutate(doc)
    with pytest.raises(PlanError, match=fragment):
        Placement.from_json_dict(doc)


def test_deeply_nested_plan_file(tmp_path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000)
    with pytest.raises(PlanError, match=r"nests too deeply|not valid JSON"):
        read_plan(path)
