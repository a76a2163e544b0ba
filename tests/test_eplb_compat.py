"""The drop-in's argument errors: our errors, and AssertionError for callers written against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moebalance.core.errors import BudgetError, InputError
from moebalance.eplb import EplbArgumentError, rebalance_experts


@pytest.mark.parametrize(("args", "match"), [
    ((9, 1, 1, 2), r"num_replicas \(9\) must be divisible by num_gpus \(2\)"),
    ((6, 1, 1, 2), r"num_replicas \(6\) must be at least num_logical_experts \(8\)"),
    ((8, 3, 1, 2), r"num_logical_experts \(8\) must be divisible by num_groups \(3\)"),
    ((9, 2, 2, 3), r"num_gpus \(3\) must be divisible by num_nodes \(2\)"),
])
def test_layout_errors_are_catchable_three_ways(args: tuple[int, int, int, int], match: str) -> None:
    weight = np.ones((1, 8))
    for kind in (AssertionError, EplbArgumentError, InputError, BudgetError):
        with pytest.raises(kind, match=match):
            rebalance_experts(weight, *args)


# ----- the reference module's other functions, which SGLang's and vLLM's EPLB tests call -------------------------

def test_the_drop_in_has_the_reference_functions() -> None:
    """Before: ``from moebalance.eplb import balanced_packing`` failed (lost in the restructure)."""
    import moebalance.eplb as drop_in
    from moebalance.algorithms import eplb as algorithm

    for name in ("balanced_packing", "replicate_experts", "rebalance_experts_hierarchical", "rebalance_experts"):
        assert getattr(drop_in, name) is getattr(algorithm, name)
        assert name in drop_in.__all__


def test_balanced_packing_and_replicate_experts_by_hand() -> None:
    from moebalance.eplb import balanced_packing, replicate_experts

    # [5, 4, 3, 3] into 2 packs of 2, heaviest first: 5 -> pack 0; 4 -> pack 1; 3 -> pack 1 (4 < 5, now full);
    # the last 3 -> pack 0. Torch in, torch out.
    index, rank = balanced_packing(torch.tensor([[5.0, 4.0, 3.0, 3.0]]), 2)
    assert isinstance(index, torch.Tensor) and index.tolist() == [[0, 1, 1, 0]] and rank.tolist() == [[0, 0, 1, 1]]
    # [9, 2] into 4 slots: 9 -> a copy (4.5 > 2), then 4.5 > 2 again -> a third copy (3 > 2): numpy in, numpy out.
    phy2log, replica, count = replicate_experts(np.array([[9.0, 2.0]]), 4)
    assert isinstance(phy2log, np.ndarray)
    assert phy2log.tolist() == [[0, 1, 0, 0]] and replica.tolist() == [[0, 0, 1, 2]] and count.tolist() == [[3, 1]]


def test_rebalance_experts_hierarchical_by_hand() -> None:
    """Load [8, 4, 2, 2], 6 slots on 2 GPUs, 1 group, 1 node (the global policy is this call): slots [1, 0, 3 | 0,
    0, 2] (tests/test_eplb.py derives them step by step), expert 0's replicas 0, 1, 2 in slots 3, 4 and 1."""
    from moebalance.eplb import rebalance_experts_hierarchical

    phy2log, phyrank, logcnt = rebalance_experts_hierarchical(torch.tensor([[8.0, 4.0, 2.0, 2.0]]), 6, 1, 1, 2)
    assert phy2log.tolist() == [[1, 0, 3, 0, 0, 2]]
    assert phyrank.tolist() == [[0, 2, 0, 0, 1, 0]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rebalance_experts_hierarchical_is_rebalance_experts_step_by_step(seed: int) -> None:
    """With nodes dividing groups, rebalance_experts is the hierarchical policy plus log2phy: the same slots and
    counts, and each slot sits in log2phy at its replica rank."""
    from moebalance.eplb import rebalance_experts_hierarchical

    rng = np.random.default_rng(seed)
    weight = torch.from_numpy(rng.integers(0, 100, size=(3, 32)).astype(np.float32))
    phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, 48, 8, 2, 8)
    want = rebalance_experts(weight, 48, 8, 2, 8)
    assert torch.equal(phy2log, want[0]) and torch.equal(logcnt, want[2])
    for layer in range(3):
        for slot in range(48):
            assert want[1][layer, phy2log[layer, slot], phyrank[layer, slot]] == slot


def test_rebalance_experts_hierarchical_refuses_what_the_reference_asserts() -> None:
    from moebalance.eplb import rebalance_experts_hierarchical

    for kind in (AssertionError, EplbArgumentError, InputError):
        with pytest.raises(kind, match=r"num_groups \(3\) must be divisible by num_nodes \(2\)"):
            rebalance_experts_hierarchical(np.ones((1, 6)), 6, 3, 2, 2)


def test_drop_in_helpers_refuse_bad_arguments_catchably_three_ways() -> None:
    """The reference asserts its preconditions: code written against it catches AssertionError; ours also names
    the value as an InputError / BudgetError (a moebalance user error)."""
    from moebalance.core.errors import BudgetError, InputError
    from moebalance.eplb import balanced_packing, replicate_experts

    w = np.ones((1, 6))
    for call in (lambda: balanced_packing(w, 4), lambda: replicate_experts(w, 5)):
        for kind in (AssertionError, InputError, BudgetError):
            with pytest.raises(kind):
                call()
