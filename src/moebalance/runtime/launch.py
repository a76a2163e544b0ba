"""Run a function on ``G`` local processes joined in a torch.distributed group (gloo on CPU by default), or join a
group that torchrun started.

For tests, benchmarks and quick checks on one machine, in the spirit of ``torch.multiprocessing.spawn``, but:

- processes start from a *forkserver* that has imported torch once, so a launch after the first does not pay
  a torch import per rank; where there is no forkserver, ``spawn`` is used;
- the group meets through a file store in a fresh temporary folder, so concurrent launches (pytest-xdist)
  never race for a TCP port;
- each rank's return value comes back to the caller (keep it picklable and small: numpy, not tensors);
- a rank that raises, or a launch that outlives ``timeout``, stops every process of the launch and raises
  :class:`RuntimeError` with the ranks' tracebacks, instead of hanging in a collective.

Beyond one machine, ranks are started by torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``): :func:`init_from_env` joins that group with ``init_method="env://"``,
NCCL where CUDA is available (each process on GPU ``LOCAL_RANK``), else gloo; nothing is spawned.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from moebalance.core.errors import InputError

__all__ = ["TORCHRUN_VARS", "init_from_env", "launch", "torchrun_env"]

#: The variables torchrun sets that ``init_method="env://"`` reads.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_PRELOAD = ["torch", "torch.distributed", "numpy", "moebalance.runtime"]


def _context() -> Any:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when this process first starts the server
        return ctx
    return mp.get_context("spawn")


def _entry(fn: Callable[..., Any], rank: int, world_size: int, store: str, backend: str, timeout: float,
           results: Any, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           timeout: float = 120.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each run in its own process of one group.

    ``fn`` must be importable by name (a module-level function). The group is the default process group.
    """
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be at least 1")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="moebalance-launch-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, backend, timeout, results, args),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(errors) < world_size:
                try:
                    rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    if time.monotonic() >= deadline:
                        errors.append(f"timed out after {timeout:.0f} s with ranks {sorted(out)} done")
                        break
                    continue
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
                    break
        finally:
            if errors:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
            for p in procs:
                p.join(timeout=10)
        if errors:
            raise RuntimeError("distributed launch failed: " + "\n".join(errors))
    return [out[r] for r in range(world_size)]


def torchrun_env() -> bool:
    """Whether this process was started by torchrun (or another ``env://`` launcher): all of
    :data:`TORCHRUN_VARS` are set."""
    return all(os.environ.get(v) for v in TORCHRUN_VARS)


def init_from_env(backend: str | None = None, timeout: float = 1800.0) -> tuple[int, int, Any]:
    """Join the process group of a torchrun launch: ``(rank, world_size, device)``; a no-op join if this
    process is already in a group.

    ``backend``: ``nccl`` where CUDA is available, else ``gloo``, unless given. Under NCCL the process works on
    ``cuda:LOCAL_RANK`` (set as the current device), else on the CPU.
    """
    import torch
    import torch.distributed as dist

    if not torchrun_env():
        missing = [v for v in TORCHRUN_VARS if not os.environ.get(v)]
        raise InputError(f"no torchrun environment: {', '.join(missing)} not set; start the ranks with torchrun "
                         "(or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or run on local processes")
    if backend is None:
        backend = str(dist.get_backend()) if dist.is_initialized() else \
            ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if "nccl" in backend:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size(), device
