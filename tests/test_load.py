"""Load matrices, token-level traces and their files."""

from __future__ import annotations

import numpy as np
import pytest

from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, check_counts, parse_batch_range, read_load, write_load
from moebalance.core.trace import RoutingTrace


def small_trace() -> RoutingTrace:
    # 4 tokens, 2 layers, top-2, 3 experts, 2 GPUs, 2 batches.
    topk = [
        [[0, 1], [2, 0]],
        [[1, 2], [2, 1]],
        [[0, 2], [0, 1]],
        [[0, 1], [2, 0]],
    ]
    return RoutingTrace(topk, src_gpu=[0, 1, 1, 0], batch=[0, 0, 1, 1], num_experts=3)


def test_trace_statistics_by_hand() -> None:
    tr = small_trace()
    # batch 0: layer 0 picks {0,1},{1,2} -> [1,2,1]; layer 1 {2,0},{2,1} -> [1,1,2]
    # batch 1: layer 0 {0,2},{0,1} -> [2,1,1]; layer 1 {0,1},{2,0} -> [2,1,1]
    assert tr.counts().tolist() == [[[1, 2, 1], [1, 1, 2]], [[2, 1, 1], [2, 1, 1]]]
    co = tr.coactivation()
    # layer 0 pairs: (0,1) tokens 0 and 3, (1,2) token 1, (0,2) token 2
    assert co[0].tolist() == [[3, 2, 1], [2, 3, 1], [1, 1, 2]]
    assert np.array_equal(co, co.transpose(0, 2, 1))
    tr_ = tr.transitions()
    # token 0: {0,1} -> {2,0}: pairs (0,2),(0,0),(1,2),(1,0)
    assert tr_.shape == (1, 3, 3) and tr_.sum() == 4 * 4
    # expert 0 in layer 0 -> expert 2 in layer 1: tokens 0 ({0,1}->{2,0}) and 3 (same); token 2 goes {0,2}->{0,1}
    assert tr_[0, 0, 2] == 2
    assert tr_[0, 2, 1] == 2  # token 1 ({1,2}->{2,1}) and token 2 ({0,2}->{0,1})
    dem = tr.demand(2)
    # GPU 0 holds tokens 0 and 3, GPU 1 tokens 1 and 2
    assert dem[0].tolist() == [[2, 2, 0], [1, 1, 2]]
    sub = tr.select_batches(1, 2)
    assert sub.num_tokens == 2 and sub.batch.tolist() == [0, 0]
    assert np.array_equal(sub.counts()[0], tr.counts()[1])


def test_transitions_match_a_loop() -> None:
    rng = np.random.default_rng(3)
    T, L, K, E = 50, 4, 3, 7
    topk = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)])
    tr = RoutingTrace(topk, np.zeros(T, int), np.zeros(T, int), num_experts=E)
    expected = np.zeros((L - 1, E, E), int)
    co = np.zeros((L, E, E), int)
    for t in range(T):
        for layer in range(L):
            for i in topk[t, layer]:
                for j in topk[t, layer]:
                    co[layer, i, j] += 1
                if layer < L - 1:
                    for j in topk[t, layer + 1]:
                        expected[layer, i, j] += 1
    assert np.array_equal(tr.transitions(), expected)
    assert np.array_equal(tr.coactivation(), co)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"topk_ids": [[[0, 3]]]}, "ids must lie in"),
        ({"topk_ids": [[[1, 1]]]}, "same expert twice"),
        ({"batch": [1, 0]}, "non-decreasing"),
        ({"src_gpu": [0]}, "one entry per token"),
        ({"src_gpu": [-1, 0]}, "ranks must be >= 0"),
        ({"topk_ids": [[[0.5, 1]]]}, "must hold integers"),
    ],
)
def test_bad_traces(kwargs: dict, fragment: str) -> None:
    base = {"topk_ids": [[[0, 1]], [[1, 2]]], "src_gpu": [0, 1], "batch": [0, 0], "num_experts": 3}
    if "topk_ids" in kwargs and len(kwargs["topk_ids"]) == 1:
        base.update(src_gpu=[0], batch=[0])
    base.update(kwargs)
    with pytest.raises(InputError, match=fragment):
        RoutingTrace(**base)


@pytest.mark.parametrize(
    ("arr", "fragment"),
    [
        (np.array([[[1.0, np.nan]]]), "must be finite"),
        (np.array([[[1, -2]]]), "non-negative"),
        (np.array([[[1.5, 2]]]), "whole numbers"),
        (np.zeros(3, int), "expected \\[L, E\\] or \\[B, L, E\\]"),
        (np.zeros((1, 1, 1, 1), int), "expected"),
        (np.zeros((0, 3), int), "at least 1"),
        (np.array([["a"]]), "dtype"),
        (np.array([[True]]), "dtype"),
    ],
)
def test_bad_counts(arr: np.ndarray, fragment: str) -> None:
    with pytest.raises(InputError, match=fragment):
        check_counts(arr)


def test_two_d_is_one_batch_and_floats_with_whole_values_accepted() -> None:
    assert check_counts(np.array([[1.0, 2.0]])).shape == (1, 1, 2)
    assert check_counts(np.array([[1.0, 2.0]])).dtype == np.int64


def test_npz_round_trip_with_trace(tmp_path) -> None:
    tr = small_trace()
    lm = LoadMatrix(tr.counts(), tr, preset="olmoe-1b-7b")
    write_load(tmp_path / "t.npz", lm)
    back = read_load(tmp_path / "t.npz")
    assert back.preset == "olmoe-1b-7b"
    assert back.trace is not None and np.array_equal(back.trace.topk_ids, tr.topk_ids)
    assert np.array_equal(back.counts, lm.counts)


def test_counts_must_match_trace(tmp_path) -> None:
    tr = small_trace()
    counts = tr.counts()
    counts[1, 0, 2] += 1
    with pytest.raises(InputError, match=r"counts\[1, 0, 2\] is 2 but topk_ids routes 1"):
        LoadMatrix(counts, tr)


def test_npz_without_counts_recomputes_them(tmp_path) -> None:
    tr = small_trace()
    np.savez(tmp_path / "t.npz", topk_ids=tr.topk_ids, src_gpu=tr.src_gpu, batch=tr.batch)
    assert np.array_equal(read_load(tmp_path / "t.npz").counts, tr.counts())


def test_pickle_is_never_loaded(tmp_path) -> None:
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="pickled"):
        read_load(tmp_path / "o.npy")


def test_truncated_file(tmp_path) -> None:
    np.save(tmp_path / "c.npy", np.ones((4, 5, 6), dtype=np.int64))
    data = (tmp_path / "c.npy").read_bytes()
    (tmp_path / "c.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cannot read"):
        read_load(tmp_path / "c.npy")


def test_split_and_ranges() -> None:
    lm = LoadMatrix(np.ones((10, 2, 3), int))
    train, test = lm.split(0.5)
    assert (train.num_batches, test.num_batches) == (5, 5)
    train, test = lm.split(0.99)
    assert (train.num_batches, test.num_batches) == (9, 1)
    assert lm.split(1.0)[1] is lm
    with pytest.raises(InputError, match="none can be held out"):
        LoadMatrix(np.ones((1, 2, 3), int)).split(0.5)
    assert parse_batch_range("2:", 10) == (2, 10)
    assert parse_batch_range(":-2", 10) == (0, 8)
    with pytest.raises(InputError, match="empty"):
        parse_batch_range("5:2", 10)


def test_header_claiming_a_huge_array(tmp_path) -> None:
    # a valid header for a 2**60-element array followed by a few bytes: numpy would try to allocate it
    path = tmp_path / "huge.npy"
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<i8", "fortran_order": False, "shape": (2**20, 2**20, 2**20)})
        fh.write(b"\0" * 64)
    with pytest.raises(InputError, match="cannot read"):
        read_load(path)


def test_counts_beyond_int64() -> None:
    with pytest.raises(InputError, match="below 2\\*\\*62"):
        check_counts(np.array([[1.0, 2.0**63]]))
    with pytest.raises(InputError, match="below 2\\*\\*62"):
        check_counts(np.array([[1, 2**63]], dtype=np.uint64))


def test_bundled_traces_load_and_match_their_recipes() -> None:
    import importlib.util
    from pathlib import Path

    from moebalance.core.load import bundled_names, read_load
    from moebalance.models import get_model
    from moebalance.workloads.synth import synthesize

    spec = importlib.util.spec_from_file_location("make_bundled_data", Path(__file__).parents[1] / "tools" / "make_bundled_data.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    # every bundled trace is synthetic and has a recipe, except the real one (tests/test_bundled.py checks it)
    assert bundled_names() == sorted([*tool.RECIPES, "esft-law"])
    for name, (preset, batches, tokens, gpus, token_level) in tool.RECIPES.items():
        load = read_load(f"bundled:{name}")
        again = synthesize(get_model(preset), num_batches=batches, tokens_per_batch=tokens, num_gpus=gpus, seed=0,
                           token_level=token_level)
        assert np.array_equal(load.counts, again["counts"]) and load.preset == preset
        assert load.model is get_model(preset)
        assert (load.trace is not None) == token_level
        if load.trace is not None:
            assert np.array_equal(load.trace.topk_ids, again["topk_ids"])
    with pytest.raises(InputError, match="no bundled trace 'nope'; bundled: deepseek-v3-8x8"):
        read_load("bundled:nope")
