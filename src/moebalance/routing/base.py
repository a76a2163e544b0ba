"""The router interface, and router options.

A router may take options (Libra's tolerance, for one): a frozen :class:`RouterConfig` subclass, given on the
command line as ``--router-set key=value`` and in Python as ``get_router("rebalance", {"eps": 0.02})`` or
``router.with_params(eps=0.02)``. A configured router is a new :class:`Router` with the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.options import Options

if TYPE_CHECKING:
    from moebalance.core.plan import Placement
    from moebalance.core.trace import RoutingTrace

__all__ = ["Router", "RouterConfig", "check_routes"]


@dataclass(kw_only=True, frozen=True, slots=True)
class RouterConfig(Options):
    """Base of a router's options (``--router-set``): frozen, keyword-only, validated in ``__post_init__``."""

    owner_kind: ClassVar[str] = "router"
    option_word: ClassVar[str] = "option"


@dataclass(frozen=True, slots=True)
class Router:
    """A named replica-selection rule, usable on counts and on tokens.

    Routers whose choice depends on the load (``minmax``, ``rebalance``) also give ``assign_kept``, so that
    picks a capacity dropped do not count; ``config`` and ``configure`` carry a router's options.
    """

    name: str
    #: ``(plan, counts [B, L, E], rng) -> float64 [B, L, G]`` tokens served per GPU.
    split_counts: Callable[[Placement, np.ndarray, np.random.Generator], np.ndarray]
    #: ``(plan, trace, rng) -> int64 [T, L, K]`` the GPU serving each token's each pick.
    assign_tokens: Callable[[Placement, RoutingTrace, np.random.Generator], np.ndarray]
    #: One line for help texts.
    summary: str = ""
    #: ``(plan, trace, kept bool [T, L, K], rng) -> int64 [T, L, K]``: ``assign_tokens`` when only the kept
    #: picks are served; a dropped pick's GPU is ``-1``. ``None``: the router ignores loads, so the runtime
    #: routes every pick with ``assign_tokens`` and discards the dropped ones.
    assign_kept: Callable[[Placement, RoutingTrace, np.ndarray, np.random.Generator], np.ndarray] | None = None
    #: The options this router runs with; ``None`` for a router without options.
    config: RouterConfig | None = None
    #: ``(config) -> Router``: the same router with other options (module-level, so routers pickle).
    configure: Callable[[Any], Router] | None = field(default=None, repr=False)
    #: The options the label shows where they differ from the defaults (``None``: all): those a user gave, not those a
    #: command's deployment filled in (``metro``'s GPU, model and calibration, which the command's title states).
    label_keys: tuple[str, ...] | None = field(default=None, repr=False)

    def with_params(self, **params: Any) -> Router:
        """This router with ``params`` changed (an unknown option or a router without options: InputError)."""
        if not params:
            return self
        if self.config is None or self.configure is None:
            raise InputError(f"router {self.name!r} takes no options; {', '.join(sorted(params))} given")
        config = type(self.config).from_params(self.name, {**self.config.as_params(), **params})
        return self.configure(config)

    @property
    def params(self) -> dict[str, Any]:
        """The options as JSON values (empty without options)."""
        return {} if self.config is None else self.config.as_params()

    @property
    def label(self) -> str:
        """``name``, with the options that differ from the defaults (reals to 4 significant digits):
        ``rebalance(eps=0.02)``."""
        if self.config is None:
            return self.name
        default = type(self.config)().as_params()
        changed = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in self.config.as_params().items()
                   if default.get(k) != v and (self.label_keys is None or k in self.label_keys)]
        return f"{self.name}({', '.join(changed)})" if changed else self.name


def check_routes(dest_TK: np.ndarray, ids_TK: np.ndarray, copies_EG: np.ndarray, router: str,
                 kept_TK: np.ndarray | None = None) -> None:
    """Refuse a router's answer unless every pick goes to a GPU ``0..G-1`` that holds a copy of its expert.

    ``dest_TK`` is what router ``router`` returned for the picks ``ids_TK`` of a one-layer plan whose
    ``copies_EG [E, G]`` counts each expert's copies per GPU; with ``kept_TK`` only the kept picks are
    checked (the others must be -1). Every rank checks the same data, so all ranks refuse together and none
    is left waiting in a collective.
    """
    dest = np.asarray(dest_TK)
    G = copies_EG.shape[1]
    if dest.shape != ids_TK.shape:
        raise InputError(f"router {router!r} returned GPUs of shape {dest.shape} for picks of shape {ids_TK.shape}; "
                         f"it must return one GPU per pick")
    if not np.issubdtype(dest.dtype, np.integer):
        raise InputError(f"router {router!r} returned GPUs of dtype {dest.dtype}; it must return integer GPU ids")
    if kept_TK is not None:
        if np.any(dest[~kept_TK] != -1):
            t, k = (int(i) for i in np.argwhere(~kept_TK & (dest != -1))[0])
            raise InputError(f"router {router!r} sent dropped pick {k} of token {t} to GPU {int(dest[t, k])}; a "
                             f"dropped pick's GPU must be -1")
        dest = np.where(kept_TK, dest, np.argmax(copies_EG[ids_TK] > 0, axis=-1))  # checked picks only
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
