"""The README tour on bundled data, end to end through the CLI, against outputs stored before a refactor.

``tests/data/tour.json`` holds what each step printed or wrote (plans, scores, statistics, the demo table) when
it was recorded; timings are dropped. A change that moves code around must leave every plan identical and every
score equal (floats to 1e-9 relative: the JSON rounds to 6 decimals anyway). To record the file again after an
intended change of behaviour: ``MOEBALANCE_RECORD_TOUR=1 pytest tests/test_tour.py`` (then review the diff).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moebalance.app.cli import main

GOLDEN = Path(__file__).parent / "data" / "tour.json"
RECORD = os.environ.get("MOEBALANCE_RECORD_TOUR") == "1"

#: Keys whose values are wall-clock times: never compared.
TIMING_KEYS = ("seconds", "plan_time", "_ms", "ilp1_time", "ilp2_time")


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not any(t in k for t in TIMING_KEYS)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _close(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: length"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0, argv
    return capsys.readouterr().out


def _plan(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert doc["format"] == "moebalance.plan" and doc["version"] == 1  # the plan file's contract
    return _strip({k: doc[k] for k in ("policy", "params", "cluster", "placement", "weights") if k in doc})


def _tour(tmp: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    olmoe = tmp / "olmoe.npz"
    _run(["synth", "--preset", "olmoe-1b-7b", "--batches", "64", "--tokens-per-batch", "512", "--gpus", "8",
          "--seed", "0", "--token-level", "--out", str(olmoe)], capsys)
    with np.load(olmoe, allow_pickle=False) as f:  # the values, whatever width the file stores integers in
        out["synth"] = {k: hashlib.sha256(np.ascontiguousarray(
            f[k], dtype=np.int64 if f[k].dtype.kind in "iu" else None).tobytes()).hexdigest() for k in sorted(f.files)}
    out["stats"] = _strip(json.loads(_run(["stats", "--load", str(olmoe), "--json"], capsys)))
    cluster = ["--nodes", "2", "--gpus-per-node", "4"]
    _run(["plan", "--load", str(olmoe), "--policy", "eplb", *cluster, "--slots-per-gpu", "10", "--batches", ":32",
          "--out", str(tmp / "eplb.json")], capsys)
    out["plan_eplb"] = _plan(tmp / "eplb.json")
    out["evaluate"] = _strip(json.loads(_run(["evaluate", "--plan", str(tmp / "eplb.json"), "--load", str(olmoe),
                                              "--batches", "32:", "--json"], capsys)))
    out["compare_olmoe"] = _strip(json.loads(_run(
        ["compare", "--load", str(olmoe), "--policies", "contiguous,greedy,eplb", *cluster, "--slots-per-gpu", "10",
         "--json"], capsys)))
    out["compare_grace"] = _strip(json.loads(_run(
        ["compare", "--load", "bundled:qwen3-30b-a3b-tokens", "--policies", "contiguous,grace", *cluster,
         "--slots-per-gpu", "20", "--router", "locality", "--json"], capsys)))
    _run(["plan", "--load", "bundled:mixtral-8x7b-tokens", "--policy", "moetuner", *cluster, "--slots-per-gpu", "1",
          "--out", str(tmp / "mt.json")], capsys)
    out["plan_moetuner"] = _plan(tmp / "mt.json")
    _run(["plan", "--load", "bundled:deepseek-v3-8x8", "--policy", "craft", "--nodes", "8", "--gpus-per-node", "8",
          "--replicas-per-gpu", "8", "--batches", ":100", "--out", str(tmp / "craft.json")], capsys)
    out["plan_craft"] = _plan(tmp / "craft.json")
    _run(["demo", "--out-dir", str(tmp / "demo")], capsys)
    out["demo"] = _strip(json.loads((tmp / "demo" / "comparison.json").read_text()))
    return out


def test_readme_tour_is_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = json.loads(json.dumps(_tour(tmp_path, capsys)))  # the same types as a stored file
    if RECORD:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=None, separators=(",", ":")) + "\n")
        pytest.skip(f"recorded {GOLDEN}")  # only ever on request, never in CI
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    for step in want:
        _close(got[step], want[step], step)
