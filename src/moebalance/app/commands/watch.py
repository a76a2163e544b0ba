"""``moebalance watch``: follow a folder of an engine's routing records, export balance metrics, and re-plan when
the move pays (docs/design.md, "Watching a running engine"; the decisions: :mod:`moebalance.online.watch`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.app import deployment, options
from moebalance.app.advise import DEFAULT_MARGIN
from moebalance.app.console import err, out
from moebalance.core.errors import InputError, MoebalanceError
from moebalance.core.io import atomic_path
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.engines import open_load
from moebalance.engines.registry import ENGINES
from moebalance.engines.sglang import plan_from_map, read_dumps
from moebalance.online.rearrange import DEFAULT_OVERHEAD_MS, REARRANGE_MODES, Replanning
from moebalance.online.watch import Observation, WatchConfig, Watcher
from moebalance.pricing.step import StepPricing

__all__ = ["add_parser", "run"]

#: File names a record may have (SGLang's stat dumps, moebalance loads).
RECORD_SUFFIXES = (".pt", ".npz", ".json")
#: Polls a record that fails to read is retried before it is skipped for good (it may be half-written).
RETRIES = 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser("watch", help="follow an engine's routing records: balance metrics, and re-plans when the "
                                     "move pays")
    p.add_argument("records", help="folder the engine writes its records to: SGLang stat dumps, TensorRT-LLM "
                                   "statistics folders, the vLLM plug-in's records, moebalance loads")
    options.add_cluster(p)
    options.add_budget(p)
    p.add_argument("--policy", default="eplb", help="the policy a re-plan runs (default eplb)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="policy option")
    p.add_argument("--model", help="the model the records are of (default: from their shape)")
    p.add_argument("--placement", help="the placement the engine serves (its file); default: the plan watch last "
                                       "wrote (--write-plan), else contiguous blocks")
    p.add_argument("--window", type=options.positive, default=8, help="records in the rolling window (default 8)")
    p.add_argument("--horizon", type=options.positive_float, default=600.0,
                   help="seconds of serving a re-plan must pay back within (default 600)")
    p.add_argument("--margin", type=options.non_negative_float, default=DEFAULT_MARGIN,
                   help=f"a re-plan must serve this share more tokens over the horizon (default {DEFAULT_MARGIN}, "
                        "advise's)")
    p.add_argument("--migration", choices=("fresh", "aligned", "bounded"), default="aligned",
                   help="how a re-plan is laid onto the placement in service (default aligned)")
    p.add_argument("--max-moves", type=options.positive, help="copies one GPU may receive per re-plan (bounded)")
    p.add_argument("--rearrange", choices=REARRANGE_MODES, default="async",
                   help="sync: serving stops while experts move; async (the default): it goes on with the old plan")
    p.add_argument("--rearrange-overhead-ms", type=options.non_negative_float, default=DEFAULT_OVERHEAD_MS,
                   help=f"host time a synchronous re-plan exposes besides its transfer (default {DEFAULT_OVERHEAD_MS:g})")
    deployment.add(p, gpu_required=False)
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="the steps a record's routing is priced as (default decode)")
    p.add_argument("--write-plan", help="write the engine's file for each re-plan here (atomically)")
    p.add_argument("--engine", choices=sorted(ENGINES), default="sglang",
                   help="the engine whose file --write-plan writes (default sglang)")
    p.add_argument("--on-replan", help="a command run after each re-plan is written (its path in $MOEBALANCE_PLAN)")
    p.add_argument("--dry-run", action="store_true", help="decide and log, write nothing")
    p.add_argument("--log", help="JSON lines of every record and decision; watch resumes from it when restarted")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--dashboard", type=int, metavar="PORT",
                   help="serve a page that refreshes itself: balance per layer over the records, tokens/s now and "
                        "after a re-plan, the decisions, the hottest experts")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the metrics and dashboard ports bind to (default localhost)")
    p.add_argument("--interval", type=options.positive_float, default=5.0,
                   help="seconds between looks at the folder (default 5)")
    p.add_argument("--sglang", metavar="URL",
                   help="an SGLang server (http://host:port) whose recorder watch starts, then asks for a dump before "
                        "each look; its SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR must be the records folder")
    p.add_argument("--once", action="store_true", help="process the records there now, then stop")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


@dataclass
class _Seen:
    """Records done (by name), and those failing to read with their (size, mtime) and tries."""

    done: set[str] = field(default_factory=set)
    failing: dict[str, tuple[tuple[int, float], int]] = field(default_factory=dict)
    last_mtime: float = -math.inf
    #: Records measured by earlier runs (the log's), so that a resumed run numbers its records on.
    measured: int = 0
    #: Every record seen before is gone from the folder while new ones came: the engine started over.
    wiped: bool = False
    #: The process id the vLLM plug-in's records name (another one: vLLM was restarted).
    pid: str | None = None


#: An SGLang per_pass or per_token dump of one rank: ``expert_distribution_recorder_{time}_{rank}.pt``.
PER_RANK = re.compile(r"^expert_distribution_recorder_(\d+(?:\.\d+)?)_(\d+)\.pt$")
#: A record of the vLLM plug-in: ``vllm-eplb-{ns}-{pid}.npz`` (its process id tells a restart).
VLLM_RECORD = re.compile(r"^vllm-eplb-\d+-(\d+)\.npz$")
#: Seconds within which the ranks' files of one per_pass/per_token dump are written (each rank names its file by
#: its own clock when the dump is asked for).
RANK_SPAN_S = 60.0


@dataclass(frozen=True)
class Record:
    """One record: a file, a TensorRT-LLM statistics folder, or the ranks' files of one SGLang per_pass/per_token
    dump (named after the first, without its rank)."""

    name: str
    paths: tuple[Path, ...]
    stamp: float
    size: int


def _stamp(path: Path) -> tuple[float, int]:
    """``(modification time, bytes)`` of a file, or of a TensorRT-LLM statistics folder's newest file and all."""
    if path.is_dir():
        files = [f.stat() for f in path.iterdir() if f.is_file()]
        return max((f.st_mtime for f in files), default=path.stat().st_mtime), sum(f.st_size for f in files)
    st = path.stat()
    return st.st_mtime, st.st_size


def _records(folder: Path, seen: _Seen, ranks: int) -> Iterator[Record]:
    """The folder's records not yet done, oldest first (by modification time, then name): record files, TensorRT-LLM
    statistics folders (``meta_info.json`` and the ranks' ``.safetensors``: one ``EXPERT_STATISTIC_PATH`` each), and
    SGLang per_pass/per_token dumps, ``ranks`` files each (one per rank, named within :data:`RANK_SPAN_S`; a dump
    whose ranks have not all written yet is not a record yet)."""
    try:
        entries = [p for p in folder.iterdir() if not p.name.startswith(".") and (
            (p.suffix in RECORD_SUFFIXES and p.is_file()) or (p.is_dir() and (p / "meta_info.json").is_file()))]
    except OSError as exc:
        raise InputError(f"cannot list {str(folder)!r}: {exc.strerror}") from None
    found: list[Record] = []
    per_rank: list[tuple[float, int, Path, float, int]] = []
    for p in entries:
        try:
            stamp, size = _stamp(p)
        except OSError:  # removed meanwhile
            continue
        m = PER_RANK.match(p.name)
        if m is not None:
            per_rank.append((float(m.group(1)), int(m.group(2)), p, stamp, size))
        else:
            found.append(Record(p.name, (p,), stamp, size))
    group: list[tuple[float, int, Path, float, int]] = []
    for item in [*sorted(per_rank), (math.inf, -1, folder, 0.0, 0)]:  # a sentinel closes the last group
        if group and (item[0] - group[0][0] > RANK_SPAN_S or item[1] in {g[1] for g in group} or item[1] < 0):
            if len(group) >= ranks:
                name = f"expert_distribution_recorder_{group[0][0]}"
                found.append(Record(name, tuple(g[2] for g in group), max(g[3] for g in group),
                                    sum(g[4] for g in group)))
            group = []
        if item[1] >= 0:
            group.append(item)
    present = {r.name for r in found}
    if seen.done and not seen.done & present and present:
        seen.wiped = True  # the folder was emptied and filled again
    seen.done.intersection_update(present)  # names of removed files need not be kept: memory stays flat
    for gone in [n for n in seen.failing if n not in present]:
        del seen.failing[gone]
    for r in sorted(found, key=lambda r: (r.stamp, r.name)):
        if r.name not in seen.done:
            yield r


def _load(record: Record, model: str | None) -> LoadMatrix:
    """A record as the engines' readers read it (the model named by ``model``, else by the shape where only one fits)."""
    if len(record.paths) > 1 or PER_RANK.match(record.paths[0].name):
        return read_dumps(record.paths[0].parent, model=model, files=list(record.paths))
    return open_load(record.paths[0], model=model).load


def _read(record: Record, model: str | None) -> np.ndarray:
    """A record's counts ``[L, E]``: its passes summed."""
    return _load(record, model).counts.sum(axis=0)


def _engine_map(path: Path) -> np.ndarray | None:
    """The placement a vLLM plug-in record says the engine serves after the call (``new_map [L, P]``), else None."""
    if path.suffix != ".npz":
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            return np.asarray(data["new_map"]) if "new_map" in data.files else None
    except (OSError, ValueError):
        return None


class _Metrics:
    """The Prometheus gauges and counters (README, "Watching a running engine", lists them with their units)."""

    def __init__(self, port: int, host: str, engine: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.engine = engine
        r, lab = self.registry, ["engine"]
        self.balancedness = Gauge("moebalance_layer_balancedness_ratio", "mean over max of GPU load, per MoE layer",
                                  ["engine", "layer"], registry=r)
        self.balancedness_mean = Gauge("moebalance_balancedness_ratio", "balancedness averaged over the MoE layers",
                                       lab, registry=r)
        self.drift = Gauge("moebalance_drift_ratio", "total variation between the window's expert shares and the "
                           "placement's planning shares", lab, registry=r)
        self.tokens = Gauge("moebalance_tokens_per_second", "modelled tokens per second", ["engine", "plan"],
                            registry=r)
        self.moved = Gauge("moebalance_replan_moved_bytes", "bytes the best re-plan would move", lab, registry=r)
        self.exposed = Gauge("moebalance_replan_exposed_seconds", "seconds the best re-plan would stall serving", lab,
                             registry=r)
        self.records = Counter("moebalance_records", "records processed", lab, registry=r)
        self.skipped = Counter("moebalance_records_skipped", "records that could not be read", lab, registry=r)
        self.replans = Counter("moebalance_replans", "re-plans decided", lab, registry=r)
        self.restarts = Counter("moebalance_engine_restarts", "engine restarts detected", lab, registry=r)
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=r)
        except OSError as exc:
            raise InputError(f"--metrics-port {port} on {host}: {exc.strerror}; give a free port") from None

    def record(self, o: Observation) -> None:
        e = self.engine
        self.records.labels(e).inc()
        for layer, b in enumerate(o.balancedness):
            if np.isfinite(b):
                self.balancedness.labels(e, str(layer)).set(float(b))
        finite = o.balancedness[np.isfinite(o.balancedness)]
        if finite.size:
            self.balancedness_mean.labels(e).set(float(finite.mean()))
        self.drift.labels(e).set(o.drift)
        if o.tokens_per_s_now is not None and o.tokens_per_s_replan is not None:
            self.tokens.labels(e, "current").set(o.tokens_per_s_now)
            self.tokens.labels(e, "replan").set(o.tokens_per_s_replan)
            self.moved.labels(e).set((o.moved_gib or 0.0) * 2**30)
            self.exposed.labels(e).set(o.exposed_s or 0.0)
        if o.decision == "replan":
            self.replans.labels(e).inc()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _sglang(url: str, endpoint: str) -> bool:
    """POST ``url/endpoint`` (SGLang's recorder endpoints); a server that does not answer is a warning, not an end:
    watch goes on with what the folder holds."""
    import urllib.error
    import urllib.request

    target = f"{url.rstrip('/')}/{endpoint}"
    try:
        with urllib.request.urlopen(urllib.request.Request(target, method="POST", data=b""), timeout=30) as reply:
            ok = 200 <= reply.status < 300
    except (urllib.error.URLError, OSError, ValueError) as exc:
        err.print(f"warning: {target}: {getattr(exc, 'reason', exc)}")
        return False
    if not ok:
        err.print(f"warning: {target} answered {reply.status}")
    return ok


def _append(log: Path | None, doc: dict[str, Any]) -> None:
    """One JSON line, flushed to disk before the next record: a crash leaves at most a partial last line, which
    :func:`_resume` ignores."""
    if log is None:
        return
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(doc, separators=(",", ":")) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _resume(log: Path | None) -> list[dict[str, Any]]:
    """The log's complete lines. A torn last line (a crash mid-write) is cut off the file first, atomically, so that
    the next line starts on a line of its own."""
    if log is None or not log.exists():
        return []
    data = log.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with atomic_path(log) as tmp:
            tmp.write_bytes(data)
        err.print(f"warning: {log}: dropped a torn last line (a crash while it was written)")
    lines = []
    for text in data.decode("utf-8", "replace").splitlines():
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            lines.append(doc)
    return lines


def _write(args: argparse.Namespace, plan: Placement, record: str) -> Path | None:
    """The engine's file for ``plan`` at ``--write-plan`` (atomically), and ``--on-replan``."""
    if args.write_plan is None or args.dry_run:
        return None
    dest = Path(args.write_plan)
    # each writer writes atomically (a temporary file, then a rename); vLLM's is the plan, which the plug-in takes
    ENGINES[args.engine].write_plan(dest, plan, args.model)
    if args.on_replan:
        env = {**os.environ, "MOEBALANCE_PLAN": str(dest), "MOEBALANCE_RECORD": record}
        done = subprocess.run(shlex.split(args.on_replan), env=env, check=False)
        if done.returncode != 0:
            err.print(f"warning: --on-replan exited with {done.returncode}")
    return dest


def run(args: argparse.Namespace) -> None:
    folder = Path(args.records)
    if not folder.is_dir():
        raise InputError(f"records folder {args.records!r} does not exist or is not a folder")
    if args.migration == "bounded" and args.max_moves is None:
        raise InputError("--migration bounded needs --max-moves M, the copies one GPU may receive per re-plan")
    if args.max_moves is not None and args.migration != "bounded":
        raise InputError("--max-moves is used only by --migration bounded; drop it or add --migration bounded")
    if args.sglang is not None and not args.sglang.startswith(("http://", "https://")):
        raise InputError(f"--sglang {args.sglang!r} must be the server's URL, like http://127.0.0.1:30000")
    cluster = options.cluster(args)
    budget = options.budget(args)
    params = options.resolve_set(args.set, [args.policy])[args.policy]
    log = Path(args.log) if args.log else None
    seen = _Seen()
    logged = _resume(log)
    seen.done = {d["record"] for d in logged if "record" in d}
    seen.last_mtime = max((float(d["mtime"]) for d in logged if isinstance(d.get("mtime"), int | float)),
                          default=-math.inf)
    measured = [d for d in logged if "balancedness" in d]
    seen.measured = len(measured)
    history = measured[-args.window:]  # what a resumed watcher needs, no more
    del logged, measured
    watcher: Watcher | None = None
    metrics = _Metrics(args.metrics_port, args.host, args.engine) if args.metrics_port is not None else None
    board = None
    if args.dashboard is not None:
        from moebalance.app.dashboard import Dashboard

        board = Dashboard(args.dashboard, args.host, f"moebalance watch: {folder.name}",
                          f"{cluster.num_nodes} x {cluster.gpus_per_node} GPUs, {args.policy} re-plans on the last "
                          f"{args.window} records, over {args.horizon:g} s of serving",
                          max(1, round(args.interval)))
    if args.sglang is not None:
        _sglang(args.sglang, "start_expert_distribution_record")
    try:
        while True:
            if args.sglang is not None:
                _sglang(args.sglang, "dump_expert_distribution_record")
            for record in _records(folder, seen, cluster.num_gpus):
                watcher = _one(args, record, seen, watcher, cluster, budget, params, log, metrics, history, board)
            if args.once:
                break
            time.sleep(args.interval)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C: the record in hand is either logged whole or not at all
        err.print("watch stopped")
    finally:
        if metrics is not None:
            metrics.close()
        if board is not None:
            board.close()


def _one(args: argparse.Namespace, record: Record, seen: _Seen, watcher: Watcher | None, cluster: Any, budget: Any,
         params: dict[str, Any], log: Path | None, metrics: _Metrics | None,
         history: list[dict[str, Any]], board: Any = None) -> Watcher | None:
    """Read, observe, decide and log one record; a record that fails to read is retried, then skipped."""
    name, stamp, size = record.name, record.stamp, record.size
    try:
        load = _load(record, args.model)
    except (MoebalanceError, OSError) as exc:  # half-written while the engine writes it, or not a record
        key = (int(size), float(stamp))
        previous = seen.failing.get(name)
        tries = 1 if previous is None or previous[0] != key else previous[1] + 1
        seen.failing[name] = (key, tries)
        limit = 1 if args.once else RETRIES  # --once: nothing is being written any more
        if tries >= limit:
            seen.done.add(name)
            _append(log, {"record": name, "skipped": str(exc)})
            if metrics is not None:
                metrics.skipped.labels(args.engine).inc()
        err.print(f"warning: {name}: {exc}" + (" (skipped)" if tries >= limit else " (retrying)"))
        return watcher
    counts = load.counts.sum(axis=0)  # the record's passes summed
    if watcher is None:  # the model: --model, else the one the records' shape names alone
        watcher = _watcher(args, counts, cluster, budget, params, folder=record.paths[0].parent, history=history,
                           measured=seen.measured, model=args.model or load.preset)
    pid = m.group(1) if (m := VLLM_RECORD.match(name)) else None
    why = ("an older record after newer ones" if stamp < seen.last_mtime else
           "every earlier record is gone from the folder" if seen.wiped else
           f"the plug-in's records now come from process {pid}, not {seen.pid}"
           if pid is not None and seen.pid is not None and pid != seen.pid else None)
    seen.wiped = False
    seen.pid = pid or seen.pid
    if why is not None:  # the engine started over: its counters, and the window, start again
        watcher.reset()
        _append(log, {"record": name, "restart": why})
        err.print(f"note: {name}: the engine restarted ({why}); the window starts again")
        if metrics is not None:
            metrics.restarts.labels(args.engine).inc()
    seen.last_mtime = max(seen.last_mtime, stamp)
    engine_map = _engine_map(record.paths[0]) if len(record.paths) == 1 else None
    if engine_map is not None:  # vLLM re-planned on this window itself: its map is the placement in service
        watcher.plan = plan_from_map(engine_map, cluster, counts.shape[1], source=name, policy="vllm")
        watcher.planned_on, watcher.planned_records = counts.astype(np.int64), [name]
    o = watcher.observe(counts, name)
    written = None
    if o.decision == "replan" and o.plan is not None:
        written = _write(args, o.plan, name)
        watcher.adopt(o.plan)
    doc = {**o.as_dict(), "planned_on": watcher.planned_records, "written": None if written is None else str(written),
           "mtime": stamp, "time": time.time()}
    _append(log, doc)
    seen.done.add(name)
    if metrics is not None:
        metrics.record(o)
    if board is not None:
        board.add(o)
    out.print(_line(o), markup=False)
    return watcher


def _watcher(args: argparse.Namespace, counts: np.ndarray, cluster: Any, budget: Any, params: dict[str, Any], *,
             folder: Path, history: list[dict[str, Any]], measured: int = 0, model: str | None = None) -> Watcher:
    """The watcher for the records' shape: its pricing (with ``--gpu``), the placement in service, and, when resumed,
    the window of the records the log names last."""
    probe = LoadMatrix(counts[None], preset=model)
    pricing = None
    if args.gpu is not None:
        if model is None:
            raise InputError("watch prices with --gpu for a model, and the records' shape names none alone: give "
                             "--model (e.g. --model deepseek-v3)")
        pricing = StepPricing(deployment=deployment.build(args, probe), phase=args.phase)
    else:
        deployment.refuse(args, "with --gpu (re-plans are priced)")
    how = Replanning(migration=args.migration, max_moves=args.max_moves, rearrange=args.rearrange,
                     overhead_ms=args.rearrange_overhead_ms)
    config = WatchConfig(cluster=cluster, budget=budget, policy=args.policy, params=params, window=args.window,
                         horizon_s=args.horizon, margin=args.margin, replanning=how, pricing=pricing, seed=args.seed)
    plan = None
    if args.placement is not None:
        plan = options.read_plan(argparse.Namespace(plan=args.placement, nodes=args.nodes,
                                                    gpus_per_node=args.gpus_per_node), probe)
    elif args.write_plan is not None and Path(args.write_plan).exists() and not args.dry_run:
        plan = options.read_plan(argparse.Namespace(plan=args.write_plan, nodes=args.nodes,
                                                    gpus_per_node=args.gpus_per_node), probe)
    watcher = Watcher(config, plan)
    if history:  # resumed: the window as it was, and the records its placement was planned on
        watcher.seen = measured
        for doc in history:
            again = _reread(folder, doc["record"], args.model)
            if again is not None:
                watcher.push(again, doc["record"])
        planned = [c for c in (_reread(folder, n, args.model) for n in history[-1].get("planned_on") or [])
                   if c is not None]
        if planned:
            watcher.planned_on = np.sum(np.stack(planned), axis=0)
            watcher.planned_records = list(history[-1]["planned_on"])
    return watcher


def _reread(folder: Path, name: str, model: str | None) -> np.ndarray | None:
    """A record read again on resume, by its logged name; ``None`` where it is gone or unreadable (the window is then
    shorter)."""
    path = folder / name
    try:
        if path.exists():
            return _read(Record(name, (path,), 0.0, 0), model)
        ranks = sorted(p for p in folder.glob(f"{name}_*.pt") if PER_RANK.match(p.name))  # a per-rank dump
        return _read(Record(name, tuple(ranks), 0.0, 0), model) if ranks else None
    except (MoebalanceError, OSError):
        return None


def _line(o: Observation) -> str:
    bal = o.balancedness[np.isfinite(o.balancedness)]
    head = f"{o.record}: balancedness {bal.mean():.3f} (min {bal.min():.3f}), drift {o.drift:.3f}" if bal.size else \
        f"{o.record}: no load"
    if o.tokens_per_s_now is None:
        return head
    return (f"{head}; {o.tokens_per_s_now:,.0f} tokens/s now, {o.tokens_per_s_replan:,.0f} after a re-plan moving "
            f"{o.moved_gib:.1f} GiB: {o.decision} ({o.reason})")


