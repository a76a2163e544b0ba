"""Real MoE models: one description per model (:class:`ModelSpec`), the shape facts of its ``config.json``.

Layers, experts, top-k and expert groups (what the synthetic generator and the policies read), and the
architecture's sizes -- hidden and FFN sizes, shared experts, attention (:class:`Attention`: MLA or GQA; each layer
full, a window or linear, :class:`LinearAttention`), vocabulary, multi-token-prediction layers -- from which the cost
model counts parameters and KV-cache bytes. These are
published numbers, each with its source, not modelling choices; the synthetic routing profiles that imitate each
model's traffic live in :mod:`moebalance.workloads.synth` (see ``docs/synth.md``).
"""

from moebalance.models.presets import MODELS, get_model
from moebalance.models.specs import Attention, LinearAttention, ModelSpec

__all__ = ["MODELS", "Attention", "LinearAttention", "ModelSpec", "get_model"]
