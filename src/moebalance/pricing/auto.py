"""``--replicas-per-gpu auto --auto-by goodput``: CRAFT's replication factor chosen by modelled goodput.

CRAFT Step 2 chooses ``R`` from the balancedness curve alone (the knee of mean gain against ``log2 R``,
:func:`moebalance.algorithms.craft.auto_replicas_per_gpu`): it cannot see that replicas take KV cache. Here each
candidate ``R`` in ``0, 1, 2, 4, ..., L`` gets CRAFT's plan (one benefit table for all of them, Steps 3-5 per ``R``),
each plan is modelled on the planning batches (:func:`moebalance.pricing.goodput.price_plan`: its balance and traffic
against the KV cache its replicas leave), and the ``R`` with the best modelled goodput wins (ties to the smaller
``R``). The plan records ``auto_by``, the chosen ``R`` and the goodput of every candidate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.policies import make_plan
from moebalance.pricing.goodput import PlanPrice

__all__ = ["candidates", "craft_by_goodput"]


def candidates(num_layers: int) -> tuple[int, ...]:
    """``0, 1, 2, 4, ..., L``: placement only, then CRAFT's candidates (powers of two up to ``L``, then ``L``)."""
    powers = [1 << i for i in range(int(math.log2(max(num_layers, 1))) + 1)]
    return (0, *powers, *((num_layers,) if powers[-1] != num_layers else ()))


def craft_by_goodput(load: LoadMatrix, cluster: Cluster, cost: Callable[[Placement, LoadMatrix], PlanPrice], *,
                     dense_layers: Sequence[int] | None = None, **params: Any) -> Placement:
    """CRAFT's plan at the ``R`` whose plan has the best modelled goodput on ``load`` (module docstring);
    ``dense_layers`` as :func:`moebalance.policies.make_plan` takes them."""
    tried = []
    for R in candidates(load.num_layers):
        plan, _ = make_plan("craft", load, cluster, Budget(replicas_per_gpu=R), dense_layers=dense_layers, **params)
        tried.append((cost(plan, load).modelled_goodput, -R, plan))
    _, neg_r, plan = max(tried, key=lambda t: (t[0], t[1]))  # the best goodput; ties to the smaller R
    curve = {str(-r): round(g, 3) for g, r, _ in tried}
    out = plan.with_params({**plan.params, "replicas_per_gpu": "auto", "auto_by": "goodput",
                            "chosen_replicas_per_gpu": -neg_r, "goodput_by_replicas_per_gpu": curve})
    Budget(replicas_per_gpu="auto").check(out)  # the auto budget reads the chosen R from the params
    return out
