"""The README's screenshot of the HTML report (``report.html``, :mod:`moebalance.app.html_report`).

Builds the page ``moebalance compare --out-dir`` writes for the bundled real routing (``bundled:esft-law``,
DeepSeek-V2-Lite's ESFT law task) on 1 node x 8 GPUs with 9 expert slots per GPU: contiguous, greedy, EPLB and
CRAFT planned on the first half of the batches, scored on the held-out half and modelled on H100s; then renders it
in headless Chromium (Debian's ``chromium`` package) at 1,200 px wide and saves the whole page as
docs/results/report.png (kept under 300 KB; ``--html PATH`` also keeps the page).

Run: .venv/bin/python bench/report_screenshot.py [--browser PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT

from moebalance.app.compare import Scenario, run_comparison
from moebalance.app.html_report import compare_report
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.io import atomic_path
from moebalance.core.load import read_bundled
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.pricing.goodput import price_plan

WIDTH = 1200
LIMIT = 300 * 1024
#: Where the page ends, for a screenshot of all of it.
PROBE = "<script>document.body.setAttribute('data-height', document.documentElement.scrollHeight);</script>"


def build(out: Path) -> Path:
    load = read_bundled("esft-law")
    cluster, budget = Cluster(num_nodes=1, gpus_per_node=8), Budget(slots_per_gpu=9)
    model = get_model(load.preset or "deepseek-v2-lite")
    deployment = Deployment(model=model, gpu=get_gpu("h100-80gb"))
    scenarios = [Scenario(p, budget, {}, "uniform", plan_name=p) for p in ("contiguous", "greedy", "eplb", "craft")]
    rows, plans = run_comparison(load, cluster, scenarios,
                                 price=lambda plan, test, router: price_plan(plan, test, deployment, router=router))
    train, test = load.split(0.5)
    title = (f"bundled:esft-law ({model.display_name}, the ESFT law task): {load.num_layers} layers x "
             f"{load.num_experts} experts on 1x8 GPUs, {budget.describe()}, planned on {train.num_batches} batches, "
             f"scored on {test.num_batches} held-out (uniform router); modelled on h100-80gb")
    return compare_report(rows, plans, scenarios, test, title).write(out)


def chromium(browser: str, page: Path, profile: Path, *args: str) -> str:
    cmd = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run", f"--user-data-dir={profile}", *args, page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True).stdout


def shoot(browser: str, page: Path, png: Path) -> int:
    """Screenshot all of ``page`` into ``png`` (palette PNG if the full-colour one is over the limit); its bytes."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        probe = tmp / "probe.html"
        probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
        dom = chromium(browser, probe, tmp / "profile", f"--window-size={WIDTH},1000", "--dump-dom")
        found = re.search(r'data-height="(\d+)"', dom)
        height = int(json.loads(found.group(1))) if found else 2400
        raw = tmp / "shot.png"
        chromium(browser, page, tmp / "profile", f"--window-size={WIDTH},{height}", f"--screenshot={raw}")
        with Image.open(raw) as im:
            img = im.convert("RGB")
        with atomic_path(png) as out:
            img.save(out, format="PNG", optimize=True)
            if out.stat().st_size > LIMIT:
                img.quantize(colors=256, dither=Image.Dither.NONE).save(out, format="PNG", optimize=True)
        return png.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--browser", help="Chromium's binary (default: chromium, chromium-browser or google-chrome)")
    parser.add_argument("--html", type=Path, help="also keep the page here")
    args = parser.parse_args()
    browser = args.browser or next((b for b in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                                         "google-chrome")) if b), None)
    if browser is None:
        sys.exit("report_screenshot.py: no Chromium found; install Debian's chromium package or give --browser")
    png = ROOT / "docs" / "results" / "report.png"
    with tempfile.TemporaryDirectory() as tmp:
        page = build(args.html or Path(tmp) / "report.html")
        size = shoot(browser, page, png)
        kept = f"{page} ({page.stat().st_size:,} bytes) and " if args.html else ""
    print(f"wrote {kept}{png.relative_to(ROOT)} ({size:,} bytes{', over the limit' if size > LIMIT else ''})")
    if size > LIMIT:
        sys.exit(1)


if __name__ == "__main__":
    main()
