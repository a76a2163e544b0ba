"""Transfer schedules of plan changes (cost/transfer.py) and migration-aware re-planning (algorithms/migration.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement
from moebalance.cost.transfer import colour_transfers, schedule_transfers

# 450e6 bytes: 1 ms over NVLink 4 (450 GB/s), 9 ms over one 400 Gb/s NIC (50 GB/s)
MB450 = 450_000_000


def _plan(rows: list, num_experts: int, cluster: Cluster) -> Placement:
    return Placement(rows, num_experts, cluster)


# ----- transfer schedules ------------------------------------------------------------------------------------
def test_two_gpu_move_one_node() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    # layer 0: GPU 0 receives 2 (from GPU 1), GPU 1 receives 1 (from GPU 0)
    # layer 1: the two GPUs swap everything: GPU 0 receives 2 and 3, GPU 1 receives 0 and 1
    prev = _plan([[[0, 1], [2, 3]], [[0, 1], [2, 3]]], 4, c)
    new = _plan([[[0, 2], [1, 3]], [[2, 3], [0, 1]]], 4, c)
    s = schedule_transfers(prev, new, MB450, c)
    # each GPU sends 3 and receives 3 -> 3 rounds (König); each round 1 ms on NVLink
    assert s.rounds == 3
    assert s.moved_experts == 6 and s.moved_bytes == 6 * MB450
    np.testing.assert_allclose(s.per_round_seconds, [1e-3] * 3)
    assert s.seconds == pytest.approx(3e-3)
    # layer 1 only: 2 sends / receives per GPU -> 2 rounds
    s1 = schedule_transfers(prev, new, MB450, c, layers=[1])
    assert (s1.rounds, s1.moved_experts) == (2, 4)
    assert s1.seconds == pytest.approx(2e-3)


def test_two_gpu_move_across_nodes() -> None:
    c = Cluster(num_nodes=2, gpus_per_node=1)
    prev = _plan([[[0, 1], [2, 3]]], 4, c)
    new = _plan([[[0, 2], [1, 3]]], 4, c)
    s = schedule_transfers(prev, new, MB450, c)
    # one copy each way, in one round, over the 50 GB/s NIC: 9 ms
    assert (s.rounds, s.moved_experts) == (1, 2)
    assert s.seconds == pytest.approx(9e-3)


def test_four_gpu_move_two_nodes() -> None:
    c = Cluster(num_nodes=2, gpus_per_node=2)  # GPUs 0, 1 on node 0; 2, 3 on node 1
    prev = _plan([[[0], [1], [2], [3]]], 4, c)
    new = _plan([[[0, 1], [1, 0], [2, 0], [3, 0]]], 4, c)
    s = schedule_transfers(prev, new, MB450, c)
    # GPU 0 receives 1 from GPU 1 (1 ms); GPUs 1, 2, 3 receive expert 0, held only by GPU 0: GPU 0 sends 3 copies
    # -> 3 rounds: one holds GPU 0 -> 1 (1 ms, with GPU 1 -> 0 or not), two hold GPU 0 -> 2 and 0 -> 3 (9 ms each)
    assert (s.rounds, s.moved_experts) == (3, 4)
    np.testing.assert_allclose(sorted(s.per_round_seconds), [1e-3, 9e-3, 9e-3])
    assert s.seconds == pytest.approx(19e-3)


def test_four_gpu_move_prefers_a_source_on_the_node() -> None:
    c = Cluster(num_nodes=2, gpus_per_node=2)
    # expert 0 is on GPU 0 (node 0) and GPU 3 (node 1): GPU 1 gets it from GPU 0, GPU 2 from GPU 3; GPU 0 gets 1
    # from GPU 1 and GPU 3 gets 2 from GPU 2 -> every GPU sends one and receives one, all on NVLink: 1 round, 1 ms
    prev = _plan([[[0], [1], [2], [0]]], 3, c)
    new = _plan([[[1], [0], [0], [2]]], 3, c)
    s = schedule_transfers(prev, new, MB450, c)
    assert (s.rounds, s.moved_experts) == (1, 4)
    assert s.seconds == pytest.approx(1e-3)


def test_nothing_moves() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    prev = _plan([[[0, 1], [2, 3]]], 4, c)
    # same sets, other slot order, and a duplicate of a held expert (cloned locally): nothing on the wire
    s = schedule_transfers(prev, _plan([[[1, 0, 0], [3, 2]]], 4, c), MB450, c)
    assert (s.rounds, s.seconds, s.moved_experts, s.moved_bytes) == (0, 0.0, 0, 0)
    assert s.per_round_seconds.shape == (0,)


def test_schedule_refusals() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    prev = _plan([[[0], [1]]], 2, c)
    new = _plan([[[1], [0]]], 2, c)
    with pytest.raises(PlanError, match="same model and cluster"):
        schedule_transfers(prev, _plan([[[0], [1]], [[0], [1]]], 2, c), 1, c)
    with pytest.raises(PlanError, match="cluster has 4 GPUs"):
        schedule_transfers(prev, new, 1, Cluster(num_nodes=1, gpus_per_node=4))
    with pytest.raises(InputError, match="bytes_per_expert"):
        schedule_transfers(prev, new, -1, c)
    with pytest.raises(PlanError, match="layer 3 is not a plan layer"):
        schedule_transfers(prev, new, 1, c, layers=[3])
    # GPU 0 is lost: expert 0 (only on GPU 0) cannot be sent to GPU 1
    with pytest.raises(PlanError, match="expert 0 of layer 0 has no copy"):
        schedule_transfers(prev, new, 1, c, lost=[0])


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=80))
def test_colouring_is_a_minimal_proper_edge_colouring(g: int, pairs: list[tuple[int, int]]) -> None:
    edges = [(a % g, b % g) for a, b in pairs if a % g != b % g]
    src = np.array([a for a, _ in edges], dtype=np.int64)
    dst = np.array([b for _, b in edges], dtype=np.int64)
    degree = max(np.bincount(src, minlength=g).max(), np.bincount(dst, minlength=g).max()) if edges else 0
    colour = colour_transfers(src, dst, g, max(int(degree), 1))
    assert colour.shape == src.shape
    if edges:
        assert colour.min() >= 0 and colour.max() < degree
    # a proper colouring: no GPU sends twice or receives twice in a round
    assert len(set(zip(colour.tolist(), src.tolist(), strict=True))) == len(edges)
    assert len(set(zip(colour.tolist(), dst.tolist(), strict=True))) == len(edges)


# ----- align ------------------------------------------------------------------------------------------------
from moebalance.algorithms.migration import align, bounded, in_place_order  # noqa: E402


def _kept(previous: Placement, new: Placement) -> int:
    """(layer, GPU, expert) triples held before and after: what does not move."""
    return int(((previous.copies > 0) & (new.copies > 0)).sum())


def _slot_kept(previous: Placement, new: Placement) -> int:
    return sum(a == b for pl, nl in zip(previous.gpu_experts, new.gpu_experts, strict=True)
               for pr, nr in zip(pl, nl, strict=True) for a, b in zip(pr, nr, strict=False))


def _loads(plan: Placement, w: np.ndarray) -> np.ndarray:
    """``[L, G]`` GPU loads with each expert's load split evenly over the GPUs that hold it."""
    has = plan.copies > 0
    return np.einsum("le,leg->lg", w / has.sum(axis=2), has)


def test_in_place_order() -> None:
    # 4 keeps slot 0, 9 slot 2, the new expert 1 fills slot 1
    assert in_place_order([4, 7, 9], [9, 1, 4]) == [2, 1, 0]
    # a shorter row: 9 sat in slot 2, which is gone, so it fills the free slot 1
    assert in_place_order([4, 7, 9], [9, 4]) == [1, 0]


def test_align_rotation_is_not_the_identity() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=3)
    prev = _plan([[[0, 1], [2, 3], [4, 5]]], 6, c)
    fresh = _plan([[[5, 4], [1, 0], [3, 2]]], 6, c)
    # fresh set j onto GPU (j + 1) mod 3 keeps all 6 experts (the identity keeps 0), each in its previous slot
    out = align(prev, fresh)
    assert [list(r) for r in out.gpu_experts[0]] == [[0, 1], [2, 3], [4, 5]]
    assert schedule_transfers(prev, out, 1, c).moved_experts == 0
    assert schedule_transfers(prev, fresh, 1, c).moved_experts == 6
    assert out.params["migration"] == "aligned"


def test_align_keeps_slot_counts() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    prev = _plan([[[0, 1, 2], [3]]], 4, c)
    fresh = _plan([[[3], [2, 0, 1]]], 4, c)
    # the sets differ in size, so they cannot trade GPUs: GPU 0 keeps 1 slot (fresh's), 3 moves in, 0-2 move out;
    # GPU 1 held only 3, so nothing of [2, 0, 1] has a previous slot and fresh's order stays
    assert [list(r) for r in align(prev, fresh).gpu_experts[0]] == [[3], [2, 0, 1]]
    # matched to the previous slots instead, nothing moves
    out = align(prev, fresh, match_previous_slots=True)
    assert [list(r) for r in out.gpu_experts[0]] == [[0, 1, 2], [3]]
    with pytest.raises(PlanError, match="cannot take"):
        align(_plan([[[0, 1], [2, 3]]], 4, c), fresh, match_previous_slots=True)


def test_align_keep_nodes_moves_whole_nodes() -> None:
    c = Cluster(num_nodes=2, gpus_per_node=2)
    prev = _plan([[[0], [1], [2], [3]]], 4, c)
    fresh = _plan([[[3], [0], [1], [2]]], 4, c)
    # free: every expert back on its GPU. Node blocks kept: fresh node {3, 0} onto a node and {1, 2} onto the
    # other; either way one expert per node stays (0 on GPU 0 and 2 on GPU 2, or 1 on GPU 1 and 3 on GPU 3): 2
    assert _kept(prev, align(prev, fresh)) == 4
    out = align(prev, fresh, keep_nodes=True)
    assert _kept(prev, out) == 2
    nodes = sorted(sorted(e for g in (0, 1) for e in out.gpu_experts[0][2 * n + g]) for n in (0, 1))
    assert nodes == [[0, 3], [1, 2]]


def test_align_carries_weights() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    prev = _plan([[[0, 1], [2, 0]]], 3, c)
    fresh = Placement([[[2, 0], [1, 0]]], 3, c, weights=[[[1.0, 0.25], [1.0, 0.75]]])
    out = align(prev, fresh)
    # GPU 0 takes [1, 0] (keeps 0 and 1) as [0, 1]; GPU 1 takes [2, 0] as is
    assert [list(r) for r in out.gpu_experts[0]] == [[0, 1], [2, 0]]
    assert out.weights is not None
    assert [list(r) for r in out.weights[0]] == [[0.75, 1.0], [1.0, 0.25]]


@st.composite
def _plan_pairs(draw: st.DrawFn, equal_slots: bool) -> tuple[Placement, Placement, np.ndarray]:
    nodes = draw(st.integers(1, 2))
    per = draw(st.integers(1, 3))
    G = nodes * per
    c = Cluster(num_nodes=nodes, gpus_per_node=per)
    L = draw(st.integers(1, 3))
    E = draw(st.integers(max(2, G), 2 * G + 2))
    slots = [-(-E // G) + draw(st.integers(0, 1)) for _ in range(L)]

    def one() -> list:
        rows = []
        for S in slots:
            if equal_slots:  # S slots per GPU (the same in both plans), replicas on distinct GPUs
                perm = draw(st.permutations(range(E)))
                row: list[list[int]] = [[] for _ in range(G)]
                for k, e in enumerate(perm):
                    row[k % G].append(e)
                for g in range(G):
                    spare = [e for e in range(E) if e not in row[g]]
                    while len(row[g]) < S and spare:
                        row[g].append(spare.pop(draw(st.integers(0, len(spare) - 1))))
            else:
                owner = draw(st.lists(st.integers(0, G - 1), min_size=E + G, max_size=E + G))
                ids = list(range(E)) + draw(st.lists(st.integers(0, E - 1), min_size=G, max_size=G))
                row = [[e for e, o in zip(ids, owner, strict=True) if o == g] for g in range(G)]
            rows.append(row)
        return rows

    w = np.asarray(draw(st.lists(st.integers(0, 50), min_size=L * E, max_size=L * E)), dtype=np.float64)
    return _plan(one(), E, c), _plan(one(), E, c), w.reshape(L, E)


@settings(max_examples=80, deadline=None)
@given(_plan_pairs(equal_slots=False), st.booleans())
def test_align_properties(pair: tuple[Placement, Placement, np.ndarray], keep_nodes: bool) -> None:
    prev, fresh, w = pair
    out = align(prev, fresh, keep_nodes=keep_nodes)
    # a relabelling of GPUs per layer: the same sets, the same slots per GPU, the same balance
    np.testing.assert_array_equal(out.slots(), fresh.slots())
    for lo, lf in zip(out.gpu_experts, fresh.gpu_experts, strict=True):
        assert sorted(sorted(r) for r in lo) == sorted(sorted(r) for r in lf)
    np.testing.assert_allclose(np.sort(_loads(out, w), axis=1), np.sort(_loads(fresh, w), axis=1))
    # at least as many experts stay as with the fresh plan laid out by GPU index (which is also what vLLM's
    # preserve_intragpu_slots keeps: it only reorders slots within a GPU)
    assert _kept(prev, out) >= _kept(prev, fresh)
    assert schedule_transfers(prev, out, 1, prev.cluster).moved_experts <= \
        schedule_transfers(prev, fresh, 1, prev.cluster).moved_experts


@settings(max_examples=60, deadline=None)
@given(_plan_pairs(equal_slots=True))
def test_align_keeps_more_slots_than_preserve_intragpu_slots(pair: tuple[Placement, Placement, np.ndarray]) -> None:
    prev, fresh, _ = pair
    # vLLM's rule: the fresh plan's GPU order, each GPU's kept experts in their previous slots
    rule = _plan([[[r[k] for k in in_place_order(p, r)] for p, r in zip(pl, fl, strict=True)]
                  for pl, fl in zip(prev.gpu_experts, fresh.gpu_experts, strict=True)], fresh.num_experts,
                 fresh.cluster)
    out = align(prev, fresh)
    assert _slot_kept(prev, out) >= _slot_kept(prev, rule)
    assert _kept(prev, out) >= _kept(prev, rule)


# ----- bounded ----------------------------------------------------------------------------------------------
def test_bounded_takes_the_move_that_balances() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    prev = _plan([[[0, 1, 2, 3], [0, 1, 4, 5]]], 6, c)
    fresh = _plan([[[0, 1, 2, 3], [2, 3, 4, 5]]], 6, c)
    load = np.array([[0, 0, 10, 0, 0, 0]])
    # only expert 2 has load: on GPU 0 alone the loads (over the mean) are [2, 0]; receiving 2 on GPU 1 makes them
    # [1, 1], receiving 3 changes nothing. With one move per GPU, GPU 1 takes 2 (in place of 0 or 1)
    step = bounded(prev, fresh, 1, load)
    row = step.gpu_experts[0][1]
    assert 2 in row and 3 not in row and len({0, 1} & set(row)) == 1
    assert list(step.gpu_experts[0][0]) == [0, 1, 2, 3]
    # the next re-plan finishes: GPU 1 holds the fresh set
    assert sorted(bounded(step, fresh, 1, load).gpu_experts[0][1]) == [2, 3, 4, 5]
    assert bounded(prev, fresh, 0, load).gpu_experts == prev.gpu_experts


def test_bounded_swaps_single_copies_together() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    prev = _plan([[[0, 1], [2, 3]]], 4, c)
    fresh = _plan([[[0, 2], [1, 3]]], 4, c)
    # 1 and 2 have one copy each: neither move alone keeps every expert placed; the pair does, one move per GPU
    out = bounded(prev, fresh, 1, np.ones((1, 4)))
    assert sorted(sorted(r) for r in out.gpu_experts[0]) == [[0, 2], [1, 3]]


def test_bounded_refusals() -> None:
    c = Cluster(num_nodes=1, gpus_per_node=2)
    prev = _plan([[[0, 1], [2, 3]]], 4, c)
    with pytest.raises(InputError, match="max_moves"):
        bounded(prev, prev, -1, np.ones((1, 4)))
    with pytest.raises(InputError, match=r"shape \(1, 3\)"):
        bounded(prev, prev, 1, np.ones((1, 3)))


@settings(max_examples=60, deadline=None)
@given(_plan_pairs(equal_slots=True), st.integers(1, 3))
def test_bounded_properties(pair: tuple[Placement, Placement, np.ndarray], m: int) -> None:
    prev, fresh, w = pair
    target = align(prev, fresh, match_previous_slots=True)
    cur = prev
    for _ in range(target.num_layers * target.max_slots_per_gpu * 2 + 2):
        nxt = bounded(cur, fresh, m, w)
        np.testing.assert_array_equal(nxt.slots(), prev.slots())
        # never more than m copies received per GPU, summed over layers
        received = ((nxt.copies > 0) & (cur.copies == 0)).sum(axis=(0, 1))
        assert received.max() <= m
        if nxt.gpu_experts == cur.gpu_experts:
            break
        cur = nxt
    # repeated re-plans reach the aligned fresh plan's sets
    for lc, lt in zip(cur.gpu_experts, target.gpu_experts, strict=True):
        assert [sorted(r) for r in lc] == [sorted(r) for r in lt]


# ----- plan --previous ---------------------------------------------------------------------------------------
from pathlib import Path  # noqa: E402

from conftest import assert_user_error, run_cli  # noqa: E402

from moebalance.core.plan import read_plan  # noqa: E402


def _load(path: Path, seed: int, shape: tuple[int, int] = (26, 64)) -> Path:
    rng = np.random.default_rng(seed)
    np.save(path, rng.integers(1, 1000, size=shape).astype(np.int64))
    return path


def _plan_cli(load: Path, out: Path, *extra: object) -> list[object]:
    return ["plan", "--load", load, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 4, "--slots-per-gpu", 18,
            "--out", out, *extra]


def test_plan_previous_aligned_bounded_fresh(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = _load(tmp_path / "old.npy", 0), _load(tmp_path / "new.npy", 1)
    assert run_cli(_plan_cli(old, tmp_path / "prev.json"), capsys)[0] == 0
    prev = read_plan(tmp_path / "prev.json")
    moved = {}
    for mode, extra in (("fresh", []), ("aligned", []), ("bounded", ["--max-moves", 3])):
        out = tmp_path / f"{mode}.json"
        rc, text, err = run_cli(_plan_cli(new, out, "--previous", tmp_path / "prev.json", "--migration", mode,
                                          "--model", "deepseek-v2-lite", *extra), capsys)
        assert rc == 0, err
        plan = read_plan(out)
        assert plan.params["migration"] == mode
        s = schedule_transfers(prev, plan, 17301504, plan.cluster)  # DeepSeek-V2-Lite: 17,301,504 bytes per expert
        line = next(x for x in text.splitlines() if x.startswith("migration:"))
        assert f"{s.moved_experts} experts moved" in line and f"{s.rounds} transfer rounds" in line
        assert f"{s.moved_bytes / 2**30:.2f} GiB of DeepSeek-V2-Lite (bf16, as served)" in line
        moved[mode] = (s.moved_experts, ((plan.copies > 0) & (prev.copies == 0)).sum(axis=(0, 1)).max())
    assert moved["aligned"][0] <= moved["fresh"][0]
    assert moved["bounded"][1] <= 3  # per GPU, over the 26 layers
    # without a model the line says how to get the GiB; aligned is the default
    rc, text, _ = run_cli(_plan_cli(new, tmp_path / "d.json", "--previous", tmp_path / "prev.json"), capsys)
    assert rc == 0 and "give --model" in text
    assert read_plan(tmp_path / "d.json").params["migration"] == "aligned"


def test_plan_previous_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load = _load(tmp_path / "l.npy", 0)
    assert run_cli(_plan_cli(_load(tmp_path / "small.npy", 0, (2, 8)), tmp_path / "small.json"), capsys)[0] == 0
    assert run_cli(_plan_cli(load, tmp_path / "prev.json"), capsys)[0] == 0
    out = tmp_path / "o.json"
    assert_user_error(_plan_cli(load, out, "--previous", tmp_path / "small.json"), capsys,
                      "2 layers x 8 experts", "same model and cluster")
    assert_user_error(_plan_cli(load, out, "--migration", "aligned"), capsys, "--migration needs --previous")
    assert_user_error(_plan_cli(load, out, "--previous", tmp_path / "prev.json", "--migration", "bounded"), capsys,
                      "--max-moves")
    assert_user_error(_plan_cli(load, out, "--previous", tmp_path / "prev.json", "--max-moves", 2), capsys,
                      "--max-moves is used only by --migration bounded")
    assert_user_error(_plan_cli(load, out, "--previous", tmp_path / "missing.json"), capsys, "missing.json")
    assert not out.exists()


def test_plan_previous_takes_migration_as_set_items(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The contract's spelling, ``--set migration=bounded --set max_moves=3``, is the flags' plan exactly."""
    old, new = _load(tmp_path / "old.npy", 0), _load(tmp_path / "new.npy", 1)
    assert run_cli(_plan_cli(old, tmp_path / "prev.json"), capsys)[0] == 0
    by_flags, by_items = tmp_path / "flags.json", tmp_path / "items.json"
    assert run_cli(_plan_cli(new, by_flags, "--previous", tmp_path / "prev.json", "--migration", "bounded",
                             "--max-moves", 3), capsys)[0] == 0
    rc, _, err = run_cli(_plan_cli(new, by_items, "--previous", tmp_path / "prev.json", "--set", "migration=bounded",
                                   "--set", "max_moves=3"), capsys)
    assert rc == 0, err
    assert read_plan(by_items).gpu_experts == read_plan(by_flags).gpu_experts
    assert read_plan(by_items).params["migration"] == "bounded"
    out = tmp_path / "o.json"
    assert_user_error(_plan_cli(new, out, "--previous", tmp_path / "prev.json", "--set", "migration=sideways"), capsys,
                      "migration=sideways", "fresh, aligned, bounded")
    assert_user_error(_plan_cli(new, out, "--previous", tmp_path / "prev.json", "--migration", "aligned", "--set",
                                "migration=bounded"), capsys, "disagree")
    assert not out.exists()


def test_moves_are_reported_in_the_checkpoints_own_bytes() -> None:
    """plan --previous prices what a copy moves as the model's checkpoint holds its experts: DeepSeek-V3's in FP8
    (1 byte a weight), not bf16."""
    from moebalance.app.commands.plan import report_moves
    from moebalance.core.load import LoadMatrix
    from moebalance.models import get_model

    v3 = get_model("deepseek-v3")
    cluster = Cluster(num_nodes=1, gpus_per_node=8)
    blocks = [[list(range(32 * g, 32 * g + 32)) for g in range(8)]] * 58
    swapped = [[[*range(32 * g, 32 * g + 31), (32 * g + 63) % 256] for g in range(8)]] * 58
    prev, plan = Placement(blocks, 256, cluster), Placement(swapped, 256, cluster)
    load = LoadMatrix(np.ones((1, 58, 256), dtype=np.int64), preset="deepseek-v3")
    line = report_moves(prev, plan, load, cluster)
    s = schedule_transfers(prev, plan, v3.expert_params(), cluster)  # 1 byte a weight
    assert f"{s.moved_experts} experts moved, {s.moved_bytes / 2**30:.2f} GiB of DeepSeek-V3 (fp8, as served)" in line
    assert s.moved_experts == 8 * 58
