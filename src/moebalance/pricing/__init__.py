"""Plans priced in time (docs/design.md, "Cost model"): the floor above ``routing`` and ``policies`` that replays a
load through a plan and a router and prices what it serves, with the cost model of :mod:`moebalance.cost` for one
:class:`~moebalance.cost.Deployment`.

- :mod:`~moebalance.pricing.layer`: every ``(batch, layer)`` priced -- each GPU's grouped GEMM, the all-to-all;
- :mod:`~moebalance.pricing.step`: a served batch as a forward step, with what a router and a prefetch expose;
- :mod:`~moebalance.pricing.phase`: a load's batches drawn again as a phase's decode or prefill steps, and a
  router's layer time on them;
- :mod:`~moebalance.pricing.goodput`: a plan's modelled layer time and goodput on a held-out load;
- :mod:`~moebalance.pricing.auto`: CRAFT's replication factor chosen by modelled goodput.
"""

from moebalance.pricing.goodput import PlanPrice, price_plan
from moebalance.pricing.layer import LayerPrice, price_layers
from moebalance.pricing.phase import PhaseModel, PhaseTime, phase_steps, phase_time
from moebalance.pricing.step import StepPricing, StepTime, step_time

__all__ = ["LayerPrice", "PhaseModel", "PhaseTime", "PlanPrice", "StepPricing", "StepTime", "phase_steps", "phase_time",
           "price_layers", "price_plan", "step_time"]
