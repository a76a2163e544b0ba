"""The engines moebalance serves, each declared by its own module (:class:`moebalance.engines.base.Engine`): the
commands loop over :data:`ENGINES` instead of naming engines one by one.

Detection of a load asks the engines in :data:`DETECTION` order, the first that claims the path reading it:
TensorRT-LLM's statistics folder has ``meta_info.json``; vLLM's routed experts are ``.json`` responses (a folder of
them without ``.pt`` dumps); SGLang's dumps are ``.pt`` files, a folder of them, or their ``.json``.
"""

from __future__ import annotations

from moebalance.core.errors import InputError
from moebalance.cost.deployment import Deployment
from moebalance.cost.hardware import VENDORS
from moebalance.engines import sglang, trtllm, vllm
from moebalance.engines.base import Engine

__all__ = ["DETECTION", "ENGINES", "get_engine", "refusal"]

#: Every engine by its name (``--engine``, ``export --to``, an engine load's ``--format``), in the order listed.
ENGINES: dict[str, Engine] = {e.name: e for e in (vllm.ENGINE, sglang.ENGINE, trtllm.ENGINE)}
#: The order in which engines are asked whether a load is theirs.
DETECTION: tuple[Engine, ...] = (trtllm.ENGINE, vllm.ENGINE, sglang.ENGINE)


def get_engine(name: str) -> Engine:
    """The engine named ``name``; an unknown name is one line listing the engines."""
    try:
        return ENGINES[name]
    except KeyError:
        raise InputError(f"engine {name!r} is unknown; choose one of: {', '.join(ENGINES)}") from None


def refusal(name: str, d: Deployment) -> str | None:
    """Why engine ``name`` cannot serve the priced deployment ``d``, in one line naming the fix, or ``None``: a GPU
    of a vendor it does not run on (naming the engines that do), else what the engine itself refuses
    (:attr:`~moebalance.engines.base.Engine.refuses`)."""
    engine, gpu = get_engine(name), d.gpu
    if gpu.vendor not in engine.rule.vendors:
        runs = [e.name for e in ENGINES.values() if gpu.vendor in e.rule.vendors]
        return (f"{name} runs on {' and '.join(VENDORS[v] for v in engine.rule.vendors)} GPUs only, not on --gpu "
                f"{gpu.name} ({VENDORS[gpu.vendor]} {gpu.display_name}); give --engine {'|'.join(runs)}")
    return engine.refuses(d)
