"""Plans for the worst of several workloads: ``algorithms/robust.py``, ``eplb`` / ``craft`` with
``objective=worst``, and ``moebalance plan`` with several ``--load``.

What is true of the algorithms, and what these tests check:
- replication (``replicate_worst``) is optimal for the bound it minimises, ``max_e max_k w[k, e] / r_e``:
  checked against every replica vector on small cases;
- packing (``pack_worst``) without the equal-slot constraint obeys the list-scheduling bound
  ``peak <= sum_k T_k / G + max item`` (so at most ``K + 1`` times the optimum): proven in
  ``test_pack_worst_obeys_the_list_scheduling_bound``, checked on random cases and against brute force;
- the whole EPLB pipeline with equal slots per GPU is a heuristic with no constant bound proven: on 120 seeded
  tiny cases it is optimal (among plans without same-GPU copies) in 89 and never more than 1.271 times the
  optimum; the test keeps it there;
- CRAFT's allocation for the worst workload is never above the optimum and the optimum never above its
  recorded bound; on 300 seeded tables it is optimal in 286.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_user_error, run_cli

from moebalance.algorithms.craft import BenefitTable, allocate_replicas
from moebalance.algorithms.eplb import rebalance_experts
from moebalance.algorithms.robust import (
    WorstTable,
    allocate_worst,
    eplb_worst,
    normalise,
    pack_worst,
    plan_layers_worst,
    replicate_worst,
    workload_balancedness,
    workload_starts,
)
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import MoebalanceError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement, read_plan
from moebalance.policies import make_plan
from moebalance.routing.simulate import evaluate

# ----- hand-derived cases ------------------------------------------------------------------------------------------

# One layer, experts 0-2, one node of 2 GPUs with 2 slots each (one extra copy).
# Workload A (100 tokens) = [60, 30, 10], workload B (10 tokens) = [1, 8, 1].
A = np.array([[[60, 30, 10]]])
B = np.array([[[1, 8, 1]]])
TWO = Cluster(num_nodes=1, gpus_per_node=2)


def test_eplb_sum_and_worst_differ_on_a_hand_derived_case() -> None:
    # sum = [61, 38, 11]: EPLB copies expert 0 (61 > 38); copies 38 (e1), 30.5, 30.5 (e0), 11 (e2), heaviest first
    # onto the lighter GPU with room: e1 -> GPU 0, e0 -> GPU 1, e0 -> GPU 1 (30.5 < 38), e2 -> GPU 0 (GPU 1 full).
    # GPU 0 = {1, 2}, GPU 1 = {0, 0}. A: 40 | 60, balancedness 50 / 60 = 0.833; B: 9 | 1, 5 / 9 = 0.556.
    load = LoadMatrix(np.concatenate([A, B]))
    plan, _ = make_plan("eplb", load, TWO, Budget(slots_per_gpu=2), objective="sum", workload_batches=[1, 1])
    assert [sorted(g) for g in plan.gpu_experts[0]] == [[1, 2], [0, 0]]
    assert evaluate(plan, LoadMatrix(A)).balancedness == pytest.approx(50 / 60)
    assert evaluate(plan, LoadMatrix(B)).balancedness == pytest.approx(5 / 9)
    # worst: normalised A = [.6, .3, .1], B = [.1, .8, .1]; the largest per expert [.6, .8, .1]: copy expert 1.
    # Copies by their largest share: e0 (.6, .1), e1 (.15, .4) twice, e2 (.1, .1). e0 -> GPU 0 (tie, lowest);
    # e1 -> GPU 1 (peak .4 < .75); the second e1 avoids GPU 1, which holds e1 -> GPU 0; e2 -> GPU 1 (room).
    # GPU 0 = {0, 1}: A 60 + 15 = 75, B 1 + 4 = 5; GPU 1 = {1, 2}: A 15 + 10 = 25, B 4 + 1 = 5.
    # A: 50 / 75 = 0.667, B: 1.0. Worst 0.667 > the sum plan's 0.556 (and optimal: copying expert 0 leaves B's
    # expert 1 alone on a GPU, 0.625 at best; {0, 2} | {1, 1} gives B 0.625).
    plan, _ = make_plan("eplb", load, TWO, Budget(slots_per_gpu=2), objective="worst", workload_batches=[1, 1])
    assert [sorted(g) for g in plan.gpu_experts[0]] == [[0, 1], [1, 2]]
    assert evaluate(plan, LoadMatrix(A)).balancedness == pytest.approx(50 / 75)
    assert evaluate(plan, LoadMatrix(B)).balancedness == pytest.approx(1.0)
    assert plan.params["objective"] == "worst" and plan.params["workload_batches"] == [1, 1]
    assert not plan.warnings  # no second copy on one GPU


def test_allocate_worst_on_a_hand_derived_table() -> None:
    # Two layers, one extra replica to give (ladder [1]). Gains: A gains .3 in layer 0, B gains .2 in layer 1.
    # Bases: A [.5, .5], B [.5, .4]. Scores (mean over layers):
    #   replica in layer 0: A .5 + .3 / 2 = .65, B .45 -> worst .45
    #   replica in layer 1: A .5,                B .45 + .2 / 2 = .55 -> worst .5 (the optimum)
    # Alg. 2 on the summed gains (.3 vs .2) takes layer 0; the worst objective takes layer 1.
    table = WorstTable(np.array([1]), np.array([[[0.3, 0.0]], [[0.0, 0.2]]]), np.array([[0.5, 0.5], [0.5, 0.4]]))
    summed = BenefitTable(np.array([1]), table.gain.sum(axis=0), table.base.sum(axis=0))
    assert allocate_replicas(summed, 1).tolist() == [1, 0]
    got = allocate_worst(table, 1)
    assert got.layer_replicas.tolist() == [0, 1]
    assert got.predicted == pytest.approx([0.5, 0.55])
    # the bound: min over weights of the best weighted score; at lam_A = .4 both allocations score .53
    assert 0.53 - 1e-9 <= got.bound <= 0.55 + 1e-9


# ----- brute force -------------------------------------------------------------------------------------------------

def test_replicate_worst_is_optimal_for_its_bound() -> None:
    rng = np.random.default_rng(3)
    for _ in range(60):
        K, E = int(rng.integers(2, 4)), int(rng.integers(2, 6))
        extra, cap = int(rng.integers(0, 6)), int(rng.integers(2, 5))
        if E * cap < E + extra:
            continue
        w = normalise(rng.integers(0, 50, size=(K, 1, E)))
        peak = w.max(axis=0)[0]
        counts = replicate_worst(w, extra, cap)[0]
        assert counts.sum() == E + extra and counts.max() <= cap
        best = min(float(np.max(peak / np.array(r))) for r in itertools.product(range(1, cap + 1), repeat=E)
                   if sum(r) == E + extra)
        assert np.max(peak / counts) == pytest.approx(best)


def _assign_peak(items: np.ndarray, bins: np.ndarray, num_bins: int) -> np.ndarray:
    """``items [K, N]``, ``bins [C, N]`` (every assignment) -> ``[C]`` largest load of any workload on any bin."""
    onehot = bins[:, :, None] == np.arange(num_bins)  # [C, N, G]
    return np.einsum("kn,cng->ckg", items, onehot).max(axis=(1, 2))


def test_pack_worst_obeys_the_list_scheduling_bound() -> None:
    # Proof: let item j be the last one put on the bin g* that ends with the peak (workload k*). When j was placed,
    # g* minimised max_k(load_k + v_kj) over all bins (no slot limit), so the peak is at most
    # min_h max_k load_k[h] + max_k v_kj <= min_h sum_k load_k[h] + a <= sum_k T_k / G + a, with T_k workload k's
    # total and a the largest item. The optimum is at least max_k T_k / G and at least a, so the greedy is within
    # K + 1 times it.
    rng = np.random.default_rng(5)
    for _ in range(80):
        K, N, G = int(rng.integers(2, 4)), int(rng.integers(1, 8)), int(rng.integers(2, 4))
        items = rng.random((K, 1, N)) * rng.integers(1, 4, size=(K, 1, 1))
        got = pack_worst(items, np.full((1, G), N))[0]
        peak = _assign_peak(items[:, 0], got[None], G)[0]
        assert peak <= items.sum(axis=2).sum() / G + items.max() + 1e-12
        if G ** N <= 4096:
            every = np.array(list(itertools.product(range(G), repeat=N)))
            assert peak <= (K + 1) * _assign_peak(items[:, 0], every, G).min() + 1e-12


def _eplb_peak(w: np.ndarray, phy: np.ndarray, G: int) -> np.ndarray:
    """``w [K, E]`` normalised, ``phy [C, P]`` plans -> ``[C]`` worst ``G x`` normalised GPU load (imbalance)."""
    C, P = phy.shape
    counts = (phy[:, :, None] == np.arange(w.shape[1])).sum(axis=1)
    share = w[:, phy] / np.take_along_axis(counts, phy, axis=1)[None]
    return share.reshape(w.shape[0], C, G, P // G).sum(axis=-1).max(axis=(0, 2)) * G


def test_eplb_worst_against_brute_force() -> None:
    rng = np.random.default_rng(7)
    ratios: list[float] = []
    while len(ratios) < 120:
        E, G, s = int(rng.integers(2, 6)), int(rng.integers(2, 4)), int(rng.integers(1, 4))
        s = min(s, E)
        P = s * G
        if P < E or E ** P > 5000:
            continue
        K = int(rng.integers(2, 4))
        W = rng.integers(0, 30, size=(K, 1, E)) * rng.integers(1, 100, size=(K, 1, 1))
        W[:, 0, 0] += 1
        w = normalise(W)[:, 0]
        every = np.array(list(itertools.product(range(E), repeat=P)))
        legal = (every[:, :, None] == np.arange(E)).any(axis=1).all(axis=1)  # every expert placed
        per_gpu = np.sort(every.reshape(len(every), G, s), axis=-1)
        legal &= np.all(per_gpu[..., 1:] != per_gpu[..., :-1], axis=(1, 2))  # no second copy on one GPU
        best = _eplb_peak(w, every[legal], G).min()
        phy = eplb_worst(W, num_replicas=P, num_groups=1, num_nodes=1, num_gpus=G)
        got = _eplb_peak(w, phy, G)[0]
        assert got >= best - 1e-12  # the enumeration holds the greedy's plan
        ratios.append(got / best)
    r = np.array(ratios)
    assert (r <= 1 + 1e-9).sum() >= 89 and r.max() <= 1.272, (int((r <= 1 + 1e-9).sum()), r.max())


def test_allocate_worst_against_brute_force() -> None:
    rng = np.random.default_rng(1)
    optimal = 0
    for _ in range(300):
        K, L = int(rng.integers(2, 4)), int(rng.integers(2, 6))
        ladder = np.array([1, 2, 4][: int(rng.integers(1, 4))])
        table = WorstTable(ladder, np.sort(rng.random((K, ladder.size, L)) * 0.3, axis=1), rng.random((K, L)) * 0.5 + 0.3)
        C = int(rng.integers(1, L * ladder.max() + 1))
        xs = np.array(list(itertools.product([0, *ladder.tolist()], repeat=L)))
        # Alg. 2 spends exactly C where some allocation does, else the best total below it
        feasible = xs[xs.sum(axis=1) == C] if (xs.sum(axis=1) == C).any() else xs[xs.sum(axis=1) <= C]
        best = max(float(table.scores(x).min()) for x in feasible)
        got = allocate_worst(table, C)
        assert got.layer_replicas.tolist() in feasible.tolist()
        assert got.predicted.min() <= best + 1e-12 <= got.bound + 2e-12
        optimal += got.predicted.min() >= best - 1e-12
    assert optimal >= 286


# ----- properties --------------------------------------------------------------------------------------------------

def _random_load(rng: np.random.Generator, K: int, L: int, E: int, batches: int = 2) -> tuple[LoadMatrix, list[int]]:
    skews = [rng.dirichlet(np.full(E, 0.5), size=L) for _ in range(K)]
    parts = [rng.poisson(400 * skew, size=(batches, L, E)) + (np.arange(E) == 0) for skew in skews]
    return LoadMatrix(np.concatenate(parts)), [batches] * K


def test_objective_sum_is_todays_plan() -> None:
    rng = np.random.default_rng(11)
    cluster = Cluster(num_nodes=2, gpus_per_node=2)
    for _ in range(4):
        load, sizes = _random_load(rng, 2, 3, 8)
        base, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=3))
        reference = Placement.from_eplb(rebalance_experts(load.total(), 12, 1, 2, 4)[0], cluster, num_experts=8)
        assert base.gpu_experts == reference.gpu_experts
        # CRAFT's Alg. 2 objectives leave EPLB on the summed load (one --set for several policies)
        for extra in ({"objective": "sum"}, {"objective": "sum", "workload_batches": sizes}, {"objective": "weighted"}):
            plan, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=3), **extra)
            assert plan.gpu_experts == base.gpu_experts
        assert "objective" not in base.params and "workload_batches" not in base.params
        base, _ = make_plan("craft", load, cluster, Budget(replicas_per_gpu=2))
        for extra in ({"objective": "sum"}, {"objective": "sum", "workload_batches": sizes}):
            plan, _ = make_plan("craft", load, cluster, Budget(replicas_per_gpu=2), **extra)
            assert plan.gpu_experts == base.gpu_experts
            assert plan.params["objective"] == "gain"  # Alg. 2's objective on the summed load, as before


def test_a_big_workload_does_not_dominate() -> None:
    # each workload is normalised by its total in each layer: scaling one by 1000 gives the same plan
    rng = np.random.default_rng(13)
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    load, sizes = _random_load(rng, 2, 3, 8, batches=1)
    scaled = LoadMatrix(load.counts * np.array([1, 1000])[:, None, None])
    for policy, budget in (("eplb", Budget(slots_per_gpu=3)), ("craft", Budget(replicas_per_gpu=2))):
        a, _ = make_plan(policy, load, cluster, budget, objective="worst", workload_batches=sizes)
        b, _ = make_plan(policy, scaled, cluster, budget, objective="worst", workload_batches=sizes)
        assert a.gpu_experts == b.gpu_experts


def test_worst_plans_keep_copies_apart_and_beat_the_sum_on_the_worst_workload_in_sample() -> None:
    rng = np.random.default_rng(17)
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    for _ in range(5):
        load, sizes = _random_load(rng, 3, 4, 12, batches=1)
        parts = [LoadMatrix(load.counts[k:k + 1]) for k in range(3)]
        worst, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=5), objective="worst", workload_batches=sizes)
        assert not worst.warnings
        for g in (g for layer in worst.gpu_experts for g in layer):
            assert len(set(g)) == len(g)
        # planned on one batch per workload, so in sample (on these seeds by 0.09 to 0.22; not a theorem: the plan
        # minimises each layer's worst ratio, the score averages balancedness over layers)
        summed, _ = make_plan("eplb", load, cluster, Budget(slots_per_gpu=5))
        assert min(evaluate(worst, p).balancedness for p in parts) > \
            min(evaluate(summed, p).balancedness for p in parts)


def test_eplb_worst_hierarchical_keeps_groups_on_nodes() -> None:
    rng = np.random.default_rng(19)
    W = rng.integers(0, 100, size=(2, 3, 16))
    phy = eplb_worst(W, num_replicas=24, num_groups=4, num_nodes=2, num_gpus=4)  # 12 slots per node, 6 per GPU
    for layer in phy:
        halves = [set(layer[:12].tolist()), set(layer[12:].tolist())]
        assert halves[0].isdisjoint(halves[1]) and halves[0] | halves[1] == set(range(16))
        for node in halves:  # whole groups of 4 consecutive experts
            assert {e // 4 for e in node} and all(len({e for e in node if e // 4 == grp}) == 4
                                                  for grp in {e // 4 for e in node})
        for gpu in layer.reshape(4, 6):
            assert len(set(gpu.tolist())) == 6


def test_workload_balancedness_matches_the_scorer() -> None:
    rng = np.random.default_rng(23)
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    load, sizes = _random_load(rng, 2, 3, 8, batches=3)
    starts = workload_starts(sizes, load.num_batches)
    w = normalise(np.add.reduceat(load.counts, starts[:-1], axis=0))
    _, gpu, expert = plan_layers_worst(w, np.array([2, 1, 0]), cluster.gpus_per_node, 4)
    got = workload_balancedness(load.counts, starts, gpu, expert, 4)
    plan = Placement([[sorted(expert[li][gpu[li] == g].tolist()) for g in range(4)] for li in range(3)], 8, cluster)
    for k in range(2):
        part = LoadMatrix(load.counts[starts[k]:starts[k + 1]])
        assert got[k] == pytest.approx(evaluate(plan, part).per_layer_balancedness)


@pytest.mark.parametrize(("params", "fragment"), [
    ({"objective": "max"}, "objective ('max') must be"),
    ({"objective": "worst"}, "two or more --load"),
    ({"objective": "worst", "workload_batches": [2]}, "two or more --load"),
    ({"objective": "worst", "workload_batches": [1, 2]}, "sum to 3 batches but the load has 2"),
    ({"workload_batches": [0, 2]}, "batch counts >= 1"),
    ({"workload_batches": "2,2"}, "batch counts >= 1"),
])
@pytest.mark.parametrize("policy", ["eplb", "craft"])
def test_config_errors_are_one_line(policy: str, params: dict[str, Any], fragment: str) -> None:
    load = LoadMatrix(np.concatenate([A, B]))
    budget = Budget(slots_per_gpu=2) if policy == "eplb" else Budget(replicas_per_gpu=1)
    with pytest.raises(MoebalanceError) as info:
        make_plan(policy, load, TWO, budget, **params)
    message = str(info.value)
    assert "\n" not in message
    if policy == "craft" and params == {"objective": "max"}:
        fragment = "objective ('max') must be 'gain', 'weighted', 'sum' or 'worst'"
    assert fragment in message


# ----- the command line --------------------------------------------------------------------------------------------

@pytest.fixture
def workloads(tmp_path: Path) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(29)
    a = rng.poisson(300 * rng.dirichlet(np.full(8, 0.4), size=2), size=(3, 2, 8)) + 1
    b = rng.poisson(30 * rng.dirichlet(np.full(8, 0.4), size=2), size=(2, 2, 8)) + 1
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    return tmp_path / "a.npy", tmp_path / "b.npy", a, b


CLUSTER_FLAGS = ["--nodes", 1, "--gpus-per-node", 4]


def test_cli_one_load_is_unchanged(workloads: tuple[Path, Path, np.ndarray, np.ndarray], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    a, _, counts, _ = workloads
    rc, out, err = run_cli(["plan", "--load", a, "--policy", "eplb", *CLUSTER_FLAGS, "--slots-per-gpu", 3,
                            "--out", tmp_path / "p.json"], capsys)
    assert rc == 0, err
    plan = read_plan(tmp_path / "p.json")
    api, _ = make_plan("eplb", LoadMatrix(counts), Cluster(num_nodes=1, gpus_per_node=4), Budget(slots_per_gpu=3))
    assert plan.gpu_experts == api.gpu_experts
    assert plan.params["planned_on_batches"] == "0:3"
    assert not {"objective", "workloads", "workload_batches"} & set(plan.params)
    assert "per workload" not in out


def test_cli_several_loads_sum_and_worst(workloads: tuple[Path, Path, np.ndarray, np.ndarray], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    a, b, ca, cb = workloads
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    both = LoadMatrix(np.concatenate([ca, cb]))
    for policy, budget, flag in (("eplb", Budget(slots_per_gpu=3), ["--slots-per-gpu", 3]),
                                 ("craft", Budget(replicas_per_gpu=2), ["--replicas-per-gpu", 2])):
        for objective in ("sum", "worst"):
            dest = tmp_path / f"{policy}-{objective}.json"
            rc, out, err = run_cli(["plan", "--load", a, "--load", b, "--policy", policy, *CLUSTER_FLAGS, *flag,
                                    "--set", f"objective={objective}", "--out", dest], capsys)
            assert rc == 0, err
            plan = read_plan(dest)
            api, _ = make_plan(policy, both, cluster, budget, objective=objective, workload_batches=[3, 2])
            assert plan.gpu_experts == api.gpu_experts
            doc = json.loads(dest.read_text())["params"]
            assert doc["workloads"] == [str(a), str(b)] and doc["workload_batches"] == [3, 2]
            assert doc["planned_on_batches"] == ["0:3", "0:2"]
            assert doc["objective"] == (objective if policy == "eplb" or objective == "worst" else "gain")
            # the per-workload table: each workload's in-sample balancedness, and the worst of them
            scores = [evaluate(plan, LoadMatrix(c)).balancedness for c in (ca, cb)]
            assert "per workload" in out and f"{scores[0]:.4f}" in out and f"{scores[1]:.4f}" in out
            worst_line = next(line for line in out.splitlines() if line.strip("│┃ ").startswith("worst "))
            assert f"{min(scores):.4f}" in worst_line


def test_cli_batches_apply_to_each_load(workloads: tuple[Path, Path, np.ndarray, np.ndarray], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    a, b, ca, cb = workloads
    rc, _, err = run_cli(["plan", "--load", a, "--load", b, "--policy", "greedy", *CLUSTER_FLAGS, "--slots-per-gpu",
                          2, "--batches", "1:2", "--out", tmp_path / "g.json"], capsys)
    assert rc == 0, err
    plan = read_plan(tmp_path / "g.json")
    api, _ = make_plan("greedy", LoadMatrix(np.concatenate([ca[1:2], cb[1:2]])), Cluster(num_nodes=1, gpus_per_node=4),
                       Budget(slots_per_gpu=2))
    assert plan.gpu_experts == api.gpu_experts
    assert plan.params["planned_on_batches"] == ["1:2", "1:2"] and plan.params["objective"] == "sum"


def test_cli_errors_are_one_line(workloads: tuple[Path, Path, np.ndarray, np.ndarray], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    a, b, _, _ = workloads
    np.save(tmp_path / "other.npy", np.ones((2, 3, 8), dtype=np.int64))
    base = ["--policy", "eplb", *CLUSTER_FLAGS, "--slots-per-gpu", 3, "--out", tmp_path / "x.json"]
    assert_user_error(["plan", "--load", a, *base, "--set", "objective=worst"], capsys, "two or more --load")
    assert_user_error(["plan", "--load", a, "--load", tmp_path / "other.npy", *base, "--set", "objective=worst"],
                      capsys, "[layers, experts] = [3, 8]", "give workloads of one model")
    assert_user_error(["plan", "--load", a, "--load", b, *base, "--set", "objective=max"], capsys,
                      "objective ('max') must be")
    assert_user_error(["plan", "--load", a, "--load", b, *base, "--set", "workload_batches=[3,2]"], capsys,
                      "give each workload as its own --load")
    assert_user_error(["plan", "--load", a, "--load", b, "--policy", "greedy", *CLUSTER_FLAGS, "--slots-per-gpu", 2,
                       "--set", "objective=worst", "--out", tmp_path / "x.json"], capsys, "no parameter 'objective'")
    assert not (tmp_path / "x.json").exists()


def test_concatenated_traces_keep_their_tokens() -> None:
    from moebalance.core.load import concatenate_loads
    from moebalance.core.trace import RoutingTrace

    rng = np.random.default_rng(31)

    def trace(tokens: int, batches: int) -> LoadMatrix:
        ids = np.stack([rng.permutation(8)[:2] for _ in range(tokens * 2)]).reshape(tokens, 2, 2)
        tr = RoutingTrace(ids, rng.integers(0, 4, tokens), np.sort(rng.integers(0, batches, tokens)), num_experts=8,
                          num_batches=batches)
        return LoadMatrix(tr.counts(), tr)

    a, b = trace(30, 3), trace(20, 2)
    both = concatenate_loads([a, b])
    assert both.trace is not None and both.num_batches == 5
    assert np.array_equal(both.counts, np.concatenate([a.counts, b.counts]))  # the loader recounts from the trace
    assert np.array_equal(both.trace.src_gpu, np.concatenate([a.trace.src_gpu, b.trace.src_gpu]))  # type: ignore[union-attr]
    # counts only where one of them has no trace
    mixed = concatenate_loads([a, LoadMatrix(b.counts)])
    assert mixed.trace is None and np.array_equal(mixed.counts, both.counts)
