"""What ``moebalance advise`` hands over: the engine's whole launch command for the configuration it recommends (the
layout, all-to-all, precision and overlap it was priced with, and the EPLB flags: each engine's ``launch``,
:class:`moebalance.engines.base.Engine`), the files it names (written atomically), the ranking table, and the HTML
report with what the prices assumed (:mod:`moebalance.app.assumptions`; docs/design.md, "Advice").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from moebalance.app.advise import Advice, Candidate, Priced, Setup
from moebalance.app.assumptions import assumption_rows
from moebalance.app.html_report import Report, relative_loads
from moebalance.core.io import atomic_write_text
from moebalance.core.plan import write_plan
from moebalance.engines.base import EplbChoice, Launch
from moebalance.engines.registry import ENGINES

__all__ = ["FLAGS_FILE", "PLAN_FILE", "advice_text", "advise_report", "advise_table", "choice_of", "launch_lines",
           "write_engine_files"]

#: The files ``--out-dir`` receives besides the engine's own, ``report.html`` and ``advise.json``.
FLAGS_FILE, PLAN_FILE = "launch.txt", "plan.json"


def choice_of(c: Candidate) -> EplbChoice | None:
    """What a launch of candidate ``c`` runs (``None``: EPLB off)."""
    if c.off:
        return None
    return EplbChoice(redundant_experts=c.redundant_experts, router=c.router, rebalance=c.rebalance,
                      hierarchical=c.mode == "hierarchical", plugin=c.plugin, layers_per_step=c.layers_per_step or 0)


def _launch(advice: Advice, setup: Setup, folder: Path | None) -> Launch:
    return Launch(setup.phase.deployment, setup.cluster, setup.phase.phase, choice_of(advice.recommended.candidate),
                  folder)


def launch_lines(advice: Advice, setup: Setup, out_dir: Path | None = None) -> list[str]:
    """The engine's whole launch command for the recommended configuration (first line: the model, layout,
    all-to-all, precision and overlap priced, then the EPLB flags), with its environment, and ``#`` comments after
    it; the files are named in ``out_dir`` (else placeholders to fill once written), every path and JSON argument
    quoted for a POSIX shell."""
    return ENGINES[advice.engine].launch(_launch(advice, setup, out_dir))


def write_engine_files(advice: Advice, setup: Setup, out_dir: Path, model: str, *, mtp_layers: int = 0,
                       named: Path | None = None) -> list[Path]:
    """Write the recommendation's files into ``out_dir``: the plan (moebalance's JSON) unless EPLB stays off, the
    engine's files (its placement, TensorRT-LLM's ``--extra_llm_api_options`` YAML), and the launch command last;
    returns their paths. ``mtp_layers``: the keys of multi-token-prediction layers where the engine's placement
    carries them (:func:`moebalance.engines.trtllm.write_config`). ``named``: the folder the command names the files
    in (default ``out_dir``), where they will be read from when ``out_dir`` is a temporary folder put in its place
    afterwards (:func:`moebalance.core.io.atomic_dir`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rec, engine = advice.recommended, ENGINES[advice.engine]
    at = _launch(advice, setup, out_dir if named is None else named)
    written: list[Path] = []
    if not rec.candidate.off:
        written.append(out_dir / PLAN_FILE)
        write_plan(written[-1], rec.plan)
    written += engine.write_files(out_dir, at, None if rec.candidate.off else rec.plan, model, mtp_layers)
    written.append(out_dir / FLAGS_FILE)
    atomic_write_text(written[-1], "\n".join(engine.launch(at)) + "\n")
    return written


def advice_text(advice: Advice) -> str:
    """The recommendation in one sentence."""
    rec, off = advice.recommended, advice.off
    margin = f"{100 * advice.margin:.1f}%"
    if advice.leave_off:
        best = advice.ranked[0]
        beat = "" if best is off else (f"; the fastest, {best.candidate.label}, models "
                                       f"{best.tokens_per_s:,.0f} tokens/s, "
                                       f"{100 * (best.tokens_per_s / off.tokens_per_s - 1):+.1f}%")
        return (f"Leave EPLB off on {advice.engine}: {off.tokens_per_s:,.0f} tokens/s modelled, and no configuration "
                f"beats it by more than the {margin} margin{beat}.")
    why = off.candidate.reference_only
    last = (f"the margin to clear was {margin}" if why is None else
            f"EPLB off cannot run here, as {why}, so the fastest configuration {advice.engine} runs is recommended")
    return (f"Run {rec.candidate.label} on {advice.engine}: {rec.tokens_per_s:,.0f} tokens/s modelled, "
            f"{100 * advice.gain_vs_off:+.1f}% over EPLB off ({off.tokens_per_s:,.0f}), KV cache "
            f"{rec.kv_cache_gib:.1f} GiB per GPU against {off.kv_cache_gib:.1f}; {last}.")


_COLUMNS = ("candidate", "tokens/s", "vs off", "KV cache GiB/GPU", "weights GiB/GPU", "step tokens",
            "balancedness", "redundant", "exposed ms")


def _cells(p: Priced, off: Priced) -> list[str]:
    gain = p.tokens_per_s / off.tokens_per_s - 1 if off.tokens_per_s > 0 else 0.0
    return [p.candidate.label, f"{p.tokens_per_s:,.0f}", f"{100 * gain:+.1f}%", f"{p.kv_cache_gib:.2f}",
            f"{p.weights_gib:.2f}", f"{p.step_tokens:,}", f"{p.balancedness:.4f}", f"{p.candidate.redundant_experts}",
            f"{p.time['exposed_balancing_ms']:.1f}"]


def advise_table(advice: Advice, title: str) -> Table:
    """The ranking, fastest first; the recommended row in bold."""
    table = Table(title=title, title_justify="left")
    widest = min(max(len(p.candidate.label) for p in advice.ranked), 90)  # labels on one line where they fit
    for i, col in enumerate(_COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right", min_width=widest if i == 0 else None)
    for p in advice.ranked:
        table.add_row(*_cells(p, advice.off), style="bold" if p is advice.recommended else None)
    return table


def _step_split(p: Priced, moe_layers: int) -> dict[str, float]:
    """A candidate's mean step, ms: its MoE layers (slowest GPU's experts and the all-to-all), the rest of the model,
    and what balancing exposed (re-plan stalls, router time)."""
    t = p.time
    n = max(len(t["per_batch_step_ms"]), 1)
    exposed = t["exposed_balancing_ms"] / n
    moe = min(t["moe_layer_ms_mean"] * moe_layers, max(t["step_ms_mean"] - exposed, 0.0))
    return {"MoE layers": moe, "rest of the model": max(t["step_ms_mean"] - exposed - moe, 0.0),
            "balancing exposed": max(exposed, 0.0)}


#: Bars drawn at most (the fastest, and EPLB off).
_MAX_BARS = 12


def advise_report(advice: Advice, setup: Setup, title: str, files: Mapping[str, str],
                  notes: Sequence[str] = (), *, assumptions: dict[str, Any] | None = None) -> Report:
    """The page of ``advise --out-dir``: what the prices assumed (``assumptions``,
    :func:`moebalance.app.assumptions.assumptions`), the ranking, the recommendation with its files (``{name:
    content}``), each candidate's mean step split, the GPUs' loads on the priced batches as recorded under EPLB off
    and under the recommendation, and the notes."""
    report = Report("moebalance advise", title)
    if assumptions is not None:
        report.assumptions(assumption_rows(assumptions))
    report.ranking([_cells(p, advice.off) for p in advice.ranked], _COLUMNS,
                   best=list(advice.ranked).index(advice.recommended),
                   caption="Candidates by modelled tokens per second, fastest first; the recommendation highlighted. "
                           "\"every K on W\": re-planned every K steps from the load of the last W steps.")
    report.recommendation(advice_text(advice), files)
    L = setup.num_moe_layers
    bars: dict[str, dict[str, float]] = {}
    for p in [*advice.ranked, advice.off]:  # the fastest, without near-duplicates (same tokens, within 0.5%), and off
        split = _step_split(p, L)
        label = f"{p.candidate.label}: {p.step_tokens:,} tokens/step"
        twin = any(k.endswith(f": {p.step_tokens:,} tokens/step") and abs(sum(split.values()) - sum(v.values()))
                   <= 0.005 * sum(v.values()) for k, v in bars.items())
        if (len(bars) < _MAX_BARS and not twin) or (p is advice.off and label not in bars):
            bars[label] = split
    report.bars("Mean step time", bars, unit="ms per step",
                caption="Per candidate, with its step's tokens (a step of fewer tokens can be shorter and still serve "
                        "fewer tokens per second): its MoE layers, the rest of the model on those tokens, and the time "
                        "balancing exposed (a synchronous re-plan's stall, a router's host time). Candidates within "
                        "0.5% of a faster one's step on the same tokens are left out.")
    pairs = [("off", advice.off)] + ([] if advice.leave_off else [("recommended", advice.recommended)])
    heats = [relative_loads(p.plan, setup.test, p.candidate.router, setup.seed)[0] for _, p in pairs]
    report.heatmap("GPU load per layer: EPLB off and the recommendation", heats[0], heats[1] if len(heats) > 1 else None,
                   labels=(pairs[0][0], pairs[-1][0]), scale_label="GPU load / the layer's mean GPU load (1 = fair share)",
                   gpus_per_node=setup.cluster.gpus_per_node,
                   caption="The priced batches as recorded (before they are drawn again as steps); grey: no load.")
    for line in notes:
        report.note(line)
    return report
