"""An MoE layer's price on a load through a plan and a router: every ``(batch, layer)`` replayed, each GPU's grouped
GEMM and the all-to-all timed (docs/design.md, "Cost model").

Legend: ``B`` batches, ``L`` layers, ``G`` GPUs.

The router's picks per GPU and the experts they touch come from the replay
(:func:`moebalance.routing.simulate.replay_picks`: exact from a token-level load's picks, or from a router that
says its split, else the hosted experts with load in the batch); each GPU's grouped GEMM is the deployment's
roofline (:meth:`moebalance.cost.Deployment.gemm_seconds`); the all-to-all is timed from a token-level load's
copies as the phase's kernel moves them (:func:`moebalance.routing.copies.traffic`), or, for counts, estimated from
each GPU's picks (:meth:`moebalance.cost.Deployment.a2a_estimate`), with the kernel's fixed cost; the layer is
:meth:`moebalance.cost.Deployment.layer_seconds` of the two. Everything that prices a plan's layers (the goodput
model, the phase steps, the priced online replay, ``advise``) prices them here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.deployment import Deployment
from moebalance.routing import Router
from moebalance.routing.simulate import replay_picks

__all__ = ["LayerPrice", "price_layers"]


@dataclass(frozen=True, slots=True)
class LayerPrice:
    """Every ``(batch, layer)`` of a load priced through a plan and a router."""

    #: ``float64 [B, L, G]``: the picks each GPU serves.
    loads: np.ndarray
    #: ``float64 [B, L, G]``: the distinct experts those picks touch.
    touched: np.ndarray
    #: ``float64 [B, L, G]``: each GPU's grouped GEMM, seconds.
    expert: np.ndarray
    #: ``float64 [B, L]``: the all-to-all (dispatch and combine), seconds.
    a2a: np.ndarray
    #: ``float64 [B, L]``: the layer, seconds (the slowest GPU and the all-to-all, with the deployment's overlap).
    seconds: np.ndarray

    @property
    def active(self) -> np.ndarray:
        """``bool [B, L]``: the ``(batch, layer)`` with load."""
        return self.loads.sum(axis=2) > 0


def price_layers(plan: Placement, load: LoadMatrix, router: Router, deployment: Deployment,
                 rng: np.random.Generator, phase: str | None = None) -> LayerPrice:
    """Replay ``load`` through ``plan`` with ``router`` (drawing from ``rng``) and price every ``(batch, layer)``
    for ``deployment``, its all-to-all with ``phase``'s kernel (:meth:`moebalance.cost.Deployment.a2a_kernel`;
    module docstring)."""
    token_level = load.trace is not None
    r = replay_picks(plan, load, router, rng, with_touched=True, with_traffic=token_level,
                     bytes_per_copy=deployment.bytes_per_copy, kernel=deployment.a2a_kernel(phase), seconds_only=True)
    if r.touched is None:  # replay_picks gives them when asked
        raise RuntimeError("the replay gave no experts touched")
    seconds = r.traffic.a2a_seconds if r.traffic is not None else None
    if seconds is not None:
        a2a = seconds + np.where(r.loads.sum(axis=2) > 0, deployment.a2a_fixed_seconds(phase), 0.0)
    else:
        a2a = deployment.a2a_estimate(r.loads, plan.cluster, phase)
    expert = deployment.gemm_seconds(r.loads, r.touched)
    return LayerPrice(loads=r.loads, touched=np.asarray(r.touched, dtype=np.float64), expert=expert,
                      a2a=np.asarray(a2a, dtype=np.float64), seconds=deployment.layer_seconds(expert, a2a))
