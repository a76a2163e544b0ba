"""The cost model as the commands use it: ``--gpu`` (with ``--model`` or the load's own) turned into a function that
models a plan on a held-out load (``compare``, ``sweep``), or that ``--auto-by goodput`` picks CRAFT's ``R`` with
(``plan``, ``compare``); and the checks that refuse cost flags where no cost model runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from moebalance.app import options
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.cost.goodput import PlanCost, plan_cost
from moebalance.cost.hardware import get_gpu
from moebalance.models import get_model
from moebalance.routing import Router

__all__ = ["CostFn", "auto_by_goodput", "bytes_per_copy", "cost_fn", "refuse_cost_options"]

#: ``(plan, held-out load, router) -> PlanCost``.
CostFn = Callable[[Placement, LoadMatrix, "str | Router"], PlanCost]


def bytes_per_copy(load: LoadMatrix, hidden_size: int | None, dtype_bytes: int) -> int | None:
    """Bytes one dispatched copy carries: ``hidden_size`` (default: the load's model's) x ``dtype_bytes``."""
    if hidden_size is None and load.model is not None:
        hidden_size = load.model.hidden_size
    return None if hidden_size is None else hidden_size * dtype_bytes


def refuse_cost_options(args: argparse.Namespace, why: str) -> None:
    """Refuse the cost flags given where no cost model runs; ``why`` says what they need."""
    given = options.given_cost_options(args)
    if given:
        raise InputError(f"{given[0]} is used {why}; drop it")


def cost_fn(args: argparse.Namespace, load: LoadMatrix) -> CostFn | None:
    """The cost model of ``--gpu`` (with ``--model`` or the load's own), else None (checked against the load)."""
    if getattr(args, "gpu", None) is None:
        refuse_cost_options(args, "with --gpu (the cost model)")
        return None
    name = args.model or load.preset
    if name is None:
        raise InputError("the load names no model; give --model with --gpu (e.g. --model deepseek-v3)")
    spec, gpu = get_model(name), get_gpu(args.gpu)
    if spec.num_experts != load.num_experts or load.num_layers not in (spec.num_layers,
                                                                        spec.num_layers + spec.num_dense_layers):
        raise InputError(f"{spec.display_name} has {spec.num_layers} MoE layers ({spec.num_layers + spec.num_dense_layers}"
                         f" with its dense ones) x {spec.num_experts} experts but the load {load.num_layers} x "
                         f"{load.num_experts}; give the load's --model")
    engine, workload = options.engine_from(args), options.workload_from(args)
    calibration = options.calibration_from(args)
    forwarding = args.dispatch == "node"
    seed = args.seed

    def costing(plan: Placement, test: LoadMatrix, router: str | Router) -> PlanCost:
        return plan_cost(plan, test, spec, gpu, router=router, engine=engine, calibration=calibration,
                         workload=workload, seed=seed, node_forwarding=forwarding)

    return costing


def auto_by_goodput(args: argparse.Namespace, load: LoadMatrix,
                    policies: Sequence[str]) -> Callable[[Placement, LoadMatrix], PlanCost] | None:
    """``(plan, load) -> PlanCost`` when ``--auto-by goodput`` asks for it (checked), else None."""
    if args.auto_by != "goodput":
        return None
    if args.replicas_per_gpu != "auto" or "craft" not in policies:
        raise InputError("--auto-by goodput chooses craft's R: give --policy craft (or craft in --policies) with "
                         "--replicas-per-gpu auto")
    if args.gpu is None:
        raise InputError("--auto-by goodput needs --gpu (and --model when the load names none): the cost model")
    costing = cost_fn(args, load)
    if costing is None:  # unreachable: --gpu is given
        raise InputError("--auto-by goodput needs --gpu")
    return lambda plan, part: costing(plan, part, "uniform")
