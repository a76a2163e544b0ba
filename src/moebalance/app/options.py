"""Command-line options shared by the command modules: ``--set``-style items and routers with their options."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from moebalance.core.errors import InputError
from moebalance.routing import ROUTERS, Router, get_router

__all__ = ["add_router", "parse_set", "router", "routers"]


def parse_set(items: Sequence[str] | None, flag: str = "--set") -> dict[str, Any]:
    """``key=value`` items as a dict; values parse as JSON where they can (``eps=0.02`` -> 0.02), else strings."""
    params: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"{flag} {item!r} must look like key=value")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def routers(args: argparse.Namespace) -> list[Router]:
    """The routers of ``--router NAME[,NAME...]`` with ``--router-set key=value`` applied to each that has the option."""
    names = [n.strip() for n in args.router.split(",") if n.strip()]
    if not names:
        raise InputError("--router is empty; give a name like uniform or rebalance")
    chosen = [get_router(n) for n in names]
    params = parse_set(args.router_set, "--router-set")
    for key in params:
        if not any(key in r.params for r in chosen):
            takers = sorted(f"{n} ({', '.join(r.params)})" for n, r in ROUTERS.items() if r.params)
            raise InputError(f"--router-set {key}: no router given ({', '.join(names)}) has option {key!r}; routers "
                             f"with options: {'; '.join(takers)}")
    return [r.with_params(**{k: v for k, v in params.items() if k in r.params}) for r in chosen]


def router(args: argparse.Namespace) -> Router:
    """The one router of a command that scores with one (``evaluate``, ``run``)."""
    given = routers(args)
    if len(given) > 1:
        raise InputError(f"--router {args.router!r} names {len(given)} routers; this command takes one "
                         "(compare takes several)")
    return given[0]


def add_router(p: argparse.ArgumentParser, *, several: bool = False, default: str = "uniform") -> None:
    """``--router`` (one name, or several comma-separated with ``several``) and ``--router-set``."""
    what = "comma-separated routers, one row each per policy" if several else "router"
    p.add_argument("--router", default=default, metavar="NAME" + ("[,NAME...]" if several else ""),
                   help=f"{what}: {', '.join(sorted(ROUTERS))} (default {default})")
    p.add_argument("--router-set", action="append", metavar="KEY=VALUE",
                   help="router option, e.g. eps=0.02 for rebalance (repeatable)")
