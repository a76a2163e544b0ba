"""The exact per-layer planner on the device (:mod:`moebalance.algorithms.exact_device`: Triton programs for Libra's
prefetcher and rebalancer) against the compiled CPU planner it must equal, and the token hand-out of its plans.

On this machine the kernels run in Triton's interpreter (CPU tensors); a subprocess compiles the prefetcher's
kernel for GPU targets down to a cubin, so a construct the interpreter accepts but the compiler rejects fails here.
Equal means: the extras, the split, the loads and the moves identical, and the expected loads within the planner's
tie tolerance (they are float sums taken in another order).
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from conftest import assert_compiles_for_gpus
from hypothesis import given, settings

from moebalance.algorithms import exact_device as device
from moebalance.algorithms.exact import LayerPlan, assign, plan_layer
from moebalance.algorithms.prefetch import TOL
from moebalance.core.errors import InputError


def _check(got: device.DevicePlan, b: int, layer: int, want: LayerPlan) -> None:
    assert got.extras[b, layer].tolist() == want.extras.tolist()
    np.testing.assert_allclose(got.expected[b, layer].cpu().numpy(), want.expected, rtol=0, atol=TOL)
    assert got.remote[b, layer].tolist() == want.remote.tolist()
    assert got.loads[b, layer].tolist() == want.loads.tolist()
    assert int(got.moves[b, layer]) == want.moves


def _copies(rng: np.random.Generator, L: int, E: int, G: int, wide: float) -> np.ndarray:
    """``int64 [L, E, G]``: every expert once, some on more GPUs, some twice on one."""
    copies = np.zeros((L, E, G), dtype=np.int64)
    for layer in range(L):
        copies[layer, np.arange(E), rng.integers(0, G, E)] += 1
        for e in np.flatnonzero(rng.random(E) < wide):
            copies[layer, e, rng.integers(0, G)] += int(rng.integers(1, 3))
    return copies


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), B=st.integers(1, 2), L=st.integers(1, 2), G=st.integers(1, 6),
       E=st.integers(1, 12), scale=st.sampled_from([1, 3, 50]), alpha=st.sampled_from([0.0, 0.5, 1.0]),
       eps=st.sampled_from([0.0, 0.1]), strict=st.booleans(), data=st.data())
def test_every_layer_equals_the_cpu_planner(seed: int, B: int, L: int, G: int, E: int, scale: int, alpha: float,
                                            eps: float, strict: bool, data: st.DataObject) -> None:
    """Few distinct demands and small loads: ties everywhere, in phase 1, in phase 2's loads and shares, and in the
    rebalancer."""
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(0, E))
    copies = _copies(rng, L, E, G, 0.5)
    demand = (rng.integers(0, 4, (B, L, G, E)) * scale).astype(np.int64)
    got = device.plan(torch.from_numpy(demand), torch.from_numpy(copies), n, alpha, eps=eps, strict=strict)
    assert got.extras.shape == (B, L, G, n) and got.holds.dtype == torch.bool
    for b in range(B):
        for layer in range(L):
            want = plan_layer(demand[b, layer], copies[layer], n, alpha, eps=eps, strict=strict)
            _check(got, b, layer, want)
            holds = copies[layer].T > 0
            g, slot = np.nonzero(want.extras >= 0)
            holds[g, want.extras[g, slot]] = True
            assert got.holds[b, layer].numpy().tolist() == holds.tolist()


def test_a_skewed_layer_with_many_moves() -> None:
    """16 GPUs x 48 experts, top-4 routing skewed per GPU on contiguous homes: phase 2 duplicates and the rebalancer
    makes dozens of moves; every (batch, layer) in one call."""
    rng = np.random.default_rng(7)
    G, E, L = 16, 48, 3
    shared = rng.dirichlet(np.full(E, 0.5))
    demand = np.stack([np.stack([rng.multinomial(256 * 4, rng.dirichlet(shared * E * 4 + 1e-3)) for _ in range(G)])
                       for _ in range(L)])[None].astype(np.int64)
    copies = np.zeros((L, E, G), dtype=np.int64)
    copies[:, np.arange(E), np.arange(E) * G // E] = 1
    for n in (2, 4):
        got = device.plan(torch.from_numpy(demand), torch.from_numpy(copies), n, 0.5)
        for layer in range(L):
            want = plan_layer(demand[0, layer], copies[layer], n, 0.5)
            assert want.moves > 10
            _check(got, 0, layer, want)


def test_fractional_shares_that_tie_within_the_tolerance() -> None:
    # thirds of remote picks over three holders: shares and loads equal up to rounding, so the lower id must win
    demand = np.array([[0, 1, 1, 0], [1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]])
    copies = np.array([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1]])
    for n, alpha in ((2, 0.5), (4, 0.0), (3, 1.0)):
        got = device.plan(torch.from_numpy(demand)[None, None], torch.from_numpy(copies)[None], n, alpha)
        _check(got, 0, 0, plan_layer(demand, copies, n, alpha))


def test_the_hand_checked_example() -> None:
    # experts {0, 1} on GPU 0, {2, 3} on GPU 1; GPU 0's tokens pick 0 once and 2 three times, GPU 1's pick 2 once.
    # n = 1, alpha = 1: GPU 0 takes expert 2 (its most requested remote expert); GPU 1's tokens want nothing it
    # lacks. Every pick is then local: loads 1 + 3 = 4 and 1, B = 2.5; local picks never move: no move.
    copies = torch.tensor([[[1, 0], [1, 0], [0, 1], [0, 1]]])
    got = device.plan(torch.tensor([[[[1, 0, 3, 0], [0, 0, 1, 0]]]]), copies, 1, 1.0)
    assert got.extras[0, 0].tolist() == [[2], [-1]]
    assert got.expected[0, 0].tolist() == [4.0, 1.0]
    assert not got.remote.any() and got.loads[0, 0].tolist() == [4, 1] and got.moves.tolist() == [[0]]
    # alpha = 0, phase 2 alone: GPU 1 serves its own pick of 2 and GPU 0's three (load 4), GPU 0 its pick of 0
    # (load 1); B = 2.5. GPU 1 is the source, expert 2 its largest share, GPU 0 the destination, but taking 2
    # would localise GPU 0's own 3 picks: 1 + 3 > B, so line 15 refuses it and nothing is added or moved
    got = device.plan(torch.tensor([[[[1, 0, 3, 0], [0, 0, 1, 0]]]]), copies, 1, 0.0)
    assert got.extras[0, 0].tolist() == [[-1], [-1]] and got.expected[0, 0].tolist() == [1.0, 4.0]
    assert got.remote[0, 0].tolist() == [[0, 0, 0, 0], [0, 0, 3, 0]] and got.loads[0, 0].tolist() == [1, 4]
    _check(got, 0, 0, plan_layer(np.array([[1, 0, 3, 0], [0, 0, 1, 0]]), copies[0].numpy(), 1, 0.0))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), G=st.integers(1, 6), E=st.integers(2, 10), T=st.integers(1, 40),
       gpn=st.integers(1, 6), n=st.integers(0, 2))
def test_assign_equals_the_cpu_hand_out(seed: int, G: int, E: int, T: int, gpn: int, n: int) -> None:
    """Every kept pick's GPU equals :func:`moebalance.algorithms.exact.assign`'s on the same plan (local picks at
    home, extras included; the rest by shares in token order, own node first), and the GPUs' picks are the loads."""
    rng = np.random.default_rng(seed)
    gpn = min(gpn, G)
    K = min(E, 2)
    copies = _copies(rng, 2, E, G, 0.4)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(2)])
    src = np.sort(rng.integers(0, G, T))
    kept = rng.random((2, T, K)) < 0.9
    demand = np.zeros((1, 2, G, E), dtype=np.int64)
    for layer in range(2):
        np.add.at(demand[0, layer], (np.repeat(src, K)[kept[layer].ravel()], ids[layer].ravel()[kept[layer].ravel()]), 1)
    got = device.plan(torch.from_numpy(demand), torch.from_numpy(copies), n, 0.5)
    for layer in range(2):
        want = assign(plan_layer(demand[0, layer], copies[layer], n, 0.5), copies[layer], ids[layer], src, kept[layer],
                      gpn)
        dest = device.assign(got, 0, layer, torch.from_numpy(ids[layer]), torch.from_numpy(src),
                             torch.from_numpy(kept[layer]), gpn)
        assert dest.tolist() == want.tolist()
        assert np.bincount(dest.numpy()[kept[layer]], minlength=G).tolist() == got.loads[0, layer].tolist()


def test_bad_inputs_are_named() -> None:
    one = torch.ones(1, 1, 2, 2, dtype=torch.int64)
    eye = torch.eye(2, dtype=torch.int64)[None]
    with pytest.raises(InputError, match="integer tensors"):
        device.plan(one.double(), eye, 1, 0.5)
    with pytest.raises(InputError, match="torch tensors"):
        device.plan(np.ones((1, 1, 2, 2)), eye, 1, 0.5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"demand \(1, 1, 2, 2\) must be \[B, L, G, E\] and copies \(1, 3, 2\)"):
        device.plan(one, torch.ones(1, 3, 2, dtype=torch.int64), 1, 0.5)
    with pytest.raises(InputError, match=r"demand\[0, 0, 1, 0\] is negative"):
        device.plan(torch.tensor([[[[1, 0], [-1, 0]]]]), eye, 1, 0.5)
    with pytest.raises(InputError, match="expert 1 has no copy in layer 0"):
        device.plan(one, torch.tensor([[[1, 1], [0, 0]]]), 1, 0.5)
    with pytest.raises(InputError, match=r"n \(3\) exceeds the 2 experts"):
        device.plan(one, eye, 3, 0.5)
    with pytest.raises(InputError, match=r"eps \(1.5\)"):
        device.plan(one, eye, 1, 0.5, eps=1.5)
    with pytest.raises(InputError, match="more than this planner sums exactly"):
        device.plan(torch.full((1, 1, 2, 2), 2**51, dtype=torch.int64), eye, 1, 0.5)
    got = device.plan(one, eye, 1, 0.5)
    with pytest.raises(InputError, match=r"\(batch, layer\) = \(0, 1\) is outside the plan's \[1, 1\]"):
        device.assign(got, 0, 1, torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                      torch.ones(1, 1, dtype=torch.bool), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run where one is)")
def test_on_cuda_every_layer_equals_the_cpu_planner() -> None:
    # 218 picks on 6 GPUs: 218 / 6 = 36.333333333333336 but 218 * (1 / 6) = 36.33333333333333; the mean must be
    # divided, not multiplied by a reciprocal (a torch planner once was one bit off on an H200 here)
    demand = np.array([[0, 7, 8, 1, 10, 0, 0], [7, 4, 2, 1, 3, 9, 10], [5, 1, 7, 9, 8, 4, 7], [2, 10, 10, 3, 6, 7, 2],
                       [10, 8, 8, 4, 0, 5, 2], [3, 9, 1, 2, 9, 7, 7]])
    copies = np.array([[1, 0, 0, 1, 2, 1], [0, 0, 0, 1, 1, 0], [0, 0, 1, 0, 1, 0], [0, 1, 1, 0, 1, 1],
                       [0, 1, 1, 2, 0, 0], [1, 2, 2, 0, 0, 1], [1, 0, 2, 2, 2, 2]])
    got = device.plan(torch.from_numpy(demand)[None, None].cuda(), torch.from_numpy(copies)[None].cuda(), 4, 0.0,
                      eps=0.1, strict=True)
    _check(got, 0, 0, plan_layer(demand, copies, 4, 0.0, eps=0.1, strict=True))
    rng = np.random.default_rng(0)
    for _ in range(100):
        G, E = int(rng.integers(1, 13)), int(rng.integers(1, 25))
        copies = _copies(rng, 2, E, G, 0.5)
        demand = rng.integers(0, 6, (2, 2, G, E)).astype(np.int64)
        n, alpha = int(rng.integers(0, E + 1)), float(rng.choice([0.0, 0.5, 1.0]))
        got = device.plan(torch.from_numpy(demand).cuda(), torch.from_numpy(copies).cuda(), n, alpha)
        assert got.remote.device.type == "cuda"
        for b in range(2):
            for layer in range(2):
                _check(got, b, layer, plan_layer(demand[b, layer], copies[layer], n, alpha))




def test_the_prefetch_kernel_compiles_for_a100_and_h100_without_a_gpu() -> None:
    sig = {"d_ptr": "*i64", "copies_ptr": "*i64", "has_ptr": "*i8", "share_ptr": "*fp64", "extras_ptr": "*i64",
           "expected_ptr": "*fp64", "L": "i32", "G": "i32", "E": "i32", "N": "i32", "NL": "i32",
           "GP": "constexpr", "EP": "constexpr", "NP": "constexpr"}
    assert_compiles_for_gpus("moebalance.algorithms.exact_device", sig, [{"GP": 64, "EP": 256, "NP": 8}],
                             {"enable_fp_fusion": False})
