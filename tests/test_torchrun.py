"""``moebalance run`` under a real torchrun launch (docs/design.md, "Runtime"): 4 processes on loopback join the
group torchrun sets up (``env://``, gloo on this CPU machine), each runs its rank, rank 0 gathers the results,
runs the dense reference and prints the report. Nothing is mocked; one launch of a few seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moebalance.app.cli import main
from moebalance.core.cluster import Cluster
from moebalance.core.plan import Placement, write_plan
from moebalance.runtime import TORCHRUN_VARS, torchrun_env

NPROC, E, LAYERS = 4, 16, 4  # the bundled model: 4 MoE layers x 16 experts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _plan(path: Path) -> None:
    """2 nodes x 2 GPUs, 4 experts a GPU plus one copy of a neighbour's expert (no duplicates)."""
    layers = [[[*range(4 * g, 4 * g + 4), (4 * g + 4 + layer) % E] for g in range(NPROC)] for layer in range(LAYERS)]
    write_plan(path, Placement(layers, E, Cluster(num_nodes=2, gpus_per_node=2)))


def test_run_under_torchrun_equals_dense(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    _plan(plan)
    env = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    cmd = [*_torchrun(), "--nproc-per-node", str(NPROC), "--master-addr", "127.0.0.1", "--master-port",
           str(_free_port()), "-m", "moebalance", "run", "--plan", str(plan), "--domain", "code", "--tokens", "512",
           "--batch-tokens", "256", "--router", "rebalance", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)  # rank 0 alone prints the report
    assert doc["world_size"] == NPROC and len(doc["ranks"]) == NPROC
    assert doc["logits_agree"] and doc["max_abs_logit_diff"] <= 1e-3
    assert doc["counts_match_simulator"] and doc["routing_mismatches"] == 0
    assert sum(r["tokens"] for r in doc["ranks"]) == doc["num_tokens"] == 512
    assert [r["picks_computed"] for r in doc["ranks"]] == [r["picks_predicted"] for r in doc["ranks"]]
    assert sum(r["inter_node_bytes"] for r in doc["ranks"]) > 0  # 2 nodes: tokens crossed between them


def test_run_needs_a_world_size_outside_torchrun(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torchrun_env():
        pytest.skip("this test process itself runs under torchrun")
    plan = tmp_path / "plan.json"
    _plan(plan)
    rc = main(["run", "--plan", str(plan), "--domain", "code", "--tokens", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("moebalance: error: --world-size is required unless torchrun starts the ranks")
