"""Tests of moebalance.eplb: DeepSeek's README example, hand-derived cases, stored golden outputs for both
policies, validation and invariants.

Golden outputs (tests/data/eplb_golden.npz). The file holds, for 36 ``rebalance_experts`` calls
(integer, float, float32, all-zero, tie-heavy and odd-dtype loads; hierarchical and global policies; 1 to
64 GPUs), the input ``caseNN_weight`` and the expected ``caseNN_phy2log``, ``caseNN_log2phy`` and
``caseNN_logcnt``, with the call's arguments as JSON strings in ``params`` (row ``NN``); and, for four
weight matrices ``packNN_*``, expected outputs of the ``balanced_packing`` and ``replicate_experts`` kernels.
The expected outputs were computed once, with torch 2.13 on CPU, by a loop-based torch transcription of
``rebalance_experts`` from DeepSeek's published reference ``eplb.py`` (deepseek-ai/EPLB on GitHub),
whose results it reproduced on DeepSeek's README example. That transcription and the script that ran it
are no longer in the repository, so the file cannot be regenerated here; it is data, checked below for
self-consistency (shapes, counts, inverse maps) as well as compared with ``moebalance.algorithms.eplb``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moebalance.algorithms import eplb
from moebalance.core.errors import BudgetError, InputError, MoebalanceError

GOLDEN_PATH = Path(__file__).parent / "data" / "eplb_golden.npz"


def _load_golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN_PATH, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


GOLDEN = _load_golden()
GOLDEN_PARAMS: list[dict[str, Any]] = [json.loads(str(row)) for row in GOLDEN["params"]]
GOLDEN_PACKS = sorted({key[:6] for key in GOLDEN if key.startswith("pack")})


# DeepSeek EPLB README example: 2 layers, 12 experts in 4 groups, 16 slots, 2 nodes, 8 GPUs.
README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]
# Replica counts read off README_PHY2LOG (how often each expert appears in its row).
README_LOGCNT = [
    [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
    [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1],
]


def _assert_same(fast: tuple[torch.Tensor, ...], slow: tuple[torch.Tensor, ...]) -> None:
    assert len(fast) == len(slow)
    for got, want in zip(fast, slow, strict=True):
        assert got.dtype == want.dtype == torch.int64
        assert torch.equal(got, want), (got, want)


def _check_invariants(
    phy2log: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray, num_replicas: int
) -> None:
    num_layers, num_logical = logcnt.shape
    assert phy2log.shape == (num_layers, num_replicas)
    assert log2phy.shape == (num_layers, num_logical, logcnt.max())
    assert (logcnt >= 1).all()  # every logical expert has a slot
    assert (logcnt.sum(axis=1) == num_replicas).all()
    for layer in range(num_layers):
        assert np.array_equal(np.bincount(phy2log[layer], minlength=num_logical), logcnt[layer])
        for expert in range(num_logical):
            count = logcnt[layer, expert]
            slots = log2phy[layer, expert, :count]
            assert (log2phy[layer, expert, count:] == -1).all()
            assert len(set(slots.tolist())) == count
            assert (phy2log[layer, slots] == expert).all()


# ---------------------------------------------------------------------------------------------------
# The published example
# ---------------------------------------------------------------------------------------------------


def test_readme_example_torch_in_torch_out() -> None:
    phy2log, log2phy, logcnt = eplb.rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    for out in (phy2log, log2phy, logcnt):
        assert isinstance(out, torch.Tensor)
        assert out.dtype == torch.int64
        assert out.device.type == "cpu"
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == README_LOGCNT
    _check_invariants(phy2log.numpy(), log2phy.numpy(), logcnt.numpy(), 16)
    # Expert 5 of layer 0 sits in slots 0 and 2 (replica 0 and 1); expert 2 only in slot 11.
    assert log2phy[0, 5].tolist() == [0, 2]
    assert log2phy[0, 2].tolist() == [11, -1]


def test_readme_example_numpy_in_numpy_out() -> None:
    phy2log, log2phy, logcnt = eplb.rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    for out in (phy2log, log2phy, logcnt):
        assert isinstance(out, np.ndarray)
        assert out.dtype == np.int64
    assert phy2log.tolist() == README_PHY2LOG
    assert logcnt.tolist() == README_LOGCNT


def test_eplb_plan_matches_rebalance_experts() -> None:
    plan = eplb.eplb_plan(np.array(README_WEIGHT), num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert np.array_equal(plan.physical_to_logical, phy2log)
    assert np.array_equal(plan.logical_to_physical, log2phy)
    assert np.array_equal(plan.logical_count, logcnt)
    assert plan.replica_rank[0].tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0]
    # log2phy is phy2log/replica_rank inverted.
    for layer in range(2):
        for slot in range(16):
            expert, rank = plan.physical_to_logical[layer, slot], plan.replica_rank[layer, slot]
            assert plan.logical_to_physical[layer, expert, rank] == slot
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.logical_count = logcnt  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------
# Small cases derived by hand
# ---------------------------------------------------------------------------------------------------


def test_balanced_packing_by_hand() -> None:
    pack = eplb.balanced_packing

    # [4, 3, 2, 1] into 2 packs of 2. Heaviest first: 4 -> pack 0 (both empty, lowest index);
    # 3 -> pack 1 (0 < 4); 2 -> pack 1 (3 < 4, now 5, full); 1 -> pack 0 (4 < 5).
    index, rank = pack(torch.tensor([[4.0, 3.0, 2.0, 1.0]]), 2)
    assert index.tolist() == [[0, 1, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1]]

    # [10, 1, 1, 1, 1, 1] into 2 packs of 3: 10 -> pack 0; the first three 1s -> pack 1 (loads 1, 2,
    # 3, all below 10), which is then full, so the last two 1s must go to pack 0 despite its load.
    index, rank = pack(torch.tensor([[10.0, 1, 1, 1, 1, 1]]), 2)
    assert index.tolist() == [[0, 1, 1, 1, 0, 0]]
    assert rank.tolist() == [[0, 0, 1, 2, 1, 2]]

    # Equal weights (short rows sort ties by index): packs alternate 0, 1, 0, 1, since on equal
    # loads the lower pack index wins.
    index, rank = pack(torch.ones(1, 4), 2)
    assert index.tolist() == [[0, 1, 0, 1]]
    assert rank.tolist() == [[0, 0, 1, 1]]

    # One item per pack: item i goes to pack i whatever the weights.
    index, rank = pack(torch.tensor([[1.0, 5.0, 3.0]]), 3)
    assert index.tolist() == [[0, 1, 2]]
    assert rank.tolist() == [[0, 0, 0]]


def test_replicate_experts_by_hand() -> None:
    replicate = eplb.replicate_experts
    # [6, 3, 2] into 6 slots. Slots 0-2 hold experts 0-2. Slot 3: loads per replica [6, 3, 2] -> expert
    # 0 (its 2nd replica, rank 1). Slot 4: [3, 3, 2], a tie -> lowest index, expert 0 again (rank 2).
    # Slot 5: [2, 3, 2] -> expert 1 (rank 1).
    phy2log, rank, logcnt = replicate(torch.tensor([[6.0, 3.0, 2.0]]), 6)
    assert phy2log.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert rank.tolist() == [[0, 0, 0, 1, 2, 1]]
    assert logcnt.tolist() == [[3, 2, 1]]


def test_global_policy_by_hand() -> None:
    rebalance = eplb.rebalance_experts
    # Load [8, 4, 2, 2], 6 slots on 2 GPUs (3 each), one group and one node: the global policy.
    # Replication: slot 4 -> expert 0 (8 is the largest), slot 5 -> expert 0 again (4 = 8/2 ties with
    # expert 1's 4; lowest index wins). Slots [0, 1, 2, 3, 0, 0], ranks [0, 0, 0, 0, 1, 2], counts [3, 1, 1, 1].
    # Per-slot loads [8/3, 4, 2, 2, 8/3, 8/3]; packing into 2 GPUs of 3 slots, heaviest first:
    #   slot 1 (4)    -> GPU 0 (4)
    #   slot 0 (8/3)  -> GPU 1 (8/3)
    #   slot 4 (8/3)  -> GPU 1 (16/3, 8/3 < 4)
    #   slot 5 (8/3)  -> GPU 0 (20/3, 4 < 16/3)
    #   slot 2 (2)    -> GPU 1 (22/3, full)
    #   slot 3 (2)    -> GPU 0 (the only one with room)
    # GPU 0 = [slot 1, slot 5, slot 3] = experts [1, 0, 3]; GPU 1 = [slot 0, slot 4, slot 2] = [0, 0, 2]:
    # GPU 1 holds two copies of expert 0, as DeepSeek's reference does.
    phy2log, log2phy, logcnt = rebalance(torch.tensor([[8, 4, 2, 2]]), 6, 1, 1, 2)
    assert phy2log.tolist() == [[1, 0, 3, 0, 0, 2]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    # Expert 0's replicas 0, 1, 2 were slots 0, 4, 5, now placed at 3, 4 and 1.
    assert log2phy.tolist() == [[[3, 4, 1], [0, -1, -1], [5, -1, -1], [2, -1, -1]]]


def test_long_tied_rows_follow_torch_sort() -> None:
    # torch's default CPU sort does not keep index order among ties in rows longer than 16 items, and
    # the packing must visit items in exactly torch's order.
    # Golden kernel set pack00 is exactly these rows.
    weight = torch.tensor([[float(i % 2) for i in range(40)], [1.0] * 20 + [0.0] * 20])
    assert np.array_equal(GOLDEN["pack00_weight"], weight.numpy())
    index, rank = eplb.balanced_packing(weight, 8)
    assert torch.equal(index, torch.from_numpy(GOLDEN["pack00_pack_index"]))
    assert torch.equal(rank, torch.from_numpy(GOLDEN["pack00_rank_in_pack"]))
    # Index order among ties is not what a stable sort gives, so this case tests the tie order.
    assert index[0].tolist() != [0, 1, 2, 3, 4, 5, 6, 7] * 5


def test_all_zero_load() -> None:
    # Every expert ties at 0, so the first expert of each replication row takes all extra slots, and the
    # packing follows torch's tie order.
    weight = torch.zeros(3, 32, dtype=torch.int64)
    # Global: one row of 32 experts and 48 slots, so expert 0 gets 1 + 16 replicas.
    fast = eplb.rebalance_experts(weight, 48, 3, 2, 8)
    assert fast[2][:, 0].tolist() == [17, 17, 17]
    # Hierarchical, 2 nodes: each node replicates its 16 experts into 24 slots, so one expert per node
    # gets 1 + 8 replicas.
    fast = eplb.rebalance_experts(weight, 48, 4, 2, 8)
    assert sorted(fast[2][0].tolist()) == [1] * 30 + [9, 9]


# ---------------------------------------------------------------------------------------------------
# Agreement with the stored golden outputs
# ---------------------------------------------------------------------------------------------------


def _golden_case(index: int) -> tuple[np.ndarray, tuple[int, int, int, int], tuple[np.ndarray, ...]]:
    params = GOLDEN_PARAMS[index]
    args = (params["num_replicas"], params["num_groups"], params["num_nodes"], params["num_gpus"])
    want = tuple(GOLDEN[f"case{index:02d}_{name}"] for name in ("phy2log", "log2phy", "logcnt"))
    return GOLDEN[f"case{index:02d}_weight"], args, want


def test_golden_file_is_consistent() -> None:
    # The stored file covers what its description says, and its expected outputs are valid plans.
    assert len(GOLDEN_PARAMS) == 36
    policies = {p["num_groups"] % p["num_nodes"] == 0 for p in GOLDEN_PARAMS}
    assert policies == {True, False}
    assert {p["num_gpus"] for p in GOLDEN_PARAMS} >= {1, 64}
    assert GOLDEN_PATH.stat().st_size < 300_000
    for index in range(len(GOLDEN_PARAMS)):
        weight, args, (phy2log, log2phy, logcnt) = _golden_case(index)
        assert weight.ndim == 2
        assert logcnt.shape == weight.shape
        for out in (phy2log, log2phy, logcnt):
            assert out.dtype == np.int64
        _check_invariants(phy2log, log2phy, logcnt, args[0])
    for pack in GOLDEN_PACKS:
        num_packs = int(GOLDEN[f"{pack}_num_packs"])
        index_, rank = GOLDEN[f"{pack}_pack_index"], GOLDEN[f"{pack}_rank_in_pack"]
        for row in range(index_.shape[0]):
            assert np.array_equal(
                np.bincount(index_[row], minlength=num_packs),
                np.full(num_packs, index_.shape[1] // num_packs),
            )
            pairs = set(zip(index_[row].tolist(), rank[row].tolist(), strict=True))
            assert len(pairs) == index_.shape[1]


@pytest.mark.parametrize("index", range(36), ids=[f"case{i:02d}" for i in range(36)])
def test_matches_golden(index: int) -> None:
    weight, args, want = _golden_case(index)
    got_torch = eplb.rebalance_experts(torch.from_numpy(weight), *args)
    _assert_same(got_torch, tuple(torch.from_numpy(w) for w in want))
    got_np = eplb.rebalance_experts(weight, *args)
    for got, expected in zip(got_np, want, strict=True):
        assert isinstance(got, np.ndarray)
        assert got.dtype == np.int64
        assert np.array_equal(got, expected)
    num_groups, num_nodes = args[1], args[2]
    if num_groups % num_nodes == 0:
        _check_groups_stay_on_one_node(got_np[0], weight.shape[1], num_groups, num_nodes)


def test_golden_kernels() -> None:
    assert GOLDEN_PACKS
    for pack in GOLDEN_PACKS:
        weight = GOLDEN[f"{pack}_weight"]
        want_index, want_rank = GOLDEN[f"{pack}_pack_index"], GOLDEN[f"{pack}_rank_in_pack"]
        num_packs, num_phy = int(GOLDEN[f"{pack}_num_packs"]), int(GOLDEN[f"{pack}_num_phy"])
        for inp in (weight, torch.from_numpy(weight)):
            index, rank = eplb.balanced_packing(inp, num_packs)
            assert np.array_equal(np.asarray(index), want_index)
            assert np.array_equal(np.asarray(rank), want_rank)
            phy2log, rank_, logcnt = eplb.replicate_experts(inp, num_phy)
            assert np.array_equal(np.asarray(phy2log), GOLDEN[f"{pack}_rep_phy2log"])
            assert np.array_equal(np.asarray(rank_), GOLDEN[f"{pack}_rep_rank"])
            assert np.array_equal(np.asarray(logcnt), GOLDEN[f"{pack}_rep_logcnt"])


def test_non_contiguous_input_matches_golden() -> None:
    # Same values laid out column-major (a non-contiguous torch view, a Fortran-order array).
    for index in range(len(GOLDEN_PARAMS)):
        weight, args, want = _golden_case(index)
        if GOLDEN_PARAMS[index]["kind"] not in ("float", "float32") or weight.shape[0] == 1:
            continue  # (a one-layer transpose is still contiguous)
        view = torch.from_numpy(np.ascontiguousarray(weight.T)).T
        assert not view.is_contiguous()
        _assert_same(eplb.rebalance_experts(view, *args), tuple(torch.from_numpy(w) for w in want))
        for got, expected in zip(eplb.rebalance_experts(np.asfortranarray(weight), *args), want, strict=True):
            assert np.array_equal(got, expected)


# ---------------------------------------------------------------------------------------------------
# Properties on random inputs
# ---------------------------------------------------------------------------------------------------


def _random_load(rng: np.random.Generator, kind: str, shape: tuple[int, int]) -> np.ndarray:
    if kind == "few_ints":  # many ties and zeros
        return rng.integers(0, 3, size=shape)
    if kind == "ints":
        load = rng.integers(0, 1000, size=shape)
        load[rng.random(shape) < 0.2] = 0
        return load
    if kind == "zipf":
        return np.minimum(rng.zipf(1.3, size=shape), 10**7)
    if kind == "float":
        return rng.lognormal(0.0, 2.0, size=shape)
    if kind == "float32":
        return rng.random(shape, dtype=np.float32) * 100
    assert kind == "zero_layers"
    load = rng.integers(0, 50, size=shape)
    load[rng.random(shape[0]) < 0.5] = 0
    load[0] = 0
    return load


LOAD_KINDS = ["few_ints", "ints", "zipf", "float", "float32", "zero_layers"]


@st.composite
def _layouts(draw: st.DrawFn, hierarchical: bool) -> tuple[int, int, int, int, int, int]:
    """(num_layers, num_logical, num_replicas, num_groups, num_nodes, num_gpus) selecting the policy."""
    if hierarchical:
        num_nodes = draw(st.integers(1, 4))
        num_groups = num_nodes * draw(st.integers(1, 4))
        num_logical = num_groups * draw(st.integers(1, 5))
        num_gpus = num_nodes * draw(st.integers(1, 4))
    else:
        num_nodes = draw(st.integers(2, 5))
        num_groups = draw(st.integers(1, 12).filter(lambda g: g % num_nodes != 0))
        num_logical = draw(st.integers(1, 40))  # need not be a multiple of num_groups here
        num_gpus = draw(st.integers(1, 8))
    per_gpu = math.ceil(num_logical / num_gpus) + draw(st.integers(0, 3))
    num_layers = draw(st.integers(1, 3))
    return num_layers, num_logical, per_gpu * num_gpus, num_groups, num_nodes, num_gpus


@pytest.mark.parametrize("hierarchical", [True, False], ids=["hierarchical", "global"])
def test_invariants_random(hierarchical: bool) -> None:
    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        layout=_layouts(hierarchical),
        kind=st.sampled_from(LOAD_KINDS),
        seed=st.integers(0, 2**32 - 1),
    )
    def check(layout: tuple[int, int, int, int, int, int], kind: str, seed: int) -> None:
        num_layers, num_logical, num_replicas, num_groups, num_nodes, num_gpus = layout
        assert (num_groups % num_nodes == 0) == hierarchical
        load = _random_load(np.random.default_rng(seed), kind, (num_layers, num_logical))
        args = (num_replicas, num_groups, num_nodes, num_gpus)

        got_np = eplb.rebalance_experts(load, *args)
        # torch in and numpy in give the same plan.
        got_torch = eplb.rebalance_experts(torch.from_numpy(load), *args)
        for got, other in zip(got_np, got_torch, strict=True):
            assert got.dtype == np.int64
            assert np.array_equal(got, other.numpy())
        _check_invariants(*got_np, num_replicas)
        if hierarchical:
            _check_groups_stay_on_one_node(got_np[0], num_logical, num_groups, num_nodes)

    check()


def _check_groups_stay_on_one_node(
    phy2log: np.ndarray, num_logical: int, num_groups: int, num_nodes: int
) -> None:
    group_size = num_logical // num_groups
    slot_node = np.arange(phy2log.shape[1]) // (phy2log.shape[1] // num_nodes)
    for layer in range(phy2log.shape[0]):
        node_of_group: dict[int, int] = {}
        for slot, expert in enumerate(phy2log[layer].tolist()):
            node = node_of_group.setdefault(expert // group_size, int(slot_node[slot]))
            assert node == slot_node[slot]
        assert np.array_equal(
            np.bincount(list(node_of_group.values()), minlength=num_nodes),
            np.full(num_nodes, num_groups // num_nodes),
        )


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------

LOAD_12 = np.ones((2, 12), dtype=np.int64)


@pytest.mark.parametrize(
    ("weight", "args", "error", "message"),
    [
        # hierarchical (num_nodes divides num_groups) needs num_groups to divide the experts
        (
            LOAD_12,
            (12, 5, 1, 4),
            InputError,
            r"num_logical_experts \(12\) must be divisible by num_groups \(5\)",
        ),
        (LOAD_12, (12, 4, 2, 3), InputError, r"num_gpus \(3\) must be divisible by num_nodes \(2\)"),
        (
            LOAD_12,
            (13, 4, 2, 4),
            BudgetError,
            r"num_replicas \(13\) must be divisible by num_gpus \(4\).* 16",
        ),
        (
            LOAD_12,
            (8, 4, 2, 4),
            BudgetError,
            r"num_replicas \(8\) must be at least num_logical_experts \(12\)",
        ),
        (LOAD_12, (12, 3, 2, 5), BudgetError, r"num_replicas \(12\) must be divisible by num_gpus \(5\)"),
        (LOAD_12, (12, 4, 0, 4), InputError, r"num_nodes \(0\) must be a positive integer"),
        (LOAD_12, (12, 4, 2, -4), InputError, r"num_gpus \(-4\) must be a positive integer"),
        (LOAD_12, (12.0, 4, 2, 4), InputError, r"num_replicas must be a positive integer, got 12.0"),
        (LOAD_12, (12, True, 1, 4), InputError, r"num_groups must be a positive integer, got True"),
        (
            np.ones(12),
            (12, 4, 2, 4),
            InputError,
            r"must be 2-D \[num_layers, num_logical_experts\], got shape \(12,\)",
        ),
        (np.ones((1, 2, 12)), (12, 4, 2, 4), InputError, r"must be 2-D"),
        (np.ones((0, 12)), (12, 4, 2, 4), InputError, r"at least one layer and one expert"),
        (
            np.array([[1.0, np.nan] * 6]),
            (12, 4, 2, 4),
            InputError,
            r"weight\[0, 1\] is nan; loads must be finite",
        ),
        (
            np.array([[1.0, np.inf] * 6]),
            (12, 4, 2, 4),
            InputError,
            r"weight\[0, 1\] is inf; loads must be finite",
        ),
        (
            np.array([[1, 2, -3] * 4]),
            (12, 4, 2, 4),
            InputError,
            r"weight\[0, 2\] is -3.0; loads must be non-negative",
        ),
        (np.array([["a"] * 12]), (12, 4, 2, 4), InputError, r"must hold real numbers, got dtype <U1"),
        (torch.ones(2, 12, dtype=torch.complex64), (12, 4, 2, 4), InputError, r"must be real"),
    ],
)
def test_validation(
    weight: object, args: tuple[object, ...], error: type[MoebalanceError], message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        eplb.rebalance_experts(weight, *args)  # type: ignore[call-overload]
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_global_policy_ignores_group_divisibility() -> None:
    # 3 nodes do not divide 5 groups -> global policy, which (like the reference) never uses num_groups,
    # so 12 experts need not be divisible by 5 nor 4 GPUs by 3 nodes.
    # Golden case 14 is such a call (2 layers, 12 experts, args (12, 5, 3, 4)).
    weight, args, want = _golden_case(14)
    assert args == (12, 5, 3, 4) and weight.shape == (2, 12)
    _assert_same(
        eplb.rebalance_experts(torch.from_numpy(weight), *args), tuple(torch.from_numpy(w) for w in want)
    )


def test_kernel_validation() -> None:
    with pytest.raises(InputError, match=r"items \(6\) must be divisible by num_packs \(4\)"):
        eplb.balanced_packing(np.ones((1, 6)), 4)
    with pytest.raises(BudgetError, match=r"num_phy \(2\) must be at least the number of experts \(3\)"):
        eplb.replicate_experts(np.ones((1, 3)), 2)
    with pytest.raises(InputError, match="non-negative"):
        eplb.replicate_experts(-np.ones((1, 3)), 4)


def test_public_name_is_the_algorithm() -> None:
    # the drop-in's documented import path
    import moebalance.eplb as public

    assert public.rebalance_experts is eplb.rebalance_experts and public.eplb_plan is eplb.eplb_plan
