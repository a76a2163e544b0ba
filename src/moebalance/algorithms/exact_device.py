"""The exact per-layer planner on the routing's device: Libra's prefetcher and rebalancer as Triton programs.

Legend: ``B`` batches, ``L`` layers, ``G`` GPUs, ``E`` experts, ``N`` extra experts a GPU may take for one layer,
``NL = floor(N * alpha)`` of them chosen for locality; ``T`` tokens, ``K`` picks per token.

:func:`plan` gives, for every ``(batch, layer)`` at once, what :func:`moebalance.algorithms.exact.plan_layer` gives
for one (Libra's prefetcher, Alg. 1 phases 1 and 2, then the token rebalancer, Alg. 2; docs/papers/libra.md), with
every tensor on the device of the routing. It is three steps, none of which waits for the host:

1. **Alg. 1**, one Triton program per ``(batch, layer)`` (:func:`_alg1`). Phase 1 takes each GPU's ``NL`` most
   requested experts it does not hold as ``NL`` arg-max passes over the program's ``[G, E]`` tile (ties to the
   lower id). Phase 2 keeps the loads in registers and the shares and holdings in a scratch ``[G, E]`` in memory,
   so a duplication reads and writes one row and one column, not the tile: the most loaded GPU, its expert with
   the most remote share, the least loaded open GPU without that expert, the localisation of its own picks and
   the rebalancer's transfer, exactly as :func:`moebalance.algorithms.prefetch.plan_extras` prints them.
2. **The start**: each expert's remote picks dealt over its holders in GPU order, an extra counting as one copy
   (batched torch operations: :func:`moebalance.algorithms.rebalance_device.start_split`).
3. **Alg. 2**, one program per ``(batch, layer)`` with the local picks fixed
   (:func:`moebalance.algorithms.rebalance_device.moves`).

Equal to the CPU planner: the extras, the split, the loads and the number of moves are the same, ties included
(``tests/test_exact_device.py``). The expected loads are float sums taken in another order (a reduction over the
tile, not expert by expert), so they agree to within :data:`moebalance.algorithms.prefetch.TOL`, the tolerance
within which the planner counts two loads or shares as tied (the lower id wins), and every decision falls alike.

:func:`assign` hands one layer's split out to its tokens on the device, as :func:`moebalance.algorithms.exact.assign`
does on the host. On a CPU tensor the kernels run in Triton's interpreter (for tests; slow).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moebalance.algorithms import rebalance_device
from moebalance.algorithms.exact import MAX_PICKS
from moebalance.algorithms.prefetch import TOL, check_options
from moebalance.core.errors import InputError

if TYPE_CHECKING:
    import torch

try:  # after rebalance_device, which chooses Triton's interpreter when no GPU is present
    import triton.language as tl
except ImportError:  # an optional dependency: kernel() says how to install it
    tl = None
_TOL = TOL if tl is None else tl.constexpr(TOL)  # a kernel reads module constants only as constexpr

__all__ = ["DevicePlan", "assign", "kernel", "plan"]


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """Every ``(batch, layer)``'s exact plan, as tensors on the routing's device."""

    #: ``int64 [B, L, G, N]``: each GPU's extras in the order added (phase 1 first), padded with -1.
    extras: torch.Tensor
    #: ``float64 [B, L, G]``: the loads the prefetcher expects.
    expected: torch.Tensor
    #: ``bool [B, L, G, E]``: the GPUs holding each expert in the batch's layer, base copies and extras.
    holds: torch.Tensor
    #: ``int64 [B, L, G, E]``: remote picks of expert ``e`` that GPU ``g`` serves after the rebalancer.
    remote: torch.Tensor
    #: ``int64 [B, L, G]``: picks each GPU serves.
    loads: torch.Tensor
    #: ``int64 [B, L]``: the rebalancer's moves.
    moves: torch.Tensor


def _flag(cond):  # pragma: no cover - inlined into the kernel
    """``cond`` as an integer flag: Triton's interpreter broadcasts a float comparison's result as floats."""
    return tl.where(cond, 1, 0) > 0


if tl is not None:
    import triton

    _flag = triton.jit(_flag)  # called from the kernel: a Triton function (interpreted where the kernel is)


def _alg1(d_ptr, copies_ptr, has_ptr, share_ptr, extras_ptr, expected_ptr, L, G, E, N, NL,
          GP: tl.constexpr, EP: tl.constexpr, NP: tl.constexpr):  # pragma: no cover - a Triton kernel
    """One ``(batch, layer)`` per program: ``d int64 [G, E]`` and the layer's base ``copies [G, E]`` in;
    ``has int8 [G, E]`` (base plus extras), ``share float64 [G, E]`` (scratch: remote shares), ``extras [G, N]``
    and ``expected [G]`` out."""
    pid = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: B * L * G * E may pass 2**31
    g = tl.arange(0, GP)
    e = tl.arange(0, EP)
    slot = tl.arange(0, NP)
    gm = g < G
    em = e < E
    m2 = gm[:, None] & em[None, :]
    tile = g[:, None] * E + e[None, :]
    base = pid * G * E
    d = tl.load(d_ptr + base + tile, mask=m2, other=0)
    held = (tl.load(copies_ptr + (pid % L) * G * E + tile, mask=m2, other=0) > 0) & m2
    added = tl.zeros([GP], dtype=tl.int64)
    extras = tl.full([GP, NP], -1, tl.int64)
    # phase 1: each GPU's NL most requested experts it does not hold, most requested first, the lower id on ties
    for i in range(0, NL):
        wanted = tl.where(held | (m2 == 0), -1, d)
        top = tl.max(wanted, axis=1)
        pick = tl.min(tl.where(wanted == top[:, None], e[None, :], EP), axis=1)
        ok = top > 0
        extras = tl.where((slot[None, :] == i) & ok[:, None], pick[:, None], extras)
        held = held | ((e[None, :] == pick[:, None]) & ok[:, None])
        added += ok.to(tl.int64)
    # loads: local picks stay; each expert's remote picks split evenly over its holders
    column = tl.sum(d, axis=0)  # [EP]
    dh = tl.where(held, d, 0)
    rem_e = (column - tl.sum(dh, axis=0)).to(tl.float64)
    hcount = tl.sum(held.to(tl.int64), axis=0)
    share_e = tl.where(rem_e > 0, rem_e / tl.maximum(hcount, 1).to(tl.float64), 0.0)
    share = tl.where(held, share_e[None, :], 0.0)
    load = tl.sum(dh.to(tl.float64) + share, axis=1)  # [GP]
    B = tl.sum(column, axis=0).to(tl.float64) / G
    tl.store(has_ptr + base + tile, held.to(tl.int8), mask=m2)
    tl.store(share_ptr + base + tile, share, mask=m2)
    tl.debug_barrier()
    # phase 2: at most (N - NL) * G duplications; a pass that finds nothing to do ends the loop
    passes = (N - NL) * G
    it = 0
    go = passes > 0
    while go:
        top = tl.max(tl.where(gm, load, -1.0), axis=0)
        src = tl.min(tl.where(gm & (load + _TOL >= top), g, GP), axis=0)  # most loaded, lower id within TOL
        ok = _flag(top > B + _TOL)
        srow = tl.load(share_ptr + base + src * E + e, mask=em, other=0.0)  # [EP]
        best = tl.max(srow, axis=0)
        x = tl.minimum(tl.min(tl.where((srow + _TOL >= best) & em, e, EP), axis=0), E - 1)
        ok = ok & _flag(best > _TOL)
        hcol = tl.load(has_ptr + base + g * E + x, mask=gm, other=0) > 0  # [GP]: the holders of x
        open_ = gm & (added < N) & (hcol == 0)
        low = tl.min(tl.where(open_, load, float("inf")), axis=0)
        dst = tl.min(tl.where(open_ & (load - _TOL <= low), g, GP), axis=0)
        ok = ok & (dst < G)
        at_dst = g == dst
        own = tl.sum(tl.where(at_dst, tl.load(d_ptr + base + g * E + x, mask=gm, other=0), 0), axis=0)
        own = own.to(tl.float64)
        ok = ok & _flag(tl.sum(tl.where(at_dst, load, 0.0), axis=0) + own <= B + _TOL)
        # localise dst's own picks of x, taken from x's holders in proportion to what they serve
        col = tl.load(share_ptr + base + g * E + x, mask=gm, other=0.0)  # [GP]
        remote = tl.sum(tl.where(hcol, col, 0.0), axis=0)
        keep = tl.maximum(remote - own, 0.0) / tl.where(remote > 0, remote, 1.0)
        cut = tl.where(hcol & ok & _flag((own > 0) & (remote > 0)), col * (1.0 - keep), 0.0)
        col = col - cut
        load = load - cut
        to_dst = _flag(at_dst & ok)
        col = tl.where(to_dst, 0.0, col)
        load = tl.where(to_dst, load + own, load)
        slot_dst = tl.sum(tl.where(at_dst, added, 0), axis=0)
        extras = tl.where(to_dst[:, None] & (slot[None, :] == slot_dst), x, extras)
        added += to_dst.to(tl.int64)
        # the rebalancer's transfer of src's remote picks of x, never past B on either side
        at_src = g == src
        amount = tl.minimum(tl.minimum(tl.sum(tl.where(at_src, col, 0.0), axis=0),
                                       tl.sum(tl.where(at_src, load, 0.0), axis=0) - B),
                            B - tl.sum(tl.where(at_dst, load, 0.0), axis=0))
        amount = tl.where(ok & _flag(amount > 0), amount, 0.0)
        col = col - tl.where(at_src, amount, 0.0) + tl.where(at_dst, amount, 0.0)
        load = load - tl.where(at_src, amount, 0.0) + tl.where(at_dst, amount, 0.0)
        tl.store(share_ptr + base + g * E + x, col, mask=_flag(gm & ok))
        tl.store(has_ptr + base + g * E + x, tl.full([GP], 1, tl.int8), mask=to_dst)
        tl.debug_barrier()
        it += 1
        go = ok & (it < passes)
    tl.store(expected_ptr + pid * G + g, load, mask=gm)
    tl.store(extras_ptr + pid * G * N + g[:, None] * N + slot[None, :], extras, mask=gm[:, None] & (slot[None, :] < N))


@functools.cache
def kernel(interpret: bool) -> Any:
    """Alg. 1's kernel (:func:`moebalance.algorithms.rebalance_device.compile_kernel`)."""
    return rebalance_device.compile_kernel(_alg1, interpret)


def plan(demand: torch.Tensor, copies: torch.Tensor, n: int, alpha: float, *, eps: float = 0.0, strict: bool = False,
         validate: bool = True) -> DevicePlan:
    """Every ``(batch, layer)``'s exact plan (module docstring) of ``demand int [B, L, G, E]`` (picks by source GPU
    and expert) on the base placement's ``copies int [L, E, G]``, on their device.

    ``n``, ``alpha``: the prefetcher's buffer and locality share; ``eps``, ``strict``: the rebalancer's options.
    With ``validate`` the values are checked first (non-negative, every expert at least once, under
    :data:`moebalance.algorithms.exact.MAX_PICKS` picks a layer): that reads a few numbers back to the host. Give
    ``validate=False`` inside a CUDA graph; then the call never waits for the host, and bad values give a plan
    that means nothing."""
    import torch

    if not isinstance(demand, torch.Tensor) or not isinstance(copies, torch.Tensor):
        raise InputError("the device planner takes torch tensors: demand [B, L, G, E] and copies [L, E, G]")
    if not _whole(demand) or not _whole(copies):
        raise InputError(f"demand ({demand.dtype}) and copies ({copies.dtype}) must hold whole numbers (integer "
                         "tensors)")
    if demand.dim() != 4 or copies.dim() != 3 or (demand.shape[1], demand.shape[3], demand.shape[2]) != copies.shape:
        raise InputError(f"demand {tuple(demand.shape)} must be [B, L, G, E] and copies {tuple(copies.shape)} "
                         "[L, E, G] of the same layers")
    if demand.device != copies.device:
        raise InputError(f"demand is on {demand.device} and copies on {copies.device}; give both on one device")
    B, L, G, E = demand.shape
    n_local = check_options(n, alpha, E)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0.0 <= eps < 1.0:
        raise InputError(f"eps ({eps!r}) must be a number in [0, 1), the rebalancer's tolerance over the mean load")
    d = demand.to(torch.int64).contiguous()
    base = copies.to(torch.int64).permute(0, 2, 1).contiguous()  # [L, G, E]
    if validate:
        _validate(d, base)
    dev = d.device
    has = torch.empty((B, L, G, E), dtype=torch.int8, device=dev)
    share = torch.empty((B, L, G, E), dtype=torch.float64, device=dev)
    extras = torch.full((B, L, G, n), -1, dtype=torch.int64, device=dev)
    expected = torch.zeros((B, L, G), dtype=torch.float64, device=dev)
    if B * L * G * E:
        pow2 = rebalance_device.pow2
        kernel(dev.type == "cpu")[(B * L,)](d, base, has, share, extras, expected, L, G, E, int(n), n_local,
                                            GP=pow2(G), EP=pow2(E), NP=pow2(max(int(n), 1)),
                                            **rebalance_device.float_launch(dev))
    holds = has.to(torch.bool)
    mult = torch.where(holds, base.clamp(min=1)[None], 0)  # an extra is one copy on a GPU that had none
    mine = torch.where(holds, d, 0)
    column = d.sum(dim=2)  # [B, L, E]
    n_remote = (column - mine.sum(dim=2)).reshape(1, B * L, E)
    flat = mult.reshape(B * L, G, E).transpose(1, 2)  # [B * L, E, G]
    remote = rebalance_device.start_split(n_remote, flat).contiguous()  # [1, B * L, G, E]
    loads, moves = rebalance_device.moves(remote, mine.sum(dim=3).reshape(1, B * L, G), flat,
                                          column.sum(dim=2).reshape(1, B * L), float(eps), bool(strict))
    return DevicePlan(extras, expected, holds, remote.reshape(B, L, G, E), loads.reshape(B, L, G),
                      moves.reshape(B, L))


def _whole(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex)


def _validate(d: torch.Tensor, base: torch.Tensor) -> None:
    """One-line errors for negative demand or copies, an expert without a home, or too many picks in a layer."""
    import torch

    if d.numel() and bool((d < 0).any()):
        b, layer, g, e = (int(x) for x in torch.nonzero(d < 0)[0])
        raise InputError(f"demand[{b}, {layer}, {g}, {e}] is negative; give picks counted per GPU and expert")
    if base.numel() and bool((base < 0).any()):
        layer, g, e = (int(x) for x in torch.nonzero(base < 0)[0])
        raise InputError(f"copies[{layer}, {e}, {g}] is negative; give copy counts >= 0")
    homeless = ~(base > 0).any(dim=1)  # [L, E]
    if homeless.numel() and bool(homeless.any()):
        layer, e = (int(x) for x in torch.nonzero(homeless)[0])
        raise InputError(f"expert {e} has no copy in layer {layer} of the base placement; every expert needs a home")
    if d.numel():
        picks = d.sum(dim=(2, 3))
        # a layer's picks stay exact in float64, and the rebalancer's packed sums in int64
        if int(picks.max()) >= MAX_PICKS or int(d.amax()) >= MAX_PICKS // max(d.shape[2] * d.shape[3], 1):
            raise InputError(f"a layer has {int(picks.max()):.3g} picks, more than this planner sums exactly "
                             f"({MAX_PICKS:.3g}); give fewer tokens per batch")


def assign(p: DevicePlan, batch: int, layer: int, ids: torch.Tensor, src: torch.Tensor, kept: torch.Tensor,
           gpus_per_node: int) -> torch.Tensor:
    """``int64 [T, K]``: each kept pick's GPU under ``p``'s plan of ``(batch, layer)`` (-1 where not kept), on the
    picks' device, as :func:`moebalance.algorithms.exact.assign` gives it: a pick stays on its token's GPU when that
    GPU holds the expert (base copy or extra), the others take the plan's shares in token order, the token's node
    first (:func:`moebalance.algorithms.rebalance_device.hand_out`).

    ``ids int [T, K]``, ``src int [T]`` (each token's GPU) and ``kept bool [T, K]``: the picks the plan was counted
    from. No host synchronisation."""
    import torch

    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise InputError(f"gpus_per_node ({gpus_per_node!r}) must be a positive integer")
    if ids.dim() != 2 or src.shape != ids.shape[:1] or kept.shape != ids.shape:
        raise InputError(f"ids {list(ids.shape)}, src {list(src.shape)} and kept {list(kept.shape)} must be [T, K], "
                         "[T] and [T, K]: the picks the plan was counted from")
    Bn, L = p.moves.shape
    if not (0 <= batch < Bn and 0 <= layer < L):
        raise InputError(f"(batch, layer) = ({batch}, {layer}) is outside the plan's [{Bn}, {L}]")
    T, K = ids.shape
    flat = ids.to(torch.int64).reshape(-1)
    own = src.to(torch.int64)[:, None].expand(T, K).reshape(-1)
    keep = kept.to(torch.bool).reshape(-1)
    at_home = keep & p.holds[batch, layer][own, flat]
    share = p.remote[batch, layer].T[None]  # [1, E, G]
    dest = rebalance_device.hand_out(flat, own, torch.zeros_like(flat), at_home, keep & ~at_home, share,
                                     gpus_per_node)
    return dest.reshape(T, K)

