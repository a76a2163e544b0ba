"""The ``moebalance`` command line: happy paths, and every kind of bad input.

User errors (docs/design.md, "Data formats" and the ``cli`` docstring): exit code 2, exactly one stderr line starting with
``moebalance: error:`` that names the bad value, no traceback, and no output (or temporary) file left behind.

Most tests call :func:`moebalance.app.cli.main` in-process; one runs the installed console script.
Small data throughout: 3 layers x 16 experts, top-2, 4 batches of 32 tokens, 2 nodes x 2 GPUs.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_cli

from moebalance.core.plan import read_plan

L, E, K, B, TOKENS = 3, 16, 2, 4, 32
NODES, GPN = 2, 2
G = NODES * GPN
CLUSTER = ["--nodes", str(NODES), "--gpus-per-node", str(GPN)]


# ----- helpers -------------------------------------------------------------------------------------------------

def tree(root: Path) -> list[str]:
    """Every path under ``root`` (hidden temporary files included), relative and sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def assert_user_error(argv: Sequence[Any], capsys: pytest.CaptureFixture[str], root: Path,
                      *fragments: str) -> str:
    """Run ``argv`` and check the user-error contract; returns the error line."""
    before = tree(root)
    rc, _, err = run_cli(argv, capsys)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert rc == 2, f"exit code {rc}, stderr: {err!r}"
    assert len(lines) == 1, f"expected exactly one stderr line, got: {err!r}"
    line = lines[0]
    assert line.startswith("moebalance: error:"), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    assert tree(root) == before, "an output or temporary file was left behind"
    return line


def make_trace(seed: int = 0, num_batches: int = B, num_gpus: int = G) -> dict[str, np.ndarray]:
    """A valid token-level trace: skewed top-k picks, distinct within a token, with matching counts."""
    rng = np.random.default_rng(seed)
    T = num_batches * TOKENS
    popularity = rng.dirichlet(np.full(E, 0.4), size=L)  # [L, E]
    keys = np.log(popularity + 1e-12)[None] + rng.gumbel(size=(T, L, E))  # Gumbel top-k: distinct picks
    topk_ids = np.argsort(-keys, axis=2)[:, :, :K].astype(np.int64)  # [T, L, K]
    src_gpu = rng.integers(0, num_gpus, size=T).astype(np.int64)
    batch = np.repeat(np.arange(num_batches, dtype=np.int64), TOKENS)
    return {"counts": counts_of(topk_ids, batch, num_batches), "topk_ids": topk_ids, "src_gpu": src_gpu,
            "batch": batch}


def counts_of(topk_ids: np.ndarray, batch: np.ndarray, num_batches: int) -> np.ndarray:
    counts = np.zeros((num_batches, L, E), dtype=np.int64)
    for t in range(topk_ids.shape[0]):
        for layer in range(L):
            for e in topk_ids[t, layer]:
                counts[batch[t], layer, e] += 1
    return counts


def contiguous_doc(num_layers: int = L, num_experts: int = E) -> dict[str, Any]:
    """A valid plan document: GPU g hosts a block of consecutive experts in every layer."""
    per = num_experts // G
    return {"format": "moebalance.plan", "version": 1, "policy": "custom", "params": {},
            "cluster": {"num_nodes": NODES, "gpus_per_node": GPN}, "num_layers": num_layers,
            "num_experts": num_experts,
            "placement": [[list(range(g * per, (g + 1) * per)) for g in range(G)] for _ in range(num_layers)]}


def write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def inp(tmp_path: Path) -> Path:
    d = tmp_path / "in"
    d.mkdir()
    return d


@pytest.fixture
def outdir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.fixture
def trace_file(inp: Path) -> Path:
    p = inp / "trace.npz"
    np.savez(p, **make_trace())
    return p


@pytest.fixture
def plan_file(inp: Path) -> Path:
    return write_json(inp / "contiguous.json", contiguous_doc())


# ----- bad load files ------------------------------------------------------------------------------------------

def _npy(arr: np.ndarray) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        np.save(d / "load.npy", arr)
        return d / "load.npy"
    return build


def _npz(**arrays: Any) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        np.savez(d / "load.npz", **arrays)
        return d / "load.npz"
    return build


def _trace_npz(edit: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        arrays = make_trace()
        edit(arrays)
        np.savez(d / "trace.npz", **arrays)
        return d / "trace.npz"
    return build


def _with_nan() -> np.ndarray:
    a = np.ones((B, L, E))
    a[1, 2, 3] = np.nan
    return a


def _with_value(value: float, dtype: Any) -> np.ndarray:
    a = np.ones((B, L, E), dtype=dtype)
    a[0, 1, 2] = value
    return a


def _pickled_npy(d: Path) -> Path:
    np.save(d / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return d / "obj.npy"


def _pickled_npz(d: Path) -> Path:
    np.savez(d / "obj.npz", counts=np.array([{"a": 1}], dtype=object))
    return d / "obj.npz"


def _truncated(suffix: str) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        p = d / f"cut{suffix}"
        counts = np.ones((B, L, E), dtype=np.int64)
        if suffix == ".npy":
            np.save(p, counts)
        else:
            np.savez_compressed(p, counts=counts)
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
        return p
    return build


def _not_numpy(d: Path) -> Path:
    p = d / "text.npy"
    p.write_text("layer,expert,count\n0,0,3\n")
    return p


def _csv(d: Path) -> Path:
    p = d / "load.csv"
    p.write_text("1,2,3\n4,5,6\n")
    return p


def _missing(d: Path) -> Path:
    return d / "nowhere.npz"


def _set(key: str, index: tuple[int, ...], value: int, drop_counts: bool = True) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(a: dict[str, np.ndarray]) -> None:
        a[key][index] = value
        if drop_counts:
            del a["counts"]
    return edit


def _bump_count(a: dict[str, np.ndarray]) -> None:
    a["counts"][1, 2, 3] += 1


def _repeat_pick(a: dict[str, np.ndarray]) -> None:
    a["topk_ids"][7, 2, 1] = a["topk_ids"][7, 2, 0]
    del a["counts"]


def _go_back(a: dict[str, np.ndarray]) -> None:
    a["batch"][TOKENS + 8] = 0  # token 40 is in batch 0 again, after token 39 of batch 1
    del a["counts"]


def _drop(key: str) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(a: dict[str, np.ndarray]) -> None:
        del a[key]
    return edit


BAD_LOADS: list[Any] = [
    pytest.param(_npy(_with_nan()), ("counts[1, 2, 3] is nan",), id="nan"),
    pytest.param(_npz(counts=_with_nan()), ("counts[1, 2, 3] is nan",), id="nan-npz"),
    pytest.param(_npy(_with_value(-1, np.int64)), ("counts[0, 1, 2] is -1", "non-negative"), id="negative"),
    pytest.param(_npy(_with_value(1.5, np.float64)), ("counts[0, 1, 2] is 1.5", "whole"), id="fractional"),
    pytest.param(_npy(np.ones(E, dtype=np.int64)), ("(16,)",), id="1-d"),
    pytest.param(_npy(np.ones((2, 2, L, E), dtype=np.int64)), ("(2, 2, 3, 16)",), id="4-d"),
    pytest.param(_npy(np.ones((L, 0), dtype=np.int64)), ("every dimension must be at least 1",), id="empty-2d"),
    pytest.param(_npz(counts=np.ones((0, L, E), dtype=np.int64)), ("every dimension must be at least 1",),
                 id="empty-batches"),
    pytest.param(_npy(np.ones((B, L, E), dtype=bool)), ("dtype bool",), id="bool"),
    pytest.param(_npy(np.full((B, L, E), "x")), ("dtype <U1",), id="strings"),
    pytest.param(_pickled_npy, ("obj.npy", "pickled"), id="pickled-npy"),
    pytest.param(_pickled_npz, ("obj.npz", "pickled"), id="pickled-npz"),
    pytest.param(_truncated(".npy"), ("cannot read", "cut.npy"), id="truncated-npy"),
    pytest.param(_truncated(".npz"), ("cannot read", "cut.npz"), id="truncated-npz"),
    pytest.param(_not_numpy, ("cannot read", "text.npy"), id="not-numpy"),
    pytest.param(_missing, ("nowhere.npz", "does not exist"), id="missing"),
    pytest.param(_csv, ("load.csv", "must end in .npy"), id="csv"),
    pytest.param(_npz(weights=np.ones((L, E))), ("no 'counts' array", "weights"), id="no-counts"),
    pytest.param(_trace_npz(_bump_count), ("counts[1, 2, 3] is", "topk_ids routes"), id="trace-count-mismatch"),
    pytest.param(_trace_npz(_drop("topk_ids")), ("lacks topk_ids",), id="trace-no-topk_ids"),
    pytest.param(_trace_npz(_drop("src_gpu")), ("lacks src_gpu",), id="trace-no-src_gpu"),
    pytest.param(_trace_npz(_drop("batch")), ("lacks batch",), id="trace-no-batch"),
    pytest.param(_trace_npz(_set("topk_ids", (5, 1, 0), E, drop_counts=False)), ("expert id 16", "[0, 16)"),
                 id="expert-id-too-large"),
    pytest.param(_trace_npz(_set("topk_ids", (5, 1, 0), -1)), ("expert id -1",), id="expert-id-negative"),
    pytest.param(_trace_npz(_repeat_pick), ("token 7 picks the same expert twice in layer 2",), id="repeated-pick"),
    pytest.param(_trace_npz(_go_back), ("non-decreasing", "token 40"), id="batch-decreasing"),
    pytest.param(_trace_npz(_set("src_gpu", (3,), -2)), ("src_gpu holds rank -2",), id="src-gpu-negative"),
]

COMMANDS = ["plan", "evaluate", "compare", "stats"]


def load_command(command: str, load: Path, tmp_path: Path) -> list[Any]:
    out = tmp_path / "out"
    if command == "plan":
        return ["plan", "--load", load, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--out", out / "plan.json"]
    if command == "evaluate":
        plan = write_json(tmp_path / "in" / "contiguous.json", contiguous_doc())
        return ["evaluate", "--plan", plan, "--load", load, "--json"]
    if command == "compare":
        return ["compare", "--load", load, "--policies", "contiguous,greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--out-dir", out / "cmp"]
    return ["stats", "--load", load]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("build", "fragments"), BAD_LOADS)
def test_bad_load_file(command: str, build: Callable[[Path], Path], fragments: tuple[str, ...], tmp_path: Path,
                       inp: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    load = build(inp)
    argv = load_command(command, load, tmp_path)
    assert_user_error(argv, capsys, tmp_path, *fragments)


@pytest.mark.parametrize("command", ["plan", "evaluate", "compare"])
def test_corrupted_npz_is_a_user_error(command: str, tmp_path: Path, inp: Path, outdir: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # Intact zip directory, damaged compressed member: numpy raises zlib.error while reading the array.
    p = inp / "corrupt.npz"
    np.savez_compressed(p, counts=np.random.default_rng(0).integers(0, 50, (B, L, E)))
    data = bytearray(p.read_bytes())
    for i in range(60, 120):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))
    assert_user_error(load_command(command, p, tmp_path), capsys, tmp_path, "cannot read", "corrupt.npz")


@pytest.mark.parametrize("name", ["text.npy", "text.npz"])
def test_text_file_is_not_called_pickled(name: str, tmp_path: Path, inp: Path, outdir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # A CSV saved under a numpy name holds no pickle; the message should not send the user hunting for one.
    p = inp / name
    p.write_text("layer,expert,count\n0,0,3\n")
    line = assert_user_error(load_command("plan", p, tmp_path), capsys, tmp_path, "cannot read", name)
    assert "pickle" not in line, line


def test_src_gpu_beyond_cluster_at_evaluate(tmp_path: Path, inp: Path, plan_file: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    arrays = make_trace()
    arrays["src_gpu"][-1] = 6  # the trace was recorded on 7+ ranks; the plan's cluster has 4 GPUs
    np.savez(inp / "trace8.npz", **arrays)
    assert_user_error(["evaluate", "--plan", plan_file, "--load", inp / "trace8.npz", "--json"], capsys, tmp_path,
                      "src_gpu holds rank 6", "4 GPUs")


def test_src_gpu_beyond_cluster_at_plan_leaves_no_plan(tmp_path: Path, inp: Path, outdir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # `plan` scores its plan in-sample after writing it; an error there must not leave the file behind.
    arrays = make_trace()
    arrays["src_gpu"][-1] = 6
    np.savez(inp / "trace8.npz", **arrays)
    assert_user_error(["plan", "--load", inp / "trace8.npz", "--policy", "contiguous", *CLUSTER,
                       "--slots-per-gpu", 4, "--out", outdir / "plan.json"], capsys, tmp_path, "src_gpu holds rank 6")


def test_plan_on_all_zero_load(tmp_path: Path, inp: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Either a valid plan (contiguous needs no load) or a user error, but never an error with the file written.
    np.save(inp / "zero.npy", np.zeros((B, L, E), dtype=np.int64))
    dest = outdir / "plan.json"
    rc, _, err = run_cli(["plan", "--load", inp / "zero.npy", "--policy", "contiguous", *CLUSTER,
                          "--slots-per-gpu", 4, "--out", dest], capsys)
    assert "Traceback" not in err
    if rc == 0:
        assert read_plan(dest).num_layers == L
    else:
        assert rc == 2 and len(err.strip().splitlines()) == 1
        assert tree(outdir) == [], f"exit {rc} ({err.strip()}) but the plan file was written"


def test_evaluate_all_zero_load(tmp_path: Path, inp: Path, plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(inp / "zero.npy", np.zeros((B, L, E), dtype=np.int64))
    assert_user_error(["evaluate", "--plan", plan_file, "--load", inp / "zero.npy"], capsys, tmp_path, "zero")


# ----- bad plans -----------------------------------------------------------------------------------------------

def _edit_plan(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    """A contiguous plan document changed in place by ``edit`` (its return value is ignored)."""
    def build(d: Path) -> Path:
        doc = contiguous_doc()
        edit(doc)
        return write_json(d / "bad.json", doc)
    return build


def _other_plan(doc: dict[str, Any]) -> Callable[[Path], Path]:
    """A valid plan document for another model than the load."""
    def build(d: Path) -> Path:
        return write_json(d / "bad.json", doc)
    return build


def _raw_plan(text: str) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        (d / "bad.json").write_text(text)
        return d / "bad.json"
    return build


def _truncated_plan(d: Path) -> Path:
    text = json.dumps(contiguous_doc())
    (d / "bad.json").write_text(text[: len(text) // 2])
    return d / "bad.json"


BAD_PLANS: list[Any] = [
    pytest.param(_edit_plan(lambda d: d["placement"][1][1].remove(5)), ("expert 5 of layer 1 has no replica",),
                 id="missing-expert"),
    pytest.param(_edit_plan(lambda d: d["placement"][2][0].append(E)), ("placement[2][0]", "expert 16"),
                 id="expert-id-too-large"),
    pytest.param(_edit_plan(lambda d: d["placement"][0][3].append(-1)), ("placement[0][3]", "expert -1"),
                 id="expert-id-negative"),
    pytest.param(_edit_plan(lambda d: d["placement"][0][1].append(2.0)), ("placement[0][1]", "2.0"),
                 id="expert-id-float"),
    pytest.param(_edit_plan(lambda d: d["placement"].pop()), ("placement has 2 layers but num_layers is 3",),
                 id="layers-vs-num_layers"),
    pytest.param(_edit_plan(lambda d: d["placement"][0].pop()), ("placement[0] has 3 GPU lists", "4 GPUs"),
                 id="gpu-lists-vs-cluster"),
    pytest.param(_other_plan(contiguous_doc(num_layers=2)), ("the plan has 2 layers", "3 x 16"),
                 id="layers-vs-load"),
    pytest.param(_other_plan(contiguous_doc(num_experts=32)), ("32 experts", "3 x 16"),
                 id="experts-vs-load"),
    pytest.param(_edit_plan(lambda d: d.update(format="eplb.plan")), ("format 'eplb.plan'",), id="format"),
    pytest.param(_edit_plan(lambda d: d.pop("format")), ("format None",), id="no-format"),
    pytest.param(_edit_plan(lambda d: d.update(version=2)), ("version 2",), id="version"),
    pytest.param(_edit_plan(lambda d: d.pop("placement")), ("lacks the key 'placement'",), id="no-placement"),
    pytest.param(_edit_plan(lambda d: d.update(cluster={"num_nodes": 0, "gpus_per_node": 2})), ("num_nodes (0)",),
                 id="cluster-zero-nodes"),
    # a "cluster" with a key the format does not have (here the GPU total) is refused, not ignored
    pytest.param(_edit_plan(lambda d: d["cluster"].update(num_gpus=4)),
                 ("bad.json", "'cluster' has unknown keys ['num_gpus']", "only num_nodes and gpus_per_node"),
                 id="cluster-unknown-key"),
    pytest.param(_edit_plan(lambda d: d.update(num_experts="16")), ("num_experts ('16')",), id="num-experts-string"),
    pytest.param(_raw_plan("placement: [[0, 1]]\n"), ("bad.json", "not valid JSON"), id="not-json"),
    pytest.param(_truncated_plan, ("bad.json", "not valid JSON"), id="truncated-json"),
    pytest.param(_raw_plan("[[[0, 1, 2, 3]]]"), ("JSON object, not list",), id="json-list"),
    pytest.param(lambda d: d / "nowhere.json", ("nowhere.json", "does not exist"), id="missing"),
    pytest.param(_edit_plan(lambda d: d.update(weights=[[[1.0] * 4] * 4] * 2)), ("weights has 2 layers",),
                 id="weights-layers"),
    pytest.param(_edit_plan(lambda d: d.update(weights=5)), ("weights",), id="weights-not-a-list"),
    pytest.param(_edit_plan(lambda d: d.update(weights=[[["a"] * 4] * 4] * 3)), ("weights[0][0]",),
                 id="weights-not-numbers"),
]


@pytest.mark.parametrize(("build", "fragments"), BAD_PLANS)
def test_bad_plan_file(build: Callable[[Path], Path], fragments: tuple[str, ...], tmp_path: Path, inp: Path,
                       trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = build(inp)
    assert_user_error(["evaluate", "--plan", plan, "--load", trace_file, "--json"], capsys, tmp_path, *fragments)


def test_duplicated_expert_on_one_gpu_is_a_warning(tmp_path: Path, inp: Path, trace_file: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # docs/design.md, "Data formats": a second copy of an expert on the same GPU is a warning, not an error (reference EPLB makes them).
    doc = contiguous_doc()
    doc["placement"][1][2].append(doc["placement"][1][2][0])  # GPU 2 hosts expert 8 twice in layer 1
    plan = write_json(inp / "dup.json", doc)
    rc, out, err = run_cli(["evaluate", "--plan", plan, "--load", trace_file, "--json"], capsys)
    assert rc == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning:"), err
    assert "layer 1, GPU 2, expert 8" in lines[0]
    result = json.loads(out)
    assert len(result["warnings"]) == 1
    assert result["extra_replicas"] == 1 and result["max_slots_per_gpu"] == 5


# ----- budgets, policies, parameters ---------------------------------------------------------------------------

@pytest.fixture
def load64(inp: Path) -> Path:
    p = inp / "load64.npy"
    np.save(p, np.random.default_rng(1).integers(0, 100, size=(2, L, 64)))
    return p


@pytest.mark.parametrize("policy", ["contiguous", "greedy", "eplb"])
def test_slots_too_small_for_the_experts(policy: str, tmp_path: Path, load64: Path, outdir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # 64 experts on 8 GPUs need at least 8 slots per GPU.
    assert_user_error(["plan", "--load", load64, "--policy", policy, "--nodes", 2, "--gpus-per-node", 4,
                       "--slots-per-gpu", 7, "--out", outdir / "plan.json"], capsys, tmp_path,
                      "slots_per_gpu (7)", "64 experts on 8 GPUs", "at least 8")


def test_eplb_replica_budget_too_small(tmp_path: Path, inp: Path, outdir: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # 18 experts on 4 GPUs: equal slots need 5 per GPU, 2 extra replicas per layer, 6 in all; R=1 allows 4.
    np.save(inp / "load18.npy", np.ones((2, L, 18), dtype=np.int64))
    assert_user_error(["plan", "--load", inp / "load18.npy", "--policy", "eplb", *CLUSTER, "--replicas-per-gpu", 1,
                       "--out", outdir / "plan.json"], capsys, tmp_path, "replicas_per_gpu 1")


@pytest.mark.parametrize(("budget", "fragment"), [
    (["--slots-per-gpu", "0"], "--slots-per-gpu: 0 must be >= 1"),
    (["--slots-per-gpu", "-3"], "--slots-per-gpu: -3 must be >= 1"),
    (["--replicas-per-gpu", "-1"], "replicas_per_gpu (-1)"),
])
@pytest.mark.parametrize("command", ["plan", "compare"])
def test_bad_budget_value(command: str, budget: list[str], fragment: str, tmp_path: Path, trace_file: Path,
                          outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if command == "plan":
        argv = ["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, *budget, "--out", outdir / "p.json"]
    else:
        argv = ["compare", "--load", trace_file, "--policies", "greedy", *CLUSTER, *budget, "--out-dir", outdir / "c"]
    assert_user_error(argv, capsys, tmp_path, fragment)


@pytest.mark.parametrize(("args", "fragments"), [
    (["--slots-per-gpu", "4", "--replicas-per-gpu", "2"], ("--replicas-per-gpu", "not allowed with")),
    ([], ("--slots-per-gpu", "--replicas-per-gpu", "required")),
    (["--slots-per-gpu", "four"], ("--slots-per-gpu", "'four'")),
    (["--slots-per-gpu", "4", "--nodes", "x"], ("--nodes", "'x'")),
    (["--slots-per-gpu", "4", "--bogus", "1"], ("--bogus",)),
])
def test_argparse_errors_are_one_line(args: list[str], fragments: tuple[str, ...], tmp_path: Path, trace_file: Path,
                                      outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, *args,
                       "--out", outdir / "p.json"], capsys, tmp_path, *fragments)


@pytest.mark.parametrize(("argv", "fragments"), [
    ([], ("required",)),
    (["frobnicate"], ("'frobnicate'",)),
    (["plan"], ("required",)),
    (["evaluate", "--plan", "p.json", "--load", "l.npz", "--router", "psychic"], ("'psychic'",)),
    (["compare", "--load", "l.npz", "--policies", "greedy", *CLUSTER, "--slots-per-gpu", "4", "--train-frac", "half"],
     ("--train-frac", "'half'")),
])
def test_argparse_errors_elsewhere(argv: list[str], fragments: tuple[str, ...], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(argv, capsys, tmp_path, *fragments)


@pytest.mark.parametrize(("argv", "fragment"), [
    # misspelt, and the real option missing: the misspelling is named, not "--gpus-per-node is required"
    (["advise", "--load", "l.npz", "--nodes", "1", "--gpu-per-node", "8", "--gpu", "h100-80gb"],
     "unrecognized option --gpu-per-node; did you mean --gpus-per-node?"),
    (["plan", "--load", "l.npz", "--policy", "greedy", *CLUSTER, "--slots-per-gpu", "4", "--out", "p.json",
      "--seeed=3"], "unrecognized option --seeed; did you mean --seed?"),
    (["stats", "--load", "l.npz", "--jsn"], "unrecognized option --jsn; did you mean --json?"),
    (["stats", "--load", "l.npz", "--zzz"], "unrecognized option --zzz (see: moebalance stats --help)"),
])
def test_an_unknown_option_is_named_with_the_closest_real_one(argv: list[str], fragment: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(argv, capsys, tmp_path, fragment)


def _load_argv(command: str, load: Path, tmp_path: Path) -> list[Any]:
    """``command`` reading ``load`` (``advise`` besides :data:`COMMANDS`)."""
    if command == "advise":
        return ["advise", "--load", load, "--nodes", 1, "--gpus-per-node", 8, "--gpu", "h100-80gb"]
    return load_command(command, load, tmp_path)


@pytest.mark.parametrize("command", [*COMMANDS, "advise"])
@pytest.mark.parametrize("name", ["nowhere.npz", "nowhere"])
def test_a_missing_load_is_named_before_any_format_guess(command: str, name: str, tmp_path: Path, inp: Path,
                                                         outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # advise once read a missing .npz as a moebalance load and asked for --engine
    line = assert_user_error(_load_argv(command, inp / name, tmp_path), capsys, tmp_path, "does not exist")
    assert f"load file '{inp / name}' does not exist" in line and "--engine" not in line


@pytest.mark.parametrize("command", [*COMMANDS, "advise"])
def test_a_load_of_no_known_kind_lists_every_kind(command: str, tmp_path: Path, inp: Path, outdir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    readme = inp / "README.md"
    readme.write_text("# notes\n")
    assert_user_error(_load_argv(command, readme, tmp_path), capsys, tmp_path, "README.md", "moebalance load (.npz",
                      ".npy", "bundled:NAME", "SGLang", ".pt or .json", "TensorRT-LLM statistics folder",
                      "meta_info.json", "vLLM routed experts")


def test_eplb_groups_must_divide_experts(tmp_path: Path, load64: Path, outdir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # One node: 7 groups is hierarchical (1 divides 7), and 64 experts cannot form 7 equal groups.
    assert_user_error(["plan", "--load", load64, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 8,
                       "--slots-per-gpu", 9, "--groups", 7, "--out", outdir / "plan.json"], capsys, tmp_path,
                      "num_groups (7)", "64")


@pytest.mark.parametrize("groups", ["0", "-2"])
def test_eplb_non_positive_groups(groups: str, tmp_path: Path, trace_file: Path, outdir: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["plan", "--load", trace_file, "--policy", "eplb", *CLUSTER, "--slots-per-gpu", 5,
                       "--groups", groups, "--out", outdir / "plan.json"], capsys, tmp_path, f"num_groups ({groups})")


@pytest.mark.parametrize("value", ["abc", "[1]"])
def test_eplb_num_groups_set_to_a_non_integer(value: str, tmp_path: Path, trace_file: Path, outdir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["plan", "--load", trace_file, "--policy", "eplb", *CLUSTER, "--slots-per-gpu", 5,
                       "--set", f"num_groups={value}", "--out", outdir / "plan.json"], capsys, tmp_path,
                      "num_groups", value)


def test_unknown_policy_plan(tmp_path: Path, trace_file: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["plan", "--load", trace_file, "--policy", "magic", *CLUSTER, "--slots-per-gpu", 4,
                       "--out", outdir / "plan.json"], capsys, tmp_path, "unknown policy 'magic'", "contiguous")


@pytest.mark.parametrize(("policies", "fragments"), [
    ("greedy,magic", ("unknown policy 'magic'", "eplb")),
    (" , ", ("--policies is empty",)),
])
def test_bad_policies_compare(policies: str, fragments: tuple[str, ...], tmp_path: Path, trace_file: Path,
                              outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["compare", "--load", trace_file, "--policies", policies, *CLUSTER, "--slots-per-gpu", 4,
                       "--out-dir", outdir / "c"], capsys, tmp_path, *fragments)


@pytest.mark.parametrize(("command", "item", "fragments"), [
    ("plan", "speed=3", ("policy 'greedy' has no parameter 'speed'",)),
    ("plan", "novalue", ("--set 'novalue' must look like key=value",)),
    ("plan", "=3", ("--set '=3' must look like key=value",)),
    ("compare", "speed=3", ("--set speed: no policy among --policies contiguous,greedy has parameter 'speed'",
                            "contiguous: none; greedy: none")),
    ("compare", "greedy.speed=3", ("policy 'greedy' has no parameter 'speed'",)),
    ("compare", "craft.speed=3", ("'craft' is not among --policies contiguous,greedy",)),
    ("compare", "novalue", ("--set 'novalue' must look like key=value",)),
])
def test_bad_set_parameter(command: str, item: str, fragments: tuple[str, ...], tmp_path: Path, trace_file: Path,
                           outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if command == "plan":
        argv = ["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--set", item, "--out", outdir / "plan.json"]
    else:
        argv = ["compare", "--load", trace_file, "--policies", "contiguous,greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--set", item, "--out-dir", outdir / "c"]
    assert_user_error(argv, capsys, tmp_path, *fragments)


@pytest.mark.parametrize(("batches", "fragments"), [
    ("5:2", ("'5:2'", "empty")),
    ("2:2", ("'2:2'", "empty")),
    ("a:b", ("'a:b'", "integers")),
    ("10:20", ("'10:20'", "4 batches")),
    ("1:2:3", ("'1:2:3'", "a:b")),
    ("3", ("'3'", "a:b")),
])
@pytest.mark.parametrize("command", ["plan", "evaluate"])
def test_bad_batch_range(command: str, batches: str, fragments: tuple[str, ...], tmp_path: Path, trace_file: Path,
                         plan_file: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if command == "plan":
        argv = ["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--batches", batches, "--out", outdir / "plan.json"]
    else:
        argv = ["evaluate", "--plan", plan_file, "--load", trace_file, "--batches", batches]
    assert_user_error(argv, capsys, tmp_path, *fragments)


@pytest.mark.parametrize(("frac", "fragment"), [("0", "(0.0)"), ("1.5", "(1.5)"), ("-0.5", "(-0.5)"),
                                                ("nan", "(nan)")])
def test_bad_train_fraction(frac: str, fragment: str, tmp_path: Path, trace_file: Path, outdir: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["compare", "--load", trace_file, "--policies", "contiguous,greedy", *CLUSTER,
                       "--slots-per-gpu", 4, "--train-frac", frac, "--out-dir", outdir / "c"], capsys, tmp_path,
                      "train fraction", fragment)


def test_compare_one_batch_with_default_train_fraction(tmp_path: Path, inp: Path, outdir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    np.save(inp / "one.npy", np.random.default_rng(2).integers(1, 20, size=(L, E)))
    assert_user_error(["compare", "--load", inp / "one.npy", "--policies", "contiguous,greedy", *CLUSTER,
                       "--slots-per-gpu", 4, "--out-dir", outdir / "c"], capsys, tmp_path, "1 batch", "--train-frac 1")


@pytest.mark.parametrize(("cluster", "fragment"), [
    (["--nodes", "0", "--gpus-per-node", "2"], "--nodes: 0 must be >= 1"),
    (["--nodes", "2", "--gpus-per-node", "-1"], "--gpus-per-node: -1 must be >= 1"),
    # absurd sizes are one line, not a MemoryError
    (["--nodes", "100000", "--gpus-per-node", "100000"], "--nodes: 100,000 is more than 65,536"),
    (["--nodes", "512", "--gpus-per-node", "256"], "--nodes x --gpus-per-node = 131,072 is outside 1..65,536"),
])
@pytest.mark.parametrize("command", ["plan", "compare"])
def test_bad_cluster(command: str, cluster: list[str], fragment: str, tmp_path: Path, trace_file: Path, outdir: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
    if command == "plan":
        argv = ["plan", "--load", trace_file, "--policy", "greedy", *cluster, "--slots-per-gpu", 4,
                "--out", outdir / "plan.json"]
    else:
        argv = ["compare", "--load", trace_file, "--policies", "greedy", *cluster, "--slots-per-gpu", 4,
                "--out-dir", outdir / "c"]
    assert_user_error(argv, capsys, tmp_path, fragment)


@pytest.mark.parametrize("command", ["evaluate", "compare"])
def test_negative_seed(command: str, tmp_path: Path, trace_file: Path, plan_file: Path, outdir: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    if command == "evaluate":
        argv = ["evaluate", "--plan", plan_file, "--load", trace_file, "--router", "random", "--seed", "-1"]
    else:
        argv = ["compare", "--load", trace_file, "--policies", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--router", "random", "--seed", "-1", "--out-dir", outdir / "c"]
    assert_user_error(argv, capsys, tmp_path, "seed", "-1")


@pytest.mark.parametrize(("flag", "value"), [("--hidden-size", "-1"), ("--hidden-size", "0"),
                                             ("--dtype-bytes", "0"), ("--dtype-bytes", "-2")])
def test_non_positive_traffic_size(flag: str, value: str, tmp_path: Path, trace_file: Path, plan_file: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    # bytes per copy = hidden size x dtype bytes; a non-positive size is a typo, not a traffic volume.
    argv = ["evaluate", "--plan", plan_file, "--load", trace_file, "--json", "--hidden-size", "64", flag, value]
    line = assert_user_error(argv, capsys, tmp_path, value)
    assert flag.split("-")[2] in line, line  # "hidden" or "dtype"


# ----- outputs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["plan.txt", "plan", "plan.json.tmp", "plan.npz"])
def test_plan_out_wrong_extension(name: str, tmp_path: Path, trace_file: Path, outdir: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                       "--out", outdir / name], capsys, tmp_path, name, "must end in .json")


def test_plan_out_is_a_directory(tmp_path: Path, trace_file: Path, outdir: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    (outdir / "plan.json").mkdir()
    assert_user_error(["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                       "--out", outdir / "plan.json"], capsys, tmp_path, "plan.json", "is a folder")


def test_plan_out_under_a_file(tmp_path: Path, trace_file: Path, outdir: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (outdir / "blocker").write_text("not a folder")
    assert_user_error(["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                       "--out", outdir / "blocker" / "plan.json"], capsys, tmp_path, "blocker")


def test_compare_out_dir_is_a_file(tmp_path: Path, trace_file: Path, outdir: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    (outdir / "results").write_text("not a folder")
    assert_user_error(["compare", "--load", trace_file, "--policies", "contiguous,greedy", *CLUSTER,
                       "--slots-per-gpu", 4, "--out-dir", outdir / "results"], capsys, tmp_path, "results")


@pytest.mark.parametrize("command", ["plan", "compare", "synth"])
def test_outputs_have_ordinary_permissions(command: str, trace_file: Path, outdir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # The atomic writers go through mkstemp (mode 0600); the final files should get the usual 0666 & ~umask,
    # like any file the user writes, or teammates and serving containers cannot read them.
    umask = os.umask(0)
    os.umask(umask)
    if command == "plan":
        argv = ["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--out", outdir / "plan.json"]
    elif command == "compare":
        argv = ["compare", "--load", trace_file, "--policies", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                "--out-dir", outdir]
    else:
        argv = ["synth", "--preset", "olmoe-1b-7b", "--batches", 2, "--tokens-per-batch", 8, "--gpus", 2,
                "--out", outdir / "t.npz"]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 0, err
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in outdir.iterdir()}
    assert modes and set(modes.values()) == {oct(0o666 & ~umask)}, f"files written with modes {modes}"


# ----- synth ---------------------------------------------------------------------------------------------------

SYNTH = ["synth", "--preset", "olmoe-1b-7b", "--batches", "4", "--tokens-per-batch", "64", "--gpus", "4"]


def test_synth_unknown_preset(tmp_path: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["synth", "--preset", "gpt-9", "--batches", 2, "--tokens-per-batch", 8, "--gpus", 2,
                       "--out", outdir / "t.npz"], capsys, tmp_path, "gpt-9", "deepseek-v3", "olmoe-1b-7b")


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize(("flag", "word"), [("--batches", "batches"), ("--tokens-per-batch", "tokens"),
                                            ("--gpus", "gpus")])
def test_synth_non_positive_sizes(flag: str, word: str, value: str, tmp_path: Path, outdir: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--batches": "2", "--tokens-per-batch": "8", "--gpus": "2", flag: value}
    argv = ["synth", "--preset", "olmoe-1b-7b", *[x for kv in args.items() for x in kv], "--out", outdir / "t.npz"]
    line = assert_user_error(argv, capsys, tmp_path, value)
    assert word in line.lower(), line


def test_synth_negative_seed(tmp_path: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error([*SYNTH, "--seed", "-1", "--out", outdir / "t.npz"], capsys, tmp_path, "seed", "-1")


def test_synth_out_wrong_extension(tmp_path: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error([*SYNTH, "--out", outdir / "t.npy"], capsys, tmp_path, "t.npy", "must end in .npz")


def test_synth_then_stats_plan_evaluate(tmp_path: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = outdir / "olmoe.npz"
    rc, out, err = run_cli([*SYNTH, "--token-level", "--out", trace], capsys)
    assert rc == 0, err
    assert "olmoe" in out.lower()
    assert [p for p in tree(outdir) if p != "olmoe.npz"] == [], "temporary files left behind"
    with np.load(trace, allow_pickle=False) as data:
        counts, topk, src, batch = (data[k] for k in ("counts", "topk_ids", "src_gpu", "batch"))
    assert counts.ndim == 3 and counts.shape[0] == 4
    assert topk.shape[0] == src.shape[0] == batch.shape[0] == 4 * 64
    assert topk.shape[1] == counts.shape[1]
    assert counts.sum() == topk.size  # every (token, layer, pick) counted once
    assert src.min() >= 0 and src.max() < 4
    assert np.all(np.diff(batch) >= 0)
    num_experts = counts.shape[2]

    rc, out, err = run_cli(["stats", "--load", trace, "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["shape"] == list(counts.shape)

    plan = outdir / "plan.json"
    slots = -(-num_experts // 4) + 1
    rc, out, err = run_cli(["plan", "--load", trace, "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 4,
                            "--slots-per-gpu", slots, "--out", plan], capsys)
    assert rc == 0, err
    assert read_plan(plan).num_experts == num_experts
    rc, out, err = run_cli(["evaluate", "--plan", plan, "--load", trace, "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    assert 0 < result["balancedness"] <= 1
    assert set(result["traffic"]) >= {"local", "intra_node", "inter_node"}
    assert result["traffic"]["inter_node"] == 0  # one node
    assert "bytes" in result["traffic"]  # the preset knows its hidden size


# ----- happy paths ---------------------------------------------------------------------------------------------

def test_stats(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["stats", "--load", trace_file], capsys)
    assert rc == 0, err
    assert "token-level" in out
    rc, out, err = run_cli(["stats", "--load", trace_file, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["shape"] == [B, L, E]
    assert len(doc["peak_to_mean"]) == L


@pytest.mark.parametrize("budget", [["--slots-per-gpu", "5"], ["--replicas-per-gpu", "3"]])
@pytest.mark.parametrize("policy", ["contiguous", "greedy", "eplb"])
def test_plan_policies_and_budgets(policy: str, budget: list[str], trace_file: Path, outdir: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    dest = outdir / "plan.json"
    rc, out, err = run_cli(["plan", "--load", trace_file, "--policy", policy, *CLUSTER, *budget, "--out", dest],
                           capsys)
    assert rc == 0, err
    # Reference EPLB may put two copies of an expert on one GPU: a warning line, nothing else (docs/design.md, "Data formats").
    assert all(line.startswith("warning:") for line in err.splitlines()), err
    assert "wrote" in out and "balancedness" in out
    assert tree(outdir) == ["plan.json"], "temporary files left behind"
    plan = read_plan(dest)
    assert (plan.num_layers, plan.num_experts, plan.num_gpus, plan.policy) == (L, E, G, policy)
    assert np.all(plan.replica_counts() >= 1)
    if budget[0] == "--slots-per-gpu":
        assert plan.max_slots_per_gpu <= 5
    else:
        assert plan.extra_replicas <= 3 * G
    if policy == "eplb":
        assert plan.extra_replicas == L * (5 * G - E)  # both budgets give 5 equal slots per GPU here
    else:
        assert plan.extra_replicas == 0
    assert plan.params["planned_on_batches"] == f"0:{B}"
    doc = json.loads(dest.read_text())
    assert doc["format"] == "moebalance.plan" and doc["version"] == 1


def test_plan_on_batch_range(trace_file: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = outdir / "plan.json"
    rc, _, err = run_cli(["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                          "--batches", "1:3", "--out", dest], capsys)
    assert rc == 0, err
    assert read_plan(dest).params["planned_on_batches"] == "1:3"


def test_plan_overwrites_existing_file(trace_file: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = outdir / "plan.json"
    dest.write_text("old")
    rc, _, err = run_cli(["plan", "--load", trace_file, "--policy", "contiguous", *CLUSTER, "--slots-per-gpu", 4,
                          "--out", dest], capsys)
    assert rc == 0, err
    assert read_plan(dest).policy == "contiguous"
    assert tree(outdir) == ["plan.json"]


def _expected_contiguous(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Balancedness, gap and traffic of the contiguous plan (GPU g hosts experts 4g..4g+3), by brute force."""
    counts = arrays["counts"].astype(np.float64)
    gpu_load = counts.reshape(B, L, G, E // G).sum(axis=3)
    mean, peak = gpu_load.mean(axis=2), gpu_load.max(axis=2)
    bound = np.maximum(counts.sum(axis=2) / G, counts.max(axis=2))
    local = intra = inter = 0
    for t in range(arrays["topk_ids"].shape[0]):
        src = int(arrays["src_gpu"][t])
        for layer in range(L):
            for dest in {int(e) // (E // G) for e in arrays["topk_ids"][t, layer]}:
                if dest == src:
                    local += 1
                elif dest // GPN == src // GPN:
                    intra += 1
                else:
                    inter += 1
    return {"balancedness": float(np.mean(mean / peak)), "per_layer": (mean / peak).mean(axis=0),
            "imbalance_ratio": float(np.mean(peak / mean)), "gap": float(np.mean(peak / bound - 1)),
            "traffic": (local, intra, inter)}


def test_evaluate_json_contiguous_by_hand(inp: Path, plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = make_trace()
    np.savez(inp / "t.npz", **arrays)
    rc, out, err = run_cli(["evaluate", "--plan", plan_file, "--load", inp / "t.npz", "--json"], capsys)
    assert rc == 0, err
    assert err == ""
    r = json.loads(out)
    want = _expected_contiguous(arrays)
    assert r["balancedness"] == pytest.approx(want["balancedness"], abs=1e-6)
    assert r["imbalance_ratio"] == pytest.approx(want["imbalance_ratio"], abs=1e-6)
    assert r["lower_bound_gap"] == pytest.approx(want["gap"], abs=1e-6)
    assert r["per_layer_balancedness"] == pytest.approx(list(want["per_layer"]), abs=1e-6)
    assert r["extra_replicas"] == 0 and r["max_slots_per_gpu"] == E // G
    t = r["traffic"]
    assert (t["local"], t["intra_node"], t["inter_node"]) == want["traffic"]
    T = B * TOKENS
    assert T * L <= t["local"] + t["intra_node"] + t["inter_node"] <= T * L * K
    assert r["num_batches"] == B and r["batches"] == f"0:{B}" and r["warnings"] == []


@pytest.mark.parametrize("policy", ["contiguous", "greedy", "eplb"])
@pytest.mark.parametrize("router", ["uniform", "random"])
def test_evaluate_json_ranges(policy: str, router: str, trace_file: Path, outdir: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    plan = outdir / "plan.json"
    rc, _, err = run_cli(["plan", "--load", trace_file, "--policy", policy, *CLUSTER, "--slots-per-gpu", 5,
                          "--out", plan], capsys)
    assert rc == 0, err
    rc, out, err = run_cli(["evaluate", "--plan", plan, "--load", trace_file, "--router", router, "--json",
                            "--batches", "2:"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    for key in ("balancedness", "imbalance_ratio", "per_layer_balancedness", "extra_replicas",
                "max_slots_per_gpu", "lower_bound_gap", "traffic"):
        assert key in r, key
    assert 0 < r["balancedness"] <= 1
    assert r["imbalance_ratio"] >= 1
    assert len(r["per_layer_balancedness"]) == L
    assert all(0 < v <= 1 for v in r["per_layer_balancedness"])
    assert r["lower_bound_gap"] >= -1e-9
    # every layer has load in every batch: the means over (batch, layer) are the means of the per-layer values, and
    # per layer the mean of max/mean is at least 1 / the mean of mean/max (arithmetic against harmonic mean)
    per_bal, per_imb = np.array(r["per_layer_balancedness"]), np.array(r["per_layer_imbalance_ratio"])
    assert r["balancedness"] == pytest.approx(per_bal.mean(), abs=2e-6)
    assert r["imbalance_ratio"] == pytest.approx(per_imb.mean(), abs=2e-6)
    assert np.all(per_imb >= 1 / per_bal - 1e-5)
    # 16 experts on 4 GPUs: 4 slots each without replicas; eplb fills its 5 slots, 4 extra per layer
    assert r["extra_replicas"] == {"contiguous": 0, "greedy": 0, "eplb": L * (5 * G - E)}[policy]
    assert r["max_slots_per_gpu"] == {"contiguous": 4, "greedy": 4, "eplb": 5}[policy]
    if policy != "eplb":  # one copy of each expert: any router sends an expert's picks to its one GPU
        copies = read_plan(plan).copies  # [L, E, G]
        with np.load(trace_file) as f:
            loads = np.einsum("ble,leg->blg", f["counts"][2:4], copies).astype(float)  # [2, L, G]
        assert per_bal == pytest.approx((loads.mean(axis=2) / loads.max(axis=2)).mean(axis=0), abs=1e-6)
        assert per_imb == pytest.approx((loads.max(axis=2) / loads.mean(axis=2)).mean(axis=0), abs=1e-6)
    assert r["router"] == router and r["num_batches"] == 2 and r["batches"] == "2:4"
    t = r["traffic"]
    T = 2 * TOKENS
    assert all(isinstance(t[k], int) and t[k] >= 0 for k in ("local", "intra_node", "inter_node"))
    assert T * L <= t["local"] + t["intra_node"] + t["inter_node"] <= T * L * K


def test_random_router_equals_uniform_without_replicas(trace_file: Path, plan_file: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    results = {}
    for router in ("uniform", "random"):
        rc, out, err = run_cli(["evaluate", "--plan", plan_file, "--load", trace_file, "--router", router, "--json"],
                               capsys)
        assert rc == 0, err
        results[router] = json.loads(out)
    for key in ("balancedness", "imbalance_ratio", "lower_bound_gap", "traffic"):
        assert results["uniform"][key] == results["random"][key], key


def test_evaluate_bytes_with_hidden_size(trace_file: Path, plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["evaluate", "--plan", plan_file, "--load", trace_file, "--json", "--hidden-size", "64"],
                           capsys)
    assert rc == 0, err
    t = json.loads(out)["traffic"]
    assert t["bytes"]["inter_node"] == 2 * t["inter_node"] * 64 * 2


def test_evaluate_table(trace_file: Path, plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["evaluate", "--plan", plan_file, "--load", trace_file], capsys)
    assert rc == 0, err
    assert "balancedness" in out and "inter-node" in out


def test_counts_only_npz_has_no_traffic(inp: Path, plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(inp / "counts.npz", counts=make_trace()["counts"])
    rc, out, err = run_cli(["evaluate", "--plan", plan_file, "--load", inp / "counts.npz", "--json"], capsys)
    assert rc == 0, err
    assert "traffic" not in json.loads(out)


def test_token_level_npz_without_counts(inp: Path, plan_file: Path, trace_file: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    arrays = make_trace()
    del arrays["counts"]
    np.savez(inp / "nocounts.npz", **arrays)
    outs = []
    for load in (inp / "nocounts.npz", trace_file):
        rc, out, err = run_cli(["evaluate", "--plan", plan_file, "--load", load, "--json"], capsys)
        assert rc == 0, err
        outs.append(json.loads(out))
    assert outs[0]["balancedness"] == outs[1]["balancedness"]
    assert outs[0]["traffic"] == outs[1]["traffic"]


def test_npy_2d_is_one_batch(inp: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = np.random.default_rng(5).integers(0, 40, size=(L, E))
    np.save(inp / "le.npy", counts)
    np.save(inp / "ble.npy", counts[None])
    plans = []
    for name in ("le", "ble"):
        dest = outdir / f"{name}.json"
        rc, _, err = run_cli(["plan", "--load", inp / f"{name}.npy", "--policy", "greedy", *CLUSTER,
                              "--slots-per-gpu", 4, "--out", dest], capsys)
        assert rc == 0, err
        plans.append(read_plan(dest).gpu_experts)
        assert read_plan(dest).params["planned_on_batches"] == "0:1"
    assert plans[0] == plans[1]
    rc, out, err = run_cli(["evaluate", "--plan", outdir / "le.json", "--load", inp / "le.npy", "--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    assert r["num_batches"] == 1 and len(r["per_layer_balancedness"]) == L


def test_float_npy_with_whole_numbers_is_accepted(inp: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(inp / "f.npy", np.random.default_rng(6).integers(0, 40, size=(B, L, E)).astype(np.float32))
    rc, _, err = run_cli(["plan", "--load", inp / "f.npy", "--policy", "greedy", *CLUSTER, "--slots-per-gpu", 4,
                          "--out", outdir / "p.json"], capsys)
    assert rc == 0, err


def test_compare_json_and_out_dir(trace_file: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = outdir / "cmp"
    policies = ["contiguous", "greedy", "eplb"]
    rc, out, err = run_cli(["compare", "--load", trace_file, "--policies", ",".join(policies), *CLUSTER,
                            "--slots-per-gpu", 5, "--json", "--out-dir", dest], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert [r["policy"] for r in doc["rows"]] == policies
    for row in doc["rows"]:
        assert 0 < row["balancedness"] <= 1
        assert len(row["per_layer_balancedness"]) == L
        assert set(row["traffic"]) >= {"local", "intra_node", "inter_node"}
    assert "planned on 2 batches" in doc["title"] and "scored on 2 held-out" in doc["title"]
    expected = {"comparison.md", "comparison.json", "per_layer_balancedness.png", "report.html", ".moebalance-out",
                *(f"plan-{p}.json" for p in policies)}
    assert set(tree(dest)) == expected, "missing outputs or leftover temporary files"
    assert json.loads((dest / "comparison.json").read_text()) == doc
    md = (dest / "comparison.md").read_text()
    assert md.startswith("# ") and all(p in md for p in policies)
    assert (dest / "per_layer_balancedness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for p in policies:
        plan = read_plan(dest / f"plan-{p}.json")
        assert plan.policy == p and plan.num_layers == L


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_compare_out_dir_is_replaced_as_a_whole(trace_file: Path, outdir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A second run into the same out-dir leaves only its own files: the plan of a policy no longer compared and a
    stale file are gone, not mixed with the new ones."""
    dest = outdir / "cmp"
    argv = ["compare", "--load", trace_file, *CLUSTER, "--slots-per-gpu", 5, "--out-dir", dest]
    rc, _, err = run_cli([*argv, "--policies", "contiguous,eplb"], capsys)
    assert rc == 0, err
    (dest / "stale.txt").write_text("from an earlier run")
    rc, out, err = run_cli([*argv, "--policies", "greedy"], capsys)
    assert rc == 0, err
    assert tree(dest) == [".moebalance-out", "comparison.json", "comparison.md", "per_layer_balancedness.png",
                          "plan-greedy.json", "report.html"]
    assert [r["policy"] for r in json.loads((dest / "comparison.json").read_text())["rows"]] == ["greedy"]
    assert tree(outdir) == ["cmp", *(f"cmp/{name}" for name in tree(dest))]  # no temporary folder beside it
    assert [line for line in out.splitlines() if line.startswith("wrote")] == [
        f"wrote {dest}: comparison.md, comparison.json, per_layer_balancedness.png, plan-*.json and report.html"]


@pytest.mark.filterwarnings("ignore:Tight layout not applied")  # the plot's legend holds the long row label
def test_compare_failing_mid_write_leaves_the_old_out_dir(tmp_path: Path, inp: Path, trace_file: Path, outdir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run that fails after writing part of its files (here the plan of a --baseline whose name is too long for
    the file system, after the comparison's own files) leaves the old out-dir exactly as it was, and no
    temporary folder."""
    dest = outdir / "cmp"
    argv = ["compare", "--load", trace_file, "--policies", "greedy", *CLUSTER, "--slots-per-gpu", 4, "--out-dir", dest]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 0, err
    before = _contents(dest)
    baseline = write_json(inp / ("b" * 240 + ".json"), contiguous_doc())  # plan-baseline-bbb...json: 259 characters
    assert_user_error([*argv, "--baseline", baseline], capsys, tmp_path, "File name too long")
    assert _contents(dest) == before and tree(outdir) == ["cmp", *(f"cmp/{name}" for name in tree(dest))]


def test_compare_refuses_an_out_dir_of_other_files_before_any_work(tmp_path: Path, trace_file: Path, outdir: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """moebalance replaces its out-dir as a whole, so a folder of the user's own files, or the current folder, is
    refused in one line, and stays as it was."""
    (outdir / "notes.txt").write_text("the user's")
    argv = ["compare", "--load", trace_file, "--policies", "greedy", *CLUSTER, "--slots-per-gpu", 4]
    assert_user_error([*argv, "--out-dir", outdir], capsys, tmp_path, str(outdir), "'notes.txt'",
                      "give a new or empty folder")
    monkeypatch.chdir(outdir)
    assert_user_error([*argv, "--out-dir", "."], capsys, tmp_path, "'.' is the current folder")
    assert (outdir / "notes.txt").read_text() == "the user's"


def test_compare_table_with_groups_and_set(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["compare", "--load", trace_file, "--policies", "greedy,eplb", *CLUSTER,
                            "--replicas-per-gpu", 3, "--groups", 2, "--set", "eplb.num_groups=4",
                            "--train-frac", "0.75", "--router", "random"], capsys)
    assert rc == 0, err
    assert "eplb" in out and "greedy" in out and "random router" in out


def test_compare_in_sample_on_one_batch(inp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(inp / "one.npy", np.random.default_rng(2).integers(1, 20, size=(L, E)))
    rc, out, err = run_cli(["compare", "--load", inp / "one.npy", "--policies", "contiguous,greedy", *CLUSTER,
                            "--slots-per-gpu", 4, "--train-frac", "1", "--json"], capsys)
    assert rc == 0, err
    assert len(json.loads(out)["rows"]) == 2


def test_console_script(tmp_path: Path, inp: Path, outdir: Path, trace_file: Path) -> None:
    script = Path(sys.executable).parent / "moebalance"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "moebalance"]
    ok = subprocess.run([*cmd, "plan", "--load", str(trace_file), "--policy", "greedy", *CLUSTER,
                         "--slots-per-gpu", "4", "--out", str(outdir / "plan.json")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert read_plan(outdir / "plan.json").policy == "greedy"
    bad = subprocess.run([*cmd, "evaluate", "--plan", str(outdir / "plan.json"), "--load", str(inp / "nope.npz")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moebalance: error:") and "nope.npz" in lines[0], bad.stderr


def test_stats_on_a_trace_without_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.npz"
    np.savez(path, counts=np.zeros((1, 2, 4), dtype=np.int64), topk_ids=np.zeros((0, 2, 2), dtype=np.int64),
             src_gpu=np.zeros(0, dtype=np.int64), batch=np.zeros(0, dtype=np.int64))
    code, out, err = run_cli(["stats", "--load", path], capsys)
    assert code == 0 and "no tokens" in out and err == ""


def test_replicas_per_gpu_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    load = tmp_path / "c.npy"
    np.save(load, rng.integers(0, 100, size=(6, 4, 16)))
    out_plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--load", load, "--policy", "craft", "--nodes", 2, "--gpus-per-node", 2,
                            "--replicas-per-gpu", "auto", "--out", out_plan], capsys)
    assert code == 0, err
    plan = read_plan(out_plan)
    assert plan.params["replicas_per_gpu"] == "auto" and plan.params["chosen_replicas_per_gpu"] >= 1
    assert plan.extra_replicas <= plan.params["chosen_replicas_per_gpu"] * 4
    assert_user_error(["plan", "--load", load, "--policy", "eplb", "--nodes", 2, "--gpus-per-node", 2,
                       "--replicas-per-gpu", "auto", "--out", tmp_path / "q.json"], capsys, tmp_path,
                      "cannot choose replicas_per_gpu itself")
    assert_user_error(["plan", "--load", load, "--policy", "craft", "--nodes", 2, "--gpus-per-node", 2,
                       "--replicas-per-gpu", "lots", "--out", tmp_path / "q.json"], capsys, tmp_path,
                      "neither an integer nor 'auto'")


def test_sweep_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    load = tmp_path / "c.npy"
    p = rng.dirichlet(np.full(16, 0.2), size=4)
    np.save(load, np.stack([np.stack([rng.multinomial(2000, pl) for pl in p]) for _ in range(6)]))
    out_dir = tmp_path / "sw"
    code, out, err = run_cli(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--policies",
                              "eplb,craft,uniform", "--replicas-per-gpu", "0,1,2", "--out-dir", out_dir, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    points = {(q["policy"], q["replicas_per_gpu"]): q for q in doc["points"]}
    assert ("eplb", 4) in points  # EPLB's minimum uniform replication, R = L, is always included
    assert points[("eplb", 4)]["extra_replicas"] == 4 * 4
    assert points[("craft", 2)]["extra_replicas"] == 2 * 4 and points[("craft", 0)]["gain"] == pytest.approx(0)
    assert all(0 < q["balancedness"] <= 1 for q in doc["points"])
    for name in ("sweep.md", "sweep.json", "sweep.png"):
        assert (out_dir / name).stat().st_size > 0
    assert_user_error(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--replicas-per-gpu", "1,x"],
                      capsys, tmp_path, "must be integers")
    assert_user_error(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--policies", "craft,magic"],
                      capsys, tmp_path, "sweep policy 'magic' is unknown")
    assert_user_error(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--replicas-per-gpu", "-1"],
                      capsys, tmp_path, "must be a non-empty list of integers >= 0")
    assert_user_error(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--policies", " , "],
                      capsys, tmp_path, "no sweep policies given")
    assert_user_error(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--replicas-per-gpu",
                       "0,99999999999999"], capsys, tmp_path, "exceeds", "every GPU already holds every expert")


def test_sweep_skips_points_a_policy_cannot_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 6 experts on 4 GPUs: EPLB's equal slots need 8 slots per layer, i.e. 2 extra replicas per layer, so it
    # refuses R = 0 and R = 1; the sweep goes on and says so
    rng = np.random.default_rng(2)
    load = tmp_path / "c.npy"
    np.save(load, rng.integers(0, 50, size=(6, 3, 6)))
    code, out, err = run_cli(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--policies",
                              "eplb,craft", "--replicas-per-gpu", "0,1,2", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert {(q["policy"], q["replicas_per_gpu"]) for q in doc["points"]} == {
        ("eplb", 2), ("eplb", 3), ("craft", 0), ("craft", 1), ("craft", 2)}
    assert [s.split(":")[0] for s in doc["skipped"]] == ["eplb at R = 0", "eplb at R = 1"]
    code, out, err = run_cli(["sweep", "--load", load, "--nodes", 2, "--gpus-per-node", 2, "--policies",
                              "eplb", "--replicas-per-gpu", "0,2"], capsys)
    assert code == 0 and "skipped eplb at R = 0" in out


def test_link_options_set_the_all_to_all_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one 2 x 1 cluster, every token crosses nodes: halving the inter-node link doubles the time
    plan = tmp_path / "p.json"
    code, _, err = run_cli(["plan", "--load", "bundled:mixtral-8x7b-tokens", "--policy", "contiguous", "--nodes", 2,
                            "--gpus-per-node", 4, "--slots-per-gpu", 1, "--out", plan], capsys)
    assert code == 0, err
    times = []
    for link in ("50", "25", "ib-ndr400"):
        code, out, err = run_cli(["evaluate", "--plan", plan, "--load", "bundled:mixtral-8x7b-tokens", "--json",
                                  "--batches", "0:4", "--inter-link", link, "--intra-link", "1e9"], capsys)
        assert code == 0, err
        times.append(json.loads(out)["traffic"]["a2a_us_per_layer"])
    assert times[1] == pytest.approx(2 * times[0], rel=1e-3) and times[2] == pytest.approx(times[0], rel=1e-3)
    assert_user_error(["evaluate", "--plan", plan, "--load", "bundled:mixtral-8x7b-tokens", "--inter-link", "fast"],
                      capsys, tmp_path, "--inter-link", "neither a number of GB/s nor a link preset")
    assert_user_error(["evaluate", "--plan", plan, "--load", "bundled:mixtral-8x7b-tokens", "--intra-link", "-3"],
                      capsys, tmp_path, "must be a positive number of GB/s")


def test_json_stays_json_with_the_milp_solver() -> None:
    # HiGHS prints a banner on the process's stdout when its first solver is made; --json must not carry it.
    # A fresh process, so that this is the first solver it makes.
    cmd = [sys.executable, "-m", "moebalance", "compare", "--load", "bundled:mixtral-8x7b-tokens", "--policies",
           "contiguous,moetuner", "--nodes", "2", "--gpus-per-node", "4", "--slots-per-gpu", "1", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert [r["policy"] for r in json.loads(done.stdout)["rows"]] == ["contiguous", "moetuner"]


# ----- routers with options, several routers in one comparison -----------------------------------------------

@pytest.fixture
def eplb_plan(trace_file: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """An EPLB plan with replicas (6 slots per GPU for 16 experts on 4 GPUs), so routers have choices."""
    plan = outdir / "eplb.json"
    rc, _, err = run_cli(["plan", "--load", trace_file, "--policy", "eplb", *CLUSTER, "--slots-per-gpu", 6,
                          "--set", "num_groups=1", "--out", plan], capsys)
    assert rc == 0, err
    return plan


def test_evaluate_routing_gap_and_router_options(trace_file: Path, eplb_plan: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    results = {}
    for argv in (["--router", "uniform"], ["--router", "random"], ["--router", "minmax"],
                 ["--router", "rebalance"], ["--router", "rebalance", "--router-set", "eps=0.5",
                                              "--router-set", "strict=true"]):
        rc, out, err = run_cli(["evaluate", "--plan", eplb_plan, "--load", trace_file, "--json", *argv], capsys)
        assert rc == 0, err
        results[" ".join(argv[1:])] = json.loads(out)
    assert results["minmax"]["routing_gap"] == 0  # the bound itself
    assert all(r["routing_gap"] >= 0 for r in results.values())
    assert results["uniform"]["routing_gap"] > 0 < results["random"]["routing_gap"]  # replicas leave room
    assert results["rebalance"]["router_params"] == {"eps": 0.0, "strict": False}
    loose = results["rebalance --router-set eps=0.5 --router-set strict=true"]
    assert loose["router"] == "rebalance" and loose["router_params"] == {"eps": 0.5, "strict": True}
    assert "router_params" not in results["uniform"]
    # on tokens minmax's mean straggler is the least: every router that assigns whole picks exceeds it by exactly
    # its gap (uniform's loads are fractions, measured against the fractional bound instead)
    best = results["minmax"]["mean_max_load"]
    for name, r in results.items():
        if name != "uniform":
            assert r["mean_max_load"] == pytest.approx(best * (1 + r["routing_gap"]), rel=1e-4)


def test_compare_several_routers_plans_once(trace_file: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["compare", "--load", trace_file, "--policies", "contiguous,eplb", *CLUSTER,
                            "--slots-per-gpu", 6, "--groups", 1, "--router", "uniform,rebalance,minmax",
                            "--router-set", "eps=0.01", "--json", "--out-dir", outdir / "c"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    labels = [r["policy"] for r in doc["rows"]]
    assert labels == [f"{p} + {r}" for p in ("contiguous", "eplb")
                      for r in ("uniform", "rebalance(eps=0.01)", "minmax")]
    rows = {r["policy"]: r for r in doc["rows"]}
    # one plan per policy: the same planning time and replicas on each of its rows; without replicas routers agree
    for p in ("contiguous", "eplb"):
        assert len({(rows[f"{p} + {r}"]["plan_seconds"], rows[f"{p} + {r}"]["extra_replicas"])
                    for r in ("uniform", "rebalance(eps=0.01)", "minmax")}) == 1
    assert rows["contiguous + uniform"]["balancedness"] == rows["contiguous + minmax"]["balancedness"]
    assert rows["eplb + minmax"]["balancedness"] >= rows["eplb + uniform"]["balancedness"]
    assert "per row" in doc["title"]
    assert sorted(p.name for p in (outdir / "c").glob("plan-*.json")) == ["plan-contiguous.json", "plan-eplb.json"]


@pytest.mark.parametrize(("args", "fragments"), [
    (["--router", "psychic"], ("unknown router 'psychic'", "minmax", "rebalance")),
    (["--router", ","], ("--router is empty",)),
    (["--router", "uniform,minmax"], ("names 2 routers", "compare takes several")),
    (["--router", "rebalance", "--router-set", "eps=2"], ("eps (2)", "[0, 1)")),
    (["--router", "rebalance", "--router-set", "eps=fast"], ("eps ('fast')",)),
    (["--router", "rebalance", "--router-set", "strict=maybe"], ("strict ('maybe')", "true or false")),
    (["--router", "rebalance", "--router-set", "eps"], ("--router-set 'eps' must look like key=value",)),
    (["--router", "rebalance", "--router-set", "tolerance=0.1"], ("no router given (rebalance) has option "
                                                                    "'tolerance'", "rebalance (eps, strict)")),
    (["--router", "uniform", "--router-set", "eps=0.1"], ("no router given (uniform) has option 'eps'",)),
])
def test_router_option_errors_are_one_line(args: list[str], fragments: tuple[str, ...], trace_file: Path,
                                           plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["evaluate", "--plan", plan_file, "--load", trace_file, *args], capsys, tmp_path, *fragments)


def test_compare_refuses_a_bad_router_option_before_writing(trace_file: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["compare", "--load", trace_file, "--policies", "eplb", *CLUSTER, "--slots-per-gpu", 6,
                       "--router", "uniform,rebalance", "--router-set", "eps=-1", "--out-dir", tmp_path / "c"],
                      capsys, tmp_path, "eps (-1)")


# ----- budgets, models and options a command would ignore --------------------------------------------------------

def test_compare_and_plan_show_a_budget_the_policy_converted(trace_file: Path, outdir: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # 16 experts on 4 GPUs in 3 layers: 5 slots per GPU are R = 3 * (5 - 16 / 4) = 3 extra replicas per GPU for craft
    argv = ["compare", "--load", trace_file, "--policies", "greedy,craft", *CLUSTER, "--slots-per-gpu", 5,
            "--out-dir", outdir / "c"]
    rc, out, err = run_cli([*argv, "--json"], capsys)
    assert rc == 0, err
    rows = {r["policy"]: r for r in json.loads(out)["rows"]}
    assert "budget_note" not in rows["greedy"]
    note = rows["craft"]["budget_note"]
    assert note.startswith("slots_per_gpu 5 read as replicas_per_gpu 3 = L * (S - E / G) for craft")
    md = (outdir / "c" / "comparison.md").read_text()
    assert "| craft (budget note 1) |" in md and f"- budget note 1 (craft): {note}" in md and "| greedy |" in md
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0, err
    assert "craft (budget note 1)" in out and "budget note 1 (craft): slots_per_gpu 5 read as replicas_per_gpu 3" in out
    rc, out, err = run_cli(["plan", "--load", trace_file, "--policy", "craft", *CLUSTER, "--slots-per-gpu", 5, "--out",
                            outdir / "p.json"], capsys)
    assert rc == 0, err
    assert f"budget note: {note}" in out


def test_compare_notes_a_replica_budget_eplb_cannot_spend(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # R = 2 gives 8 extra replicas; EPLB's equal slots need 3 * 4 = 12 for one more slot per GPU, so it uses none
    rc, out, err = run_cli(["compare", "--load", trace_file, "--policies", "eplb,craft", *CLUSTER,
                            "--replicas-per-gpu", 2, "--json"], capsys)
    assert rc == 0, err
    rows = {r["policy"]: r for r in json.loads(out)["rows"]}
    assert rows["eplb"]["extra_replicas"] == 0 and rows["craft"]["extra_replicas"] == 8
    assert "replicas_per_gpu 2" in rows["eplb"]["budget_note"]


def test_plan_model_gives_eplb_the_models_groups(inp: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a DeepSeek-V3-shaped load that names no model (an engine's dump): 58 MoE layers x 256 experts
    np.save(inp / "ds.npy", np.random.default_rng(0).integers(1, 50, size=(2, 58, 256)))
    base = ["plan", "--load", inp / "ds.npy", "--policy", "eplb", "--nodes", 8, "--gpus-per-node", 8,
            "--slots-per-gpu", 5, "--out", outdir / "p.json"]
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    assert (read_plan(outdir / "p.json").params["mode"], read_plan(outdir / "p.json").params["num_groups"]) == \
        ("global", 1)
    assert "eplb ran global: 1 expert group(s), the load names no model with expert groups: give --model" in out
    rc, out, err = run_cli([*base, "--model", "deepseek-v3"], capsys)
    assert rc == 0, err
    plan = read_plan(outdir / "p.json")
    assert (plan.params["mode"], plan.params["num_groups"]) == ("hierarchical", 8)
    assert "eplb ran hierarchical: 8 expert group(s), DeepSeek-V3's (--model); 8 node(s) divide them" in out
    rc, out, err = run_cli([*base, "--model", "deepseek-v3", "--groups", 1], capsys)
    assert rc == 0 and "eplb ran global: 1 expert group(s), as given" in out
    assert_user_error([*base, "--model", "kimi-k2"], capsys, inp, "the load (--model kimi-k2) does not fit model "
                      "'kimi-k2'", "256 experts per layer, but Kimi-K2 has 384", "give the load's --model")


def test_plan_says_one_group_plainly_and_names_the_option_against_duplicates(
        inp: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 4 experts, one hot, on 2 GPUs of 4 slots: EPLB gives the hot expert the 4 extra slots, so its 5 copies put at
    # least 3 on one GPU (no swap can part them); one group on one node: hierarchical is global
    np.save(inp / "hot.npy", np.array([[1000, 1, 1, 1]]))
    base = ["plan", "--load", inp / "hot.npy", "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 2,
            "--slots-per-gpu", 4, "--out", outdir / "p.json"]
    same = "on one node, so its hierarchical and global plans are the same"
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    assert f"eplb: one expert group (the load names no model with expert groups: give --model or --groups) {same}" \
        in out and "1 expert group(s)" not in out
    assert "host two copies of one expert" in err and "; --set avoid_duplicates=true swaps them onto other GPUs" in err
    rc, out, err = run_cli([*base, "--groups", 1, "--set", "avoid_duplicates=true"], capsys)
    assert rc == 0 and f"eplb: one expert group (as given) {same}" in out
    assert "; avoid_duplicates found no GPU to swap them to" in err and "--set avoid_duplicates" not in err
    # a model without expert groups says so
    np.save(inp / "olmoe.npy", np.ones((16, 64), dtype=np.int64))
    rc, out, err = run_cli(["plan", "--load", inp / "olmoe.npy", "--model", "olmoe-1b-7b", "--policy", "eplb",
                            "--nodes", 1, "--gpus-per-node", 4, "--slots-per-gpu", 16, "--out", outdir / "o.json"],
                           capsys)
    assert rc == 0 and f"eplb: one expert group (OLMoE-1B-7B has no expert groups) {same}" in out, err


def test_plan_model_on_a_load_that_names_one(tmp_path: Path, outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --model confirming the model the load (or an engine file's shape) names is accepted; another model's is not
    base = ["plan", "--load", "bundled:olmoe-1b-7b-tokens", "--policy", "greedy", "--nodes", 2, "--gpus-per-node", 4,
            "--slots-per-gpu", 8]
    rc, _, err = run_cli([*base, "--model", "olmoe-1b-7b", "--out", outdir / "p.json"], capsys)
    assert rc == 0, err
    assert read_plan(outdir / "p.json").params["model"] == "olmoe-1b-7b"
    assert_user_error([*base, "--model", "deepseek-v3", "--out", outdir / "q.json"], capsys, tmp_path, "--model deepseek-v3")


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--memory-fraction", "2"], "--memory-fraction: 2 must be in (0, 1]"),
    (["--memory-fraction", "0.5"], "--memory-fraction is used by plan only with --auto-by goodput"),
    (["--gpu", "h100-80gb"], "--gpu is used by plan only with --auto-by goodput"),
    (["--intra-link", "nvlink4"], "--intra-link is used by plan only with --auto-by goodput"),
    (["--slots-per-gpu", "1000000000"], "--slots-per-gpu: 1,000,000,000 is more than 65,536"),
])
def test_plan_refuses_options_it_would_ignore(extra: list[str], fragment: str, tmp_path: Path, trace_file: Path,
                                              outdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    budget = [] if "--slots-per-gpu" in extra else ["--slots-per-gpu", "4"]
    assert_user_error(["plan", "--load", trace_file, "--policy", "greedy", *CLUSTER, *budget, *extra, "--out",
                       outdir / "p.json"], capsys, tmp_path, fragment)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["cost", "--model", "kimi-k2", "--gpu", "a100-80gb", "--nodes", "100000", "--gpus-per-node", "100000"],
     "--nodes: 100,000 is more than 65,536"),
    (["cost", "--model", "kimi-k2", "--gpu", "a100-80gb", "--nodes", "1000", "--gpus-per-node", "1000"],
     "--nodes x --gpus-per-node = 1,000,000 is outside 1..65,536"),
    (["import", "--load", "x.json", "--out", "y.npz", "--gpus", "-2"], "--gpus: -2 must be >= 1"),
    (["synth", "--preset", "olmoe-1b-7b", "--batches", "2", "--tokens-per-batch", "8", "--gpus", "1000000000",
      "--out", "t.npz"], "--gpus: 1,000,000,000 is more than 65,536"),
])
def test_sizes_are_bounded_in_one_line(argv: list[str], fragment: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(argv, capsys, tmp_path, fragment)


def test_groups_is_a_first_set_item_in_compare(trace_file: Path, outdir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["compare", "--load", trace_file, "--policies", "greedy,eplb", *CLUSTER, "--slots-per-gpu", 5,
                          "--groups", 2, "--set", "num_groups=1", "--out-dir", outdir / "c"], capsys)
    assert rc == 0, err
    assert read_plan(outdir / "c" / "plan-eplb.json").params["num_groups"] == 1  # the later item wins
    rc, _, err = run_cli(["compare", "--load", trace_file, "--policies", "greedy,eplb", *CLUSTER, "--slots-per-gpu", 5,
                          "--groups", 1, "--out-dir", outdir / "d"], capsys)
    assert rc == 0, err
    assert read_plan(outdir / "d" / "plan-eplb.json").params["num_groups"] == 1
    assert_user_error(["compare", "--load", trace_file, "--policies", "greedy,contiguous", *CLUSTER,
                       "--slots-per-gpu", 5, "--groups", 2], capsys, tmp_path,
                      "--groups: no policy among --policies greedy,contiguous has parameter 'num_groups'")


def test_sweep_names_craft_uniform_and_takes_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    load = tmp_path / "c.npy"
    np.save(load, rng.integers(1, 200, size=(4, 3, 16)))
    argv = ["sweep", "--load", load, *CLUSTER, "--replicas-per-gpu", "0,2", "--json"]
    rc, out, err = run_cli([*argv, "--policies", "uniform,eplb", "--set", "eplb.num_groups=2"], capsys)
    assert rc == 0, err
    points = {(q["policy"], q["replicas_per_gpu"]): q for q in json.loads(out)["points"]}
    assert set(points) == {("craft-uniform", 0), ("craft-uniform", 2), ("eplb", 0), ("eplb", 2), ("eplb", 3)}
    assert points[("craft-uniform", 2)]["extra_replicas"] == 2 * G  # the same replicas in every layer, all spent
    rc, out, err = run_cli([*argv, "--policies", "craft", "--set", "replica_counts=[1, 2]"], capsys)
    assert rc == 0, err
    rc, text, err = run_cli([*argv[:-1], "--policies", "craft-uniform,greedy"], capsys)
    assert rc == 0 and "craft-uniform" in text
    assert_user_error([*argv, "--policies", "craft", "--groups", 2], capsys, tmp_path,
                      "--groups: policy 'craft' has no parameter 'num_groups'")
    assert_user_error([*argv, "--policies", "craft-uniform", "--set", "allocation=benefit"], capsys, tmp_path,
                      "policy 'craft-uniform' has no parameter 'allocation'")


def test_sigterm_stops_a_command_like_ctrl_c(tmp_path: Path) -> None:
    """A scheduler's SIGTERM ends a command cleanly: exit 130 as for Ctrl-C, no traceback, no file left behind."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "big.npz"
    argv = ["synth", "--preset", "deepseek-v3", "--batches", "100000", "--tokens-per-batch", "4096", "--gpus", "8",
            "--out", str(out)]
    # "ready" once the imports are done (they take seconds on a loaded machine); main then installs its handler
    # within microseconds and the generator runs for minutes
    script = f"import sys; from moebalance.app.cli import main; print('ready', flush=True); sys.exit(main({argv!r}))"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_export_mtp_layer_and_model_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``export --mtp-layers 1``: TensorRT-LLM's YAML gets key 61 (DeepSeek-V3 registers its MTP layer as decoder
    layer num_hidden_layers + 0), in the engine's default order as the plan has no MTP row; ``--num-hidden-layers``
    numbers an unlisted model's layers; ``--mtp-layers`` is refused for engines that never read an MTP row."""
    import yaml

    rng = np.random.default_rng(5)
    np.save(tmp_path / "moe.npy", rng.integers(1, 50, size=(2, 58, 256)))
    plan = tmp_path / "plan.json"
    rc, _, err = run_cli(["plan", "--load", tmp_path / "moe.npy", "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 8,
                          "--slots-per-gpu", 33, "--model", "deepseek-v3", "--out", plan], capsys)
    assert rc == 0, err
    assert json.loads(plan.read_text())["params"]["model"] == "deepseek-v3"
    rc, out, err = run_cli(["export", "--plan", plan, "--to", "trtllm", "--mtp-layers", 1, "--out", tmp_path / "lb.yaml",
                            "--json"], capsys)
    assert rc == 0, err
    doc = yaml.safe_load((tmp_path / "lb.yaml").read_text())["initial_global_assignments"]
    assert sorted(doc) == [*range(3, 61), 61]
    assert doc[61] == [p % 256 for p in range(8 * 33)]  # slot p holds expert p mod E
    assert json.loads(out)["moe_layers"][-1] == 61
    assert_user_error(["export", "--plan", plan, "--to", "sglang", "--mtp-layers", 1, "--out", tmp_path / "x.json"],
                      capsys, tmp_path, "--mtp-layers is for --to trtllm")
    # a model moebalance does not list: 4 MoE rows of an 8-expert model, numbered after 2 dense layers by hand
    np.save(tmp_path / "small.npy", rng.integers(1, 50, size=(2, 4, 8)))
    small = tmp_path / "small.json"
    assert run_cli(["plan", "--load", tmp_path / "small.npy", "--policy", "eplb", "--nodes", 1, "--gpus-per-node", 2,
                    "--slots-per-gpu", 4, "--out", small], capsys)[0] == 0
    rc, _, err = run_cli(["export", "--plan", small, "--to", "sglang", "--num-hidden-layers", 4, "--out",
                          tmp_path / "s.json"], capsys)
    assert rc == 0, err
    assert np.asarray(json.loads((tmp_path / "s.json").read_text())["physical_to_logical_map"]).shape == (4, 8)


def test_model_reaches_the_engine_reader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM routed experts that never pick expert 255: ``--model deepseek-v3`` gives the model's 256 experts (and
    its 8 expert groups) on ``plan`` and on ``import``, which stores the model (before: refused as 255 experts)."""
    rng = np.random.default_rng(13)
    routed = np.zeros((1, 61, 8), dtype=np.uint16)
    for layer in range(3, 61):
        routed[0, layer] = rng.choice(255, size=8, replace=False)
    np.save(tmp_path / "req.npy", routed)
    rc, _, err = run_cli(["plan", "--load", tmp_path / "req.npy", "--format", "vllm", "--model", "deepseek-v3",
                            "--policy", "eplb", "--nodes", 8, "--gpus-per-node", 8, "--slots-per-gpu", 4, "--out",
                            tmp_path / "p.json"], capsys)
    assert rc == 0, err
    plan = read_plan(tmp_path / "p.json")
    assert plan.num_experts == 256 and plan.params["model"] == "deepseek-v3" and plan.params["num_groups"] == 8
    rc, _, err = run_cli(["import", "--load", tmp_path / "req.npy", "--format", "vllm", "--model", "deepseek-v3",
                          "--out", tmp_path / "t.npz"], capsys)
    assert rc == 0, err
    from moebalance.core.load import read_load

    load = read_load(tmp_path / "t.npz")
    assert load.num_experts == 256 and load.preset == "deepseek-v3"


# ----- start-up and progress on screen -----------------------------------------------------------------------------

def _imported_by(argv: list[str], **env: str) -> tuple[set[str], str]:
    """``(modules imported, stdout)`` once ``moebalance argv`` has run in a fresh interpreter."""
    script = ("import sys\nfrom moebalance.app.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
              "    pass\nsys.stderr.write('\\n'.join(sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    return set(proc.stderr.splitlines()), proc.stdout


def test_top_level_help_imports_no_command_nor_torch() -> None:
    """``moebalance --help`` lists the commands from their summaries: no command module, no torch, numba or scipy
    (most of its time went to importing them)."""
    modules, out = _imported_by(["--help"])
    assert "usage: moebalance" in out and "synth" in out and "watch" in out
    heavy = {"torch", "numba", "scipy", "matplotlib"} & modules
    assert not heavy, heavy
    assert not [m for m in modules if m.startswith("moebalance.app.commands.")]


def test_a_command_imports_only_its_own_module() -> None:
    modules, out = _imported_by(["synth", "--help"])
    assert "usage: moebalance synth" in out and "--tokens-per-batch" in out
    assert [m for m in modules if m.startswith("moebalance.app.commands.")] == ["moebalance.app.commands.synth"]


@pytest.mark.parametrize("command", ["plan", "compare", "online", "advise"])
def test_a_commands_help_imports_no_torch_nor_scipy(command: str) -> None:
    """A command's ``--help`` builds its parser only: torch (EPLB's reference sort, the engines' dumps) and scipy's
    solvers (the aligned re-plan's assignment) are imported where they run, not to list options (numba's own import
    check loads scipy's small top package)."""
    modules, out = _imported_by([command, "--help"])
    assert f"usage: moebalance {command}" in out
    heavy = {"torch", "scipy.optimize", "scipy.linalg"} & modules
    assert not heavy, heavy


def test_the_lazy_parser_shows_what_the_full_one_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The top-level help and a wrong command's error are the same from the summaries as from every module's
    parser: each summary is the help its module's ``add_parser`` passes."""
    import argparse

    from moebalance.app.cli import build_parser

    full, lazy = build_parser(), build_parser("")
    assert lazy.format_help() == full.format_help()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    assert {a.dest: a.help for a in sub._choices_actions} == {
        "synth": "generate a synthetic routing trace for a real model", "plan": "compute a placement plan",
        "evaluate": "score a plan by replaying a load through it",
        "compare": "plan with several policies and score them on held-out batches",
        "sweep": "balancedness against extra replicas per GPU (CRAFT Figures 1 and 8)",
        "stats": "per-layer skew of a load or trace", "demo": "compare every policy on bundled DeepSeek-V3-like data",
        "import": "convert an engine's routing dump into a moebalance load (.npz), once",
        "export": "write a plan in the form an engine loads (SGLang, TensorRT-LLM, vLLM)",
        "cost": "memory per GPU, KV cache, concurrency; with a plan, modelled layer time and goodput",
        "calibrate": "fit the cost model's compute constants to measured grouped-GEMM times, or measure them here "
                     "(--measure)",
        "predict": "how much of each token's routing a predictor foresees (Libra's accuracy)",
        "online": "replay a trace batch by batch as a server would: static, periodic and dynamic (libra) planning",
        "advise": "what to run on vLLM, SGLang or TensorRT-LLM: every expert-parallel configuration the engine can "
                  "run, priced in tokens per second",
        "watch": "follow an engine's routing records: balance metrics, and re-plans when the move pays",
        "capture": "run the bundled MoE LM on text and write its token-level routing trace",
        "run": "run the MoE LM expert-parallel on local gloo ranks (or under torchrun) under a plan, and check it"}
    wrong = "invalid choice: 'synt' (choose from 'synth', 'plan', 'evaluate', 'compare', 'sweep', 'stats', 'demo', " \
            "'import', 'export', 'cost', 'calibrate', 'predict', 'online', 'advise', 'watch', 'capture', 'run')"
    assert_user_error(["synt"], capsys, tmp_path, wrong)


def test_long_steps_show_progress_on_a_terminal_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """synth, compare and online draw their bars on stderr when it is a terminal (forced here: rich reads
    TTY_COMPATIBLE on each check, and decides once, when the console is made, that a terminal is interactive);
    stdout, --json's included, is what it is without them; off a terminal stderr stays empty."""
    from moebalance.app import console

    trace = tmp_path / "t.npz"
    synth = ["synth", "--preset", "olmoe-1b-7b", "--batches", 6, "--tokens-per-batch", 32, "--gpus", 2, "--token-level",
             "--out", trace]
    cluster = ["--nodes", 1, "--gpus-per-node", 2, "--replicas-per-gpu", 2]
    compare = ["compare", "--load", trace, "--policies", "contiguous,eplb", *cluster, "--json"]
    online = ["online", "--load", trace, "--policy", "eplb", *cluster, "--warmup", "0:2", "--json"]
    plain = []
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    for argv in (synth, compare, online):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 0 and err == "", err
        plain.append(out)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setattr(console.err, "is_interactive", True)
    shown = []
    for argv, steps in ((synth, ("synth olmoe-1b-7b", "write t.npz")), (compare, ("read t.npz", "plan + score")),
                        (online, ("read t.npz", "online eplb"))):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 0, err
        for name in steps:
            assert name in err, (name, err[-400:])
        shown.append(out)
    assert shown[0] == plain[0]
    for before, after in zip(plain[1:], shown[1:], strict=True):  # the same rows; planning times differ run to run
        a, b = json.loads(before), json.loads(after)
        assert _without(a) == _without(b)


def test_libra_build_and_report_files_show_on_a_terminal_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """online's libra draws its path table's build layer by layer (the batches' bar sat at 0 meanwhile), and
    online and compare with --out-dir draw each file they write (``writing report.html``) on a terminal's stderr;
    --json's stdout is what it is without the bars, and off a terminal stderr stays empty."""
    import re

    from moebalance.app import console

    trace = tmp_path / "t.npz"
    rc, _, err = run_cli(["synth", "--preset", "olmoe-1b-7b", "--batches", 6, "--tokens-per-batch", 32, "--gpus", 2,
                          "--token-level", "--out", trace], capsys)
    assert rc == 0, err
    cluster = ["--nodes", 1, "--gpus-per-node", 2, "--replicas-per-gpu", 2]

    def commands(folder: str) -> list[list[Any]]:
        return [["online", "--load", trace, "--policy", "eplb,libra", "--set", "libra.predictor=path", *cluster,
                 "--warmup", "0:2", "--out-dir", tmp_path / f"online-{folder}", "--json"],
                ["compare", "--load", trace, "--policies", "contiguous,eplb", *cluster,
                 "--out-dir", tmp_path / f"compare-{folder}", "--json"]]

    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    plain = []
    for argv in commands("plain"):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 0 and err == "", err
        plain.append(json.loads(out))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setattr(console.err, "is_interactive", True)
    files = (["online.json", "online.md", "online.png", "report.html"],
             ["comparison.md", "comparison.json", "per_layer_balancedness.png", "plan-contiguous.json",
              "plan-eplb.json", "report.html"])
    for argv, before, written in zip(commands("shown"), plain, files, strict=True):
        rc, out, err = run_cli(argv, capsys)
        assert rc == 0, err
        for name in written:
            assert f"writing {name}" in err, (name, err[-400:])
            assert (Path(argv[argv.index("--out-dir") + 1]) / name).is_file()
        assert _without(json.loads(out)) == _without(before)
        if argv[0] == "online":  # OLMoE's 16 layers: tables for layers 1..15, each drawn as it is built
            for k in range(16):
                assert re.search(rf"online libra: build the path predictor[^\n]*\s{k}/15\b", err), (k, err[-400:])
    rc, out, err = run_cli(["predict", "--load", trace, "--predictor", "path", "--build", trace, "--json"], capsys)
    assert rc == 0 and json.loads(out), err
    for k in range(16):  # predict builds the same table before its first batch
        assert re.search(rf"predict \(path\): build the predictor[^\n]*\s{k}/15\b", err), (k, err[-400:])


def _without(doc: Any) -> Any:
    """``doc`` without the times the run measured (keys ending in ``_seconds``), at any depth."""
    if isinstance(doc, dict):
        return {k: _without(v) for k, v in doc.items() if not k.endswith("_seconds")}
    if isinstance(doc, list):
        return [_without(v) for v in doc]
    return doc


def test_a_first_run_says_it_compiles_the_kernels(tmp_path: Path) -> None:
    """With numba's cache empty (NUMBA_CACHE_DIR), the first compile of a kernel of moebalance says so once on a
    terminal's stderr; the next process loads the kernel from the cache and says nothing."""
    from moebalance.app.console import COMPILING

    script = ("import numpy as np\nfrom moebalance.app.console import announce_compiles\nfrom moebalance.core import "
              "tally\nannounce_compiles()\nfor n in (3, 4):\n    tally.check_picks(np.zeros((4, 1, 1), dtype=np.int16), n)\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "TTY_COMPATIBLE": "1"}
    said = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                           check=True).stderr for _ in range(2)]
    assert said[0].count(COMPILING) == 1, said[0]
    assert COMPILING not in said[1], said[1]
