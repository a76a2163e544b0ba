"""Per-layer skew statistics and token-level locality / affinity / cross-layer dependency."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moebalance.core.errors import InputError
from moebalance.workloads.stats import (
    HIGH_SKEW_PEAK_TO_MEAN,
    LayerSkew,
    coactivation_strength,
    layer_skew,
    locality,
    transition_strength,
)

# ----- layer_skew ------------------------------------------------------------------------------------------


def test_worked_example_from_docstring() -> None:
    # loads [6, 1, 1, 0], mean 2: peak/mean 6/2 = 3; top two 7/8; std sqrt((16+1+1+4)/4) = 2.345, CV 1.17;
    # one expert above 2x the mean (6 > 4).
    skew = layer_skew(np.array([[6, 1, 1, 0]]))
    assert isinstance(skew, LayerSkew)
    assert skew.peak_to_mean == pytest.approx([3.0])
    assert skew.top2_share == pytest.approx([0.875])
    assert skew.cv == pytest.approx([np.sqrt(5.5) / 2])
    assert skew.drift == pytest.approx([0.0])
    assert skew.hot_experts.tolist() == [1] and skew.hot_experts.dtype == np.int64
    assert skew.high_skew.tolist() == [False]


def test_shapes_and_high_skew_threshold() -> None:
    counts = np.zeros((3, 2, 32), dtype=np.int64)
    counts[:, 0] = 5  # uniform layer
    counts[:, 1, 0] = 100  # layer 1: expert 0 takes 100 of 131 tokens: 100 / (131 / 32) = 24.4x
    counts[:, 1, 1:] = 1
    skew = layer_skew(counts)
    for field in ("peak_to_mean", "top2_share", "cv", "drift", "hot_experts", "high_skew"):
        assert getattr(skew, field).shape == (2,)
    assert skew.peak_to_mean == pytest.approx([1.0, 100 / (131 / 32)])
    assert skew.high_skew.tolist() == [False, True]
    assert skew.cv[0] == 0.0 and skew.hot_experts.tolist() == [0, 1]
    assert skew.drift == pytest.approx([0.0, 0.0])  # the same shares in every batch
    assert HIGH_SKEW_PEAK_TO_MEAN == 10.0


def test_zero_load_layer_reads_as_uniform() -> None:
    counts = np.zeros((2, 2, 4), dtype=np.int64)
    counts[:, 1] = [3, 1, 0, 0]
    skew = layer_skew(counts)
    assert skew.peak_to_mean[0] == 1.0 and skew.top2_share[0] == 0.5 and skew.cv[0] == 0.0
    assert skew.drift[0] == 0.0 and skew.hot_experts[0] == 0 and not skew.high_skew[0]
    assert all(np.all(np.isfinite(getattr(skew, f))) for f in ("peak_to_mean", "top2_share", "cv", "drift"))


def test_single_expert_layer() -> None:
    skew = layer_skew(np.array([[[4]], [[0]]]))
    assert skew.peak_to_mean.tolist() == [1.0] and skew.top2_share.tolist() == [1.0] and skew.cv.tolist() == [0.0]


def test_drift_by_hand() -> None:
    # Expert 0's share: 0.5, 0.25 (mean 0.375, std 0.125, ratio 1/3); expert 1's: 0.5, 0.75 (ratio 0.2).
    # A third batch with no load is skipped.
    counts = np.array([[[2, 2]], [[1, 3]], [[0, 0]]])
    assert layer_skew(counts).drift == pytest.approx([(1 / 3 + 0.2) / 2])
    assert layer_skew(counts[:1]).drift == pytest.approx([0.0])


def test_two_dimensional_input_is_one_batch() -> None:
    flat = np.array([[5, 1, 0, 2], [1, 1, 1, 1]])
    a, b = layer_skew(flat), layer_skew(flat[None])
    for field in ("peak_to_mean", "top2_share", "cv", "drift", "hot_experts", "high_skew"):
        assert np.array_equal(getattr(a, field), getattr(b, field))


def test_hot_factor() -> None:
    counts = np.array([[30, 20, 5, 5, 0, 0, 0, 0]])  # mean 7.5
    assert layer_skew(counts).hot_experts.tolist() == [2]
    assert layer_skew(counts, hot_factor=3.0).hot_experts.tolist() == [1]
    with pytest.raises(InputError, match="hot_factor"):
        layer_skew(counts, hot_factor=0)


@pytest.mark.parametrize(("counts", "needle"), [
    (np.array([1, 2, 3]), "expected [B, L, E]"),
    (np.zeros((2, 0, 3)), "at least one batch"),
    (np.array([[[1, -2]]]), "negative load"),
    (np.array([[[1.0, np.nan]]]), "NaN"),
    (np.array([[["a", "b"]]]), "dtype"),
])
def test_bad_counts_teach(counts: np.ndarray, needle: str) -> None:
    with pytest.raises(InputError) as info:
        layer_skew(counts)
    assert needle in str(info.value)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.int64, hnp.array_shapes(min_dims=3, max_dims=3, max_side=6), elements=st.integers(0, 50)))
def test_skew_properties(counts: np.ndarray) -> None:
    skew = layer_skew(counts)
    num_experts = counts.shape[2]
    assert np.all(skew.peak_to_mean >= 1.0 - 1e-12) and np.all(skew.peak_to_mean <= num_experts + 1e-9)
    assert np.all(skew.top2_share >= min(2, num_experts) / num_experts - 1e-12) and np.all(skew.top2_share <= 1.0)
    assert np.all(skew.cv >= 0) and np.all(skew.drift >= 0)
    assert np.all((skew.hot_experts >= 0) & (skew.hot_experts < num_experts))
    # Relabelling experts and scaling all loads by one factor change nothing.
    perm = np.random.default_rng(counts.size).permutation(num_experts)
    relabelled = layer_skew(counts[:, :, perm] * 3)
    for field in ("peak_to_mean", "top2_share", "cv", "drift", "hot_experts", "high_skew"):
        assert np.allclose(getattr(relabelled, field), getattr(skew, field))


# ----- token-level statistics ------------------------------------------------------------------------------


def test_locality_by_hand() -> None:
    # GPU 0's tokens pick expert 0, GPU 1's pick expert 1: each is 0.5 away (TV) from the global (0.5, 0.5).
    ids = np.array([0, 0, 1, 1])[:, None, None]
    assert locality(ids, np.array([0, 0, 1, 1]), 2) == pytest.approx([0.5])
    # Same demand everywhere: 0.
    assert locality(ids, np.array([0, 1, 0, 1]), 2) == pytest.approx([0.0])
    # GPUs without tokens do not count.
    assert locality(ids, np.array([0, 0, 3, 3]), 2) == pytest.approx([0.5])


def test_coactivation_by_hand() -> None:
    # Tokens pick {0, 1} or {2, 3}: P(0, 1) = P(1, 0) = P(2, 3) = P(3, 2) = 1/4, marginals 1/4, so
    # MI = log2((1/4) / (1/16)) = 2 bits: the partner tells which pair, all the marginal's 2 bits.
    ids = np.array([[0, 1], [1, 0], [2, 3], [3, 2]])[:, None, :]
    assert coactivation_strength(ids, 4) == pytest.approx([2.0])
    assert coactivation_strength(ids[:, :, :1], 4).tolist() == [0.0]  # top-1: no pairs


def test_coactivation_pairs_value() -> None:
    # P(a, b) = 1/12 for a != b, marginals 1/4: MI = log2((1/12) / (1/16)) = log2(4/3).
    pairs = np.array([[a, b] for a in range(4) for b in range(4) if a != b])[:, None, :]
    assert coactivation_strength(pairs, 4) == pytest.approx([np.log2(4 / 3)])


def test_transition_by_hand() -> None:
    # Layer 1 repeats layer 0's expert: MI = H = 2 bits for 4 equally likely experts.
    e = np.repeat(np.arange(4), 3)
    same = np.stack([e, e], axis=1)[:, :, None]
    assert transition_strength(same, 4) == pytest.approx([2.0])
    # Every (layer 0, layer 1) combination once: independent, 0 bits.
    a, b = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    independent = np.stack([a.ravel(), b.ravel()], axis=1)[:, :, None]
    assert transition_strength(independent, 4) == pytest.approx([0.0], abs=1e-12)
    assert transition_strength(same[:, :1], 4).shape == (0,)


def test_symmetric_mutual_information_counts_both_orders() -> None:
    ids = np.array([[0, 1], [0, 1], [2, 3]])[:, None, :]
    swapped = ids[:, :, ::-1]
    assert coactivation_strength(ids, 4) == pytest.approx(coactivation_strength(swapped, 4))


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: locality(np.zeros((3, 1, 1), dtype=int), np.zeros(2, dtype=int), 2), "one GPU per token"),
    (lambda: locality(np.zeros((3, 1, 1), dtype=int), -np.ones(3, dtype=int), 2), "ranks must be >= 0"),
    (lambda: coactivation_strength(np.full((2, 1, 2), 5), 4), "expert id 5"),
    (lambda: transition_strength(np.zeros((2, 2)), 4), "expected [N, L, K]"),
    (lambda: transition_strength(np.zeros((2, 2, 1)), 4), "integer expert ids"),
    (lambda: coactivation_strength(np.zeros((2, 1, 2), dtype=int), 0), "num_experts (0)"),
])
def test_bad_token_inputs_teach(call: object, needle: str) -> None:
    with pytest.raises(InputError) as info:
        call()  # type: ignore[operator]
    assert needle in str(info.value)
