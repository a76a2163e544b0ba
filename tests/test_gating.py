"""Top-k gating and capacity: golden cases, a loop reference written here, properties."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given

from moebalance.core.errors import InputError
from moebalance.runtime.gating import GateConfig, expert_capacity, topk_gating


def _topk_by_definition(logits: np.ndarray, k: int, renormalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The definition, token by token: softmax over every expert, then ``k`` rounds of taking the largest
    remaining gate (the lowest index among equal ones), then the kept gates divided by their sum."""
    T, E = logits.shape
    ids = np.zeros((T, k), dtype=np.int64)
    w = np.zeros((T, k))
    for t in range(T):
        e = np.exp(logits[t] - logits[t].max())
        gates = e / e.sum()
        left = list(range(E))
        for j in range(k):
            best = max(left, key=lambda i: (gates[i], -i))
            ids[t, j], w[t, j] = best, gates[best]
            left.remove(best)
        if renormalize:
            w[t] /= w[t].sum()
    return ids, w


@st.composite
def logit_cases(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    T, E = draw(st.integers(1, 12)), draw(st.integers(1, 9))
    k = draw(st.integers(1, E))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    if draw(st.booleans()):  # small integers: many exact ties
        logits = rng.integers(-2, 3, size=(T, E)).astype(np.float32)
    else:
        logits = (rng.normal(size=(T, E)) * draw(st.sampled_from([0.1, 1.0, 4.0]))).astype(np.float32)
    return logits, k


@given(case=logit_cases(), renormalize=st.booleans())
def test_matches_the_definition(case: tuple[np.ndarray, int], renormalize: bool) -> None:
    logits, k = case
    ref_ids, ref_w = _topk_by_definition(logits.astype(np.float64), k, renormalize)
    out = topk_gating(torch.from_numpy(logits), GateConfig(top_k=k, renormalize=renormalize))
    assert np.array_equal(out.topk_ids.numpy(), ref_ids)  # equal logits tie exactly in both precisions
    np.testing.assert_allclose(out.topk_weights.numpy(), ref_w, rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lowest_index() -> None:
    out = topk_gating(torch.zeros(3, 6), GateConfig(top_k=3))
    assert out.topk_ids.tolist() == [[0, 1, 2]] * 3  # docs/papers/routing.md: all-equal logits pick the k lowest indices
    assert torch.allclose(out.topk_weights, torch.full((3, 3), 1 / 3))
    # a tie below the top: logits [1, 0, 1, 0] -> experts 0 and 2 tie first, then 1 and 3
    out = topk_gating(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), GateConfig(top_k=3))
    assert out.topk_ids.tolist() == [[0, 2, 1]]


@given(case=logit_cases())
def test_renormalised_gates_sum_to_one_and_are_sorted(case: tuple[np.ndarray, int]) -> None:
    logits, k = case
    out = topk_gating(torch.from_numpy(logits), GateConfig(top_k=k))
    w = out.topk_weights.numpy()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-5)
    assert np.all(np.diff(w, axis=1) <= 1e-7)  # high to low
    ids = out.topk_ids.numpy()
    assert all(len(set(row)) == k for row in ids)  # distinct picks


def test_top1_and_dense_limits() -> None:
    logits = torch.from_numpy(np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32))
    top1 = topk_gating(logits, GateConfig(top_k=1))
    assert torch.equal(top1.topk_ids[:, 0], logits.argmax(dim=1)) and torch.allclose(top1.topk_weights, torch.ones(32, 1))
    full = topk_gating(logits, GateConfig(top_k=8))  # k == E recovers the full softmax
    dense = torch.zeros(32, 8).scatter(1, full.topk_ids, full.topk_weights)
    assert torch.allclose(dense, torch.softmax(logits, dim=1), atol=1e-6)
    raw = topk_gating(logits, GateConfig(top_k=2, renormalize=False))
    assert torch.all(raw.topk_weights.sum(dim=1) < 1.0)  # mass left on the other experts


def test_sigmoid_scores_and_selection_bias() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    out = topk_gating(logits, GateConfig(top_k=2, score_fn="sigmoid"))
    s = torch.sigmoid(logits[0])
    assert out.topk_ids.tolist() == [[2, 1]]
    assert torch.allclose(out.topk_weights[0], s[[2, 1]] / s[[2, 1]].sum())
    # DeepSeek-V3's bias changes which experts are picked, not how they are weighted
    biased = topk_gating(logits, GateConfig(top_k=2, score_fn="sigmoid"),
                         selection_bias_E=torch.tensor([0.0, 0.0, -5.0, 5.0]))
    assert biased.topk_ids.tolist() == [[3, 1]]
    assert torch.allclose(biased.topk_weights[0], s[[3, 1]] / s[[3, 1]].sum())


def test_capacity_formula() -> None:
    assert expert_capacity(1024, 2, 8, 1.25) == 320  # the classic example: 1.25 * 1024 * 2 / 8
    assert expert_capacity(1024, 2, 8, 1.0) == 256
    assert expert_capacity(1024, 1, 4, 1.5) == 384
    assert expert_capacity(10, 1, 11, 1.1) == 1  # 1.1 * 10 / 11 is 1.0000000000000002 in floats: rounded first
    assert expert_capacity(10, 1, 4, 1.0) == 3  # ceil(2.5); the classic floor would give 2
    assert GateConfig(top_k=2).capacity(100, 8) is None


def test_drop_skewed_load_drops_only_the_hot_overflow() -> None:
    # the classic adversarial case: 900 of 1000 top-1 tokens want expert 0, capacity 300 (cf 2.4 -> 2.4 * 125)
    rng = np.random.default_rng(1)
    hot = np.concatenate([np.zeros(900, int), rng.integers(1, 8, size=100)])
    rng.shuffle(hot)
    logits = torch.full((1000, 8), -5.0)
    logits[torch.arange(1000), torch.from_numpy(hot)] = 5.0
    out = topk_gating(logits, GateConfig(top_k=1, capacity_factor=2.4))
    kept = out.kept[:, 0].numpy()
    assert (~kept).sum() == 600 and np.all(hot[~kept] == 0)
    assert np.array_equal(np.flatnonzero(hot == 0)[:300], np.flatnonzero(kept & (hot == 0)))  # first come
    assert torch.all(out.topk_weights[~out.kept] == 0)


def test_spill_moves_to_the_next_best_expert_with_room() -> None:
    # every token prefers 0 > 1 > 2 (logits 2, 1, 0); top-1, capacity ceil(1 * 3 * 1 / 3) = 1:
    # token 0 takes expert 0, token 1 spills to 1, token 2 spills to 2; weights p_e / p_0 = e^{-1}, e^{-2}
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 3)
    out = topk_gating(logits, GateConfig(top_k=1, capacity_factor=1.0, overflow="spill"))
    assert out.topk_ids.tolist() == [[0], [1], [2]] and out.kept.all()
    assert torch.allclose(out.topk_weights[:, 0], torch.tensor([1.0, math.exp(-1), math.exp(-2)]))
    # two experts, capacity ceil(0.5 * 3 / 2) = 1: token 2 finds both full and is dropped
    out = topk_gating(logits[:, :2], GateConfig(top_k=1, capacity_factor=0.5, overflow="spill"))
    assert out.topk_ids.tolist() == [[0], [1], [0]] and out.kept.tolist() == [[True], [True], [False]]
    # top-2, capacity ceil(0.75 * 2 * 2 / 3) = 1: token 0 fills experts 0 and 1; token 1's pick of 0 spills
    # to 2 (weight p_2 / (p_0 + p_1)), its pick of 1 finds no expert outside {1, 2} with room and is dropped
    out = topk_gating(logits[:2], GateConfig(top_k=2, capacity_factor=0.75, overflow="spill"))
    assert out.topk_ids.tolist() == [[0, 1], [2, 1]] and out.kept.tolist() == [[True, True], [True, False]]
    p = torch.softmax(logits[0], dim=0)
    assert torch.allclose(out.topk_weights[1], torch.stack([p[2] / (p[0] + p[1]), torch.tensor(0.0)]))


FACTORS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 8.0]


@given(case=logit_cases())
def test_capacity_properties(case: tuple[np.ndarray, int]) -> None:
    logits, k = case
    T, E = logits.shape
    x = torch.from_numpy(logits)
    free = topk_gating(x, GateConfig(top_k=k))
    prev = {"drop": T * k + 1, "spill": T * k + 1}
    for cf in FACTORS:
        cap = expert_capacity(T, k, E, cf)
        res = {o: topk_gating(x, GateConfig(top_k=k, capacity_factor=cf, overflow=o)) for o in ("drop", "spill")}
        for o, out in res.items():
            ids, kept = out.topk_ids.numpy(), out.kept.numpy()
            assert np.all(np.bincount(ids[kept], minlength=E) <= cap)  # nobody exceeds capacity
            assert all(len(set(row)) == k for row in ids)  # picks stay distinct
            assert np.all(out.topk_weights.numpy()[~kept] == 0)
            assert out.num_dropped <= prev[o]  # raising the factor never drops more
            prev[o] = out.num_dropped
            if cap >= T:  # an expert gets at most T picks
                assert out.num_dropped == 0
        drop, spill = res["drop"], res["spill"]
        assert spill.num_dropped <= drop.num_dropped  # proved in gating's docstring
        if (E - k + 1) * cap >= T * k:
            assert spill.num_dropped == 0
        # drop changes no kept pick or its weight
        assert torch.equal(drop.topk_ids, free.topk_ids)
        assert torch.equal(drop.topk_weights[drop.kept], free.topk_weights[drop.kept])


def test_config_validation_names_the_bad_value() -> None:
    with pytest.raises(InputError, match="top_k"):
        GateConfig(top_k=0)
    with pytest.raises(InputError, match="capacity_factor"):
        GateConfig(top_k=1, capacity_factor=-1.0)
    with pytest.raises(InputError, match="overflow"):
        GateConfig(top_k=1, overflow="queue")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="must not exceed"):
        topk_gating(torch.zeros(2, 3), GateConfig(top_k=4))
