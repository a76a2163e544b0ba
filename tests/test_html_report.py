"""The self-contained HTML report (:mod:`moebalance.app.html_report`, :mod:`moebalance.app.html_charts`): the page's
structure read back with the standard library's HTML parser (sections, the SVG cells, points and bars), escaping,
nothing fetched at view time, the same bytes for the same input, atomic writes; the heatmaps' numbers on a
hand-derived plan and load; the pages of ``compare`` and ``online`` on the bundled ESFT routing. The page in a real
browser: ``tests/test_html_browser.py``."""

from __future__ import annotations

import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_cli

from moebalance.app.compare import Scenario, run_comparison
from moebalance.app.html_charts import (
    MISSING,
    nice_ticks,
    oklab_lightness,
    sequential,
    short_number,
)
from moebalance.app.html_report import Report, compare_report, online_report, relative_loads
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_bundled
from moebalance.core.plan import Placement
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.online.rearrange import Replanning
from moebalance.online.replay import replay
from moebalance.pricing.goodput import price_plan
from moebalance.pricing.step import StepPricing


class Page(HTMLParser):
    """Every element as ``(tag, attrs, enclosing section id or None)``, and the text under each section."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str], str | None]] = []
        self.texts: dict[str | None, list[str]] = {}
        self._section: list[str | None] = [None]
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        d = {k: v or "" for k, v in attrs}
        self.elements.append((tag, d, self._section[-1]))
        if tag == "section":
            self._section.append(d.get("id"))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}, self._section[-1]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self._section.pop()

    def handle_data(self, data: str) -> None:
        self.texts.setdefault(self._section[-1], []).append(data)

    def sections(self) -> dict[str, str]:
        """``{heading: section id}``."""
        ids = [a["id"] for t, a, _ in self.elements if t == "section"]
        return {self.heading(i): i for i in ids}

    def heading(self, section: str) -> str:
        return self.texts[section][0]

    def text(self, section: str | None = None) -> str:
        return "".join(self.texts.get(section, []))

    def find(self, tag: str, cls: str | None = None, section: str | None = None) -> list[dict[str, str]]:
        return [a for t, a, s in self.elements if t == tag and (cls is None or cls in a.get("class", "").split())
                and (section is None or s == section)]


def points(polyline: dict[str, str]) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in (p.split(",") for p in polyline["points"].split())]


def small_report(title: str = "t", label: str = "eplb") -> Report:
    rng = np.random.default_rng(0)
    before, after = rng.random((5, 4)) * 3, rng.random((5, 4)) + 0.5
    before[2] = np.nan
    return (Report(title, "subtitle")
            .ranking([[label, "0.91"], ["contiguous", "0.73"], ["greedy", "0.89"]], ["row", "balancedness"])
            .recommendation("run eplb", {"eplb.json": '{"a": 1}', "flags.txt": "--enable-eplb"})
            .heatmap("heat", before, after, labels=("before: contiguous", f"after: {label}"), gpus_per_node=2)
            .lines("per batch", {label: [1.2, 1.1, 1.3, 1.0, 1.05, 1.1, 1.2], "b": [1.0, 1.1, 1.2, np.nan, 1.3, 1.4,
                                                                                     1.2]}, "imbalance", reference=1.0)
            .bars("cost", {label: {"expert": 1.0, "all-to-all": 2.0}, "b": {"expert": 0.0, "all-to-all": 3.0}})
            .note("a note"))


def test_sections_and_their_charts() -> None:
    page = Page(small_report().html())
    sec = page.sections()
    assert list(sec) == ["Ranking", "Recommendation", "heat", "per batch", "cost"]
    # the table: a header of 2 columns, 3 rows, the first highlighted
    assert len(page.find("th", section=sec["Ranking"])) == 2
    rows = page.find("tr", section=sec["Ranking"])
    assert len(rows) == 4 and [r.get("class") for r in rows[1:]] == ["best", None, None]
    # two heatmaps of 5 x 4 cells, one colour bar; the nan layer's 4 cells are grey, on the before map only
    assert len(page.find("svg", "heatmap", sec["heat"])) == 2
    cells = page.find("rect", "cell", sec["heat"])
    assert len(cells) == 2 * 5 * 4
    assert [c["fill"] for c in cells].count(MISSING) == 4
    assert all(c["fill"] == MISSING for c in cells[8:12])
    assert len(page.find("rect", "cbar", sec["heat"])) == 64
    # node boundaries: one line inside each map of 2 nodes x 2 GPUs
    assert sum(1 for a in page.find("line", section=sec["heat"]) if a.get("stroke") == "#ffffff") == 2
    # lines: series 0 is one polyline of 7 points; series 1 breaks at its nan into 3 + 3 points
    lines = page.find("polyline", "series", sec["per batch"])
    by_series = [[len(points(p)) for p in lines if p["data-series"] == s] for s in ("0", "1")]
    assert by_series == [[7], [3, 3]]
    assert len(page.find("line", "reference", sec["per batch"])) == 1
    assert len(page.find("li", section=sec["per batch"])) == 2  # the legend
    # bars: one segment per positive component (b's expert is 0), widths proportional to the values
    segs = page.find("rect", "seg", sec["cost"])
    assert len(segs) == 3
    widths = [float(s["width"]) for s in segs]
    assert widths[1] == pytest.approx(2 * widths[0], abs=0.02) and widths[2] == pytest.approx(3 * widths[0], abs=0.02)
    # the recommendation: its text and each file in a <pre>
    assert "run eplb" in page.text(sec["Recommendation"])
    assert len(page.find("pre", section=sec["Recommendation"])) == 2
    assert '{"a": 1}' in page.text(sec["Recommendation"])
    # the navigation links to every section
    assert [a["href"] for a in page.find("a")] == [f"#{i}" for i in sec.values()]


def test_line_points_follow_the_values() -> None:
    """Higher values sit higher (smaller y), x grows with the index, and every point is inside the chart."""
    page = Page(Report("t").lines("l", {"s": [3.0, 1.0, 2.0]}, "y").html())
    (line,) = page.find("polyline", "series")
    (svg,) = page.find("svg", "lines")
    pts = points(line)
    assert pts[0][0] < pts[1][0] < pts[2][0]
    assert pts[0][1] < pts[2][1] < pts[1][1]
    assert all(0 <= x <= float(svg["width"]) and 0 <= y <= float(svg["height"]) for x, y in pts)


def test_user_strings_are_escaped() -> None:
    evil = '<script>alert("x")</script> & \'q\''
    text = Report(evil, evil).ranking([[evil, 1]], [evil, "n"], name=evil).recommendation(evil, {evil: evil}) \
        .lines(evil, {evil: [1.0, 2.0]}, evil, xlabel=evil).bars(evil, {evil: {evil: 1.0}}, unit=evil) \
        .heatmap(evil, np.ones((2, 2)), labels=(evil, evil), scale_label=evil).note(evil) \
        .assumptions([(evil, evil)], name=evil).html()
    page = Page(text)
    assert not page.find("script")
    assert "<script>" not in text
    assert sum(t.count(evil) for ts in page.texts.values() for t in ts) >= 10


def test_nothing_is_fetched_at_view_time() -> None:
    text = small_report().html()
    page = Page(text)
    refs = [a[k] for _, a, _ in page.elements for k in ("src", "href") if k in a]
    assert refs and all(r.startswith("#") for r in refs)
    assert not re.search(r"https?://|url\(|@import", text)
    assert not page.find("script") and not page.find("link") and not page.find("img")


def test_same_input_same_bytes(tmp_path: Path) -> None:
    a = small_report().write(tmp_path / "a.html").read_bytes()
    b = small_report().write(tmp_path / "b.html").read_bytes()
    assert a == b
    assert a.decode("utf-8") == small_report().html()


def test_write_is_atomic(tmp_path: Path) -> None:
    """Writing over a folder fails after the temporary file is made (the rename): one line, and no file left."""
    target = tmp_path / "report.html"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(InputError, match="is a folder") as info:
        small_report().write(target)
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    assert [p.name for p in target.iterdir()] == ["keep"]
    # a good write replaces the old file whole
    out = tmp_path / "out" / "r.html"
    out.parent.mkdir()
    out.write_text("old")
    assert small_report().write(out) == out and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in out.parent.iterdir()] == ["r.html"]


def test_text_that_is_not_unicode_is_written(tmp_path: Path) -> None:
    """A title from a file name with undecodable bytes (surrogate escapes) is written with ``?``, not refused."""
    data = Report("load-\udcff.npz").write(tmp_path / "r.html").read_bytes()
    assert b"<title>load-?.npz</title>" in data


@pytest.mark.parametrize("build, fragment", [
    (lambda r: r.ranking([["a", "b"]], ["only one"]), "row 0 has 2 cells but there are 1 columns"),
    (lambda r: r.heatmap("h", np.ones((2, 3)), np.ones((3, 2))), "differ in shape"),
    (lambda r: r.heatmap("h", np.ones(3)), "not shape [3]"),
    (lambda r: r.bars("b", {"x": {"c": -1.0}}), "bar 'x' has c = -1.0"),
    (lambda r: r.bars("b", {"x": {"c": float("nan")}}), "give finite values"),
    (lambda r: r.lines("l", {}, "y"), "has no series"),
    (lambda r: r.lines("l", {"s": [1.0, 2.0, 3.0]}, "y", x=[0, 1]), "a series of 3 values but 2 x values"),
    (lambda r: r.lines("l", {"s": [1.0]}, "y", styles=[0, 1]), "1 series but 2 styles"),
])
def test_bad_sections_are_one_line(build: Any, fragment: str) -> None:
    with pytest.raises(InputError, match=re.escape(fragment)) as info:
        build(Report("t"))
    assert "\n" not in str(info.value)


def test_colour_scale() -> None:
    """Light to dark, evenly in lightness (over steps of 15 levels; one level is within 8-bit rounding), ends at the
    given range, nan grey."""
    cols = sequential(np.linspace(0, 1, 256), 0.0, 1.0)
    light = [oklab_lightness(c) for c in cols]
    steps = np.diff(light)
    assert np.all(steps < 0)
    coarse = np.diff(light[::15])
    assert coarse.min() / coarse.max() < 1.25  # no flat stretch: every step darker by a similar amount
    assert light[0] > 0.9 and light[-1] < 0.35
    assert sequential(np.array([-5.0, 0.0, 1.0, 7.0, np.nan]), 0.0, 1.0) == [cols[0], cols[0], cols[-1], cols[-1],
                                                                           MISSING]


@pytest.mark.parametrize("lo, hi", [(0, 1.02), (0.83, 1.31), (0, 123456), (-3.5, 2.25), (1e-4, 7e-4), (5, 5.001)])
def test_nice_ticks(lo: float, hi: float) -> None:
    ticks = nice_ticks(lo, hi, 5)
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** np.floor(np.log10(step))
    assert min(abs(mantissa - m) for m in (1, 2, 5, 10)) < 1e-6
    assert ticks[0] >= lo - 1e-9 and ticks[-1] <= hi + 1e-9 and ticks[0] - step < lo and ticks[-1] + step > hi
    assert 2 <= len(ticks) <= 11
    assert np.allclose(np.diff(ticks), step)


def test_short_numbers() -> None:
    assert [short_number(v) for v in (0, 0.00123, 1.234, 12.34, 1234.5, 277071.6)] == \
        ["0", "0.00123", "1.23", "12.3", "1,234", "277,072"]
    assert [short_number(v, 0.05) for v in (0.0, 0.25)] == ["0.00", "0.25"]
    assert short_number(100000, 20000) == "100,000" and short_number(float("nan")) == "-"


def test_relative_loads_by_hand() -> None:
    """One GPU of two hosts experts 0 and 1, the other 2 and 3 (no replicas, the uniform router):

    batch 0, layer 0: counts [3, 1, 0, 0] -> GPU loads [4, 0], mean 2 -> relative [2, 0], imbalance 2
    batch 1, layer 0: counts [1, 1, 1, 1] -> [2, 2] -> [1, 1], imbalance 1
    layer 1 has no load in either batch -> nan; each batch's imbalance is its layer 0's.
    """
    plan = Placement(gpu_experts=[[[0, 1], [2, 3]], [[0, 1], [2, 3]]], num_experts=4,
                     cluster=Cluster(num_nodes=1, gpus_per_node=2))
    counts = np.zeros((2, 2, 4), dtype=np.int64)
    counts[0, 0] = [3, 1, 0, 0]
    counts[1, 0] = [1, 1, 1, 1]
    heat, imbalance = relative_loads(plan, LoadMatrix(counts), "uniform")
    assert np.allclose(heat[0], [1.5, 0.5]) and np.isnan(heat[1]).all()
    assert np.allclose(imbalance, [2.0, 1.0])


@pytest.fixture(scope="module")
def esft() -> LoadMatrix:
    return read_bundled("esft-law")


def test_compare_report(esft: LoadMatrix) -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=8)
    budget = Budget(slots_per_gpu=9)
    scenarios = [Scenario(p, budget, {}, "uniform", plan_name=p) for p in ("greedy", "contiguous", "eplb")]
    rows, plans = run_comparison(esft, cluster, scenarios)
    held_out = esft.split(0.5)[1]
    page = Page(compare_report(rows, plans, scenarios, held_out, "esft-law on 1x8").html())
    sec = page.sections()
    assert list(sec) == ["Ranking", "Recommendation", "GPU load per layer, before and after",
                         "Imbalance per held-out batch", "Balancedness per layer"]
    # ranked by balancedness, best first
    body = [r for r in page.find("tr", section=sec["Ranking"])][1:]
    assert len(body) == 3
    ranked = sorted(rows.values(), key=lambda r: -r.score.balancedness)
    cells = page.text(sec["Ranking"])
    assert [cells.index(r.policy) for r in ranked] == sorted(cells.index(r.policy) for r in ranked)
    best = ranked[0].policy
    assert best == "eplb"
    # before: contiguous, after: eplb, each 26 layers x 8 GPUs; every layer's cells average to a fair share of 1
    heat = sec["GPU load per layer, before and after"]
    assert "before: contiguous" in page.text(heat) and "after: eplb" in page.text(heat)
    assert len(page.find("rect", "cell", heat)) == 2 * 26 * 8
    for name in ("contiguous", "eplb"):
        h, imb = relative_loads(plans[name], held_out, "uniform")
        assert np.allclose(np.nanmean(h, axis=1), 1.0) and imb.shape == (held_out.num_batches,)
        assert np.all(imb >= 1.0)
    # the per-batch lines: one per map, one point per held-out batch; per-layer lines: one per row
    per_batch = page.find("polyline", "series", sec["Imbalance per held-out batch"])
    assert [len(points(p)) for p in per_batch] == [held_out.num_batches] * 2
    per_layer = page.find("polyline", "series", sec["Balancedness per layer"])
    assert len(per_layer) == 3
    # a row keeps its colour from chart to chart: contiguous and eplb per batch as in the per-layer chart
    colour = {r.policy: line["stroke"] for r, line in zip(ranked, per_layer, strict=True)}
    assert [p["stroke"] for p in per_batch] == [colour["contiguous"], colour["eplb"]]
    rec = page.text(sec["Recommendation"])
    assert f"Best by held-out balancedness: {best}" in rec
    # SGLang's and TensorRT-LLM's files by export; for vLLM, which loads no placement file, the plug-in
    assert "moebalance export --plan plan-eplb.json --to sglang --out eplb-sglang.json" in rec
    assert "moebalance export --plan plan-eplb.json --to trtllm --out eplb-trtllm.yaml" in rec
    assert "--to vllm" not in rec and "export MOEBALANCE_VLLM_EPLB=eplb" in rec


def test_compare_report_priced(esft: LoadMatrix) -> None:
    """With the cost model (``compare --gpu``): ranked by modelled goodput, each row's MoE layer split into expert
    time and all-to-all, the two adding up to the row's modelled layer."""
    deployment = Deployment(model=get_model("deepseek-v2-lite"), gpu=get_gpu("h100-80gb"))
    scenarios = [Scenario(p, Budget(slots_per_gpu=9), {}, "uniform", plan_name=p) for p in ("eplb", "contiguous")]
    rows, plans = run_comparison(esft, Cluster(num_nodes=1, gpus_per_node=8), scenarios,
                                 price=lambda plan, test, router: price_plan(plan, test, deployment, router=router))
    page = Page(compare_report(rows, plans, scenarios, esft.split(0.5)[1], "priced").html())
    sec = page.sections()
    ranked = sorted(rows.values(), key=lambda r: -r.price.modelled_goodput if r.price else 0.0)
    ranking = page.text(sec["Ranking"])
    assert "ranked by modelled goodput" in ranking
    assert ranking.index(f"{ranked[0].price.modelled_goodput:,.0f}") < ranking.index(
        f"{ranked[1].price.modelled_goodput:,.0f}")
    assert f"Best by modelled goodput: {ranked[0].policy}" in page.text(sec["Recommendation"])
    bars = sec["Modelled MoE layer time"]
    assert len(page.find("rect", "seg", bars)) == 4
    totals = re.findall(r"^[\d,.]+$", page.text(bars), flags=re.M)
    expected = [short_number(r.price.modelled_layer_ms) for r in ranked if r.price]
    assert [t for t in totals if t in set(expected)] == expected


def test_compare_report_of_one_row(esft: LoadMatrix) -> None:
    """A comparison of one row has no "before": one heatmap, labelled as the best."""
    scenarios = [Scenario("eplb", Budget(slots_per_gpu=9), {}, "uniform", plan_name="eplb")]
    rows, plans = run_comparison(esft, Cluster(num_nodes=1, gpus_per_node=8), scenarios)
    page = Page(compare_report(rows, plans, scenarios, esft.split(0.5)[1], "one").html())
    heat = page.sections()["GPU load per layer, before and after"]
    assert len(page.find("svg", "heatmap", heat)) == 1 and "best: eplb" in page.text(heat)
    with pytest.raises(InputError, match="no rows to report"):
        compare_report({}, {}, [], esft, "none")


def _shell_words(line: str) -> list[str]:
    """The words a POSIX shell makes of command ``line`` (its first word run as a function that prints the rest)."""
    name = line.split()[0]
    done = subprocess.run(["sh", "-c", f'{name}() {{ printf "%s\\n" "$@"; }}\n{line}'], capture_output=True,
                          text=True, check=True)
    return [name, *done.stdout.splitlines()]


def test_compare_report_quotes_paths_for_a_shell_and_sends_vllm_to_the_plug_in(
        esft: LoadMatrix, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The export commands of ``compare --out-dir`` name the plan in the out-dir and the load, each quoted for a
    shell: a space or a quote in a path stays in one word. vLLM gets the plug-in, not a file it would never read."""
    load = tmp_path / "bob's load.npy"
    np.save(load, esft.counts)
    out = tmp_path / "my out"
    rc, _, err = run_cli(["compare", "--load", load, "--policies", "contiguous,craft", "--nodes", 1, "--gpus-per-node",
                          8, "--replicas-per-gpu", 1, "--out-dir", out], capsys)
    assert rc == 0, err
    page = Page((out / "report.html").read_text())
    rec = page.sections()["Recommendation"]
    assert "Best by held-out balancedness: craft" in page.text(rec)  # replicas beat none
    chunks = page.texts[rec]
    exports = chunks[chunks.index("export the plan for SGLang or TensorRT-LLM") + 1].splitlines()
    # craft spreads 8 replicas over 26 layers: uneven slots, so the commands pad, on the compared load
    assert [_shell_words(line) for line in exports] == [
        ["moebalance", "export", "--plan", f"{tmp_path}/my out/plan-craft.json", "--to", "sglang", "--pad", "--load",
         f"{tmp_path}/bob's load.npy", "--out", "craft-sglang.json"],
        ["moebalance", "export", "--plan", f"{tmp_path}/my out/plan-craft.json", "--to", "trtllm", "--pad", "--load",
         f"{tmp_path}/bob's load.npy", "--out", "craft-trtllm.yaml"]]
    vllm = chunks[chunks.index("vLLM: the moebalance plug-in") + 1].splitlines()
    assert [line for line in vllm if not line.startswith("#")] == [
        "pip install 'moebalance[vllm]'", "export MOEBALANCE_VLLM_EPLB=eplb  # or eplb-no-duplicates, move-aware",
        "vllm serve MODEL --enable-expert-parallel --enable-eplb"]
    assert "--to vllm" not in page.text(rec) and "moebalance_eplb" in page.text(rec)
    assert "Assumptions" not in page.sections()  # nothing priced without --gpu, so nothing assumed


def _panel(page: Page) -> dict[str, str]:
    """The Assumptions panel's rows, ``{what: value}``; it is the page's first section."""
    sec = page.sections()
    assert next(iter(sec)) == "Assumptions"
    cells = page.texts[sec["Assumptions"]][1:]
    return dict(zip(cells[::2], cells[1::2], strict=True))


def test_compare_and_online_priced_with_a_deployment_state_their_assumptions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``compare --gpu`` and ``online --gpu`` open their page with what the prices assumed, as the command line
    gave it: the published peaks (which record no fit error), bf16, DeepEP's low-latency kernels, two-batch overlap,
    attention over the node's 8 GPUs (one data-parallel rank, the default)."""
    given = ["--load", "bundled:esft-law", "--model", "deepseek-v2-lite", "--nodes", 1, "--gpus-per-node", 8,
             "--slots-per-gpu", 9, "--gpu", "h100-80gb", "--precision", "bf16", "--calibration", "peaks", "--overlap",
             "tbo", "--a2a", "low-latency"]
    common = {"calibration": "published peaks; no fit error recorded",
              "precision": "bf16 weights and GEMMs, bf16 KV cache",
              "attention": "tensor-parallel over 8 GPUs in each of 1 data-parallel rank",
              "all-to-all": "low-latency: DeepEP low-latency kernels", "overlap": "two-batch overlap (tbo)",
              "priced batches": "held out (not planned on)"}
    rc, _, err = run_cli(["compare", *given, "--policies", "contiguous,eplb", "--out-dir", tmp_path / "c"], capsys)
    assert rc == 0, err
    # no --phase: the goodput model's decode and prefill rounds, each plan's decode step its KV cache's concurrency;
    # compare's recommendation clears advise's margin (5%: the peaks record no fit error) over its row without replicas
    assert _panel(Page((tmp_path / "c" / "report.html").read_text())) == {
        **common, "phase": "decode and prefill rounds (goodput at saturation)",
        "tokens per step": "decode: each plan's KV-cache concurrency; prefill: 4,096 per data-parallel rank",
        "margin": "5.0% over the row without replicas"}
    rc, _, err = run_cli(["online", *given, "--policy", "eplb", "--phase", "decode", "--warmup", "0:8", "--out-dir",
                          tmp_path / "o"], capsys)
    assert rc == 0, err
    step = re.search(r"every batch drawn again as a step of ([\d,]+) tokens", err)
    assert step is not None
    assert _panel(Page((tmp_path / "o" / "report.html").read_text())) == {
        **common, "phase": "decode steps: one token per running request", "tokens per step": step.group(1),
        "requests per step": step.group(1)}


def test_demo_writes_the_report_html_it_announces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``moebalance demo`` said it wrote report.html, twice, and wrote none: each part's folder now has the page of
    its comparison, and one line says what was written, after the whole out-dir is in place."""
    dest = tmp_path / "demo"
    rc, out, err = run_cli(["demo", "--out-dir", dest], capsys)
    assert rc == 0, err
    wrote = [line for line in out.splitlines() if line.startswith("wrote")]
    assert len(wrote) == 1 and f"{dest}, {dest}/traffic:" in wrote[0] and "report.html" in wrote[0]
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no temporary folder left
    # part 1: the rows of the recorded tour (tests/data/tour.json), best first
    text = (dest / "report.html").read_text()
    assert text.startswith("<!DOCTYPE html>") and "<title>moebalance demo</title>" in text
    page = Page(text)
    sec = page.sections()
    assert list(sec)[:2] == ["Ranking", "Recommendation"]
    ranking = page.texts[sec["Ranking"]]
    want = [("eplb (global)", "0.8127"), ("craft (R=8)", "0.7838"), ("eplb", "0.7180"), ("greedy", "0.5716"),
            ("contiguous", "0.4181")]
    at = [next(i for i, c in enumerate(ranking) if c == label or c.startswith(f"{label} (budget note"))
          for label, _ in want]
    assert at == sorted(at) and [ranking[i + 2] for i in at] == [b for _, b in want]
    rec = page.text(sec["Recommendation"])
    assert "Best by held-out balancedness: eplb (global)" in rec
    assert f"moebalance export --plan {dest}/plan-eplb-global.json --to sglang" in rec
    assert (dest / "plan-eplb-global.json").is_file()
    # part 2: the traffic comparison's six rows in its own folder
    page = Page((dest / "traffic" / "report.html").read_text())
    ranking = page.texts[page.sections()["Ranking"]]
    for label in ("contiguous", "moetuner", "eplb (random router)", "grace, no replicas", "grace (wrr router)",
                  "grace (locality router)"):
        assert any(c == label or c.startswith(f"{label} (budget note") for c in ranking), label
    assert len(page.find("tr", section=page.sections()["Ranking"])) == 1 + 6


def test_online_report(esft: LoadMatrix) -> None:
    cluster, budget = Cluster(num_nodes=1, gpus_per_node=8), Budget(slots_per_gpu=9)
    pricing = StepPricing(deployment=Deployment(model=get_model("deepseek-v2-lite"), gpu=get_gpu("h100-80gb")),
                          router_ms=0.05)
    results = [replay(esft, cluster, budget, "eplb", {}, warmup=(0, 4), replanning=Replanning(every=2, window=2),
                      pricing=pricing),
               replay(esft, cluster, budget, "libra", {"n": 2, "predictor": "path"}, warmup=(0, 4), pricing=pricing),
               replay(esft, cluster, budget, "contiguous", {}, warmup=(0, 4), pricing=pricing)]
    page = Page(online_report(results, "esft-law online").html())
    sec = page.sections()
    assert list(sec) == ["Ranking", "Recommendation", "Imbalance per served batch",
                         "Modelled step time per served batch", "Mean step time"]
    speeds = [r.time["tokens_per_s"] for r in results if r.time is not None]
    fastest = results[int(np.argmax(speeds))]
    ranking = page.text(sec["Ranking"])
    assert ranking.index(f"{max(speeds):,.0f}") < min(ranking.index(f"{s:,.0f}") for s in speeds if s != max(speeds))
    assert f"{fastest.policy}" in page.text(sec["Recommendation"]).split(":")[1]
    served = esft.num_batches - 4
    for name in ("Imbalance per served batch", "Modelled step time per served batch"):
        assert [len(points(p)) for p in page.find("polyline", "series", sec[name])] == [served] * 3
    # each bar's parts (the step without balancing, the router, copies and stalls) add up to the mean step
    bars = sec["Mean step time"]
    assert len(page.find("rect", "seg", bars)) >= 4  # libra's router and eplb's stalls show beside the steps
    shown = re.findall(r"^[\d,.]+$", page.text(bars), flags=re.M)
    order = sorted(results, key=lambda r: -r.time["tokens_per_s"] if r.time else 0)
    expected = [short_number(r.time["step_ms_mean"]) for r in order if r.time]
    assert len(expected) == 3 and [t for t in shown if t in set(expected)] == expected


def test_online_report_unpriced(esft: LoadMatrix) -> None:
    """Without --gpu: rows as given, the best balanced one recommended, no step time charts."""
    cluster, budget = Cluster(num_nodes=1, gpus_per_node=8), Budget(slots_per_gpu=9)
    results = [replay(esft, cluster, budget, p, {}, warmup=(0, 4)) for p in ("contiguous", "eplb")]
    page = Page(online_report(results, "unpriced").html())
    sec = page.sections()
    assert list(sec) == ["Ranking", "Recommendation", "Imbalance per served batch"]
    best = min(results, key=lambda r: r.mean_imbalance_ratio)
    assert f"Best balanced in the replay: {best.policy}" in page.text(sec["Recommendation"])
    with pytest.raises(InputError, match="no results"):
        online_report([], "none")



def test_compare_recommends_by_advises_margin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One rule with ``advise``: ranked by modelled goodput, the best row must beat the row without replicas by more
    than the margin (5%; the H100's profile records a fit error of 0.029, whose exp - 1 = 2.9% is smaller). On
    DeepSeek's ESFT routing EPLB models +0.1% over contiguous: keep contiguous, no export offered. On the bundled
    DeepSeek-V3 load it clears the margin: EPLB is recommended with its export commands."""
    common = ["--policies", "contiguous,eplb", "--gpu", "h100-80gb", "--out-dir"]
    rc, _, _ = run_cli(["compare", "--load", "bundled:esft-law", "--nodes", 1, "--gpus-per-node", 8,
                        "--slots-per-gpu", 9, *common, tmp_path / "esft"], capsys)
    page = (tmp_path / "esft" / "report.html").read_text()
    assert rc == 0 and "Keep contiguous: the best by modelled goodput, eplb, models +0.1%" in page
    assert "not more than the 5.0% margin that advise also applies" in page and "--to sglang" not in page
    assert "5.0% over the row without replicas" in page  # the assumptions panel states the margin
    rc, _, _ = run_cli(["compare", "--load", "bundled:deepseek-v3-8x8", "--nodes", 8, "--gpus-per-node", 8,
                        "--slots-per-gpu", 5, *common, tmp_path / "v3"], capsys)
    page = (tmp_path / "v3" / "report.html").read_text()
    assert rc == 0 and "Best by modelled goodput: eplb" in page and "Keep " not in page and "--to sglang" in page
