"""Collectives for the expert-parallel layer: variable-size all-to-all and all-gather, and point-to-point batches.

Legend: ``G`` ranks of the group (rank ``g`` is GPU ``g`` of the plan), ``N`` rows sent, ``M`` rows received,
``H`` hidden size.

``all_to_all_v`` has two implementations, chosen by ``impl``:

- ``native``: ``torch.distributed.all_to_all_single`` with split sizes. NCCL has it; gloo has it for CPU
  tensors in the torch versions we support (checked on 2.13), but not for CUDA tensors.
- ``p2p``: the same exchange from ``isend``/``irecv`` pairs issued in one ``batch_isend_irecv``: in step
  ``i = 1 .. G-1`` rank ``r`` sends to ``r + i`` and receives from ``r - i`` (mod ``G``); its own chunk is a
  local copy. Used where a backend lacks the collective.
- ``auto`` (default): ``native``, except ``p2p`` on a backend other than NCCL for a device other than CPU.

Gloo cannot move CUDA tensors at all, so on gloo every collective here stages non-CPU tensors through host
memory and copies the result back; NCCL works on the tensors' device. Receive sizes are exchanged first
(:func:`exchange_counts`: a ``[G]`` all-to-all of counts, or an all-gather of every rank's counts under
``p2p``), because split sizes must be known on the host: one small device-to-host copy per exchange, as
in torchtitan's and Megatron's all-to-all dispatchers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from moebalance.core.errors import InputError

__all__ = ["A2AImpl", "Pending", "all_gather_v", "all_to_all_v", "exchange_counts", "global_rank", "over_budget",
           "p2p_exchange", "resolve_impl", "staged_through_host"]

A2AImpl = Literal["auto", "native", "p2p"]
_IMPLS = ("auto", "native", "p2p")


def _backend(group: Any, device: torch.device) -> str:
    """The backend serving ``device`` in ``group`` ("gloo", "nccl", ...), also for mixed ``cpu:gloo,cuda:nccl``."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    table = dict(part.split(":", 1) for part in name.split(","))
    return table.get(device.type, next(iter(table.values())))


def resolve_impl(impl: A2AImpl, group: Any, device: torch.device) -> Literal["native", "p2p"]:
    """The all-to-all implementation ``impl`` stands for on ``device`` in ``group``."""
    if impl not in _IMPLS:
        raise InputError(f"unknown all-to-all implementation {impl!r}; choose one of: {', '.join(_IMPLS)}")
    if impl != "auto":
        return impl
    return "native" if _backend(group, device) == "nccl" or device.type == "cpu" else "p2p"


def staged_through_host(group: Any, device: torch.device) -> bool:
    """True where tensors on ``device`` must go through host memory (gloo with CUDA tensors)."""
    return device.type != "cpu" and _backend(group, device) != "nccl"


def global_rank(group: Any, rank: int) -> int:
    """The default group's rank of ``rank`` of ``group`` (``None``: the default group itself)."""
    return rank if group is None else dist.get_global_rank(group, rank)


@dataclass(slots=True)
class Pending:
    """A result still in flight: ``wait()`` returns it once every underlying request has completed."""

    result: torch.Tensor
    works: list[Any] = field(default_factory=list)
    #: Where to copy a host-staged result back to, if anywhere.
    device: torch.device | None = None

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        if self.device is not None:
            self.result, self.device = self.result.to(self.device), None
        return self.result


def exchange_counts(send_counts_G: torch.Tensor, group: Any = None, impl: A2AImpl = "auto") -> torch.Tensor:
    """``int64 [G]``: rows each rank will send here, from the rows this rank sends to each (``[G]``)."""
    device = send_counts_G.device
    counts = send_counts_G.to(torch.int64).cpu() if staged_through_host(group, device) else send_counts_G.to(torch.int64)
    G = dist.get_world_size(group)
    if resolve_impl(impl, group, device) == "native":
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=group)
    else:
        rows = [torch.empty_like(counts) for _ in range(G)]
        dist.all_gather(rows, counts.contiguous(), group=group)
        recv = torch.stack(rows)[:, dist.get_rank(group)].contiguous()
    return recv.to(device)


def all_to_all_v(x_N: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Any = None,
                 impl: A2AImpl = "auto", *, async_op: bool = False) -> Pending:
    """Send rows ``x[sum(send_counts[:g]) : ...]`` to rank ``g``; the result stacks the rows received, by rank.

    ``x`` is ``[N, ...]`` with ``N = sum(send_counts)``; the result is ``[M, ...]`` with ``M = sum(recv_counts)``.
    With ``async_op`` the exchange runs in the background until ``wait()``.
    """
    G, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(send_counts) != G or len(recv_counts) != G or sum(send_counts) != x_N.shape[0]:
        raise InputError(f"all_to_all_v: {len(send_counts)} send and {len(recv_counts)} receive counts for {G} "
                         f"ranks, {sum(send_counts)} rows to send but x has {x_N.shape[0]}")
    device = x_N.device
    staged = staged_through_host(group, device)
    src = x_N.cpu() if staged else x_N
    src = src.contiguous()
    out = torch.empty((int(sum(recv_counts)), *src.shape[1:]), dtype=src.dtype, device=src.device)
    back = device if staged else None
    if resolve_impl(impl, group, device) == "native":
        work = dist.all_to_all_single(out, src, output_split_sizes=list(map(int, recv_counts)),
                                      input_split_sizes=list(map(int, send_counts)), group=group,
                                      async_op=async_op)
        pending = Pending(out, [work] if async_op else [], back)
        return pending if async_op else Pending(pending.wait())
    send_off = [0]
    recv_off = [0]
    for g in range(G):
        send_off.append(send_off[-1] + int(send_counts[g]))
        recv_off.append(recv_off[-1] + int(recv_counts[g]))
    out[recv_off[rank]:recv_off[rank + 1]] = src[send_off[rank]:send_off[rank + 1]]
    ops = []
    for i in range(1, G):
        to, frm = (rank + i) % G, (rank - i) % G
        if send_counts[to]:
            ops.append(dist.P2POp(dist.isend, src[send_off[to]:send_off[to + 1]], global_rank(group, to), group))
        if recv_counts[frm]:
            ops.append(dist.P2POp(dist.irecv, out[recv_off[frm]:recv_off[frm + 1]], global_rank(group, frm), group))
    pending = Pending(out, list(dist.batch_isend_irecv(ops)) if ops else [], back)
    if not async_op:
        pending.wait()
    return pending


def over_budget(rank: int, rows: int, max_rows: int) -> InputError:
    """The error for a rank with more rows than a fixed-size gather's ``max_rows``."""
    return InputError(f"rank {rank} has {rows} tokens but max_tokens_per_rank is {max_rows}; "
                      "raise it or send fewer tokens per forward")


def all_gather_v(x_N: torch.Tensor, group: Any = None, max_rows: int | None = None) -> list[torch.Tensor]:
    """Every rank's ``x [N_r, ...]`` (row counts may differ), as a list indexed by rank.

    Without ``max_rows`` it takes two collectives: the row counts, then the rows padded to the largest.
    With ``max_rows`` (every rank must pass the same; ``N_r <= max_rows``) it takes one: a fixed
    ``[max_rows + 1, ...]`` buffer whose first entry carries the row count, as engines with a fixed
    per-rank token budget do (e.g. CUDA graphs, DeepEP's low-latency mode). Counts ride in ``x``'s dtype, so
    an integer or float64 ``x`` carries any count; float32 exactly up to 2**24 rows.
    """
    device = x_N.device
    staged = staged_through_host(group, device)
    src = (x_N.cpu() if staged else x_N).contiguous()
    G = dist.get_world_size(group)
    if max_rows is not None:
        # every rank checks the same (dtype, max_rows), so all raise together: none is left in a collective
        exact = (2 / torch.finfo(src.dtype).eps if src.dtype.is_floating_point
                 else 1 if src.dtype == torch.bool else torch.iinfo(src.dtype).max)
        if max_rows > exact:
            raise InputError(f"max_rows ({max_rows}) is more than {src.dtype} holds exactly ({int(exact)}); "
                             "send float64 or int64 rows, or lower the bound")
        rows = src.shape[0]
        padded = torch.zeros((max_rows + 1, *src.shape[1:]), dtype=src.dtype, device=src.device)
        # a rank over the budget still takes part (no rank may leave a collective), sending -N: all then raise
        padded.view(max_rows + 1, -1)[0, 0] = rows if rows <= max_rows else -rows
        padded[1: min(rows, max_rows) + 1] = src[:max_rows]
        bufs = [torch.empty_like(padded) for _ in range(G)]
        dist.all_gather(bufs, padded, group=group)
        counts = [int(b.view(max_rows + 1, -1)[0, 0].item()) for b in bufs]
        over = [(r, -c) for r, c in enumerate(counts) if c < 0]
        if over:
            raise over_budget(*over[0], max_rows)
        return [b[1:c + 1].to(device) for b, c in zip(bufs, counts, strict=True)]
    n = torch.tensor([src.shape[0]], dtype=torch.int64, device=src.device)
    sizes = [torch.empty_like(n) for _ in range(G)]
    dist.all_gather(sizes, n, group=group)
    counts = [int(s.item()) for s in sizes]
    width = max(counts)
    padded = torch.zeros((width, *src.shape[1:]), dtype=src.dtype, device=src.device)
    padded[: src.shape[0]] = src
    bufs = [torch.empty_like(padded) for _ in range(G)]
    dist.all_gather(bufs, padded, group=group)
    return [b[:c].to(device) for b, c in zip(bufs, counts, strict=True)]


def p2p_exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 group: Any = None) -> None:
    """Send each ``(peer, tensor)`` of ``sends`` and fill each of ``recvs``, all in one batch; blocks until done.

    Every pair of ranks must list their common messages in the same order on both sides (messages between
    two ranks are matched in posting order). Tensors must be contiguous; gloo stages CUDA tensors on the host.
    """
    ops, copy_back = [], []
    for peer, t in sends:
        buf = t.cpu().contiguous() if staged_through_host(group, t.device) else t.contiguous()
        ops.append(dist.P2POp(dist.isend, buf, global_rank(group, peer), group))
    for peer, t in recvs:
        if staged_through_host(group, t.device):
            host = torch.empty(t.shape, dtype=t.dtype)
            copy_back.append((t, host))
            ops.append(dist.P2POp(dist.irecv, host, global_rank(group, peer), group))
        else:
            ops.append(dist.P2POp(dist.irecv, t, global_rank(group, peer), group))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    for t, host in copy_back:
        t.copy_(host)
