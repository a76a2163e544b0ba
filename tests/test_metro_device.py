"""The ``metro`` search on the device (:mod:`moebalance.algorithms.metro_device`, one Triton program per (batch,
layer)) against the compiled CPU search it must equal: every GPU's picks and experts touched, ties included.

On this machine the kernel runs in Triton's interpreter (CPU tensors); a subprocess compiles it for GPU targets down
to a cubin, so a construct the interpreter accepts but the compiler rejects fails here too.
"""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from conftest import assert_compiles_for_gpus
from hypothesis import given, settings

from moebalance.algorithms import metro as cpu
from moebalance.algorithms import metro_device as device
from moebalance.core.errors import InputError

REFERENCE = Path(__file__).parent / "data" / "metro" / "reference.npz"


def _same(counts: np.ndarray, has: np.ndarray, cost: np.ndarray) -> None:
    want = cpu.split_counts(counts, has, cost)
    got = device.split_counts(torch.from_numpy(counts), torch.from_numpy(has), torch.from_numpy(cost))
    assert got[0].dtype == torch.float64 and got[0].shape == want[0].shape
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    np.testing.assert_array_equal(got[1].numpy(), want[1])


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), B=st.integers(1, 2), L=st.integers(1, 2), E=st.integers(1, 9), G=st.integers(1, 5),
       scale=st.sampled_from([1, 3, 50]), beta=st.sampled_from([3e-6, 1e-5]), launch=st.sampled_from([0.0, 5e-6]),
       kappa=st.sampled_from([0.0, 3e-7]))
def test_splits_equal_the_cpu_search(seed: int, B: int, L: int, E: int, G: int, scale: int, beta: float,
                                     launch: float, kappa: float) -> None:
    """Few distinct loads and round costs: equal GPU times everywhere, so every tie-break of the starts, the local
    search, the chains and the levelling is exercised."""
    rng = np.random.default_rng(seed)
    has = np.zeros((L, E, G), dtype=bool)
    for layer in range(L):
        has[layer, np.arange(E), rng.integers(0, G, E)] = True
        has[layer, rng.random((E, G)) < 0.4] = True
    counts = (rng.integers(0, 4, (B, L, E)) * scale).astype(np.int64)
    _same(counts, has, np.array([1e-6, beta, 1e-7, launch, kappa]))


def test_the_stored_problems() -> None:
    """Seven of the stored problems (``bench/metro_reference.py``), one call each: a DeepSeek-V3 decode layer (64 GPUs
    x 256 experts, EPLB's 256 redundant experts, 8 tokens per GPU) and six of random shapes up to 64 experts on 16
    GPUs with the cost model's decode and prefill rooflines."""
    z = np.load(REFERENCE)
    assert tuple(z["shape"][0]) == (256, 64)
    for i in (0, *range(60, 66)):
        E, G = z["shape"][i]
        _same(z["loads"][i, :E].astype(np.int64)[None, None], np.ascontiguousarray(z["has"][i, :E, :G])[None],
              z["cost"][i])


def test_a_decode_batch_where_token_balance_is_wrong() -> None:
    # Experts 0 and 1 on both of two GPUs, 3 and 1 picks, reading an expert's weights dominating (beta): each
    # expert whole on its own GPU (1 expert touched each), never split for token balance.
    picks, touched = device.split_counts(torch.tensor([[[3, 1]]]), torch.ones(1, 2, 2, dtype=torch.bool),
                                         torch.tensor([8.9e-8, 2.6e-5, 8.6e-9, 0.0, 0.0], dtype=torch.float64))
    assert sorted(picks[0, 0].tolist()) == [1.0, 3.0] and touched[0, 0].tolist() == [1.0, 1.0]
    # no load: nothing served, nothing touched
    picks, touched = device.split_counts(torch.zeros(1, 1, 2, dtype=torch.int64), torch.ones(1, 2, 2, dtype=torch.bool),
                                         torch.ones(5, dtype=torch.float64))
    assert not picks.any() and not touched.any()


def test_bad_inputs_are_named() -> None:
    ones = torch.ones(1, 2, 2, dtype=torch.bool)
    with pytest.raises(InputError, match=r"counts \[B, L, E\] \(1, 1, 3\) and has \[L, E, G\] \(1, 2, 2\) do not"):
        device.split_counts(torch.ones(1, 1, 3, dtype=torch.int64), ones, torch.ones(5, dtype=torch.float64))
    with pytest.raises(InputError, match="cost must be 5 floats"):
        device.split_counts(torch.ones(1, 1, 2, dtype=torch.int64), ones, torch.ones(4, dtype=torch.float64))




def test_the_kernel_compiles_for_a100_and_h100_without_a_gpu() -> None:
    """Small tiles: the same code paths as 64 x 256, which is slow to compile (once per shape, then cached)."""
    sig = {"counts_ptr": "*i64", "has_ptr": "*i8", "cost_ptr": "*fp64", "take_ptr": "*i64", "start_ptr": "*i64",
           "best_ptr": "*i64", "picks_ptr": "*fp64", "touched_ptr": "*fp64", "L": "i32", "G": "i32", "E": "i32",
           "GP": "constexpr", "EP": "constexpr"}
    assert_compiles_for_gpus("moebalance.algorithms.metro_device", sig, [{"GP": 8, "EP": 32}],
                             {"enable_fp_fusion": False}, timeout=900)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run where one is)")
def test_on_cuda_the_stored_problems_equal_the_cpu_search() -> None:
    z = np.load(REFERENCE)
    for i in range(len(z["shape"])):
        E, G = z["shape"][i]
        counts = z["loads"][i, :E].astype(np.int64)[None, None]
        has = np.ascontiguousarray(z["has"][i, :E, :G])[None]
        want = cpu.split_counts(counts, has, z["cost"][i])
        got = device.split_counts(torch.from_numpy(counts).cuda(), torch.from_numpy(has).cuda(),
                                  torch.from_numpy(z["cost"][i]).cuda())
        np.testing.assert_array_equal(got[0].cpu().numpy(), want[0])
        np.testing.assert_array_equal(got[1].cpu().numpy(), want[1])
