"""Turn the folder ``bench/gpu_check.py`` wrote into ``docs/results/gpu.md`` and a plot.

What it reports, from the files alone (nothing is measured here):

- the grouped GEMM against the cost model's expert time (``cost.time.gemm_seconds``) per expert shape and regime,
  with the published peaks and with the fitted calibration: the mean absolute log error and the geometric-mean
  ratio modelled / measured. A run's regime is what the published-peak roofline says binds it: memory (few tokens
  per expert: decode) or FLOPs (many: prefill);
- per workload and regime, each plan's mean measured straggler time beside the modelled ones, and whether the
  plans' order by measured time equals their order by modelled time (exactly, and Kendall's tau);
- what the runtime's CUDA paths did (each case: pass or fail, the largest error against the dense reference, or the
  error), and the device-side planner's times;
- each section's status, seconds and error.

Run: ``python bench/gpu_report.py --in DIR [--out docs/results/gpu.md] [--plot docs/results/gpu.png]``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
try:  # an installed moebalance, else the source tree
    import moebalance  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from moebalance.cost.hardware import GPUS, GpuSpec  # noqa: E402
from moebalance.cost.time import Calibration, gemm_seconds  # noqa: E402
from moebalance.models import get_model  # noqa: E402


# ---------------------------------------------------------------- reading
def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_rows(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as fh:
            return list(csv.DictReader(fh))
    except OSError:
        return []


def num(text: str | None) -> float:
    """A CSV cell as a float; empty or missing is nan."""
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def calibration_of(doc: Any) -> Calibration | None:
    if not isinstance(doc, dict):
        return None
    fields = {f.name for f in dataclasses.fields(Calibration)}
    try:
        return Calibration(**{k: v for k, v in doc.items() if k in fields})
    except Exception:
        return None


# ---------------------------------------------------------------- arithmetic
def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-a of two equally long sequences: (concordant - discordant pairs) / all pairs; a pair tied in
    either counts as neither. ``nan`` for fewer than two items."""
    n = len(a)
    if n != len(b):
        raise ValueError("kendall_tau needs sequences of one length")
    if n < 2:
        return math.nan
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            s += int(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]))
    return s / (n * (n - 1) / 2)


def order(names: Sequence[str], values: Sequence[float]) -> list[str]:
    """``names`` from the smallest value to the largest (ties by name)."""
    return [n for _, n in sorted(zip(values, names, strict=True))]


def log_errors(model: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """``(mean |log(model / measured)|, geometric-mean ratio model / measured)`` over the finite positive pairs."""
    ok = np.isfinite(model) & np.isfinite(measured) & (model > 0) & (measured > 0)
    if not ok.any():
        return math.nan, math.nan
    r = np.log(model[ok] / measured[ok])
    return float(np.abs(r).mean()), float(np.exp(r.mean()))


def shape_model(hidden: int, ffn: int) -> Any:
    """A model spec whose routed expert is ``hidden x ffn`` (only those two sizes enter the expert time)."""
    return dataclasses.replace(get_model("deepseek-v3"), hidden_size=int(hidden), moe_intermediate_size=int(ffn))


def fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:.3f}"


# ---------------------------------------------------------------- sections of the report
@dataclasses.dataclass
class Folder:
    path: Path
    env: dict[str, Any]
    gemm: list[dict[str, str]]
    calibration: Calibration | None
    straggler: list[dict[str, str]]
    gpus: list[dict[str, str]]
    runtime: dict[str, Any] | None
    planner: dict[str, Any] | None

    @staticmethod
    def read(path: Path) -> Folder:
        env = read_json(path / "env.json")
        return Folder(path, env if isinstance(env, dict) else {}, read_rows(path / "gemm.csv"),
                      calibration_of(read_json(path / "calibration.json")), read_rows(path / "straggler.csv"),
                      read_rows(path / "straggler_gpus.csv"), read_json(path / "runtime.json"),
                      read_json(path / "planner.json"))

    def section(self, name: str) -> dict[str, Any]:
        return self.env.get("sections", {}).get(name, {}) or {}

    def gpu(self) -> GpuSpec:
        name = self.section("gemm").get("result", {}).get("gpu_spec") or self.env.get("machine", {}).get("gpu_spec")
        return GPUS.get(name or "", GPUS["h100-80gb"])


def header(f: Folder) -> list[str]:
    m = f.env.get("machine", {})
    mode = f.env.get("mode", "unknown")
    lines = ["# On one GPU: the cost model's expert time, measured straggler times, the CUDA paths", "",
             "Generated by `bench/gpu_report.py` from the files `bench/gpu_check.py` wrote (one command on the device: "
             "`bash bench/gpu_check.sh`). Every number below comes from those files.", "",
             f"- device: **{m.get('device_name', 'unknown')}** ({m.get('memory_gib', '?')} GiB, "
             f"{m.get('multiprocessors', '?')} multiprocessors), cost-model spec `{f.gpu().name}` "
             f"({f.gpu().bf16_tflops:g} TFLOP/s BF16, {f.gpu().memory_bandwidth:g} GB/s)",
             f"- software: Python {m.get('python', '?')}, torch {m.get('versions', {}).get('torch', '?')}, CUDA "
             f"{m.get('torch_cuda', '?')}, NCCL {m.get('nccl', '?')}, numpy {m.get('versions', {}).get('numpy', '?')}, "
             f"numba {m.get('versions', {}).get('numba', '?')}; missing: {', '.join(m.get('missing', [])) or 'none'}",
             f"- run: {f.env.get('started', '?')}, {f.env.get('total_seconds', '?')} s in all, mode `{mode}`"
             + (f", commit `{m['git_commit'][:12]}`" if m.get("git_commit") else ""), ""]
    if mode != "cuda":
        lines += ["**This folder comes from the CPU mode: small expert sizes in float32 on the CPU. It checks the "
                  "script end to end and measures nothing about GPUs.**", ""]
    lines += ["| section | status | seconds | note |", "|---|---|---:|---|"]
    for name, rec in f.env.get("sections", {}).items():
        note = rec.get("error", "") or ""
        lines.append(f"| {name} | {rec.get('status', '?')} | {rec.get('seconds', rec.get('wall_seconds', '?'))} | "
                     f"{note.replace('|', '/')} |")
    return [*lines, ""]


def gemm_part(f: Folder) -> list[str]:
    lines = ["## Grouped GEMM against the modelled expert time", ""]
    if not f.gemm:
        return [*lines, "No grouped-GEMM measurements (see the sections table).", ""]
    res = f.section("gemm").get("result", {})
    gpu = f.gpu()
    primary = res.get("primary_kernel", f.gemm[0].get("kernel", "bmm"))
    fits = res.get("fits", {})
    if f.calibration is not None:
        c = f.calibration
        lines += [f"`moebalance calibrate` on the `{primary}` runs of every shape (`calibration.json`): "
                  f"{100 * c.flops_efficiency:.1f}% of the BF16 peak, {100 * c.bandwidth_efficiency:.1f}% of the "
                  f"memory bandwidth, {c.launch_us:.1f} us per grouped GEMM.", ""]
    refused = res.get("kernels_refused") or {}
    if refused:
        lines += [f"Kernels that did not run: {'; '.join(f'`{k}`: {v}' for k, v in refused.items())}.", ""]
    if fits:
        lines += ["Fits per kernel and shape (grid search, mean absolute log error):", "",
                  "| kernel / shape | FLOP/s share | bandwidth share | launch us | mean abs log error | runs (FLOP-, "
                  "memory-bound) |", "|---|---:|---:|---:|---:|---|"]
        for key, v in fits.items():
            lines.append(f"| {key} | {100 * v['flops_efficiency']:.1f}% | {100 * v['bandwidth_efficiency']:.1f}% | "
                         f"{v['launch_us']:.1f} | {v['mean_abs_log_error']:.3f} | {v['runs']} ({v['bound_by_flops']}, "
                         f"{v['bound_by_memory']}) |")
        lines.append("")
    lines += ["Model error per regime: the regime is what the published-peak roofline says binds a run (memory: few "
              "tokens per expert, decode; FLOPs: many, prefill). Error = mean |log(modelled / measured)|; ratio = "
              "geometric mean of modelled / measured (below 1: the model is optimistic). Calibrated: each kernel's own "
              "fit over every shape (`calibration.json` for the primary kernel).", "",
              "| kernel | shape | regime | runs | tokens per expert | peaks: error | peaks: ratio | calibrated: error "
              "| calibrated: ratio |", "|---|---|---|---:|---|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str, str], list[tuple[float, float, float, float]]] = defaultdict(list)
    for r in f.gemm:
        kernel = r.get("kernel", "bmm")
        cal = _kernel_calibration(f, kernel)
        H, F, u, t = (int(num(r[c])) for c in ("hidden_size", "ffn_size", "experts", "tokens_per_expert"))
        model = shape_model(H, F)
        peak = float(gemm_seconds(u * t, u, model, gpu))
        calib = float(gemm_seconds(u * t, u, model, gpu, cal)) if cal is not None else math.nan
        flops = 6.0 * H * F * u * t / (gpu.bf16_tflops * 1e12)
        regime = "FLOP-bound (prefill)" if flops >= peak - 1e-15 else "memory-bound (decode)"
        groups[(kernel, r.get("shape", f"{H}x{F}"), regime)].append((num(r["seconds"]), peak, calib, t))
    for (kernel, shape, regime), vals in sorted(groups.items()):
        a = np.array(vals)
        e0, r0 = log_errors(a[:, 1], a[:, 0])
        e1, r1 = log_errors(a[:, 2], a[:, 0])
        lines.append(f"| {kernel} | {shape} | {regime} | {len(vals)} | {int(a[:, 3].min())}-{int(a[:, 3].max())} | "
                     f"{fmt(e0)} | {fmt(r0)} | {fmt(e1)} | {fmt(r1)} |")
    return [*lines, ""]


def _kernel_calibration(f: Folder, kernel: str) -> Calibration | None:
    fit = f.section("gemm").get("result", {}).get("fits", {}).get(f"{kernel}/all")
    if fit:
        return Calibration(flops_efficiency=fit["flops_efficiency"], bandwidth_efficiency=fit["bandwidth_efficiency"],
                           launch_us=fit["launch_us"], source=f"{kernel} fit")
    return f.calibration


def straggler_summary(rows: list[dict[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per ``(workload, regime)``: plans in first-seen order, their mean measured and modelled straggler seconds
    over the points every plan has, the orders and Kendall's tau."""
    by: dict[tuple[str, str], dict[str, dict[tuple[str, str], tuple[float, float, float]]]] = defaultdict(dict)
    for r in rows:
        key = (r["workload"], r["regime"])
        by[key].setdefault(r["plan"], {})[(r["batch"], r["layer"])] = (
            num(r["measured_s"]), num(r["modelled_uncal_s"]), num(r["modelled_cal_s"]))
    out = {}
    for key, plans in by.items():
        common = set.intersection(*(set(p) for p in plans.values()))
        names = list(plans)
        if not common:
            continue
        mean = {n: np.array([plans[n][pt] for pt in sorted(common)]).mean(axis=0) for n in names}
        meas, unc, cal = ([float(mean[n][i]) for n in names] for i in range(3))
        summary: dict[str, Any] = {"plans": names, "points": len(common), "measured": meas, "peaks": unc,
                                   "calibrated": cal, "order_measured": order(names, meas)}
        for label, vals in (("peaks", unc), ("calibrated", cal)):
            if all(math.isfinite(v) for v in vals):
                summary[f"order_{label}"] = order(names, vals)
                summary[f"tau_{label}"] = kendall_tau(meas, vals)
                summary[f"same_{label}"] = summary[f"order_{label}"] == summary["order_measured"]
        out[key] = summary
    return out


def straggler_part(f: Folder) -> list[str]:
    lines = ["## Expert parallelism on one GPU: measured against modelled straggler time", ""]
    if not f.straggler:
        return [*lines, "No straggler measurements (see the sections table).", ""]
    res = f.section("straggler").get("result", {})
    lines += [f"Each virtual GPU's grouped GEMM (`{res.get('kernel', '?')}` kernel) ran with the picks and experts the "
              "plan and its router give it, one GPU after another; the layer's measured time is the slowest GPU's "
              "(median of repeated runs), the modelled one `max_g expert_seconds(picks [G, E])` with the "
              "published peaks and with the calibration. Static plans (made on the first batches, scored on later "
              "ones) use the `uniform` router; `libra` is the contiguous base plus the batch's extras from its true "
              "routing, with the `rebalance` router.", ""]
    for name, w in res.get("workloads", {}).items():
        lines.append(f"- `{name}`: {w['gpus']} GPUs, {w['experts']} experts, expert {w['hidden_size']} x "
                     f"{w['ffn_size']}, layers {w['layers']}, batches {w['batches']}, regimes {w['regimes']}; "
                     f"measured {w['measured']} of {w['points']} points; "
                     + ", ".join(f"{p} {v['extra_replicas']} extra replicas" for p, v in w["plans"].items())
                     + f"; libra n = {w['libra']['n']}")
    lines.append("")
    summary = straggler_summary(f.straggler)
    agree = []
    for (wl, regime), s in summary.items():
        lines += [f"### {wl}, {regime} ({s['points']} points per plan)", "",
                  "| plan | measured ms | modelled ms (peaks) | modelled ms (calibrated) | measured / calibrated |",
                  "|---|---:|---:|---:|---:|"]
        for i, p in enumerate(s["plans"]):
            ratio = s["measured"][i] / s["calibrated"][i] if s["calibrated"][i] > 0 else math.nan
            lines.append(f"| {p} | {ms(s['measured'][i])} | {ms(s['peaks'][i])} | {ms(s['calibrated'][i])} | "
                         f"{fmt(ratio)} |")
        lines.append("")
        lines.append(f"Order by measured time: {' < '.join(s['order_measured'])}.")
        for label in ("peaks", "calibrated"):
            if f"order_{label}" in s:
                same = "the same" if s[f"same_{label}"] else "**a different** order"
                lines.append(f"By modelled time ({label}): {' < '.join(s[f'order_{label}'])}: {same} "
                             f"(Kendall's tau {s[f'tau_{label}']:+.2f}).")
                agree.append(s[f"same_{label}"])
        lines.append("")
    if f.gpus:
        lines += ["Per virtual GPU (every GPU with picks, every point):", "",
                  "| workload | regime | GPUs | peaks: error | peaks: ratio | calibrated: error | calibrated: ratio | "
                  "straggler GPU agrees |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        per: dict[tuple[str, str], list[tuple[float, float, float]]] = defaultdict(list)
        for r in f.gpus:
            if num(r["picks"]) > 0:
                per[(r["workload"], r["regime"])].append((num(r["measured_s"]), num(r["modelled_uncal_s"]),
                                                           num(r["modelled_cal_s"])))
        for key, vals in per.items():
            a = np.array(vals)
            e0, r0 = log_errors(a[:, 1], a[:, 0])
            e1, r1 = log_errors(a[:, 2], a[:, 0])
            pts = [r for r in f.straggler if (r["workload"], r["regime"]) == key]
            hit = float(np.mean([r["measured_gpu"] == r["modelled_gpu"] for r in pts])) if pts else math.nan
            lines.append(f"| {key[0]} | {key[1]} | {len(vals)} | {fmt(e0)} | {fmt(r0)} | {fmt(e1)} | {fmt(r1)} | "
                         f"{fmt(100 * hit, 3)}% |")
        lines.append("")
    if agree:
        lines += [f"The modelled order equals the measured one in {sum(agree)} of {len(agree)} comparisons.", ""]
    return lines


def runtime_part(f: Folder) -> list[str]:
    lines = ["## The runtime", ""]
    rt = f.runtime
    if not rt:
        return [*lines, "No runtime results (see the sections table).", ""]
    launches = rt.get("launches", [])
    for entry in launches:
        if entry.get("error"):
            lines.append(f"- {entry['backend']}, {entry['world_size']} rank(s) on {entry['device']}: the launch "
                         f"failed: `{entry['error']}`")
    cases = rt.get("cases", [])
    if cases:
        lines += ["", "The expert-parallel layer (two layers, a residual chain) against the dense "
                  "reference (`runtime.experts.dense_moe`, float32 on the CPU):", "",
                  "| backend | ranks | device | case | result | max abs error |", "|---|---:|---|---|---|---|"]
        for c in cases:
            what = "pass" if c.get("pass") else "**fail**"
            detail = fmt(c["max_abs_error"]) if "max_abs_error" in c else f"`{c.get('error', '')}`"
            lines.append(f"| {c['backend']} | {c['world_size']} | {c['device']} | {c['case']} | {what} | {detail} |")
        lines.append("")
    for c in rt.get("cli", []):
        what = "pass" if c.get("pass") else "**fail**"
        lines.append(f"- `{c['command']}`"
                     f" as rank 0 of a one-rank torchrun environment: {what}; largest logit difference "
                     f"{fmt(c.get('max_abs_logit_diff', math.nan))} (tolerance {c.get('logit_tolerance', '?')}), "
                     f"routing mismatches {c.get('routing_mismatches', '?')}"
                     + (f"; error `{c['error']}`" if c.get("error") else ""))
    return [*lines, ""]


def planner_part(f: Folder) -> list[str]:
    lines = ["## The planner", ""]
    p = f.planner
    if not p:
        return [*lines, "No planner results (see the sections table).", ""]
    size = f"{p['gpus']} GPUs x {p['experts']} experts, {p['tokens_per_gpu']} tokens per GPU, top-{p['top_k']}, " \
           f"n = {p['n']}"
    tp = p.get("torch_planner", {})
    if tp.get("status") == "present":
        for dev, v in tp.items():
            if not isinstance(v, dict):
                continue
            if "median_seconds_per_layer" in v:
                what = f"{v['median_seconds_per_layer'] * 1e6:.0f} us per layer (median of {v['repeats']})"
            elif "skipped" in v:
                what = f"not run ({v['skipped']})"
            else:
                what = f"failed: `{v.get('error')}`"
            checked = "; its plan checked equal to `algorithms.exact.plan_layer`'s" if tp.get("checked_against_exact") \
                and "median_seconds_per_layer" in v else ""
            lines.append(f"- torch exact planner on {dev}: {what} ({size}{checked})")
    elif tp:  # a folder from before the device planner
        lines.append(f"- torch exact planner: {tp.get('status', 'not run')} ({tp.get('why', '')})")
    dp = p.get("device_planner", {})
    if dp.get("status") == "present":
        lines.append(f"- device exact planner on cuda (`algorithms.exact_device.plan`): "
                     f"{dp['median_seconds_per_layer'] * 1e6:.0f} us per layer (median of {dp['repeats']}; {size}; "
                     "its loads and extras checked equal to `algorithms.exact.plan_layer`'s)")
    elif dp:
        lines.append(f"- device exact planner: {dp.get('status')} ({dp.get('why', '')})")
    if p.get("cpu_planner_error"):
        lines.append(f"- Libra's CPU planner failed: `{p['cpu_planner_error']['error']}`")
    cp = p.get("cpu_planner")
    if cp:
        lines.append(f"- Libra's CPU planner as `moebalance online` runs it: prefetch phases 1-2 "
                     f"{cp['prefetch_median_seconds'] * 1e6:.0f} us, the `rebalance` router over the tokens "
                     f"{cp['rebalance_router_median_seconds'] * 1e3:.2f} ms per layer ({size}; median of "
                     f"{cp['repeats']})")
        ex = cp.get("exact_plan_layer", {})
        if ex.get("status") == "present":
            lines.append(f"- the exact planner in one call on the CPU (`algorithms.exact.plan_layer`: prefetch phases "
                         f"and the rebalancer's split): {ex['median_seconds'] * 1e6:.0f} us per layer ({size})")
        elif ex:
            lines.append(f"- `algorithms.exact.plan_layer`: {ex.get('status')} ({ex.get('why', '')})")
    return [*lines, ""]


def plot(f: Folder, path: Path) -> bool:
    """GEMM time against tokens per expert per shape (measured points, modelled lines), and measured against
    modelled straggler time; ``False`` when there is nothing to draw."""
    if not f.gemm and not f.straggler:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    primary = f.section("gemm").get("result", {}).get("primary_kernel") or (f.gemm[0]["kernel"] if f.gemm else "")
    shapes = sorted({r["shape"] for r in f.gemm if r.get("kernel") == primary})
    panels = len(shapes) + (1 if f.straggler else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    gpu = f.gpu()
    cal = _kernel_calibration(f, primary)
    for ax, shape in zip(axes[0], shapes, strict=False):
        rows = [r for r in f.gemm if r.get("kernel") == primary and r["shape"] == shape]
        for i, u in enumerate(sorted({int(num(r["experts"])) for r in rows})):
            pts = sorted((int(num(r["tokens_per_expert"])), num(r["seconds"]), int(num(r["hidden_size"])),
                          int(num(r["ffn_size"]))) for r in rows if int(num(r["experts"])) == u)
            t = np.array([p[0] for p in pts], dtype=float)
            model = shape_model(pts[0][2], pts[0][3])
            color = f"C{i}"
            ax.loglog(t, [p[1] * 1e3 for p in pts], "o", color=color, ms=4, label=f"{u} expert{'s' if u > 1 else ''}")
            ax.loglog(t, gemm_seconds(t * u, u, model, gpu) * 1e3, "--", color=color, lw=1)
            if cal is not None:
                ax.loglog(t, gemm_seconds(t * u, u, model, gpu, cal) * 1e3, "-", color=color, lw=1)
        ax.set_title(f"{shape} ({primary})", fontsize=9)
        ax.set_xlabel("tokens per expert")
        ax.set_ylabel("ms (points: measured; --: peaks; -: calibrated)", fontsize=7)
        ax.legend(fontsize=7)
    if f.straggler:
        ax = axes[0][-1]
        groups = sorted({(r["workload"], r["regime"]) for r in f.straggler})
        for i, key in enumerate(groups):
            rows = [r for r in f.straggler if (r["workload"], r["regime"]) == key]
            meas = np.array([num(r["measured_s"]) for r in rows]) * 1e3
            model = np.array([num(r["modelled_cal_s"]) for r in rows]) * 1e3
            if not np.isfinite(model).any():
                model = np.array([num(r["modelled_uncal_s"]) for r in rows]) * 1e3
            ax.loglog(model, meas, "o", ms=3, color=f"C{i}", label=f"{key[0]} {key[1]}")
        lim = [v for v in ax.get_xlim() + ax.get_ylim()]
        ax.loglog([min(lim), max(lim)], [min(lim), max(lim)], "k:", lw=1)
        ax.set_xlabel("modelled straggler ms (calibrated)")
        ax.set_ylabel("measured straggler ms")
        ax.set_title("straggler time per layer", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(folder: Path, out: Path, plot_path: Path | None) -> str:
    """Write the report of ``folder`` to ``out`` (and the plot); returns the text."""
    f = Folder.read(folder)
    if not f.env:
        raise SystemExit(f"{folder}/env.json is missing or unreadable: is {folder} a bench/gpu_check.py folder?")
    lines = header(f) + gemm_part(f) + straggler_part(f) + runtime_part(f) + planner_part(f)
    if plot_path is not None and plot(f, plot_path):
        rel = Path(*plot_path.parts[len(out.parent.parts):]) if plot_path.parent == out.parent else plot_path
        lines += [f"![grouped GEMM and straggler times]({rel})", ""]
    text = "\n".join(lines).rstrip() + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--in", dest="folder", required=True, help="the folder bench/gpu_check.py wrote")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "gpu.md"))
    parser.add_argument("--plot", help="PNG to draw (default: beside --out, .png); 'none' for no plot")
    args = parser.parse_args(argv)
    out = Path(args.out)
    plot_path = None if args.plot == "none" else Path(args.plot) if args.plot else out.with_suffix(".png")
    report(Path(args.folder), out, plot_path)
    print(f"wrote {out}" + (f" and {plot_path}" if plot_path else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
