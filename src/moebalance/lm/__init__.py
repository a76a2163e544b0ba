"""A small byte-level MoE language model, trained offline, whose routing is real data for moebalance.

Glossary (see also :mod:`moebalance` and :mod:`moebalance.runtime`)
-------------------------------------------------------------------
domain
    A kind of text: ``code`` (the running Python's standard library source) or ``prose`` (the English
    documentation shipped as ``pydoc_data/topics.py``). Both are present on every CPython, so nothing is
    downloaded (:mod:`~moebalance.lm.data`).
held-out split
    Every tenth 4,096-token chunk of a domain: text the model never trained on, used for evaluation, capture
    and runs.
MoE layer
    Every transformer block's FFN: a softmax top-k gate (the runtime's :func:`~moebalance.runtime.topk_gating`)
    over ``E`` SwiGLU experts stored as :class:`~moebalance.runtime.ExpertWeights`.
capture
    A token-level routing trace (docs/design.md, "Data formats") recorded by running the model on text, sequences spread
    round-robin over data-parallel ranks (:mod:`~moebalance.lm.capture`).
run
    The model with every MoE layer executed by :class:`~moebalance.runtime.ExpertParallelMoE` on local gloo
    ranks under a plan, checked against the dense single-process model and the simulator
    (:mod:`~moebalance.lm.run`).

Modules: :mod:`~moebalance.lm.moe_lm` (model, checkpoints), :mod:`~moebalance.lm.data` (corpora),
:mod:`~moebalance.lm.train` (``python -m moebalance.lm.train``), :mod:`~moebalance.lm.capture`,
:mod:`~moebalance.lm.run`. The trained checkpoint ships as ``moebalance/lm/weights/moe_lm.safetensors`` with its
record ``moe_lm.json``; ``docs/results/moe_lm.md`` reports its training and routing.
"""

from moebalance.lm.capture import PRESET, Capture, Layout, capture, make_layout, write_capture
from moebalance.lm.data import DOMAINS, domain_tokens, text_tokens
from moebalance.lm.moe_lm import (
    ForwardOutput,
    ModelConfig,
    MoELM,
    bundled_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from moebalance.lm.run import RankReport, RunReport, run_model, run_torchrun

__all__ = [
    "DOMAINS",
    "PRESET",
    "Capture",
    "ForwardOutput",
    "Layout",
    "MoELM",
    "ModelConfig",
    "RankReport",
    "RunReport",
    "bundled_checkpoint",
    "capture",
    "domain_tokens",
    "load_checkpoint",
    "make_layout",
    "run_model",
    "run_torchrun",
    "save_checkpoint",
    "text_tokens",
    "write_capture",
]
