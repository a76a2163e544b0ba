"""``moebalance run`` under a real torchrun launch (docs/design.md, "Runtime"): 4 processes on loopback join the
group torchrun sets up (``env://``, gloo on this CPU machine), each runs its rank, rank 0 gathers the results,
runs the dense reference and prints the report. Nothing is mocked; one launch of a few seconds.

Failures between ranks, with real torchrun agents (two "nodes" on loopback) and real processes:

- node 1 given a missing or wrong-shaped plan: both nodes exit within the timeout with the same one line
  (without agreement node 0 waited in ``init_process_group`` for 30 minutes);
- a rank that never arrives is named after the timeout (``MOEBALANCE_DIST_TIMEOUT``);
- a rank killed mid-run: the survivor prints one line naming it, not gloo's "Connection reset by peer"
  traceback; under the local launcher the caller names it too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moebalance.app.cli import main
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement, write_plan
from moebalance.runtime import (
    TIMEOUT_ENV,
    TORCHRUN_VARS,
    GroupError,
    all_gather_v,
    free_port,
    launch,
    torchrun_env,
)

NPROC, E, LAYERS = 4, 16, 4  # the bundled model: 4 MoE layers x 16 experts


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def test_free_port_is_a_port_a_server_binds_next() -> None:
    """``free_port`` binds port 0 and returns the port the OS chose (closed again): a server can listen on it."""
    import socket

    port = free_port()
    assert isinstance(port, int) and 0 < port < 2**16
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass


def _plan(path: Path, gpus: int = NPROC, experts: int = E) -> None:
    """``gpus`` GPUs on 2 nodes, ``experts / gpus`` experts a GPU plus one copy of a neighbour's expert."""
    per = experts // gpus
    layers = [[[*range(per * g, per * g + per), (per * g + per + layer) % experts] for g in range(gpus)]
              for layer in range(LAYERS)]
    write_plan(path, Placement(layers, experts, Cluster(num_nodes=2, gpus_per_node=gpus // 2)))


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (*TORCHRUN_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE", TIMEOUT_ENV)}
    return {**env, **extra}


def _two_nodes(tmp_path: Path, argvs: list[list[str]], env: dict[str, str], limit: float = 120.0
               ) -> tuple[list[int], list[str], float]:
    """Two torchrun agents (``--nnodes 2``, one process each) on loopback, agent ``i`` running ``argvs[i]``:
    ``(exit codes, stderr texts, seconds until both ended)``; both are killed after ``limit`` seconds."""
    port = str(free_port())
    procs, errs = [], []
    t0 = time.monotonic()
    for node, argv in enumerate(argvs):
        err = open(tmp_path / f"node{node}.err", "w+")
        errs.append(err)
        procs.append(subprocess.Popen(
            [*_torchrun(), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
             "127.0.0.1", "--master-port", port, *argv],
            stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp_path, start_new_session=True))
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, limit - (time.monotonic() - t0))))
    except subprocess.TimeoutExpired:
        pass
    finally:
        seconds = time.monotonic() - t0
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    texts = []
    for err in errs:
        err.seek(0)
        texts.append(err.read())
        err.close()
    assert len(codes) == 2, f"the agents still ran after {limit:.0f} s:\n" + "\n".join(t[-2000:] for t in texts)
    return codes, texts, seconds


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("moebalance: error:")]


def test_run_under_torchrun_equals_dense(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    _plan(plan)
    env = _clean_env()
    cmd = [*_torchrun(), "--nproc-per-node", str(NPROC), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), "-m", "moebalance", "run", "--plan", str(plan), "--domain", "code", "--tokens", "512",
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


def test_run_needs_a_world_size_outside_torchrun(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:  # as if this test process were not itself a torchrun rank
        monkeypatch.delenv(var, raising=False)
    assert not torchrun_env()
    plan = tmp_path / "plan.json"
    _plan(plan)
    rc = main(["run", "--plan", str(plan), "--domain", "code", "--tokens", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("moebalance: error: --world-size is required unless torchrun starts the ranks")


RUN = ["-m", "moebalance", "run", "--domain", "code", "--tokens", "256", "--batch-tokens", "256", "--plan"]


@pytest.mark.parametrize("bad", ["missing", "wrong-shape"])
def test_one_node_with_a_bad_plan_fails_both_nodes_with_one_line(tmp_path: Path, bad: str) -> None:
    """The hang: node 1 exits on its bad plan while node 0 waited for it in ``init_process_group``. Now every
    rank checks its inputs, the ranks agree, and both print the same line, well within the 60 s timeout."""
    good = tmp_path / "plan.json"
    _plan(good, gpus=2)
    wrong = tmp_path / "wrong.json"
    if bad == "wrong-shape":
        _plan(wrong, gpus=2, experts=8)  # 8 experts: not the bundled model's 16
    codes, errs, seconds = _two_nodes(tmp_path, [[*RUN, str(good)], [*RUN, str(wrong)]], _clean_env())
    assert seconds < 60, seconds
    assert codes[0] != 0 and codes[1] != 0
    lines = [_error_lines(e) for e in errs]
    assert all(len(ln) == 1 for ln in lines), errs
    assert lines[0] == lines[1], lines
    assert lines[0][0].startswith("moebalance: error: rank 1: ")
    assert ("does not exist" if bad == "missing" else "8 experts") in lines[0][0]
    # no worker traceback (the agents print their own, from torch)
    assert not any('File "' in ln and "/moebalance/" in ln for e in errs for ln in e.splitlines()), errs


WORKER = """
import os, signal, sys, time
import torch
from moebalance.core.errors import MoebalanceError
from moebalance.runtime import all_gather_v, guarded, init_from_env

def main():
    try:
        rank, world, _ = init_from_env()
        with guarded():
            for step in range(400):
                if rank == 1 and step == 20:
                    if sys.argv[1] == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise ValueError("a bug on rank 1")
                all_gather_v(torch.full((rank + 1, 4), float(step)))
                time.sleep(0.01)
    except MoebalanceError as exc:
        sys.stderr.write(f"moebalance: error: {exc}\\n")
        return 2
    return 0

sys.exit(main())
"""


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_rank_that_leaves_mid_run_is_named_in_one_line(tmp_path: Path, how: str) -> None:
    """Rank 1 is killed (SIGKILL), or raises an error of its own, after 20 all-gathers: rank 0 exits promptly with
    one line naming rank 1 and the collective, not gloo's "Connection reset by peer" traceback."""
    (tmp_path / "worker.py").write_text(WORKER)
    codes, errs, seconds = _two_nodes(tmp_path, [["worker.py", how], ["worker.py", how]], _clean_env())
    assert seconds < 60, seconds
    assert codes[0] != 0 and codes[1] != 0
    lines = _error_lines(errs[0])
    assert len(lines) == 1, errs[0]
    where = "all_gather in moebalance.runtime.comm.all_gather_v"
    if how == "kill":
        assert lines[0].startswith(f"moebalance: error: rank 1 left the group during {where} ("), lines[0]
        assert "exitcode: -9" in errs[1]  # rank 1 was killed, as its agent reports
    else:
        assert lines[0] == f"moebalance: error: rank 1 stopped on an error of its own during {where}: ValueError: " \
                           "a bug on rank 1", lines[0]
        assert "ValueError: a bug on rank 1" in errs[1]  # its own traceback: a bug, told where it happened
    assert "Connection reset" not in errs[0] and "RuntimeError" not in errs[0], errs[0]


def test_a_rank_that_never_arrives_is_named_after_the_timeout(tmp_path: Path) -> None:
    """Node 1 stops before it checks anything (a bad option): node 0 names it after ``MOEBALANCE_DIST_TIMEOUT``."""
    good = tmp_path / "plan.json"
    _plan(good, gpus=2)
    argv0, argv1 = [*RUN, str(good)], [*RUN, str(good), "--no-such-option"]
    codes, errs, seconds = _two_nodes(tmp_path, [argv0, argv1], _clean_env(**{TIMEOUT_ENV: "4"}))
    assert seconds < 30, seconds
    assert codes[0] != 0 and codes[1] != 0
    lines = _error_lines(errs[0])
    assert len(lines) == 1, errs[0]
    assert lines[0].startswith("moebalance: error: rank 1 did not arrive within 4 s"), lines[0]
    assert TIMEOUT_ENV in lines[0]


def _killed_at(rank: int, world_size: int, victim: int) -> int:
    """A local rank that all-gathers until ``victim`` kills itself at step 5."""
    for step in range(200):
        if rank == victim and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        all_gather_v(torch.full((rank + 1, 2), float(step)))
    return rank


def test_local_launch_names_a_killed_rank() -> None:
    t0 = time.monotonic()
    with pytest.raises(GroupError, match=r"^rank 2 left the group: its process was killed by SIGKILL"):
        launch(_killed_at, 3, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def _raises_on(rank: int, world_size: int, bad: int) -> int:
    if rank == bad:
        raise PlanError("the plan is wrong here")
    return rank


def test_local_launch_raises_a_rank_error_as_its_class_in_one_line() -> None:
    with pytest.raises(PlanError, match=r"^rank 1: the plan is wrong here$"):
        launch(_raises_on, 2, 1, timeout=60)
    assert launch(_raises_on, 2, 5, timeout=60) == [0, 1]


def test_dist_timeout_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from moebalance.runtime import DEFAULT_TIMEOUT, dist_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert dist_timeout() == DEFAULT_TIMEOUT == 60.0
    assert dist_timeout(5) == 5.0
    monkeypatch.setenv(TIMEOUT_ENV, "12.5")
    assert dist_timeout() == 12.5
    for bad in ("0", "-3", "nan", "soon"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(InputError, match=TIMEOUT_ENV):
            dist_timeout()


def _plain_env_ranks(tmp_path: Path, script: str, world_size: int, env: dict[str, str], limit: float = 90.0
                     ) -> tuple[list[int], list[str]]:
    """``world_size`` processes of ``script`` started as a plain ``env://`` launcher starts them (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; no torchrun agent: rank 0 hosts the store):
    ``(exit codes, stderr texts)``; all are killed after ``limit`` seconds."""
    (tmp_path / "ranks.py").write_text(script)
    port = str(free_port())
    procs, errs = [], []
    for rank in range(world_size):
        err = open(tmp_path / f"rank{rank}.err", "w+")
        errs.append(err)
        procs.append(subprocess.Popen(
            [sys.executable, "ranks.py"], stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path,
            env={**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": port}))
    t0 = time.monotonic()
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, limit - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    texts = []
    for err in errs:
        err.seek(0)
        texts.append(err.read())
        err.close()
    return codes, texts


TWO_JOINS = """
import os, signal, sys, time
import torch
import torch.distributed as dist
from moebalance.core.errors import MoebalanceError
from moebalance.runtime import all_gather_v, guarded, init_from_env
from moebalance.runtime.launch import membership

def join(kill):
    rank, _, _ = init_from_env()
    with guarded():
        for step in range(40):
            if kill and rank == 1 and step == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            all_gather_v(torch.full((rank + 1, 4), float(step)))
    dist.destroy_process_group()
    membership().leave()  # as run_torchrun ends: this rank is done

try:
    join(False)
    sys.stderr.write("first join done\\n")
    join(True)
except MoebalanceError as exc:
    sys.stderr.write(f"moebalance: error: {exc}\\n")
    sys.exit(2)
"""


def test_a_rank_killed_in_a_second_join_is_named_not_taken_as_done(tmp_path: Path) -> None:
    """A process that joins the group twice (``run_torchrun`` called twice): rank 1's "done" record of the first
    join must not make its death in the second read as "finished" (and torch's keys of the first join must not
    be read back by the second ``init_process_group``, which then failed to connect)."""
    codes, errs = _plain_env_ranks(tmp_path, TWO_JOINS, 2, _clean_env(**{TIMEOUT_ENV: "30"}))
    assert codes[1] == -signal.SIGKILL, errs[1]
    assert codes[0] == 2, errs[0]
    assert "first join done" in errs[0] and "first join done" in errs[1]
    lines = _error_lines(errs[0])
    assert len(lines) == 1, errs[0]
    assert lines[0].startswith("moebalance: error: rank 1 left the group during all_gather in "
                               "moebalance.runtime.comm.all_gather_v ("), lines[0]


def test_rank_0_hosting_the_store_names_the_rank_that_never_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain ``env://`` launch (no torchrun agent): rank 0 hosts the store; rank 1 never starts. Rank 0 names
    rank 1 after the timeout, not "could not reach the group's store ... is rank 0's launcher running?"."""
    from moebalance.runtime import agreed_inputs

    # the module, not the function the package exports under its name
    monkeypatch.setattr(sys.modules["moebalance.runtime.launch"], "_MEMBERSHIP", None)  # this process's connection is this test's alone
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(free_port())), (TIMEOUT_ENV, "2")):
        monkeypatch.setenv(var, value)
    t0 = time.monotonic()
    with pytest.raises(GroupError, match=r"^rank 1 did not arrive within 2 s to check the run's inputs \("), \
            agreed_inputs(None, "check the run's inputs"):
        pass
    assert time.monotonic() - t0 < 20
