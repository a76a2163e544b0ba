"""What ``moebalance advise`` hands over: the engine's whole launch command for the configuration it recommends (the
layout, all-to-all, precision and overlap it was priced with: :mod:`moebalance.app.engine_command`, then the EPLB
flags below), the files it names (written atomically), the ranking table, and the HTML report with what the prices
assumed (:mod:`moebalance.app.assumptions`; docs/design.md, "Advice").

EPLB flags, checked against the engines' own argument lists:

- vLLM 0.33: ``--enable-expert-parallel --enable-eplb --eplb-config '{"window_size": W, "step_interval": S,
  "num_redundant_experts": R, "use_async": true}'``. vLLM loads no placement: its EPLB makes its first plan after
  ``S / 4`` steps on the ``W`` steps before, then re-plans every ``S`` steps. A static plan is given as
  ``W = 1000`` (vLLM's default window) and ``S = 4 W``: the first plan after ``W`` steps, the next after ``S`` more.
  The migration-aware variant is the plug-in's (``MOEBALANCE_VLLM_EPLB=move-aware``, :mod:`moebalance.engines.vllm_plugin`).
- SGLang 0.5: ``--ep-size G --ep-num-redundant-experts R --init-expert-location FILE --ep-dispatch-algorithm
  static|dynamic|lp`` (no ``--enable-eplb`` for a static plan: it would re-plan every 1,000 iterations); periodic
  re-planning adds ``--enable-eplb --eplb-algorithm deepseek|deepseek_hierarchical --eplb-rebalance-num-iterations S
  --expert-distribution-recorder-buffer-size W``.
- TensorRT-LLM: ``--extra_llm_api_options`` naming a YAML whose ``moe_config.load_balancer`` names the YAML of
  ``num_slots``, ``initial_global_assignments`` and ``layer_updates_per_iter``.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from moebalance.app.advise import ENGINE_RULES, Advice, Priced, Setup
from moebalance.app.assumptions import assumption_rows
from moebalance.app.engine_command import engine_command, trtllm_options
from moebalance.app.html_report import Report, relative_loads
from moebalance.core.io import atomic_write_text
from moebalance.core.plan import write_plan
from moebalance.engines.sglang import write_placement
from moebalance.engines.trtllm import write_config
from moebalance.engines.vllm_plugin import ENTRY_POINT, ENV

__all__ = ["FILE_NAMES", "VLLM_STATIC_WINDOW", "advice_text", "advise_report", "advise_table", "launch_lines",
           "trtllm_yaml", "write_engine_files"]

#: vLLM's default ``window_size``: the steps a static plan is made on.
VLLM_STATIC_WINDOW = 1000
#: The files ``--out-dir`` receives (besides ``report.html`` and ``advise.json``).
FILE_NAMES = {"flags": "launch.txt", "plan": "plan.json", "sglang": "sglang-init-expert-location.json",
              "trtllm": "trtllm-load-balancer.yaml", "trtllm_options": "trtllm-extra-llm-api-options.yaml"}


def _placement_file(engine: str, out_dir: Path | None) -> str:
    return str(out_dir / FILE_NAMES[engine]) if out_dir is not None else FILE_NAMES[engine]


def launch_lines(advice: Advice, setup: Setup, out_dir: Path | None = None) -> list[str]:
    """The engine's whole launch command for the recommended configuration (first line: the model, layout,
    all-to-all, precision and overlap priced, :func:`~moebalance.app.engine_command.engine_command`, then the EPLB
    flags), with its environment, and ``#`` comments after it; the files are named in ``out_dir`` (else placeholders
    to fill once written), every path and JSON argument quoted for a POSIX shell."""
    rec = advice.recommended.candidate
    engine, q = advice.engine, shlex.quote
    words, comments = engine_command(engine, setup.phase.deployment, setup.cluster, setup.phase.phase)
    if engine == "vllm":
        if rec.off:
            return [" ".join(words), "# EPLB off: no --enable-eplb", *comments]
        K, W = rec.rebalance if rec.rebalance is not None else (4 * VLLM_STATIC_WINDOW, VLLM_STATIC_WINDOW)
        config = {"window_size": W, "step_interval": K, "num_redundant_experts": rec.redundant_experts,
                  "use_async": True}
        env = [] if rec.plugin is None else [f"{ENV}={q(rec.plugin)}"]
        lines = [" ".join([*env, *words, "--enable-eplb", "--eplb-config", q(json.dumps(config))])]
        if rec.rebalance is None:
            lines.append(f"# vLLM loads no placement: it makes its first plan after step_interval / 4 = {W} steps, on "
                         f"those steps, then re-plans every {K} steps (a step_interval beyond the run would keep "
                         "vLLM's initial layout, experts 0..R-1 copied, not this plan)")
        if rec.plugin is not None:
            lines.append(f"# {ENV}: the moebalance plug-in (pip install moebalance[vllm]); if VLLM_PLUGINS is set it "
                         f"must list {ENTRY_POINT}")
        return lines + comments
    if engine == "sglang":
        if rec.off:
            return [" ".join(words), "# EPLB off: the trivial expert location, no --enable-eplb", *comments]
        dispatch = ENGINE_RULES["sglang"].routers[rec.router]  # SGLang's name of the router
        words += ["--ep-num-redundant-experts", str(rec.redundant_experts), "--init-expert-location",
                  q(_placement_file("sglang", out_dir)), "--ep-dispatch-algorithm", dispatch]
        if rec.rebalance is not None:
            algorithm = "deepseek_hierarchical" if rec.mode == "hierarchical" else "deepseek"
            words += ["--enable-eplb", "--eplb-algorithm", algorithm, "--eplb-rebalance-num-iterations",
                      str(rec.rebalance[0]), "--expert-distribution-recorder-buffer-size", str(rec.rebalance[1])]
        return [" ".join(words), *_unwritten([FILE_NAMES["sglang"]], out_dir), *comments]
    options = _placement_file("trtllm_options", out_dir)
    lines = [" ".join([*words, "--extra_llm_api_options", q(options)]), f"# {options} holds:"]
    lines += [f"#   {line}" for line in trtllm_yaml(advice, setup, out_dir).splitlines()]
    if rec.off:
        lines.append("# EPLB off: no moe_config.load_balancer")
    names = [FILE_NAMES["trtllm_options"], *([] if rec.off else [FILE_NAMES["trtllm"]])]
    return lines + _unwritten(names, out_dir) + comments


def trtllm_yaml(advice: Advice, setup: Setup, out_dir: Path | None) -> str:
    """TensorRT-LLM's ``--extra_llm_api_options`` file for the recommendation
    (:func:`~moebalance.app.engine_command.trtllm_options`), naming the load-balancer file in ``out_dir``."""
    balancer = None if advice.recommended.candidate.off else _placement_file("trtllm", out_dir)
    doc: dict[str, Any] = trtllm_options(setup.phase.deployment, setup.cluster, balancer)
    return yaml.safe_dump(doc, default_flow_style=False, sort_keys=False, width=10**6)


def _unwritten(names: Sequence[str], out_dir: Path | None) -> list[str]:
    return [f"# give --out-dir to write {' and '.join(names)}"] if out_dir is None else []


def write_engine_files(advice: Advice, setup: Setup, out_dir: Path, model: str, *, mtp_layers: int = 0,
                       named: Path | None = None) -> list[Path]:
    """Write the recommendation's files into ``out_dir``: the launch command, unless EPLB stays off the plan
    (moebalance's JSON) and the engine's placement file, and TensorRT-LLM's ``--extra_llm_api_options`` YAML;
    returns their paths, the command last. ``mtp_layers``: the
    TensorRT-LLM file's keys for multi-token-prediction layers (:func:`moebalance.engines.trtllm.write_config`).
    ``named``: the folder the flags name the files in (default ``out_dir``), where they will be read from when
    ``out_dir`` is a temporary folder put in its place afterwards (:func:`moebalance.core.io.atomic_dir`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rec = advice.recommended
    written: list[Path] = []
    if not rec.candidate.off:
        plan = rec.plan
        dest = out_dir / FILE_NAMES["plan"]
        write_plan(dest, plan)
        written.append(dest)
        if advice.engine == "sglang":
            dest = out_dir / FILE_NAMES["sglang"]
            write_placement(dest, plan, model=model)
            written.append(dest)
        elif advice.engine == "trtllm":
            dest = out_dir / FILE_NAMES["trtllm"]
            write_config(dest, plan, None, rec.candidate.layers_per_step or 0, model=model, mtp_layers=mtp_layers)
            written.append(dest)
    if advice.engine == "trtllm":  # the options name the load balancer where the files will be read
        dest = out_dir / FILE_NAMES["trtllm_options"]
        atomic_write_text(dest, trtllm_yaml(advice, setup, out_dir if named is None else named))
        written.append(dest)
    dest = out_dir / FILE_NAMES["flags"]
    atomic_write_text(dest, "\n".join(launch_lines(advice, setup, out_dir if named is None else named)) + "\n")
    return [*written, dest]


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
