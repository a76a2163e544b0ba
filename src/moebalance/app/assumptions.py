"""What a price assumed, stated beside it (docs/design.md, "Advice"): the calibration and its fit error, the
precision, the attention layout, the all-to-all, the overlap, the phase, the tokens and requests in a step, the
margin, and whether the priced batches were held out.

``advise`` gives them as ``assumptions`` in its JSON (``--json`` and ``advise.json``, :data:`KEYS`), in its table's
title and in its report's "Assumptions" panel; ``compare`` and ``online`` in their report's panel where they price
with ``--gpu``. A value a command does not have (``online`` has no margin) is ``None`` and has no row.
"""

from __future__ import annotations

from typing import Any

from moebalance.core.cluster import Cluster
from moebalance.cost.deployment import A2A_WORDS, Deployment
from moebalance.cost.time import PRECISION_BYTES

__all__ = ["KEYS", "assumption_rows", "assumption_text", "assumptions", "compare_assumptions",
           "online_assumptions"]

#: The keys of ``assumptions``, in this order.
KEYS = ("calibration", "calibration_fit_error", "precision", "kv_cache_dtype", "attention_tp", "data_parallel_ranks",
        "a2a", "overlap", "phase", "tokens_per_step", "step_note", "requests_per_step", "margin", "held_out",
        "held_out_note")
#: A precision in words where "<precision> weights and GEMMs" would not say it (:func:`assumption_rows`).
_PRECISIONS = {"mxfp4": "mxfp4 experts (4.25 bits a weight), bf16 other weights and GEMMs"}
_PHASES = {"decode": "decode steps: one token per running request",
           "prefill": "prefill steps: a chunk of prompt tokens per data-parallel rank"}


def assumptions(d: Deployment, cluster: Cluster, *, fit_error: float | None, phase: str,
                tokens_per_step: int | None = None, margin: float | None = None, held_out: bool | None = None,
                held_out_note: str | None = None, step_note: str | None = None) -> dict[str, Any]:
    """The assumptions of prices taken for ``d`` on ``cluster`` (:data:`KEYS`). ``fit_error``: the calibration's
    recorded mean absolute log error (``None``: none recorded); ``phase``: the steps priced (``decode``, ``prefill``
    or what else priced them, in words); ``tokens_per_step``: a step's tokens where one number holds, else
    ``step_note`` says what a step holds (or whose the number is); ``held_out_note``: why the priced batches are not
    held out, or where held out what they are."""
    tokens = None if tokens_per_step is None else int(tokens_per_step)
    requests: float | None = None
    if tokens is not None and phase == "decode":
        requests = tokens  # one token per running request
    elif tokens is not None and phase == "prefill":
        requests = round(tokens / d.workload.prompt_tokens, 6)  # prompts' worth of prompt tokens
    kv = {b: name for name, b in PRECISION_BYTES.items()}.get(d.engine.kv_bytes, f"{d.engine.kv_bytes}-byte")
    return {"calibration": d.calibration.source,
            "calibration_fit_error": None if fit_error is None else round(float(fit_error), 6),
            "precision": d.precision, "kv_cache_dtype": kv,
            "attention_tp": d.engine.attention_group(cluster.gpus_per_node), "data_parallel_ranks": d.ranks(cluster),
            "a2a": d.a2a, "overlap": d.overlap, "phase": phase, "tokens_per_step": tokens, "step_note": step_note,
            "requests_per_step": requests, "margin": None if margin is None else round(float(margin), 6),
            "held_out": held_out, "held_out_note": held_out_note}


def assumption_rows(doc: dict[str, Any], baseline: str = "EPLB off") -> list[tuple[str, str]]:
    """``(what, value)`` in words, one per assumption ``doc`` (:func:`assumptions`) holds: the report's panel; the
    margin is over ``baseline``."""
    error = doc["calibration_fit_error"]
    rows = [("calibration", doc["calibration"] + ("; no fit error recorded" if error is None else
                                                  f"; fit error {error:.3f} (mean absolute log error)")),
            ("precision", f"{_PRECISIONS.get(doc['precision'], doc['precision'] + ' weights and GEMMs')}, "
                          f"{doc['kv_cache_dtype']} KV cache"),
            ("attention", f"tensor-parallel over {doc['attention_tp']} GPUs in each of {doc['data_parallel_ranks']} "
                          f"data-parallel rank{'' if doc['data_parallel_ranks'] == 1 else 's'}"),
            ("all-to-all", f"{doc['a2a']}: {A2A_WORDS[doc['a2a']]}"),
            ("overlap", "none" if doc["overlap"] == "none" else "two-batch overlap (tbo)"),
            ("phase", _PHASES.get(doc["phase"], doc["phase"]))]
    tokens, requests, note = doc["tokens_per_step"], doc["requests_per_step"], doc["step_note"]
    if tokens is not None or note:
        rows.append(("tokens per step", ", ".join(t for t in ("" if tokens is None else f"{tokens:,}", note) if t)))
    if requests is not None:
        rows.append(("requests per step", f"{requests:,}" if doc["phase"] == "decode" else
                     f"{requests:,.2f} (prompts' worth of prompt tokens)"))
    if doc["margin"] is not None:
        rows.append(("margin", f"{100 * doc['margin']:.1f}% over {baseline}"))
    if doc["held_out"] is not None:
        why = f": {doc['held_out_note']}" if doc["held_out_note"] else ""
        rows.append(("priced batches", "held out (not planned on)" + why if doc["held_out"] else "in sample" + why))
    return rows


def assumption_text(doc: dict[str, Any]) -> str:
    """The assumptions in one line (``advise``'s title): ``"calibration ...; precision ...; ..."``."""
    return "; ".join(f"{what} {value}" for what, value in assumption_rows(doc))


def compare_assumptions(d: Deployment, cluster: Cluster, *, fit_error: float | None, phase: str | None,
                        train_frac: float, margin: float | None = None) -> dict[str, Any]:
    """``compare --gpu``'s assumptions: each plan priced on the held-out batches (the last ``1 - train_frac``) in
    ``phase``'s steps, or without one by the goodput model's decode and prefill rounds."""
    chunk, ranks = d.workload.prefill_chunk, d.ranks(cluster)
    tokens = chunk * ranks if phase == "prefill" else None
    note = ("each plan's: as many requests as its KV cache holds" if phase == "decode" else None if phase else
            f"decode: each plan's KV-cache concurrency; prefill: {chunk:,} per data-parallel rank")
    held = train_frac < 1
    return assumptions(d, cluster, fit_error=fit_error, phase=phase or "decode and prefill rounds (goodput at "
                       "saturation)", tokens_per_step=tokens, step_note=note, held_out=held, margin=margin,
                       held_out_note=None if held else "--train-frac 1 scores the plans on the batches they plan on")


def online_assumptions(d: Deployment, cluster: Cluster, *, fit_error: float | None, phase: str | None,
                       step_tokens: int | None) -> dict[str, Any]:
    """``online --gpu``'s assumptions: the served batches, which come after the warm-up ones (``online`` refuses an
    overlap), replayed as ``phase``'s steps of ``step_tokens`` (without a phase, each batch as recorded, priced as a
    prefill step of its tokens)."""
    return assumptions(d, cluster, fit_error=fit_error,
                       phase=phase or "the load's batches as recorded, each priced as a prefill step",
                       tokens_per_step=step_tokens, step_note=None if phase else "each batch's own", held_out=True)
