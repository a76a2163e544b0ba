"""The HTML report in a real headless browser (Chromium, driven by its own command line): the pages of ``compare``
and ``online`` on the bundled ESFT routing load with no console message, show the recommendation in the rendered
page, and a screenshot holds the charts (each chart's region, located by the browser, is drawn in the report's
colours).

Skipped only where no Chromium is installed (Debian: ``apt-get install chromium``); ``.ci/run`` installs it and sets
``MOEBALANCE_REQUIRE_BROWSER=1``, which turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from moebalance.app.compare import Scenario, run_comparison
from moebalance.app.html_charts import CATEGORICAL, sequential
from moebalance.app.html_report import Report, compare_report, online_report
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.load import read_bundled
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import replay
from moebalance.pricing.step import StepPricing

WIDTH, HEIGHT = 1200, 3000
#: Appended to a copy of the page: records where each chart was laid out, for --dump-dom to print.
PROBE = ("<script>document.body.setAttribute('data-probe', JSON.stringify([...document.querySelectorAll("
         "'svg.chart')].map(e => { const b = e.getBoundingClientRect(); return [e.getAttribute('class'), b.x, "
         "b.y + window.scrollY, b.width, b.height]; })));</script>")


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def chromium() -> str:
    found = _browser()
    if found is None:
        if os.environ.get("MOEBALANCE_REQUIRE_BROWSER") == "1":
            pytest.fail("MOEBALANCE_REQUIRE_BROWSER=1 but no chromium, chromium-browser or google-chrome is on PATH "
                        "(Debian: apt-get install chromium)")
        pytest.skip("no headless browser: install Debian's chromium package (apt-get install chromium)")
    return found


def run_browser(chromium: str, page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Chromium headless on ``page`` with console messages logged to stderr; its own profile folder, so that runs in
    parallel do not share one."""
    cmd = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run", "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}",
           f"--window-size={WIDTH},{HEIGHT}", *args, page.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def console_messages(stderr: str) -> list[str]:
    """The page's console output in Chromium's log (``...:CONSOLE...``), uncaught errors included."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def charts(chromium: str, page: Path, tmp: Path) -> list[tuple[str, int, int, int, int]]:
    """``(class, x, y, width, height)`` of every chart as the browser lays the page out."""
    probed = tmp / f"probe-{page.name}"
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = run_browser(chromium, probed, tmp / "profile-probe", "--dump-dom").stdout
    found = re.search(r'data-probe="([^"]*)"', dom)
    assert found, "the probe did not run"
    boxes = json.loads(found.group(1).replace("&quot;", '"'))
    return [(c, round(x), round(y), round(w), round(h)) for c, x, y, w, h in boxes]


def screenshot(chromium: str, page: Path, tmp: Path) -> tuple[np.ndarray, str]:
    """``(uint8 [H, W, 3] pixels, the browser's stderr)`` of ``page`` rendered at WIDTH x HEIGHT."""
    from PIL import Image

    png = tmp / f"{page.stem}.png"
    done = run_browser(chromium, page, tmp / "profile-shot", f"--screenshot={png}")
    with Image.open(png) as im:
        return np.asarray(im.convert("RGB")), done.stderr


def rgb(colour: str) -> np.ndarray:
    return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])


def near(pixels: np.ndarray, colours: list[str], tol: int = 24) -> int:
    """Pixels within ``tol`` (per channel) of any of ``colours``."""
    flat = pixels.reshape(-1, 3).astype(np.int64)
    hit = np.zeros(flat.shape[0], dtype=bool)
    for c in dict.fromkeys(colours):
        hit |= np.all(np.abs(flat - rgb(c)) <= tol, axis=1)
    return int(hit.sum())


def drawn_series(region: np.ndarray) -> int:
    """How many series colours a line chart's region shows (not only its axes: each line is 150 pixels or more)."""
    return sum(near(region, [c]) > 150 for c in CATEGORICAL[:-2])  # grey and black also draw the axes


def check_page(chromium: str, page: Path, tmp: Path, recommendation: str) -> dict[str, list[np.ndarray]]:
    """Load ``page``: no console message, ``recommendation`` in the rendered DOM; returns each chart kind's screenshot
    regions."""
    dom = run_browser(chromium, page, tmp / "profile-dom", "--dump-dom")
    assert not console_messages(dom.stderr)
    assert recommendation in dom.stdout
    assert 'class="recommendation"' in dom.stdout
    pixels, stderr = screenshot(chromium, page, tmp)
    assert pixels.shape[:2] == (HEIGHT, WIDTH)
    assert not console_messages(stderr)
    regions: dict[str, list[np.ndarray]] = {}
    for cls, x, y, w, h in charts(chromium, page, tmp):
        assert 0 <= x and x + w <= WIDTH and y + h <= HEIGHT, f"{cls} at {x},{y} {w}x{h} is outside the screenshot"
        kind = cls.split()[-1]
        regions.setdefault(kind, []).append(pixels[y:y + h, x:x + w])
    return regions


@pytest.fixture(scope="module")
def esft_pages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, str]:
    """``(compare page, online page, their recommendations' first words)`` on the bundled ESFT routing."""
    tmp = tmp_path_factory.mktemp("pages")
    load = read_bundled("esft-law")
    cluster, budget = Cluster(num_nodes=1, gpus_per_node=8), Budget(slots_per_gpu=9)
    scenarios = [Scenario(p, budget, {}, "uniform", plan_name=p) for p in ("contiguous", "greedy", "eplb")]
    rows, plans = run_comparison(load, cluster, scenarios)
    compare = compare_report(rows, plans, scenarios, load.split(0.5)[1], "bundled:esft-law on 1 x 8 GPUs")
    pricing = StepPricing(deployment=Deployment(model=get_model("deepseek-v2-lite"), gpu=get_gpu("h100-80gb")),
                          router_ms=0.05)
    results = [replay(load, cluster, budget, "eplb", {}, warmup=(0, 4), replanning=Replanning(every=4, window=4),
                      pricing=pricing),
               replay(load, cluster, budget, "libra", {"n": 2, "predictor": "path"}, warmup=(0, 4), pricing=pricing)]
    online = online_report(results, "bundled:esft-law served after 4 warm-up batches")
    return (compare.write(tmp / "compare.html"), online.write(tmp / "online.html"),
            "Best by held-out balancedness: eplb", "Fastest in the replay:")


def test_compare_page_in_browser(chromium: str, esft_pages: tuple[Path, Path, str, str], tmp_path: Path) -> None:
    page, _, recommendation, _ = esft_pages
    regions = check_page(chromium, page, tmp_path, recommendation)
    assert len(regions["heatmap"]) == 2 and len(regions["colorbar"]) == 1 and len(regions["lines"]) == 2
    scale = sequential(np.linspace(0.0, 1.0, 256), 0.0, 1.0)
    for region in regions["heatmap"]:
        # 26 layers x 8 GPUs of cells fill most of the map, in the scale's colours, in many shades
        assert near(region, scale, tol=2) > 0.5 * region.shape[0] * region.shape[1]
        assert len(np.unique(region.reshape(-1, 3), axis=0)) > 40
    for region in regions["lines"]:
        assert drawn_series(region) >= 2


def test_online_page_in_browser(chromium: str, esft_pages: tuple[Path, Path, str, str], tmp_path: Path) -> None:
    _, page, _, recommendation = esft_pages
    regions = check_page(chromium, page, tmp_path, recommendation)
    assert len(regions["lines"]) == 2 and len(regions["bars"]) == 1
    (bars,) = regions["bars"]
    assert near(bars, [CATEGORICAL[0]], tol=2) > 100  # the steps without balancing, as solid bars
    for region in regions["lines"]:
        assert drawn_series(region) == 2


def test_advise_page_in_browser(chromium: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``advise --out-dir``'s page: no console errors, the recommendation rendered, the load heatmaps (EPLB off and
    the recommendation) and the step bars drawn."""
    from conftest import run_cli

    out = tmp_path / "advice"
    stats = Path(__file__).parent / "data" / "sglang-deepseek-v3" / "decode_in1000out1000.json"
    rc, _, err = run_cli(["advise", "--load", stats, "--nodes", 8, "--gpus-per-node", 8, "--gpu", "h100-80gb",
                          "--out-dir", out], capsys)
    assert rc == 0, err
    label = json.loads((out / "advise.json").read_text())["recommendation"]["label"]
    assert "off" not in label  # something beats EPLB off on DeepSeek-V3's decode
    regions = check_page(chromium, out / "report.html", tmp_path, f"Run {label} on sglang")
    assert len(regions["heatmap"]) == 2 and len(regions["bars"]) == 1
    for region in regions["heatmap"]:
        assert len(np.unique(region.reshape(-1, 3), axis=0)) > 40
    assert near(regions["bars"][0], [CATEGORICAL[0]], tol=2) > 100


def test_console_errors_are_caught(chromium: str, tmp_path: Path) -> None:
    """The check itself: a page whose script throws is seen to log to the console; the report's page has none."""
    page = tmp_path / "broken.html"
    page.write_text(Report("broken").html().replace("</body>", "<script>undefinedFunction();</script></body>"),
                    encoding="utf-8")
    done = run_browser(chromium, page, tmp_path / "profile", "--dump-dom")
    assert any("undefinedFunction" in line for line in console_messages(done.stderr))


def test_watch_dashboard_in_browser(chromium: str, tmp_path: Path) -> None:
    """``watch --dashboard``: a real process follows a folder of records (a hot spot under contiguous blocks, so the
    first record decides a re-plan); its page, fetched over HTTP, loads in the browser without console errors, says
    the decision, and draws the balance heatmap and the two line charts."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from moebalance.runtime import free_port

    folder = tmp_path / "records"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        p = np.full(64, 0.4 / 56)
        p[:8] = 0.6 / 8
        np.savez(folder / f"r{i}.npz", counts=rng.multinomial(40_000, p, size=(1, 16)).astype(np.int64),
                 preset=np.array("olmoe-1b-7b"))
        os.utime(folder / f"r{i}.npz", (1_000 + i, 1_000 + i))
    port = free_port()
    log = tmp_path / "watch.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "moebalance", "watch", str(folder), "--nodes", "2",
                             "--gpus-per-node", "4", "--slots-per-gpu", "10", "--model", "olmoe-1b-7b", "--gpu",
                             "h100-80gb", "--phase", "prefill", "--margin", "0", "--log", str(log), "--interval", "1",
                             "--dashboard", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
            time.sleep(0.3)
        assert log.exists() and len(log.read_text().splitlines()) == 3
        html = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert '<meta http-equiv="refresh" content="1">' in html
    page = tmp_path / "dashboard.html"
    page.write_text(html)
    regions = check_page(chromium, page, tmp_path, "r2.npz: ")
    assert "replan" in html and "Hottest experts" in html
    assert len(regions["heatmap"]) == 1 and len(regions["lines"]) == 2
    (heat,) = regions["heatmap"]
    scale = sequential(np.linspace(0.0, 1.0, 256), 0.0, 1.0)
    assert near(heat, scale, tol=2) > 0.3 * heat.shape[0] * heat.shape[1]  # 16 layers x 3 records of cells
    assert drawn_series(regions["lines"][0]) == 2  # tokens/s now and after the re-plan
