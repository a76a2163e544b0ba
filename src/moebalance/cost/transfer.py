"""What a plan change costs on the wire: the expert copies each GPU receives, scheduled in rounds.

Legend: ``L`` layers, ``E`` logical experts per layer, ``G`` GPUs, ``D`` the largest number of copies any GPU
sends or receives.

One transfer is one expert copy of one layer: GPU ``g`` receives expert ``e`` of layer ``l`` when the new plan
places ``e`` on ``g`` and the previous plan placed no copy there (a second copy on a GPU that already holds one is
cloned locally, as ``runtime/rearrange.py`` does; docs/design.md, "Runtime"). Its source is a GPU that held ``e``
in the previous plan: one on ``g``'s node when there is one, else any; within that tier the one that sends the
fewest copies so far (over the layers scheduled; ties: the lowest id), the rule of ``runtime/rearrange.py``.

Transfers are grouped into rounds in which every GPU sends at most one copy and receives at most one (batching
so that each rank talks to one peer at a time). The transfers form a bipartite multigraph, senders on one side
and receivers on the other; a round is a matching, and by König's edge-colouring theorem ``D`` rounds suffice
and are needed, ``D`` the largest degree. The colouring is built edge by edge, flipping an alternating two-colour
path where the free colours at the two ends differ (the classical proof of König's theorem), in a compiled
kernel. A round lasts as long as its slowest copy, ``bytes_per_expert / bandwidth``, with the cluster's
intra-node or inter-node GB/s per GPU and direction; the schedule's time is the sum over rounds. The rounds are
minimal in number; which copies share a round is not tuned to the links, so a round mixing one inter-node copy
with intra-node ones lasts the inter-node time.

Worked example: 2 GPUs on one node at 450 GB/s, GPU 0 receives 2 experts of 1 GB and GPU 1 one: ``D = 2`` rounds
(GPU 1 sends twice), each ``1 / 450`` s, ``seconds = 2 / 450``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement

__all__ = ["TransferSchedule", "colour_transfers", "schedule_transfers"]


@dataclass(frozen=True, slots=True)
class TransferSchedule:
    """The copies a plan change moves and the rounds they take.

    Example (the module's worked example): ``rounds == 2``, ``moved_experts == 3``, ``moved_bytes == 3 * 10**9``,
    ``per_round_seconds == [1/450, 1/450]``, ``seconds == 2/450``.
    """

    #: Transfer rounds (each GPU sends to at most one peer and receives from at most one per round).
    rounds: int
    #: Sum over rounds of the round's slowest transfer (bytes / link GB/s).
    seconds: float
    #: Expert copies received, summed over GPUs and layers.
    moved_experts: int
    #: ``moved_experts * bytes_per_expert``.
    moved_bytes: int
    #: ``float64 [rounds]``: each round's time.
    per_round_seconds: np.ndarray


@njit(cache=True, nogil=True)
def _pick_sources(held: np.ndarray, lay: np.ndarray, exp: np.ndarray, dst: np.ndarray, node: np.ndarray,
                  ) -> np.ndarray:  # pragma: no cover - compiled
    """``int64 [N]`` source of each transfer (``-1``: no holder); ``held`` is ``bool [l, E, G]``."""
    G = held.shape[2]
    sends = np.zeros(G, dtype=np.int64)
    out = np.full(lay.size, -1, dtype=np.int64)
    for i in range(lay.size):
        best, best_near, best_sends = -1, False, 0
        for h in range(G):
            if not held[lay[i], exp[i], h]:
                continue
            near = node[h] == node[dst[i]]
            if best < 0 or (near and not best_near) or (near == best_near and sends[h] < best_sends):
                best, best_near, best_sends = h, near, sends[h]
        out[i] = best
        if best >= 0:
            sends[best] += 1
    return out


@njit(cache=True, nogil=True)
def colour_transfers(src: np.ndarray, dst: np.ndarray, num_gpus: int, num_colours: int,
                     ) -> np.ndarray:  # pragma: no cover - compiled
    """``int64 [N]``: a round in ``[0, num_colours)`` for every transfer ``src[i] -> dst[i]`` such that no GPU sends
    twice or receives twice in one round; ``num_colours`` must be at least the largest send or receive count."""
    n = src.size
    at_src = np.full((num_gpus, num_colours), -1, dtype=np.int64)  # transfer of colour c sent by g
    at_dst = np.full((num_gpus, num_colours), -1, dtype=np.int64)  # transfer of colour c received by g
    colour = np.full(n, -1, dtype=np.int64)
    path = np.empty(n, dtype=np.int64)
    for i in range(n):
        u, v = src[i], dst[i]
        a = 0
        while at_src[u, a] >= 0:
            a += 1
        b = 0
        while at_dst[v, b] >= 0:
            b += 1
        if at_dst[v, a] >= 0:
            # a is free at u, b at v: flip the a/b path from v. It leaves v by its a-edge, reaches senders by
            # a-edges and receivers by b-edges, so it never reaches u (a is free there); afterwards a is free at v.
            k = 0
            cur, on_dst, want = v, True, a
            while True:
                e = at_dst[cur, want] if on_dst else at_src[cur, want]
                if e < 0:
                    break
                path[k] = e
                k += 1
                cur = src[e] if on_dst else dst[e]
                on_dst = not on_dst
                want = b if want == a else a
            for j in range(k):
                e = path[j]
                at_src[src[e], colour[e]] = -1
                at_dst[dst[e], colour[e]] = -1
            for j in range(k):
                e = path[j]
                colour[e] = b if colour[e] == a else a
                at_src[src[e], colour[e]] = e
                at_dst[dst[e], colour[e]] = e
        colour[i] = a
        at_src[u, a] = i
        at_dst[v, a] = i
    return colour


def _check_shapes(previous: Placement, new: Placement, cluster: Cluster) -> None:
    if (previous.num_layers, previous.num_experts, previous.num_gpus) != (new.num_layers, new.num_experts,
                                                                            new.num_gpus):
        raise PlanError(f"the previous plan has {previous.num_layers} layers x {previous.num_experts} experts on "
                        f"{previous.num_gpus} GPUs but the new one {new.num_layers} x {new.num_experts} on "
                        f"{new.num_gpus}; both plans must be for the same model and cluster")
    if cluster.num_gpus != new.num_gpus:
        raise PlanError(f"the cluster has {cluster.num_gpus} GPUs but the plans {new.num_gpus}; give the plans' "
                        "cluster")


def _layer_list(layers: Sequence[int] | None, num_layers: int) -> np.ndarray:
    if layers is None:
        return np.arange(num_layers, dtype=np.int64)
    out = []
    for x in layers:
        if isinstance(x, bool) or not isinstance(x, int | np.integer) or not 0 <= x < num_layers:
            raise PlanError(f"layer {x!r} is not a plan layer; give layers in [0, {num_layers})")
        out.append(int(x))
    return np.unique(np.asarray(out, dtype=np.int64))


def schedule_transfers(previous: Placement, new: Placement, bytes_per_expert: int, cluster: Cluster, *,
                       layers: Sequence[int] | None = None, lost: Sequence[int] = ()) -> TransferSchedule:
    """The transfers that turn ``previous`` into ``new`` (only ``layers``, when given), in minimal rounds.

    ``lost``: GPUs whose previous copies are gone (they send nothing); an expert copy that only they held cannot
    be sourced and is a :class:`PlanError` naming it.
    """
    _check_shapes(previous, new, cluster)
    if isinstance(bytes_per_expert, bool) or not isinstance(bytes_per_expert, int | np.integer) \
            or bytes_per_expert < 0:
        raise InputError(f"bytes_per_expert ({bytes_per_expert!r}) must be a non-negative integer")
    sel = _layer_list(layers, new.num_layers)
    G = new.num_gpus
    held = previous.copies[sel] > 0  # [l, E, G]
    for g in lost:
        if isinstance(g, bool) or not isinstance(g, int | np.integer) or not 0 <= g < G:
            raise PlanError(f"lost GPU {g!r} is not one of the {G} GPUs")
        held[:, :, int(g)] = False
    need = (new.copies[sel] > 0) & (previous.copies[sel] == 0)  # [l, E, G]
    lay, exp, dst = np.nonzero(need)
    order = np.lexsort((exp, dst, lay))  # by layer, then destination, then expert
    lay, exp, dst = lay[order], exp[order], dst[order]
    src = _pick_sources(np.ascontiguousarray(held), lay, exp, dst, cluster.node_of())
    if lay.size and src.min() < 0:
        i = int(np.argmax(src < 0))
        raise PlanError(f"expert {int(exp[i])} of layer {int(sel[lay[i]])} has no copy in the previous plan to send "
                        f"to GPU {int(dst[i])}; a lost GPU's only copies must be reloaded from the host")
    n = int(lay.size)
    rounds = int(max(np.bincount(src, minlength=G).max(), np.bincount(dst, minlength=G).max())) if n else 0
    per_round = np.zeros(rounds, dtype=np.float64)
    if n:
        colour = colour_transfers(src, dst, G, rounds)
        seconds = bytes_per_expert / (cluster.bandwidth_matrix()[src, dst] * 1e9)
        np.maximum.at(per_round, colour, seconds)
    return TransferSchedule(rounds=rounds, seconds=float(per_round.sum()), moved_experts=n,
                            moved_bytes=n * int(bytes_per_expert), per_round_seconds=per_round)
