"""Inline SVG charts for the HTML report (:mod:`moebalance.app.html_report`): heatmaps, line charts, stacked
bars and their colour scales.

Every function returns markup (a string) to paste into an HTML page: no scripts, no external fonts or images, every
text HTML-escaped. Numbers are written with fixed precision, so the same input gives the same bytes. Sizes are CSS
pixels chosen to fit a 1,200 px page.

Colours: a sequential scale for magnitudes (:func:`sequential`), interpolated in the OKLab space (Björn Ottosson,
"A perceptual color space for image processing", 2020) between light yellow and dark purple, so that lightness falls
evenly from low to high; a categorical set for series (:data:`CATEGORICAL`), distinguishable with the common colour
vision deficiencies (Okabe and Ito, "Color Universal Design", 2002).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["CATEGORICAL", "MISSING", "bar_components", "bars_svg", "colorbar_svg", "heatmap_svg", "legend_html",
           "lines_svg", "nice_ticks", "oklab_lightness", "sequential", "short_number"]

#: Series colours, in the order series take them (black last: it also draws the axes' reference lines).
CATEGORICAL = ("#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#7f7f7f", "#000000")
#: Dash patterns of the second, third... round of :data:`CATEGORICAL` when there are more series than colours.
_DASHES = ("", "6 3", "2 2", "8 3 2 3")
#: The fill of a heatmap cell without a value (a layer that never had load).
MISSING = "#d9d9d9"
#: Anchors of the sequential scale, light to dark.
_ANCHORS = ("#fcf6c8", "#f8c25c", "#ec7d43", "#cc3f4f", "#8c1f6a", "#3b1259")
_LEVELS = 256
_AXIS = "#444444"
_GRID = "#e6e6e6"
_FONT = 'font-family="inherit" font-size="11"'


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _srgb_to_linear(c: np.ndarray) -> np.ndarray:
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def _linear_to_srgb(c: np.ndarray) -> np.ndarray:
    c = np.clip(c, 0.0, 1.0)
    return np.where(c <= 0.0031308, 12.92 * c, 1.055 * c ** (1 / 2.4) - 0.055)


_M1 = np.array([[0.4122214708, 0.5363325363, 0.0514459929], [0.2119034982, 0.6806995451, 0.1073969566],
                [0.0883024619, 0.2817188376, 0.6299787005]])
_M2 = np.array([[0.2104542553, 0.7936177850, -0.0040720468], [1.9779984951, -2.4285922050, 0.4505937099],
                [0.0259040371, 0.7827717662, -0.8086757660]])


def _hex_to_oklab(colours: Sequence[str]) -> np.ndarray:
    """``float64 [N, 3]``: OKLab ``(L, a, b)`` of ``#rrggbb`` colours."""
    rgb = np.array([[int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)] for c in colours])
    lms = _srgb_to_linear(rgb) @ _M1.T
    return np.cbrt(lms) @ _M2.T


def _oklab_to_hex(lab: np.ndarray) -> list[str]:
    lms = (lab @ np.linalg.inv(_M2).T) ** 3
    rgb = np.rint(_linear_to_srgb(lms @ np.linalg.inv(_M1).T) * 255).astype(np.int64)
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in rgb]


def _scale() -> tuple[str, ...]:
    """The :data:`_LEVELS` colours of the sequential scale: the path through the anchors in OKLab, sampled at evenly
    spaced lightness (the anchors' lightness falls monotonically), so that equal steps of value look equal."""
    anchors = _hex_to_oklab(_ANCHORS)
    t = np.linspace(0.0, len(_ANCHORS) - 1, 64 * _LEVELS)
    lo = np.minimum(np.floor(t).astype(np.int64), len(_ANCHORS) - 2)
    frac = (t - lo)[:, None]
    path = anchors[lo] * (1 - frac) + anchors[lo + 1] * frac  # [N, 3], lightness falling along it
    targets = np.linspace(path[0, 0], path[-1, 0], _LEVELS)
    idx = np.searchsorted(-path[:, 0], -targets).clip(0, len(path) - 1)
    return tuple(_oklab_to_hex(path[idx]))


_SCALE = _scale()


def sequential(values: np.ndarray, vmin: float, vmax: float) -> list[str]:
    """The scale's colour of each value (flattened), ``vmin`` lightest and ``vmax`` darkest; nan is :data:`MISSING`."""
    v = np.asarray(values, dtype=np.float64).ravel()
    span = vmax - vmin if vmax > vmin else 1.0
    finite = np.isfinite(v)
    t = np.clip((np.where(finite, v, vmin) - vmin) / span, 0.0, 1.0)
    idx = np.rint(t * (_LEVELS - 1)).astype(np.int64)
    return [_SCALE[i] if ok else MISSING for i, ok in zip(idx.tolist(), finite.tolist(), strict=True)]


def oklab_lightness(colour: str) -> float:
    """OKLab lightness (0 black, 1 white) of a ``#rrggbb`` colour."""
    return float(_hex_to_oklab([colour])[0, 0])


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (steps of 1, 2 or 5 times a power of ten) covering ``[lo, hi]``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    ticks = []
    k = first
    while k * step <= hi + step * 1e-9:
        ticks.append(round(k * step, 12))
        k += 1
    return ticks


def short_number(v: float, step: float | None = None) -> str:
    """``v`` written for a tick (as many decimals as the ticks' ``step`` needs) or a value (three significant
    digits), thousands separated."""
    if not math.isfinite(v):
        return "-"
    if step:
        s = abs(step)
        decimals = (0 if float(s).is_integer() else 1) if s >= 1 else -math.floor(math.log10(s) + 1e-9)
    else:
        a = abs(v)
        decimals = 0 if a == 0 or a >= 100 else 1 if a >= 10 else 2 if a >= 1 else -math.floor(math.log10(a)) + 2
    return f"{v:,.{min(decimals, 6)}f}"


def _xy(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def heatmap_svg(matrix: np.ndarray, vmin: float, vmax: float, *, caption: str, gpus_per_node: int | None = None,
                width: int = 540, height: int = 460, xlabel: str = "GPU") -> str:
    """``matrix [L, G]`` as a grid of ``L * G`` cells (class ``cell``; layers down, GPUs across, or what ``xlabel``
    names), coloured on ``[vmin, vmax]`` (:func:`sequential`); node boundaries drawn every ``gpus_per_node`` GPUs."""
    m = np.asarray(matrix, dtype=np.float64)
    L, G = m.shape
    left, top, bottom = 44, 22, 34
    cw = max(1, min(40, (width - left - 8) // G))
    ch = max(1, min(24, (height - top - bottom) // L))
    w, h = left + cw * G + 8, top + ch * L + bottom
    colours = sequential(m, vmin, vmax)
    parts = [f'<svg class="chart heatmap" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             f'aria-label="{_esc(caption)}">',
             f'<text x="{left}" y="14" {_FONT} font-weight="600">{_esc(caption)}</text>']
    for i, colour in enumerate(colours):
        layer, gpu = divmod(i, G)
        parts.append(f'<rect class="cell" x="{left + gpu * cw}" y="{top + layer * ch}" width="{cw}" height="{ch}" '
                     f'fill="{colour}"/>')
    if gpus_per_node and 0 < gpus_per_node < G:
        for g in range(gpus_per_node, G, gpus_per_node):
            x = left + g * cw
            parts.append(f'<line x1="{x}" y1="{top}" x2="{x}" y2="{top + ch * L}" stroke="#ffffff" '
                         'stroke-width="1"/>')
    parts.append(f'<rect x="{left}" y="{top}" width="{cw * G}" height="{ch * L}" fill="none" stroke="{_AXIS}" '
                 'stroke-width="0.5"/>')
    for g in _index_ticks(G):
        parts.append(f'<text x="{left + g * cw + cw / 2:.1f}" y="{top + ch * L + 13}" {_FONT} '
                     f'text-anchor="middle">{g}</text>')
    for layer in _index_ticks(L):
        parts.append(f'<text x="{left - 4}" y="{top + layer * ch + ch / 2 + 4:.1f}" {_FONT} '
                     f'text-anchor="end">{layer}</text>')
    parts.append(f'<text x="{left + cw * G / 2:.1f}" y="{h - 4}" {_FONT} text-anchor="middle">{_esc(xlabel)}</text>')
    parts.append(f'<text x="12" y="{top + ch * L / 2:.1f}" {_FONT} text-anchor="middle" '
                 f'transform="rotate(-90 12 {top + ch * L / 2:.1f})">MoE layer</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _index_ticks(n: int) -> list[int]:
    """Indices ``0 .. n - 1`` to label: every one when few, else about eight round ones."""
    if n <= 16:
        return list(range(n))
    step = int(next(t for t in nice_ticks(0, n, 8)[1:] if t > 0)) if n > 1 else 1
    return list(range(0, n, max(step, 1)))


def colorbar_svg(vmin: float, vmax: float, label: str, *, width: int = 480, steps: int = 64) -> str:
    """A horizontal legend of the sequential scale on ``[vmin, vmax]``: ``steps`` swatches (class ``cbar``), ticks and
    ``label``."""
    left, bar_h = 10, 14
    sw = (width - 2 * left) / steps
    vals = np.linspace(vmin, vmax, steps)
    parts = [f'<svg class="chart colorbar" width="{width}" height="48" viewBox="0 0 {width} 48" role="img" '
             f'aria-label="{_esc(label)}">']
    for i, colour in enumerate(sequential(vals, vmin, vmax)):
        parts.append(f'<rect class="cbar" x="{left + i * sw:.2f}" y="4" width="{sw + 0.4:.2f}" height="{bar_h}" '
                     f'fill="{colour}"/>')
    ticks = nice_ticks(vmin, vmax, 6)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else None
    span = vmax - vmin if vmax > vmin else 1.0
    for t in ticks:
        x = left + (t - vmin) / span * (width - 2 * left)
        parts.append(f'<line x1="{x:.1f}" y1="{4 + bar_h}" x2="{x:.1f}" y2="{8 + bar_h}" stroke="{_AXIS}"/>')
        parts.append(f'<text x="{x:.1f}" y="{20 + bar_h}" {_FONT} text-anchor="middle">{short_number(t, step)}</text>')
    parts.append(f'<text x="{width / 2:.1f}" y="46" {_FONT} text-anchor="middle">{_esc(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _style(i: int) -> tuple[str, str]:
    """``(colour, dash pattern)`` of series ``i``."""
    return CATEGORICAL[i % len(CATEGORICAL)], _DASHES[(i // len(CATEGORICAL)) % len(_DASHES)]


def legend_html(labels: Sequence[str], *, blocks: bool = False, styles: Sequence[int] | None = None) -> str:
    """An HTML legend: per label, a swatch of its series' colour (a line, or with ``blocks`` a filled square, as the
    bars of :func:`bars_svg` are drawn) and the label; ``styles`` as in :func:`lines_svg`."""
    items = []
    for i, label in enumerate(labels):
        colour, dash = _style(i if styles is None else styles[i])
        swatch = (f'<span class="swatch block" style="background: {colour}"></span>' if blocks else
                  f'<span class="swatch" style="border-top: 3px {"dashed" if dash else "solid"} {colour}"></span>')
        items.append(f"<li>{swatch}{_esc(label)}</li>")
    return '<ul class="legend">' + "".join(items) + "</ul>"


def lines_svg(series: Mapping[str, Sequence[float]], *, ylabel: str, xlabel: str,
              x: Sequence[float] | None = None, reference: float | None = None,
              ylim: tuple[float | None, float | None] = (None, None), styles: Sequence[int] | None = None,
              width: int = 1100, height: int = 320) -> str:
    """One line per series (``polyline`` elements of class ``series``, broken where a value is nan), against ``x``
    (shared; default ``0, 1, ...``), with axes, grid, ticks, axis labels and an optional dotted ``reference`` line.
    Series ``i`` takes colour and dash number ``styles[i]`` (default ``i``), so that one row keeps its colour across
    charts."""
    left, right, top, bottom = 70, 16, 12, 44
    pw, ph = width - left - right, height - top - bottom
    ys = [np.asarray(v, dtype=np.float64) for v in series.values()]
    xs = [np.asarray(x, dtype=np.float64)[:y.size] if x is not None else np.arange(y.size, dtype=np.float64)
          for y in ys]
    finite = np.concatenate([y[np.isfinite(y)] for y in ys] + [np.zeros(0)])
    xall = np.concatenate([*xs, np.zeros(0)])
    lo = float(finite.min()) if finite.size else 0.0
    hi = float(finite.max()) if finite.size else 1.0
    if reference is not None:
        lo, hi = min(lo, reference), max(hi, reference)
    pad = (hi - lo) * 0.05 or max(abs(hi) * 0.05, 0.5)
    lo = ylim[0] if ylim[0] is not None else lo - pad
    hi = ylim[1] if ylim[1] is not None else hi + pad
    x0 = float(xall.min()) if xall.size else 0.0
    x1 = float(xall.max()) if xall.size else 1.0
    x1 = x1 if x1 > x0 else x0 + 1.0

    def px(v: np.ndarray | float) -> np.ndarray:
        return left + (np.asarray(v, dtype=np.float64) - x0) / (x1 - x0) * pw

    def py(v: np.ndarray | float) -> np.ndarray:
        return top + ph - (np.asarray(v, dtype=np.float64) - lo) / (hi - lo) * ph

    parts = [f'<svg class="chart lines" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{_esc(ylabel)}">']
    yt = [t for t in nice_ticks(lo, hi, 6) if lo <= t <= hi]
    ystep = yt[1] - yt[0] if len(yt) > 1 else None
    for t in yt:
        y = float(py(t))
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="{_GRID}"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" {_FONT} text-anchor="end">{short_number(t, ystep)}</text>')
    xt = [t for t in nice_ticks(x0, x1, 10) if x0 <= t <= x1]
    xstep = xt[1] - xt[0] if len(xt) > 1 else None
    for t in xt:
        xp = float(px(t))
        parts.append(f'<line x1="{xp:.1f}" y1="{top + ph}" x2="{xp:.1f}" y2="{top + ph + 4}" stroke="{_AXIS}"/>')
        parts.append(f'<text x="{xp:.1f}" y="{top + ph + 16}" {_FONT} text-anchor="middle">'
                     f'{short_number(t, xstep)}</text>')
    if reference is not None and lo <= reference <= hi:
        y = float(py(reference))
        parts.append(f'<line class="reference" x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#000000" '
                     'stroke-dasharray="2 3" stroke-width="0.8"/>')
    parts.append(f'<polyline points="{left},{top} {left},{top + ph} {left + pw},{top + ph}" fill="none" '
                 f'stroke="{_AXIS}"/>')
    for i, (xv, yv) in enumerate(zip(xs, ys, strict=True)):
        colour, dash = _style(i if styles is None else styles[i])
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        ok = np.isfinite(yv)
        pxs, pys = px(xv), py(np.clip(np.where(ok, yv, lo), lo, hi))
        breaks = np.flatnonzero(np.diff(np.concatenate([[0], ok.astype(np.int8), [0]])))
        for start, stop in zip(breaks[::2].tolist(), breaks[1::2].tolist(), strict=True):
            pts = " ".join(f"{_xy(a)},{_xy(b)}" for a, b in zip(pxs[start:stop].tolist(), pys[start:stop].tolist(),
                                                                  strict=True))
            parts.append(f'<polyline class="series" data-series="{i}" points="{pts}" fill="none" stroke="{colour}" '
                         f'stroke-width="1.6" stroke-linejoin="round"{dash_attr}/>')
            if stop - start == 1 or yv.size <= 40:
                parts += [f'<circle cx="{_xy(a)}" cy="{_xy(b)}" r="2.2" fill="{colour}"/>'
                          for a, b in zip(pxs[start:stop].tolist(), pys[start:stop].tolist(), strict=True)]
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{height - 6}" {_FONT} text-anchor="middle">{_esc(xlabel)}</text>')
    parts.append(f'<text x="14" y="{top + ph / 2:.1f}" {_FONT} text-anchor="middle" '
                 f'transform="rotate(-90 14 {top + ph / 2:.1f})">{_esc(ylabel)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def bars_svg(data: Mapping[str, Mapping[str, float]], *, unit: str, width: int = 1100) -> str:
    """A stacked horizontal bar per label: one ``rect`` of class ``seg`` per component with a positive value (the
    components coloured in first-seen order, :func:`legend_html` of :func:`bar_components` with ``blocks``), the
    total at its end; the axis is labelled ``unit``."""
    labels = list(data)
    comps = bar_components(data)
    longest = max((len(k) for k in labels), default=0)
    left, right, top, row = min(560, max(120, 7 * min(longest, 76) + 16)), 70, 8, 26  # room for the labels
    pw = width - left - right
    totals = [sum(float(v) for v in data[k].values()) for k in labels]
    peak = max(totals, default=0.0) or 1.0
    ticks = nice_ticks(0.0, peak, 6)
    top_tick = max(ticks[-1] if ticks else peak, peak)
    height = top + row * len(labels) + 40
    parts = [f'<svg class="chart bars" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{_esc(unit)}">']
    step = ticks[1] - ticks[0] if len(ticks) > 1 else None
    base = top + row * len(labels)
    for t in ticks:
        xp = left + t / top_tick * pw
        parts.append(f'<line x1="{xp:.1f}" y1="{top}" x2="{xp:.1f}" y2="{base}" stroke="{_GRID}"/>')
        parts.append(f'<text x="{xp:.1f}" y="{base + 14}" {_FONT} text-anchor="middle">{short_number(t, step)}</text>')
    for j, label in enumerate(labels):
        y = top + j * row + 4
        shown = label if len(label) <= 76 else label[:75] + "…"
        parts.append(f'<text x="{left - 8}" y="{y + 13}" {_FONT} text-anchor="end"><title>{_esc(label)}</title>'
                     f'{_esc(shown)}</text>')
        x = float(left)
        for c, comp in enumerate(comps):
            v = float(data[label].get(comp, 0.0))
            if v <= 0:
                continue
            w = v / top_tick * pw
            parts.append(f'<rect class="seg" x="{x:.2f}" y="{y}" width="{w:.2f}" height="18" '
                         f'fill="{_style(c)[0]}"><title>{_esc(label)}: {_esc(comp)} {short_number(v)} {_esc(unit)}'
                         '</title></rect>')
            x += w
        parts.append(f'<text class="total" x="{x + 6:.1f}" y="{y + 13}" {_FONT}>{short_number(totals[j])}</text>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="{_AXIS}"/>')
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{height - 6}" {_FONT} text-anchor="middle">{_esc(unit)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def bar_components(data: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The components of :func:`bars_svg`'s data, in first-seen order (the order of their colours)."""
    return list(dict.fromkeys(c for parts in data.values() for c in parts))
