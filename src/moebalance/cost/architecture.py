"""The cost model's names for a model's architecture, kept for code written against them.

A model's architecture sizes and its parameter counts now live in the one real-model description,
:class:`moebalance.models.ModelSpec` (with :class:`~moebalance.models.Attention`); ``ModelArch`` is that class,
:data:`ARCHS` the named models that give their architecture, and ``arch.spec`` is the spec itself.
"""

from __future__ import annotations

from moebalance.models import MODELS, ModelSpec, get_model

__all__ = ["ARCHS", "ModelArch", "get_arch"]

#: The former name of :class:`moebalance.models.ModelSpec`.
ModelArch = ModelSpec

#: The named models whose architecture the cost model can weigh (every preset gives it).
ARCHS: dict[str, ModelSpec] = {name: spec for name, spec in MODELS.items() if spec.has_architecture}


def get_arch(name: str) -> ModelSpec:
    """The model called ``name`` (:func:`moebalance.models.get_model`); an unknown name raises
    :class:`~moebalance.core.errors.InputError`."""
    return get_model(name)
