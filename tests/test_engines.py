"""Engines' files in and out: written here exactly as the engines write them, field by field.

Sources (also in the modules' docstrings and docs/formats.md): SGLang ``python/sglang/srt/eplb/expert_distribution.py``
(the ``stat`` dump: ``torch.save({"rank", "logical_count" int32 [B, L, E], "average_utilization_rate_over_window"})``)
and ``expert_location.py`` (``--init-expert-location``: ``physical_to_logical_map [L, P]``, the only key);
TensorRT-LLM ``tensorrt_llm/_torch/expert_statistic.py`` (``meta_info.json`` and ``rank{r}.safetensors`` keyed
``"{iter}_{layer}"``, int64 ``[E]``) and ``MoeLoadBalancerConfig`` (``num_slots``, ``initial_global_assignments``,
``layer_updates_per_iter``).
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import assert_user_error, run_cli
from safetensors.numpy import save_file

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix, read_load
from moebalance.core.plan import Placement, read_plan, write_plan
from moebalance.engines import detect, pad_plan, read_any_load, read_any_plan, slot_table, stream
from moebalance.engines.sglang import read_dumps, read_stat
from moebalance.engines.vllm import read_routed_experts
from moebalance.policies import Budget, make_plan
from moebalance.routing.simulate import evaluate

DATA = Path(__file__).parent / "data" / "sglang-deepseek-v3"
L, E, DENSE = 5, 8, (0, 1)  # a model of 5 decoder layers, the first two dense


def _counts(seed: int, batches: int = 4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 50, size=(batches, L, E)) * (rng.random((1, 1, E)) < 0.8) + rng.integers(0, 3, (batches, L, E))
    c[:, list(DENSE)] = 0
    return c.astype(np.int64)


# ---------------------------------------------------------------------------------------------------------- SGLang

def write_stat_dump(path: Path, counts: np.ndarray, ring: int = 0) -> None:
    """As SGLang's rank 0 writes a stat dump: the ring buffer (``ring`` passes that never ran are zero rows, the
    order rotated), int32, summed over ranks."""
    rows = np.concatenate([np.zeros((ring, *counts.shape[1:]), np.int64), counts])
    rows = np.roll(rows, 2, axis=0)
    torch.save({"rank": 0, "logical_count": torch.from_numpy(rows.astype(np.int32)),
                "average_utilization_rate_over_window": None}, path)


def test_sglang_stat_dump_pt(tmp_path: Path) -> None:
    counts = _counts(0)
    path = tmp_path / "expert_distribution_recorder_1719999999.123.pt"
    write_stat_dump(path, counts, ring=3)
    load = read_any_load(path)
    # the passes that never ran are dropped; the order is the ring's (rotated); dense layers stay zero rows
    assert load.counts.shape == (4, L, E) and load.counts.dtype == np.int64
    assert sorted(map(tuple, load.counts.reshape(4, -1))) == sorted(map(tuple, counts.reshape(4, -1)))
    assert (load.counts[:, list(DENSE)] == 0).all()
    assert np.array_equal(load.counts.sum(axis=0), counts.sum(axis=0))


def test_sglang_logical_count_json_and_2d(tmp_path: Path) -> None:
    counts = _counts(1)
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"logical_count": counts.sum(axis=0).tolist()}))  # [L, E], as the published files
    load = read_any_load(path)
    assert load.counts.shape == (1, L, E) and np.array_equal(load.counts[0], counts.sum(axis=0))


@pytest.mark.parametrize("name", ["prefill_in1024.json", "decode_in1000out1000.json"])
def test_sglang_published_files_load_as_they_are(name: str) -> None:
    load = read_any_load(DATA / name)
    assert load.counts.shape == (1, 61, 256)
    per_layer = load.counts[0].sum(axis=1)
    assert (per_layer[:3] == 0).all()  # DeepSeek-V3's dense layers 0-2
    assert len(set(per_layer[3:].tolist())) == 1 and per_layer[3] % 8 == 0  # top-8: every MoE layer sums to 8 x tokens


def test_sglang_placement_round_trip_scores_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Plan on the published prefill statistics, export for SGLang, read the file back as a plan: identical
    placement and identical score on the decode statistics."""
    plan_path, out = tmp_path / "ep.json", tmp_path / "init.json"
    rc, _, err = run_cli(["plan", "--load", DATA / "prefill_in1024.json", "--policy", "eplb", "--nodes", 2,
                          "--gpus-per-node", 8, "--slots-per-gpu", 18, "--out", plan_path], capsys)
    assert rc == 0, err
    rc, text, err = run_cli(["export", "--plan", plan_path, "--format", "sglang", "--out", out], capsys)
    assert rc == 0, err
    assert "--ep-size 16 --ep-num-redundant-experts 32" in text
    doc = json.loads(out.read_text())
    assert list(doc) == ["physical_to_logical_map"]  # SGLang passes the dict as keyword arguments: that key only
    m = np.asarray(doc["physical_to_logical_map"])
    assert m.shape == (61, 288)  # every decoder layer, P = 256 + 32
    plan = read_plan(plan_path)
    assert plan.params["dense_layers"] == [0, 1, 2]
    for layer in (0, 1, 2):  # DeepSeek-V3's dense layers hold no experts: written in SGLang's default order
        assert list(m[layer]) == [p % 256 for p in range(288)]
        assert plan.gpu_experts[layer] == tuple(tuple(range(16 * g, 16 * g + 16)) for g in range(16))
    cluster = Cluster(num_nodes=2, gpus_per_node=8)
    prefill = read_any_load(DATA / "prefill_in1024.json")
    back = read_any_plan(out, cluster, load=prefill)  # with the load, its dense rows are read as holding no copies
    assert back.gpu_experts == plan.gpu_experts
    assert back.extra_replicas == plan.extra_replicas == 58 * 32
    without = read_any_plan(out, cluster)  # without it, every row is a placement, the dense ones' copies included
    assert without.gpu_experts[3:] == plan.gpu_experts[3:] and without.extra_replicas == 61 * 32
    for g in range(16):  # rank r owns the contiguous slots r * 18 .. r * 18 + 17
        assert list(m[5, g * 18:(g + 1) * 18]) == list(plan.gpu_experts[5][g])
    decode = read_any_load(DATA / "decode_in1000out1000.json")
    assert evaluate(back, decode).as_dict() == evaluate(plan, decode).as_dict()
    rc, text, err = run_cli(["evaluate", "--plan", out, "--nodes", 2, "--gpus-per-node", 8, "--load",
                             DATA / "decode_in1000out1000.json", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(text)["balancedness"] == round(evaluate(plan, decode).balancedness, 6)
    # a .pt placement, as torch.save writes one, reads the same
    torch.save({"physical_to_logical_map": torch.from_numpy(m)}, tmp_path / "init.pt")
    assert read_any_plan(tmp_path / "init.pt", cluster, load=prefill).gpu_experts == plan.gpu_experts


class Evil:
    """Anything torch.load(weights_only=True) refuses: code, not data."""


def test_sglang_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"logical_count": torch.zeros(2, 3, dtype=torch.int32), "obj": Evil()}, tmp_path / "pickle.pt")
    torch.save({"counts": torch.zeros(1, 3, 4, dtype=torch.int32)}, tmp_path / "key.pt")
    torch.save({"logical_count": torch.zeros(7, dtype=torch.int32)}, tmp_path / "shape.pt")
    torch.save({"logical_count": torch.tensor([[[1, -2]]], dtype=torch.int32)}, tmp_path / "neg.pt")
    (tmp_path / "trunc.pt").write_bytes(b"PK\x03\x04 not really")
    (tmp_path / "ragged.json").write_text(json.dumps({"logical_count": [[1, 2], [3]]}))
    (tmp_path / "place.json").write_text(json.dumps({"physical_to_logical_map": [[0, 1]]}))
    for name, fragment in (("pickle.pt", "never unpickles"), ("key.pt", "has no 'logical_count'"),
                           ("shape.pt", "logical_count has shape (7,)"), ("neg.pt", "logical_count"),
                           ("trunc.pt", "is not a torch.save file"), ("ragged.json", "not a rectangular array"),
                           ("place.json", "is an SGLang placement")):
        assert_user_error(["stats", "--load", tmp_path / name], capsys, fragment)
    counts = tmp_path / "c.npy"
    np.save(counts, _counts(2))
    (tmp_path / "p.json").write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3, 4, 5, 6]] * L}))
    assert_user_error(["evaluate", "--plan", tmp_path / "p.json", "--load", counts], capsys, "give --nodes and --gpus-per-node")
    assert_user_error(["evaluate", "--plan", tmp_path / "p.json", "--load", counts, "--nodes", 1, "--gpus-per-node", 2],
               capsys, "7 physical slots do not split evenly over 2 GPUs")


# ---------------------------------------------------------------------------------------------------- TensorRT-LLM

def write_statistics(folder: Path, per_rank: list[np.ndarray], iters: Sequence[int], layers: Sequence[int],
                     k: int = 2) -> None:
    """As TensorRT-LLM writes expert statistics: rank 0's meta_info.json, every rank's counts per
    ``"{iter}_{layer}"`` (int64 ``[E]``), MoE layers only."""
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": k}))
    for r, counts in enumerate(per_rank):  # counts [I, L, E]
        save_file({f"{it}_{layer}": counts[i, layer].astype(np.int64) for i, it in enumerate(iters) for layer in layers},
                  str(folder / f"rank{r}.safetensors"))


def test_trtllm_statistics(tmp_path: Path) -> None:
    a, b = _counts(3, 3), _counts(4, 3)
    folder = tmp_path / "expert_statistic"
    write_statistics(folder, [a, b], range(100, 103), [2, 3, 4])
    load = read_any_load(folder)
    assert load.counts.shape == (3, L, E)
    assert np.array_equal(load.counts, a + b)  # the ranks summed; layers 0-1 (no keys: dense) zero rows


def test_trtllm_bad_statistics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _counts(5, 2)
    write_statistics(tmp_path / "disagree", [a, a], range(2), [2, 3, 4])
    save_file({"0_2": a[0, 2]}, str(tmp_path / "disagree" / "rank1.safetensors"))
    assert_user_error(["stats", "--load", tmp_path / "disagree"], capsys, "the ranks disagree")
    write_statistics(tmp_path / "key", [a], range(2), [2])
    save_file({"iteration0": a[0, 2]}, str(tmp_path / "key" / "rank0.safetensors"))
    assert_user_error(["stats", "--load", tmp_path / "key"], capsys, "has key 'iteration0'")
    write_statistics(tmp_path / "shape", [a], range(2), [2])
    save_file({"0_2": np.zeros(3, np.int64)}, str(tmp_path / "shape" / "rank0.safetensors"))
    assert_user_error(["stats", "--load", tmp_path / "shape"], capsys, "has shape (3,)")
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "meta_info.json").write_text("{}")
    assert_user_error(["stats", "--load", tmp_path / "meta"], capsys, "num_experts")
    (tmp_path / "empty").mkdir()
    assert_user_error(["stats", "--load", tmp_path / "empty"], capsys, "folder without meta_info.json")


def test_trtllm_yaml_export_parses_and_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = tmp_path / "c.npy"
    np.save(counts, _counts(6))
    plan_path, out = tmp_path / "plan.json", tmp_path / "lb.yaml"
    rc, _, err = run_cli(["plan", "--load", counts, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 4,
                          "--slots-per-gpu", 3, "--set", "num_groups=1", "--out", plan_path], capsys)
    assert rc == 0, err
    plan = read_plan(plan_path)
    assert plan.params["dense_layers"] == list(DENSE)
    rc, _, err = run_cli(["export", "--plan", plan_path, "--format", "trtllm", "--out", out,
                          "--layer-updates-per-iter", 0], capsys)
    assert rc == 0, err
    doc = yaml.safe_load(out.read_text())
    assert set(doc) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    assert doc["num_slots"] == 12 and doc["layer_updates_per_iter"] == 0
    assign = doc["initial_global_assignments"]
    assert sorted(assign) == [2, 3, 4]  # decoder-layer ids of the MoE layers; dense layers left out
    for layer, ids in assign.items():
        assert len(ids) == 12 and set(ids) == set(range(E))  # every expert at least once
        assert ids == [e for g in range(4) for e in plan.gpu_experts[layer][g]]  # rank r: the r-th block of 3
    back = read_any_plan(out, plan.cluster, load=LoadMatrix(np.load(counts)))
    assert [back.gpu_experts[layer] for layer in (2, 3, 4)] == [plan.gpu_experts[layer] for layer in (2, 3, 4)]
    assert evaluate(back, LoadMatrix(np.load(counts))).balancedness == evaluate(plan, LoadMatrix(np.load(counts))).balancedness


def test_trtllm_bad_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = tmp_path / "c.npy"
    np.save(counts, _counts(7))
    cases = {"unknown.yaml": ({"num_slots": 8, "initial_global_assignments": {2: list(range(8))}, "extra": 1},
                              "unknown keys ['extra']"),
             "length.yaml": ({"num_slots": 8, "initial_global_assignments": {2: [0, 1]}}, "must list 8"),
             "missing.yaml": ({"num_slots": 8, "initial_global_assignments": {2: [0] * 8}},
                              "does not hold every expert"),
             "layer.yaml": ({"num_slots": 8, "initial_global_assignments": {9: list(range(8))}}, "places layer 9")}
    for name, (doc, fragment) in cases.items():
        (tmp_path / name).write_text(yaml.safe_dump(doc))
        assert_user_error(["evaluate", "--plan", tmp_path / name, "--load", counts, "--nodes", 1, "--gpus-per-node", 2],
                   capsys, fragment)
    (tmp_path / "broken.yaml").write_text("num_slots: [1\n")
    assert_user_error(["evaluate", "--plan", tmp_path / "broken.yaml", "--load", counts, "--nodes", 1, "--gpus-per-node", 2],
               capsys, "cannot read")


# ------------------------------------------------------------------------------------- vLLM, slots and padding

def test_vllm_map_lists_moe_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = tmp_path / "c.npy"
    np.save(counts, _counts(8))
    plan_path, out = tmp_path / "plan.json", tmp_path / "map.json"
    assert run_cli(["plan", "--load", counts, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 2, "--slots-per-gpu",
                    5, "--set", "num_groups=1", "--out", plan_path], capsys)[0] == 0
    rc, text, err = run_cli(["export", "--plan", plan_path, "--format", "vllm", "--out", out, "--json"], capsys)
    assert rc == 0, err
    rows = json.loads(out.read_text())
    plan = read_plan(plan_path)
    assert rows == [slot_table(plan).phy2log[layer].tolist() for layer in (2, 3, 4)]
    assert json.loads(text)["num_redundant_experts"] == 2 and json.loads(text)["moe_layers"] == [2, 3, 4]
    rc, _, err = run_cli(["export", "--plan", plan_path, "--format", "vllm", "--out", out, "--dense-layers", "0"],
                         capsys)
    assert rc == 0 and len(json.loads(out.read_text())) == 4


def test_unequal_slots_are_refused_or_padded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = _counts(9)
    load = LoadMatrix(counts)
    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    plan, _ = make_plan("craft", load, cluster, Budget(replicas_per_gpu=2))
    assert len({len(x) for row in plan.gpu_experts for x in row}) > 1  # CRAFT: per-layer counts differ
    with pytest.raises(PlanError, match="give --pad"):
        slot_table(plan)
    padding = pad_plan(plan, counts)
    padded = padding.plan
    S = plan.max_slots_per_gpu
    assert plan.params["dense_layers"] == list(DENSE)  # planned without them: contiguous blocks, no copies
    assert plan.slots()[list(DENSE)].max() == -(-E // 4) and plan.replica_counts()[list(DENSE)].max() == 1
    moe = [layer for layer in range(L) if layer not in DENSE]
    assert {len(x) for layer in moe for x in padded.gpu_experts[layer]} == {S}
    for layer in DENSE:  # no experts in the engine: not padded (written in the engine's default order)
        assert padded.gpu_experts[layer] == plan.gpu_experts[layer]
    assert slot_table(padded).phy2log[list(DENSE)].tolist() == [[p % E for p in range(4 * S)]] * len(DENSE)
    added = 0
    for old_row, new_row in zip(plan.gpu_experts, padded.gpu_experts, strict=True):
        for old, new in zip(old_row, new_row, strict=True):
            assert new[:len(old)] == old and len(set(new)) == len(new)  # the plan's lists, then new experts
            added += len(new) - len(old)
    assert padding.slots == added > 0 and "padding added" in padding.describe(plan)
    # forced copies can cost balance in a layer where the plan chose none, but chosen copies beat filling each GPU
    # with its lowest missing expert ids, on the load the padding plans on (measured: 5 of 5 seeds)
    summed = LoadMatrix(counts.sum(axis=0, keepdims=True))
    naive = Placement([[list(x) + [e for e in range(E) if e not in x][:S - len(x)] for x in row]
                       for row in plan.gpu_experts], E, cluster)
    assert evaluate(padded, summed).balancedness > evaluate(naive, summed).balancedness
    plan_path, npy = tmp_path / "craft.json", tmp_path / "c.npy"
    write_plan(plan_path, plan)
    np.save(npy, counts)
    assert_user_error(["export", "--plan", plan_path, "--format", "sglang", "--out", tmp_path / "x.json"], capsys,
               "give --pad")
    assert not (tmp_path / "x.json").exists()
    assert_user_error(["export", "--plan", plan_path, "--format", "sglang", "--out", tmp_path / "x.json", "--pad"], capsys,
               "--pad needs --load")
    rc, _, err = run_cli(["export", "--plan", plan_path, "--format", "sglang", "--out", tmp_path / "x.json", "--pad",
                          "--load", npy], capsys)
    assert rc == 0 and "padding added" in err
    assert np.asarray(json.loads((tmp_path / "x.json").read_text())["physical_to_logical_map"]).shape == (L, 4 * S)


def test_stats_and_import_mark_dense_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dump.pt"
    write_stat_dump(path, _counts(10))
    rc, text, err = run_cli(["stats", "--load", path, "--json"], capsys)
    assert rc == 0, err
    assert json.loads(text)["dense_layers"] == list(DENSE)
    rc, text, err = run_cli(["stats", "--load", path], capsys)
    assert rc == 0 and text.count("dense (no load)") == 2
    rc, text, err = run_cli(["import", "--load", path, "--out", tmp_path / "t.npz"], capsys)
    assert rc == 0 and "dense layers (no load, kept as zero rows): 0, 1" in text
    assert np.array_equal(np.load(tmp_path / "t.npz")["counts"], read_stat(path).counts)
    with pytest.raises(InputError, match="unknown load format"):
        read_any_load(path, "nope")


def test_compare_scores_an_engine_placement_as_a_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = tmp_path / "c.npy"
    np.save(counts, _counts(11, batches=6))
    plan_path = tmp_path / "plan.json"
    assert run_cli(["plan", "--load", counts, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 4, "--slots-per-gpu",
                    3, "--set", "num_groups=1", "--batches", "0:3", "--out", plan_path], capsys)[0] == 0
    assert run_cli(["export", "--plan", plan_path, "--format", "sglang", "--out", tmp_path / "init.json"], capsys)[0] == 0
    assert run_cli(["export", "--plan", plan_path, "--format", "trtllm", "--out", tmp_path / "lb.yaml"], capsys)[0] == 0
    rc, text, err = run_cli(["compare", "--load", counts, "--policies", "greedy", "--nodes", 1, "--gpus-per-node", 4,
                             "--slots-per-gpu", 3, "--baseline", tmp_path / "init.json", "--baseline",
                             tmp_path / "lb.yaml", "--json"], capsys)
    assert rc == 0, err
    rows = {r["policy"]: r for r in json.loads(text)["rows"]}
    held_out = LoadMatrix(np.load(counts)[3:])  # compare scores the second half
    want = round(evaluate(read_plan(plan_path), held_out).balancedness, 6)
    assert rows["baseline init.json"]["balancedness"] == rows["baseline lb.yaml"]["balancedness"] == want
    assert rows["baseline init.json"]["plan_seconds"] == 0
    assert_user_error(["compare", "--load", counts, "--policies", "greedy", "--nodes", 1, "--gpus-per-node", 5,
                "--slots-per-gpu", 5, "--baseline", tmp_path / "init.json"], capsys, "12 physical slots do not split evenly")


def write_pass_dumps(folder: Path, per_rank: list[dict[int, Any]], phy2log: np.ndarray,
                     per_token: bool = False) -> None:
    """As SGLang's per_pass / per_token recorder writes them: one file per rank, a record per forward pass with
    this rank's physical-slot counts ``int32 [L, P]`` (per_token adds physical top-k ids padded to 8 with -1)."""
    folder.mkdir()
    for rank, passes in enumerate(per_rank):
        records = []
        for fid, item in passes.items():
            phys, topk = item if per_token else (item, None)  # per_token: (counts, topk ids [L, T, 8])
            rec: dict[str, Any] = {"forward_pass_id": fid, "rank": rank, "gatherer_key": "primary",
                                   "global_physical_count": torch.from_numpy(phys.astype(np.int32))}
            if topk is not None:
                T = topk.shape[1]
                rec.update(input_ids=list(range(T)), positions=list(range(T)), extend_seq_lens=[T], forward_mode=1,
                           topk_ids_of_layer=torch.from_numpy(topk.astype(np.int32)), misc_objects=[])
            records.append(rec)
        torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(phy2log)},
                   folder / f"expert_distribution_recorder_1719999999.123_{rank}.pt")


def test_sglang_per_pass_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    P = E + 2  # slots 8 and 9 are second copies of experts 3 and 5
    phy2log = np.tile(np.concatenate([np.arange(E), [3, 5]]), (L, 1)).astype(np.int64)
    rng = np.random.default_rng(12)
    per_rank = [{fid: rng.integers(0, 20, size=(L, P)) * (np.arange(L)[:, None] >= 2) for fid in (7, 8, 9)}
                for _ in range(2)]
    for per_token in (False,):
        folder = tmp_path / f"dumps{int(per_token)}"
        write_pass_dumps(folder, per_rank, phy2log, per_token)
        load = read_any_load(folder)
        assert load.counts.shape == (3, L, E)
        for b, fid in enumerate((7, 8, 9)):
            phys = per_rank[0][fid] + per_rank[1][fid]
            want = phys[:, :E].copy()
            want[:, 3] += phys[:, 8]
            want[:, 5] += phys[:, 9]  # each slot's picks counted for its logical expert, the ranks summed
            assert np.array_equal(load.counts[b], want)
        assert (load.counts[:, :2] == 0).all()  # dense layers: zero rows
    other = [per_rank[0], {7: per_rank[1][7]}]
    write_pass_dumps(tmp_path / "disagree", other, phy2log)
    assert_user_error(["stats", "--load", tmp_path / "disagree"], capsys, "record different forward passes")
    (tmp_path / "mixed").mkdir()
    torch.save({"logical_count": torch.zeros(1, L, E, dtype=torch.int32)}, tmp_path / "mixed" / "x.pt")
    assert_user_error(["stats", "--load", tmp_path / "mixed"], capsys, "give the file, not the folder")


def vllm_response(*requests: np.ndarray) -> dict[str, Any]:
    """An OpenAI-style response as recent vLLM returns it: each choice's routed_experts a base64-encoded .npy."""
    import base64
    import io

    def b64(a: np.ndarray) -> str:
        buf = io.BytesIO()
        np.save(buf, a)
        return base64.b64encode(buf.getvalue()).decode()

    return {"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": i, "text": "...", "routed_experts": b64(a)} for i, a in enumerate(requests)]}


def _routed(seed: int, tokens: int, dtype: Any = np.uint8) -> np.ndarray:
    """``[tokens, L, 2]`` distinct picks per token; layers 0 and 1 dense: zeros, as vLLM's capture buffer leaves them."""
    rng = np.random.default_rng(seed)
    out = np.zeros((tokens, L, 2), dtype=dtype)
    for t in range(tokens):
        for layer in range(2, L):
            out[t, layer] = rng.choice(E, size=2, replace=False)
    return out


def test_vllm_routed_experts_to_a_token_level_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = [_routed(20, 5), _routed(21, 3), _routed(22, 4, np.int32)]
    (tmp_path / "resp.json").write_text(json.dumps(vllm_response(reqs[0], reqs[1])))
    np.save(tmp_path / "req2.npy", reqs[2])
    folder = tmp_path / "responses"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(vllm_response(reqs[0], reqs[1])))
    (folder / "b.json").write_text(json.dumps([vllm_response(reqs[2])]))
    load = read_any_load(folder, gpus=2, batch_tokens=8, num_experts=E)
    tr = load.trace
    assert tr is not None and load.layer_ids is not None
    assert load.layer_ids.tolist() == [2, 3, 4]  # dense layers left out, the model's numbering kept
    assert np.array_equal(tr.topk_ids, np.concatenate(reqs)[:, 2:].astype(np.int64))
    # requests 0 and 1 (8 tokens) fill batch 0 on ranks 0 and 1; request 2 opens batch 1 on rank 0
    assert tr.batch.tolist() == [0] * 8 + [1] * 4 and tr.src_gpu.tolist() == [0] * 5 + [1] * 3 + [0] * 4
    assert read_any_load(tmp_path / "resp.json").counts.shape == (1, 3, E)
    assert read_any_load(tmp_path / "req2.npy", "vllm").trace is not None
    # import, plan, export: the engine files line up with the model's layers again
    rc, text, err = run_cli(["import", "--load", folder, "--gpus", 2, "--batch-tokens", 8, "--experts", E, "--out",
                             tmp_path / "t.npz"], capsys)
    assert rc == 0 and "the model's layer ids kept: 2,3,4" in text, err
    assert np.load(tmp_path / "t.npz")["layer_ids"].tolist() == [2, 3, 4]
    rc, text, err = run_cli(["stats", "--load", tmp_path / "t.npz", "--json"], capsys)
    assert rc == 0 and json.loads(text)["layer_ids"] == [2, 3, 4]
    plan_path = tmp_path / "plan.json"
    assert run_cli(["plan", "--load", tmp_path / "t.npz", "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 2,
                    "--slots-per-gpu", 5, "--set", "num_groups=1", "--out", plan_path], capsys)[0] == 0
    plan = read_plan(plan_path)
    assert plan.params["layer_ids"] == [2, 3, 4]
    assert run_cli(["export", "--plan", plan_path, "--format", "sglang", "--out", tmp_path / "i.json"], capsys)[0] == 0
    m = np.asarray(json.loads((tmp_path / "i.json").read_text())["physical_to_logical_map"])
    assert m.shape == (5, 10)  # every decoder layer up to the last MoE one
    assert (m[:2] == np.arange(10) % E).all()  # dense rows: SGLang's own trivial layout
    assert np.array_equal(m[2:], slot_table(plan).phy2log)
    assert run_cli(["export", "--plan", plan_path, "--format", "trtllm", "--out", tmp_path / "lb.yaml"], capsys)[0] == 0
    assert sorted(yaml.safe_load((tmp_path / "lb.yaml").read_text())["initial_global_assignments"]) == [2, 3, 4]
    # and both files read back against the import give the plan's placement
    imported = read_any_load(tmp_path / "t.npz")
    for f in ("i.json", "lb.yaml"):
        assert read_any_plan(tmp_path / f, plan.cluster, load=imported).gpu_experts == plan.gpu_experts


def test_vllm_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "nob64.json").write_text(json.dumps({"choices": [{"routed_experts": "@@@"}]}))
    (tmp_path / "none.json").write_text(json.dumps({"choices": [{"text": "hi"}]}))
    (tmp_path / "shapes.json").write_text(json.dumps(vllm_response(_routed(1, 2), _routed(2, 2)[:, :3])))
    for name, fragment in (("nob64.json", "not base64"), ("none.json", "--enable-return-routed-experts"),
                           ("shapes.json", "disagree on [layers, top-k]")):
        assert_user_error(["stats", "--load", tmp_path / name, "--format", "vllm"], capsys, fragment)


def test_review_cases_fail_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = tmp_path / "c.npy"
    np.save(counts, _counts(13))
    (tmp_path / "strings.json").write_text(json.dumps({"physical_to_logical_map": [["a"] * 8] * L}))
    assert_user_error(["evaluate", "--plan", tmp_path / "strings.json", "--load", counts, "--nodes", 1, "--gpus-per-node", 2],
               capsys, "must hold numbers")
    (tmp_path / "text.pt").write_text("not a torch file at all")
    assert_user_error(["stats", "--load", tmp_path / "text.pt"], capsys, "is not a torch.save file")
    (tmp_path / "lc.json").write_text(json.dumps({"logical_count": [[1] * E] * L}))
    assert_user_error(["evaluate", "--plan", tmp_path / "lc.json", "--load", counts, "--nodes", 1, "--gpus-per-node", 2],
               capsys, "is an SGLang load (logical_count), not a placement")
    (tmp_path / "dumps").mkdir()
    torch.save({"records": 5, "last_physical_to_logical_map": torch.zeros(L, E, dtype=torch.int64)},
               tmp_path / "dumps" / "x_0.pt")
    assert_user_error(["stats", "--load", tmp_path / "dumps"], capsys, "'records' must be a list")
    # TensorRT-LLM: a MoE layer (one with load) left out, booleans as ids, iterations with gaps
    (tmp_path / "partial.yaml").write_text(yaml.safe_dump({"num_slots": 8, "initial_global_assignments":
                                                           {2: list(range(8)), 3: list(range(8))}}))
    assert_user_error(["evaluate", "--plan", tmp_path / "partial.yaml", "--load", counts, "--nodes", 1, "--gpus-per-node", 2],
               capsys, "does not place layer 4, which carries load")
    (tmp_path / "bools.yaml").write_text(yaml.safe_dump({"num_slots": 2, "initial_global_assignments":
                                                         {2: [True, False]}}))
    assert_user_error(["evaluate", "--plan", tmp_path / "bools.yaml", "--load", counts, "--nodes", 1, "--gpus-per-node", 2],
               capsys, "non-negative expert ids")
    a = _counts(14, 3)
    write_statistics(tmp_path / "gaps", [a], (0, 1, 5), [2, 3, 4])
    assert_user_error(["stats", "--load", tmp_path / "gaps"], capsys, "with gaps")


def test_duplicate_baseline_names_and_dense_layers_from_the_whole_load(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    c = _counts(15, 4)
    c[:2, 3] = 0  # an MoE layer idle in the planning window only
    counts = tmp_path / "c.npy"
    np.save(counts, c)
    plan_path = tmp_path / "plan.json"
    assert run_cli(["plan", "--load", counts, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 2, "--slots-per-gpu",
                    5, "--set", "num_groups=1", "--batches", "0:2", "--out", plan_path], capsys)[0] == 0
    assert read_plan(plan_path).params["dense_layers"] == list(DENSE)  # layer 3 is not dense: it has load later
    assert run_cli(["export", "--plan", plan_path, "--format", "trtllm", "--out", tmp_path / "lb.yaml"], capsys)[0] == 0
    assert sorted(yaml.safe_load((tmp_path / "lb.yaml").read_text())["initial_global_assignments"]) == [2, 3, 4]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        assert run_cli(["export", "--plan", plan_path, "--format", "sglang", "--out", tmp_path / d / "x.json"],
                       capsys)[0] == 0
    assert_user_error(["compare", "--load", counts, "--policies", "greedy", "--nodes", 1, "--gpus-per-node", 2,
                "--slots-per-gpu", 5, "--baseline", tmp_path / "a" / "x.json", "--baseline", tmp_path / "b" / "x.json"],
               capsys, "two --baseline files are named 'x.json'")


def test_sglang_per_token_dumps_are_a_token_level_trace(tmp_path: Path) -> None:
    P, K, T = E + 2, 2, 5
    phy2log = np.tile(np.concatenate([np.arange(E), [3, 5]]), (L, 1)).astype(np.int64)
    rng = np.random.default_rng(16)
    per_rank, truth = [], {}
    for rank in range(2):
        passes = {}
        for fid in (4, 5):
            topk = np.full((L, T, 8), -1, dtype=np.int64)  # SGLang pads to 8; dense layers 0-1 never written
            for layer in range(2, L):
                for t in range(T):  # K distinct logical experts, each served by one of its physical copies
                    for j, e in enumerate(rng.choice(E, size=K, replace=False)):
                        topk[layer, t, j] = rng.choice(np.flatnonzero(phy2log[layer] == e))
            phys = np.zeros((L, P), dtype=np.int64)
            np.add.at(phys, (np.repeat(np.arange(L), T * K), np.clip(topk[:, :, :K], 0, None).ravel()),
                      (topk[:, :, :K] >= 0).ravel())
            passes[fid] = (phys, topk)
            truth[fid, rank] = phy2log[0][topk[2:, :, :K]].transpose(1, 0, 2)  # logical ids [T, 3, K]
        per_rank.append(passes)
    write_pass_dumps(tmp_path / "tok", per_rank, phy2log, per_token=True)
    load = read_any_load(tmp_path / "tok")
    tr = load.trace
    assert tr is not None and load.layer_ids is not None and load.layer_ids.tolist() == [2, 3, 4]
    assert tr.batch.tolist() == [0] * 10 + [1] * 10 and tr.src_gpu.tolist() == ([0] * 5 + [1] * 5) * 2
    want = np.concatenate([truth[4, 0], truth[4, 1], truth[5, 0], truth[5, 1]])
    assert np.array_equal(tr.topk_ids, want)


def test_export_writes_the_models_decoder_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan on a plain [58, 256] load (DeepSeek-V3's MoE layers alone): SGLang gets its 61 rows, TensorRT-LLM its
    decoder-layer ids 3..60 (before: 58 rows, and keys 0..57). A plan whose rows cannot be placed is refused."""
    rng = np.random.default_rng(17)
    np.save(tmp_path / "moe.npy", rng.integers(1, 50, size=(2, 58, 256)))
    plan_path = tmp_path / "plan.json"
    rc, _, err = run_cli(["plan", "--load", tmp_path / "moe.npy", "--policy", "eplb", "--nodes", 2, "--gpus-per-node", 8,
                          "--slots-per-gpu", 18, "--out", plan_path], capsys)
    assert rc == 0, err
    rc, _, err = run_cli(["export", "--plan", plan_path, "--format", "sglang", "--out", tmp_path / "init.json"], capsys)
    assert rc == 0, err
    m = np.asarray(json.loads((tmp_path / "init.json").read_text())["physical_to_logical_map"])
    assert m.shape == (61, 288) and np.array_equal(m[3:], slot_table(read_plan(plan_path)).phy2log)
    rc, _, err = run_cli(["export", "--plan", plan_path, "--format", "trtllm", "--out", tmp_path / "lb.yaml"], capsys)
    assert rc == 0, err
    assert sorted(yaml.safe_load((tmp_path / "lb.yaml").read_text())["initial_global_assignments"]) == list(range(3, 61))
    np.save(tmp_path / "small.npy", rng.integers(1, 50, size=(2, 4, 8)))
    small = tmp_path / "small.json"
    assert run_cli(["plan", "--load", tmp_path / "small.npy", "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 2,
                    "--slots-per-gpu", 4, "--out", small], capsys)[0] == 0
    assert_user_error(["export", "--plan", small, "--format", "sglang", "--out", tmp_path / "x.json"], capsys,
                      "the plan's 4 layers all carry load and it names no model")
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------------- import, one file at a time (streamed)

def _token_passes(rng: np.random.Generator, phy2log: np.ndarray, tokens: dict[int, int],
                  K: int = 2) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """One rank's per_token records ``{pass id: (physical counts [L, P], physical top-k [L, T, 8] -1 padded)}``:
    ``tokens[pass id]`` tokens each, ``K`` distinct logical experts per token in the MoE layers (a random physical
    copy of each), nothing in the dense layers."""
    out = {}
    for fid, T in tokens.items():
        topk = np.full((L, T, 8), -1, dtype=np.int64)
        for layer in range(L):
            if layer in DENSE:
                continue
            for t in range(T):
                for j, e in enumerate(rng.choice(E, size=K, replace=False)):
                    topk[layer, t, j] = rng.choice(np.flatnonzero(phy2log[layer] == e))
        phys = np.zeros((L, phy2log.shape[1]), dtype=np.int64)
        np.add.at(phys, (np.repeat(np.arange(L), T * K), np.clip(topk[:, :, :K], 0, None).ravel()),
                  (topk[:, :, :K] >= 0).ravel())
        out[fid] = (phys, topk)
    return out


def _same_arrays(path: Path, want: dict[str, np.ndarray]) -> None:
    """The ``.npz`` at ``path`` holds exactly ``want``: the same names, dtypes, shapes and values."""
    with np.load(path, allow_pickle=False) as got:
        assert sorted(got.files) == sorted(want)
        for name, arr in want.items():
            assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
            assert np.array_equal(got[name], arr), name


def _stored_members(path: Path) -> dict[str, bool]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: i.compress_type == zipfile.ZIP_STORED for i in zf.infolist()}


PHY2LOG = np.tile(np.concatenate([np.arange(E), [3, 5]]), (L, 1)).astype(np.int64)  # slots 8, 9: copies of 3, 5


@pytest.mark.parametrize("chunk", [None, 16])
def test_import_streams_sglang_per_token_dumps_as_read_dumps_reads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        chunk: int | None) -> None:
    if chunk is not None:  # 16 picks: one token of 5 layers x 8 slots per chunk
        monkeypatch.setattr(stream, "CHUNK_PICKS", chunk)
    rng = np.random.default_rng(30)
    # passes recorded as 12, 10, 11 (they go in id order); rank 0 had no token in pass 10
    tokens = [{12: 3, 10: 0, 11: 4}, {12: 2, 10: 5, 11: 1}, {12: 4, 10: 2, 11: 3}]
    per_rank = [_token_passes(rng, PHY2LOG, t) for t in tokens]
    folder, out = tmp_path / "tok", tmp_path / "t.npz"
    write_pass_dumps(folder, per_rank, PHY2LOG, per_token=True)
    rc, text, err = run_cli(["import", "--load", folder, "--out", out], capsys)
    assert rc == 0, err
    assert "token-level (24 tokens)" in text and "the model's layer ids kept: 2,3,4" in text
    _same_arrays(out, read_dumps(folder).to_arrays())  # today's reader, holding every file at once
    # by hand: pass 10 (ranks 1 and 2: 5 + 2 tokens), pass 11 (4 + 1 + 3), pass 12 (3 + 2 + 4), rank-major in each
    with np.load(out) as got:
        assert got["batch"].tolist() == [0] * 7 + [1] * 8 + [2] * 9
        assert got["src_gpu"].tolist() == [1] * 5 + [2] * 2 + [0] * 4 + [1] + [2] * 3 + [0] * 3 + [1] * 2 + [2] * 4
        want = np.concatenate([PHY2LOG[0][per_rank[r][fid][1][2:, :, :2]].transpose(1, 0, 2)
                               for fid in (10, 11, 12) for r in range(3)])
        assert got["topk_ids"].dtype == np.int16 and np.array_equal(got["topk_ids"], want)
        assert got["layer_ids"].tolist() == [2, 3, 4]
    stored = _stored_members(out)  # the token-level members uncompressed, the small ones compressed
    assert stored == {"topk_ids.npy": True, "src_gpu.npy": True, "batch.npy": True, "counts.npy": False,
                      "layer_ids.npy": False}
    trace = read_load(out).trace
    assert trace is not None
    ids = trace.topk_ids
    while not isinstance(ids, np.memmap) and ids.base is not None:
        ids = ids.base
    assert isinstance(ids, np.memmap)  # later commands map the ids, not read them
    # per_pass dumps (no per-token ids) are counts alone, read whole as before
    write_pass_dumps(tmp_path / "pass", [{fid: phys for fid, (phys, _) in r.items()} for r in per_rank], PHY2LOG)
    rc, text, err = run_cli(["import", "--load", tmp_path / "pass", "--out", tmp_path / "p.npz"], capsys)
    assert rc == 0 and "token-level" not in text, err
    _same_arrays(tmp_path / "p.npz", read_dumps(tmp_path / "pass").to_arrays())
    with np.load(tmp_path / "p.npz") as got:  # passes 10, 11, 12: the ranks' physical counts as logical ones
        phys = per_rank[0][11][0] + per_rank[1][11][0] + per_rank[2][11][0]
        want = phys[:, :E].copy()
        want[:, 3] += phys[:, 8]
        want[:, 5] += phys[:, 9]
        assert got["counts"].shape == (3, L, E) and np.array_equal(got["counts"][1], want)


@pytest.mark.parametrize("chunk", [None, 12])
def test_import_streams_vllm_routed_experts_as_the_reader_reads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     chunk: int | None) -> None:
    if chunk is not None:  # 12 picks: one token of 5 layers x top-2 per chunk
        monkeypatch.setattr(stream, "CHUNK_PICKS", chunk)
    reqs = [_routed(40, 5), _routed(41, 3), _routed(42, 4, np.int32), _routed(43, 6, np.uint16)]
    folder = tmp_path / "responses"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(vllm_response(reqs[0], reqs[1])))
    np.save(folder / "b.npy", reqs[2])
    (folder / "c.json").write_text(json.dumps([vllm_response(reqs[3])]))
    for gpus, batch_tokens, experts in ((2, 8, None), (3, 4, E + 3)):
        out = tmp_path / f"v{gpus}.npz"
        argv = ["import", "--load", folder, "--gpus", gpus, "--batch-tokens", batch_tokens, "--out", out]
        rc, text, err = run_cli(argv + ([] if experts is None else ["--experts", experts]), capsys)
        assert rc == 0 and "token-level (18 tokens)" in text, err
        _same_arrays(out, read_routed_experts(folder, gpus=gpus, batch_tokens=batch_tokens,
                                              num_experts=experts).to_arrays())
        assert _stored_members(out)["topk_ids.npy"] and not _stored_members(out)["counts.npy"]
    with np.load(tmp_path / "v2.npz") as got:  # by hand: 5 + 3 tokens fill batch 0 (ranks 0, 1), 4 + 6 batch 1
        assert got["batch"].tolist() == [0] * 8 + [1] * 10
        assert got["src_gpu"].tolist() == [0] * 5 + [1] * 3 + [0] * 4 + [1] * 6
        assert np.array_equal(got["topk_ids"], np.concatenate(reqs)[:, 2:])
        assert got["counts"].shape == (2, 3, E) and got["layer_ids"].tolist() == [2, 3, 4]
    with np.load(tmp_path / "v3.npz") as got:  # at least 4 tokens a batch: 5 | 3 + 4 (ranks 0, 1) | 6
        assert got["batch"].tolist() == [0] * 5 + [1] * 7 + [2] * 6
        assert got["src_gpu"].tolist() == [0] * 8 + [1] * 4 + [0] * 6
        assert got["counts"].shape == (3, 3, E + 3)
    # one .npy without dense layers: no layer ids in either
    np.save(tmp_path / "one.npy", _routed(44, 7)[:, 2:])
    rc, _, err = run_cli(["import", "--load", tmp_path / "one.npy", "--format", "vllm", "--out", tmp_path / "o.npz"],
                         capsys)
    assert rc == 0, err
    _same_arrays(tmp_path / "o.npz", read_routed_experts(tmp_path / "one.npy").to_arrays())


def _no_output(tmp_path: Path, *inputs: str) -> None:
    """Nothing but the inputs in ``tmp_path``: no output file, no temporary."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(inputs)


def test_a_damaged_file_in_the_middle_is_one_line_and_leaves_no_output(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(31)
    per_rank = [_token_passes(rng, PHY2LOG, {1: 3, 2: 2}) for _ in range(3)]
    folder, out = tmp_path / "tok", tmp_path / "t.npz"
    write_pass_dumps(folder, per_rank, PHY2LOG, per_token=True)
    middle = folder / "expert_distribution_recorder_1719999999.123_1.pt"
    intact = middle.read_bytes()
    middle.write_bytes(intact[: len(intact) // 2])  # cut off while it was copied
    assert_user_error(["import", "--load", folder, "--out", out], capsys, f"{str(middle)!r}", "torch.save")
    _no_output(tmp_path, "tok")
    # a token of the middle rank picking expert 3 twice (slot 3 and its copy, slot 8): found while the .npz is
    # written, which is then removed
    per_rank[1][2][1][3, 1, :2] = [3, 8]
    shutil.rmtree(folder)
    write_pass_dumps(folder, per_rank, PHY2LOG, per_token=True)
    assert_user_error(["import", "--load", folder, "--out", out], capsys,
                      f"{str(middle)!r}, forward pass 2: token 1 picks the same expert twice in layer 3")
    _no_output(tmp_path, "tok")
    # vLLM: a truncated .npy between two good responses, then one with a repeated pick
    responses = tmp_path / "responses"
    responses.mkdir()
    (responses / "a.json").write_text(json.dumps(vllm_response(_routed(45, 4))))
    (responses / "c.json").write_text(json.dumps(vllm_response(_routed(46, 3))))
    bad = _routed(47, 5)
    np.save(responses / "b.npy", bad)
    data = (responses / "b.npy").read_bytes()
    (responses / "b.npy").write_bytes(data[:-7])
    assert_user_error(["import", "--load", responses, "--out", out], capsys, str(responses / "b.npy"), "truncated")
    _no_output(tmp_path, "tok", "responses")
    bad[2, 4] = [6, 6]
    np.save(responses / "b.npy", bad)
    assert_user_error(["import", "--load", responses, "--out", out], capsys,
                      f"{str(responses / 'b.npy')!r}, request 0: token 2 picks the same expert twice in layer 4")
    _no_output(tmp_path, "tok", "responses")


def test_dumps_larger_than_memory_are_imported_a_file_at_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(32)
    folder, out = tmp_path / "tok", tmp_path / "t.npz"
    write_pass_dumps(folder, [_token_passes(rng, PHY2LOG, {1: 6, 2: 5}) for _ in range(3)], PHY2LOG, per_token=True)
    sizes = [f.stat().st_size for f in folder.iterdir()]
    monkeypatch.setattr(detect, "machine_memory_bytes", lambda: sum(sizes) - 1)  # less than all, more than each
    line = assert_user_error(["stats", "--load", folder], capsys, "GiB of sglang dumps",
                             f"run moebalance import --load {folder} --out X.npz first", "then give --load X.npz")
    assert "in parts" not in line
    rc, _, err = run_cli(["import", "--load", folder, "--out", out], capsys)
    assert rc == 0, err
    rc, text, err = run_cli(["stats", "--load", out, "--json"], capsys)
    assert rc == 0 and json.loads(text)["layer_ids"] == [2, 3, 4], err
    monkeypatch.setattr(stream, "machine_memory_bytes", lambda: max(sizes) - 1)  # one file alone is too large
    assert_user_error(["import", "--load", folder, "--out", tmp_path / "u.npz"], capsys, "alone holds",
                      "import reads one file at a time")
    assert not (tmp_path / "u.npz").exists()
    # TensorRT-LLM statistics are read whole by import too: refused as before
    write_statistics(tmp_path / "stats", [_counts(33, 2)], (0, 1), [2, 3, 4])
    monkeypatch.setattr(detect, "machine_memory_bytes", lambda: 10)
    assert_user_error(["import", "--load", tmp_path / "stats", "--out", tmp_path / "s.npz"], capsys,
                      "import the dumps in parts")


def test_import_holds_one_dump_file_at_a_time(tmp_path: Path) -> None:
    """tracemalloc traces numpy's arrays (and Python's objects, not torch's tensors): at its peak, today's reader
    holds every rank's ids as int64 (here 33 times one file's), the streamed import a third of one file's, with 3
    ranks or 12."""
    T, passes = 1000, 4
    one_file = passes * T * L * 8 * 8  # a rank's ids [L, T, 8] over its passes, as int64

    def dumps(name: str, ranks: int) -> Path:
        rng = np.random.default_rng(ranks)
        per_rank = []
        for _ in range(ranks):
            recs = {}
            for fid in range(passes):
                topk = np.full((L, T, 8), -1, dtype=np.int64)
                first = rng.integers(0, E, size=(L - 2, T))
                topk[2:, :, 0] = first
                topk[2:, :, 1] = (first + rng.integers(1, E, size=(L - 2, T))) % E  # a second, distinct expert
                recs[fid] = (np.zeros((L, E + 2), dtype=np.int64), topk)
            per_rank.append(recs)
        write_pass_dumps(tmp_path / name, per_rank, PHY2LOG, per_token=True)
        return tmp_path / name

    def peak(run: Any) -> int:
        tracemalloc.start()
        try:
            run()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    few, many = dumps("few", 3), dumps("many", 12)
    stream.import_dumps(few, tmp_path / "warm.npz")  # imports and compiled kernels loaded before tracing
    streamed_few = peak(lambda: stream.import_dumps(few, tmp_path / "few.npz"))
    streamed_many = peak(lambda: stream.import_dumps(many, tmp_path / "many.npz"))
    whole = peak(lambda: read_dumps(many))
    assert whole > 12 * one_file  # the instrument sees every file held at once
    assert streamed_many < one_file, (streamed_many, one_file)
    assert streamed_many - streamed_few < one_file / 4, (streamed_few, streamed_many)  # 9 more files: no more held
