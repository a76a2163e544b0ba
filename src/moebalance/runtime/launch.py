"""Run a function on ``G`` local processes joined in a torch.distributed group (gloo on CPU by default), or join a
group that torchrun started.

For tests, benchmarks and quick checks on one machine, in the spirit of ``torch.multiprocessing.spawn``, but:

- processes start from a *forkserver* that has imported torch once, so a launch after the first does not pay
  a torch import per rank; where there is no forkserver, ``spawn`` is used;
- the group meets through a file store in a fresh temporary folder, so concurrent launches (pytest-xdist)
  never race for a TCP port;
- each rank's return value comes back to the caller (keep it picklable and small: numpy, not tensors);
- a rank that raises, a rank whose process dies (killed by a signal, crashed), or a launch that outlives
  ``timeout`` stops every process of the launch and raises in the caller, instead of hanging in a collective:
  a :class:`~moebalance.core.errors.MoebalanceError` as the same class with its one line; a dead process as
  a :class:`~moebalance.runtime.errors.GroupError` naming its rank and signal; anything else as a
  :class:`RuntimeError` with the ranks' tracebacks.

Beyond one machine, ranks are started by torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``): :func:`init_from_env` joins that group, NCCL where CUDA is available
(each process on GPU ``LOCAL_RANK``), else gloo; nothing is spawned. Every wait there is bounded
(:mod:`moebalance.runtime.group`: ``MOEBALANCE_DIST_TIMEOUT`` seconds, default 60): :func:`agreed_inputs`
makes the ranks agree on their own checks before joining, so one rank's bad input is every rank's one-line
error, and :func:`guarded` names a rank that left during a collective. :func:`free_port` names a port for a
one-machine torchrun environment (tests, benchmarks).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from moebalance.core.errors import InputError, MoebalanceError
from moebalance.runtime.errors import GroupError, error_code, one_line, raise_coded
from moebalance.runtime.group import TIMEOUT_ENV, Membership, dist_timeout, failure_reason, is_comm_failure

__all__ = ["TORCHRUN_VARS", "agreed_inputs", "free_port", "guarded", "init_from_env", "launch", "membership",
           "torchrun_env", "torchrun_world"]

#: The variables torchrun sets that ``init_method="env://"`` reads.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_PRELOAD = ["torch", "torch.distributed", "numpy", "moebalance.runtime"]
#: Seconds the caller waits, after a rank reported a failed collective, for the process that caused it to show.
_GRACE = 5.0


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
    except BaseException as exc:
        code = error_code(exc) if isinstance(exc, MoebalanceError) else 0
        results.put((rank, False, (code, one_line(exc), is_comm_failure(exc), traceback.format_exc())))


def _death(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return f"rank {rank} left the group: its process {how} before returning"


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           timeout: float = 120.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each run in its own process of one group.

    ``fn`` must be importable by name (a module-level function). The group is the default process group, its
    collectives bounded by ``timeout`` seconds, as is the whole launch. Failures: module doc.
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
        failure: tuple[int, Any] | None = None  # (rank, what _entry reported)
        died: str | None = None
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size and failure is None and died is None:
                try:
                    rank, ok, value = results.get(timeout=0.2)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                    if dead:
                        died = _death(dead[0], int(procs[dead[0]].exitcode or 0))
                    elif time.monotonic() >= deadline:
                        break
                    continue
                if ok:
                    out[rank] = value
                else:
                    failure = (rank, value)
            if failure is not None and failure[1][2]:  # a failed collective: did a process die under it?
                end = time.monotonic() + _GRACE
                while died is None and time.monotonic() < end:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        died = _death(dead[0], int(procs[dead[0]].exitcode or 0))
                    time.sleep(0.05)
        finally:
            if len(out) < world_size:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
            for p in procs:
                p.join(timeout=10)
    if died is not None:
        raise GroupError(died)
    if failure is not None:
        rank, (code, line, _comm, text) = failure
        if code:
            raise_coded(code, line if line.startswith("rank ") else f"rank {rank}: {line}")
        raise RuntimeError(f"distributed launch failed: rank {rank} failed:\n{text}")
    if len(out) < world_size:
        raise RuntimeError(f"distributed launch failed: timed out after {timeout:.0f} s with ranks {sorted(out)} done")
    return [out[r] for r in range(world_size)]


def torchrun_env() -> bool:
    """Whether this process was started by torchrun (or another ``env://`` launcher): all of
    :data:`TORCHRUN_VARS` are set."""
    return all(os.environ.get(v) for v in TORCHRUN_VARS)


def free_port() -> int:
    """A TCP port of ``127.0.0.1`` that was free a moment ago: binds port 0 and returns the port the OS chose, for a
    ``MASTER_PORT`` (or a server's port) on one machine in tests and benchmarks.

    Racy by nature: the socket is closed before the port is returned, so another process may take the port before
    the caller binds it. :func:`launch` meets through a file store instead, so that concurrent launches never race
    for a port; use this only where a port must be named (a torchrun environment, a local HTTP server).
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_MEMBERSHIP: Membership | None = None


def membership() -> Membership | None:
    """This process's :class:`~moebalance.runtime.group.Membership` of the torchrun launch, once it has
    connected (:func:`agreed_inputs`, :func:`init_from_env`); else ``None``."""
    return _MEMBERSHIP


def torchrun_world() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` of this process's torchrun launch; a one-line error outside one."""
    if not torchrun_env():
        missing = [v for v in TORCHRUN_VARS if not os.environ.get(v)]
        raise InputError(f"no torchrun environment: {', '.join(missing)} not set; start the ranks with torchrun "
                         "(or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or run on local processes")
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        rank = world_size = -1
    if not 0 <= rank < world_size:
        raise InputError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} must be integers "
                         "with 0 <= RANK < WORLD_SIZE; start the ranks with torchrun")
    return rank, world_size


def _connect(timeout: float | None) -> Membership:
    """Connect (once per process) to the store of the torchrun launch: bounded by the timeout."""
    global _MEMBERSHIP
    rank, world_size = torchrun_world()
    if _MEMBERSHIP is None:
        import torch.distributed as dist

        seconds = dist_timeout(timeout)
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        if not port.isdigit() or not 0 < int(port) < 2**16:
            raise InputError(f"MASTER_PORT={port!r} must be a TCP port (1 to 65535); start the ranks with torchrun")
        try:  # as env:// does, but rank 0 does not wait here for the others: the agreement names who is missing
            store = dist.TCPStore(addr, int(port), world_size, is_master=rank == 0 and not agent,
                                  timeout=timedelta(seconds=seconds), wait_for_workers=False, multi_tenant=True)
        except Exception as exc:
            where = ("could not serve the group's store" if rank == 0 and not agent
                     else "could not reach the group's store")
            raise GroupError(f"rank {rank} {where} at {addr}:{port} within {seconds:g} s ({failure_reason(exc)}): "
                             f"is {'the port free' if rank == 0 and not agent else 'its host running there'}? "
                             f"({TIMEOUT_ENV} sets the wait in seconds)") from exc
        prefix = f"moebalance/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        owner = "the torchrun agent of the first node" if agent else "rank 0"
        _MEMBERSHIP = Membership(store, rank, world_size, seconds, hosts_store=rank == 0 and not agent,
                                 store_owner=owner, prefix=prefix)
    return _MEMBERSHIP


@contextmanager
def agreed_inputs(timeout: float | None = None, what: str = "check their inputs") -> Iterator[None]:
    """Under torchrun, every rank's checks in the ``with`` body are agreed on before any rank goes on: a rank
    whose body raised makes every rank raise the same one-line error (that of the lowest failing rank, as
    ``rank r: ...``), and a rank that does not arrive within the timeout is named
    (:meth:`~moebalance.runtime.group.Membership.agree`). Outside torchrun the body runs as it is.

    Checks needing no other rank (files, shapes, options) belong in the body, before the group is joined.
    ``timeout``: seconds; default ``$MOEBALANCE_DIST_TIMEOUT``, else 60 (the first connection of the process
    to the store sets it for the rest of the launch).
    """
    if not torchrun_env():
        yield
        return
    error: Exception | None = None
    try:
        yield
    except Exception as exc:  # agreed on with the other ranks before anyone raises
        error = exc
    _connect(timeout).agree(error, what)  # raises the agreed error if any rank failed, this one included


def init_from_env(backend: str | None = None, timeout: float | None = None) -> tuple[int, int, Any]:
    """Join the process group of a torchrun launch: ``(rank, world_size, device)``; a no-op join if this
    process is already in a group.

    ``backend``: ``nccl`` where CUDA is available, else ``gloo``, unless given. Under NCCL the process works on
    ``cuda:LOCAL_RANK`` (set as the current device), else on the CPU.

    When it joins, every wait is bounded by ``timeout`` seconds (default ``$MOEBALANCE_DIST_TIMEOUT``, else 60):
    reaching the store, the other ranks' arrival (a rank that does not come is named in a
    :class:`~moebalance.runtime.errors.GroupError`, before anyone waits in ``init_process_group``), and every
    collective of the group. Wrap the work in :func:`guarded` to turn a failed collective into one line naming
    the rank that left. A group this process joined otherwise keeps its own timeout.
    """
    import torch
    import torch.distributed as dist

    torchrun_world()  # a one-line error outside torchrun
    if backend is None:
        backend = str(dist.get_backend()) if dist.is_initialized() else \
            ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if "nccl" in backend:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        member = _connect(timeout)
        member.agree(None, "join the process group")
        dist.init_process_group(backend, store=member.next_join(), rank=member.rank, world_size=member.world_size,
                                timeout=timedelta(seconds=member.timeout))
        member.start_heartbeat()
    return dist.get_rank(), dist.get_world_size(), device


@contextmanager
def guarded() -> Iterator[None]:
    """Turn a failed collective in the ``with`` body into a one-line
    :class:`~moebalance.runtime.errors.GroupError` naming the rank that left the group (killed, crashed) or that
    stopped on an error, the same on every surviving rank; any other error is posted for the others to name,
    then raised as it is. Unless this process joined the group by :func:`init_from_env` (so that every rank's
    heartbeat runs), the body runs as it is."""
    member = membership()
    if member is None or not member.beating:
        yield
        return
    try:
        yield
    except Exception as exc:
        if is_comm_failure(exc):
            raise member.explain(exc) from exc
        member.leave(f"error:{one_line(exc)}")
        raise
    except BaseException:  # interrupted: the others should not blame a crash
        member.leave("error:interrupted")
        raise
