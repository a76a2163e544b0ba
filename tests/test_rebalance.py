"""The ``rebalance`` router: Libra's Adaptive Token Rebalancer (Libra Section 3.3, Appendix C, Alg. 2).

Readings of the pseudocode that these tests pin (they are the contract, see the module docstrings):

- ``B`` is the mean GPU load (total picks / G); tokens are whole, ``cap = floor(B - G[g_d])``, so a
  destination never passes ``B``;
- sources are the GPUs with load ``> B``, most loaded first; for each, its experts with remote picks, most
  remote picks first, only those with a copy on another GPU; ties go to the lower GPU / expert id;
- the destination is the least loaded other GPU holding the expert (only it is looked at);
- ``cap < 1``: ``strict=True`` skips the expert (as printed); the default moves up to
  ``floor((G[g_s] - G[g_d]) / 2)`` (levelling the two) when that is ``>= 1``;
- after every move the search restarts at the most loaded GPU (the paper's prose); the loop stops when
  ``max <= (1 + eps) B`` or when nothing can move;
- start state: own-GPU picks are local and pinned; the remote picks of expert ``e`` start as the ``uniform``
  router deals them (round-robin over ``e``'s copies in GPU order, copy ``j`` of ``r`` takes ``n // r``, one
  more if ``j < n % r``); on counts every pick is remote;
- after Alg. 2 each GPU's share of ``e`` is handed out in token order, to same-node tokens first.

Hand-checked cases carry their derivation (loads and remote picks after each move) in comments. The property
tests compare against :func:`_alg2`, a slow, direct reading of the printed pseudocode written for this file
(every quantity recomputed from scratch each step, no incremental bookkeeping), and check facts that hold
whatever the order of moves: conservation, hosting GPUs, pinned local picks, no worse than the start, and
the stopping rule checked by brute force over all (source, expert, destination) triples.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import random_replica_layers
from hypothesis import given, settings

from moebalance.algorithms.minmax import host_lists
from moebalance.algorithms.rebalance import gpu_lists, rebalance
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix, read_load
from moebalance.core.plan import Placement
from moebalance.core.trace import RoutingTrace
from moebalance.policies import Budget, make_plan
from moebalance.routing import ROUTERS, get_router
from moebalance.routing.base import check_routes
from moebalance.routing.simulate import evaluate

RNG = np.random.default_rng(0)  # the rebalance router draws nothing; any generator will do


# ----------------------------------------------------------------------------------------------------------
# helpers written from the spec (not from the implementation)
# ----------------------------------------------------------------------------------------------------------


def _has(gpus: list[list[int]], E: int) -> np.ndarray:
    """``bool [E, G]`` from per-GPU expert lists."""
    has = np.zeros((E, len(gpus)), dtype=bool)
    for g, experts in enumerate(gpus):
        has[experts, g] = True
    return has


def _kernel(local: list[int], remote: dict[tuple[int, int], int], gpus: list[list[int]], *, eps: float = 0.0,
            strict: bool = False, target: float | None = None) -> tuple[list[int], np.ndarray, int]:
    """Run the kernel on one (batch, layer): ``remote`` maps ``(gpu, expert)`` to picks; ``gpus`` lists the
    experts each GPU holds. Returns ``(loads, remote [G, E] after the moves, moves)``; B defaults to the
    mean."""
    G, E = len(gpus), 1 + max(e for experts in gpus for e in experts)
    rem = np.zeros((G, E), dtype=np.int64)
    for (g, e), n in remote.items():
        rem[g, e] = n
    loc = np.asarray(local, dtype=np.int64)
    B = (loc.sum() + rem.sum()) / G if target is None else target
    hstart, hosts = host_lists(_has(gpus, E))
    gstart, gexp = gpu_lists(hstart, hosts, G)
    loads, moves = rebalance(loc, rem, hstart, hosts, gstart, gexp, float(B), eps, strict)
    return loads.tolist(), rem, int(moves)


def _alg2(local: np.ndarray, remote: np.ndarray, has: np.ndarray, B: float, eps: float,
          strict: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Alg. 2 read directly, with this project's readings: ``(loads [G], remote [G, E], moves)``.

    Slow on purpose: every step re-sorts the sources and experts and rescans the candidates.
    """
    G, E = remote.shape
    remote = remote.copy()
    loads = local + remote.sum(axis=1)  # remote is zero where a GPU holds no copy
    moves = 0
    while loads.max() > (1 + eps) * B:
        moved = False
        for gs in sorted((g for g in range(G) if loads[g] > B), key=lambda g: (-loads[g], g)):
            movable = [e for e in range(E) if remote[gs, e] > 0 and has[e].sum() > 1]
            for e in sorted(movable, key=lambda e: (-remote[gs, e], e)):
                gd = min((g for g in range(G) if g != gs and has[e, g]), key=lambda g: (loads[g], g))
                cap = math.floor(B - loads[gd])
                if cap < 1 and not strict:
                    cap = (loads[gs] - loads[gd]) // 2
                if cap >= 1:
                    amount = min(remote[gs, e], cap)
                    remote[gs, e] -= amount
                    remote[gd, e] += amount
                    loads[gs] -= amount
                    loads[gd] += amount
                    moves += 1
                    moved = True
                    break
            if moved:
                break  # restart at the most loaded GPU
        if not moved:
            break
    return loads, remote, moves


def _round_robin(n: int, copies_G: np.ndarray) -> np.ndarray:
    """``int64 [G]``: ``n`` picks dealt as the ``uniform`` router deals tokens: the i-th to copy ``i mod r``,
    copies in GPU order (a GPU with two copies holds two consecutive copy numbers)."""
    slots = np.repeat(np.arange(copies_G.shape[0]), copies_G)  # copy number -> GPU
    out = np.zeros(copies_G.shape[0], dtype=np.int64)
    np.add.at(out, slots[np.arange(n) % slots.size], 1)
    return out


def _start(ids: np.ndarray, src: np.ndarray, copies_EG: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start state of one (batch, layer) from its picks ``ids [N]`` made by tokens on ``src [N]`` (``src``
    -1: no source GPU, every pick remote): ``(local [G], remote [G, E])``."""
    E, G = copies_EG.shape
    local = np.zeros(G, dtype=np.int64)
    is_local = (src >= 0) & (copies_EG[ids, np.maximum(src, 0)] > 0)
    np.add.at(local, src[is_local], 1)
    n_remote = np.bincount(ids[~is_local], minlength=E)
    remote = np.stack([_round_robin(int(n_remote[e]), copies_EG[e]) for e in range(E)], axis=1)
    return local, remote


def _blocked(loads: np.ndarray, remote: np.ndarray, has: np.ndarray, B: float, strict: bool) -> list[str]:
    """Every move Alg. 2 would still allow in this state, by brute force (empty: none is left).

    All (source with load > B, expert with remote picks there, other GPU holding it) triples; the rule looks
    only at the least loaded such GPU, so a triple is allowed when its destination is a least loaded one and
    the cap for it is >= 1.
    """
    allowed = []
    G, E = remote.shape
    for gs in range(G):
        if loads[gs] <= B:
            continue
        for e in range(E):
            others = [g for g in range(G) if g != gs and has[e, g]]
            if remote[gs, e] <= 0 or not others:
                continue
            least = min(loads[g] for g in others)
            for gd in others:
                if loads[gd] != least:
                    continue
                cap = math.floor(B - loads[gd])
                if not strict and cap < 1:
                    cap = (loads[gs] - loads[gd]) // 2
                if cap >= 1:
                    allowed.append(f"{remote[gs, e]} picks of expert {e} from GPU {gs} ({loads[gs]}) "
                                   f"to GPU {gd} ({loads[gd]}), B = {B}")
    return allowed


def _plan(gpus: list[list[int]], E: int, nodes: int = 1) -> Placement:
    """A one-layer plan from per-GPU expert lists, ``nodes`` equal nodes."""
    return Placement([gpus], E, Cluster(num_nodes=nodes, gpus_per_node=len(gpus) // nodes))


def _split(gpus: list[list[int]], counts: list[int], **params: object) -> list[float]:
    """The ``rebalance`` router's GPU loads for one batch of one layer of counts."""
    router = get_router("rebalance", params)
    return router.split_counts(_plan(gpus, len(counts)), np.array([[counts]]), RNG)[0, 0].tolist()


def _trace(ids: list[int], src: list[int], batch: list[int] | None = None, E: int = 2) -> RoutingTrace:
    """A one-layer top-1 trace."""
    T = len(ids)
    return RoutingTrace(np.array(ids).reshape(T, 1, 1), np.array(src), np.array(batch or [0] * T),
                        num_experts=E)


# ----------------------------------------------------------------------------------------------------------
# 1. hand-checked cases
# ----------------------------------------------------------------------------------------------------------


def test_a_one_move_fills_the_destination_to_floor_b() -> None:
    # Kernel. GPU 0 holds {0}, GPU 1 holds {0}. local = [3, 2], remote[0, 0] = 6. G = [9, 2],
    # B = 11 / 2 = 5.5.
    # g_s = 0 (9 > 5.5), e = 0 (6 remote), C = {1}, g_d = 1, cap = floor(5.5 - 2) = 3, move min(6, 3) = 3:
    #   G = [6, 5], remote[0, 0] = 3, remote[1, 0] = 3.
    # 6 > 5.5 still: g_s = 0, e = 0, g_d = 1, cap = floor(0.5) = 0 -> strict skips; levelling gives
    #   (6 - 5) // 2 = 0 -> nothing moves; stop. The destination sits at floor(B) = 5, never above B
    #   (a rounded cap of 4 would overshoot to [5, 6]).
    for strict in (False, True):
        loads, rem, moves = _kernel([3, 2], {(0, 0): 6}, [[0], [0]], strict=strict)
        assert (loads, rem[:, 0].tolist(), moves) == ([6, 5], [3, 3], 1)


def test_a_router_on_counts() -> None:
    # GPU 0 holds {0, 1}, GPU 1 holds {0}; counts [5, 4]; on counts every pick is remote.
    # Start: expert 0's 5 picks round-robin over copies (GPU 0, GPU 1): 3 + 2; expert 1 -> GPU 0.
    #   G = [3 + 4, 2] = [7, 2], B = 9 / 2 = 4.5.
    # g_s = 0; expert 1 has one copy (cannot move); e = 0 (3 remote), g_d = 1, cap = floor(2.5) = 2,
    #   move min(3, 2) = 2: G = [5, 4]. Then 5 > 4.5: cap = floor(0.5) = 0, levelling (5 - 4) // 2 = 0: stop.
    # (uniform's fractional split is [6.5, 2.5].)
    assert _split([[0, 1], [0]], [5, 4]) == [5.0, 4.0]
    assert _split([[0, 1], [0]], [5, 4], strict=True) == [5.0, 4.0]


def test_b_strict_tries_the_next_expert_and_the_default_levels() -> None:
    # Kernel. GPU 0 holds {0, 1}, GPU 1 holds {0}, GPU 2 holds {1}. local = [2, 6, 2],
    # remote[0, 0] = 5, remote[0, 1] = 3. G = [10, 6, 2], B = 18 / 3 = 6.
    # strict:
    #   g_s = 0; e = 0 (5, the hottest): g_d = 1 at 6 = B, cap = floor(0) = 0 -> skip;
    #   e = 1 (3): g_d = 2 at 2, cap = 4, move 3: G = [7, 6, 5], remote[0, 1] = 0, remote[2, 1] = 3.
    #   7 > 6: g_s = 0; e = 0: g_d = 1 at 6, cap 0 -> skip; no other source (6 is not > 6): stop.
    loads, rem, moves = _kernel([2, 6, 2], {(0, 0): 5, (0, 1): 3}, [[0, 1], [0], [1]], strict=True)
    assert (loads, moves) == ([7, 6, 5], 1)
    assert rem.tolist() == [[5, 0], [0, 0], [0, 3]]
    # default:
    #   g_s = 0; e = 0: g_d = 1, cap = 0 -> level: (10 - 6) // 2 = 2, move 2: G = [8, 8, 2],
    #     remote[0, 0] = 3, remote[1, 0] = 2.
    #   Sources 0 and 1 tie at 8 -> GPU 0 first; its experts tie at 3 -> expert 0 first: g_d = 1 at 8,
    #     cap = -2, level 0 -> skip; e = 1: g_d = 2 at 2, cap = 4, move 3: G = [5, 8, 5], remote[2, 1] = 3.
    #   g_s = 1 (8); e = 0 (2): g_d = 0 at 5, cap = floor(1) = 1, move 1: G = [6, 7, 5], remote[0, 0] = 4,
    #     remote[1, 0] = 1.
    #   g_s = 1 (7); e = 0: g_d = 0 at 6, cap 0, level (7 - 6) // 2 = 0 -> skip; GPU 0 (6) is no source: stop.
    loads, rem, moves = _kernel([2, 6, 2], {(0, 0): 5, (0, 1): 3}, [[0, 1], [0], [1]])
    assert (loads, moves) == ([6, 7, 5], 3)
    assert rem.tolist() == [[4, 0], [1, 0], [0, 3]]


def test_b_strict_gives_up_where_levelling_helps() -> None:
    # Kernel. GPU 0 holds {0}, GPU 1 {0}, GPU 2 {1}. local = [4, 6, 3], remote[0, 0] = 5:
    # G = [9, 6, 3], B = 6.
    # The only destination of GPU 0's picks (GPU 1) is at B, cap = 0:
    #   strict: skip -> nothing moves, [9, 6, 3].
    #   default: level (9 - 6) // 2 = 1: [8, 7, 3]; then g_s = 0: g_d = 1 at 7, level (8 - 7) // 2 = 0;
    #   g_s = 1 (7 > 6): its expert 0 (1 remote) can only go to GPU 0 at 8, level < 0: stop.
    assert _kernel([4, 6, 3], {(0, 0): 5}, [[0], [0], [1]], strict=True)[::2] == ([9, 6, 3], 0)
    assert _kernel([4, 6, 3], {(0, 0): 5}, [[0], [0], [1]])[::2] == ([8, 7, 3], 1)


def test_b_router_on_counts() -> None:
    # Strict skips the hottest expert and moves the next one. Experts: 0 on GPUs {0, 1}, 1 on {0, 2},
    # 2 on {0} only, 3 on {1} only; counts [9, 5, 2, 3].
    # Start: expert 0: 5 + 4 (GPU 0, GPU 1); expert 1: 3 + 2 (GPU 0, GPU 2); G = [5+3+2, 4+3, 2] = [10, 7, 2],
    #   B = 19 / 3 = 6.33.
    # strict: g_s = 0; e = 0 (5): g_d = 1 at 7, cap = floor(-0.67) = -1 -> skip; e = 1 (3): g_d = 2 at 2,
    #   cap = floor(4.33) = 4, move 3: [7, 7, 5]. Then sources 0 and 1 (7): expert 0 only, each other at 7,
    #   cap < 1 -> skip; stop.
    gpus = [[0, 1, 2], [0, 3], [1]]
    assert _split(gpus, [9, 5, 2, 3], strict=True) == [7.0, 7.0, 5.0]
    # Levelling where strict gives up: experts 0 on {0, 1}, 1 on {0}, 2 on {1}, 3 on {2}; counts [8, 5, 2, 3].
    # Start: expert 0: 4 + 4; G = [4 + 5, 4 + 2, 3] = [9, 6, 3], B = 6. g_d = 1 sits at B:
    #   strict: nothing moves; default: level (9 - 6) // 2 = 1: [8, 7, 3], then (8 - 7) // 2 = 0: stop.
    gpus = [[0, 1], [0, 2], [3]]
    assert _split(gpus, [8, 5, 2, 3], strict=True) == [9.0, 6.0, 3.0]
    assert _split(gpus, [8, 5, 2, 3]) == [8.0, 7.0, 3.0]


def test_c_restart_at_the_new_busiest_gpu() -> None:
    # Kernel. GPU 0 holds {0, 2}, GPU 1 {1}, GPU 2 {1, 2}, GPU 3 {0}.
    # local = [3, 5, 3, 3]; remote[0, 0] = 4, remote[0, 2] = 3, remote[1, 1] = 4.
    # G = [10, 9, 3, 3], B = 25 / 4 = 6.25.
    # 1. g_s = 0; e = 0 (4 > 3): g_d = 3 at 3, cap = floor(3.25) = 3, move 3: G = [7, 9, 3, 6],
    #    remote[0, 0] = 1, remote[3, 0] = 3. GPU 1 is now the busiest.
    # 2. restart: g_s = 1 (9); e = 1 (4): g_d = 2 at 3, cap = 3, move 3: G = [7, 6, 6, 6], remote[2, 1] = 3.
    # 3. g_s = 0 (7): e = 2 (3): g_d = 2 at 6, cap = 0; e = 0 (1): g_d = 3 at 6, cap = 0 (levelling: 0 too):
    #    stop at [7, 6, 6, 6].
    # Moving on with GPU 0's next expert instead (no restart) would send expert 2 to GPU 2 first
    # ([4, 9, 6, 6]) and leave GPU 1 stuck at 9.
    for strict in (False, True):
        loads, rem, moves = _kernel([3, 5, 3, 3], {(0, 0): 4, (0, 2): 3, (1, 1): 4},
                                    [[0, 2], [1], [1, 2], [0]], strict=strict)
        assert (loads, moves) == ([7, 6, 6, 6], 2)
        assert rem.tolist() == [[1, 0, 3], [0, 1, 0], [0, 3, 0], [3, 0, 0]]


def test_c_restart_when_the_source_stays_the_busiest() -> None:
    # Kernel. GPUs hold 0: {0, 2}, 1: {1}, 2: {1, 2}, 3: {0}. local = [4, 5, 3, 5];
    # remote[0, 0] = 4, remote[0, 2] = 3, remote[1, 1] = 3. G = [11, 8, 3, 5], B = 27 / 4 = 6.75.
    # strict:
    #   1. g_s = 0; e = 0 (4): g_d = 3 at 5, cap = floor(1.75) = 1, move 1: G = [10, 8, 3, 6]. GPU 0 is
    #      still the busiest.
    #   2. restart at GPU 0 (not at GPU 1, the next source of the old order, as the printed `break` would):
    #      experts tie at 3 -> expert 0: g_d = 3 at 6, cap = 0, skip; e = 2: g_d = 2 at 3, cap = 3, move 3:
    #      G = [7, 8, 6, 6].
    #   3. g_s = 1 (8): e = 1 (3): g_d = 2 at 6, cap = 0; g_s = 0 (7): e = 0 (3): g_d = 3 at 6, cap 0: stop.
    #   Final [7, 8, 6, 6]. (Going on to GPU 1 after move 1 would fill GPU 2 with expert 1 and leave GPU 0
    #   stuck at 10.)
    args = ([4, 5, 3, 5], {(0, 0): 4, (0, 2): 3, (1, 1): 3}, [[0, 2], [1], [1, 2], [0]])
    loads, rem, moves = _kernel(*args, strict=True)
    assert (loads, moves) == ([7, 8, 6, 6], 2)
    assert rem.tolist() == [[3, 0, 0], [0, 3, 0], [0, 0, 3], [1, 0, 0]]
    # default:
    #   1. as above: [10, 8, 3, 6].
    #   2. g_s = 0; e = 0 (3): g_d = 3 at 6, cap 0 -> level (10 - 6) // 2 = 2, move 2: [8, 8, 3, 8],
    #      remote[0, 0] = 1, remote[3, 0] = 3.
    #   3. GPUs 0, 1, 3 tie at 8 -> GPU 0; e = 2 (3): g_d = 2 at 3, cap = 3, move 3: [5, 8, 6, 8].
    #   4. GPUs 1 and 3 tie at 8 -> GPU 1; e = 1 (3): g_d = 2 at 6, cap 0, level 1: [5, 7, 7, 8],
    #      remote[1, 1] = 2, remote[2, 1] = 1.
    #   5. g_s = 3 (8); e = 0 (3): g_d = 0 at 5, cap = floor(1.75) = 1: [6, 7, 7, 7], remote[3, 0] = 2,
    #      remote[0, 0] = 2.
    #   6. GPUs 1, 2, 3 at 7 > 6.75: every candidate is at 6 or 7, cap 0 and levelling 0: stop.
    loads, rem, moves = _kernel(*args)
    assert (loads, moves) == ([6, 7, 7, 7], 5)
    assert rem.tolist() == [[2, 0, 0], [0, 2, 0], [0, 1, 3], [2, 0, 0]]


def test_c_router_on_counts() -> None:
    # After the first move another GPU is the busiest: experts 0 on GPUs {0, 1}, 1 on {1}, 2 and 3 on {0, 2};
    # counts [2, 4, 1, 1]. Start: expert 0: 1 + 1; expert 1 -> GPU 1; experts 2, 3 -> GPU 0 (first copy).
    #   G = [3, 5, 0], B = 8 / 3 = 2.67.
    # strict: g_s = 1 (5): its only movable expert 0 (1): g_d = 0 at 3, cap = -1, skip.
    #   g_s = 0 (3): experts 0, 2, 3 tie at 1 -> expert 0: g_d = 1 at 5, skip; expert 2: g_d = 2 at 0,
    #   cap = 2, move 1: [2, 5, 1].
    #   Restart at GPU 1 (5), not at GPU 0's next expert: expert 0: g_d = 0 at 2, cap = floor(0.67) = 0, skip;
    #   GPU 0 (2) is no source: stop at [2, 5, 1]. (Moving expert 3 too before restarting would end at
    #   [2, 4, 2]: the paper's restart order is not always the better one.)
    gpus = [[0, 2, 3], [0, 1], [2, 3]]
    assert _split(gpus, [2, 4, 1, 1], strict=True) == [2.0, 5.0, 1.0]
    # default: g_s = 1: expert 0: level (5 - 3) // 2 = 1: [4, 4, 0]. GPUs 0 and 1 tie at 4 -> GPU 0:
    #   expert 0 (2): g_d = 1 at 4, skip; expert 2 (1): g_d = 2, cap 2, move 1: [3, 4, 1].
    #   GPU 1 (4): no remote picks of a movable expert left; GPU 0 (3): expert 0: g_d = 1 at 4, skip;
    #   expert 3 (1): g_d = 2 at 1, cap = floor(1.67) = 1, move 1: [2, 4, 2]; then nothing moves.
    assert _split(gpus, [2, 4, 1, 1]) == [2.0, 4.0, 2.0]


def test_c_router_restarts_at_the_tied_source_with_the_lower_id() -> None:
    # Experts 0 and 1 on GPUs {0, 2}, 2 on {0, 1}, 3 on {1, 2}; counts [1, 1, 4, 1].
    # Start: experts 0, 1 -> GPU 0 (first copy); expert 2: 2 + 2 on GPUs 0, 1; expert 3 -> GPU 1.
    #   G = [4, 3, 0], B = 7 / 3 = 2.33.
    # 1. g_s = 0; e = 2 (2): g_d = 1 at 3, cap = -1, level 0, skip; e = 0 (1, ties with 1 -> lower id):
    #    g_d = 2 at 0, cap = 2, move 1: [3, 3, 1].
    # 2. restart: GPUs 0 and 1 tie at 3 -> GPU 0; e = 2: g_d = 1 at 3, skip; e = 1 (1): g_d = 2 at 1,
    #    cap = floor(1.33) = 1, move 1: [2, 3, 2].
    # 3. g_s = 1 (3): expert 2 (2): g_d = 0 at 2, cap = 0, level 0; expert 3 (1): g_d = 2 at 2, same: stop.
    # Continuing with GPU 1 after move 1 (the printed `break`) would give [3, 2, 2] instead.
    gpus = [[0, 1, 2], [2, 3], [0, 1, 3]]
    for strict in (False, True):
        assert _split(gpus, [1, 1, 4, 1], strict=strict) == [2.0, 3.0, 2.0]


def test_d_eps_stops_early() -> None:
    # The restart case above (B = 6.25, start max 10): eps = 0.5 stops once max <= 9.375, i.e. after move 1
    # ([7, 9, 3, 6]); eps = 0.2 (7.5) runs to [7, 6, 6, 6] as eps = 0 does.
    args = ([3, 5, 3, 3], {(0, 0): 4, (0, 2): 3, (1, 1): 4}, [[0, 2], [1], [1, 2], [0]])
    assert _kernel(*args, eps=0.5, strict=True)[::2] == ([7, 9, 3, 6], 1)
    assert _kernel(*args, eps=0.2, strict=True)[::2] == ([7, 6, 6, 6], 2)
    # The stopping test is max <= (1 + eps) B: with B = 8 and eps = 0.25 a max of exactly 10 is done.
    assert _kernel([4, 6], {(0, 0): 6}, [[0], [0]], eps=0.25)[::2] == ([10, 6], 0)
    assert _kernel([4, 6], {(0, 0): 6}, [[0], [0]], eps=0.2)[::2] == ([8, 8], 1)  # cap = floor(8 - 6) = 2


def test_d_router_eps() -> None:
    # Counts [5, 4] on GPU 0 {0, 1}, GPU 1 {0}: start [7, 2], B = 4.5 (see test_a_router_on_counts).
    # eps = 0.6: 7 <= 7.2, nothing moves; eps = 0.5: 7 > 6.75, one move to [5, 4].
    assert _split([[0, 1], [0]], [5, 4], eps=0.6) == [7.0, 2.0]
    assert _split([[0, 1], [0]], [5, 4], eps=0.5) == [5.0, 4.0]
    # Counts [6, 2]: start [3 + 2, 3] = [5, 3], B = 4; (1 + 0.25) * 4 = 5 exactly: done; eps = 0.2: [4, 4].
    assert _split([[0, 1], [0]], [6, 2], eps=0.25) == [5.0, 3.0]
    assert _split([[0, 1], [0]], [6, 2], eps=0.2) == [4.0, 4.0]


def test_start_state_is_uniform_round_robin_per_copy() -> None:
    # eps large enough that nothing moves shows the start state.
    # Expert 0 on GPUs 0, 1, 2: 5 picks -> 2, 2, 1 (the lower copies take the remainder); 4 -> 2, 1, 1.
    # B = 5 / 3, (1 + 0.9) B = 3.17 >= 2: no move.
    assert _split([[0], [0], [0]], [5], eps=0.9) == [2.0, 2.0, 1.0]
    assert _split([[0], [0], [0]], [4], eps=0.9) == [2.0, 1.0, 1.0]
    # Two copies on GPU 0, one on GPU 1 (expert 1 pads GPU 0): 7 picks -> copies 3, 2, 2 -> GPU 0 takes two
    # shares: [5, 2]; B = 3.5, (1 + 0.5) B = 5.25 >= 5: no move. With eps 0: cap = floor(1.5) = 1: [4, 3].
    two = [[0, 0, 1], [0]]
    assert _split(two, [7, 0], eps=0.5) == [5.0, 2.0]
    assert _split(two, [7, 0]) == [4.0, 3.0]


def test_e_local_picks_are_pinned() -> None:
    # 1 node x 2 GPUs; GPU 0 holds {0}, GPU 1 holds {0, 1}. Six tokens on GPU 0 pick expert 0 and two on
    # GPU 1 pick expert 1: every pick has a copy on its own GPU, so all are local and none may move.
    # G = [6, 2], B = 4; GPU 0 is the busiest but has no remote pick: nothing moves.
    plan = _plan([[0], [0, 1]], 2)
    tr = _trace([0] * 6 + [1] * 2, [0] * 6 + [1] * 2)
    for params in ({}, {"strict": True}):
        dest = get_router("rebalance", params).assign_tokens(plan, tr, RNG)
        assert dest[:, 0, 0].tolist() == [0] * 6 + [1] * 2
    score = evaluate(plan, LoadMatrix(tr.counts(), tr), "rebalance", routing_gap=False)
    assert score.balancedness == pytest.approx(4 / 6)
    # The same counts without source GPUs are all remote: expert 0 starts 3 + 3, expert 1 -> GPU 1:
    # [3, 5], B = 4; g_s = 1, expert 0 (3): g_d = 0 at 3, cap = 1: [4, 4].
    assert ROUTERS["rebalance"].split_counts(plan, tr.counts(), RNG)[0, 0].tolist() == [4.0, 4.0]


def test_e_local_picks_stay_while_remote_ones_move() -> None:
    # 1 node x 3 GPUs; GPU 0 {0, 1}, GPU 1 {0}, GPU 2 {2}. Tokens 0-2 on GPU 0 pick expert 1 (local),
    # tokens 3-8 on GPU 2 pick expert 0 (remote: GPU 2 holds no copy).
    # local = [3, 0, 0]; expert 0's 6 remote picks start 3 + 3: G = [6, 3, 0], B = 3.
    # g_s = 0; expert 1 has one copy; expert 0 (3): g_d = 1 at 3 = B, cap 0 -> strict: stop at [6, 3, 0];
    #   default: level (6 - 3) // 2 = 1: [5, 4, 0], remote = [2, 4]; then GPU 0: g_d = 1 at 4, level 0;
    #   GPU 1 (4): expert 0 (4) -> g_d = 0 at 5, level < 0: stop.
    # Hand-out in token order (one node): GPU 0's share first: tokens 3, 4 -> GPU 0, the rest -> GPU 1.
    plan = _plan([[0, 1], [0], [2]], 3)
    tr = _trace([1] * 3 + [0] * 6, [0] * 3 + [2] * 6, E=3)
    dest = ROUTERS["rebalance"].assign_tokens(plan, tr, RNG)[:, 0, 0].tolist()
    assert dest == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    dest = get_router("rebalance", {"strict": True}).assign_tokens(plan, tr, RNG)[:, 0, 0].tolist()
    assert dest == [0, 0, 0, 0, 0, 0, 1, 1, 1]


def test_f_hand_out_prefers_the_same_node_copy() -> None:
    # 2 nodes x 2 GPUs; expert 0 on GPU 1 (node 0) and GPU 2 (node 1); expert 1 on GPUs 0 and 3.
    # Batch 0: tokens 0, 1, 2 on GPU 3 (node 1) and token 3 on GPU 0 (node 0) pick expert 0 (all remote).
    #   Start 2 + 2 on GPUs 1, 2: G = [0, 2, 2, 0], B = 1. GPU 1: g_d = 2 at 2, cap = -1, level 0; GPU 2
    #   likewise: nothing moves; shares GPU 1: 2, GPU 2: 2.
    #   Hand-out, same node first in token order: token 0 -> GPU 2, token 1 -> GPU 2 (node 1's share is
    #   used up), token 2 waits, token 3 -> GPU 1; then the rest: token 2 -> GPU 1.
    #   (uniform's round-robin would give 1, 2, 1, 2: three inter-node sends instead of one.)
    # Batch 1 (rebalanced on its own): tokens 4, 5 on GPU 0, token 6 on GPU 3: start GPU 1: 2, GPU 2: 1;
    #   G = [0, 2, 1, 0], B = 0.75; GPU 1: g_d = 2 at 1, cap = -1, level 0; GPU 2 (1): g_d = 1 at 2: stop.
    #   Tokens 4, 5 -> GPU 1 (node 0), token 6 -> GPU 2 (node 1).
    plan = _plan([[1], [0], [0], [1]], 2, nodes=2)
    tr = _trace([0] * 7, [3, 3, 3, 0, 0, 0, 3], [0, 0, 0, 0, 1, 1, 1])
    for params in ({}, {"strict": True}):
        dest = get_router("rebalance", params).assign_tokens(plan, tr, RNG)[:, 0, 0].tolist()
        assert dest == [2, 2, 1, 1, 1, 1, 2]
    score = evaluate(plan, LoadMatrix(tr.counts(), tr), "rebalance", routing_gap=False)
    assert score.traffic is not None and score.traffic.inter_node == 1


# ----------------------------------------------------------------------------------------------------------
# 2. properties
# ----------------------------------------------------------------------------------------------------------


@st.composite
def kernel_cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, bool]:
    """``(local [G], remote [G, E], has [E, G], eps, strict)``: remote picks only where a copy is."""
    G, E = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    has = np.zeros((E, G), dtype=bool)
    for e in range(E):
        has[e, rng.choice(G, size=int(rng.integers(1, G + 1)), replace=False)] = True
    local = rng.integers(0, draw(st.integers(1, 12)), size=G)
    remote = rng.integers(0, draw(st.integers(1, 12)), size=(G, E)) * has.T
    return local, remote, has, draw(st.sampled_from([0.0, 0.05, 0.3])), draw(st.booleans())


@settings(max_examples=150)  # cheap: more cases than the profile's default
@given(case=kernel_cases())
def test_kernel_properties(case: tuple[np.ndarray, np.ndarray, np.ndarray, float, bool]) -> None:
    local, remote, has, eps, strict = case
    G = remote.shape[0]
    B = (local.sum() + remote.sum()) / G
    hstart, hosts = host_lists(has)
    gstart, gexp = gpu_lists(hstart, hosts, G)
    out = remote.astype(np.int64)  # the kernel moves picks in place
    loads, moves = rebalance(local.astype(np.int64), out, hstart, hosts, gstart, gexp, B, eps, strict)
    # conservation: every expert keeps its remote picks; picks only on GPUs holding the expert;
    # loads are local + remote; the local picks were not touched
    assert np.array_equal(out.sum(axis=0), remote.sum(axis=0))
    assert np.all(out >= 0) and np.all(out[~has.T] == 0)
    assert np.array_equal(loads, local + out.sum(axis=1))
    # never worse than where it started
    assert loads.max() <= (local + remote.sum(axis=1)).max()
    # it stops only when balanced within eps or when no move is allowed
    if loads.max() > (1 + eps) * B:
        assert _blocked(loads, out, has, B, strict) == []
    # the same moves, in the same order, as the direct reading of Alg. 2
    ref_loads, ref_remote, ref_moves = _alg2(local, remote, has, B, eps, strict)
    assert loads.tolist() == ref_loads.tolist()
    assert out.tolist() == ref_remote.tolist()
    assert moves == ref_moves


def test_neither_mode_always_ends_lower() -> None:
    # Why no property compares the two modes: levelling changes the greedy's path, and either can end higher.
    # Levelling better: experts 0 on GPUs {0, 2}, 1 on {1, 2}; local = [3, 3, 1], remote[0, 0] = 2,
    # remote[1, 1] = 2. G = [5, 5, 1], B = 11 / 3 = 3.67.
    #   Both: g_s = 0 (ties with 1, lower id), e = 0: g_d = 2 at 1, cap = floor(2.67) = 2, move 2: [3, 5, 3].
    #   g_s = 1, e = 1: g_d = 2 at 3, cap = floor(0.67) = 0: strict stops at [3, 5, 3]; the default levels
    #   (5 - 3) // 2 = 1: [3, 4, 4], then every cap and levelling is 0: stop.
    args = ([3, 3, 1], {(0, 0): 2, (1, 1): 2}, [[0], [1], [0, 1]])
    assert _kernel(*args, strict=True)[::2] == ([3, 5, 3], 1)
    assert _kernel(*args)[::2] == ([3, 4, 4], 2)
    # Strict better: experts 0 on GPUs {1, 2}, 1 on {0, 1}, 2 on {0, 1, 2}; local = [4, 0, 1];
    # remote: GPU 0: expert 1: 1; GPU 1: experts 0: 2, 1: 5, 2: 1; GPU 2: expert 2: 1. G = [5, 8, 2], B = 5.
    #   strict: g_s = 1; e = 1 (5): g_d = 0 at 5 = B, skip; e = 0 (2): g_d = 2 at 2, cap = 3, move 2:
    #     [5, 6, 4]; g_s = 1; e = 1 skip; e = 2 (1): candidates GPU 0 (5), GPU 2 (4) -> g_d = 2, cap = 1,
    #     move 1: [5, 5, 5].
    #   default: g_s = 1; e = 1: g_d = 0 at 5, level (8 - 5) // 2 = 1: [6, 7, 2] (GPU 0 now holds 2 of
    #     expert 1's picks, which can only go back to GPU 1); g_s = 1 (7); e = 1 (4): g_d = 0 at 6, level 0;
    #     e = 0 (2): g_d = 2, cap = 3, move 2: [6, 5, 4]; g_s = 0 (6): expert 1 (2) -> GPU 1 at 5: cap 0,
    #     level 0: stop with max 6.
    args = ([4, 0, 1], {(0, 1): 1, (1, 0): 2, (1, 1): 5, (1, 2): 1, (2, 2): 1}, [[1, 2], [0, 1, 2], [0, 2]])
    assert _kernel(*args, strict=True)[::2] == ([5, 5, 5], 2)
    assert _kernel(*args)[::2] == ([6, 5, 4], 2)


@st.composite
def token_cases(draw: st.DrawFn) -> tuple[Placement, RoutingTrace, float, bool]:
    """A small random plan and top-k trace (several batches, maybe empty ones) on the same GPUs."""
    nodes, gpn = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    G = nodes * gpn
    E, L = draw(st.integers(1, 6)), draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    plan = Placement(random_replica_layers(rng, L, E, G), E, Cluster(num_nodes=nodes, gpus_per_node=gpn))
    T, K = draw(st.integers(1, 40)), draw(st.integers(1, min(3, E)))
    topk = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)])
    batch = np.sort(rng.integers(0, 3, T))
    trace = RoutingTrace(topk, rng.integers(0, G, T), batch, num_experts=E, num_batches=3)
    return plan, trace, draw(st.sampled_from([0.0, 0.1])), draw(st.booleans())


def _check_token_routing(plan: Placement, trace: RoutingTrace, dest: np.ndarray, kept: np.ndarray, eps: float,
                         strict: bool) -> None:
    """Every property of one token-level answer (``kept`` picks only), batch by batch and layer by layer."""
    G, gpn = plan.num_gpus, plan.cluster.gpus_per_node
    assert np.all(dest[~kept] == -1)
    for layer in range(plan.num_layers):
        copies = plan.copies[layer]
        has = copies > 0  # [E, G]
        check_routes(dest[:, layer], trace.topk_ids[:, layer], copies, "rebalance", kept[:, layer])
        for b in range(trace.num_batches):
            rows = trace.batch == b
            keep = kept[rows, layer]
            ids = trace.topk_ids[rows, layer][keep]
            src = np.broadcast_to(trace.src_gpu[rows, None], keep.shape)[keep]
            got = dest[rows, layer][keep]
            if ids.size == 0:
                continue
            is_local = copies[ids, src] > 0
            assert np.array_equal(got[is_local], src[is_local])  # local picks stay on their GPU
            loads = np.bincount(got, minlength=G)
            assert loads.sum() == ids.size  # every kept pick served once
            local, remote = _start(ids, src, copies)
            assert loads.max() <= (local + remote.sum(axis=1)).max()  # never worse than the start
            final = np.zeros((G, copies.shape[0]), dtype=np.int64)
            np.add.at(final, (got[~is_local], ids[~is_local]), 1)
            B = ids.size / G
            if loads.max() > (1 + eps) * B:
                assert _blocked(loads, final, has, B, strict) == []
            ref_loads, ref_remote, _ = _alg2(local, remote, has, B, eps, strict)
            assert loads.tolist() == ref_loads.tolist() and final.tolist() == ref_remote.tolist()
            # hand-out: for each expert and node, the node's remote tokens (in token order) take the node's
            # shares first: the first min(tokens, shares) stay on the node, and only those
            for e in np.unique(ids[~is_local]):
                mine = ~is_local & (ids == e)
                for node in range(G // gpn):
                    from_node = mine & (src // gpn == node)
                    shares = int(np.sum(mine & (got // gpn == node)))
                    on_node = (got[from_node] // gpn == node).tolist()
                    n_on = min(int(from_node.sum()), shares)
                    assert on_node == [True] * n_on + [False] * (len(on_node) - n_on)


@settings(max_examples=150)  # cheap: more cases than the profile's default
@given(case=token_cases())
def test_token_properties(case: tuple[Placement, RoutingTrace, float, bool]) -> None:
    plan, trace, eps, strict = case
    router = get_router("rebalance", {"eps": eps, "strict": strict})
    dest = router.assign_tokens(plan, trace, RNG)
    everything = np.ones(trace.topk_ids.shape, dtype=bool)
    _check_token_routing(plan, trace, dest, everything, eps, strict)
    assert np.array_equal(router.assign_kept(plan, trace, everything, RNG), dest)  # type: ignore[misc]


@settings(max_examples=150)  # cheap: more cases than the profile's default
@given(case=token_cases(), seed=st.integers(0, 2**31))
def test_kept_properties(case: tuple[Placement, RoutingTrace, float, bool], seed: int) -> None:
    plan, trace, eps, strict = case
    kept = np.random.default_rng(seed).random(trace.topk_ids.shape) < 0.7
    router = get_router("rebalance", {"eps": eps, "strict": strict})
    assert router.assign_kept is not None
    _check_token_routing(plan, trace, router.assign_kept(plan, trace, kept, RNG), kept, eps, strict)


@settings(max_examples=150)  # cheap: more cases than the profile's default
@given(case=token_cases(), seed=st.integers(0, 2**31))
def test_dropping_a_token_equals_leaving_it_out(case: tuple[Placement, RoutingTrace, float, bool],
                                               seed: int) -> None:
    # Top-1 and one layer: dropping a pick is the same as a trace without that token, so the kept picks
    # must be routed exactly as the shorter trace's picks are (the dropped ones count nowhere).
    plan, trace, eps, strict = case
    one = Placement([plan.gpu_experts[0]], plan.num_experts, plan.cluster)
    top1 = RoutingTrace(trace.topk_ids[:, :1, :1], trace.src_gpu, trace.batch, num_experts=trace.num_experts,
                        num_batches=trace.num_batches)
    keep = np.random.default_rng(seed).random(top1.num_tokens) < 0.6
    router = get_router("rebalance", {"eps": eps, "strict": strict})
    assert router.assign_kept is not None
    kept = np.broadcast_to(keep[:, None, None], top1.topk_ids.shape).copy()
    dest = router.assign_kept(one, top1, kept, RNG)
    shorter = RoutingTrace(top1.topk_ids[keep], top1.src_gpu[keep], top1.batch[keep],
                           num_experts=top1.num_experts, num_batches=top1.num_batches)
    assert dest[~keep].ravel().tolist() == [-1] * int((~keep).sum())
    if keep.any():
        assert np.array_equal(dest[keep], router.assign_tokens(one, shorter, RNG))


@settings(max_examples=150)  # cheap: more cases than the profile's default
@given(case=token_cases(), seed=st.integers(0, 2**31))
def test_count_properties(case: tuple[Placement, RoutingTrace, float, bool], seed: int) -> None:
    plan, _, eps, strict = case
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 15, size=(3, plan.num_layers, plan.num_experts)) * (rng.random((3, 1, 1)) < 0.8)
    loads = get_router("rebalance", {"eps": eps, "strict": strict}).split_counts(plan, counts, RNG)
    assert loads.shape == (3, plan.num_layers, plan.num_gpus)
    assert np.array_equal(loads, np.round(loads))  # whole tokens
    assert np.array_equal(loads.sum(axis=2), counts.sum(axis=2))  # conservation
    hosted = np.einsum("ble,leg->blg", counts, plan.copies) > 0
    assert np.all(loads[~hosted] == 0)  # only GPUs holding an expert with picks serve any
    G = plan.num_gpus
    for b in range(3):
        for layer in range(plan.num_layers):
            ids = np.repeat(np.arange(plan.num_experts), counts[b, layer])
            if ids.size == 0:
                assert loads[b, layer].tolist() == [0.0] * G
                continue
            local, remote = _start(ids, np.full(ids.size, -1), plan.copies[layer])  # no source: all remote
            assert local.sum() == 0 and loads[b, layer].max() <= remote.sum(axis=1).max()
            want, _, _ = _alg2(local, remote, plan.copies[layer] > 0, ids.size / G, eps, strict)
            assert loads[b, layer].tolist() == want.tolist()


# ----------------------------------------------------------------------------------------------------------
# 3. acceptance on the bundled traces
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "nodes", "gpus_per_node", "slots", "params"), [
    ("deepseek-v3-8x8", 8, 8, 5, {}),
    ("deepseek-v3-8x8", 8, 8, 5, {"num_groups": 1}),
    ("olmoe-1b-7b-tokens", 2, 4, 9, {"num_groups": 1}),
    ("qwen3-30b-a3b-tokens", 2, 4, 18, {"num_groups": 1}),
    ("mixtral-8x7b-tokens", 1, 8, 2, {"num_groups": 1}),
])
def test_bundled_traces_balance_close_to_minmax(name: str, nodes: int, gpus_per_node: int, slots: int,
                                                params: dict[str, int]) -> None:
    # EPLB plans from the first half, scored on the held-out half (all of its batches: about 1 s per trace).
    # The greedy must beat the static equal split and come within 3% of the optimal min-max split.
    train, test = read_load(f"bundled:{name}").split(0.5)
    plan = make_plan("eplb", train, Cluster(num_nodes=nodes, gpus_per_node=gpus_per_node),
                     Budget(slots_per_gpu=slots), **params)[0]
    bal = {r: evaluate(plan, test, ROUTERS[r], routing_gap=False).balancedness
           for r in ("uniform", "rebalance", "minmax")}
    assert bal["rebalance"] >= bal["uniform"], bal
    assert bal["rebalance"] >= 0.97 * bal["minmax"], bal


# ----------------------------------------------------------------------------------------------------------
# 4. kept mask, by hand
# ----------------------------------------------------------------------------------------------------------


def test_dropped_picks_get_minus_one_and_do_not_count() -> None:
    # 1 node x 3 GPUs; GPU 0 {0, 1}, GPU 1 {0}, GPU 2 {2}. Tokens 0-2 on GPU 0 pick expert 1 (local);
    # tokens 3-6 on GPU 2 pick expert 0 (remote).
    plan = _plan([[0, 1], [0], [2]], 3)
    tr = _trace([1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 2, 2, 2, 2], E=3)
    router = ROUTERS["rebalance"]
    assert router.assign_kept is not None

    def route(kept: list[bool]) -> list[int]:
        mask = np.array(kept).reshape(-1, 1, 1)
        return router.assign_kept(plan, tr, mask, RNG)[:, 0, 0].tolist()  # type: ignore[misc]

    # All kept: local [3, 0, 0], expert 0: 2 + 2 -> G = [5, 2, 0], B = 7 / 3 = 2.33.
    #   g_s = 0, expert 0 (2): g_d = 1 at 2, cap = floor(0.33) = 0 -> level (5 - 2) // 2 = 1: [4, 3, 0].
    #   GPU 0: expert 0 (1): g_d = 1 at 3, level 0; GPU 1 (3): expert 0 -> GPU 0 at 4, no: stop.
    #   Shares GPU 0: 1, GPU 1: 3 -> token 3 -> GPU 0, tokens 4-6 -> GPU 1.
    assert route([True] * 7) == [0, 0, 0, 0, 1, 1, 1]
    # Tokens 0 and 1 dropped: local [1, 0, 0], G = [3, 2, 0], B = 5 / 3 = 1.67.
    #   g_s = 0, expert 0: g_d = 1 at 2, cap = -1, level (3 - 2) // 2 = 0; GPU 1: g_d = 0 at 3: stop.
    #   Shares 2 + 2: tokens 3, 4 -> GPU 0, tokens 5, 6 -> GPU 1. (Counting the dropped picks would move
    #   one more pick to GPU 1, as in the all-kept case.)
    assert route([False, False, True, True, True, True, True]) == [-1, -1, 0, 0, 0, 1, 1]
    # Token 3 dropped: local [3, 0, 0], expert 0's 3 remote picks start 2 + 1: G = [5, 1, 0], B = 2.
    #   g_s = 0, expert 0 (2): g_d = 1 at 1, cap = 1: [4, 2, 0]; again: g_d = 1 at 2, cap 0, level
    #   (4 - 2) // 2 = 1, min(1, 1): [3, 3, 0], GPU 0's share 0; then nothing moves (3 vs 3).
    #   Tokens 4-6 -> GPU 1.
    assert route([True, True, True, False, True, True, True]) == [0, 0, 0, -1, 1, 1, 1]
    # Nothing kept: everything -1.
    assert route([False] * 7) == [-1] * 7


# ----------------------------------------------------------------------------------------------------------
# 5. options
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "message"), [
    ({"eps": 1}, "rebalance option eps (1) must be a number in [0, 1), the tolerance over the mean GPU load"),
    ({"eps": 1.5}, "rebalance option eps (1.5) must be a number in [0, 1)"),
    ({"eps": -0.1}, "rebalance option eps (-0.1) must be a number in [0, 1)"),
    ({"eps": float("nan")}, "rebalance option eps (nan) must be a number in [0, 1)"),
    ({"eps": float("inf")}, "rebalance option eps (inf) must be a number in [0, 1)"),
    ({"eps": True}, "rebalance option eps (True) must be a number in [0, 1)"),
    ({"eps": "0.1"}, "rebalance option eps ('0.1') must be a number in [0, 1)"),
    ({"eps": None}, "rebalance option eps (None) must be a number in [0, 1)"),
    ({"strict": "yes"}, "rebalance option strict ('yes') must be true or false"),
    ({"strict": 1}, "rebalance option strict (1) must be true or false"),
    ({"tol": 0.1}, "router 'rebalance' has no option 'tol'; its options: eps, strict"),
])
def test_rebalance_option_errors(params: dict[str, object], message: str) -> None:
    with pytest.raises(InputError) as err:
        get_router("rebalance", params)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_options_of_routers_without_options() -> None:
    with pytest.raises(InputError) as err:
        get_router("uniform", {"eps": 1})
    assert "router 'uniform' takes no options; eps given" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(InputError, match="unknown router 'rebalancer'; choose one of: "):
        get_router("rebalancer", {"eps": 0.1})


def test_option_values_labels_and_params() -> None:
    default = ROUTERS["rebalance"]
    assert default.label == "rebalance" and default.params == {"eps": 0.0, "strict": False}
    r = get_router("rebalance", {"eps": 0.02})
    assert r.name == "rebalance" and r.label == "rebalance(eps=0.02)"
    assert r.params == {"eps": 0.02, "strict": False}
    both = r.with_params(strict=True)  # keeps eps
    assert both.params == {"eps": 0.02, "strict": True} and both.label == "rebalance(eps=0.02, strict=True)"
    assert get_router("rebalance", {"strict": True}).label == "rebalance(strict=True)"
    assert get_router("rebalance", {"eps": 0}).params["eps"] == 0.0  # an int is taken, as a float
    assert get_router("rebalance", {"eps": 0}).label == "rebalance"
    assert get_router("rebalance", {"eps": np.float32(0.5)}).params == {"eps": 0.5, "strict": False}
    assert get_router("rebalance", {"strict": np.bool_(True)}).params["strict"] is True
    # the options reach the score
    plan = _plan([[0, 1], [0]], 2)
    score = evaluate(plan, LoadMatrix(np.array([[[5, 4]]])), r, routing_gap=False)
    assert score.router == "rebalance" and score.router_params == {"eps": 0.02, "strict": False}
