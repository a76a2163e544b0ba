"""Agreement before a forward's exchange: one rank's bad input fails every rank, with one message (docs/design.md, "Errors").

Legend: ``G`` ranks, ``T_r`` routing rows of rank ``r``, ``X`` routing columns (``2 K``: expert ids and gate
weights as float32), ``M`` the fixed row bound (``max_rows``).

Without it, a rank that raises before a collective (a wrong shape, a bad per-batch plan) leaves the other ranks
waiting in that collective until the process group's timeout. Instead every rank *prepares* its forward (checks
its input and plan, gates its tokens), catches what went wrong, and reports it in a header that travels with
the routing gather that happens anyway, so agreement costs no extra collective:

    header int64 [4] = (error code, T_r, step, plan digest)

- without a row bound, the ``G`` headers are all-gathered in place of :func:`~moebalance.runtime.comm.all_gather_v`'s
  row-count round, then the rows (two collectives, as before);
- with ``max_rows``, the header rides in the first rows of the fixed-size buffer (one collective, as before):
  the buffer is ``int32 [h + M, X]`` with ``h = ceil(8 / X)`` header rows, and the float32 routing travels as its
  bit pattern, exactly.

If any rank reports an error, every rank joins one more all-gather of fixed-size messages and raises the same
error: that of the lowest failing rank, as ``rank r: <its message>`` (noting the other failing ranks), of its
class (:mod:`moebalance.runtime.errors`: a :class:`~moebalance.core.errors.MoebalanceError` keeps its class,
anything else becomes a :class:`RuntimeError`). A rank over the row bound
is such an error. Ranks that disagree on the step (the router's seed) or on the plan digest (layer, top-k and
the layer's per-GPU expert lists, hashed) would route differently and deadlock or mix results; they raise a
:class:`PlanError` naming the ranks. Every check is made on the gathered headers, identical everywhere, so all
ranks decide alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from moebalance.core.errors import PlanError
from moebalance.runtime.comm import over_budget, staged_through_host
from moebalance.runtime.errors import agreed_message, error_code, one_line, raise_coded

__all__ = ["MESSAGE_BYTES", "RankCheck", "agreed_gather", "plan_digest"]

#: Bytes of each rank's error message in the error round (longer messages are cut).
MESSAGE_BYTES = 512


@dataclass(frozen=True, slots=True)
class RankCheck:
    """What one rank found while preparing its forward.

    Example: a rank whose input had the wrong width: ``RankCheck(error=InputError("x must be ..."), step=3,
    digest=plan_digest(...))``.
    """

    #: The exception its preparation raised, or ``None``.
    error: BaseException | None
    #: The forward step (the router's seed), which every rank must share.
    step: int
    #: :func:`plan_digest` of the plan this forward routes on, which every rank must share.
    digest: int


def plan_digest(layer: int, top_k: int, gpu_experts: Sequence[Sequence[int]],
                next_layer: Sequence[Sequence[int]] = ()) -> int:
    """A 64-bit digest of one layer's plan and, with a per-batch plan, of the next layer's lists (whose copies
    this forward starts), the same in every process (integer tuples hash deterministically)."""
    h = hash((layer, top_k, tuple(tuple(e) for e in gpu_experts), tuple(tuple(e) for e in next_layer)))
    return (h + 2**63) % 2**64 - 2**63


def _fail(headers: torch.Tensor, error: BaseException | None, rank: int, group: Any,
          device: torch.device) -> NoReturn:
    """Every rank: gather the failing ranks' messages and raise the lowest one's error (a collective)."""
    mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if error is not None:
        raw = one_line(error).encode("utf-8")[:MESSAGE_BYTES]
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    mine = mine.to(device)  # the device the routing travelled on: NCCL gathers CUDA tensors only
    bufs = [torch.empty_like(mine) for _ in range(headers.shape[0])]
    dist.all_gather(bufs, mine, group=group)
    bufs = [b.cpu() for b in bufs]
    failed = [r for r in range(headers.shape[0]) if int(headers[r, 0]) != 0]
    texts = {r: bytes(bufs[r].tolist()).rstrip(b"\0").decode("utf-8", errors="replace") for r in failed}
    raise_coded(int(headers[failed[0], 0]), agreed_message(texts), error if rank == failed[0] else None)


def _check_same(headers: torch.Tensor) -> None:
    """Raise the same :class:`PlanError` on every rank if the ranks disagree on the step or the plan."""
    for col, what, fix in ((2, "step", "pass the same step to every rank's forward (or none on every rank)"),
                           (3, "plan", "give every rank the same plan (and per-batch plan) for this layer")):
        values = headers[:, col].tolist()
        if any(v != values[0] for v in values):
            other = next(r for r, v in enumerate(values) if v != values[0])
            shown = (f"rank 0 is at step {values[0]} but rank {other} at step {values[other]}" if col == 2
                     else f"rank {other}'s plan of this layer (or of the next, whose copies it starts) differs "
                          "from rank 0's")
            raise PlanError(f"the ranks disagree on the {what}: {shown}; {fix}")


def agreed_gather(routing_TX: torch.Tensor, check: RankCheck, group: Any = None,
                  max_rows: int | None = None) -> list[torch.Tensor]:
    """Every rank's ``float32 [T_r, X]`` routing rows, by rank, once all ranks agree their forward may go on.

    A collective: every rank calls it, also a rank whose preparation failed (with ``routing_TX`` of zero rows).
    Raises on every rank alike if any rank failed or the ranks disagree (module doc).
    """
    rank, G = dist.get_rank(group), dist.get_world_size(group)
    device = routing_TX.device
    src = (routing_TX.cpu() if staged_through_host(group, device) else routing_TX).to(torch.float32).contiguous()
    X, rows = int(src.shape[1]), int(src.shape[0])
    error = check.error
    if error is None and max_rows is not None and rows > max_rows:
        error = over_budget(rank, rows, max_rows)
    if error is not None:
        rows = 0
    header = torch.tensor([error_code(error), rows, check.step, check.digest], dtype=torch.int64, device=src.device)
    if max_rows is None:
        gathered = [torch.empty_like(header) for _ in range(G)]
        dist.all_gather(gathered, header, group=group)
        headers = torch.stack(gathered).cpu()
    else:
        h = math.ceil(8 / X)
        buf = torch.zeros((h + max_rows, X), dtype=torch.int32, device=src.device)
        buf[:h].view(-1)[:8] = header.view(torch.int32)
        if rows:
            buf[h:h + rows] = src.view(torch.int32)
        bufs = [torch.empty_like(buf) for _ in range(G)]
        dist.all_gather(bufs, buf, group=group)
        headers = torch.stack([b[:h].reshape(-1)[:8].contiguous().view(torch.int64) for b in bufs]).cpu()
    if bool((headers[:, 0] != 0).any()):
        _fail(headers, error, rank, group, src.device)
    _check_same(headers)
    counts = [int(c) for c in headers[:, 1].tolist()]
    if max_rows is not None:
        return [b[h:h + c].view(torch.float32).to(device) for b, c in zip(bufs, counts, strict=True)]
    padded = torch.zeros((max(counts), X), dtype=torch.float32, device=src.device)
    padded[:rows] = src
    parts = [torch.empty_like(padded) for _ in range(G)]
    dist.all_gather(parts, padded, group=group)
    return [p[:c].to(device) for p, c in zip(parts, counts, strict=True)]
