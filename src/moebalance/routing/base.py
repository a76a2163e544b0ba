"""The router interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moebalance.core.errors import InputError

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["Router", "check_routes"]


@dataclass(frozen=True, slots=True)
class Router:
    """A named replica-selection rule, usable on counts and on tokens."""

    name: str
    #: ``(plan, counts [B, L, E], rng) -> float64 [B, L, G]`` tokens served per GPU.
    split_counts: Callable[[Placement, np.ndarray, np.random.Generator], np.ndarray]
    #: ``(plan, trace, rng) -> int64 [T, L, K]`` the GPU serving each token's each pick.
    assign_tokens: Callable[[Placement, RoutingTrace, np.random.Generator], np.ndarray]
    #: One line for help texts.
    summary: str = ""


def check_routes(dest_TK: np.ndarray, ids_TK: np.ndarray, copies_EG: np.ndarray, router: str) -> None:
    """Refuse a router's answer unless every pick goes to a GPU ``0..G-1`` that holds a copy of its expert.

    ``dest_TK`` is what router ``router`` returned for the picks ``ids_TK`` of a one-layer plan whose
    ``copies_EG [E, G]`` counts each expert's copies per GPU. Every rank checks the same data, so all ranks
    refuse together and none is left waiting in a collective.
    """
    dest = np.asarray(dest_TK)
    G = copies_EG.shape[1]
    if dest.shape != ids_TK.shape:
        raise InputError(f"router {router!r} returned GPUs of shape {dest.shape} for picks of shape {ids_TK.shape}; "
                         f"it must return one GPU per pick")
    if not np.issubdtype(dest.dtype, np.integer):
        raise InputError(f"router {router!r} returned GPUs of dtype {dest.dtype}; it must return integer GPU ids")
    outside = (dest < 0) | (dest >= G)
    if outside.any():
        t, k = (int(i) for i in np.argwhere(outside)[0])
        raise InputError(f"router {router!r} sent pick {k} of token {t} to GPU {int(dest[t, k])}; "
                         f"valid GPUs are 0..{G - 1}")
    no_copy = copies_EG[ids_TK, dest] == 0
    if no_copy.any():
        t, k = (int(i) for i in np.argwhere(no_copy)[0])
        e, g = int(ids_TK[t, k]), int(dest[t, k])
        hosts = np.flatnonzero(copies_EG[e]).tolist()
        raise InputError(f"router {router!r} sent pick {k} of token {t} (expert {e}) to GPU {g}, which holds no "
                         f"copy of it; expert {e} is on GPUs {hosts}")
