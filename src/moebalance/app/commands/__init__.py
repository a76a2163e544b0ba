"""One module per command of the ``moebalance`` command line, each with ``add_parser(sub)`` (its sub-parser, whose
``func`` is ``run``) and ``run(args)``; :data:`SUMMARIES` names them in the order ``--help`` shows them, and
:data:`COMMANDS` is their modules in that order.

No command module is imported here: ``moebalance --help`` lists the commands from :data:`SUMMARIES` alone, and a
run imports only its own command's module (:func:`load`), so neither pays for torch, scipy or numba that the
command does not use. Options several commands share live in :mod:`moebalance.app.options`; ``import_`` is
``moebalance import`` (``import`` is a Python keyword).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["COMMANDS", "SUMMARIES", "load"]

#: Each command's one-line summary (its sub-parser's ``help``, which ``moebalance --help`` lists), in that order;
#: each module's ``add_parser`` passes the same text (tests/test_app_options.py checks that they agree).
SUMMARIES: dict[str, str] = {
    "synth": "generate a synthetic routing trace for a real model",
    "plan": "compute a placement plan",
    "evaluate": "score a plan by replaying a load through it",
    "compare": "plan with several policies and score them on held-out batches",
    "sweep": "balancedness against extra replicas per GPU (CRAFT Figures 1 and 8)",
    "stats": "per-layer skew of a load or trace",
    "demo": "compare every policy on bundled DeepSeek-V3-like data",
    "import": "convert an engine's routing dump into a moebalance load (.npz), once",
    "export": "write a plan in the form an engine loads (SGLang, TensorRT-LLM, vLLM)",
    "cost": "memory per GPU, KV cache, concurrency; with a plan, modelled layer time and goodput",
    "calibrate": "fit the cost model's compute constants to measured grouped-GEMM times, or measure them here "
                 "(--measure)",
    "predict": "how much of each token's routing a predictor foresees (Libra's accuracy)",
    "online": "replay a trace batch by batch as a server would: static, periodic and dynamic (libra) planning",
    "advise": "what to run on vLLM, SGLang or TensorRT-LLM: every expert-parallel configuration the engine can run, "
              "priced in tokens per second",
    "watch": "follow an engine's routing records: balance metrics, and re-plans when the move pays",
    "capture": "run the bundled MoE LM on text and write its token-level routing trace",
    "run": "run the MoE LM expert-parallel on local gloo ranks (or under torchrun) under a plan, and check it",
}


def load(name: str) -> ModuleType:
    """The module of command ``name`` (a key of :data:`SUMMARIES`), imported now."""
    return importlib.import_module(f"{__name__}.{'import_' if name == 'import' else name}")


def __getattr__(name: str) -> Any:
    """``COMMANDS``: every command's module, in :data:`SUMMARIES`'s order (imports them all)."""
    if name == "COMMANDS":
        return tuple(load(command) for command in SUMMARIES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
