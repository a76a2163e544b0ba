"""One self-contained HTML page of a comparison, an online replay or an advice (``report.html`` in ``--out-dir``).

A :class:`Report` is a title and sections added in order: a ranking table, per-layer x per-GPU load heatmaps before
and after a plan, lines per batch or layer, stacked cost bars, the recommendation with its files, notes. The page
needs nothing at view time: the CSS is inline, the charts are inline SVG (:mod:`moebalance.app.html_charts`), there
is no script, no font and no image to fetch. Every string given is HTML-escaped, and the same sections give the same
bytes (nothing is dated unless a subtitle says so).

:func:`compare_report` and :func:`online_report` build the page of ``moebalance compare`` and ``moebalance online``
from their results.
"""

from __future__ import annotations

import dataclasses
import html
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moebalance.app.advise import clears
from moebalance.app.compare import PhaseRow, Scenario
from moebalance.app.html_charts import (
    bar_components,
    bars_svg,
    colorbar_svg,
    heatmap_svg,
    legend_html,
    lines_svg,
)
from moebalance.app.online_report import failure_notes, online_label
from moebalance.app.report import ComparisonRow, budget_notes
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_path
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.engines.registry import ENGINES
from moebalance.engines.vllm_plugin import ENTRY_POINT, ENV, VARIANTS
from moebalance.online.replay import OnlineResult
from moebalance.routing import Router, get_router
from moebalance.routing.simulate import layer_metrics, replay_loads

__all__ = ["Report", "compare_report", "online_report", "relative_loads"]

_CSS = """
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Arial, sans-serif; font-size: 14px;
       color: #1d1d1f; background: #ffffff; margin: 0; }
main { max-width: 1160px; margin: 0 auto; padding: 16px 20px 40px; }
h1 { font-size: 22px; margin: 8px 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #e3e3e3; padding-bottom: 4px; }
.subtitle { color: #555555; margin: 0 0 8px; }
nav ul { list-style: none; padding: 0; margin: 8px 0; display: flex; flex-wrap: wrap; gap: 4px 16px; }
nav a { color: #0b5cad; text-decoration: none; }
table.ranking { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
.scroll { overflow-x: auto; }
table.ranking th { background: #f2f4f7; text-align: right; padding: 6px 8px; border-bottom: 2px solid #c9ced6;
                   font-weight: 600; vertical-align: bottom; }
table.ranking th::after { content: " \\2195"; color: #9aa3ad; font-weight: 400; }
table.ranking td { text-align: right; padding: 5px 8px; border-bottom: 1px solid #eceff3; }
table.ranking th:first-child, table.ranking td:first-child { text-align: left; }
table.ranking tr.best td { background: #eaf6ec; font-weight: 600; }
table.ranking tbody tr:hover td { background: #f7f9fc; }
.pair { display: flex; flex-wrap: wrap; gap: 12px 24px; align-items: flex-start; }
.chart text { fill: #1d1d1f; }
ul.legend { list-style: none; padding: 0; margin: 4px 0 0 70px; display: flex; flex-wrap: wrap; gap: 4px 18px;
            font-size: 12px; }
ul.legend .swatch { display: inline-block; width: 22px; margin: 0 6px 3px 0; vertical-align: middle; }
ul.legend .swatch.block { width: 12px; height: 12px; margin-bottom: 0; }
div.recommendation { border: 2px solid #2e7d32; background: #f1f8f2; border-radius: 6px; padding: 12px 16px; }
div.recommendation p { margin: 0 0 8px; white-space: pre-line; font-size: 15px; }
div.recommendation figure { margin: 10px 0 0; }
div.recommendation figcaption { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-weight: 600;
                             font-size: 12px; margin-bottom: 2px; }
pre { background: #ffffff; border: 1px solid #cfd8cf; border-radius: 4px; padding: 8px 10px; margin: 0;
      overflow-x: auto; font-size: 12px; line-height: 1.35; max-height: 420px; }
.note { color: #333333; margin: 6px 0; white-space: pre-line; }
.caption { color: #555555; font-size: 12px; margin: 4px 0 0; }
table.assumptions { border-collapse: collapse; font-size: 13px; }
table.assumptions th { text-align: left; color: #555555; font-weight: 600; padding: 2px 16px 2px 0; vertical-align: top; }
"""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


class Report:
    """A page being built: add sections in the order they should appear, then :meth:`write` (or :meth:`html`).

    Every method returns the report, so calls chain: ``Report("t").note("n").write(path)``.
    """

    def __init__(self, title: str, subtitle: str | None = None, *, refresh_s: int | None = None) -> None:
        self.title = str(title)
        self.subtitle = subtitle
        #: Seconds after which the page loads itself again (a live dashboard); ``None``: a static page.
        self.refresh_s = refresh_s
        self._sections: list[tuple[str, str, str]] = []  # (kind, heading, body)

    def _add(self, kind: str, heading: str, body: str) -> Report:
        self._sections.append((kind, str(heading), body))
        return self

    def ranking(self, rows: Sequence[Sequence[object]], columns: Sequence[str], *, name: str = "Ranking",
                best: int | None = 0, caption: str | None = None) -> Report:
        """A table of ``rows`` (each one cell per column, already in rank order); row ``best`` is highlighted."""
        for i, row in enumerate(rows):
            if len(row) != len(columns):
                raise InputError(f"ranking row {i} has {len(row)} cells but there are {len(columns)} columns; give one "
                                 "cell per column")
        head = "".join(f'<th scope="col">{_esc(c)}</th>' for c in columns)
        body = "".join(("<tr class=\"best\">" if i == best else "<tr>") + "".join(f"<td>{_esc(c)}</td>" for c in row)
                       + "</tr>" for i, row in enumerate(rows))
        cap = "" if caption is None else f'<p class="caption">{_esc(caption)}</p>'
        return self._add("ranking", name, f'<div class="scroll"><table class="ranking"><thead><tr>{head}</tr></thead>'
                                          f"<tbody>{body}</tbody></table></div>{cap}")

    def heatmap(self, name: str, before: np.ndarray, after: np.ndarray | None = None, *,
                labels: tuple[str, str] = ("before", "after"), scale_label: str = "value",
                gpus_per_node: int | None = None, caption: str | None = None, xlabel: str = "GPU") -> Report:
        """Per-layer x per-GPU heatmaps ``[L, G]``, ``before`` and ``after`` side by side on one colour scale (from
        the smaller of 0 and their minimum to their maximum), with its legend; nan cells are grey."""
        mats = [np.asarray(before, dtype=np.float64)] + ([] if after is None else [np.asarray(after, dtype=np.float64)])
        for m in mats:
            if m.ndim != 2 or 0 in m.shape:
                raise InputError(f"a heatmap needs a non-empty [layers, GPUs] matrix, not shape {list(m.shape)}")
        if len(mats) == 2 and mats[0].shape != mats[1].shape:
            raise InputError(f"heatmaps before {list(mats[0].shape)} and after {list(mats[1].shape)} differ in shape; "
                             "give both on the same layers and GPUs")
        finite = np.concatenate([m[np.isfinite(m)] for m in mats])
        vmin = min(0.0, float(finite.min())) if finite.size else 0.0
        vmax = float(finite.max()) if finite.size else 1.0
        vmax = vmax if vmax > vmin else vmin + 1.0
        maps = "".join(heatmap_svg(m, vmin, vmax, caption=label, gpus_per_node=gpus_per_node, xlabel=xlabel)
                       for m, label in zip(mats, labels, strict=False))
        cap = "" if caption is None else f'<p class="caption">{_esc(caption)}</p>'
        return self._add("heatmap", name, f'<div class="pair">{maps}</div>{colorbar_svg(vmin, vmax, scale_label)}{cap}')

    def lines(self, name: str, series: Mapping[str, Sequence[float]], ylabel: str, *, xlabel: str = "batch",
              x: Sequence[float] | None = None, reference: float | None = None,
              ylim: tuple[float | None, float | None] = (None, None), styles: Sequence[int] | None = None,
              caption: str | None = None) -> Report:
        """One line per series (``{label: values}``) against ``x`` (default ``0, 1, ...``), with a legend; series
        ``i`` is drawn in colour number ``styles[i]`` (default ``i``)."""
        if not series:
            raise InputError(f"the chart {name!r} has no series; give at least one")
        longest = max(len(v) for v in series.values())
        if x is not None and len(x) < longest:
            raise InputError(f"the chart {name!r} has a series of {longest} values but {len(x)} x values; give one x "
                             "per value")
        if styles is not None and len(styles) != len(series):
            raise InputError(f"the chart {name!r} has {len(series)} series but {len(styles)} styles; give one each")
        svg = lines_svg(series, ylabel=ylabel, xlabel=xlabel, x=x, reference=reference, ylim=ylim, styles=styles)
        cap = "" if caption is None else f'<p class="caption">{_esc(caption)}</p>'
        return self._add("lines", name, svg + legend_html(list(series), styles=styles) + cap)

    def bars(self, name: str, data: Mapping[str, Mapping[str, float]], *, unit: str = "ms",
             caption: str | None = None) -> Report:
        """A stacked bar per label (``{label: {component: value}}``, values finite and >= 0), with a legend."""
        for label, parts in data.items():
            for comp, v in parts.items():
                if not np.isfinite(v) or v < 0:
                    raise InputError(f"bar {label!r} has {comp} = {v}; give finite values >= 0")
        cap = "" if caption is None else f'<p class="caption">{_esc(caption)}</p>'
        return self._add("bars", name, bars_svg(data, unit=unit) + legend_html(bar_components(data), blocks=True) + cap)

    def recommendation(self, text: str, files: Mapping[str, str] | None = None, *,
                       name: str = "Recommendation") -> Report:
        """A highlighted box: ``text``, then each file (``{name: content}``) in a ``<pre>`` block."""
        blocks = "".join(f"<figure><figcaption>{_esc(f)}</figcaption><pre>{_esc(content)}</pre></figure>"
                         for f, content in (files or {}).items())
        return self._add("recommendation", name, f'<div class="recommendation"><p>{_esc(text)}</p>{blocks}</div>')

    def assumptions(self, rows: Sequence[tuple[str, str]], *, name: str = "Assumptions") -> Report:
        """A small table of what the prices assumed: ``(what, value)`` rows (:mod:`moebalance.app.assumptions`)."""
        body = "".join(f'<tr><th scope="row">{_esc(k)}</th><td>{_esc(v)}</td></tr>' for k, v in rows)
        return self._add("assumptions", name, f'<table class="assumptions"><tbody>{body}</tbody></table>')

    def note(self, text: str) -> Report:
        """A paragraph of plain text (line breaks kept) under the section before it."""
        return self._add("note", "", f'<p class="note">{_esc(text)}</p>')

    def html(self) -> str:
        """The page."""
        out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
               '<meta name="viewport" content="width=device-width, initial-scale=1">',
               *([] if self.refresh_s is None else [f'<meta http-equiv="refresh" content="{int(self.refresh_s)}">']),
               f"<title>{_esc(self.title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>", "<main>",
               f"<h1>{_esc(self.title)}</h1>"]
        if self.subtitle:
            out.append(f'<p class="subtitle">{_esc(self.subtitle)}</p>')
        headed = [(i, h) for i, (_, h, _) in enumerate(self._sections) if h]
        if len(headed) > 1:
            out.append("<nav><ul>" + "".join(f'<li><a href="#section-{i}">{_esc(h)}</a></li>' for i, h in headed)
                       + "</ul></nav>")
        for i, (kind, heading, body) in enumerate(self._sections):
            if heading:
                out.append(f'<section id="section-{i}" class="{kind}"><h2>{_esc(heading)}</h2>{body}</section>')
            else:
                out.append(body)
        out += ["</main>", "</body>", "</html>", ""]
        return "\n".join(out)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the page to ``path`` as UTF-8, atomically (a temporary file, then a rename: a failed write leaves
        nothing); returns the path. Text that is not Unicode (a file name's undecodable bytes) is written as ``?``."""
        target = Path(path)
        data = self.html().encode("utf-8", "replace")
        try:
            with atomic_path(target) as tmp:
                tmp.write_bytes(data)
        except IsADirectoryError:
            raise InputError(f"cannot write the report to {str(target)!r}: it is a folder; remove it or write "
                             "elsewhere") from None
        return target


def relative_loads(plan: Placement, load: LoadMatrix, router: str | Router = "uniform",
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(heat [L, G], imbalance [B])`` of ``load`` replayed through ``plan`` with ``router``.

    ``heat[l, g]``: GPU ``g``'s load over the layer's mean GPU load, averaged over the batches where layer ``l`` has
    load (nan where it never has: 1.0 is a fair share). ``imbalance[b]``: the batch's imbalance ratio (busiest GPU
    over the mean), averaged over its layers with load (nan for a batch without load).
    """
    loads, _, _ = replay_loads(plan, load, get_router(router), np.random.default_rng(seed))
    mean = loads.mean(axis=2)  # [B, L]
    active = mean > 0
    rel = loads / np.where(active, mean, 1.0)[..., None]  # [B, L, G]; zero where the layer has no load
    per_layer = active.sum(axis=0)  # [L]
    heat = np.full((per_layer.size, loads.shape[2]), np.nan)
    seen = per_layer > 0
    heat[seen] = rel.sum(axis=0)[seen] / per_layer[seen, None]
    imb = layer_metrics(loads, load.counts, plan.replica_counts()).imbalance  # [B, L], nan without load
    per_batch = active.sum(axis=1)
    imbalance = np.full(per_batch.shape, np.nan)
    imbalance[per_batch > 0] = np.nansum(imb, axis=1)[per_batch > 0] / per_batch[per_batch > 0]
    return heat, imbalance


def _rank_key(row: ComparisonRow) -> float:
    """Smaller is better: modelled goodput (``--gpu``), else the phase's MoE layer time, else balancedness."""
    if row.price is not None:
        return -row.price.modelled_goodput
    if isinstance(row, PhaseRow) and row.phase is not None:
        return row.phase.moe_layer_ms
    return -row.score.balancedness


def _comparison_cells(row: ComparisonRow) -> tuple[list[str], list[str]]:
    """``(columns, cells)`` of one comparison row in the ranking."""
    s = row.score
    cols = ["row", "extra replicas", "balancedness", "imbalance ratio", "gap to bound", "routing gap"]
    cells = [row.policy, f"{s.extra_replicas:,}", f"{s.balancedness:.4f}", f"{s.imbalance_ratio:.3f}",
             f"{100 * s.lower_bound_gap:.1f}%", "-" if s.routing_gap is None else f"{100 * s.routing_gap:.1f}%"]
    if row.price is not None:
        c = row.price
        cols += ["KV cache GiB / GPU", "MoE layer ms", "goodput tok/s"]
        cells += [f"{c.memory.kv_cache_gb_per_gpu:.1f}", f"{c.modelled_layer_ms:.3f}", f"{c.modelled_goodput:,.0f}"]
    if isinstance(row, PhaseRow) and row.phase is not None:
        cols += [f"{row.phase.phase} MoE layer us"]
        cells += [f"{1e3 * row.phase.moe_layer_ms:.1f}"]
    return cols, cells


def _cost_bars(rows: Sequence[ComparisonRow]) -> tuple[dict[str, dict[str, float]], str] | None:
    """Each row's modelled MoE layer split into the slowest GPU's experts and what the all-to-all adds after them (all
    of it without overlap, what the experts do not hide with it), and its unit, where the rows have it."""
    if rows and all(r.price is not None for r in rows):
        return {r.policy: {"expert (slowest GPU)": r.price.modelled_expert_ms,
                           "all-to-all (exposed)": max(r.price.modelled_layer_ms - r.price.modelled_expert_ms, 0.0)}
                for r in rows if r.price is not None}, "ms per MoE layer"
    timed = [r for r in rows if isinstance(r, PhaseRow) and r.phase is not None]
    if rows and len(timed) == len(rows):
        return {r.policy: {"expert (slowest GPU)": 1e3 * r.phase.expert_ms,
                           "all-to-all (exposed)": 1e3 * max(r.phase.moe_layer_ms - r.phase.expert_ms, 0.0)}
                for r in timed if r.phase is not None}, "us per MoE layer"
    return None


def _export_lines(name: str, plan: Placement, folder: Path | None, load_args: Sequence[str]) -> str:
    """The ``moebalance export`` commands that write plan file ``plan-<name>.json`` (in ``folder``, else named alone)
    in the form each engine that loads a placement file (SGLang, TensorRT-LLM) loads, each quoted for a POSIX shell.
    A plan of uneven slot counts is padded on the load ``load_args`` name (``--load FILE``; else a placeholder)."""
    padded = plan.slots()
    pad = [] if int(padded.min()) == int(padded.max()) else ["--pad", *(load_args or ("--load", "LOAD"))]
    source = f"plan-{name}.json" if folder is None else str(folder / f"plan-{name}.json")
    stem = name.replace(" ", "_")
    loaders = sorted(key for key, e in ENGINES.items() if e.rule.placement_file)  # engines that load a plan file
    return "\n".join(shlex.join(["moebalance", "export", "--plan", source, "--to", engine, *pad, "--out",
                                 f"{stem}-{engine}{ENGINES[engine].export_suffix}"]) for engine in loaders)


def _vllm_lines() -> str:
    """How vLLM runs moebalance (README, the vLLM plug-in): vLLM loads no placement file, its EPLB makes the plans; the
    plug-in puts moebalance's EPLB variants behind it."""
    return "\n".join([
        "# vLLM loads no placement file: its own EPLB makes the plans (not this one). The moebalance plug-in puts",
        "# moebalance's EPLB in the place of vLLM's policy:",
        shlex.join(["pip", "install", "moebalance[vllm]"]),
        f"export {ENV}={VARIANTS[0]}  # or {', '.join(VARIANTS[1:])}",
        "vllm serve MODEL --enable-expert-parallel --enable-eplb",
        f"# if VLLM_PLUGINS is set, it must list {ENTRY_POINT}",
    ])


_Entry = tuple[Scenario, ComparisonRow, Placement | None]


def _before(entries: Sequence[_Entry], best: Scenario) -> _Entry | None:
    """The row to show as "before": the contiguous one, else the first without replicas, else the first (not
    ``best``, with a plan)."""
    others = [e for e in entries if e[2] is not None and e[0] is not best]
    return (next((e for e in others if e[0].policy == "contiguous"), None)
            or next((e for e in others if e[1].score.extra_replicas == 0), None) or (others[0] if others else None))


def _compare_advice(best: _Entry, before: _Entry | None, by: str, folder: Path | None,
                    load_args: Sequence[str], margin: float | None = None) -> tuple[str, dict[str, str]]:
    """The recommendation's text and files: the best row ``by`` the ranking's measure, against the one before, how
    to export its plan for SGLang and TensorRT-LLM (:func:`_export_lines`) and how to run moebalance in vLLM. Ranked
    by goodput with a ``margin``, the best must clear it over the row before, as ``advise``'s (:func:`clears`)."""
    sc, row, plan = best
    base = before[1].price if before is not None else None
    if margin is not None and row.price is not None and base is not None and before is not best and \
            not clears(row.price.modelled_goodput, base.modelled_goodput, margin):
        gain = row.price.modelled_goodput / base.modelled_goodput - 1
        return (f"Keep {before[1].policy}: the best by {by}, {row.policy}, models {gain:+.1%} "  # type: ignore[index]
                f"({row.price.modelled_goodput:,.0f} tokens/s), not more than the {margin:.1%} margin that advise "
                "also applies (the cost model's uncertainty, or the calibration's fit error where larger)."), {}
    s = row.score
    text = (f"Best by {by}: {row.policy} (balancedness {s.balancedness:.4f}, imbalance ratio "
            f"{s.imbalance_ratio:.3f}, {s.extra_replicas:,} extra replicas)")
    if row.price is not None:
        text += f", modelled goodput {row.price.modelled_goodput:,.0f} tokens/s"
    if before is not None:
        text += f"; {before[1].policy}: balancedness {before[1].score.balancedness:.4f}"
    name = sc.plan_name or sc.display
    if plan is None:
        return text + ".", {}
    return text + ".", {"export the plan for SGLang or TensorRT-LLM": _export_lines(name, plan, folder, load_args),
                        "vLLM: the moebalance plug-in": _vllm_lines()}


def compare_report(rows: Mapping[str, ComparisonRow], plans: Mapping[str, Placement], scenarios: Sequence[Scenario],
                   held_out: LoadMatrix, title: str, *, seed: int = 0, folder: str | os.PathLike[str] | None = None,
                   load_args: Sequence[str] = (), heading: str = "moebalance compare",
                   assumptions: Sequence[tuple[str, str]] = (), margin: float | None = None) -> Report:
    """The page of ``moebalance compare`` (titled ``heading``): ``rows`` and ``plans`` as
    :func:`moebalance.app.compare.run_comparison` returns them for ``scenarios``, ``held_out`` the batches they were
    scored on. The export commands name the plan files in ``folder`` (where they are read from: the final
    ``--out-dir``) and pad on the load ``load_args`` name (``["--load", FILE]``). ``assumptions``: what the prices
    assumed (``--gpu``), as ``(what, value)`` rows, in a panel first.

    Ranked by modelled goodput (``--gpu``), else by the phase's MoE layer time (``--phase``), else by balancedness.
    The heatmaps show the GPUs' loads on the held-out batches as recorded (replayed with each row's router and
    ``seed``), before (the contiguous row, else the first without replicas, else the first) and after (the best).
    """
    entries: list[_Entry] = [(sc, rows[sc.key], plans.get(sc.plan_name or sc.display)) for sc in scenarios
                             if sc.shown and sc.key in rows]
    if not entries:
        raise InputError("the comparison has no rows to report; give at least one policy")
    ranked = sorted(entries, key=lambda e: _rank_key(e[1]))
    report = Report(heading, title)
    if assumptions:  # priced with a deployment (--gpu): what it assumed, first
        report.assumptions(assumptions)
    numbers, notes = budget_notes([r for _, r, _ in ranked])
    table = []
    for (_, row, _), number in zip(ranked, numbers, strict=True):
        cols, cells = _comparison_cells(row)
        table.append(cells if number is None else [f"{cells[0]} (budget note {number})", *cells[1:]])
    first = ranked[0][1]
    by = ("modelled goodput" if first.price is not None else "modelled MoE layer time"
          if isinstance(first, PhaseRow) and first.phase is not None else "held-out balancedness")
    report.ranking(table, cols, caption=f"Rows ranked by {by}, best first.")
    for line in notes:
        report.note(line)
    before = _before(entries, ranked[0][0])
    report.recommendation(*_compare_advice(ranked[0], before, by, None if folder is None else Path(folder),
                                           load_args, margin))
    shown = [(role, e[0], e[1], e[2]) for role, e in (("before", before), ("after" if before else "best", ranked[0]))
             if e is not None and e[2] is not None]
    traces = [(f"{role}: {row.policy}", relative_loads(plan, held_out, sc.router, seed))
              for role, sc, row, plan in shown]
    if traces:
        heats = [heat for _, (heat, _) in traces]
        report.heatmap("GPU load per layer, before and after", heats[0], heats[1] if len(heats) > 1 else None,
                       labels=(traces[0][0], traces[-1][0]),
                       scale_label="GPU load / the layer's mean GPU load (1 = fair share)",
                       gpus_per_node=shown[0][3].cluster.gpus_per_node,
                       caption=f"Mean over the {held_out.num_batches} held-out batches as recorded; white lines "
                               "separate nodes; grey: a layer without load.")
        report.lines("Imbalance per held-out batch", dict(zip(_unique([t[0] for t in traces]),
                                                              [imb.tolist() for _, (_, imb) in traces], strict=True)),
                     "imbalance ratio (max / mean GPU load)", xlabel="held-out batch", reference=1.0,
                     styles=[next(i for i, e in enumerate(ranked) if e[0] is sc) for _, sc, _, _ in shown],
                     caption="Per batch: the busiest GPU's load over the mean, averaged over the layers with load.")
    per_layer = [r.score.per_layer_balancedness.tolist() for _, r, _ in ranked]
    report.lines("Balancedness per layer", dict(zip(_unique([r.policy for _, r, _ in ranked]), per_layer, strict=True)),
                 "balancedness (mean / max GPU load)", xlabel="MoE layer", ylim=(0.0, 1.02))
    bars = _cost_bars([r for _, r, _ in ranked])
    if bars is not None:
        report.bars("Modelled MoE layer time", bars[0], unit=bars[1],
                    caption="The slowest GPU's grouped GEMM and the all-to-all (dispatch and combine), per MoE layer.")
    for w in dict.fromkeys(f"{r.policy}: {w}" for _, r, _ in ranked for w in r.warnings):
        report.note(f"warning: {w}")
    return report


def _unique(labels: Sequence[str]) -> list[str]:
    """``labels`` with repeats numbered (``x``, ``x (2)``), so that each names one series."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def _online_cells(r: OnlineResult, prefetch: Mapping[str, float] | None, with_prefetch: bool) -> list[str]:
    """One replayed policy's cells in the ranking (the step time ones where it was priced)."""
    cells = [online_label(r), r.router, f"{r.mean_imbalance_ratio:.3f}", f"{float(np.max(r.per_batch_imbalance)):.3f}",
             f"{r.balancedness:.4f}", f"{r.experts_moved:.1f}", f"{r.replica_slots_per_gpu:g}"]
    if with_prefetch:
        cells.append("-" if prefetch is None else f"{prefetch['gb_per_batch']:.3f}")
    if r.time is not None:
        t = r.time
        cells += [f"{t['step_ms_mean']:.3f}", f"{t['step_ms_p99']:.3f}", f"{t['tokens_per_s']:,.0f}",
                  f"{t['exposed_balancing_ms']:.3f}"]
    return cells


def _step_parts(t: Mapping[str, Any]) -> dict[str, float]:
    """A priced replay's mean step (its ``time`` object), ms: the step without balancing, the router's exposed host
    time, and the rest of what balancing exposed (copies not hidden, re-plan stalls)."""
    n = max(len(t["per_batch_step_ms"]), 1)
    exposed, router = t["exposed_balancing_ms"] / n, t.get("exposed_router_ms", 0.0) / n
    return {"step without balancing": max(t["step_ms_mean"] - exposed, 0.0), "router (exposed)": max(router, 0.0),
            "copies and stalls (exposed)": max(exposed - router, 0.0)}


def online_report(results: Sequence[OnlineResult], title: str,
                  prefetch: Sequence[Mapping[str, float] | None] | None = None,
                  assumptions: Sequence[tuple[str, str]] = ()) -> Report:
    """The page of ``moebalance online``: the ranking (by tokens per second when priced, ``--gpu``, else as given),
    imbalance and step time per served batch, each policy's mean step split into what balancing exposed and the rest,
    the fastest (or best balanced) policy, and the failures. ``prefetch[i]``: result ``i``'s modelled prefetch;
    ``assumptions``: what the prices assumed (``--gpu``), as ``(what, value)`` rows, in a panel first."""
    if not results:
        raise InputError("the replay has no results to report; give at least one policy")
    costs = list(prefetch) if prefetch is not None else [None] * len(results)
    times = [r.time for r in results if r.time is not None]
    timed = len(times) == len(results)
    order = sorted(range(len(results)), key=lambda i: -float(times[i]["tokens_per_s"])) if timed else \
        list(range(len(results)))
    labels = _unique([f"{online_label(r)}, {r.router}" for r in results])
    with_prefetch = any(c is not None for c in costs)
    cols = ["policy", "router", "mean imbalance", "max imbalance", "balancedness", "experts moved / batch",
            "replica slots / GPU", *(["prefetch GiB / batch"] if with_prefetch else []),
            *(["step ms mean", "step ms p99", "tokens / s", "exposed ms"] if timed else [])]
    table = [_online_cells(results[i] if timed else dataclasses.replace(results[i], time=None), costs[i],
                           with_prefetch) for i in order]
    report = Report("moebalance online", title)
    if assumptions:  # priced with a deployment (--gpu): what it assumed, first
        report.assumptions(assumptions)
    report.ranking(table, cols, caption="Rows by modelled tokens per second, fastest first." if timed else
                   "Rows in the order the policies were given.")
    if timed:
        t, best = times[order[0]], results[order[0]]
        report.recommendation(f"Fastest in the replay: {labels[order[0]]}: {t['tokens_per_s']:,.0f} tokens/s, step "
                              f"{t['step_ms_mean']:.3f} ms on average ({t['exposed_balancing_ms']:.1f} ms exposed by "
                              f"balancing over the replay), mean imbalance {best.mean_imbalance_ratio:.3f}.")
    else:
        k = min(order, key=lambda i: results[i].mean_imbalance_ratio)
        report.recommendation(f"Best balanced in the replay: {labels[k]}: mean imbalance "
                              f"{results[k].mean_imbalance_ratio:.3f}, balancedness {results[k].balancedness:.4f}. "
                              "Give --gpu to rank by modelled tokens per second.")
    same_x = all(np.array_equal(r.batches, results[0].batches) for r in results)
    x = results[0].batches.tolist() if same_x else None
    xlabel = "batch" if same_x else "served batch (index)"
    report.lines("Imbalance per served batch", {labels[i]: results[i].per_batch_imbalance.tolist() for i in order},
                 "imbalance ratio (max / mean GPU load)", xlabel=xlabel, x=x, reference=1.0)
    if timed:
        report.lines("Modelled step time per served batch", {labels[i]: list(times[i]["per_batch_step_ms"])
                                                             for i in order}, "step time (ms)", xlabel=xlabel, x=x)
        report.bars("Mean step time", {labels[i]: _step_parts(times[i]) for i in order}, unit="ms per step",
                    caption="What balancing adds to a step where the model does not hide it: the router's host time, "
                            "weight copies not under the layer before, a re-plan's stall.")
    for line in failure_notes(results):
        report.note(f"failure: {line}")
    return report
