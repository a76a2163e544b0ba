"""The device ``rebalance`` (Triton, one program per (batch, layer)) against the compiled CPU path it must equal:
the count-level split and the token routes.

On this machine the kernel runs in Triton's interpreter (CPU tensors); a subprocess compiles the same kernel for
GPU targets down to a cubin, so a construct the interpreter accepts but the compiler rejects fails here too.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from conftest import assert_compiles_for_gpus
from hypothesis import given, settings

from moebalance.algorithms import rebalance as cpu
from moebalance.algorithms import rebalance_device as device
from moebalance.algorithms.minmax import host_lists
from moebalance.core.errors import InputError


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, float, bool]:
    """``(counts [B, L, E], copies [L, E, G], eps, strict)``: every expert on one GPU or more (some twice on one),
    loads with many ties."""
    B, L = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    E, G = draw(st.integers(1, 12)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    copies = np.zeros((L, E, G), dtype=np.int64)
    for layer in range(L):
        copies[layer, np.arange(E), rng.integers(0, G, E)] += 1
        for e in np.flatnonzero(rng.random(E) < 0.6):
            copies[layer, e, rng.integers(0, G)] += int(rng.integers(1, 3))
    counts = rng.integers(0, 4, (B, L, E)) * int(draw(st.sampled_from([1, 3, 50])))
    return counts.astype(np.int64), copies, draw(st.sampled_from([0.0, 0.05, 0.5])), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(problem=problems())
def test_loads_equal_the_cpu_rebalancer(problem: tuple[np.ndarray, np.ndarray, float, bool]) -> None:
    counts, copies, eps, strict = problem
    want = cpu.split_counts(counts, copies, eps, strict)
    got = device.split_counts(torch.from_numpy(counts), torch.from_numpy(copies), eps, strict)
    assert got.dtype == torch.int64 and got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), E=st.integers(1, 10), G=st.integers(1, 6), T=st.integers(1, 30),
       B=st.integers(1, 3), data=st.data())
def test_token_routes_equal_the_cpu_router(seed: int, E: int, G: int, T: int, B: int, data: st.DataObject) -> None:
    """Every kept pick's GPU equals the CPU router's (local picks kept home, Alg. 2, then the hand-out: own node
    first, token order), dropped picks -1; nodes that do not divide the GPUs too."""
    rng = np.random.default_rng(seed)
    gpn = data.draw(st.integers(1, G))
    K = data.draw(st.integers(1, min(E, 3)))
    copies = np.zeros((E, G), dtype=np.int64)
    copies[np.arange(E), rng.integers(0, G, E)] += 1
    for e in np.flatnonzero(rng.random(E) < 0.6):
        copies[e, rng.integers(0, G)] += int(rng.integers(1, 3))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    src = rng.integers(0, G, T).astype(np.int64)
    batch = np.sort(rng.integers(0, B, T)).astype(np.int64)
    kept = rng.random((T, K)) < 0.85
    eps, strict = data.draw(st.sampled_from([0.0, 0.1])), data.draw(st.booleans())
    starts = np.searchsorted(batch, np.arange(B + 1)).astype(np.int64)
    want = cpu.route_tokens(ids, src, starts, copies, gpn, eps, strict, kept)
    got = device.route_tokens(torch.from_numpy(ids), torch.from_numpy(src), torch.from_numpy(batch), B,
                              torch.from_numpy(copies), gpn, torch.from_numpy(kept), eps, strict)
    np.testing.assert_array_equal(got.numpy(), want)


def test_a_hand_checked_layer() -> None:
    """4 GPUs, mean load 4: expert 0 (12 picks) on GPUs 0 and 1, expert 1 (4) on GPU 2 alone. The deal gives GPUs 0
    and 1 six each; GPU 0 (most loaded, lower id) can move nothing (its only other holder is GPU 1, above the mean,
    and half the gap is 0), nor can GPU 1: the loads stay ``[6, 6, 4, 0]``."""
    counts = torch.tensor([[[12, 4]]])
    copies = torch.tensor([[[1, 1, 0, 0], [0, 0, 1, 0]]])
    assert device.split_counts(counts, copies).tolist() == [[[6, 6, 4, 0]]]
    copies = torch.tensor([[[1, 1, 0, 1], [0, 0, 1, 0]]])  # a third copy on the idle GPU: 4 each
    assert device.split_counts(counts, copies).tolist() == [[[4, 4, 4, 4]]]


@given(seed=st.integers(0, 2**31), E=st.integers(1, 10), G=st.integers(1, 5))
def test_start_deals_like_the_cpu_start(seed: int, E: int, G: int) -> None:
    rng = np.random.default_rng(seed)
    copies = rng.integers(0, 3, (1, E, G))
    copies[0, np.arange(E), rng.integers(0, G, E)] += 1
    counts = rng.integers(0, 30, (1, 1, E))
    want = np.zeros((G, E), dtype=np.int64)
    hstart, hosts = host_lists(copies[0] > 0)
    cpu.start_split(counts[0, 0], cpu.host_copies(copies[0], hstart, hosts), hstart, hosts, want)
    got = device.start_split(torch.from_numpy(counts), torch.from_numpy(copies))
    np.testing.assert_array_equal(got[0, 0].numpy(), want)


def test_bad_shapes_and_options_are_named() -> None:
    with pytest.raises(InputError, match=r"counts \[B, L, E\] \(1, 2, 3\) and copies \[L, E, G\] \(2, 4, 2\) do not"):
        device.split_counts(torch.zeros(1, 2, 3, dtype=torch.int64), torch.ones(2, 4, 2, dtype=torch.int64))
    with pytest.raises(InputError, match=r"eps \(-0.1\) must be >= 0"):
        device.split_counts(torch.zeros(1, 1, 2, dtype=torch.int64), torch.ones(1, 2, 2, dtype=torch.int64), -0.1)




def test_the_kernel_compiles_for_a100_and_h100_without_a_gpu() -> None:
    sig = {"remote_ptr": "*i64", "local_ptr": "*i64", "copies_ptr": "*i64", "loads_ptr": "*i64", "moves_ptr": "*i64",
           "t0_ptr": "*i64", "limit_ptr": "*i64", "L": "i32", "G": "i32", "E": "i32", "strict": "constexpr",
           "GP": "constexpr", "EP": "constexpr"}
    assert_compiles_for_gpus("moebalance.algorithms.rebalance_device", sig,
                             [{"strict": strict, "GP": 64, "EP": 256} for strict in (False, True)],
                             env={"TRITON_DEFAULT_FP_FUSION": "1"})
