"""The jobs of ``bench/gpu_check.py``'s straggler section, rebuilt on the CPU beside what the device measured.

The committed device run (``docs/results/gpu/``: ``env.json``, ``straggler.csv``, ``straggler_gpus.csv``) timed,
for every workload, regime, measured batch, plan and layer, each virtual GPU's grouped GEMM on its picks per
expert. Those picks are computed on the CPU from seeded generators, so they can be rebuilt here exactly, with
gpu_check's own pieces: ``_workloads`` and ``_plans`` under the ``Setup`` of the mode ``env.json`` records,
``_points`` for a measured batch (and its decode subsample), the oracle predictor and ``batch_plan`` for Libra's
plan (``rebalance`` router), and the router seeds ``np.random.default_rng((0, batch))``.

``straggler_points()`` returns one dict per row of ``straggler.csv`` (in its order) with the rebuilt ``picks``
``[G, E]`` and the measured seconds per GPU from ``straggler_gpus.csv``; it checks every GPU's picks, experts
touched and largest count per expert against that file and raises if one differs.

The ESFT workload is the bundled trace (``bundled:esft-law``, shipped in ``moebalance/workloads/data``), so no
``MOEBALANCE_ESFT_DIR`` is needed; no CUDA either, though torch (CPU) is imported by the EPLB planner. About 25 s.
Run ``.venv/bin/python bench/straggler_points.py`` for the check on its own.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import gpu_check as gc  # noqa: E402  (puts src/ on sys.path where moebalance is not installed)
import numpy as np  # noqa: E402

#: Where the committed device run wrote its files.
RESULTS = BENCH.parent / "docs" / "results" / "gpu"
#: A row's key, as both CSVs spell it.
KEY = ("workload", "regime", "plan", "router", "batch", "layer")


def device_setup(results: Path = RESULTS) -> gc.Setup:
    """The ``Setup`` of the mode the device run recorded in ``env.json`` (``cuda``, ``cpu`` or ``cpu-quick``)."""
    env = json.loads((results / "env.json").read_text())
    mode = env.get("mode")
    if mode not in ("cuda", "cpu", "cpu-quick"):
        raise ValueError(f"{results / 'env.json'}: unknown mode {mode!r}")
    return gc.Setup.make(mode == "cuda", quick=mode == "cpu-quick")


def _jobs(ctx: gc.Ctx) -> Iterator[tuple[Any, str, int, str, str, int, np.ndarray]]:
    """``(workload, regime, batch, plan, router, layer, picks [G, E])`` as ``section_straggler`` builds them
    (``gpu_check.straggler_jobs``)."""
    for wl in gc._workloads(ctx):
        jobs, _, _, _ = gc.straggler_jobs(wl, ctx)
        for regime, b, layer, name, router, picks in jobs:
            yield wl, regime, b, name, router, layer, picks.astype(np.int64)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _key(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(row[k]) for k in KEY)


def straggler_points(results: Path = RESULTS) -> list[dict[str, Any]]:
    """One dict per row of ``straggler.csv`` (its order): ``workload, regime, plan, router, batch, layer``,
    ``model`` (the workload's ``ModelSpec``), ``picks`` (int64 ``[G, E]``, rebuilt) and ``measured_gpu_s``
    (float64 ``[G]``, 0 where a GPU had no picks). Raises ``AssertionError`` where a rebuilt GPU's picks, experts
    touched or largest count per expert differ from ``straggler_gpus.csv``, or where a row has no rebuilt job."""
    setup = device_setup(results)
    ctx = gc.Ctx(out=results, setup=setup, clock=gc.Clock(math.inf), log=lambda _msg: None)
    rows = _read_csv(results / "straggler.csv")
    per_gpu: dict[tuple[str, ...], dict[int, dict[str, str]]] = {}
    for r in _read_csv(results / "straggler_gpus.csv"):
        per_gpu.setdefault(_key(r), {})[int(r["gpu"])] = r
    wanted = {_key(r) for r in rows}
    built: dict[tuple[str, ...], dict[str, Any]] = {}
    for wl, regime, b, name, router, layer, picks in _jobs(ctx):
        point = {"workload": wl.name, "regime": regime, "plan": name, "router": router, "batch": b,
                 "layer": layer, "model": wl.model, "picks": picks}
        key = _key(point)
        if key in wanted:  # a device run stopped by its deadline measured only the first jobs
            built[key] = point
    missing = wanted - built.keys()
    assert not missing, f"{len(missing)} rows of straggler.csv have no rebuilt job, e.g. {sorted(missing)[0]}"
    out = []
    bad: list[str] = []
    for r in rows:
        key = _key(r)
        point = built[key]
        picks = point["picks"]
        G = picks.shape[0]
        gpus = per_gpu.get(key, {})
        assert sorted(gpus) == list(range(G)) == list(range(int(r["gpus"]))), \
            f"{key}: straggler_gpus.csv has GPUs {sorted(gpus)}, the rebuilt plan {G}"
        want = np.array([[int(gpus[g][c]) for c in ("picks", "touched", "max_tokens_per_expert")]
                         for g in range(G)], dtype=np.int64)
        got = np.stack([picks.sum(axis=1), (picks > 0).sum(axis=1), picks.max(axis=1)], axis=1)
        if not np.array_equal(got, want):
            g = int(np.flatnonzero((got != want).any(axis=1))[0])
            bad.append(f"{key} GPU {g}: rebuilt (picks, touched, max) {got[g].tolist()}, measured {want[g].tolist()}")
        if int(picks.sum()) != int(r["picks"]):
            bad.append(f"{key}: rebuilt {int(picks.sum())} picks in all, straggler.csv {r['picks']}")
        measured = np.array([float(gpus[g]["measured_s"] or 0.0) for g in range(G)], dtype=np.float64)
        measured[picks.sum(axis=1) == 0] = 0.0
        out.append({**point, "measured_gpu_s": measured})
    assert not bad, f"{len(bad)} rebuilt points differ from the device run's:\n" + "\n".join(bad[:10])
    return out


def main() -> int:
    t0 = time.perf_counter()
    points = straggler_points()
    seconds = time.perf_counter() - t0
    gpus = sum(p["picks"].shape[0] for p in points)
    by: dict[str, int] = {}
    for p in points:
        by[p["workload"]] = by.get(p["workload"], 0) + 1
    setup = device_setup()
    print(f"setup: {'cuda' if setup.cuda else 'cpu'} ({setup.measure_batches} measured "
          f"batches, {setup.layers_per_point} layers per point)")
    print(f"rebuilt and matched {len(points)} points ({gpus} GPU rows): "
          + ", ".join(f"{k} {v}" for k, v in by.items()))
    print(f"elapsed {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
