"""One GPU, one command: calibrate the cost model, check modelled straggler times against measured ones, run the
runtime's CUDA paths and time the device-side planner. Writes everything to one folder (``--out``, default
``$OUT``), which ``bench/gpu_report.py`` turns into ``docs/results/gpu.md``.

Sections, each in its own process with a time budget (a section that fails or runs over records why in
``env.json`` and the next one still runs):

1. ``gemm``: grouped-GEMM time against tokens per expert (``bench/bench_gemm.py``: 1 to 64 experts touched, 1 to
   4,096 tokens per expert) for the routed experts of DeepSeek-V3 (H 7168, F 2048), Qwen3-30B-A3B (2048, 768) and
   DeepSeek-V2-Lite (2048, 1408), bf16, with both kernels that run here (``grouped_mm``: ragged groups;
   ``bmm``: padded); ``moebalance calibrate`` fits the cost model on the ``grouped_mm`` runs (``bmm`` where it
   does not run) for the GPU's spec (``h100-80gb`` or ``h200``, from the device's name).
2. ``straggler``: "expert parallelism on one GPU". For plans (contiguous, EPLB, CRAFT; Libra with the batch's
   true routing and the ``rebalance`` router) on the bundled real routing (``bundled:esft-law``, DeepSeek-V2-Lite,
   8 GPUs) and a synthetic DeepSeek-V3 trace (``moebalance.workloads.synth``, 32 GPUs, a prefill-sized batch and a
   decode-sized subsample of it), the router gives every virtual GPU its picks per expert
   (``Router.assign_tokens``); each GPU's grouped GEMM runs one after another on the one real GPU, and the slowest
   is the layer's measured straggler time, beside the modelled one (``cost.time.expert_seconds`` with the
   published peaks and with section 1's calibration).
3. ``runtime``: the expert-parallel layer (``runtime/ep.py``) on CUDA with NCCL and one rank, and with two gloo
   ranks whose experts share the GPU (static plans under several routers, two-stage execution, per-batch plans
   with the prefetch buffer), against the dense reference; ``moebalance run`` under a torchrun environment
   (one rank, NCCL) on the bundled model.
4. ``planner``: Libra's CPU planner (prefetch phases and the ``rebalance`` router) per layer at 64 GPUs x 256
   experts, and the device exact planner (``moebalance.algorithms.exact_device.plan``) on CUDA on the same sizes.

Files (at most eight): ``gemm.csv``, ``calibration.json``, ``straggler.csv`` (one row per workload, regime, plan,
batch and layer), ``straggler_gpus.csv`` (one row per virtual GPU of those), ``runtime.json``, ``planner.json``,
``env.json`` (device, versions, each section's status, seconds and error), ``log.txt``.

Without CUDA (or with ``--cpu``) every section runs on the CPU with small expert sizes and fewer points: nothing
is calibrated, but every code path except the CUDA-only ones runs (``tests/test_gpu_check.py``).

Run on the GPU machine: ``bash bench/gpu_check.sh`` (the device's python, ``PYTHONPATH=src``); here:
``.venv/bin/python bench/gpu_check.py --out /tmp/gpu-check --cpu``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
try:  # an installed moebalance, else the source tree (the GPU machine runs it with PYTHONPATH=src)
    import moebalance  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from moebalance.core.io import atomic_path, atomic_write_text, dumps, remove_stale_temporaries  # noqa: E402

SECTIONS = ("gemm", "straggler", "runtime", "planner")
#: Seconds each section may take on a GPU: its loops stop there and keep what they have; a section still running
#: 10% (plus ``--grace`` seconds) later is stopped. About 6 minutes in all at most, 3 to 4 expected.
BUDGETS = {"gemm": 70.0, "straggler": 150.0, "runtime": 100.0, "planner": 50.0}
FILES = ("gemm.csv", "calibration.json", "straggler.csv", "straggler_gpus.csv", "runtime.json", "planner.json",
         "env.json", "log.txt")
STRAGGLER_COLUMNS = ("workload", "regime", "plan", "router", "batch", "layer", "gpus", "picks", "measured_s",
                     "modelled_uncal_s", "modelled_cal_s", "measured_gpu", "modelled_gpu")
GPU_COLUMNS = ("workload", "regime", "plan", "router", "batch", "layer", "gpu", "picks", "touched",
               "max_tokens_per_expert", "measured_s", "modelled_uncal_s", "modelled_cal_s")
#: Distributions moebalance depends on (pyproject.toml), for env.json: which ones the machine has, at which version.
PACKAGES = ("numpy", "torch", "numba", "scipy", "rich", "matplotlib", "PyYAML", "safetensors", "threadpoolctl",
            "scikit-learn", "highspy")


# ---------------------------------------------------------------- small helpers
def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


# Files are written through ``moebalance.core.io``'s atomic writers: a process stopped mid-write leaves no partial
# file. Its temporary lies in the output folder (of which only eight files come back) until the rename; a section
# stopped from outside is followed by :func:`remove_stale_temporaries` on the eight names (``run_section_child``).
def write_json(path: Path, doc: Any) -> None:
    """``doc`` as the package's JSON (``moebalance.core.io.dumps``: numpy values as the numbers they hold)."""
    atomic_write_text(path, dumps(doc))


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        for r in rows:
            w.writerow([_cell(r.get(c)) for c in columns])


def _cell(v: Any) -> Any:
    if isinstance(v, float | np.floating):
        return "" if not math.isfinite(float(v)) else f"{float(v):.9g}"
    return "" if v is None else v


class Clock:
    """Seconds since start, and a deadline after which loops stop and keep what they have."""

    def __init__(self, budget: float) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def expired(self) -> bool:
        return time.monotonic() > self.deadline


def make_log(clock: Clock, path: Path | None) -> Callable[[str], None]:
    def log(msg: str) -> None:
        line = f"[{clock.elapsed():7.1f}s] {msg}"
        print(line, flush=True)
        if path is not None:
            with open(path, "a") as fh:
                fh.write(line + "\n")
    return log


@dataclasses.dataclass(frozen=True)
class Setup:
    """Sizes of every section: the real ones on a GPU, small ones on the CPU (a check of the code only)."""

    cuda: bool
    gemm_shapes: tuple[str, ...]
    gemm_experts: tuple[int, ...]
    gemm_tokens: tuple[int, ...]
    runs: int
    #: ``None``: each workload's real expert size; else ``(H, F)`` for every workload (CPU mode).
    expert_size: tuple[int, int] | None
    v3_tokens: int
    v3_decode_tokens: int
    v3_plan_batches: int
    measure_batches: int
    layers_per_point: int
    libra_n: int
    planner_gpus: int
    planner_experts: int
    planner_tokens_per_gpu: int
    planner_repeats: int
    #: The runtime section's cases: all, or a few covering each path (``--quick``).
    runtime_quick: bool = False

    @staticmethod
    def make(cuda: bool, quick: bool = False) -> Setup:
        """The sizes for a GPU, for the CPU (every path, small), or ``quick`` (the CPU, smallest: the tests)."""
        if cuda:
            # rows per expert on both sides of the 128-row tile boundaries, where a kernel's time steps
            return Setup(True, ("deepseek-v3", "qwen3-30b-a3b", "deepseek-v2-lite"), (1, 8, 32, 64),
                         (1, 4, 16, 64, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1024, 4096), 5, None, 16384, 512, 2, 2, 8, 2, 64, 256, 8192, 20)
        if quick:
            return Setup(False, ("128x64",), (1, 4), (1, 8), 1, (64, 32), 256, 64, 2, 1, 1, 2, 8, 64, 64, 2,
                         runtime_quick=True)
        return Setup(False, ("256x128", "128x64"), (1, 4), (1, 8, 64), 2, (128, 64), 1024, 128, 2, 1, 2, 2,
                     8, 64, 256, 3)


@dataclasses.dataclass
class Ctx:
    """What a section gets: the output folder, the device, sizes, a clock with its deadline and a log."""

    out: Path
    setup: Setup
    clock: Clock
    log: Callable[[str], None]
    device: Any = None
    dtype: Any = None
    gpu_spec: str | None = None


# ---------------------------------------------------------------- device description
def describe_device(cuda: bool) -> dict[str, Any]:
    """The device's name, the cost model's spec for it, versions of what the sections import."""
    from importlib import metadata

    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                            "executable": sys.executable, "cpus": os.cpu_count(), "versions": {}, "missing": []}
    for name in PACKAGES:
        try:
            info["versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # a missing package is a fact to report, not a failure
            info["missing"].append(name)
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = bool(torch.cuda.is_available())
        if cuda and torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["device_name"] = torch.cuda.get_device_name(0)
            info["capability"] = list(torch.cuda.get_device_capability(0))
            info["memory_gib"] = round(p.total_memory / 2**30, 1)
            info["multiprocessors"] = p.multi_processor_count
            try:
                v = torch.cuda.nccl.version()
                info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple | list) else str(v)
            except Exception as exc:
                info["nccl"] = one_line(exc)
        else:
            info["device_name"] = "CPU (" + (platform.processor() or platform.machine()) + ")"
    except Exception as exc:
        info["torch_error"] = one_line(exc)
    info["gpu_spec"] = gpu_spec_for(info.get("device_name", ""))
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                            timeout=10).stdout.strip() or None
    except Exception:
        info["git_commit"] = None
    return info


def gpu_spec_for(device_name: str) -> str | None:
    """The cost model's GPU spec (``cost/hardware.py``) for a CUDA device name, ``None`` if it has none."""
    name = device_name.upper()
    for key, spec in (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"), ("B200", "b200"),
                      ("4090", "rtx4090")):
        if key in name:
            return spec
    return None


# ---------------------------------------------------------------- section 1: grouped GEMM and calibration
def section_gemm(ctx: Ctx) -> dict[str, Any]:
    import bench_gemm as bg

    from moebalance.app.cli import main as cli_main
    from moebalance.cost.calibrate import Measurements, fit
    from moebalance.cost.hardware import get_gpu

    s = ctx.setup
    usable, why = bg.usable_kernels(ctx.device, ctx.dtype)
    ctx.log(f"kernels that run here: {sorted(usable)}; not: {why}")
    result: dict[str, Any] = {"kernels": {k: dataclasses.asdict(v) for k, v in usable.items()},
                              "kernels_refused": why}
    if not usable:
        raise RuntimeError(f"no grouped-GEMM kernel runs here: {why}")
    primary = next(k for k in bg.KERNELS if k in usable)
    result["primary_kernel"] = primary
    rows: list[dict[str, Any]] = []
    truncated = False
    for name in s.gemm_shapes:
        shape = bg.preset_shape(name)
        got, truncated = bg.measure_grid([shape], s.gemm_experts, s.gemm_tokens, usable, ctx.device, ctx.dtype,
                                         s.runs, deadline=ctx.clock.deadline, log=ctx.log)
        rows += got
        bg.write_rows(str(ctx.out / "gemm.csv"), rows)
        if truncated:
            break
    result["rows"] = len(rows)
    result["truncated"] = truncated
    spec = ctx.gpu_spec or "h100-80gb"
    result["gpu_spec"] = spec
    result["gpu_spec_assumed"] = ctx.gpu_spec is None
    # the calibration, written by the command users run, from the primary kernel's runs of every shape
    sel = [r for r in rows if r["kernel"] == primary]
    if not sel:
        raise RuntimeError("no runs of the primary kernel were measured")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        measured = Path(tmp) / f"gemm_{primary}.csv"
        bg.write_rows(str(measured), sel)
        rc = cli_main(["calibrate", "--measurements", str(measured), "--gpu", spec,
                       "--out", str(ctx.out / "calibration.json")])
    result["calibrate_exit_code"] = rc
    if rc != 0:
        raise RuntimeError(f"moebalance calibrate exited with {rc}")
    # fits per kernel and shape (and per kernel over all shapes), for the report
    gpu = get_gpu(spec)
    fits: dict[str, Any] = {}
    for kernel in usable:
        for shape_name in [None, *s.gemm_shapes]:
            part = [r for r in rows if r["kernel"] == kernel and (shape_name is None or r["shape"] == shape_name)]
            if not part:
                continue
            m = Measurements(**{c: np.array([float(r[c]) for r in part]) for c in
                                ("experts", "tokens_per_expert", "hidden_size", "ffn_size", "seconds")})
            cal, err, (by_flops, by_memory) = fit(m, gpu, source=f"{kernel} {shape_name or 'all shapes'}")
            fits[f"{kernel}/{shape_name or 'all'}"] = {
                "flops_efficiency": cal.flops_efficiency, "bandwidth_efficiency": cal.bandwidth_efficiency,
                "launch_us": cal.launch_us, "mean_abs_log_error": err, "bound_by_flops": by_flops,
                "bound_by_memory": by_memory, "runs": len(part)}
    result["fits"] = fits
    return result


# ---------------------------------------------------------------- section 2: straggler time of plans
@dataclasses.dataclass
class Workload:
    name: str
    load: Any  # LoadMatrix
    model: Any  # ModelSpec (expert size possibly scaled down)
    cluster: Any  # Cluster
    plan_batches: int
    #: ``(regime, tokens kept per measured batch or None for all)``.
    regimes: list[tuple[str, int | None]]


def _workloads(ctx: Ctx) -> list[Workload]:
    from moebalance.core.cluster import Cluster
    from moebalance.core.load import LoadMatrix, read_load
    from moebalance.models import get_model
    from moebalance.workloads.synth import synthesize

    s = ctx.setup

    def sized(model: Any) -> Any:
        if s.expert_size is None:
            return model
        return dataclasses.replace(model, hidden_size=s.expert_size[0], moe_intermediate_size=s.expert_size[1])

    out = []
    law = read_load("bundled:esft-law")
    out.append(Workload("esft-law", law, sized(get_model(law.preset or "deepseek-v2-lite")),
                        Cluster(num_nodes=1, gpus_per_node=8), law.num_batches // 2, [("real", None)]))
    t0 = time.perf_counter()
    arrays = synthesize("deepseek-v3", num_batches=s.v3_plan_batches + s.measure_batches, tokens_per_batch=s.v3_tokens,
                        num_gpus=32, seed=0, token_level=True)
    ctx.log(f"synthetic DeepSeek-V3 trace: {s.v3_plan_batches + s.measure_batches} batches x {s.v3_tokens} tokens in "
            f"{time.perf_counter() - t0:.1f} s")
    v3 = LoadMatrix.from_arrays(arrays, source="synth deepseek-v3")
    out.append(Workload("deepseek-v3-synth", v3, sized(get_model("deepseek-v3")), Cluster(num_nodes=4, gpus_per_node=8),
                        s.v3_plan_batches, [("prefill", None), ("decode", s.v3_decode_tokens)]))
    return out


def _points(trace: Any, batch: int, keep: int | None) -> Any:
    """Batch ``batch`` of ``trace`` renumbered as batch 0; with ``keep``, every ``T // keep``-th token of it (so
    every source GPU keeps its share)."""
    from moebalance.core.trace import RoutingTrace

    sub = trace.select_batches(batch, batch + 1)
    if keep is None or keep >= sub.num_tokens:
        return sub
    idx = np.arange(0, sub.num_tokens, sub.num_tokens // keep)[:keep]
    return RoutingTrace(np.ascontiguousarray(sub.topk_ids[idx]), sub.src_gpu[idx], np.zeros(idx.size, np.int64),
                        num_experts=sub.num_experts, num_batches=1)


def _plans(wl: Workload, ctx: Ctx) -> tuple[dict[str, Any], Any]:
    """Static plans by name, made on the planning batches, and the Libra base plan (contiguous)."""
    from moebalance.policies import Budget, make_plan

    E, G = wl.load.num_experts, wl.cluster.num_gpus
    warm = wl.load.select_batches(0, wl.plan_batches)
    base = E // G
    plans = {}
    for name, slots in (("contiguous", base), ("eplb", base + 1), ("craft", base + 1)):
        t0 = time.perf_counter()
        plans[name] = make_plan(name, warm, wl.cluster, Budget(slots_per_gpu=slots))[0]
        ctx.log(f"{wl.name}: {name} plan ({slots} slots per GPU) in {time.perf_counter() - t0:.1f} s, "
                f"{plans[name].extra_replicas} extra replicas")
    return plans, plans["contiguous"]


def straggler_jobs(wl: Workload, ctx: Ctx) -> tuple[list[tuple[str, int, int, str, str, np.ndarray]], dict[str, Any],
                                                    list[int], list[int]]:
    """The straggler section's points of one workload, all computed on the CPU from seeded generators (so that
    ``bench/straggler_points.py`` rebuilds the committed run's): ``(jobs, plans, measured batches, layers)``, a job
    being ``(regime, batch, layer, plan name, router, picks int64 [G, E])`` for every regime, measured batch, plan
    (and Libra's batch plan with ``rebalance``) and chosen layer."""
    from moebalance.policies.libra import LibraConfig, batch_plan
    from moebalance.prediction.predictors import make_predictor
    from moebalance.routing import get_router

    s = ctx.setup
    trace = wl.load.trace
    E, G, L = wl.load.num_experts, wl.cluster.num_gpus, wl.load.num_layers
    libra = LibraConfig(predictor="oracle", n=s.libra_n)
    oracle = make_predictor("oracle")
    plans, base = _plans(wl, ctx)
    measured_batches = list(range(wl.plan_batches, wl.load.num_batches))[:s.measure_batches]
    layers = sorted({int(x) for x in np.linspace(0, L - 1, s.layers_per_point).round()})
    jobs = []
    for regime, keep in wl.regimes:
        for b in measured_batches:
            sub = _points(trace, b, keep)
            variants = [(name, p, "uniform") for name, p in plans.items()]
            demand = oracle.predict(sub, 0, G).demand
            variants.append(("libra", batch_plan(base, demand, libra)[0], "rebalance"))
            for name, plan, router in variants:
                dest = get_router(router).assign_tokens(plan, sub, np.random.default_rng((0, b)))
                for layer in layers:
                    flat = dest[:, layer, :].astype(np.int64).ravel() * E + sub.topk_ids[:, layer, :].ravel()
                    picks = np.bincount(flat, minlength=G * E).reshape(G, E)
                    jobs.append((regime, b, layer, name, router, picks))
    return jobs, plans, measured_batches, layers


def section_straggler(ctx: Ctx) -> dict[str, Any]:
    import bench_gemm as bg
    import torch

    from moebalance.cost.hardware import get_gpu
    from moebalance.cost.time import Calibration, expert_seconds
    from moebalance.policies.libra import LibraConfig

    s = ctx.setup
    usable, why = bg.usable_kernels(ctx.device, ctx.dtype)
    if not usable:
        raise RuntimeError(f"no grouped-GEMM kernel runs here: {why}")
    kernel = next(k for k in bg.KERNELS if k in usable)
    spec = ctx.gpu_spec or "h100-80gb"
    gpu = get_gpu(spec)
    cal = None
    cal_path = ctx.out / "calibration.json"
    if cal_path.is_file():
        doc = json.loads(cal_path.read_text())
        fields = {f.name for f in dataclasses.fields(Calibration)}  # the file also records the fit's error
        cal = Calibration(**{k: v for k, v in doc.items() if k in fields})
    result: dict[str, Any] = {"kernel": kernel, "gpu_spec": spec, "calibration": None if cal is None else
                              dataclasses.asdict(cal), "workloads": {}}
    ctx.log(f"kernel {kernel}; calibration: {'none (section gemm wrote none)' if cal is None else cal}")
    rows: list[dict[str, Any]] = []
    gpu_rows: list[dict[str, Any]] = []
    truncated = False
    libra = LibraConfig(predictor="oracle", n=s.libra_n)  # as straggler_jobs plans Libra, for the record
    for wl in _workloads(ctx):
        E, G = wl.load.num_experts, wl.cluster.num_gpus
        jobs, plans, measured_batches, layers = straggler_jobs(wl, ctx)
        max_u = max(int((j[5] > 0).sum(axis=1).max()) for j in jobs)
        max_n = max(int(j[5].sum(axis=1).max()) for j in jobs)
        H, F = wl.model.hidden_size, wl.model.moe_intermediate_size
        ctx.log(f"{wl.name}: {len(jobs)} (regime, batch, plan, layer) points on {G} GPUs; up to {max_u} experts and "
                f"{max_n} picks on a GPU; H {H}, F {F}")
        layout = usable[kernel]
        pool = bg.WeightPool(max_u, H, F, ctx.device, ctx.dtype, transposed=layout.transposed)
        x_pool = torch.randn(max_n + 1, H, device=ctx.device, dtype=ctx.dtype)
        if kernel == "bmm":  # padded: room for every expert at the largest count
            x_pool = torch.randn(max_u * int(max(j[5].max() for j in jobs)), H, device=ctx.device, dtype=ctx.dtype)
        # order: regime, batch, layer, plan: a deadline leaves every plan measured on the first points
        jobs.sort(key=lambda j: (j[0], j[1], j[2], list(plans).index(j[3]) if j[3] in plans else len(plans)))
        done = 0
        for regime, b, layer, name, router, picks in jobs:
            if ctx.clock.expired():
                truncated = True
                break
            n_g = picks.sum(axis=1)
            u_g = (picks > 0).sum(axis=1)
            measured = np.zeros(G)
            for g in range(G):
                tokens = [int(t) for t in picks[g][picks[g] > 0]]
                if not tokens:
                    continue
                run = bg.RaggedRun(kernel, tokens, x_pool, pool.take(len(tokens)), pad_row=layout.pad_row)

                def once(run: Any = run, u: int = len(tokens), pool: Any = pool) -> None:
                    run.weights = pool.take(u)  # experts the last runs did not touch: none of them cached
                    run()

                measured[g] = bg.median_seconds(once, ctx.device, s.runs)
            uncal = expert_seconds(picks, wl.model, gpu)
            withcal = expert_seconds(picks, wl.model, gpu, cal) if cal is not None else np.full(G, np.nan)
            key = {"workload": wl.name, "regime": regime, "plan": name, "router": router, "batch": b, "layer": layer}
            for g in range(G):
                gpu_rows.append({**key, "gpu": g, "picks": int(n_g[g]), "touched": int(u_g[g]),
                                 "max_tokens_per_expert": int(picks[g].max()), "measured_s": measured[g],
                                 "modelled_uncal_s": float(uncal[g]), "modelled_cal_s": float(withcal[g])})
            rows.append({**key, "gpus": G, "picks": int(n_g.sum()), "measured_s": float(measured.max()),
                         "modelled_uncal_s": float(uncal.max()), "modelled_cal_s": float(np.max(withcal)),
                         "measured_gpu": int(measured.argmax()),
                         "modelled_gpu": int((uncal if cal is None else withcal).argmax())})
            done += 1
            if done % 16 == 0:  # a section stopped from outside keeps what it measured
                write_csv(ctx.out / "straggler.csv", STRAGGLER_COLUMNS, rows)
                write_csv(ctx.out / "straggler_gpus.csv", GPU_COLUMNS, gpu_rows)
        write_csv(ctx.out / "straggler.csv", STRAGGLER_COLUMNS, rows)
        write_csv(ctx.out / "straggler_gpus.csv", GPU_COLUMNS, gpu_rows)
        result["workloads"][wl.name] = {"gpus": G, "experts": E, "layers": layers, "batches": measured_batches,
                                        "regimes": [r for r, _ in wl.regimes], "points": len(jobs), "measured": done,
                                        "hidden_size": H, "ffn_size": F, "plans": {
                                            n: {"extra_replicas": p.extra_replicas,
                                                "max_slots_per_gpu": p.max_slots_per_gpu} for n, p in plans.items()},
                                        "libra": {"n": libra.n, "alpha": libra.alpha, "base": "contiguous",
                                                  "predictor": "oracle", "router": "rebalance"}}
        ctx.log(f"{wl.name}: measured {done} of {len(jobs)} points")
        del pool, x_pool
        if truncated:
            break
    result["truncated"] = truncated
    return result


# ---------------------------------------------------------------- section 3: the runtime on CUDA
RT_E, RT_H, RT_F, RT_K, RT_L, RT_SEED = 16, 64, 32, 2, 2, 5
RT_TOKENS = {1: [40], 2: [24, 17]}


def _rt_inputs(world_size: int, batch: int = 0) -> Any:
    import torch

    g = torch.Generator().manual_seed(RT_SEED * 100 + 10 * world_size + batch)
    return torch.randn(sum(RT_TOKENS[world_size]), RT_H, generator=g)


def _rt_layers() -> tuple[list[Any], list[Any]]:
    """Gates ``[H, E]`` and experts of ``RT_L`` layers (float32, seeded: the same in every process)."""
    import torch

    from moebalance.runtime import random_experts

    g = torch.Generator().manual_seed(RT_SEED)
    gates = [torch.randn(RT_H, RT_E, generator=g) for _ in range(RT_L)]
    return gates, [random_experts(RT_E, RT_H, RT_F, seed=RT_SEED + li) for li in range(RT_L)]


def _rt_plans(world_size: int) -> dict[str, Any]:
    """Plans of ``RT_L`` layers for ``world_size`` GPUs on one node: contiguous, and one with replicas."""
    from moebalance.core.cluster import Cluster
    from moebalance.core.plan import Placement

    G = world_size
    per = RT_E // G
    cont = [[list(range(g * per, (g + 1) * per)) for g in range(G)] for _ in range(RT_L)]
    rep = [[[*row, (g * per + per + li) % RT_E] for g, row in enumerate(layer)] for li, layer in enumerate(cont)]
    cluster = Cluster(num_nodes=1, gpus_per_node=G)
    return {"contiguous": Placement(cont, RT_E, cluster, policy="contiguous"),
            "replicas": Placement(rep, RT_E, cluster, policy="replicas")}


def _rt_batch_plans(world_size: int, batches: int) -> list[Any]:
    """Per-batch plans: the contiguous base plus one or two extras per GPU and layer, different every batch."""
    from moebalance.core.plan import Placement

    base = _rt_plans(world_size)["contiguous"]
    rng = np.random.default_rng(RT_SEED)
    out = []
    for _ in range(batches):
        layers = []
        for li in range(RT_L):
            row = []
            for g in range(world_size):
                have = base.gpu_experts[li][g]
                free = [e for e in range(RT_E) if e not in have]
                n = int(rng.integers(1, 3)) if free else 0
                row.append([*have, *(int(e) for e in rng.choice(free, size=min(n, len(free)), replace=False))])
            layers.append(row)
        out.append(Placement(layers, RT_E, base.cluster))
    return out


def _rt_cases(world_size: int, quick: bool = False) -> list[dict[str, Any]]:
    """The runtime cases of a launch of ``world_size`` ranks; ``quick``: one of each kind."""
    cases: list[dict[str, Any]] = []
    routers = ("uniform", "rebalance", "locality") if world_size == 1 else ("uniform", "rebalance", "minmax", "random")
    for plan in ("contiguous", "replicas"):
        for router in routers:
            for local_first in (False, True):
                cases.append({"name": f"{plan}/{router}{'/local-first' if local_first else ''}", "plan": plan,
                              "router": router, "local_first": local_first})
    cases.append({"name": "replicas/rebalance/two-stage", "plan": "replicas", "router": "rebalance",
                  "router_thread": True})
    cases.append({"name": "replicas/uniform/bf16", "plan": "replicas", "router": "uniform", "dtype": "bfloat16"})
    if world_size > 1:
        cases.append({"name": "replicas/uniform/p2p", "plan": "replicas", "router": "uniform", "impl": "p2p"})
        cases.append({"name": "libra-prefetch/rebalance", "plan": "batch", "router": "rebalance", "batches": 2})
        cases.append({"name": "libra-prefetch/rebalance/two-stage", "plan": "batch", "router": "rebalance",
                      "batches": 2, "router_thread": True})
    if quick:
        keep = {"replicas/rebalance/local-first", "replicas/rebalance/two-stage", "libra-prefetch/rebalance"}
        cases = [c for c in cases if c["name"] in keep]
    return cases


def runtime_rank(rank: int, world_size: int, device_kind: str, cases: list[dict[str, Any]],
                 spill: str) -> dict[str, Any]:
    """One rank of a runtime launch: every case's output for this rank's tokens (or the case's one-line error),
    each also written to ``spill/r{rank}_c{i}.pkl`` as soon as it is known (a launch stopped by its timeout, a case
    hanging in a collective, leaves the cases before it readable)."""
    import pickle

    import torch

    from moebalance.runtime import EPConfig, ExpertParallelMoE, ExpertPrefetcher, ExpertWeights, GateConfig

    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # every rank on the one GPU
    gates, experts = _rt_layers()
    plans = _rt_plans(world_size)
    off = np.concatenate([[0], np.cumsum(RT_TOKENS[world_size])])
    out: dict[str, Any] = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            dtype = getattr(torch, case.get("dtype", "float32"))
            cfg = EPConfig(router=case["router"], router_seed=RT_SEED, local_first=case.get("local_first", False),
                           router_thread=case.get("router_thread", False), a2a_impl=case.get("impl", "auto"))
            full = [ExpertWeights(*(t.to(device, dtype) for t in e.tensors())) for e in experts]
            gate = [g.to(device, dtype) for g in gates]
            outs = []
            if case["plan"] == "batch":
                batch_plans = _rt_batch_plans(world_size, case["batches"])
                base = _rt_plans(world_size)["contiguous"]
                pf = ExpertPrefetcher(2, group=None)
                layers = [ExpertParallelMoE.from_full(base, li, gate[li], full[li], GateConfig(top_k=RT_K), cfg,
                                                      prefetcher=pf) for li in range(RT_L)]
                for b in range(case["batches"]):
                    h = _rt_inputs(world_size, b)[off[rank]:off[rank + 1]].to(device, dtype)
                    for li in range(RT_L):
                        h = h + layers[li](h, step=b, batch_plan=batch_plans[b]).out
                    outs.append(h.float().cpu().numpy())
                pf.drain()
            else:
                plan = plans[case["plan"]]
                h = _rt_inputs(world_size)[off[rank]:off[rank + 1]].to(device, dtype)
                for li in range(RT_L):
                    layer = ExpertParallelMoE.from_full(plan, li, gate[li], full[li], GateConfig(top_k=RT_K), cfg)
                    h = h + layer(h, step=0).out
                outs.append(h.float().cpu().numpy())
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[case["name"]] = {"out": outs, "seconds": time.perf_counter() - t0}
        except Exception as exc:  # recorded per case; ranks fail alike (the runtime agrees on input errors)
            out[case["name"]] = {"error": one_line(exc), "traceback": traceback.format_exc()[-1500:]}
        with open(Path(spill) / f"r{rank}_c{cases.index(case)}.pkl", "wb") as fh:
            pickle.dump(out[case["name"]], fh)
    return out


def _spilled(spill: Path, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What :func:`runtime_rank` left in ``spill``: per rank, the cases every rank finished."""
    import pickle

    per_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
    for i, case in enumerate(cases):
        paths = [spill / f"r{r}_c{i}.pkl" for r in range(world_size)]
        if not all(p.is_file() for p in paths):
            break
        for r, path in enumerate(paths):
            with open(path, "rb") as fh:
                per_rank[r][case["name"]] = pickle.load(fh)
    return per_rank


def _rt_reference(world_size: int, case: dict[str, Any]) -> list[np.ndarray]:
    """The dense single-process reference of a case, float32 on the CPU: the residual chain over the layers."""
    from moebalance.runtime import GateConfig, dense_moe

    gates, experts = _rt_layers()
    outs = []
    for b in range(case.get("batches", 1)):
        h = _rt_inputs(world_size, b)
        for li in range(RT_L):
            h = h + dense_moe(h, gates[li], experts[li], GateConfig(top_k=RT_K),
                              group_sizes=RT_TOKENS[world_size])[0]
        outs.append(h.numpy())
    return outs


def _rt_check(case: dict[str, Any], got: list[dict[str, Any]], backend: str, ws: int, kind: str) -> dict[str, Any]:
    """One case's record: the first rank's error, or the output of every rank against the dense reference (float32:
    the largest absolute error within ``1e-4`` of the output's scale; bf16, whose rounding can flip a top-k pick:
    the mean absolute error within 2% of the mean absolute output)."""
    rec: dict[str, Any] = {"backend": backend, "world_size": ws, "device": kind, "case": case["name"]}
    errors = [g for g in got if "error" in g]
    if errors:
        rec.update({"pass": False, "error": errors[0]["error"], "traceback": errors[0]["traceback"]})
        return rec
    want = _rt_reference(ws, case)
    mine = np.concatenate([np.concatenate([g["out"][b] for g in got]) for b in range(len(want))])
    ref = np.concatenate(want)
    diff = np.abs(mine - ref)
    err, mean_err = float(diff.max()), float(diff.mean())
    if case.get("dtype") == "bfloat16":
        tol = 2e-2 * float(np.abs(ref).mean())
        ok = mean_err <= tol
    else:
        tol = 1e-4 * max(1.0, float(np.abs(ref).max()))
        ok = err <= tol
    rec.update({"pass": bool(ok), "max_abs_error": err, "mean_abs_error": mean_err, "tolerance": tol,
                "seconds": round(max(g["seconds"] for g in got), 4)})
    return rec


def _run_cli_torchrun(ctx: Ctx, tmp: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    """``moebalance run`` as rank 0 of a one-rank torchrun environment (NCCL where CUDA is there), in a child."""
    from moebalance.core.cluster import Cluster
    from moebalance.core.plan import Placement, write_plan
    from moebalance.lm.moe_lm import bundled_checkpoint, checkpoint_config
    from moebalance.runtime import free_port

    c = checkpoint_config(bundled_checkpoint())
    plan_path = tmp / "plan_1gpu.json"
    write_plan(plan_path, Placement([[list(range(c.num_experts))] for _ in range(c.num_layers)], c.num_experts,
                                    Cluster(num_nodes=1, gpus_per_node=1), policy="one-gpu"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    src = str(ROOT / "src")
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), MOEBALANCE_DIST_TIMEOUT="60",
               PYTHONPATH=src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
    if ctx.device.type != "cuda":
        env["OMP_NUM_THREADS"] = "1"  # small CPU products: no spinning thread pool fighting other processes
    text = ROOT / "README.md"  # any text: the bytes are the tokens (no dependence on the stdlib's prose)
    argv = [sys.executable, "-m", "moebalance", "run", "--plan", str(plan_path), "--text", str(text), "--tokens",
            "512" if ctx.setup.runtime_quick else "2048", "--batch-tokens", "512", "--json", *extra]
    shown = " ".join(["moebalance", *argv[3:]]).replace(str(plan_path), "PLAN_1GPU.json").replace(str(ROOT) + "/", "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    except subprocess.TimeoutExpired as exc:
        return {"command": shown, "pass": False, "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": (exc.stderr or "")[-1500:] if isinstance(exc.stderr, str) else ""}
    res: dict[str, Any] = {"command": shown, "exit_code": proc.returncode,
                           "seconds": round(time.perf_counter() - t0, 2)}
    try:
        report = json.loads(proc.stdout)
        res.update({k: report.get(k) for k in ("max_abs_logit_diff", "logit_tolerance", "logits_agree",
                                                "routing_mismatches", "counts_match_simulator", "world_size",
                                                "num_tokens", "router")})
        res["pass"] = proc.returncode == 0 and bool(report.get("logits_agree")) and report.get("routing_mismatches") == 0
    except (json.JSONDecodeError, AttributeError):
        res["pass"] = False
        res["error"] = "no JSON report on stdout"
        res["stdout_tail"] = proc.stdout[-1000:]
    if proc.returncode != 0 or not res["pass"]:
        res["stderr_tail"] = proc.stderr[-1500:]
    return res


def section_runtime(ctx: Ctx) -> dict[str, Any]:
    from moebalance.runtime import launch

    cuda = ctx.device.type == "cuda"
    kind = "cuda" if cuda else "cpu"
    result: dict[str, Any] = {"device": kind, "launches": [], "cli": []}
    doc: dict[str, Any] = {"device": kind, "cases": [], "launches": result["launches"], "cli": result["cli"]}
    launches = [("nccl" if cuda else "gloo", 1), ("gloo", 2)]
    for backend, ws in launches:
        if ctx.clock.expired():
            result["truncated"] = True
            break
        cases = _rt_cases(ws, ctx.setup.runtime_quick)
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"backend": backend, "world_size": ws, "device": kind}
        ctx.log(f"runtime: {backend}, {ws} rank(s) on {kind}: {len(cases)} cases")
        spill = Path(tempfile.mkdtemp(prefix="gpu-check-spill-"))
        try:
            per_rank = launch(runtime_rank, ws, kind, cases, str(spill), backend=backend,
                              timeout=max(20.0, min(90.0, ctx.clock.deadline - time.monotonic())))
        except Exception as exc:  # a failed or stopped launch: keep the cases its ranks finished
            entry["error"] = one_line(exc)
            entry["traceback"] = traceback.format_exc()[-2000:]
            ctx.log(f"  launch failed: {entry['error']}")
            per_rank = _spilled(spill, ws, cases)
        shutil.rmtree(spill, ignore_errors=True)
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        finished = [c for c in cases if all(c["name"] in r for r in per_rank)]
        for case in finished:
            rec = _rt_check(case, [r[case["name"]] for r in per_rank], backend, ws, kind)
            doc["cases"].append(rec)
            ctx.log(f"  {case['name']}: {'pass' if rec['pass'] else 'FAIL'} "
                    f"{rec.get('max_abs_error', rec.get('error'))}")
        entry["cases"] = len(cases)
        entry["finished"] = len(finished)
        entry["passed"] = sum(1 for r in doc["cases"][-len(finished):] if r["pass"]) if finished else 0
        result["launches"].append(entry)
        write_json(ctx.out / "runtime.json", doc)
    with tempfile.TemporaryDirectory(prefix="gpu-check-run-") as tmp:
        variants: list[list[str]] = [[], ["--router", "rebalance", "--two-stage"]]
        for extra in variants[:1] if ctx.setup.runtime_quick else variants:
            if ctx.clock.expired():
                result["truncated"] = True
                break
            res = _run_cli_torchrun(ctx, Path(tmp), extra,
                                    timeout=max(20.0, min(120.0, ctx.clock.deadline - time.monotonic())))
            ctx.log(f"moebalance run {' '.join(extra)} (torchrun environment, 1 rank): "
                    f"{'pass' if res.get('pass') else 'FAIL'} {res.get('max_abs_logit_diff', res.get('error'))}")
            result["cli"].append(res)
    write_json(ctx.out / "runtime.json", doc)
    result["passed"] = sum(1 for r in doc["cases"] if r["pass"]) + sum(1 for r in result["cli"] if r.get("pass"))
    result["checks"] = len(doc["cases"]) + len(result["cli"])
    return result


# ---------------------------------------------------------------- section 4: the planner
def _routing(G: int, E: int, tokens_per_gpu: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Skewed top-k routing of ``G * tokens_per_gpu`` tokens: ``(ids int16 [T, 1, k], src int64 [T])``; a token's
    first expert is drawn with Zipf-like popularity, the others at distinct offsets from it."""
    rng = np.random.default_rng(seed)
    T = G * tokens_per_gpu
    p = 1.0 / np.arange(1, E + 1) ** 0.8
    first = rng.permutation(E)[rng.choice(E, size=T, p=p / p.sum())]
    table = np.stack([rng.choice(np.arange(1, E), size=k - 1, replace=False) for _ in range(64)])
    ids = (first[:, None] + np.concatenate([np.zeros((64, 1), np.int64), table], axis=1)[rng.integers(0, 64, T)]) % E
    return ids.astype(np.int16)[:, None, :], np.repeat(np.arange(G, dtype=np.int64), tokens_per_gpu)


def _cpu_planner(ctx: Ctx, G: int, E: int, Tg: int, k: int, n: int) -> dict[str, Any]:
    """Median seconds per layer of Libra's prefetch phases and of the ``rebalance`` router (one core's numpy and
    numba, as ``moebalance online`` runs them) on skewed routing of ``G x Tg`` tokens."""
    import statistics

    from moebalance.algorithms.prefetch import prefetch
    from moebalance.core.cluster import Cluster
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace
    from moebalance.policies.libra import LibraConfig, batch_plan
    from moebalance.routing import get_router

    ids, src = _routing(G, E, Tg, k)
    trace = RoutingTrace(ids, src, np.zeros(src.size, np.int64), num_experts=E, num_batches=1)
    per = E // G
    base = Placement([[list(range(g * per, (g + 1) * per)) for g in range(G)]], E,
                     Cluster(num_nodes=max(1, G // 8), gpus_per_node=min(8, G)), policy="contiguous")
    demand = trace.demand(G)  # [1, G, E]
    hosted = base.copies.transpose(0, 2, 1) > 0
    cfg = LibraConfig(predictor="oracle", n=n)
    router = get_router("rebalance")
    plan = batch_plan(base, demand.astype(float), cfg)[0]
    router.assign_tokens(plan, trace, np.random.default_rng(0))  # compiles the router's kernels once
    times_p: list[float] = []
    times_r: list[float] = []
    for _ in range(ctx.setup.planner_repeats):
        if ctx.clock.expired():
            break
        t0 = time.perf_counter()
        prefetch(demand[0].astype(float), hosted[0], n, cfg.alpha)
        t1 = time.perf_counter()
        router.assign_tokens(plan, trace, np.random.default_rng(0))
        t2 = time.perf_counter()
        times_p.append(t1 - t0)
        times_r.append(t2 - t1)
    if not times_p:
        raise RuntimeError("the section's budget ran out before the first timed repeat")
    ctx.log(f"CPU planner: prefetch {statistics.median(times_p) * 1e6:.0f} us, rebalance router "
            f"{statistics.median(times_r) * 1e3:.1f} ms per layer")
    out: dict[str, Any] = {"prefetch_median_seconds": statistics.median(times_p),
                           "rebalance_router_median_seconds": statistics.median(times_r), "repeats": len(times_p),
                           "numba_threads": os.environ.get("NUMBA_NUM_THREADS", "default")}
    # the one-call exact planner (prefetch phases and the rebalancer's split), where the package has it
    try:
        from moebalance.algorithms import exact  # type: ignore[attr-defined,unused-ignore]

        plan_layer = exact.plan_layer
    except (ImportError, AttributeError) as exc:
        out["exact_plan_layer"] = {"status": "absent", "why": one_line(exc)}
        return out
    try:
        copies = np.ascontiguousarray(base.copies[0])
        plan_layer(demand[0], copies, n, cfg.alpha)  # compiles (or loads) its kernel
        times = []
        for _ in range(ctx.setup.planner_repeats):
            t0 = time.perf_counter()
            plan_layer(demand[0], copies, n, cfg.alpha)
            times.append(time.perf_counter() - t0)
        out["exact_plan_layer"] = {"status": "present", "median_seconds": statistics.median(times),
                                   "repeats": len(times)}
        ctx.log(f"exact CPU planner (algorithms.exact.plan_layer): {statistics.median(times) * 1e6:.0f} us per layer")
    except Exception as exc:
        out["exact_plan_layer"] = {"status": "error", "why": one_line(exc)}
    return out


def section_planner(ctx: Ctx) -> dict[str, Any]:
    """Libra's CPU planner, then the device exact planner on CUDA (``planner.json``, written as each part ends; a
    failing part is recorded beside the others). On the CPU the device planner runs only in Triton's interpreter,
    which says nothing of its speed: it is not timed there."""
    s = ctx.setup
    G, E, Tg, k, n = s.planner_gpus, s.planner_experts, s.planner_tokens_per_gpu, 8, 4
    result: dict[str, Any] = {"gpus": G, "experts": E, "tokens_per_gpu": Tg, "top_k": k, "n": n}
    try:  # the CPU planner as libra uses it: prefetch phases 1-2, then the rebalance router on the tokens
        result["cpu_planner"] = _cpu_planner(ctx, G, E, Tg, k, n)
    except Exception as exc:
        result["cpu_planner_error"] = {"error": one_line(exc), "traceback": traceback.format_exc()[-1500:]}
        ctx.log(f"CPU planner failed: {one_line(exc)}")
    write_json(ctx.out / "planner.json", result)
    if ctx.device.type != "cuda":
        result["device_planner"] = {"status": "skipped", "why": "no CUDA device (Triton's interpreter is not timed)"}
    else:
        try:
            result["device_planner"] = _device_planner(ctx, G, E, Tg, k, n)
        except Exception as exc:
            result["device_planner"] = {"status": "error", "why": one_line(exc),
                                        "traceback": traceback.format_exc()[-1500:]}
            ctx.log(f"device planner failed: {one_line(exc)}")
    write_json(ctx.out / "planner.json", result)
    return result


def _device_planner(ctx: Ctx, G: int, E: int, Tg: int, k: int, n: int) -> dict[str, Any]:
    """Median seconds per layer of :func:`moebalance.algorithms.exact_device.plan` on one layer of a skewed
    routing (each GPU's popularity drawn around a shared one, contiguous homes), its loads checked equal to the
    compiled CPU planner's first; CUDA-synchronised around each call."""
    import statistics

    import torch

    from moebalance.algorithms import exact_device
    from moebalance.algorithms.exact import plan_layer

    rng = np.random.default_rng(0)
    shared = rng.dirichlet(np.full(E, 0.6))
    demand = np.stack([rng.multinomial(Tg * k, rng.dirichlet(shared * E * 4 + 1e-3)) for _ in range(G)]).astype(np.int64)
    copies = np.zeros((E, G), dtype=np.int64)
    copies[np.arange(E), np.arange(E) * G // E] = 1
    d, c = torch.from_numpy(demand)[None, None].to(ctx.device), torch.from_numpy(copies)[None].to(ctx.device)
    want = plan_layer(demand, copies, n, 0.5)
    got = exact_device.plan(d, c, n, 0.5)
    if not (np.array_equal(got.loads[0, 0].cpu().numpy(), want.loads)
            and np.array_equal(got.extras[0, 0].cpu().numpy(), want.extras)):
        raise RuntimeError(f"the device planner differs from plan_layer (G={G}, E={E}, n={n})")
    times: list[float] = []
    for _ in range(ctx.setup.planner_repeats):
        if ctx.clock.expired():
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        exact_device.plan(d, c, n, 0.5, validate=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if not times:
        raise RuntimeError("the section's budget ran out before the first timed call")
    ctx.log(f"device planner on cuda: {statistics.median(times) * 1e6:.0f} us per layer")
    return {"status": "present", "median_seconds_per_layer": statistics.median(times), "repeats": len(times),
            "moves": want.moves}


SECTION_FUNCS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "gemm": section_gemm, "straggler": section_straggler, "runtime": section_runtime, "planner": section_planner}


# ---------------------------------------------------------------- running sections
def run_section_here(name: str, out: Path, cuda: bool, budget: float, gpu_spec: str | None,
                     log_path: Path | None, quick: bool = False) -> dict[str, Any]:
    """Run section ``name`` in this process: ``{"status", "seconds", "result" | "error", ...}``."""
    clock = Clock(budget)
    log = make_log(clock, log_path)
    record: dict[str, Any] = {"status": "error", "budget_s": budget}
    try:
        import torch

        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        else:  # small CPU products: one thread, no spinning thread pool fighting other processes for the cores
            torch.set_num_threads(1)
        ctx = Ctx(out=out, setup=Setup.make(cuda, quick), clock=clock, log=log, device=device,
                  dtype=torch.bfloat16 if cuda else torch.float32, gpu_spec=gpu_spec)
        log(f"section {name}: start ({'cuda' if cuda else 'cpu'}, budget {budget:.0f} s)")
        result = SECTION_FUNCS[name](ctx)
        record.update(status="truncated" if result.get("truncated") else "ok", result=result)
    except Exception as exc:
        record.update(error=one_line(exc), traceback=traceback.format_exc()[-3000:])
        log(f"section {name}: error: {one_line(exc)}")
    record["seconds"] = round(clock.elapsed(), 2)
    log(f"section {name}: {record['status']} in {record['seconds']} s")
    return record


def run_section_child(name: str, out: Path, cuda: bool, budget: float, gpu_spec: str | None, work: Path,
                      log: Callable[[str], None], log_path: Path, *, quick: bool = False,
                      grace: float = 15.0) -> dict[str, Any]:
    """Run section ``name`` in a child process (its own process group), stopped after ``budget`` seconds plus a
    grace; its output is echoed here and into the log. The child stops its own loops at the budget's end."""
    result_path = work / f"{name}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--out", str(out), "--result",
            str(result_path), "--budget", f"{budget:.1f}"]
    if not cuda:
        argv.append("--cpu")
    if quick:
        argv.append("--quick")
    if gpu_spec:
        argv += ["--gpu-spec", gpu_spec]
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    tail: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        with open(log_path, "a") as fh:
            for line in proc.stdout:
                line = line.rstrip("\n")
                print(f"  {name}| {line}", flush=True)
                fh.write(f"  {name}| {line}\n")
                fh.flush()
                tail.append(line)
                del tail[:-40]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    hard = budget * 1.1 + grace  # the child's own deadline comes first; this only stops a hang
    timed_out = False
    try:
        proc.wait(timeout=hard)
    except subprocess.TimeoutExpired:
        timed_out = True
        log(f"section {name}: still running after {hard:.0f} s: stopping it")
        _stop_group(proc)
    reader.join(timeout=10)
    for file in FILES:  # the temporary of a file the child was writing when it was stopped, or when it crashed
        remove_stale_temporaries(out / file)
    record: dict[str, Any]
    if result_path.is_file():
        record = json.loads(result_path.read_text())
    else:
        record = {"status": "timeout" if timed_out else "error", "budget_s": budget,
                  "error": (f"stopped after {hard:.0f} s" if timed_out else f"the section's process exited with "
                            f"{proc.returncode} without a result"), "output_tail": tail[-20:]}
    record["exit_code"] = proc.returncode
    record["wall_seconds"] = round(time.monotonic() - t0, 2)
    return record


def _stop_group(proc: subprocess.Popen[str]) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default: $OUT)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with small sizes even if CUDA is there")
    parser.add_argument("--quick", action="store_true", help="the CPU with the smallest sizes and fewer runtime "
                                                             "cases (the tests)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    parser.add_argument("--in-process", action="store_true", help="run the sections in this process (no isolation, "
                                                                  "no hard stop)")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # a child running one section
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--gpu-spec", help=argparse.SUPPRESS)
    parser.add_argument("--grace", type=float, default=15.0, help=argparse.SUPPRESS)  # seconds past a budget
    parser.add_argument("--budgets", default="", help=argparse.SUPPRESS)  # name=seconds,...: overrides
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("--out is required where $OUT is not set")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.section:  # child: one section, its record to --result
        record = run_section_here(args.section, out, not args.cpu, args.budget or BUDGETS[args.section], args.gpu_spec,
                                  None, args.quick)
        write_json(Path(args.result), record)
        return 0

    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or args.budget_scale <= 0:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}" if unknown
                     else "--budget-scale must be positive")
    budgets = {name: BUDGETS[name] * args.budget_scale for name in SECTIONS}
    for item in filter(None, args.budgets.split(",")):
        name, _, value = item.partition("=")
        if name not in budgets:
            parser.error(f"--budgets: unknown section {name!r}")
        budgets[name] = float(value)
    clock = Clock(math.inf)
    log_path = out / "log.txt"
    log_path.write_text("")
    log = make_log(clock, log_path)
    env: dict[str, Any] = {"script": "bench/gpu_check.py", "argv": list(sys.argv[1:] if argv is None else argv),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
    try:
        import torch

        cuda = bool(torch.cuda.is_available()) and not args.cpu and not args.quick
    except Exception as exc:
        log(f"torch does not import: {one_line(exc)}")
        cuda = False
    env["mode"] = "cuda" if cuda else ("cpu-quick" if args.quick else "cpu")
    env["machine"] = describe_device(cuda)
    gpu_spec = env["machine"].get("gpu_spec") if cuda else None
    log(f"mode {env['mode']}: {env['machine'].get('device_name')} (cost model spec: {gpu_spec}); "
        f"torch {env['machine']['versions'].get('torch')}, CUDA {env['machine'].get('torch_cuda')}; "
        f"missing: {env['machine']['missing'] or 'nothing'}")
    write_json(out / "env.json", env)
    with tempfile.TemporaryDirectory(prefix="gpu-check-work-") as work:
        for name in chosen:
            budget = budgets[name]
            if args.in_process:
                record = run_section_here(name, out, cuda, budget, gpu_spec, log_path, args.quick)
            else:
                record = run_section_child(name, out, cuda, budget, gpu_spec, Path(work), log, log_path,
                                           quick=args.quick, grace=args.grace)
            env["sections"][name] = record
            env["total_seconds"] = round(clock.elapsed(), 2)
            write_json(out / "env.json", env)
            log(f"== {name}: {record['status']} ({record.get('seconds', record.get('wall_seconds'))} s)"
                + (f": {record['error']}" if record.get("error") else ""))
    env["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    env["total_seconds"] = round(clock.elapsed(), 2)
    write_json(out / "env.json", env)
    stray = sorted(p.name for p in out.iterdir() if p.name not in FILES)
    if stray:
        log(f"warning: files beyond the eight that come back: {stray}")
    log(f"done in {env['total_seconds']} s: " + ", ".join(f"{n} {r['status']}" for n, r in env["sections"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
