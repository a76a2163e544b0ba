"""The README's screenshot of ``watch --dashboard`` (:mod:`moebalance.app.dashboard`).

Feeds a watcher the records of a drifting synthetic OLMoE-1B-7B trace (``synth``'s routing model, popularity drifting
fast: AR(1) log-popularity, standard deviation 0.8, correlation time 4 records), 24 records of 4,096 tokens on
2 x 4 H100s with 10 slots per GPU and layer, EPLB re-plans on the last 4 records priced as prefill steps (the default
profile) over 600 s, adopting each re-plan it decides; renders the page the dashboard would serve after the last
record in headless Chromium and saves it as docs/results/dashboard.png (bench/report_screenshot.py's renderer).

Run: .venv/bin/python bench/dashboard_screenshot.py [--browser PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

from _common import ROOT
from report_screenshot import LIMIT, shoot

from moebalance.app.dashboard import page
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.cost.calibrate import resolve_calibration
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.online.rearrange import Replanning
from moebalance.online.watch import WatchConfig, Watcher
from moebalance.pricing.step import StepPricing
from moebalance.workloads.profiles import routing_profile
from moebalance.workloads.synth import synthesize


def observations() -> list:  # type: ignore[type-arg]
    model = get_model("olmoe-1b-7b")
    profile = dataclasses.replace(routing_profile(model), drift_sigma=0.8, drift_timescale=4.0)
    counts = synthesize(model.name, num_batches=24, tokens_per_batch=4096, num_gpus=8, seed=1,
                        profile=profile)["counts"]
    gpu = get_gpu("h100-80gb")
    pricing = StepPricing(deployment=Deployment(model=model, gpu=gpu, calibration=resolve_calibration(None, gpu.name)[0]),
                          phase="prefill")
    watcher = Watcher(WatchConfig(cluster=Cluster(num_nodes=2, gpus_per_node=4), budget=Budget(slots_per_gpu=10),
                                  window=4, horizon_s=600.0,
                                  replanning=Replanning(migration="aligned", rearrange="async"), pricing=pricing))
    out = []
    for i, c in enumerate(counts):
        o = watcher.observe(c, f"record-{i:03d}.npz")
        if o.decision == "replan" and o.plan is not None:
            watcher.adopt(o.plan)
        out.append(o)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--browser", help="Chromium's binary (default: chromium, chromium-browser or google-chrome)")
    args = parser.parse_args()
    browser = args.browser or next((b for b in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                                         "google-chrome")) if b), None)
    if browser is None:
        sys.exit("dashboard_screenshot.py: no Chromium found; install Debian's chromium package or give --browser")
    obs = observations()
    html = page(obs, "moebalance watch: records", "2 x 4 GPUs, eplb re-plans on the last 4 records, over 600 s of "
                "serving", 5)
    png = ROOT / "docs" / "results" / "dashboard.png"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dashboard.html"
        path.write_text(html.replace('<meta http-equiv="refresh" content="5">', ""), encoding="utf-8")
        size = shoot(browser, path, png)
    replans = sum(o.decision == "replan" for o in obs)
    print(f"wrote {png.relative_to(ROOT)} ({size:,} bytes; {len(obs)} records, {replans} re-plans)")
    if size > LIMIT:
        sys.exit(1)


if __name__ == "__main__":
    main()
