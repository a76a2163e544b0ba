"""Real MoE models: the shape facts of their ``config.json`` files (layers, experts, top-k, sizes, groups).

These are published numbers, not modelling choices; the synthetic routing profiles that imitate each model's
traffic live in :mod:`moebalance.workloads.synth` (see ``docs/synth.md``).
"""

from moebalance.models.specs import MODELS, ModelSpec, get_model

__all__ = ["MODELS", "ModelSpec", "get_model"]
