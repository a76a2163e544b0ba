"""``moebalance watch`` (docs/design.md, "Watching a running engine"): the drift by hand; decisions that re-plan when
the move pays and not before (sync stalls against a short horizon, the margin, a placement that already fits);
prices equal to what ``online`` prices for the same step; and the command on real folders and real processes:
resuming from its log, unreadable records, an engine restart, the plan written for the engine, SIGTERM, Prometheus.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_user_error, run_cli

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import replay
from moebalance.online.watch import WatchConfig, Watcher, drift
from moebalance.policies import make_plan
from moebalance.pricing.step import StepPricing
from moebalance.runtime import free_port

MODEL = get_model("olmoe-1b-7b")  # 16 MoE layers x 64 experts, top-8
L, E = MODEL.num_layers, MODEL.num_experts
CLUSTER = Cluster(num_nodes=2, gpus_per_node=4)
PRICING = StepPricing(deployment=Deployment(model=MODEL, gpu=get_gpu("h100-80gb")), phase="prefill")


def hot(first: int, picks: int = 40_000, share: float = 0.6, seed: int = 0) -> np.ndarray:
    """Counts ``[L, E]``: ``share`` of every layer's picks on experts ``first .. first + 7`` (one GPU's block under
    contiguous placement), the rest spread."""
    rng = np.random.default_rng(seed)
    p = np.full(E, (1 - share) / (E - 8))
    p[first:first + 8] = share / 8
    return rng.multinomial(picks, p, size=L).astype(np.int64)


def config(**kw: object) -> WatchConfig:
    base: dict[str, object] = dict(cluster=CLUSTER, budget=Budget(slots_per_gpu=10), policy="eplb", window=2,
                                   horizon_s=600.0, replanning=Replanning(migration="aligned", rearrange="async"),
                                   pricing=PRICING, margin=0.0)
    base.update(kw)
    return WatchConfig(**base)  # type: ignore[arg-type]


def test_drift_by_hand() -> None:
    a = np.array([[1, 1, 0, 0], [3, 0, 0, 0]])
    assert drift(a, a) == 0.0
    assert drift(a, np.array([[0, 0, 1, 1], [0, 3, 0, 0]])) == 1.0  # no expert in common in either layer
    assert drift(np.array([[2, 0]]), np.array([[1, 1]])) == pytest.approx(0.5)
    assert drift(np.zeros((2, 3)), a[:, :3]) == 0.0  # no load: nothing to compare


def test_a_hot_spot_pays_for_its_move_and_the_plan_in_service_then_stays() -> None:
    """Contiguous blocks under a hot spot on one GPU: EPLB's re-plan serves more tokens, async lands it for free:
    re-plan. Once adopted, the same routing leaves nothing to gain: keep."""
    w = Watcher(config())
    first = w.observe(hot(0), "r0")
    assert first.decision == "replan" and first.gain_tokens is not None and first.gain_tokens > 0
    assert first.tokens_per_s_replan is not None and first.tokens_per_s_now is not None
    assert first.tokens_per_s_replan > 1.1 * first.tokens_per_s_now
    assert first.moved_copies and first.moved_gib and first.exposed_s == 0.0  # async: nothing stalls
    assert first.plan is not None
    w.adopt(first.plan)
    again = w.observe(hot(0, seed=1), "r1")
    assert again.decision == "keep" and np.nanmean(again.balancedness) > np.nanmean(first.balancedness)


def test_a_sync_move_is_not_worth_a_short_horizon() -> None:
    """The same hot spot, re-planned synchronously (1 s of host overhead and the transfer stall serving): over a
    horizon of 0.5 s it cannot pay, over an hour it does."""
    sync = Replanning(migration="aligned", rearrange="sync")
    short = Watcher(config(replanning=sync, horizon_s=0.5)).observe(hot(0), "r0")
    assert short.decision == "keep" and short.gain_tokens is not None and short.gain_tokens < 0
    assert short.exposed_s is not None and short.exposed_s >= 1.0 and "fewer tokens" in short.reason
    long = Watcher(config(replanning=sync, horizon_s=3600.0)).observe(hot(0), "r0")
    assert long.decision == "replan" and long.exposed_s == pytest.approx(short.exposed_s)


def test_a_gain_inside_the_margin_is_kept() -> None:
    loose = Watcher(config(margin=10.0)).observe(hot(0), "r0")  # no re-plan serves 11x the tokens
    assert loose.decision == "keep" and "margin" in loose.reason


def test_without_pricing_balance_is_measured_and_nothing_decided() -> None:
    o = Watcher(config(pricing=None)).observe(hot(0), "r0")
    assert o.decision == "measure" and o.tokens_per_s_now is None and o.plan is None
    # contiguous blocks, the hot spot on GPU 0: the mean GPU carries under half of its load
    assert np.nanmax(o.balancedness) < 0.5
    assert o.hottest[0][1] in range(8) and len(o.hottest) == 5


def test_the_window_is_bounded_and_records_must_keep_their_shape() -> None:
    w = Watcher(config(pricing=None, window=3))
    for i in range(10):
        w.observe(hot(i % 4), f"r{i}")
    assert len(w.window) == 3 and w.seen == 10
    with pytest.raises(Exception, match="shape"):
        w.observe(np.zeros((L, E + 1), dtype=np.int64), "bad")
    with pytest.raises(Exception, match="whole numbers"):
        w.observe(np.full((L, E), 0.5), "half")


def test_prices_are_what_online_prices_for_the_same_step() -> None:
    """The step watch prices (drawn from the window) served by ``online``'s replay with the same fixed plan and
    pricing: the same tokens per second (the same ``score_batch``)."""
    plan = make_plan("contiguous", LoadMatrix(hot(0)[None]), CLUSTER, Budget(replicas_per_gpu=0))[0]
    w = Watcher(config(), plan)
    o = w.observe(hot(0), "r0")
    step = w.step(w.window_load())  # the step it priced
    served = LoadMatrix(np.concatenate([step.counts, step.counts]), preset=MODEL.name)
    result = replay(served, CLUSTER, Budget(slots_per_gpu=8), plan, warmup=(0, 1), batches=(1, 2), router="uniform",
                    pricing=PRICING)
    assert result.time is not None and o.tokens_per_s_now is not None
    assert o.tokens_per_s_now == pytest.approx(result.time["tokens_per_s"], rel=1e-6)


# ----- the command ----------------------------------------------------------------------------------------------

BASE = ["--nodes", 2, "--gpus-per-node", 4, "--slots-per-gpu", 10, "--model", "olmoe-1b-7b"]


def records(folder: Path, firsts: list[int], start: int = 0, mtime: float = 1_000.0) -> list[Path]:
    """One moebalance load per record (``.npz``), modification times one second apart."""
    folder.mkdir(exist_ok=True)
    out = []
    for i, first in enumerate(firsts, start=start):
        p = folder / f"r{i:03d}.npz"
        np.savez(p, counts=hot(first, seed=i)[None], preset=np.array("olmoe-1b-7b"))
        os.utime(p, (mtime + i, mtime + i))
        out.append(p)
    return out


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_watch_once_logs_every_record_and_resumes_from_its_log(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder, log = tmp_path / "records", tmp_path / "watch.jsonl"
    records(folder, [0, 0, 0])
    rc, out, err = run_cli(["watch", folder, *BASE, "--once", "--log", log], capsys)
    assert rc == 0, err
    first = log_lines(log)
    assert [d["record"] for d in first] == ["r000.npz", "r001.npz", "r002.npz"]
    assert all(d["decision"] == "measure" and len(d["balancedness"]) == L for d in first)  # no --gpu
    assert out.count("balancedness") == 3
    records(folder, [8, 8], start=3)  # two more: a restarted watch reads only those
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log], capsys)
    assert rc == 0, err
    resumed = log_lines(log)
    assert [d["record"] for d in resumed] == [f"r{i:03d}.npz" for i in range(5)]
    # the window and the planning shares restored from the log: the same figures as one run over all five
    whole = tmp_path / "whole.jsonl"
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", whole], capsys)
    assert rc == 0, err
    for a, b in zip(resumed, log_lines(whole), strict=True):
        assert (a["record"], a["index"], a["balancedness"], a["drift"]) == (b["record"], b["index"],
                                                                             b["balancedness"], b["drift"])
    assert resumed[-1]["drift"] > 0.15  # the hot block moved from experts 0-7 to 8-15


def test_unreadable_and_restarted_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, log = tmp_path / "records", tmp_path / "watch.jsonl"
    records(folder, [0, 0])
    bad = folder / "r002.npz"
    bad.write_bytes(b"PK\x03\x04 half written")
    os.utime(bad, (1_010, 1_010))
    newer = records(folder, [4], start=3)[0]
    os.utime(newer, (2_000, 2_000))
    last = folder / "a000.npz"  # read by time, not by name: the newest file comes last
    np.savez(last, counts=hot(0)[None], preset=np.array("olmoe-1b-7b"))
    os.utime(last, (3_000, 3_000))
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log], capsys)
    assert rc == 0, err
    assert "r002.npz" in err and "skipped" in err and "Traceback" not in err
    docs = log_lines(log)
    assert {"record": "r002.npz"} == {k: v for k, v in docs[2].items() if k == "record"} and "skipped" in docs[2]
    assert [d["record"] for d in docs if "balancedness" in d] == ["r000.npz", "r001.npz", "r003.npz", "a000.npz"]
    # a second run with a record older than the last seen: a restart, its window started again
    late = folder / "r004.npz"
    np.savez(late, counts=hot(0)[None], preset=np.array("olmoe-1b-7b"))
    os.utime(late, (100, 100))
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log], capsys)
    assert rc == 0, err
    assert any(d.get("restart") for d in log_lines(log))


def test_a_replan_writes_the_engines_file_and_runs_the_hook(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder, log, plan = tmp_path / "records", tmp_path / "watch.jsonl", tmp_path / "init-expert-location.json"
    records(folder, [0, 0])
    marker = tmp_path / "hook.txt"
    hook = f"{sys.executable} -c \"import os; open({str(marker)!r}, 'w').write(os.environ['MOEBALANCE_PLAN'])\""
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log, "--gpu", "h100-80gb", "--phase",
                          "prefill", "--margin", 0, "--write-plan", plan, "--engine", "sglang", "--on-replan", hook],
                           capsys)
    assert rc == 0, err
    docs = log_lines(log)
    assert docs[0]["decision"] == "replan" and docs[0]["written"] == str(plan)
    doc = json.loads(plan.read_text())
    assert np.asarray(doc["physical_to_logical_map"]).shape == (L, 8 * 10)
    assert marker.read_text() == str(plan)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # nothing half-written left
    # --dry-run: decides, writes nothing
    plan.unlink()
    log.unlink()
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log, "--gpu", "h100-80gb", "--phase", "prefill",
                          "--margin", 0, "--write-plan", plan, "--dry-run"], capsys)
    assert rc == 0, err
    assert log_lines(log)[0]["decision"] == "replan" and not plan.exists()


def test_sigterm_stops_cleanly_and_prometheus_scrapes(tmp_path: Path) -> None:
    """A real process following a folder: its metrics served on localhost, a SIGTERM while it polls ends it with
    exit 0 and a log of whole lines."""
    folder, log = tmp_path / "records", tmp_path / "watch.jsonl"
    records(folder, [0, 0])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moebalance", "watch", str(folder), *map(str, BASE), "--log",
                             str(log), "--interval", "0.2", "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
            time.sleep(0.2)
        assert log.exists() and len(log_lines(log)) == 2, proc.stderr.read() if proc.poll() is not None else ""
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'moebalance_balancedness_ratio{engine="sglang"}' in body
        assert 'moebalance_records_total{engine="sglang"} 2.0' in body
        assert 'moebalance_layer_balancedness_ratio{engine="sglang",layer="0"}' in body
        records(folder, [8], start=2, mtime=2_000.0)  # a new record while it runs
        while time.monotonic() < deadline and len(log.read_text().splitlines()) < 3:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "watch stopped" in err and "Traceback" not in err
    assert [d["record"] for d in log_lines(log)] == ["r000.npz", "r001.npz", "r002.npz"]


def test_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(["watch", tmp_path / "missing", *BASE, "--once"], capsys, "does not exist")
    folder = tmp_path / "records"
    records(folder, [0])
    assert_user_error(["watch", folder, *BASE, "--once", "--migration", "bounded"], capsys, "--max-moves")
    odd = tmp_path / "odd"
    odd.mkdir()
    np.savez(odd / "r.npz", counts=np.ones((1, 3, 16), dtype=np.int64))  # a shape no model has, naming none
    assert_user_error(["watch", odd, "--nodes", 2, "--gpus-per-node", 4, "--slots-per-gpu", 2, "--once",
                       "--gpu", "h100-80gb"], capsys, "--model")
    # records that name their model need no --model to be priced
    rc, _, err = run_cli(["watch", folder, "--nodes", 2, "--gpus-per-node", 4, "--slots-per-gpu", 10, "--once",
                          "--gpu", "h100-80gb"], capsys)
    assert rc == 0 and "Traceback" not in err
    assert_user_error(["watch", folder, *BASE, "--once", "--horizon", 0], capsys, "--horizon")
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        assert_user_error(["watch", folder, *BASE, "--once", "--metrics-port", port], capsys, f"--metrics-port {port}")


def test_a_watched_plan_shape(tmp_path: Path) -> None:
    """The plan a re-plan writes is the policy's, on the window: every GPU holds its slots, every expert a copy."""
    w = Watcher(config())
    o = w.observe(hot(0), "r0")
    assert isinstance(o.plan, Placement) and o.plan.max_slots_per_gpu == 10
    assert (o.plan.replica_counts() >= 1).all()


def test_sglang_stat_dumps_as_sglang_writes_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two ``stat`` dumps (``torch.save`` of ``{"rank", "logical_count" int32 [B, L, E], ...}``, DeepSeek-V3's 61
    decoder layers with the 3 dense ones all zero, the ring buffer's unused passes zero): watched, measured on the 58
    MoE layers; a third dump truncated mid-write is skipped with one warning."""
    import torch

    folder = tmp_path / "dumps"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        rows = np.zeros((4, 61, 256), dtype=np.int32)
        rows[:3, 3:] = rng.integers(0, 50, size=(3, 58, 256))
        path = folder / f"expert_distribution_recorder_{1_700_000_000 + i}.pt"
        torch.save({"rank": 0, "logical_count": torch.from_numpy(rows), "average_utilization_rate_over_window": None},
                   path)
        os.utime(path, (1_000 + i, 1_000 + i))
    whole = (folder / "expert_distribution_recorder_1700000001.pt").read_bytes()
    cut = folder / "expert_distribution_recorder_1700000002.pt"
    cut.write_bytes(whole[: len(whole) // 2])
    os.utime(cut, (1_002, 1_002))
    log = tmp_path / "watch.jsonl"
    rc, _, err = run_cli(["watch", folder, "--nodes", 8, "--gpus-per-node", 8, "--slots-per-gpu", 5, "--once",
                          "--log", log], capsys)
    assert rc == 0, err
    docs = log_lines(log)
    measured = [d for d in docs if "balancedness" in d]
    assert len(measured) == 2 and all(len(d["balancedness"]) == 61 for d in measured)
    assert all(d["balancedness"][:3] == [None, None, None] for d in measured)  # the dense layers carry no load
    assert "skipped" in docs[-1] and err.count("warning") == 1


def test_memory_stays_flat_over_ten_thousand_records() -> None:
    """A soak at small sizes (2 layers x 8 experts on 4 GPUs, a window of 4): the traced memory after 10,000
    records is what it was after 1,000 (the window is bounded; nothing else is kept per record)."""
    import tracemalloc

    w = Watcher(WatchConfig(cluster=Cluster(num_nodes=1, gpus_per_node=4), budget=Budget(slots_per_gpu=2),
                            window=4))
    rng = np.random.default_rng(0)
    records = [rng.integers(0, 100, size=(2, 8)) for _ in range(16)]
    tracemalloc.start()
    try:
        for i in range(10_000):
            w.observe(records[i % 16], "r")
            if i == 999:
                early = tracemalloc.get_traced_memory()[0]
        late = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert late - early < 64 * 1024, (early, late)
    assert len(w.window) == 4 and w.seen == 10_000


def test_a_drifting_sequence_replans_when_the_move_pays_and_not_before() -> None:
    """Records whose hot spot (60% of every layer's picks on two experts) stays put, then moves by steps from experts
    0-1 to 32-33. The placement in service is
    EPLB's plan on the steady routing: while the routing stays, nothing pays (keep); once the drift has moved
    enough load, a re-plan pays and is taken, once, and the prices behind every decision are the ones ``online``
    prices for the same step and plans (checked at each record)."""
    rng = np.random.default_rng(5)

    def mixed(weight: float) -> np.ndarray:
        p = np.full(E, 0.4 / (E - 4))
        p[0:2], p[32:34] = 0.6 * (1 - weight) / 2, 0.6 * weight / 2
        return rng.multinomial(40_000, p / p.sum(), size=L).astype(np.int64)

    steady = [mixed(0.0) for _ in range(6)]
    moving = [mixed(w) for w in (0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.0)]
    cfg = config(margin=0.05, window=2, replanning=Replanning(migration="aligned", rearrange="sync"),
                 horizon_s=120.0)
    base = make_plan("eplb", LoadMatrix(np.sum(steady, axis=0)[None], preset=MODEL.name), CLUSTER,
                     Budget(slots_per_gpu=10))[0]
    w = Watcher(cfg, base, planned_on=np.sum(steady, axis=0))
    decisions, drifts = [], []
    for i, c in enumerate([*steady, *moving]):
        o = w.observe(c, f"r{i}")
        decisions.append(o.decision)
        drifts.append(o.drift)
        step = w.step(w.window_load())  # the step it priced
        served = LoadMatrix(np.concatenate([step.counts, step.counts]), preset=MODEL.name)
        for plan, tps in ((w.plan, o.tokens_per_s_now), (o.plan, o.tokens_per_s_replan)):
            online = replay(served, CLUSTER, Budget(slots_per_gpu=10), plan, warmup=(0, 1), batches=(1, 2),
                            router="uniform", pricing=PRICING)
            assert online.time is not None and tps == pytest.approx(online.time["tokens_per_s"], rel=1e-6)
        if o.decision == "replan" and o.plan is not None:
            w.adopt(o.plan)
    assert decisions[:6] == ["keep"] * 6  # the steady part: the plan in service fits
    first = decisions.index("replan")
    assert first >= 6 and drifts[first] > max(drifts[:6])  # not before the drift
    assert decisions.count("replan") <= 3  # re-plans follow the moving hot spot, not every record


def test_tensorrt_llm_statistics_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One ``EXPERT_STATISTIC_PATH`` folder per collection, as TensorRT-LLM writes it (rank 0's ``meta_info.json``,
    each rank's ``rank{r}.safetensors`` keyed ``"{iter}_{layer}"``), is one record, its iterations and ranks summed;
    a folder whose ``meta_info.json`` is still being written is skipped with a warning (``--once``: nothing more
    will come)."""
    from safetensors.numpy import save_file

    folder = tmp_path / "stats"
    folder.mkdir()
    rng = np.random.default_rng(1)
    totals = []
    for n in range(2):
        d = folder / f"collection{n}"
        d.mkdir()
        (d / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": 8}))
        total = np.zeros((L, E), dtype=np.int64)
        for r in range(2):
            per = rng.integers(0, 50, size=(3, L, E))
            total += per.sum(axis=0)
            save_file({f"{it}_{layer}": per[i, layer].astype(np.int64) for i, it in enumerate((10, 11, 12))
                       for layer in range(L)}, str(d / f"rank{r}.safetensors"))
        for f in d.iterdir():
            os.utime(f, (1_000 + n, 1_000 + n))
        totals.append(total)
    half = folder / "collection2"
    half.mkdir()
    (half / "meta_info.json").write_text('{"num_experts": 64')  # rank 0 is still writing
    os.utime(half / "meta_info.json", (1_002, 1_002))
    log = tmp_path / "watch.jsonl"
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log], capsys)
    assert rc == 0, err
    docs = log_lines(log)
    assert [d["record"] for d in docs] == ["collection0", "collection1", "collection2"]
    assert "skipped" in docs[2] and "collection2" in err
    w = Watcher(config(pricing=None, window=8))
    for total in totals:
        expect = w.observe(total, "x")
    assert docs[1]["balancedness"] == expect.as_dict()["balancedness"]  # the two collections' counts, summed


def test_an_sglang_server_is_asked_to_record_and_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--sglang URL``: watch POSTs ``/start_expert_distribution_record`` once and ``/dump_expert_distribution_record``
    before it looks at the folder. SGLang's server cannot run here: an HTTP server stands in for its two endpoints,
    writing a ``stat`` dump into the folder as SGLang's recorder does; a server that does not answer is a warning."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    import torch

    folder = tmp_path / "dumps"
    folder.mkdir()
    calls: list[str] = []

    class SGLang(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            calls.append(self.path)
            if self.path == "/dump_expert_distribution_record":
                torch.save({"rank": 0, "logical_count": torch.from_numpy(hot(0)[None].astype(np.int32)),
                            "average_utilization_rate_over_window": None},
                           folder / f"expert_distribution_recorder_{time.time()}.pt")
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = HTTPServer(("127.0.0.1", 0), SGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        log = tmp_path / "watch.jsonl"
        rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log, "--sglang", url], capsys)
    finally:
        server.shutdown()
    assert rc == 0, err
    assert calls == ["/start_expert_distribution_record", "/dump_expert_distribution_record"]
    assert len(log_lines(log)) == 1 and log_lines(log)[0]["record"].startswith("expert_distribution_recorder_")
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--sglang", url], capsys)  # the server is gone
    assert rc == 0 and "warning" in err and "Traceback" not in err
    assert_user_error(["watch", folder, *BASE, "--once", "--sglang", "localhost:30000"], capsys, "--sglang")


def test_synth_deepseek_v3_drift_on_64_gpus() -> None:
    """``synth``'s DeepSeek-V3 routing (58 MoE layers x 256 experts) with its popularity drifting fast, on 8 x 8 H100s
    with EPLB's 5 slots per GPU, decode steps: the placement planned on the first records is kept while the routing
    is close to it and re-planned once the drift pays; every decision's prices are online's for the same step."""
    import dataclasses

    from moebalance.workloads.profiles import routing_profile
    from moebalance.workloads.synth import synthesize

    v3 = get_model("deepseek-v3")
    profile = dataclasses.replace(routing_profile(v3), drift_sigma=0.8, drift_timescale=3.0)
    counts = synthesize("deepseek-v3", num_batches=10, tokens_per_batch=64 * 64, num_gpus=64, seed=2,
                        profile=profile)["counts"]
    cluster, budget = Cluster(num_nodes=8, gpus_per_node=8), Budget(slots_per_gpu=5)
    pricing = StepPricing(deployment=Deployment(model=v3, gpu=get_gpu("h100-80gb")), phase="decode")
    cfg = WatchConfig(cluster=cluster, budget=budget, policy="eplb", params={"num_groups": 8}, window=1,
                      horizon_s=600.0, replanning=Replanning(migration="aligned", rearrange="async"), pricing=pricing)
    base = make_plan("eplb", LoadMatrix(counts[:1], preset=v3.name), cluster, budget, num_groups=8)[0]
    w = Watcher(cfg, base, planned_on=counts[0])
    decisions, drifts = [], []
    for i, c in enumerate(counts):
        o = w.observe(c, f"r{i}")
        decisions.append(o.decision)
        drifts.append(o.drift)
        if i % 3 == 0:  # every third record: the prices are online's
            step = w.step(w.window_load())
            served = LoadMatrix(np.concatenate([step.counts, step.counts]), preset=v3.name)
            online = replay(served, cluster, budget, w.plan, warmup=(0, 1), batches=(1, 2), router="uniform",
                            pricing=pricing)
            assert online.time is not None and o.tokens_per_s_now == pytest.approx(online.time["tokens_per_s"],
                                                                                   rel=1e-6)
        if o.decision == "replan" and o.plan is not None:
            w.adopt(o.plan)
    assert decisions[0] == "keep"  # planned on this very record
    assert "replan" in decisions
    first = decisions.index("replan")
    assert drifts[first] > drifts[0] + 0.05  # the routing had moved from the plan's


def test_a_killed_watch_loses_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL (no clean-up runs) while watch follows a folder, a torn last log line as a crash mid-write leaves:
    the next run reads past the torn line, logs each record once, and no temporary file is left beside the plan."""
    folder, log, plan = tmp_path / "records", tmp_path / "watch.jsonl", tmp_path / "plan.json"
    records(folder, [0, 0])
    proc = subprocess.Popen([sys.executable, "-m", "moebalance", "watch", str(folder), *map(str, BASE), "--log",
                             str(log), "--interval", "0.2", "--gpu", "h100-80gb", "--phase", "prefill", "--margin", "0",
                             "--write-plan", str(plan), "--engine", "vllm"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert len(log_lines(log)) == 2
    with open(log, "a") as fh:
        fh.write('{"record": "r002.npz", "bal')  # torn by the crash
    records(folder, [8], start=2, mtime=2_000.0)
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log, "--gpu", "h100-80gb", "--phase", "prefill",
                          "--margin", 0, "--write-plan", plan, "--engine", "vllm"], capsys)
    assert rc == 0, err
    assert "torn last line" in err
    assert [d["record"] for d in log_lines(log)] == ["r000.npz", "r001.npz", "r002.npz"]  # every line whole
    assert plan.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_sglang_per_pass_dumps_one_file_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``per_pass`` dumps as SGLang's recorder writes them: each rank its own
    ``expert_distribution_recorder_{time}_{rank}.pt`` (``records`` of its passes' physical counts, the map), named by
    its own clock. The ranks' files of one dump are one record, their passes and ranks summed through the map; a dump
    whose second rank has not written yet is not a record yet."""
    import torch

    folder = tmp_path / "dumps"
    folder.mkdir()
    G2 = 2
    phy2log = np.tile(np.arange(E), (L, 1)).astype(np.int64)  # 32 experts a rank, no replica
    rng = np.random.default_rng(3)
    totals = []
    for dump, t in enumerate((1_700_000_000.1, 1_700_000_100.5, 1_700_000_200.2)):
        total = np.zeros((L, E), dtype=np.int64)
        for rank in range(G2 if dump < 2 else 1):  # the last dump: rank 1 still writing
            records = []
            for fid in range(3):
                phys = rng.integers(0, 20, size=(L, E))
                total += phys
                records.append({"forward_pass_id": fid, "rank": rank, "gatherer_key": "primary",
                                "global_physical_count": torch.from_numpy(phys.astype(np.int32))})
            path = folder / f"expert_distribution_recorder_{t + 0.01 * rank}_{rank}.pt"
            torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(phy2log)}, path)
            os.utime(path, (1_000 + dump, 1_000 + dump))
        totals.append(total)
    log = tmp_path / "watch.jsonl"
    args = ["watch", folder, "--nodes", 1, "--gpus-per-node", G2, "--slots-per-gpu", E // G2, "--model",
            "olmoe-1b-7b", "--once", "--log", log]
    rc, _, err = run_cli(args, capsys)
    assert rc == 0, err
    docs = log_lines(log)
    assert [d["record"] for d in docs] == ["expert_distribution_recorder_1700000000.1",
                                           "expert_distribution_recorder_1700000100.5"]
    w = Watcher(WatchConfig(cluster=Cluster(num_nodes=1, gpus_per_node=G2), budget=Budget(slots_per_gpu=E // G2),
                            window=8))
    for total in totals[:2]:
        expect = w.observe(total, "x")
    assert docs[1]["balancedness"] == expect.as_dict()["balancedness"]
    # rank 1 of the last dump arrives: a record now, and a resumed run reads it alone
    path = folder / "expert_distribution_recorder_1700000200.21_1.pt"
    torch.save({"records": [{"forward_pass_id": fid, "rank": 1, "gatherer_key": "primary",
                             "global_physical_count": torch.zeros((L, E), dtype=torch.int32)} for fid in range(3)],
                "last_physical_to_logical_map": torch.from_numpy(phy2log)}, path)
    rc, _, err = run_cli(args, capsys)
    assert rc == 0, err
    last = log_lines(log)[-1]
    assert last["record"] == "expert_distribution_recorder_1700000200.2" and "balancedness" in last, last


def test_engine_restarts_are_told_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine that started over: the folder emptied and filled again, or the vLLM plug-in's records from another
    process; each is logged as a restart with why, and the window starts again."""
    folder, log = tmp_path / "records", tmp_path / "watch.jsonl"
    old = records(folder, [0, 0])
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log], capsys)
    assert rc == 0, err
    for p in old:
        p.unlink()
    records(folder, [8, 8], start=5, mtime=5_000.0)
    rc, _, err = run_cli(["watch", folder, *BASE, "--once", "--log", log], capsys)
    assert rc == 0, err
    restarts = [d for d in log_lines(log) if "restart" in d]
    assert len(restarts) == 1 and "gone" in restarts[0]["restart"] and "restarted" in err
    vllm, vlog = tmp_path / "vllm", tmp_path / "vllm.jsonl"
    vllm.mkdir()
    for i, pid in enumerate((100, 100, 200)):
        p = vllm / f"vllm-eplb-{i + 1}-{pid}.npz"
        np.savez(p, counts=hot(0, seed=i)[None], new_map=np.tile(np.arange(80) % E, (L, 1)))
        os.utime(p, (1_000 + i, 1_000 + i))
    rc, _, err = run_cli(["watch", vllm, *BASE, "--once", "--log", vlog], capsys)
    assert rc == 0, err
    restarts = [d for d in log_lines(vlog) if "restart" in d]
    assert len(restarts) == 1 and restarts[0]["record"] == "vllm-eplb-3-200.npz" and "200" in restarts[0]["restart"]
