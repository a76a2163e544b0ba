"""Check ``moebalance watch`` with the real parts around it (``make live``): the engines' own code writes what watch
reads, and a real Prometheus server reads what watch serves.

Runs in the scratch environment ``make engines`` builds (.venv-engines: CPU torch, vLLM and SGLang installed without
their dependencies), with Debian's ``prometheus`` package (``apt-get install prometheus``: ``prometheus`` and
``promtool`` on PATH). No GPU, no model weights, no engine server:

- SGLang: its own expert-distribution recorder (``sglang.srt.eplb.expert_distribution``, the ``stat`` accumulator
  an SGLang server runs with ``--expert-distribution-recorder-mode stat``) records forward passes of DeepSeek-V3's
  shape on a one-rank gloo group and dumps them twice, as ``/dump_expert_distribution_record`` makes it, into
  ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``. The module's two imports that need a GPU server's packages and are
  used only for typing and for the balancedness report (left off) are given empty stand-ins; the configuration getter
  returns what ``--expert-distribution-recorder-mode stat`` publishes, and the first dump's GPU cache flush is skipped.
- watch follows that folder (a real process) with ``--metrics-port``: ``promtool check metrics`` accepts its
  exposition, and a Prometheus server scraping it every second answers the PromQL query
  ``moebalance_balancedness_ratio`` through its HTTP API with the balancedness watch logged for the last dump.
- vLLM: with ``MOEBALANCE_RECORD_DIR`` set, the policy vLLM's EPLB calls (``EPLB_POLICIES["default"]`` after
  ``load_general_plugins()``) writes a record, and ``watch --once`` reads it with the plug-in's map as the placement.

Exit code 0 when every check passes; each check prints one line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import torch

E, H, G, S = 256, 61, 8, 36  # DeepSeek-V3 on 8 GPUs, 36 slots each: 32 redundant experts
DENSE = 3
FAILED: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok:   " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        FAILED.append(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 10) -> str:
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


def wait_lines(log: Path, n: int, seconds: float = 120) -> list[dict]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if log.exists():
            lines = [json.loads(x) for x in log.read_text().splitlines()]
            if len(lines) >= n:
                return lines
        time.sleep(0.3)
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def sglang_dumps(folder: Path) -> None:
    """Two ``stat`` dumps written by SGLang's own recorder (module docstring)."""
    for name in ("sglang.srt.model_executor.forward_batch_info", "sglang.srt.observability.metrics_collector"):
        stand_in = types.ModuleType(name)
        for attr in ("ForwardBatch", "ForwardMode", "ExpertDispatchCollector", "STAT_LOGGER_ROLE_EXPERT_DISPATCH",
                     "resolve_collector_class"):
            setattr(stand_in, attr, None)
        sys.modules[name] = stand_in
    import sglang.srt.eplb.expert_distribution as ed
    import torch.distributed as dist

    ns = types.SimpleNamespace
    moe = ns(expert_distribution_recorder_mode="stat", expert_distribution_recorder_buffer_size=-1,
             eplb_min_rebalancing_utilization_threshold=1.0)
    ed.get_exec = lambda: ns(moe=moe)
    ed.get_device_namespace = lambda: ns(device="cpu")
    ed.reports_expert_balancedness = lambda: False
    os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = str(folder)
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    phy2log = torch.from_numpy(np.tile(np.arange(G * S) % E, (H, 1)))  # SGLang's trivial layout
    meta = ns(num_layers=H, num_physical_experts=G * S, num_logical_experts=E, physical_to_logical_map=phy2log,
              ep_size=G)
    rng = np.random.default_rng(0)
    for _ in range(2):
        acc = ed._StatAccumulator(meta, 0)
        hot = rng.choice(G * S, 16, replace=False)
        for p in range(8):
            count = rng.integers(0, 20, size=(H, G * S))
            count[:, hot] += 400
            count[:DENSE] = 0  # dense layers record nothing
            acc.append(p, "primary", {"global_physical_count": torch.from_numpy(count.astype(np.int32))}, {})
        acc._first_dump = False  # its first dump empties the GPU's cache: there is no GPU
        acc.dump("file")
        time.sleep(1.1)  # the dumps are named by time
    dist.destroy_process_group()


def prometheus_checks(tmp: Path, dumps: Path) -> None:
    port, web = free_port(), free_port()
    log = tmp / "watch.jsonl"
    watch = subprocess.Popen([sys.executable, "-m", "moebalance", "watch", str(dumps), "--nodes", "1",
                              "--gpus-per-node", str(G), "--slots-per-gpu", str(S), "--log", str(log), "--interval",
                              "0.5", "--metrics-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    prom = None
    try:
        lines = wait_lines(log, 2)
        check(len(lines) == 2 and all(len(d["balancedness"]) == H for d in lines),
              f"watch read SGLang's two dumps ({len(lines)} records, {H} decoder layers each)")
        exposition = get(f"http://127.0.0.1:{port}/metrics")
        done = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True,
                              check=False)
        check(done.returncode == 0, f"promtool check metrics accepts watch's exposition {done.stdout.strip()}"
                                    f"{done.stderr.strip()}")
        config = tmp / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: moebalance\n"
                          f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
        prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        query = urllib.parse.quote('moebalance_balancedness_ratio{engine="sglang"}')
        value = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and value is None:
            time.sleep(1)
            try:
                doc = json.loads(get(f"http://127.0.0.1:{web}/api/v1/query?query={query}"))
            except OSError:
                continue
            result = doc.get("data", {}).get("result", [])
            if result:
                value = float(result[0]["value"][1])
        logged = lines[-1]["balancedness_mean"] if lines else None
        check(value is not None and logged is not None and abs(value - logged) < 1e-6,
              f"Prometheus's PromQL query gives {value}, the balancedness watch logged for the last dump {logged}")
    finally:
        for proc in (watch, prom):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    check(watch.returncode == 0, f"watch stopped on SIGTERM with exit code {watch.returncode}")


def vllm_checks(tmp: Path) -> None:
    from moebalance.engines.vllm_plugin import ENV, RECORD_ENV, balancedness

    records = tmp / "vllm-records"
    records.mkdir()
    os.environ[ENV] = "move-aware"
    os.environ[RECORD_ENV] = str(records)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    w = (torch.rand(4, E, generator=torch.Generator().manual_seed(0)) ** 4 * 1000).round() + 1
    new = np.asarray(EPLB_POLICIES["default"].rebalance_experts(w, G * S, 8, 1, G))
    files = sorted(records.glob("vllm-eplb-*.npz"))
    check(len(files) == 1, f"the policy vLLM's EPLB calls wrote {len(files)} record(s) into MOEBALANCE_RECORD_DIR")
    log = tmp / "vllm-watch.jsonl"
    done = subprocess.run([sys.executable, "-m", "moebalance", "watch", str(records), "--nodes", "1",
                           "--gpus-per-node", str(G), "--slots-per-gpu", str(S), "--once", "--log", str(log)],
                          capture_output=True, text=True, check=False)
    docs = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    expect = float(balancedness(new, w.double().numpy(), G).mean())
    check(done.returncode == 0 and len(docs) == 1 and abs(docs[0]["balancedness_mean"] - expect) < 1e-6,
          f"watch read it, the plug-in's map in service: balancedness {docs[0]['balancedness_mean'] if docs else None}"
          f" against vLLM's {expect:.6f}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="moebalance-live-") as name:
        tmp = Path(name)
        dumps = tmp / "dumps"
        dumps.mkdir()
        sglang_dumps(dumps)
        written = sorted(dumps.glob("expert_distribution_recorder_*.pt"))
        check(len(written) == 2, f"SGLang's recorder wrote {len(written)} stat dumps")
        prometheus_checks(tmp, dumps)
        vllm_checks(tmp)
    print(f"{len(FAILED)} check(s) failed" if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
