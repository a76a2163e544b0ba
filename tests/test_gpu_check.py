"""``bench/gpu_check.py`` (the one command of a GPU run) in its CPU mode, end to end, and ``bench/gpu_report.py`` on
what it writes.

One quick CPU run (every section in this process: small expert sizes, the real routing shapes) is checked for the
files a device run brings back and for properties that hold whatever the timings: a layer's straggler time is its
slowest virtual GPU's, the router serves every pick, the modelled time is the roofline worked out by hand, the
calibration is one ``moebalance cost --calibration`` reads, the runtime equals the dense reference. A second run
through the orchestrator's child processes checks that a section that fails, or outruns its budget, is recorded and
the next section still runs. The report is checked on that folder and on a hand-made one whose orders are known.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from moebalance.cost.calibrate import read_calibration, read_measurements
from moebalance.cost.hardware import GPUS

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
gpu_check: Any = importlib.import_module("gpu_check")
gpu_report: Any = importlib.import_module("gpu_report")


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check")
    assert gpu_check.main(["--out", str(out), "--quick", "--in-process"]) == 0
    return out


def test_a_cpu_run_writes_the_eight_files_and_every_section_succeeds(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(gpu_check.FILES)  # what a device run brings back
    env = json.loads((folder / "env.json").read_text())
    assert env["mode"] == "cpu-quick"
    assert {n: r["status"] for n, r in env["sections"].items()} == dict.fromkeys(gpu_check.SECTIONS, "ok")
    assert env["machine"]["versions"]["torch"] and env["machine"]["versions"]["numpy"]
    log = (folder / "log.txt").read_text()
    for name in gpu_check.SECTIONS:
        assert f"section {name}: ok" in log


def test_gemm_measurements_and_calibration_are_what_the_cli_reads(folder: Path) -> None:
    m = read_measurements(folder / "gemm.csv")  # the file moebalance calibrate takes
    rows = _rows(folder / "gemm.csv")
    assert m.seconds.size == len(rows) > 0 and all(s > 0 for s in m.seconds)
    setup = gpu_check.Setup.make(False, quick=True)
    kernels = {r["kernel"] for r in rows}
    assert kernels <= {"bmm", "grouped_mm"} and "bmm" in kernels
    assert len(rows) == len(kernels) * len(setup.gemm_shapes) * len(setup.gemm_experts) * len(setup.gemm_tokens)
    cal = read_calibration(folder / "calibration.json")[0]
    assert 0 < cal.flops_efficiency <= 1 and 0 < cal.bandwidth_efficiency <= 1 and cal.launch_us >= 0
    fits = json.loads((folder / "env.json").read_text())["sections"]["gemm"]["result"]["fits"]
    assert {f"{k}/all" for k in kernels} <= set(fits)


def test_straggler_is_the_slowest_virtual_gpu_and_every_pick_is_served(folder: Path) -> None:
    points = _rows(folder / "straggler.csv")
    gpus = _rows(folder / "straggler_gpus.csv")
    assert points and gpus
    by_point: dict[tuple[str, ...], list[dict[str, str]]] = defaultdict(list)
    key = ("workload", "regime", "plan", "batch", "layer")
    for r in gpus:
        by_point[tuple(r[k] for k in key)].append(r)
    assert len(by_point) == len(points)
    for p in points:
        rows = by_point[tuple(p[k] for k in key)]
        assert len(rows) == int(p["gpus"])
        assert float(p["measured_s"]) == max(float(r["measured_s"]) for r in rows)
        assert float(p["modelled_uncal_s"]) == max(float(r["modelled_uncal_s"]) for r in rows)
        assert int(p["picks"]) == sum(int(r["picks"]) for r in rows)
        for r in rows:  # an idle GPU costs nothing, a busy one something
            assert (float(r["measured_s"]) > 0) == (int(r["picks"]) > 0) == (int(r["touched"]) > 0)
    # every pick of the batch is served: the esft-law batches hold 512 tokens x top-6, the synthetic DeepSeek-V3 ones
    # the setup's tokens (prefill) or its subsample (decode) x top-8
    setup = gpu_check.Setup.make(False, quick=True)
    want = {("esft-law", "real"): 512 * 6, ("deepseek-v3-synth", "prefill"): setup.v3_tokens * 8,
            ("deepseek-v3-synth", "decode"): setup.v3_decode_tokens * 8}
    assert {(p["workload"], p["regime"]) for p in points} == set(want)
    for p in points:
        assert int(p["picks"]) == want[(p["workload"], p["regime"])]
    # every plan on every point
    plans = defaultdict(set)
    for p in points:
        plans[(p["workload"], p["regime"], p["batch"], p["layer"])].add(p["plan"])
    assert all(v == {"contiguous", "eplb", "craft", "libra"} for v in plans.values())


def test_modelled_time_is_the_roofline_by_hand(folder: Path) -> None:
    """One GPU's modelled time with the published H100 peaks, worked out from the formula in cost/time.py."""
    setup = gpu_check.Setup.make(False, quick=True)
    H, F = setup.expert_size
    gpu = GPUS["h100-80gb"]  # the CPU mode models against the H100's spec
    busy = [r for r in _rows(folder / "straggler_gpus.csv") if int(r["picks"]) > 0]
    for r in busy[:: max(1, len(busy) // 7)]:
        n, u = int(r["picks"]), int(r["touched"])
        flops = 6 * H * F * n / (gpu.bf16_tflops * 1e12)
        memory = (u * 3 * H * F * 2 + 2 * n * H * 2) / (gpu.memory_bandwidth * 1e9)
        assert math.isclose(float(r["modelled_uncal_s"]), max(flops, memory), rel_tol=1e-6)
        assert float(r["modelled_cal_s"]) > 0


def test_the_runtime_equals_the_dense_reference(folder: Path) -> None:
    doc = json.loads((folder / "runtime.json").read_text())
    assert doc["device"] == "cpu"
    assert {(c["backend"], c["world_size"]) for c in doc["cases"]} == {("gloo", 1), ("gloo", 2)}
    assert any(c["case"].startswith("libra-prefetch") for c in doc["cases"])  # the prefetch buffer's copies ran
    for c in doc["cases"]:
        assert c["pass"], c
        assert c["max_abs_error"] <= c["tolerance"]
    assert all(launch.get("error") is None for launch in doc["launches"])
    (cli,) = doc["cli"]  # moebalance run as rank 0 of a one-rank torchrun environment
    assert cli["pass"] and cli["exit_code"] == 0 and cli["routing_mismatches"] == 0
    assert cli["max_abs_logit_diff"] <= cli["logit_tolerance"]


def test_the_planner_section_times_the_cpu_planner(folder: Path) -> None:
    doc = json.loads((folder / "planner.json").read_text())
    assert doc["device_planner"]["status"] == "skipped", doc["device_planner"]  # timed on CUDA only
    cpu = doc["cpu_planner"]
    assert cpu["prefetch_median_seconds"] > 0 and cpu["rebalance_router_median_seconds"] > 0
    assert cpu["exact_plan_layer"]["status"] in ("absent", "present"), cpu


def test_the_report_of_a_cpu_run(folder: Path, tmp_path: Path) -> None:
    text = gpu_report.report(folder, tmp_path / "gpu.md", tmp_path / "gpu.png")
    assert (tmp_path / "gpu.md").read_text() == text
    assert "comes from the CPU mode" in text  # never mistaken for GPU numbers
    for heading in ("## Grouped GEMM", "## Expert parallelism on one GPU", "## The runtime", "## The planner"):
        assert heading in text
    for plan in ("contiguous", "eplb", "craft", "libra"):
        assert f"| {plan} |" in text
    assert "### esft-law, real" in text and "### deepseek-v3-synth, decode" in text
    assert "**fail**" not in text
    assert (tmp_path / "gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![grouped GEMM and straggler times](gpu.png)" in text


def test_kendall_tau_and_order_by_hand() -> None:
    assert gpu_report.kendall_tau([1, 2, 3], [1, 2, 3]) == 1.0
    assert gpu_report.kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    assert gpu_report.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)  # pairs: +1, +1, -1
    assert gpu_report.kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 3)  # the tied pair counts as neither
    assert math.isnan(gpu_report.kendall_tau([1], [2]))
    assert gpu_report.order(["a", "b", "c"], [0.3, 0.1, 0.2]) == ["b", "c", "a"]


def _write_folder(path: Path, measured: dict[str, float], modelled: dict[str, float]) -> None:
    """A minimal gpu_check folder: env.json and one point per plan (calibrated = peaks here)."""
    path.mkdir()
    gpu_check.write_json(path / "env.json", {"mode": "cuda", "machine": {"device_name": "NVIDIA H100 80GB HBM3",
                                                                        "gpu_spec": "h100-80gb"},
                                             "sections": {"straggler": {"status": "ok", "seconds": 1.0}}})
    rows = [{"workload": "w", "regime": "decode", "plan": p, "router": "uniform", "batch": 0, "layer": 0, "gpus": 2,
             "picks": 10, "measured_s": measured[p], "modelled_uncal_s": modelled[p], "modelled_cal_s": modelled[p],
             "measured_gpu": 0, "modelled_gpu": 0} for p in measured]
    gpu_check.write_csv(path / "straggler.csv", gpu_check.STRAGGLER_COLUMNS, rows)


def test_the_report_says_whether_the_orders_agree(tmp_path: Path) -> None:
    _write_folder(tmp_path / "same", {"a": 1e-3, "b": 2e-3, "c": 3e-3}, {"a": 0.5e-3, "b": 0.9e-3, "c": 2e-3})
    text = gpu_report.report(tmp_path / "same", tmp_path / "same.md", None)
    assert "By modelled time (peaks): a < b < c: the same (Kendall's tau +1.00)" in text
    assert "in 2 of 2 comparisons" in text
    _write_folder(tmp_path / "swapped", {"a": 1e-3, "b": 2e-3, "c": 3e-3}, {"a": 0.5e-3, "b": 2e-3, "c": 0.9e-3})
    text = gpu_report.report(tmp_path / "swapped", tmp_path / "swapped.md", None)
    assert "By modelled time (peaks): a < c < b: **a different** order (Kendall's tau +0.33)" in text
    assert "in 0 of 2 comparisons" in text
    assert "comes from the CPU mode" not in text and "NVIDIA H100 80GB HBM3" in text
    assert "No grouped-GEMM measurements" in text and "No runtime results" in text  # missing parts are said


_KILLED_WRITER = """
import os, sys
from moebalance.core.io import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_text("half")
    os._exit(9)
"""


def test_a_failing_or_overrunning_section_is_recorded_and_the_next_runs(tmp_path: Path) -> None:
    """Through the child processes a device run uses: gemm cannot write its CSV (a folder is in the way), straggler
    is stopped after its budget, planner still runs; the command itself succeeds, and the temporary of a writer
    killed mid-write is gone from the folder."""
    out = tmp_path / "out"
    (out / "gemm.csv").mkdir(parents=True)
    # a writer of straggler.csv killed mid-write, as a stopped section's is, leaves its temporary in the folder
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(out / "straggler.csv")], timeout=60,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert killed.returncode == 9 and [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--out", str(out), "--quick", "--sections",
                           "gemm,straggler,planner", "--budgets", "straggler=0.05", "--grace", "0"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    env = json.loads((out / "env.json").read_text())
    sections = env["sections"]
    assert sections["gemm"]["status"] == "error"
    assert sections["gemm"]["error"].startswith("IsADirectoryError") and "\n" not in sections["gemm"]["error"]
    assert sections["straggler"]["status"] == "timeout" and "stopped after" in sections["straggler"]["error"]
    assert sections["planner"]["status"] == "ok"
    assert (out / "planner.json").is_file() and not (out / "straggler.csv").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary is left to come back
    assert "== gemm: error" in proc.stdout and "planner| " in proc.stdout  # children's output echoed


def test_grouped_kernels_equal_the_per_expert_products() -> None:
    """Both kernels the GPU run times, on ragged groups in every weight layout, against one matmul per expert."""
    import torch

    bench_gemm: Any = importlib.import_module("bench_gemm")
    cpu = torch.device("cpu")
    usable, why = bench_gemm.usable_kernels(cpu, torch.float32)
    assert set(usable) == {"bmm", "grouped_mm"}, why
    assert bench_gemm.check_kernel("nope", cpu, torch.float32, bench_gemm.LAYOUTS[0]).startswith("nope: ValueError")
    tokens = [5, 1, 9]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(tokens) + 1, 32, generator=gen)
    for layout in bench_gemm.LAYOUTS:
        pool = bench_gemm.WeightPool(4, 32, 16, cpu, torch.float32, transposed=layout.transposed)
        w = pool.take(3)
        assert pool.take(2)[0].shape[0] == 2 and pool.take(1)[0].shape[0] == 1  # windows wrap inside the pool
        want = torch.cat([(torch.nn.functional.silu(x[a:b] @ w[0][i]) * (x[a:b] @ w[1][i])) @ w[2][i]
                          for i, (a, b) in enumerate(zip([0, 5, 6], [5, 6, 15], strict=True))])
        got = bench_gemm.RaggedRun("grouped_mm", tokens, x, w, pad_row=layout.pad_row)()[:15]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
