"""The exact per-layer planner in torch, on the device that holds the routing.

Legend: ``G`` GPUs, ``E`` experts, ``N`` extra experts a GPU may take for one layer, ``L = floor(N * alpha)``,
``P`` (GPU, movable expert) pairs: the experts with copies on two or more GPUs, each with a GPU holding it.

:func:`plan_layer_torch` gives what :func:`moebalance.algorithms.exact.plan_layer` gives (Libra's prefetcher,
Alg. 1 phases 1 and 2, then the token rebalancer, Alg. 2; docs/papers/libra.md), with tensors on the device of
``demand``: a GPU deployment counts the gathered routing on the GPU and plans there, and the routing never
goes to the host. What crosses is control flow: scalars, and in phase 2 at most ``G`` numbers at a time (one
expert's shares, summed GPU by GPU as the compiled planner sums them, and the loads when two are within the
tolerance of the extreme, to replay the printed scan).

How it is laid out. Phase 1 is one stable sort per GPU. Loads are summed expert by expert in the same order as
the compiled planner, so every float is the same. Phase 2 is a loop of at most ``(N - L) * G`` passes, each a
few vector operations over ``G``. The rebalancer evaluates every source at once on each move: for each pair its
least loaded other holder and ``cap`` (a segment minimum over the holders), for each GPU its first expert that
can move in the printed order (most remote picks, the lower id on ties), and the move of the most loaded GPU
that has one (the lower id on ties), which is the source the printed loop reaches after skipping those that
cannot move. Moves run in chunks without a host synchronisation: a chunk's moves after the last are no-ops.

The rebalancer makes one move per step, and a layer of 64 GPUs x 256 experts takes a few thousand moves, so this
planner is bound by the number of kernel launches, on a GPU too; :func:`time_torch_planner` measures it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moebalance.algorithms.exact import MAX_PICKS
from moebalance.algorithms.prefetch import TOL, check_options
from moebalance.core.errors import InputError

__all__ = ["TorchLayerPlan", "demand_for_timing", "plan_layer_torch", "time_torch_planner"]

#: Rebalancer moves between two checks of whether the loop has ended (one host synchronisation per chunk).
CHUNK = 32


@dataclass(frozen=True, slots=True)
class TorchLayerPlan:
    """:class:`moebalance.algorithms.exact.LayerPlan` as tensors on the routing's device."""

    #: ``int64 [G, N]``: each GPU's extras in the order added, padded with -1.
    extras: torch.Tensor
    #: ``float64 [G]``: the loads the prefetcher expects.
    expected: torch.Tensor
    #: ``int64 [G, E]``: remote picks of expert ``e`` that GPU ``g`` serves after the rebalancer.
    remote: torch.Tensor
    #: ``int64 [G]``: picks each GPU serves.
    loads: torch.Tensor
    moves: int


def _scan_max(values: torch.Tensor, start: float | None) -> int:
    """The printed tolerance scan for the largest of ``values [X]``: ``best = 0`` (or a virtual entry of value
    ``start`` before the first), then ``best = x`` where ``values[x] > values[best] + TOL``; -1 if nothing beats
    ``start``. Its result is within ``TOL`` of the maximum: when one entry alone is, that is it."""
    if values.numel() == 0:
        return -1
    top = values.max()
    near = values + TOL >= top
    if int(near.sum()) == 1:
        if start is not None and not bool(top > start + TOL):
            return -1
        return int(near.to(torch.int8).argmax())
    vals = values.tolist()
    best, bv = (-1, start) if start is not None else (0, vals[0])
    for x, v in enumerate(vals):
        if v > bv + TOL:
            best, bv = x, v
    return best


def _scan_min(values: torch.Tensor, open_: torch.Tensor) -> int:
    """The printed tolerance scan for the least of ``values [X]`` among ``open_ [X]`` (-1 if none open)."""
    if not bool(open_.any()):
        return -1
    low = torch.where(open_, values, torch.inf).min()
    near = open_ & (values - TOL <= low)
    if int(near.sum()) == 1:
        return int(near.to(torch.int8).argmax())
    best, bv = -1, 0.0
    for x, (v, ok) in enumerate(zip(values.tolist(), open_.tolist(), strict=True)):
        if ok and (best < 0 or v < bv - TOL):
            best, bv = x, v
    return best


def _prefetch(d: torch.Tensor, held: torch.Tensor, n: int, n_local: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alg. 1: ``(extras [G, N], expected [G], has [G, E] with the extras, column [E])`` (``d int64 [G, E]``)."""
    G, E = d.shape
    dev = d.device
    extras = torch.full((G, n), -1, dtype=torch.int64, device=dev)
    has = held.clone()
    rows = torch.arange(G, device=dev)
    if n_local > 0:  # phase 1: a stable sort keeps the lower id first among equal demands
        wanted = torch.where(held | (d <= 0), -1, d)
        order = torch.sort(wanted, dim=1, descending=True, stable=True).indices[:, :n_local]
        ok = wanted.gather(1, order) > 0
        extras[:, :n_local] = torch.where(ok, order, -1)
        has[rows[:, None].expand_as(order)[ok], order[ok]] = True
    added = (extras >= 0).sum(dim=1)
    column = d.sum(dim=0)
    hcount = has.sum(dim=0)
    remote_e = (column - (d * has).sum(dim=0)).double()
    share_e = torch.where(remote_e > 0, remote_e / hcount.clamp(min=1).double(), 0.0)
    # loads summed expert by expert, the own picks then the share, as the compiled planner sums them
    ids = torch.arange(E, device=dev)
    held_ids = torch.sort(torch.where(has, ids, E), dim=1).values
    S = int(has.sum(dim=1).max()) if G else 0
    load = torch.zeros(G, dtype=torch.float64, device=dev)
    for j in range(S):
        col = held_ids[:, j]
        ok = col < E
        ec = col.clamp(max=E - 1)
        load = load + torch.where(ok, d.gather(1, ec[:, None])[:, 0].double(), 0.0)
        load = load + torch.where(ok, share_e[ec], 0.0)
    share = torch.where(has, share_e[None, :], 0.0)
    # B divided on the host: CUDA divides a tensor by a scalar as a product with its reciprocal, which can
    # differ from the quotient in the last bit
    B = torch.tensor(int(column.sum()) / G if G else 0.0, dtype=torch.float64, device=dev)
    limit = float(B) + TOL
    for _ in range((n - n_local) * G):  # phase 2
        src = _scan_max(load, None)
        if not float(load[src]) > limit:
            break
        e = _scan_max(torch.where(has[src], share[src], 0.0), 0.0)
        if e < 0:
            break
        dst = _scan_min(load, ~has[:, e] & (added < n))
        if dst < 0:
            break
        own = d[dst, e].double()
        if bool(load[dst] + own > B + TOL):
            break
        holders = torch.nonzero(has[:, e])[:, 0]
        remote = 0.0
        for v in share[holders, e].tolist():  # summed GPU by GPU, as the compiled planner does
            remote += v
        own_f = float(own)
        if own_f > 0 and remote > 0:
            keep = max(remote - own_f, 0.0) / remote
            cut = share[holders, e] * (1.0 - keep)
            share[holders, e] = share[holders, e] - cut
            load[holders] = load[holders] - cut
        has[dst, e] = True
        extras[dst, added[dst]] = e
        added[dst] += 1
        load[dst] = load[dst] + own
        x = torch.minimum(torch.minimum(share[src, e], load[src] - B), B - load[dst])
        if bool(x > 0):
            share[src, e] = share[src, e] - x
            load[src] = load[src] - x
            share[dst, e] = share[dst, e] + x
            load[dst] = load[dst] + x
    return extras, load, has, column


def _start(n_remote: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """``int64 [G, E]``: each expert's remote picks dealt round-robin over its copies in GPU order (copy ``j``
    of ``r`` takes ``n // r``, one more if ``j < n mod r``; ``mult [G, E]`` copies per GPU)."""
    r = mult.sum(dim=0)
    base = torch.where(r > 0, n_remote // r.clamp(min=1), 0)
    extra = torch.where(r > 0, n_remote % r.clamp(min=1), 0)
    first = torch.cumsum(mult, dim=0) - mult  # index of each GPU's first copy
    ones = (extra[None, :] - first).clamp(min=0).minimum(mult)
    return mult * base[None, :] + ones


def _rebalance(remote: torch.Tensor, local: torch.Tensor, has: torch.Tensor, total: int, eps: float,
               strict: bool) -> tuple[torch.Tensor, int]:
    """Alg. 2 on the split ``remote [G, E]`` (moved in place); returns ``(loads [G], moves)``."""
    G = remote.shape[0]
    dev = remote.device
    target = total / G
    t0 = int(np.floor(target))  # whole loads: load > B  <=>  load > floor(B)
    limit = int(np.floor((1.0 + eps) * target))
    loads = local + remote.sum(dim=1)
    hcount = has.sum(dim=0)
    pg, pe = torch.nonzero(has & (hcount >= 2)[None, :], as_tuple=True)  # pairs, by GPU then expert
    P = pg.numel()
    if P == 0:
        return loads, 0
    # triples (pair, other holder), for the segment minimum of the holders' loads
    hosts_e = torch.nonzero(has.T)  # [(expert, GPU)] ascending
    starts = torch.cumsum(hcount, dim=0) - hcount
    cnt = hcount[pe]
    tp = torch.repeat_interleave(torch.arange(P, device=dev), cnt)
    offset = torch.arange(tp.numel(), device=dev) - torch.repeat_interleave(torch.cumsum(cnt, dim=0) - cnt, cnt)
    th = hosts_e[starts[pe][tp] + offset, 1]
    keep = th != pg[tp]
    tp, th = tp[keep], th[keep]
    big = torch.iinfo(torch.int64).max
    moves = torch.zeros((), dtype=torch.int64, device=dev)
    gpus = torch.arange(G, device=dev)
    while True:
        for _ in range(CHUNK):
            rem = remote[pg, pe]
            key = torch.full((P,), big, dtype=torch.int64, device=dev)
            key = key.scatter_reduce(0, tp, loads[th] * G + th, reduce="amin")  # least load, then lower id
            ld, dd = key // G, key % G
            cap = t0 - ld
            if not strict:
                cap = torch.where(cap < 1, (loads[pg] - ld) // 2, cap)
            ok = (rem > 0) & (cap >= 1)
            best_r = torch.full((G,), -1, dtype=torch.int64, device=dev)
            best_r = best_r.scatter_reduce(0, pg, torch.where(ok, rem, -1), reduce="amax")
            first = torch.full((G,), P, dtype=torch.int64, device=dev)
            pair_ids = torch.arange(P, device=dev)
            first = first.scatter_reduce(0, pg, torch.where(ok & (rem == best_r[pg]), pair_ids, P), reduce="amin")
            can = (first < P) & (loads > t0)
            s = torch.where(can, loads, -1).argmax().view(1)  # the most loaded that can move, the lower id on ties
            go = can.index_select(0, s) & (loads > limit).any()
            p = first.index_select(0, s).clamp(max=P - 1)
            e, g_d = pe.index_select(0, p), dd.index_select(0, p)
            amount = torch.minimum(rem.index_select(0, p), cap.index_select(0, p)) * go
            remote.index_put_((s, e), -amount, accumulate=True)
            remote.index_put_((g_d, e), amount, accumulate=True)
            loads = loads - amount * (gpus == s) + amount * (gpus == g_d)
            moves += go.to(torch.int64)[0]
        if not bool(go):
            return loads, int(moves)


def plan_layer_torch(demand: torch.Tensor, copies: torch.Tensor, n: int, alpha: float, *, eps: float = 0.0,
                     strict: bool = False) -> TorchLayerPlan:
    """:func:`moebalance.algorithms.exact.plan_layer` on ``demand [G, E]`` (whole counts) and the base layer's
    ``copies [E, G]``, with tensors on ``demand``'s device; the same result (module docstring)."""
    if not isinstance(demand, torch.Tensor) or not isinstance(copies, torch.Tensor):
        raise InputError("plan_layer_torch takes torch tensors: demand [G, E] and copies [E, G]")
    if demand.dtype.is_floating_point or demand.dtype.is_complex or copies.dtype.is_floating_point \
            or copies.dtype.is_complex:
        raise InputError(f"demand ({demand.dtype}) and copies ({copies.dtype}) must hold whole numbers (integer "
                         "tensors)")
    d = demand.to(torch.int64)
    cp = copies.to(device=d.device, dtype=torch.int64)
    if d.dim() != 2 or tuple(cp.shape) != (d.shape[1], d.shape[0]):
        raise InputError(f"demand {tuple(d.shape)} must be [G, E] and copies {tuple(cp.shape)} [E, G] of the same "
                         "layer")
    G, E = d.shape
    n_local = check_options(n, alpha, E)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0.0 <= eps < 1.0:
        raise InputError(f"eps ({eps!r}) must be a number in [0, 1), the rebalancer's tolerance over the mean load")
    if d.numel() and bool((d < 0).any()):
        g, e = (int(x) for x in torch.nonzero(d < 0)[0])
        raise InputError(f"demand[{g}, {e}] is negative; give picks counted per GPU and expert")
    if cp.numel() and bool((cp < 0).any()):
        e, g = (int(x) for x in torch.nonzero(cp < 0)[0])
        raise InputError(f"copies[{e}, {g}] is negative; give copy counts >= 0")
    held = (cp > 0).T.contiguous()
    if E and not bool(held.any(dim=0).all()):
        raise InputError(f"expert {int(torch.nonzero(~held.any(dim=0))[0, 0])} has no copy in the base placement; "
                         "every expert needs a home")
    total = int(d.sum()) if d.numel() else 0
    if total >= MAX_PICKS or total * max(G, 1) >= 1 << 62:
        raise InputError(f"the layer has {total:.3g} picks, more than this planner sums exactly; give one layer of "
                         "one batch")
    extras, expected, has, column = _prefetch(d, held, int(n), n_local)
    mult = torch.where(has, cp.T.clamp(min=1), 0)  # an extra is one copy on a GPU that had none
    local = (d * has).sum(dim=1)
    remote = _start(column - (d * has).sum(dim=0), mult)
    loads, moves = _rebalance(remote, local, has, total, float(eps), bool(strict))
    return TorchLayerPlan(extras, expected, remote, loads, moves)


def demand_for_timing(G: int, E: int, tokens_per_gpu: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(demand int64 [G, E], copies int64 [E, G])``: a skewed routing of ``tokens_per_gpu`` tokens per GPU, top-``k``
    (each GPU's own expert popularity drawn around a shared one), on a contiguous base placement."""
    rng = np.random.default_rng(seed)
    shared = rng.dirichlet(np.full(E, 0.6))
    demand = np.stack([rng.multinomial(tokens_per_gpu * k, rng.dirichlet(shared * E * 4 + 1e-3)) for _ in range(G)])
    copies = np.zeros((E, G), dtype=np.int64)
    copies[np.arange(E), np.arange(E) * G // E] = 1
    return demand.astype(np.int64), copies


def time_torch_planner(device: Any, G: int = 64, E: int = 256, tokens_per_gpu: int = 8192, k: int = 8, n: int = 4,
                       repeats: int = 50, *, seed: int = 0, max_seconds: float = 60.0, check: bool = True) -> float:
    """Median seconds of :func:`plan_layer_torch` on ``device`` (a ``torch.device`` or its name) for one layer of
    :func:`demand_for_timing`, ``alpha = 0.5``, after one untimed call; at most ``repeats`` calls and about
    ``max_seconds`` of timed calls. With ``check`` the untimed call's plan is compared with the compiled planner's
    and a difference raises ``RuntimeError``. CUDA calls are synchronised before each clock reading."""
    from moebalance.algorithms.exact import plan_layer

    dev = torch.device(device)
    demand_np, copies_np = demand_for_timing(G, E, tokens_per_gpu, k, seed)
    demand = torch.from_numpy(demand_np).to(dev)
    copies = torch.from_numpy(copies_np).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    got = plan_layer_torch(demand, copies, n, 0.5)
    sync()
    if check:
        want = plan_layer(demand_np, copies_np, n, 0.5)
        same = (np.array_equal(got.extras.cpu().numpy(), want.extras)
                and np.array_equal(got.expected.cpu().numpy(), want.expected)
                and np.array_equal(got.remote.cpu().numpy(), want.remote)
                and np.array_equal(got.loads.cpu().numpy(), want.loads) and got.moves == want.moves)
        if not same:
            raise RuntimeError(f"plan_layer_torch on {dev} differs from plan_layer (G={G}, E={E}, n={n})")
    times: list[float] = []
    spent = 0.0
    while len(times) < max(repeats, 1) and (not times or spent < max_seconds):
        sync()
        t0 = time.perf_counter()
        plan_layer_torch(demand, copies, n, 0.5)
        sync()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return statistics.median(times)
