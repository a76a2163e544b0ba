"""Bad inputs to the data model, the synthetic generator and calibration: each is one line, never a wrong result,
a MemoryError, a RecursionError, a numpy warning or a stale temporary file.

Sizes that must be refused on any machine are chosen far beyond any machine's memory (terabytes), so the tests do
not depend on the memory of the machine that runs them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_user_error, run_cli

from moebalance.core.budget import Budget, resolve_budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import BudgetError, InputError, PlanError
from moebalance.core.io import (
    OUT_DIR_MARK,
    atomic_dir,
    atomic_path,
    atomic_write_text,
    check_out_dir,
    dumps,
    read_json,
    remove_stale_temporaries,
)
from moebalance.core.load import LM_PRESET, LoadMatrix, read_load, write_load
from moebalance.core.plan import Placement, read_plan, write_plan
from moebalance.cost.calibrate import Measurements, read_measurements
from moebalance.policies import make_plan
from moebalance.workloads.synth import synthesize

C14 = Cluster(num_nodes=1, gpus_per_node=4)
CSV_HEAD = "experts,tokens_per_expert,hidden_size,ffn_size,seconds\n"


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    """No numpy warning may reach a user: every test here fails on one."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _plan_doc(**params: object) -> dict:
    """A valid 4-layer, 8-expert plan on 1 x 4 GPUs with ``params``."""
    rows = [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 4
    return Placement(rows, 8, C14, policy="contiguous", params=params).to_json_dict()


# ----- counts whose sums wrap int64 ------------------------------------------------------------------------------

def test_counts_below_the_per_entry_limit_whose_total_wraps_are_refused(tmp_path, capsys) -> None:
    """128 entries of 2**61 sum to 2**68: as int64 the per-layer sums wrapped to 0, every layer looked dense and
    a plan scored 1.0."""
    counts = np.full((2, 4, 16), 2**61, dtype=np.int64)
    with pytest.raises(InputError, match=r"sums to 2\.951e\+20 tokens .* below 2\*\*62"):
        LoadMatrix(counts)
    np.save(tmp_path / "wrap.npy", counts)
    assert_user_error(["plan", "--load", tmp_path / "wrap.npy", "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 4,
                       "--slots-per-gpu", 4, "--out", tmp_path / "p.json"], capsys, "sums to", "2**62")
    assert not (tmp_path / "p.json").exists()


def test_large_counts_whose_total_fits_are_kept_exactly() -> None:
    """One entry of 2**61 among zeros: the quick bound (max x size) fails, the exact total (2**61) passes."""
    counts = np.zeros((2, 4, 16), dtype=np.int64)
    counts[1, 2, 3] = 2**61
    load = LoadMatrix(counts)
    assert int(load.total().sum()) == 2**61 and int(load.counts.sum(axis=(0, 2))[2]) == 2**61
    # three entries just below the total limit in all: accepted, and every sum exact
    edge = np.zeros((1, 1, 3), dtype=np.int64)
    edge[0, 0] = [2**61, 2**60, 2**59]
    assert int(LoadMatrix(edge).counts.sum()) == 2**61 + 2**60 + 2**59


def test_the_total_limit_is_exact_near_it() -> None:
    """Two entries of ``2**61 - 1`` and a zero total ``2**62 - 2``, below the limit (the quick bound, largest x
    size, is not), but float64 rounds each to ``2**61`` and the total to ``2**62``: the load was refused. The exact
    total keeps it, and ``2**62`` itself is refused."""
    below = LoadMatrix(np.array([[[2**61 - 1, 2**61 - 1, 0]]], dtype=np.int64))
    assert int(below.counts.sum(dtype=object)) == 2**62 - 2
    with pytest.raises(InputError, match=r"sums to 4\.612e\+18 tokens"):
        LoadMatrix(np.array([[[2**61, 2**61]]], dtype=np.int64))
    with pytest.raises(InputError, match=r"sums to 4\.612e\+18 tokens"):
        LoadMatrix(np.array([[[2**61 - 1, 2**61 - 1, 2]]], dtype=np.uint64))


# ----- float counts: converted exactly, no numpy warnings --------------------------------------------------------

def test_float16_counts_convert_exactly_without_warnings() -> None:
    counts = np.full((2, 3, 4), 3, dtype=np.float16)
    counts[0, 1, 2] = 2048
    load = LoadMatrix(counts)
    assert load.counts.dtype == np.int64 and int(load.counts[0, 1, 2]) == 2048
    assert int(load.counts.sum()) == 23 * 3 + 2048


@pytest.mark.parametrize(("value", "fragment"), [(np.inf, "must be finite"), (2.5, "whole numbers"),
                                                 (-1.0, "non-negative")])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_bad_float_counts_are_one_line_without_warnings(dtype, value: float, fragment: str) -> None:
    counts = np.ones((1, 2, 4), dtype=dtype)
    counts[0, 1, 3] = value
    with pytest.raises(InputError, match=rf"counts\[0, 1, 3\] is .*{fragment}"):
        LoadMatrix(counts)


# ----- plan params: layer_ids and dense_layers -------------------------------------------------------------------

@pytest.mark.parametrize(("params", "fragment"), [
    ({"layer_ids": [-1, 0, 1, 2]}, "strictly increasing non-negative"),
    ({"layer_ids": [3, 2, 1, 0]}, "strictly increasing non-negative"),
    ({"layer_ids": [0, 1, 1, 2]}, "strictly increasing non-negative"),
    ({"layer_ids": [0, 1, 2, 3.0]}, "holds 3.0; layer numbers are integers"),
    ({"layer_ids": [1.5]}, "holds 1.5"),
    ({"layer_ids": [99]}, "lists 1 layers but the plan has 4"),
    ({"layer_ids": ["a", 1, 2, 3]}, "holds 'a'"),
    ({"layer_ids": [True, 2, 3, 4]}, "holds True"),
    ({"layer_ids": "0,1,2,3"}, "must be a list of layer numbers"),
    ({"layer_ids": [0, 1, 2, 10**12]}, "would take"),  # an export would write 10**12 rows
    ({"dense_layers": ["a"]}, "params.dense_layers holds 'a'"),
    ({"dense_layers": [1.5]}, "holds 1.5"),
    ({"dense_layers": [99]}, "names layer 99 but the plan's layers are 0..3"),
    ({"dense_layers": [-1]}, "names layer -1"),
    ({"dense_layers": [2, 2]}, "names layer 2 twice"),
    ({"dense_layers": {"0": 1}}, "must be a list"),
])
def test_plan_layer_params_are_validated(tmp_path, params: dict, fragment: str) -> None:
    doc = _plan_doc()
    doc["params"] = params
    with pytest.raises(PlanError, match=fragment):
        Placement.from_json_dict(doc)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=fragment):
        read_plan(tmp_path / "p.json")
    plan = Placement.from_json_dict(_plan_doc())
    with pytest.raises(PlanError, match=fragment):  # a plan's params are checked however they are set
        plan.with_params(params)


def test_valid_plan_layer_params_are_kept_as_ints(tmp_path) -> None:
    plan = Placement([[[0, 1], [2, 3], [4, 5], [6, 7]]] * 4, 8, C14,
                     params={"layer_ids": np.array([1, 2, 5, 61]), "dense_layers": [np.int64(3), 0]})
    assert plan.params["layer_ids"] == [1, 2, 5, 61] and plan.layer_ids == [1, 2, 5, 61]
    assert all(type(x) is int for x in plan.params["layer_ids"] + plan.params["dense_layers"])
    assert plan.dense_layers == frozenset({0, 3})
    write_plan(tmp_path / "p.json", plan)  # JSON-serialisable: numpy ints became Python ints
    assert read_plan(tmp_path / "p.json").layer_ids == [1, 2, 5, 61]
    assert Placement.from_json_dict(_plan_doc()).layer_ids is None


@pytest.mark.parametrize(("params", "fragment"), [
    ({"dense_layers": ["a"]}, "params.dense_layers holds 'a'"),
    ({"layer_ids": ["a", 1, 2, 3]}, "params.layer_ids holds 'a'"),
    ({"layer_ids": [-1, 0, 1, 2]}, "strictly increasing"),
    ({"layer_ids": [3, 2, 1, 0]}, "strictly increasing"),
])
def test_export_refuses_bad_layer_params(tmp_path, capsys, params: dict, fragment: str) -> None:
    """These tracebacked (``['a']``) or silently dropped or reversed rows of an SGLang export."""
    doc = _plan_doc()
    doc["params"] = params
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert_user_error(["export", "--plan", tmp_path / "p.json", "--format", "sglang", "--out", tmp_path / "o.json"],
                      capsys, fragment)
    assert not (tmp_path / "o.json").exists()


# ----- absurd sizes: one line before allocating ------------------------------------------------------------------

def test_plan_with_a_billion_experts_is_refused_before_allocating() -> None:
    doc = _plan_doc()
    doc["num_experts"] = 10**9  # [L, E, G] copies would be 128 GB
    with pytest.raises(PlanError, match="expert 8 of layer 0 has no replica"):
        Placement.from_json_dict(doc)


def test_cluster_of_ten_billion_gpus_is_refused() -> None:
    with pytest.raises(InputError, match=r"link matrix \[G, G\] of 100,000 nodes x 100,000 GPUs .* would take"):
        Cluster(num_nodes=100_000, gpus_per_node=100_000)


def test_absurd_slots_per_gpu_is_refused_before_a_policy_allocates() -> None:
    load = LoadMatrix(np.random.default_rng(0).integers(0, 100, (2, 4, 16)))
    with pytest.raises(BudgetError, match=r"physical slots \[L, G \* S\] .* would take .*lower slots_per_gpu"):
        resolve_budget(Budget(slots_per_gpu=10**12), 16, 4, 4)
    for policy in ("eplb", "greedy", "craft"):
        with pytest.raises(BudgetError, match="would take"):
            make_plan(policy, load, C14, Budget(slots_per_gpu=10**12))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_huge_expert_id_without_counts_is_refused_before_allocating(tmp_path, capsys, dtype) -> None:
    """E is the largest id + 1 when the file has no counts: id 2**31 - 2 meant [E]- and [B, L, E]-sized arrays."""
    ids = np.zeros((1, 600, 1), dtype=dtype)
    ids[0, 7, 0] = 2**31 - 2
    np.savez(tmp_path / "t.npz", topk_ids=ids, src_gpu=np.zeros(1, np.int64), batch=np.zeros(1, np.int64))
    with pytest.raises(InputError, match=r"counts \[B, L, E\] of this trace of shape \[1, 600, 2147483647\]"):
        read_load(tmp_path / "t.npz")
    assert_user_error(["stats", "--load", tmp_path / "t.npz"], capsys, "would take", "is the file damaged?")


def test_a_huge_batch_id_is_refused_before_allocating(tmp_path) -> None:
    np.savez(tmp_path / "t.npz", topk_ids=np.zeros((2, 1, 1), np.int16), src_gpu=np.zeros(2, np.int64),
             batch=np.array([0, 10**12]))
    with pytest.raises(InputError, match=r"shape \[1000000000001, 1, 1\] would take"):
        read_load(tmp_path / "t.npz")


@pytest.mark.parametrize(("sizes", "fragment"), [
    ({"num_batches": 10**10}, r"counts \[B, L, E\] of shape \[10000000000, 32, 8\] would take"),
    ({"num_gpus": 10**11}, r"topic mixtures \[B, G, C\] .* would take"),
    ({"tokens_per_batch": 2**60}, "exact below 2\\*\\*53"),
    ({"num_batches": 2**40, "tokens_per_batch": 2**16}, "fewer than 2\\*\\*62"),
])
def test_synth_refuses_absurd_sizes_before_allocating(sizes: dict, fragment: str) -> None:
    args = {"num_batches": 2, "tokens_per_batch": 16, "num_gpus": 2, "seed": 0} | sizes
    with pytest.raises(InputError, match=fragment):
        synthesize("mixtral-8x7b", **args)


def test_synth_with_a_trillion_tokens_per_batch_samples_counts_without_a_token_array() -> None:
    """The count path allotted tokens to ranks through an [T] array: 8 TB for T = 10**12."""
    T = 10**12
    counts = synthesize("mixtral-8x7b", num_batches=2, tokens_per_batch=T, num_gpus=3, seed=0)["counts"]
    assert counts.shape == (2, 32, 8)
    assert np.all(counts.sum(axis=2) == 2 * T) and counts.max() <= T and counts.min() >= 0
    assert int(LoadMatrix(counts).counts.sum()) == 2 * 32 * 2 * T  # and it reads back as a load


# ----- JSON that cannot be read --------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "fragment"), [
    ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
    ('{"a": [' * 50_000 + "]}" * 50_000, "nests too deeply"),
    ('{"logical_count": ' + "7" * 5000 + "}", "holds a value that cannot be read"),
    ('{"format": "moebalance.plan"', "is not valid JSON"),
])
def test_read_json_turns_unreadable_json_into_one_line(tmp_path, text: str, fragment: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(InputError, match=fragment) as info:
        read_json(path, "SGLang load")
    assert str(info.value).startswith(f"SGLang load {str(path)!r}") and "\n" not in str(info.value)
    with pytest.raises(PlanError, match=fragment):
        read_plan(path)


def test_read_json_names_missing_and_binary_files(tmp_path) -> None:
    with pytest.raises(PlanError, match=r"plan file .* does not exist"):
        read_json(tmp_path / "nowhere.json", "plan file", error=PlanError)
    with pytest.raises(InputError, match="is not a file"):
        read_json(tmp_path, "load")
    (tmp_path / "b.json").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(InputError, match="is not UTF-8 text"):
        read_json(tmp_path / "b.json", "load")
    (tmp_path / "ok.json").write_text('{"a": [1, 2]}')
    assert read_json(tmp_path / "ok.json", "load") == {"a": [1, 2]}


def test_dumps_writes_numpy_scalars_and_arrays_as_their_values_and_refuses_other_objects() -> None:
    """A count numpy summed (``np.int64``), a float32 time, a numpy bool and an array are written as the numbers,
    bool and list they hold, in the same text as the Python values; an object JSON has no form for is refused."""
    doc = {"moves": np.int64(7), "seconds": np.float32(0.5), "ok": np.bool_(True),
           "loads": np.arange(3, dtype=np.int32), "grid": np.eye(2), "rate": np.float64(0.25)}
    text = dumps(doc)
    assert text == dumps({"moves": 7, "seconds": 0.5, "ok": True, "loads": [0, 1, 2],
                          "grid": [[1.0, 0.0], [0.0, 1.0]], "rate": 0.25})
    assert json.loads(text)["moves"] == 7 and text.endswith("}\n")
    with pytest.raises(TypeError, match="Path is not JSON serializable"):
        dumps({"where": Path("x")})


def test_a_deeply_nested_plan_is_one_line_on_the_command_line(tmp_path, capsys) -> None:
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_user_error(["export", "--plan", tmp_path / "deep.json", "--format", "sglang", "--out",
                       tmp_path / "o.json"], capsys, "nests too deeply")


# ----- presets -----------------------------------------------------------------------------------------------------

def test_an_unknown_preset_is_refused_with_the_known_names(tmp_path, capsys) -> None:
    np.savez(tmp_path / "l.npz", counts=np.ones((2, 4, 16), np.int64), preset=np.array("bogus"))
    with pytest.raises(InputError, match=r"preset 'bogus' is not a known model; name one of .*deepseek-v3.*"
                                         "moebalance-moe-lm"):
        read_load(tmp_path / "l.npz")
    assert_user_error(["stats", "--load", tmp_path / "l.npz"], capsys, "'bogus'", "mixtral-8x7b")
    with pytest.raises(InputError, match="'bogus'"):
        LoadMatrix(np.ones((1, 2, 4), np.int64), preset="bogus")
    # the known names, the captured LM's included, are kept
    np.savez(tmp_path / "lm.npz", counts=np.ones((2, 4, 16), np.int64), preset=np.array(LM_PRESET))
    assert read_load(tmp_path / "lm.npz").preset == LM_PRESET
    assert LoadMatrix(np.ones((1, 2, 4), np.int64), preset="olmoe-1b-7b").model is not None


# ----- calibration measurements --------------------------------------------------------------------------------

@pytest.mark.parametrize(("column", "value", "fragment"), [
    (4, "1e300", "seconds is 1e+300; it must lie in"),
    (4, "inf", "seconds is inf"),
    (4, "1e-12", "seconds is 1e-12"),
    (0, "1e300", "experts is 1e+300"),
    (1, "1e300", "tokens_per_expert is 1e+300"),
    (2, "1e300", "hidden_size is 1e+300"),
    (3, "nan", "ffn_size is nan"),
    (0, "1.5", "experts is 1.5; it must be a whole number"),
])
def test_calibrate_refuses_absurd_measurements(tmp_path, capsys, column: int, value: str, fragment: str) -> None:
    """1e300 seconds wrote a calibration of 100% efficiency (and 1e300 sizes leaked overflow warnings)."""
    rows = [["8", "128", "4096", "1024", "0.001"], ["8", "256", "4096", "1024", "0.002"]]
    rows[1][column] = value
    (tmp_path / "m.csv").write_text(CSV_HEAD + "".join(",".join(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=re.escape(f"line 3: {fragment}")):
        read_measurements(tmp_path / "m.csv")
    assert_user_error(["calibrate", "--measurements", tmp_path / "m.csv", "--gpu", "h100-80gb", "--out",
                       tmp_path / "cal.json"], capsys, fragment)
    assert not (tmp_path / "cal.json").exists()


def test_calibrate_refuses_a_repeated_column(tmp_path, capsys) -> None:
    """A second ``seconds`` column (all 1 s) replaced the first: a 1 s launch cost fitted with error 1e-06."""
    rows = ["8,128,7168,2048,0.001,1\n", "8,256,7168,2048,0.002,1\n", "1,1,7168,2048,0.0002,1\n"]
    (tmp_path / "dup.csv").write_text(CSV_HEAD.replace("\n", ",seconds\n") + "".join(rows))
    with pytest.raises(InputError, match="has column 'seconds' more than once \\(columns 5, 6\\)"):
        read_measurements(tmp_path / "dup.csv")
    assert_user_error(["calibrate", "--measurements", tmp_path / "dup.csv", "--gpu", "h100-80gb", "--out",
                       tmp_path / "cal.json"], capsys, "dup.csv", "'seconds' more than once", "keep one")
    assert not (tmp_path / "cal.json").exists()


@pytest.mark.parametrize(("rows", "points"), [
    (["8,128,7168,2048,0.001"], 1),
    (["8,128,7168,2048,0.001"] * 5, 1),  # repeats of one size: still one point
    (["8,128,7168,2048,0.001", "8,128,7168,2048,0.0011", "1,1,7168,2048,0.0002"], 2),
])
def test_calibrate_refuses_fewer_distinct_points_than_constants(tmp_path, capsys, rows: list[str],
                                                                  points: int) -> None:
    """One measurement was fitted with error 0.0 (three constants through one point), which advise then took as
    its margin floor: fewer distinct sizes than the 3 constants fitted are refused, saying both counts."""
    (tmp_path / "m.csv").write_text(CSV_HEAD + "\n".join(rows) + "\n")
    noun = "point" if points == 1 else "points"
    assert_user_error(["calibrate", "--measurements", tmp_path / "m.csv", "--gpu", "h100-80gb", "--out",
                       tmp_path / "cal.json"], capsys, "m.csv", f": {points} distinct measurement {noun}",
                      "needs at least 3")
    assert not (tmp_path / "cal.json").exists()
    # a third distinct size is enough
    (tmp_path / "m.csv").write_text(CSV_HEAD + "\n".join([*rows, "32,64,7168,2048,0.004", "1,4,7168,2048,0.0003"])
                                    + "\n")
    rc, _, err = run_cli(["calibrate", "--measurements", tmp_path / "m.csv", "--gpu", "h100-80gb", "--out",
                          tmp_path / "cal.json"], capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "cal.json").read_text())["gpu"] == "h100-80gb"


def test_a_calibration_whose_gpu_is_not_a_name_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "cal.json").write_text('{"format": "moebalance.calibration", "gpu": [5]}')
    assert_user_error(["cost", "--model", "olmoe-1b-7b", "--gpu", "h100-80gb", "--nodes", 1, "--gpus-per-node", 8,
                       "--calibration", tmp_path / "cal.json"], capsys, "cal.json", "gpu is [5]")


def test_a_calibration_with_an_unreadable_number_is_one_line(tmp_path, capsys) -> None:
    """A calibration JSON holding a 5,000-digit integer raised Python's ValueError (integer string conversion
    limit) out of the reader: a traceback."""
    (tmp_path / "cal.json").write_text('{"format": "moebalance.calibration", "launch_us": ' + "1" * 5000 + "}")
    assert_user_error(["cost", "--model", "deepseek-v3", "--gpu", "h100-80gb", "--nodes", 1, "--gpus-per-node", 8,
                       "--calibration", tmp_path / "cal.json"], capsys, "calibration", "cannot be read")


def test_measurements_built_in_code_are_checked_too() -> None:
    good = {"experts": [8.0], "tokens_per_expert": [128.0], "hidden_size": [4096.0], "ffn_size": [1024.0]}
    assert Measurements(**good, seconds=np.array([1e-3])).seconds.tolist() == [1e-3]
    with pytest.raises(InputError, match="run 0: seconds is 1e\\+300"):
        Measurements(**good, seconds=np.array([1e300]))
    with pytest.raises(InputError, match="one value per run"):
        Measurements(**good, seconds=np.array([1e-3, 2e-3]))


# ----- temporaries left by killed writers ------------------------------------------------------------------------

_WRITER = r"""
import sys, time
from moebalance.core.io import atomic_path, install_sigterm_handler
if sys.argv[2] == "handler":
    install_sigterm_handler()
with atomic_path(sys.argv[1]) as tmp:
    with open(tmp, "wb") as fh:
        fh.write(b"x" * (1 << 20))
        fh.flush()
        print(tmp, flush=True)
        time.sleep(120)
"""


def _start_writer(target: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    """A real process stopped in the middle of writing ``target`` through :func:`atomic_path`; and its temporary."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise AssertionError(f"the writer did not start: {proc.communicate()[1]}")
    tmp = Path(line)
    assert tmp.exists() and tmp.parent == target.parent and tmp.name.startswith(f".{target.name}.")
    return proc, tmp


def test_sigterm_mid_write_leaves_nothing(tmp_path) -> None:
    target = tmp_path / "out.npz"
    proc, tmp = _start_writer(target, "handler")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not tmp.exists() and not target.exists() and list(tmp_path.iterdir()) == []


def test_sigkill_mid_write_leaves_a_temporary_that_the_next_write_removes(tmp_path) -> None:
    target = tmp_path / "plan.json"
    proc, tmp = _start_writer(target, "plain")
    proc.kill()  # SIGKILL: nothing in the process can clean up
    proc.communicate(timeout=60)
    assert tmp.exists() and tmp.stat().st_size == 1 << 20
    other = tmp_path / ".other.json.1@elsewhere.abc.tmp"  # another file's, another host's: not ours to remove
    other.write_text("x")
    atomic_write_text(target, "done\n")
    assert target.read_text() == "done\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, other.name])


def test_a_live_writer_keeps_its_temporary(tmp_path) -> None:
    target = tmp_path / "trace.npz"
    proc, tmp = _start_writer(target, "handler")
    try:
        assert remove_stale_temporaries(target) == []
        atomic_write_text(target, "other writer\n")  # a second writer of the same file while the first is alive
        assert tmp.exists() and target.read_text() == "other writer\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert not tmp.exists()


def test_atomic_path_removes_its_temporary_on_error(tmp_path) -> None:
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "x.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def _temporary_name(target: Path) -> str:
    """The name :func:`atomic_path` gives a temporary of ``target`` on this host now (the write is abandoned)."""
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        name = tmp.name
        raise RuntimeError("abandon")
    return name


def test_hosts_whose_names_share_a_long_prefix_keep_each_others_temporaries(tmp_path, monkeypatch) -> None:
    """Host names were cut to 32 characters (and dots made dashes): two hosts on one shared folder whose names
    agree that far took each other's temporaries for their own and removed those of the other's live writers."""
    prefix = "gpu-partition-a-cluster-example-"  # 32 characters: cluster node names share it
    tokens = {}
    for name in (prefix + "node001", prefix + "node002", "a.b", "a-b"):
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        tokens[name] = _temporary_name(tmp_path / "probe").split("@")[1].split(".")[0]
    assert len(set(tokens.values())) == 4, tokens
    assert tokens["a-b"] == "a-b" and all(len(t) <= 32 for t in tokens.values())
    # a writer on node002 whose pid is not a process on node001: node001's next write must leave its temporary
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True, check=True).stdout)
    theirs = tmp_path / f".plan.json.{pid}@{tokens[prefix + 'node002']}.abcdefgh.tmp"
    theirs.write_text("x")
    monkeypatch.setattr(socket, "gethostname", lambda: prefix + "node001")
    atomic_write_text(tmp_path / "plan.json", "done\n")
    assert theirs.exists()


def test_files_that_only_look_like_temporaries_are_kept_and_do_not_stop_a_write(tmp_path) -> None:
    """A pid too large for the OS (``os.kill`` raised OverflowError: every later write of that output ended in a
    traceback), a zero-padded or non-ASCII number: no writer of ours names a temporary so; they stay."""
    target = tmp_path / "plan.json"
    host = _temporary_name(tmp_path / "probe").split("@")[1].split(".")[0]
    odd = [f".plan.json.{'9' * 30}@{host}.abc.tmp", f".plan.json.0000001234567@{host}.abc.tmp",
           f".plan.json.\u0663\u0663\u0663\u0663\u0663\u0663\u0663@{host}.abc.tmp"]
    for name in odd:
        (tmp_path / name).write_text("x")
    assert remove_stale_temporaries(target) == []
    atomic_write_text(target, "done\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*odd, "plan.json"])


# ----- output folders replaced as a whole ------------------------------------------------------------------------

def _files(folder: Path) -> dict[str, str]:
    """``{relative path: text}`` of every file under ``folder`` (hidden ones included)."""
    return {str(f.relative_to(folder)): f.read_text() for f in sorted(folder.rglob("*")) if f.is_file()}


def _write_folder(target: Path, files: dict[str, str]) -> None:
    with atomic_dir(target) as tmp:
        for name, text in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text)


def test_atomic_dir_replaces_a_folder_it_wrote_as_a_whole(tmp_path) -> None:
    target = tmp_path / "results"
    _write_folder(target, {"a.json": "old a", "sub/b.txt": "old b"})
    assert _files(target) == {OUT_DIR_MARK: (target / OUT_DIR_MARK).read_text(), "a.json": "old a",
                              "sub/b.txt": "old b"}
    (target / "stale.txt").write_text("from an earlier run")
    _write_folder(target, {"a.json": "new a", "c.md": "new c"})
    mark = (target / OUT_DIR_MARK).read_text()
    assert "moebalance wrote this folder" in mark
    assert _files(target) == {OUT_DIR_MARK: mark, "a.json": "new a", "c.md": "new c"}  # stale.txt and sub/ gone
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # no temporary or set-aside folder left
    umask = os.umask(0)
    os.umask(umask)
    assert oct(target.stat().st_mode & 0o777) == oct(0o777 & ~umask)  # not mkdtemp's owner-only 0o700


def test_atomic_dir_leaves_the_old_folder_and_no_temporary_when_the_body_fails(tmp_path) -> None:
    target = tmp_path / "results"
    _write_folder(target, {"a.json": "old a", "b.json": "old b"})
    before = _files(target)
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target and list(tmp.iterdir()) == []
        (tmp / "a.json").write_text("new a")  # half of the new files written, then a failure
        raise RuntimeError("boom")
    assert _files(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["results"]
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "new") as tmp:  # a new folder: nothing appears
        (tmp / "a.json").write_text("x")
        raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["results"]


def test_atomic_dir_refuses_a_file_the_current_folder_and_a_folder_of_other_files(tmp_path, monkeypatch) -> None:
    work = tmp_path / "work"
    mine = work / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("the user's")
    (work / "a-file").write_text("x")
    monkeypatch.chdir(work)
    for path, fragment in (("a-file", "'a-file' is a file"), (".", "is the current folder or one above it"),
                           ("..", "is the current folder or one above it"), (str(work), "current folder"),
                           ("mine", "holds 'notes.txt' but no .moebalance-out")):
        with pytest.raises(InputError, match=re.escape(fragment)) as info:
            with atomic_dir(path, "--out-dir"):
                raise AssertionError("the body must not run")
        assert "\n" not in str(info.value) and "--out-dir" in str(info.value)
        with pytest.raises(InputError, match=re.escape(fragment)):
            check_out_dir(path)
    assert (mine / "notes.txt").read_text() == "the user's" and sorted(p.name for p in work.iterdir()) == [
        "a-file", "mine"]
    (work / "empty").mkdir()  # an empty folder is taken
    _write_folder(work / "empty", {"x.json": "x"})
    assert sorted(_files(work / "empty")) == [OUT_DIR_MARK, "x.json"]


def test_atomic_dir_through_a_symbolic_link_replaces_the_folder_it_names(tmp_path) -> None:
    real = tmp_path / "real"
    _write_folder(real, {"a.json": "old"})
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    _write_folder(link, {"b.json": "new"})
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link stays a link
    assert sorted(_files(real)) == [OUT_DIR_MARK, "b.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


_FOLDER_WRITER = r"""
import sys, time
from moebalance.core.io import atomic_dir
with atomic_dir(sys.argv[1]) as tmp:
    (tmp / "a.json").write_text("new a")
    print(tmp, flush=True)
    time.sleep(120)
"""


def test_sigkill_mid_folder_write_keeps_the_old_folder_and_the_next_write_removes_the_temporary(tmp_path) -> None:
    target = tmp_path / "results"
    _write_folder(target, {"a.json": "old a", "b.json": "old b"})
    before = _files(target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _FOLDER_WRITER, str(target)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    proc.kill()  # SIGKILL, half-way through writing the new folder
    _, stderr = proc.communicate(timeout=60)
    assert line, f"the writer did not start: {stderr}"
    tmp = Path(line)
    assert tmp.parent == tmp_path and tmp.name.startswith(".results.") and tmp.name.endswith(".tmpdir")
    assert _files(target) == before and _files(tmp) == {"a.json": "new a"}  # all old, the new one beside it
    _write_folder(target, {"c.json": "c"})
    assert sorted(_files(target)) == [OUT_DIR_MARK, "c.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # the dead writer's temporary folder removed


def test_an_address_space_limit_is_the_limit_and_an_unforeseen_memory_error_is_one_line(tmp_path: Path) -> None:
    """Under ``ulimit -v`` the size check uses the limit: counts of 65,536 x 65,536 tokens' batches fit this
    machine's memory but not 4 GB of address space, so synth refuses them in one line before allocating."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 10**9, 4 * 10**9))

    out = tmp_path / "x.npz"
    proc = subprocess.run([sys.executable, "-m", "moebalance", "synth", "--preset", "deepseek-v3", "--batches", "65536",
                           "--tokens-per-batch", "65536", "--gpus", "8", "--out", str(out)], capture_output=True,
                          text=True, preexec_fn=limit, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("moebalance: error:"), proc.stderr
    assert "of memory (or ulimit -v)" in lines[0]
    assert list(tmp_path.iterdir()) == []


# ----- a load must fit the model it is for --------------------------------------------------------------------------

OLMOE_RUN = ["--nodes", 1, "--gpus-per-node", 4]  # OLMoE-1B-7B: 16 MoE layers (0..15) of 64 experts


def _load_commands(load: Path, plan: Path, out: Path) -> dict[str, list[object]]:
    """Every command that reads ``--load`` with a model, each run on ``load``."""
    policy = ["--policy", "eplb", *OLMOE_RUN, "--slots-per-gpu", 16]
    return {"plan": ["plan", "--load", load, *policy, "--out", out / "p.json"],
            "evaluate": ["evaluate", "--plan", plan, "--load", load],
            "stats": ["stats", "--load", load],
            "compare": ["compare", "--load", load, "--policies", "eplb", *OLMOE_RUN, "--slots-per-gpu", 16],
            "online": ["online", "--load", load, *policy, "--warmup", "0:2"],
            "cost": ["cost", "--plan", plan, "--load", load, "--gpu", "h100-80gb", "--model", "olmoe-1b-7b"],
            "advise": ["advise", "--load", load, "--engine", "vllm", *OLMOE_RUN, "--gpu", "h100-80gb"]}


@pytest.fixture
def olmoe_plan(tmp_path: Path) -> Path:
    """A plan of OLMoE-1B-7B's 16 layers, made on a load that records no layer ids."""
    counts = np.random.default_rng(0).integers(1, 50, size=(4, 16, 64))
    path = tmp_path / "olmoe-plan.json"
    write_plan(path, make_plan("eplb", LoadMatrix(counts, preset="olmoe-1b-7b"), C14, Budget(slots_per_gpu=16))[0])
    return path


@pytest.mark.parametrize("command", ["plan", "evaluate", "stats", "compare", "online", "cost", "advise"])
def test_a_load_of_layers_its_model_lacks_is_refused_by_every_command(command: str, tmp_path: Path, olmoe_plan: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A load naming OLMoE-1B-7B (layers 0..15) that records layer ids 5..20: evaluate scored it as layers 0..15
    and ignored the ids; now every command refuses it in one line naming the ids the model lacks and its layers."""
    counts = np.random.default_rng(1).integers(1, 50, size=(4, 16, 64))
    write_load(tmp_path / "ids.npz", LoadMatrix(counts, preset="olmoe-1b-7b", layer_ids=np.arange(5, 21)))
    out = tmp_path / "out"
    out.mkdir()
    assert_user_error(_load_commands(tmp_path / "ids.npz", olmoe_plan, out)[command], capsys,
                      "does not fit model 'olmoe-1b-7b'", "layers 16..20, which OLMoE-1B-7B lacks",
                      "its MoE layers are 0..15")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("command", ["plan", "evaluate", "stats", "compare", "online", "advise"])
def test_a_load_named_as_one_model_with_anothers_shape_is_refused_by_every_command(
        command: str, tmp_path: Path, olmoe_plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A load of Mixtral's shape (32 layers x 8 experts) that names OLMoE-1B-7B: advise refused it, evaluate took it;
    now every command refuses it the same way, and ``--model`` naming the model it was recorded for is taken."""
    counts = np.random.default_rng(2).integers(1, 50, size=(4, 32, 8))
    write_load(tmp_path / "named.npz", LoadMatrix(counts, preset="olmoe-1b-7b"))
    out = tmp_path / "out"
    out.mkdir()
    argv = _load_commands(tmp_path / "named.npz", olmoe_plan, out)[command]
    assert_user_error(argv, capsys, "the load does not fit model 'olmoe-1b-7b'",
                      "8 experts per layer, but OLMoE-1B-7B has 64", "--model")
    if command == "plan":
        rc, _, err = run_cli([*argv, "--model", "mixtral-8x7b"], capsys)
        assert rc == 0, err
        assert read_plan(out / "p.json").num_experts == 8


def test_a_plan_records_its_layer_ids_and_is_scored_only_on_those_layers(tmp_path: Path, olmoe_plan: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A load of 16 layers that records the model's layer ids 5..20 (naming no model): its plan records them, scores
    on it, and is refused on a load of layers 0..15; a plan of layers 0..15 is refused on it (evaluate ignored the ids
    and scored either)."""
    counts = np.random.default_rng(3).integers(1, 50, size=(4, 16, 64))
    write_load(tmp_path / "ids.npz", LoadMatrix(counts, layer_ids=np.arange(5, 21)))
    write_load(tmp_path / "plain.npz", LoadMatrix(counts))
    rc, _, err = run_cli(["plan", "--load", tmp_path / "ids.npz", "--policy", "eplb", *OLMOE_RUN, "--slots-per-gpu", 16,
                          "--out", tmp_path / "p.json"], capsys)
    assert rc == 0, err
    assert read_plan(tmp_path / "p.json").params["layer_ids"] == list(range(5, 21))
    rc, _, err = run_cli(["evaluate", "--plan", tmp_path / "p.json", "--load", tmp_path / "ids.npz"], capsys)
    assert rc == 0, err
    assert_user_error(["evaluate", "--plan", tmp_path / "p.json", "--load", tmp_path / "plain.npz"], capsys,
                      "the plan was made for the model's layers 5..20 but the load holds layers 0..15")
    assert_user_error(["evaluate", "--plan", olmoe_plan, "--load", tmp_path / "ids.npz"], capsys,
                      "the plan was made for the model's layers 0..15 but the load holds layers 5..20")
