"""Routers: the run-time rule that picks which replica serves each (token, chosen expert).

A router works at two granularities with the same rule (docs/design.md, "Routers"):

- ``split_counts(plan, counts_BLE, rng) -> gpu_load_BLG``: expected or sampled tokens per GPU, for replaying
  load matrices in the simulator;
- ``assign_tokens(plan, trace, rng) -> dest_gpu_TLK``: the GPU serving each token's each pick, for
  token-level traces (traffic accounting) and for the runtime.

Routers are looked up by name in :data:`ROUTERS`; callers may also pass a :class:`Router` directly. Options
(``rebalance``'s ``eps``, ``metro``'s ``gpu`` and ``model``) come as ``get_router(name, params)`` or
``Router.with_params``. A router that knows which experts each GPU's picks touch on counts (``metro``) is a
:class:`~moebalance.routing.touched.TouchingRouter` (:mod:`moebalance.routing.touched`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moebalance.core.errors import InputError
from moebalance.routing.base import Router, RouterConfig
from moebalance.routing.basic import RANDOM, UNIFORM
from moebalance.routing.grace import LOCALITY, WRR
from moebalance.routing.metro import METRO
from moebalance.routing.minmax import MINMAX
from moebalance.routing.rebalance import REBALANCE

__all__ = ["ROUTERS", "Router", "RouterConfig", "get_router"]


ROUTERS: dict[str, Router] = {r.name: r for r in (UNIFORM, RANDOM, WRR, LOCALITY, REBALANCE, MINMAX, METRO)}


def get_router(router: str | Router, params: Mapping[str, Any] | None = None) -> Router:
    """The router called ``router`` (or ``router`` itself if it is a :class:`Router`), with options ``params``."""
    if not isinstance(router, Router):
        try:
            router = ROUTERS[router]
        except KeyError:
            raise InputError(f"unknown router {router!r}; choose one of: {', '.join(sorted(ROUTERS))}") from None
    return router.with_params(**dict(params or {}))
