"""What one forward of the expert-parallel layer reports (:class:`EPStats`, :class:`MoEOutput`), how long exact
mode took from the gate to the experts (:class:`ExactTiming`), and the clock that times expert compute.

Legend: ``G`` ranks = GPUs, ``T`` tokens of all ranks, ``K`` picks per token, ``S`` base slots of this rank in the
layer, ``n`` its extras in this forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moebalance.runtime.gating import GateOutput

__all__ = ["Clock", "EPStats", "ExactTiming", "MoEOutput"]


@dataclass(frozen=True, slots=True)
class ExactTiming:
    """Exact mode (:mod:`moebalance.runtime.exact`): one rank's wall seconds from the end of its gate to the start of
    its expert compute in one forward, in three parts that add up to it.

    Example: ``ExactTiming(plan_seconds=0.0002, copy_seconds=0.0011, route_seconds=0.0030)``, 4.3 ms in all.
    """

    #: The planner: counting the batch's picks, the prefetcher's extras and the rebalancer's routing.
    plan_seconds: float
    #: Waiting for the extras' copies once the dispatch was planned (the copies are posted before it, so the
    #: dispatch planning hides part of them): the copy time left exposed.
    copy_seconds: float
    #: Gathering the routing (waiting for the slowest rank too), planning the dispatch, and sending the tokens
    #: until the first expert computes (with ``local_first`` the local picks start as soon as the rows are sent).
    route_seconds: float

    @property
    def total_seconds(self) -> float:
        """From the gate to the start of expert compute."""
        return self.plan_seconds + self.copy_seconds + self.route_seconds


@dataclass(frozen=True, slots=True)
class EPStats:
    """One rank's account of one forward.

    Example: on 2 GPUs of one node, rank 0 computing 5 picks on its 2 slots and sending 3 rows of 4 KiB::

        tokens_per_slot = [3, 2], send_rows = [2, 3], recv_rows = [0, 1], link_kind = [0, 1]

    (``send_rows[rank]`` counts this rank's tokens served locally: copies that cost nothing.)
    """

    rank: int
    #: ``int64 [S]``: picks computed by each local physical slot (a second copy of an expert on one GPU: 0);
    #: with a per-batch plan or in exact mode ``[S + n]``, the base slots, then this batch's extras.
    tokens_per_slot: np.ndarray
    #: ``int64 [G]``: dispatch rows to each rank; at ``rank``, the own tokens served here (not sent).
    send_rows: np.ndarray
    #: ``int64 [G]``: dispatch rows from each rank; at ``rank``, the same local count.
    recv_rows: np.ndarray
    #: ``int8 [G]``: 0 this rank, 1 same node, 2 another node (``plan.cluster``).
    link_kind: np.ndarray
    #: Bytes of one hidden-state row (``H * dtype size``); combine rows are the same size.
    bytes_per_row: int
    #: This rank's picks dropped by the capacity.
    dropped_picks: int
    #: Seconds gathering the routing (including waiting for the slowest rank to reach the gather) and
    #: running the router and :func:`~moebalance.runtime.dispatch.build_dispatch` on the host.
    routing_seconds: float
    #: Seconds of expert FFN compute, local and remote picks (CUDA events on GPU, wall time on CPU).
    expert_seconds: float
    #: Extra experts this rank received into its prefetch buffer for this forward, and their bytes; and the
    #: copies it sent to other ranks' buffers (0 without a per-batch plan or exact mode, or when the buffer already
    #: held them).
    prefetch_received: int = 0
    prefetch_bytes_received: int = 0
    prefetch_sent: int = 0
    prefetch_bytes_sent: int = 0
    #: Wall seconds the router (and the dispatch planning) took; ``None`` when the layer had nothing to route.
    router_seconds: float | None = None
    #: Wall seconds of the local phase (MoE_local) in the two-stage threaded path; ``None`` otherwise.
    local_seconds: float | None = None
    #: Two-stage threaded path only: True when the router finished before the local phase did (its cost hidden).
    rebalancer_hidden: bool | None = None
    #: Exact mode only: the time from the gate to the start of expert compute, by part; ``None`` otherwise.
    exact: ExactTiming | None = None

    @property
    def tokens_computed(self) -> int:
        """Picks this GPU served: what the simulator calls its load."""
        return int(self.tokens_per_slot.sum())

    def bytes(self) -> dict[str, int]:
        """Bytes moved by this rank, by direction and link; combine is dispatch reversed."""
        out: dict[str, int] = {}
        for kind, name in ((1, "intra_node"), (2, "inter_node")):
            sent = int(self.send_rows[self.link_kind == kind].sum()) * self.bytes_per_row
            recv = int(self.recv_rows[self.link_kind == kind].sum()) * self.bytes_per_row
            out[f"dispatch_sent_{name}"] = out[f"combine_received_{name}"] = sent
            out[f"dispatch_received_{name}"] = out[f"combine_sent_{name}"] = recv
        return out


@dataclass(frozen=True, slots=True)
class MoEOutput:
    """A forward's result on one rank."""

    #: ``[T_r, H]`` the MoE output of this rank's tokens (dtype of the input).
    out: torch.Tensor
    gate: GateOutput
    stats: EPStats
    #: ``int64 [T, K]``: the GPU of every pick of every rank's token (-1 dropped), identical on all ranks.
    dest: np.ndarray


class Clock:
    """Sums compute spans: CUDA events on the current stream (no device-wide sync that would wait for the
    all-to-all in flight and spoil the overlap), wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[Any] = []

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.spans.append((start, ev))
        else:
            self.spans.append(time.perf_counter() - start)

    def busy(self) -> bool:
        """CUDA: whether the last span's kernels are still running (always False on the CPU)."""
        return self.cuda and bool(self.spans) and not self.spans[-1][1].query()

    def seconds(self) -> float:
        if not self.cuda:
            return float(sum(self.spans))
        if self.spans:
            self.spans[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
