"""The drop-in's argument errors: our errors, and AssertionError for callers written against the reference."""

from __future__ import annotations

import numpy as np
import pytest

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
