"""Large traces: compact ids, one-pass counting kernels, .npz members read in pieces or memory-mapped, replay in
chunks of batches, and planning that leaves dense layers out.

The kernels are checked against plain Python loops over the picks (an independent reading of each definition),
the chunked replay against the same replay in one chunk, and the readers against the arrays written.
"""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moebalance.core import tally
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_load, write_load
from moebalance.core.trace import RoutingTrace
from moebalance.policies import make_plan, plan_with
from moebalance.routing import simulate
from moebalance.routing.simulate import evaluate


def _random_trace(rng: np.random.Generator, T: int, L: int, K: int, E: int, G: int, B: int) -> RoutingTrace:
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)]) if T else \
        np.zeros((0, L, K), dtype=np.int64)
    return RoutingTrace(ids, rng.integers(0, G, T), np.sort(rng.integers(0, B, T)), num_experts=E, num_batches=B)


def _loops(tr: RoutingTrace, G: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """counts, co-activation, transitions and demand by plain loops over (token, layer, pick)."""
    T, L, K = tr.topk_ids.shape
    E, B = tr.num_experts, tr.num_batches
    counts, co = np.zeros((B, L, E), np.int64), np.zeros((L, E, E), np.int64)
    trans, demand = np.zeros((max(L - 1, 0), E, E), np.int64), np.zeros((L, G, E), np.int64)
    for t in range(T):
        for layer in range(L):
            for i in range(K):
                a = int(tr.topk_ids[t, layer, i])
                counts[tr.batch[t], layer, a] += 1
                demand[layer, tr.src_gpu[t], a] += 1
                for j in range(K):
                    co[layer, a, int(tr.topk_ids[t, layer, j])] += 1
                    if layer + 1 < L:
                        trans[layer, a, int(tr.topk_ids[t, layer + 1, j])] += 1
    return counts, co, trans, demand


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 30), st.integers(1, 4), st.integers(1, 4), st.integers(4, 9), st.integers(1, 3),
       st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_kernels_equal_loops_over_the_picks(T: int, L: int, K: int, E: int, G: int, B: int, seed: int) -> None:
    K = min(K, E)
    tr = _random_trace(np.random.default_rng(seed), T, L, K, E, G, B)
    counts, co, trans, demand = _loops(tr, G)
    np.testing.assert_array_equal(tr.counts(), counts)
    np.testing.assert_array_equal(tr.coactivation(), co)
    np.testing.assert_array_equal(tr.transitions(), trans)
    np.testing.assert_array_equal(tr.demand(G), demand)


def test_ids_are_held_compactly_whatever_was_given() -> None:
    ids64 = np.array([[[0, 3]], [[3, 1]]], dtype=np.int64)
    tr = RoutingTrace(ids64, [0, 0], [0, 0], num_experts=4)
    assert tr.topk_ids.dtype == np.int16 and tr.topk_ids.tolist() == ids64.tolist()
    assert RoutingTrace(ids64.astype(np.uint8), [0, 0], [0, 0], num_experts=4).topk_ids.dtype == np.int16
    big = RoutingTrace(np.array([[[40000, 1]]]), [0], [0], num_experts=40001)
    assert big.topk_ids.dtype == np.int32 and int(big.topk_ids[0, 0, 0]) == 40000
    assert big.counts()[0, 0, 40000] == 1
    assert tally.id_dtype(32767) == np.int16 and tally.id_dtype(32768) == np.int32


@pytest.mark.parametrize(("ids", "E", "fragment"), [
    ([[[0, 70000]]], 8, "expert id 70000"),  # beyond int16: refused before a cast could wrap it round
    ([[[0, -1]]], 8, "expert id -1"),
    ([[[2, 2]]], 8, "same expert twice in layer 0"),
    ([[[0, 1]], [[1, 8]]], 8, "expert id 8"),
])
def test_bad_ids_are_named(ids: list, E: int, fragment: str) -> None:
    n = len(ids)
    with pytest.raises(InputError, match=fragment):
        RoutingTrace(np.asarray(ids, dtype=np.int64), [0] * n, [0] * n, num_experts=E)


def test_a_repeated_pick_is_found_in_any_token_and_layer() -> None:
    ids = np.tile(np.arange(3, dtype=np.int64), (50, 4, 1))
    ids[37, 2] = [1, 2, 1]
    with pytest.raises(InputError, match="token 37 picks the same expert twice in layer 2"):
        RoutingTrace(ids, np.zeros(50, np.int64), np.zeros(50, np.int64), num_experts=3)


def test_batch_ranges_are_views_with_the_same_statistics() -> None:
    rng = np.random.default_rng(3)
    tr = _random_trace(rng, 60, 3, 2, 6, 2, 5)
    load = LoadMatrix(tr.counts(), tr)
    part = load.select_batches(1, 4)
    assert np.shares_memory(part.trace.topk_ids, tr.topk_ids)  # no copy of the ids
    again = RoutingTrace(part.trace.topk_ids, part.trace.src_gpu, part.trace.batch, num_experts=6, num_batches=3)
    np.testing.assert_array_equal(part.counts, again.counts())
    np.testing.assert_array_equal(part.trace.coactivation(), again.coactivation())


def test_batch_chunks_cover_every_batch_within_the_pick_budget() -> None:
    batch = np.repeat(np.arange(6), [3, 0, 5, 2, 7, 1])  # batch 1 is empty
    tr = RoutingTrace(np.zeros((18, 2, 1), np.int64), np.zeros(18, np.int64), batch, num_experts=1)
    chunks = list(tr.batch_chunks(max_picks=16))  # 2 picks per token: at most 8 tokens per chunk
    assert chunks == [(0, 3), (3, 4), (4, 6)]  # 3 + 0 + 5 tokens, then 2 (with the next 7 it would be 9), 7 + 1
    assert list(tr.batch_chunks(max_picks=10**9)) == [(0, 6)]
    assert list(tr.batch_chunks(max_picks=1)) == [(b, b + 1) for b in range(6)]  # a batch above the budget alone


# ----- .npz reading ----------------------------------------------------------------------------------------------

def _trace_arrays(E: int = 300) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tr = _random_trace(rng, 40, 3, 4, E, 4, 3)
    return {"counts": tr.counts(), "topk_ids": tr.topk_ids.astype(np.int64), "src_gpu": tr.src_gpu,
            "batch": tr.batch}


def test_uncompressed_compact_ids_are_memory_mapped(tmp_path) -> None:
    arrays = _trace_arrays()
    arrays["topk_ids"] = arrays["topk_ids"].astype(np.int16)
    path = tmp_path / "plain.npz"
    np.savez(path, **arrays)  # stored, not deflated
    load = read_load(path)
    ids = load.trace.topk_ids
    assert ids.dtype == np.int16 and not ids.flags.owndata and not ids.flags.writeable  # a read-only file view
    np.testing.assert_array_equal(ids, arrays["topk_ids"])
    np.testing.assert_array_equal(load.counts, arrays["counts"])


def test_wide_ids_are_converted_in_pieces(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moebalance.core import load as load_module

    monkeypatch.setattr(load_module, "_CHUNK_BYTES", 200)  # many pieces of a few tokens each
    arrays = _trace_arrays()
    for name, saver in (("deflated.npz", np.savez_compressed), ("stored.npz", np.savez)):
        saver(tmp_path / name, **arrays)
        got = read_load(tmp_path / name)
        assert got.trace.topk_ids.dtype == np.int16
        np.testing.assert_array_equal(got.trace.topk_ids, arrays["topk_ids"])
    # without counts, E comes from the largest id (a first pass over the pieces)
    np.savez_compressed(tmp_path / "ids_only.npz", **{k: v for k, v in arrays.items() if k != "counts"})
    got = read_load(tmp_path / "ids_only.npz")
    assert got.num_experts == int(arrays["topk_ids"].max()) + 1
    np.testing.assert_array_equal(got.counts, arrays["counts"][:, :, :got.num_experts])


def test_wide_ids_beyond_the_compact_type_are_an_error_not_a_wrap(tmp_path, monkeypatch) -> None:
    from moebalance.core import load as load_module

    monkeypatch.setattr(load_module, "_CHUNK_BYTES", 200)
    arrays = _trace_arrays()
    arrays["topk_ids"][-1, 0, 0] = 65536 + 5  # int16 would read 5, a valid id
    np.savez_compressed(tmp_path / "bad.npz", **arrays)
    with pytest.raises(InputError) as info:
        read_load(tmp_path / "bad.npz")
    assert str(info.value) == f"{str(tmp_path / 'bad.npz')!r}: topk_ids holds expert id 65541; ids must lie in [0, 300)"
    ids_only = {k: v for k, v in arrays.items() if k != "counts"}
    ids_only["topk_ids"] = ids_only["topk_ids"].copy()
    ids_only["topk_ids"][0, 0, 0] = 1 << 40  # without counts, the largest id would set E: named, not allocated
    np.savez_compressed(tmp_path / "huge.npz", **ids_only)
    with pytest.raises(InputError, match="topk_ids holds expert id 1099511627776"):
        read_load(tmp_path / "huge.npz")


def test_large_compressed_ids_are_spilled_to_a_mapped_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compressed (or wide) ids above the spill size go to an unlinked temporary file, read-only and mapped, equal
    to the stored ids; statistics over them equal those of the arrays in memory."""
    from moebalance.core import load as load_module

    monkeypatch.setattr(load_module, "_CHUNK_BYTES", 200)
    monkeypatch.setattr(load_module, "SPILL_BYTES", 100)
    arrays = _trace_arrays()
    for name, ids in (("deflated16.npz", arrays["topk_ids"].astype(np.int16)), ("deflated64.npz", arrays["topk_ids"])):
        np.savez_compressed(tmp_path / name, **{**arrays, "topk_ids": ids})
        got = read_load(tmp_path / name).trace
        assert got is not None
        assert tally._file_mapping(got.topk_ids) is not None and not got.topk_ids.flags.writeable
        np.testing.assert_array_equal(got.topk_ids, arrays["topk_ids"])
        np.testing.assert_array_equal(got.counts(), arrays["counts"])


def test_a_spill_that_finds_no_disk_is_one_line_naming_tmpdir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moebalance.core import load as load_module

    class FullDisk:  # a temporary file whose writes fail as on a full disk
        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(load_module, "SPILL_BYTES", 100)
    monkeypatch.setattr(load_module.tempfile, "TemporaryFile", lambda **kw: FullDisk())
    arrays = _trace_arrays()
    np.savez_compressed(tmp_path / "t.npz", **arrays)
    with pytest.raises(InputError, match=r"expert ids \(above the 0 MB held in memory\) could not be spilled to .* "
                                         r"\(No space left on device\); free that much disk there or set TMPDIR"):
        read_load(tmp_path / "t.npz")


def test_a_truncated_member_is_named_not_a_reshape_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moebalance.core import load as load_module

    monkeypatch.setattr(load_module, "_CHUNK_BYTES", 200)
    arrays = _trace_arrays()
    path = tmp_path / "cut.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, value in arrays.items():
            with zf.open(f"{name}.npy", "w") as fh:
                np.lib.format.write_array(fh, value[:-1] if name == "topk_ids" else value)
    with zipfile.ZipFile(path) as zf:  # the header of 39 tokens, patched to promise 40
        members = {n: zf.read(n) for n in zf.namelist()}
    members["topk_ids.npy"] = members["topk_ids.npy"].replace(b"(39, ", b"(40, ", 1)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    with pytest.raises(InputError, match=r"topk_ids ends after about 39 of its 40 tokens \(is the file damaged\?\)"):
        read_load(path)


def test_counts_walk_the_ids_in_chunks_and_hand_mapped_pages_back(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every count over many small chunks equals one pass; the pages of a mapped trace leave the process's
    resident set after a walk (the file's mapping stays readable), and an array in memory is never touched."""
    monkeypatch.setattr(tally, "CHUNK_PICKS", 7)
    rng = np.random.default_rng(3)
    tr = _random_trace(rng, 60, 4, 3, 9, 5, 4)
    ids = tr.topk_ids
    assert list(tally.token_chunks(ids, 7))[:2] == [(0, 1), (1, 2)]  # 12 picks a token: one token a chunk
    want_counts = np.zeros((4, 4, 9), dtype=np.int64)
    for t in range(60):
        for layer in range(4):
            for e in ids[t, layer]:
                want_counts[tr.batch[t], layer, e] += 1
    np.testing.assert_array_equal(tally.count_picks(ids, tr.batch, 4, 9), want_counts)
    pairs = tally.pair_counts(ids, 9)
    assert pairs.sum() == 60 * 4 * 3 * 3 and np.array_equal(np.einsum("lii->li", pairs), want_counts.sum(axis=0))
    assert tally.transition_counts(ids, 9).sum() == 60 * 3 * 3 * 3
    kept = ids.copy()
    tally.release(kept)  # memory an array owns: untouched
    np.testing.assert_array_equal(kept, ids)
    big = np.tile(np.arange(8, dtype=np.int16).reshape(1, 1, 8), (300_000, 2, 1))  # 9.6 MB of ids
    np.savez(tmp_path / "big.npz", topk_ids=big, src_gpu=np.zeros(300_000, dtype=np.int64),
             batch=np.zeros(300_000, dtype=np.int64))
    np.savez(tmp_path / "small.npz", topk_ids=big[:10], src_gpu=np.zeros(10, dtype=np.int64),
             batch=np.zeros(10, dtype=np.int64))
    monkeypatch.setattr(tally, "CHUNK_PICKS", 1 << 18)

    def resident_kb() -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("RssFile:"))

    read_load(tmp_path / "small.npz").trace.counts()  # every code path warm
    before = resident_kb()
    mapped = read_load(tmp_path / "big.npz").trace  # checked and counted on reading: walks of all 9.6 MB
    assert mapped is not None and tally._file_mapping(mapped.topk_ids) is not None
    counts = mapped.counts()  # one more walk
    assert counts[0, 0].tolist() == [300_000] * 8
    assert resident_kb() - before < 4_000  # the chunks' pages went back: well under the 9.4 MB walked
    assert int(mapped.topk_ids[-1, 1, 7]) == 7  # and the mapping still reads


def test_written_traces_store_compact_ids(tmp_path) -> None:
    arrays = _trace_arrays()
    write_load(tmp_path / "t.npz", LoadMatrix.from_arrays(arrays))
    with zipfile.ZipFile(tmp_path / "t.npz") as zf, zf.open("topk_ids.npy") as fh:
        assert np.lib.format.read_magic(fh) == (1, 0)
        _, _, dtype = np.lib.format.read_array_header_1_0(fh)
    assert dtype == np.int16


# ----- replay in chunks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("router", ["uniform", "minmax", "rebalance"])
def test_replay_in_chunks_equals_one_chunk(router: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic routers give the same loads, traffic and per-batch all-to-all times in chunks of batches."""
    load = read_load("bundled:olmoe-1b-7b-tokens").select_batches(0, 12)
    plan, _ = make_plan("eplb", load, Cluster(num_nodes=2, gpus_per_node=4), Budget(slots_per_gpu=10))
    whole = evaluate(plan, load, router, bytes_per_copy=4096)
    per_batch = load.trace.num_tokens // load.num_batches * load.num_layers * load.trace.top_k
    monkeypatch.setattr(simulate, "_CHUNK_PICKS", per_batch * 3 + 1)  # chunks of three batches
    chunked = evaluate(plan, load, router, bytes_per_copy=4096)
    assert chunked.as_dict() == whole.as_dict()
    np.testing.assert_array_equal(chunked.traffic.a2a_seconds, whole.traffic.a2a_seconds)


def test_random_replay_in_chunks_counts_every_pick_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from moebalance.routing import get_router

    load = read_load("bundled:olmoe-1b-7b-tokens").select_batches(0, 8)
    plan, _ = make_plan("eplb", load, Cluster(num_nodes=2, gpus_per_node=4), Budget(slots_per_gpu=10))
    whole = evaluate(plan, load, "random")
    monkeypatch.setattr(simulate, "_CHUNK_PICKS", 1)  # one batch per chunk
    loads, moved, whole_tokens = simulate.replay_loads(plan, load, get_router("random"), np.random.default_rng(0),
                                                        with_traffic=True)
    assert whole_tokens and moved is not None
    np.testing.assert_array_equal(loads.sum(axis=2), load.counts.sum(axis=2))  # every pick served once
    token_layers = load.trace.num_tokens * load.num_layers  # each sends at least one copy (maybe to itself)
    assert token_layers <= moved.local + moved.intra_node + moved.inter_node <= token_layers * load.trace.top_k
    assert int(moved.matrix.sum()) == moved.local + moved.intra_node + moved.inter_node
    assert abs(evaluate(plan, load, "random").balancedness - whole.balancedness) < 0.02  # other draws, same law


# ----- dense layers ----------------------------------------------------------------------------------------------

def _with_dense(L: int = 6, E: int = 16, dense: tuple[int, ...] = (0, 1), seed: int = 0) -> LoadMatrix:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 100, (4, L, E)) * (rng.random((1, L, E)) < 0.7) + 1
    counts[:, list(dense)] = 0
    return LoadMatrix(counts)


@pytest.mark.parametrize(("policy", "budget"), [("eplb", Budget(slots_per_gpu=6)), ("craft", Budget(replicas_per_gpu=4)),
                                                ("greedy", Budget(slots_per_gpu=6)), ("craft", Budget(slots_per_gpu=5))])
def test_dense_layers_get_no_copies_and_the_budget_goes_to_moe_layers(policy: str, budget: Budget) -> None:
    load = _with_dense()
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    result = plan_with(policy, load, cluster, budget)
    plan = result.placement
    assert plan.params["dense_layers"] == [0, 1]
    for layer in (0, 1):  # contiguous blocks of E / G = 4 experts, no copy
        assert plan.gpu_experts[layer] == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    moe = LoadMatrix(load.counts[:, 2:])
    alone, _ = make_plan(policy, moe, cluster, budget)
    assert plan.gpu_experts[2:] == alone.gpu_experts  # the MoE layers are planned exactly as on their own
    assert plan.extra_replicas == alone.extra_replicas
    result.capacity.check(plan, chosen_replicas_per_gpu=result.diagnostics.chosen_replicas_per_gpu)
    assert evaluate(plan, load).balancedness == pytest.approx(evaluate(alone, moe).balancedness)


def test_dense_blocks_keep_per_gpu_memory_even() -> None:
    """E = 10 on 4 GPUs: blocks of 3, 3, 2, 2; each dense layer puts its larger blocks where the fewest slots are."""
    load = _with_dense(L=4, E=10, dense=(0, 1))
    plan, _ = make_plan("contiguous", load, Cluster(num_nodes=1, gpus_per_node=4), Budget(replicas_per_gpu=0))
    per_gpu = plan.slots().sum(axis=0)
    assert per_gpu.tolist() == [10, 10, 10, 10]  # MoE layers 3,3,2,2 twice; dense layers 2,2,3,3 twice
    assert plan.gpu_experts[0] == ((0, 1), (2, 3), (4, 5, 6), (7, 8, 9))


def test_named_dense_layers_and_a_window_idle_layer() -> None:
    load = _with_dense(dense=(0,))
    load = LoadMatrix(np.concatenate([load.counts[:2] * 0 + load.counts[:2] * (np.arange(6) != 3)[None, :, None],
                                      load.counts[2:]]))
    window = load.select_batches(0, 2)  # layer 3 idle here, busy later
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    guessed, _ = make_plan("eplb", window, cluster, Budget(slots_per_gpu=6))
    assert guessed.params["dense_layers"] == [0, 3]
    named, _ = make_plan("eplb", window, cluster, Budget(slots_per_gpu=6), dense_layers=[0])
    assert named.params["dense_layers"] == [0] and named.slots()[3].tolist() == [6, 6, 6, 6]
    with pytest.raises(InputError, match="dense_layers"):
        make_plan("eplb", window, cluster, Budget(slots_per_gpu=6), dense_layers=[7])


def test_replay_reports_progress_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    load = read_load("bundled:olmoe-1b-7b-tokens").select_batches(0, 7)
    plan, _ = make_plan("eplb", load, Cluster(num_nodes=2, gpus_per_node=4), Budget(slots_per_gpu=10))
    per_batch = load.trace.num_tokens // load.num_batches * load.num_layers * load.trace.top_k
    monkeypatch.setattr(simulate, "_CHUNK_PICKS", per_batch * 2)  # chunks of two batches
    seen: list[int] = []
    evaluate(plan, load, "uniform", on_batches=seen.append)
    assert seen == [2, 2, 2, 1]



def test_kernel_inputs_are_checked_and_routers_refuse_another_models_trace() -> None:
    from moebalance.core.errors import PlanError
    from moebalance.routing import get_router

    with pytest.raises(InputError, match="expert id 1000"):  # int16 already, still range-checked
        tally.as_ids(np.array([[[1000]]], dtype=np.int16), 4)
    load = read_load("bundled:olmoe-1b-7b-tokens").select_batches(0, 2)
    plan, _ = make_plan("contiguous", LoadMatrix(np.ones((1, 2, 8), dtype=np.int64)),
                        Cluster(num_nodes=1, gpus_per_node=2), Budget(replicas_per_gpu=0))
    with pytest.raises(PlanError, match="route a trace of the plan's model"):
        get_router("uniform").assign_tokens(plan, load.trace, np.random.default_rng(0))


def test_every_layer_dense_and_loads_with_layer_ids() -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    idle, _ = make_plan("eplb", LoadMatrix(np.zeros((2, 3, 16), dtype=np.int64)), cluster, Budget(slots_per_gpu=6))
    assert idle.params["dense_layers"] == [0, 1, 2] and idle.extra_replicas == 0  # nothing to plan: no copies
    counts = _with_dense(L=4, dense=()).counts
    counts[:, 2] = 0  # a layer without picks, but the load names the model's layers: it is not a dense layer
    named = LoadMatrix(counts, layer_ids=np.array([1, 3, 5, 7]))
    plan, _ = make_plan("eplb", named, cluster, Budget(slots_per_gpu=6))
    assert "dense_layers" not in plan.params and plan.slots().min() == 6
    partly, _ = make_plan("grace", LoadMatrix(_with_dense(L=5, dense=(0, 3)).counts), cluster,
                          Budget(slots_per_gpu=6), grouping="uniform")
    assert partly.params["planned_layers"] == [1, 2, 4] and partly.params["dense_layers"] == [0, 3]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 12), k=st.integers(1, 14), seed=st.integers(0, 2**31 - 1),
       levels=st.integers(1, 4))
def test_top_k_is_the_stable_sorts_first_k(rows: int, cols: int, k: int, seed: int, levels: int) -> None:
    """``tally.top_k`` equals a stable descending sort's first ``k`` columns, ties (few distinct levels) to the lower
    column, and ``k`` beyond the columns gives them all."""
    scores = np.random.default_rng(seed).integers(0, levels, (rows, cols)).astype(np.float64) / 3
    want = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(tally.top_k(scores, k), want)


def test_top_k_by_hand_and_its_refusals() -> None:
    scores = np.array([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    np.testing.assert_array_equal(tally.top_k(scores, 3), [[1, 2, 4], [4, 0, 1]])
    for bad, k in ((np.ones(3), 1), (np.ones((2, 2)), 0), (np.array([[np.nan, 1.0]]), 1)):
        with pytest.raises(InputError, match="top_k"):
            tally.top_k(bad, k)
