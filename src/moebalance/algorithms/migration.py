"""Migration-aware re-planning: a fresh plan laid onto the GPUs so that the fewest expert copies move.

Legend: ``L`` layers, ``E`` logical experts per layer, ``G`` GPUs, ``N`` nodes of ``n`` GPUs, ``M`` the most
copies one GPU may receive in one re-plan.

A planner returns GPU ``j``'s expert set without caring which GPU gets it; a re-plan that keeps the old plan's
experts where they are moves fewer weights for the same balance. Moving weights is what stalls serving (the
rearrangement step of EPLB-style systems), and DeepSeek EPLB's maintainers suggest solving an assignment problem
for it.

- :func:`align` relabels the fresh plan's GPUs, per layer: GPU ``i`` takes fresh set ``sigma(i)``, the
  permutation that keeps the most experts in place, an exact assignment (``scipy.optimize.linear_sum_assignment``
  on the ``[G, G]`` matrix of experts GPU ``i`` holds and set ``j`` lists). Only sets of the same size are
  exchanged, so each GPU's slots per layer (and CRAFT's per-GPU totals) are the fresh plan's. Ties go to the
  relabelling that keeps the most experts in their previous slot. Within a GPU, a kept expert takes its previous
  slot where the new slot count reaches it, the others fill the free slots in the fresh plan's order, so an
  engine's slot-indexed export rewrites nothing that stays. ``keep_nodes=True`` (policies whose plan is laid out
  per node, such as hierarchical EPLB) permutes whole nodes and GPUs inside a node only, an exact two-level
  assignment: the best in-node assignment for every (old node, fresh node) pair, then the best node assignment.
  It is a relabelling of GPUs, so every layer's balance under the load is the fresh plan's.
- :func:`bounded` moves towards ``align(previous, fresh)`` receiving at most ``M`` copies per GPU per re-plan,
  summed over layers. A move replaces, on one GPU and layer, a copy the target does not keep there by one it
  adds there (slot counts stay); moves are taken in order of the balance they buy under ``load`` (the largest
  drop of the layer's most loaded GPU, over the mean, then of the sum of squared loads; a load split evenly over
  an expert's GPUs), each costing one expert's bytes, until the budget or the moves run out. Every expert keeps a
  copy: a move that would take an expert's last copy waits for a move that adds it elsewhere, or is taken with it
  as a chain. Repeated re-plans reach the aligned fresh plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from moebalance.core.errors import InputError, PlanError
from moebalance.core.plan import Placement

__all__ = ["MIGRATIONS", "align", "align_rows", "bounded", "in_place_order", "keeps_node_blocks", "lay_onto"]

#: How a re-plan is laid onto the plan in service: as planned, :func:`align` or :func:`bounded`.
MIGRATIONS = ("fresh", "aligned", "bounded")

_BLOCKED = -1e15


def in_place_order(previous_row: Sequence[int], fresh_row: Sequence[int]) -> list[int]:
    """Indices into ``fresh_row`` in slot order: a kept expert at its slot in ``previous_row`` where it fits.

    ``in_place_order([4, 7, 9], [9, 1, 4]) == [2, 1, 0]``: expert 4 keeps slot 0 and 9 slot 2, 1 takes slot 1.
    """
    pool: dict[int, list[int]] = {}
    for k, e in enumerate(fresh_row):
        pool.setdefault(e, []).append(k)
    out: list[int | None] = [None] * len(fresh_row)
    for p, e in enumerate(previous_row[:len(fresh_row)]):
        if pool.get(e):
            out[p] = pool[e].pop(0)
    rest = iter(sorted(k for ks in pool.values() for k in ks))
    return [next(rest) if k is None else k for k in out]


def _has(rows: Sequence[Sequence[int]], num_experts: int) -> np.ndarray:
    """``int64 [E, G]``: 1 where GPU ``g``'s row holds expert ``e`` (an empty slot, ``-1``, holds nothing)."""
    has = np.zeros((num_experts, len(rows)), dtype=np.int64)
    for g, row in enumerate(rows):
        ids = np.asarray(row, dtype=np.int64)
        has[ids[ids >= 0], g] = 1
    return has


def _score_matrix(prev_row: Sequence[Sequence[int]], fresh_row: Sequence[Sequence[int]], num_experts: int,
                  allowed: np.ndarray) -> np.ndarray:
    """``float64 [G, G]``: experts kept if GPU ``i`` takes fresh set ``j``, ``* (E + 1)`` plus those kept in their
    slot; ``_BLOCKED`` where not ``allowed``. Empty slots (``-1``) in ``prev_row`` keep nothing."""
    E, G = num_experts, len(prev_row)
    fresh_has = _has(fresh_row, E)
    kept = _has(prev_row, E).T @ fresh_has  # [G, G]
    pos = np.full((G, E), np.iinfo(np.int64).max, dtype=np.int64)  # first slot of e on old GPU i
    for i, row in enumerate(prev_row):
        for p in range(len(row) - 1, -1, -1):
            if row[p] >= 0:
                pos[i, row[p]] = p
    sizes = np.array([len(r) for r in fresh_row], dtype=np.int64)
    in_slot = np.zeros((G, G), dtype=np.int64)
    for s in np.unique(sizes):
        cols = np.flatnonzero(sizes == s)
        in_slot[:, cols] = (pos < s).astype(np.int64) @ fresh_has[:, cols]
    return np.where(allowed, (kept * (E + 1) + in_slot).astype(np.float64), _BLOCKED)


def _assign(score: np.ndarray) -> tuple[np.ndarray, float]:
    from scipy.optimize import (
        linear_sum_assignment,  # imported on first use: a command's --help need not load it
    )

    rows, cols = linear_sum_assignment(score, maximize=True)
    return cols[np.argsort(rows)], float(score[rows, cols].sum())


def _assign_nodes(score: np.ndarray, nodes: int, per_node: int) -> tuple[np.ndarray, float]:
    """The best permutation that maps whole nodes onto nodes and GPUs within them (exact, two levels)."""
    blocks = score.reshape(nodes, per_node, nodes, per_node)
    value = np.empty((nodes, nodes))
    inner = np.empty((nodes, nodes, per_node), dtype=np.int64)
    for a in range(nodes):
        for b in range(nodes):
            inner[a, b], value[a, b] = _assign(blocks[a, :, b, :])
    outer, total = _assign(value)
    sigma = np.concatenate([outer[a] * per_node + inner[a, outer[a]] for a in range(nodes)])
    return sigma, total


def align_rows(previous_rows: Sequence[Sequence[int]], fresh_rows: Sequence[Sequence[int]], num_experts: int, *,
               node_blocks: tuple[int, int] | None = None,
               match_previous_slots: bool = False) -> list[tuple[int, list[int]]]:
    """One layer of :func:`align` on plain rows: per GPU ``i``, the fresh set ``j`` it takes and the indices into
    ``fresh_rows[j]`` in its slot order (:func:`in_place_order`), so GPU ``i``'s new row is
    ``[fresh_rows[j][k] for k in ks]``.

    ``previous_rows`` may hold empty slots (``-1``, as an engine marks slots it added): they keep nothing and may
    miss experts. ``node_blocks=(N, n)`` permutes whole nodes of ``n`` GPUs and GPUs within a node only;
    ``match_previous_slots`` exchanges a set only onto a GPU with as many previous slots (a :class:`PlanError`
    when the sizes cannot match). Example: ``align_rows([[0, 1], [2, 3]], [[3, 2], [1, 0]], 4) ==
    [(1, [1, 0]), (0, [1, 0])]``: GPU 0 takes fresh set 1 as ``[0, 1]``, GPU 1 set 0 as ``[2, 3]``.
    """
    fsize = np.array([len(r) for r in fresh_rows])
    rsize = np.array([len(r) for r in previous_rows]) if match_previous_slots else fsize
    allowed = rsize[:, None] == fsize[None, :]
    score = _score_matrix(previous_rows, fresh_rows, num_experts, allowed)
    if node_blocks is not None:
        sigma, _ = _assign_nodes(score, *node_blocks)
    else:
        sigma, _ = _assign(score)
    if not allowed[np.arange(len(sigma)), sigma].all():
        raise PlanError(f"the fresh plan's slots per GPU {sorted(fsize.tolist())} cannot take the previous plan's "
                        f"{sorted(rsize.tolist())}; re-plan with the same slots per GPU")
    return [(j, in_place_order(previous_rows[i], fresh_rows[j])) for i, j in enumerate(sigma.tolist())]


def align(previous: Placement, fresh: Placement, *, keep_nodes: bool = False,
          match_previous_slots: bool = False) -> Placement:
    """``fresh`` relabelled per layer so the most experts stay where ``previous`` has them (module docstring).

    ``match_previous_slots=True`` exchanges a fresh set only onto a GPU that had as many slots in ``previous``, so
    the result has the previous plan's slots per GPU (a :class:`PlanError` when the sizes cannot match).
    """
    if (previous.num_layers, previous.num_experts, previous.num_gpus) != (fresh.num_layers, fresh.num_experts,
                                                                            fresh.num_gpus):
        raise PlanError(f"the previous plan has {previous.num_layers} layers x {previous.num_experts} experts on "
                        f"{previous.num_gpus} GPUs but the fresh one {fresh.num_layers} x {fresh.num_experts} on "
                        f"{fresh.num_gpus}; re-plan for the same model and cluster")
    cluster = fresh.cluster
    rows: list[list[list[int]]] = []
    weights: list[list[list[float]]] | None = None if fresh.weights is None else []
    nodes = (cluster.num_nodes, cluster.gpus_per_node) if keep_nodes and cluster.num_nodes > 1 else None
    for layer in range(fresh.num_layers):
        prow, frow = previous.gpu_experts[layer], fresh.gpu_experts[layer]
        try:
            picks = align_rows(prow, frow, fresh.num_experts, node_blocks=nodes,
                               match_previous_slots=match_previous_slots)
        except PlanError as exc:
            raise PlanError(f"layer {layer}: {exc}") from None
        rows.append([[frow[j][k] for k in ks] for j, ks in picks])
        if weights is not None:
            frw = fresh.weights[layer]  # type: ignore[index]
            weights.append([[frw[j][k] for k in ks] for j, ks in picks])
    params: dict[str, Any] = {**fresh.params, "migration": "aligned"}
    return Placement(rows, fresh.num_experts, cluster, policy=fresh.policy, params=params, weights=weights)


def _layer_weights(load: Any, num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """``float64 [L, E]``: each layer's load normalised to a mean GPU load of 1."""
    counts = np.asarray(getattr(load, "counts", load))
    if counts.ndim == 3:
        counts = counts.sum(axis=0, dtype=np.float64)
    if counts.shape != (num_layers, num_experts) or not np.issubdtype(counts.dtype, np.number):
        raise InputError(f"the load has shape {counts.shape} but the plans need [{num_layers}, {num_experts}] or "
                         f"[B, {num_layers}, {num_experts}]; plan on the same model's load")
    w = counts.astype(np.float64)
    if not np.isfinite(w).all() or (w < 0).any():
        raise InputError("the load holds negative or non-finite counts; counts are token picks")
    total = w.sum(axis=1, keepdims=True)
    return np.divide(w * num_gpus, total, out=np.zeros_like(w), where=total > 0)


class _Layer:
    """One layer's state while moving: rows, copy counts, the pending deficits and surpluses per GPU."""

    def __init__(self, cur: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]], w: np.ndarray) -> None:
        self.rows = [list(r) for r in cur]
        self.w = w
        G = len(self.rows)
        self.copies = np.zeros((w.size, G), dtype=np.int64)
        for g, r in enumerate(self.rows):
            np.add.at(self.copies[:, g], np.asarray(r, dtype=np.int64), 1)
        self.deficit = [list((Counter(t) - Counter(c)).elements()) for c, t in zip(cur, tgt, strict=True)]
        self.surplus = [list((Counter(c) - Counter(t)).elements()) for c, t in zip(cur, tgt, strict=True)]

    def loads(self, has: np.ndarray) -> np.ndarray:
        r = has.sum(axis=1)
        share = np.divide(self.w, r, out=np.zeros_like(self.w), where=r > 0)
        return share @ has

    def cost(self, g: int, d: int) -> int:
        """1 if GPU ``g`` must receive ``d`` (it holds no copy), 0 for a local clone."""
        return int(self.copies[d, g] == 0)

    def candidates(self, budget_left: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``int64 [C, 3]`` feasible moves ``(g, d, s)`` and ``float64 [C]`` their gains."""
        total = self.copies.sum(axis=1)
        moves = [(g, d, s) for g in range(len(self.rows)) for d in dict.fromkeys(self.deficit[g])
                 for s in dict.fromkeys(self.surplus[g])
                 if total[s] > 1 and (budget_left[g] > 0 or self.cost(g, d) == 0)]
        if not moves:
            return np.zeros((0, 3), dtype=np.int64), np.zeros(0)
        mv = np.asarray(moves, dtype=np.int64)
        g, d, s = mv[:, 0], mv[:, 1], mv[:, 2]
        has = self.copies > 0
        r = has.sum(axis=1).astype(np.float64)
        base = self.loads(has)
        onehot = np.zeros((len(mv), base.size))
        onehot[np.arange(len(mv)), g] = 1.0
        # s leaves g (its last copy there): its other holders share w_s over r_s - 1 (r_s >= 2: total > 1)
        rem = (self.copies[s, g] == 1).astype(np.float64)
        left = np.maximum(r[s] - 1, 1)
        new = base + rem[:, None] * (has[s] * (self.w[s] / left - self.w[s] / r[s])[:, None]
                                     - onehot * (self.w[s] / left)[:, None])
        # d arrives on g (not held there): its holders share w_d over r_d + 1
        add = (self.copies[d, g] == 0).astype(np.float64)
        new += add[:, None] * (has[d] * (self.w[d] / (r[d] + 1) - self.w[d] / r[d])[:, None]
                               + onehot * (self.w[d] / (r[d] + 1))[:, None])
        gain = (base.max() - new.max(axis=1)) + 1e-6 * ((base ** 2).sum() - (new ** 2).sum(axis=1))
        return mv, gain

    def apply(self, g: int, d: int, s: int) -> None:
        self.rows[g][self.rows[g].index(s)] = d
        self.copies[s, g] -= 1
        self.copies[d, g] += 1
        self.deficit[g].remove(d)
        self.surplus[g].remove(s)

    def chain(self, budget_left: np.ndarray) -> list[tuple[int, int, int]]:
        """Moves that only together keep every expert placed: each takes an expert's last copy that the next one
        adds on another GPU, until one takes a copy that is not the last; ``[]`` when none fits the budget."""
        total = self.copies.sum(axis=1)
        G = len(self.rows)
        for g0 in range(G):
            for d0 in dict.fromkeys(self.deficit[g0]):
                if budget_left[g0] < self.cost(g0, d0):
                    continue
                for s0 in dict.fromkeys(self.surplus[g0]):
                    moves, added, s = [(g0, d0, s0)], {d0}, s0
                    while s not in added and total[s] <= 1:  # s's only copy leaves: another GPU must add it
                        on = {m[0] for m in moves}
                        h = next((h for h in range(G) if h not in on and s in self.deficit[h]
                                  and budget_left[h] >= self.cost(h, s)), None)
                        if h is None:
                            break
                        options = list(dict.fromkeys(self.surplus[h]))
                        nxt = next((x for x in options if x in added or total[x] > 1), options[0])
                        moves.append((h, s, nxt))
                        added.add(s)
                        s = nxt
                    else:
                        return moves
        return []


def bounded(previous: Placement, fresh: Placement, max_moves: int, load: Any, *,
            keep_nodes: bool = False) -> Placement:
    """A step from ``previous`` towards ``align(previous, fresh)``: every GPU receives at most ``max_moves`` expert
    copies, summed over layers (module docstring). ``load``: ``[L, E]`` or ``[B, L, E]`` counts (or a
    :class:`~moebalance.core.load.LoadMatrix`) of the planning window."""
    if isinstance(max_moves, bool) or not isinstance(max_moves, int | np.integer) or max_moves < 0:
        raise InputError(f"max_moves ({max_moves!r}) must be a non-negative integer: the copies one GPU may "
                         "receive per re-plan")
    target = align(previous, fresh, keep_nodes=keep_nodes, match_previous_slots=True)
    G = previous.num_gpus
    w = _layer_weights(load, previous.num_layers, previous.num_experts, G)
    layers = [_Layer(previous.gpu_experts[li], target.gpu_experts[li], w[li]) for li in range(previous.num_layers)]
    budget = np.full(G, int(max_moves), dtype=np.int64)
    cache = [lay.candidates(budget) for lay in layers]
    while True:
        best, pick = -np.inf, None  # type: float, tuple[int, list[tuple[int, int, int]]] | None
        for li, (mv, gain) in enumerate(cache):
            if not len(mv):
                continue
            ok = (budget[mv[:, 0]] > 0) | (layers[li].copies[mv[:, 1], mv[:, 0]] > 0)
            if ok.any():
                k = int(np.flatnonzero(ok)[np.argmax(gain[ok])])
                if gain[k] > best:
                    best, pick = float(gain[k]), (li, [(int(mv[k, 0]), int(mv[k, 1]), int(mv[k, 2]))])
        if pick is None:
            pick = next(((li, ch) for li, lay in enumerate(layers) if (ch := lay.chain(budget))), None)
            if pick is None:
                break
        li, moves = pick
        for g, d, s in moves:
            budget[g] -= layers[li].cost(g, d)
            layers[li].apply(g, d, s)
        cache[li] = layers[li].candidates(budget)
    params: dict[str, Any] = {**fresh.params, "migration": "bounded", "max_moves": int(max_moves)}
    return Placement([lay.rows for lay in layers], fresh.num_experts, fresh.cluster, policy=fresh.policy,
                     params=params)


def keeps_node_blocks(plan: Placement) -> bool:
    """Whether a re-plan of ``plan``'s policy keeps whole nodes as blocks: hierarchical EPLB lays its plan out per
    node (its groups packed onto nodes first), so only whole nodes and GPUs within a node may be exchanged."""
    return plan.params.get("mode") == "hierarchical"


def lay_onto(previous: Placement, fresh: Placement, migration: str, *, max_moves: int | None = None,
             load: Any = None) -> Placement:
    """``fresh`` laid onto the plan in service ``previous`` as ``migration`` says: ``fresh`` (as planned, recorded
    in its params), ``aligned`` (:func:`align`) or ``bounded`` (:func:`bounded` with ``max_moves`` on ``load``, the
    planning window); node blocks kept where :func:`keeps_node_blocks` says."""
    keep = keeps_node_blocks(fresh)
    if migration == "aligned":
        return align(previous, fresh, keep_nodes=keep)
    if migration == "bounded":
        if max_moves is None or load is None:
            raise InputError("migration bounded needs max_moves (the copies one GPU may receive per re-plan) and "
                             "the planning window's load")
        return bounded(previous, fresh, max_moves, load, keep_nodes=keep)
    if migration == "fresh":
        return fresh.with_params({**fresh.params, "migration": "fresh"})
    raise InputError(f"migration {migration!r} is unknown; choose one of: {', '.join(MIGRATIONS)}")
