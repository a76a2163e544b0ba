"""``moebalance calibrate --measure`` (docs/design.md, "Cost model"): the grouped-GEMM sweep (run here on the CPU
with tiny shapes: the CLI refuses without a GPU), the all-to-all sweep between real gloo ranks (local processes
standing for 2 nodes of 2, and a real torchrun launch), the fit of links by hand, and a measured profile's links and
latency taking the place of the presets."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_user_error

from moebalance.app import options
from moebalance.core.errors import InputError
from moebalance.cost.calibrate import read_calibration, write_calibration
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import GPUS
from moebalance.cost.time import Calibration
from moebalance.models import get_model
from moebalance.runtime import TIMEOUT_ENV, TORCHRUN_VARS, free_port, launch
from moebalance.runtime.measure import fit_links, gemm_rows, link_rows


def test_gemm_sweep_rows_on_the_cpu() -> None:
    rows = gemm_rows(torch.device("cpu"), torch.float32, [(32, 16)], (1, 3), (1, 5), runs=1)
    assert [(r["experts"], r["tokens_per_expert"]) for r in rows] == [(1, 1), (1, 5), (3, 1), (3, 5)]
    assert all(r["hidden_size"] == 32 and r["ffn_size"] == 16 and r["seconds"] > 0 for r in rows)
    with pytest.raises(InputError, match="runs"):
        gemm_rows(torch.device("cpu"), torch.float32, [(32, 16)], (1,), (1,), runs=0)


def test_fit_links_by_hand() -> None:
    """10 us plus 1 GB/s: the fit recovers both; a time that does not grow with the bytes is one line."""
    rows = [{"link": "intra_node", "bytes_sent": b, "seconds": 10e-6 + b / 1e9} for b in (1e3, 1e5, 1e6)]
    fit = fit_links(rows)["intra_node"]
    assert fit.gbs == pytest.approx(1.0) and fit.latency_us == pytest.approx(10.0) and fit.error < 1e-9
    flat = [{"link": "inter_node", "bytes_sent": b, "seconds": 1e-3} for b in (1e3, 1e4)]
    with pytest.raises(InputError, match="does not grow with its bytes"):
        fit_links(flat)


def _links(rank: int, world_size: int) -> list[dict]:
    return link_rows(rank, world_size, 2, torch.device("cpu"), sizes=(4096, 65536), runs=2)


def test_link_sweep_between_gloo_ranks_of_two_nodes() -> None:
    """4 ranks, 2 a node: each rank has one peer on its node and two on the other; every rank reports the same rows
    (the slowest rank's time), both classes, and the fit gives positive bandwidths."""
    per_rank = launch(_links, 4, timeout=120.0)
    assert all(r == per_rank[0] for r in per_rank)
    rows = per_rank[0]
    assert {(r["link"], r["peers"]) for r in rows} == {("intra_node", 1), ("inter_node", 2)}
    assert all(r["bytes_sent"] == r["peers"] * r["bytes_per_peer"] and r["seconds"] > 0 for r in rows)
    with pytest.raises(InputError, match="at least 2 ranks"):
        link_rows(0, 1, 1, torch.device("cpu"))


def test_a_profiles_links_and_latency_replace_the_presets(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    write_calibration(profile, Calibration(source="measured", intra_node_gbs=12.5, a2a_latency_us=40.0), None)
    assert read_calibration(str(profile)) == (Calibration(source="measured", intra_node_gbs=12.5,
                                                          a2a_latency_us=40.0), None)
    args = argparse.Namespace(nodes=2, gpus_per_node=4, calibration=str(profile), intra_link=None, inter_link=None,
                              gpu="h100-80gb")
    cluster = options.cluster(args)
    assert cluster.intra_node_bandwidth == 12.5 and cluster.inter_node_bandwidth == 50.0  # inter not measured
    args.intra_link = 99.0  # a flag wins
    assert options.cluster(args).intra_node_bandwidth == 99.0
    v3, h100 = get_model("deepseek-v3"), GPUS["h100-80gb"]
    measured = Deployment(model=v3, gpu=h100, a2a="per-gpu", calibration=read_calibration(str(profile))[0])
    assert measured.a2a_fixed_seconds() == pytest.approx(80e-6)  # dispatch and combine
    assert Deployment(model=v3, gpu=h100).a2a_fixed_seconds() == 0.0
    with pytest.raises(InputError, match="a2a_latency_us"):
        Calibration(a2a_latency_us=-1.0)


def test_measure_without_a_gpu_or_torchrun_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the sweep would run")
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    assert_user_error(["calibrate", "--measure", "--out", tmp_path / "p.json"], capsys,
                      "calibrate --measure found no CUDA GPU here")
    assert not (tmp_path / "p.json").exists()


def test_measure_under_torchrun_writes_a_links_profile(tmp_path: Path) -> None:
    """A real torchrun launch of 2 gloo ranks on this CPU: rank 0 writes a profile with the intra-node link and its
    latency measured and the grouped GEMM left at the peaks (no GPU), which every command reads."""
    exe = Path(sys.executable).with_name("torchrun")
    runner = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             TIMEOUT_ENV)}
    out = tmp_path / "profile.json"
    res = subprocess.run([*runner, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                          str(free_port()), "-m", "moebalance", "calibrate", "--measure", "--max-message-kib", "4096",
                          "--runs", "3", "--out", str(out)], capture_output=True, text=True, timeout=180, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["intra_node_gbs"] > 0 and doc["inter_node_gbs"] == 0 and doc["a2a_latency_us"] >= 0
    assert "mean_abs_log_error" not in doc  # nothing of the GEMM was fitted
    cal, error = read_calibration(str(out))
    assert error is None and cal.flops_efficiency == 1.0 and cal.source == "published peaks; links measured"
    assert "intra-node:" in res.stdout and np.isfinite(cal.intra_node_gbs)
