"""Predictors of a batch's routing, and Libra's accuracy (docs/design.md, "Online replay and prediction").

Legend: ``T`` tokens of the batch, ``L`` MoE layers, ``K`` picks per token, ``E`` experts, ``G`` GPUs, ``D``
model width, ``W`` batches of history.

A predictor sees what a server would have when it must decide which experts to prefetch for layer ``l`` of a
batch, and returns a :class:`Prediction`: each token's predicted top-k where it predicts per token, and the
predicted picks per source GPU and expert ``demand [L, G, E]`` that the prefetcher plans from.

- ``exact`` (alias ``oracle``): the batch's routing as the gate computes it, which a server holds once the
  layer's gate has run: planning from it is planning after the gate (the exact information HarMoEny-style
  systems assume, and an upper bound for every predictor).
- ``lookahead`` (Libra Section 3.2): layer ``l``'s gate applied to layer ``l - 1``'s gate input, the hidden
  state a server holds while layer ``l - 1`` runs; hidden states change little from one layer to the next.
  Needs a capture with hidden states and the model that made it. Layer 0 has no previous layer: no prediction.
- ``path`` (Lina, as Libra describes it): a table from a token's *expert-selection path*, its experts in the
  previous few layers, to the experts it picks next, built on a build split. Our key and fallback:

  * the key is the token's **top-1** expert in each of the ``depth`` previous layers (default 2). A path of
    whole top-k sets is too specific to recur (``C(64, 6)`` sets per layer already outnumber any build split),
    while the top-1 expert carries most of a token's routing signal; a token picks its top-1 by the largest
    gate score, and traces list picks in gate order;
  * an unseen path **backs off** to the last ``depth - 1`` layers, and so on down to the previous layer's top-1
    alone; a token whose previous top-1 was never seen gets the layer's most frequent experts in the build
    split. Backing off to the longest seen suffix is the n-gram remedy for sparse contexts (Katz 1987): the
    nearest layer carries most of the information, and an empty table entry says nothing;
  * within an entry, experts are ranked by how often they followed the path, ties by their build-split
    frequency, then by the lower id.
- ``history``: the previous ``W`` batches' picks (what periodic EPLB re-plans from): every token's predicted
  top-k is the layer's ``K`` most picked experts of the window, and the demand is the window's per-GPU picks
  scaled to this batch's size. The first batches have no history and no prediction.

Accuracy (Libra Section 5.2): the fraction of a token's true top-k that its predicted top-k holds, averaged
over tokens, per layer and over the layers that have a prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.core import tally
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.core.trace import RoutingTrace

__all__ = ["EXACT", "PREDICTORS", "AccuracyTally", "ExactPredictor", "HistoryPredictor", "LookaheadPredictor",
           "OraclePredictor", "PathPredictor", "Prediction", "Predictor", "PredictorInputs", "accuracy", "demand_of", "make_predictor",
           "topk_accuracy"]

#: The names of the exact predictor: ``exact`` and its alias ``oracle`` (the same predictor, the same results).
EXACT = ("exact", "oracle")
#: Predictor names (the ``--predictor`` choices and ``libra``'s ``predictor`` option).
PREDICTORS = ("lookahead", "path", "history", "oracle", "exact")


@dataclass(frozen=True, slots=True)
class PredictorInputs:
    """What a replay's predictor may need besides the trace: the ``lookahead`` predictor's gate inputs
    ``hidden [N, L, D]`` and the ``model`` whose gates made them; the ``path`` predictor's ``build`` split (``None``:
    the warm-up batches); ``progress(done, total)``, called as the predictor is built (the ``path`` table, layer by
    layer: :class:`PathPredictor`), before the first batch is served."""

    hidden: np.ndarray | None = None
    model: Any = None
    build: LoadMatrix | None = None
    progress: Callable[[int, int], None] | None = None


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a predictor expects of one batch.

    Example: 3 tokens, 2 layers, top-1, 2 GPUs, layer 0 not predicted: ``layers = [False, True]``,
    ``topk_ids[:, 1]`` the predicted picks, ``demand[0]`` zeros.
    """

    #: ``int64 [T, L, K]``: predicted picks per token (rows of layers without a prediction are -1).
    topk_ids: np.ndarray
    #: ``bool [L]``: layers that have a prediction.
    layers: np.ndarray
    #: ``float64 [L, G, E]``: predicted picks by tokens of GPU ``g`` of expert ``e`` (0 where not predicted).
    demand: np.ndarray


def demand_of(topk_ids: np.ndarray, src_gpu: np.ndarray, num_gpus: int, num_experts: int) -> np.ndarray:
    """``float64 [L, G, E]``: picks ``topk_ids [T, L, K]`` (``-1`` ignored) counted by source GPU and expert."""
    L = topk_ids.shape[1]
    ok = topk_ids >= 0
    layer = np.broadcast_to(np.arange(L)[None, :, None], topk_ids.shape)
    src = np.broadcast_to(np.asarray(src_gpu, dtype=np.int64)[:, None, None], topk_ids.shape)
    flat = ((layer * num_gpus + src) * num_experts + topk_ids)[ok]
    return np.bincount(flat, minlength=L * num_gpus * num_experts).reshape(L, num_gpus, num_experts).astype(float)


def topk_accuracy(pred_TK: np.ndarray, true_TK: np.ndarray) -> np.ndarray:
    """``float64 [T]``: per token, the fraction of its true picks ``true [T, K]`` found in ``pred [T, K']``."""
    hit = (pred_TK[:, :, None] == true_TK[:, None, :]).any(axis=1)
    return hit.mean(axis=1) if true_TK.shape[1] else np.zeros(true_TK.shape[0])


def accuracy(pred: Prediction, true_TLK: np.ndarray) -> np.ndarray:
    """``float64 [L]``: mean per-token accuracy of each layer (nan where the layer has no prediction or no token)."""
    L = true_TLK.shape[1]
    out = np.full(L, np.nan)
    if true_TLK.shape[0] == 0:
        return out
    for layer in np.flatnonzero(pred.layers):
        out[layer] = float(topk_accuracy(pred.topk_ids[:, layer], true_TLK[:, layer]).mean())
    return out


class AccuracyTally:
    """Libra's accuracy accumulated over batches, token-weighted per layer.

    Example: ``t = AccuracyTally(L); t.add(pred, true_ids)`` per batch, then ``t.per_layer()`` (nan where nothing
    was predicted) and ``t.overall()`` (over every (token, layer) with a prediction, ``None`` if there is none).
    """

    def __init__(self, num_layers: int) -> None:
        self.total = np.zeros(num_layers)
        #: ``[L]``: tokens with a prediction in each layer.
        self.tokens = np.zeros(num_layers)

    def add(self, pred: Prediction, true_TLK: np.ndarray) -> None:
        per_layer = accuracy(pred, true_TLK)
        ok = np.isfinite(per_layer)
        n = true_TLK.shape[0]
        self.total[ok] += per_layer[ok] * n
        self.tokens[ok] += n

    def per_layer(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.tokens > 0, self.total / np.where(self.tokens > 0, self.tokens, 1), np.nan)

    def overall(self) -> float | None:
        return float(self.total.sum() / self.tokens.sum()) if self.tokens.any() else None


def _ranked_topk(scores_XE: np.ndarray, k: int) -> np.ndarray:
    """``int64 [X, k]``: the ``k`` highest-scoring experts of each row, ties to the lower id."""
    return tally.top_k(scores_XE, k)


class Predictor:
    """Base of the predictors: ``predict(trace, batch)`` for one batch of a replay."""

    name = "predictor"
    #: ``True`` when the predictor needs each token's source GPU and picks (a token-level trace).
    needs_trace = True

    def predict(self, trace: RoutingTrace, batch: int, num_gpus: int) -> Prediction:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The predictor's name and options, for reports."""
        return {"predictor": self.name}


def _empty(T: int, L: int, K: int, G: int, E: int) -> Prediction:
    return Prediction(np.full((T, L, K), -1, dtype=np.int64), np.zeros(L, dtype=bool), np.zeros((L, G, E)))


def _rows(trace: RoutingTrace, batch: int) -> slice:
    lo, hi = np.searchsorted(trace.batch, [batch, batch + 1], side="left")
    return slice(int(lo), int(hi))


class ExactPredictor(Predictor):
    """The batch's routing as the gate computes it (``exact``; ``oracle`` is the same predictor under its old
    name, which it keeps in reports when asked for by it)."""

    name = "exact"

    def __init__(self, name: str = "exact") -> None:
        if name not in EXACT:
            raise InputError(f"the exact predictor is named {' or '.join(repr(n) for n in EXACT)}, not {name!r}")
        self.name = name

    def predict(self, trace: RoutingTrace, batch: int, num_gpus: int) -> Prediction:
        rows = _rows(trace, batch)
        ids = trace.topk_ids[rows]
        return Prediction(ids.copy(), np.ones(trace.num_layers, dtype=bool),
                          demand_of(ids, trace.src_gpu[rows], num_gpus, trace.num_experts))


class OraclePredictor(ExactPredictor):
    """:class:`ExactPredictor` under its old name ``oracle``."""

    name = "oracle"

    def __init__(self) -> None:
        super().__init__("oracle")


class LookaheadPredictor(Predictor):
    """Layer ``l``'s gate on layer ``l - 1``'s gate input (Libra Section 3.2).

    ``gates [L, D, E]``, ``biases [L, E]`` (selection biases, or ``None``) and the gate's config come from the
    model; ``hidden [N, L, D]`` are the capture's gate inputs, row-aligned with the trace.
    """

    name = "lookahead"

    def __init__(self, gates: np.ndarray, biases: np.ndarray | None, gate_config: Any, hidden: np.ndarray) -> None:
        if gates.ndim != 3:
            raise InputError(f"gates must be [L, D, E], got shape {gates.shape}")
        if hidden.ndim != 3 or hidden.shape[1:] != gates.shape[:2]:
            raise InputError(f"hidden states {hidden.shape} do not fit the model's gates {gates.shape} "
                             "([N, L, D] against [L, D, E]); capture with this model and --hidden-states")
        self.gates, self.biases, self.gate_config, self.hidden = gates, biases, gate_config, hidden

    def predict(self, trace: RoutingTrace, batch: int, num_gpus: int) -> Prediction:
        import torch

        from moebalance.runtime.gating import topk_gating

        if self.hidden.shape[0] != trace.num_tokens:
            raise InputError(f"the capture has hidden states for {self.hidden.shape[0]} tokens and a trace of "
                             f"{trace.num_tokens}; use hidden states and routing of the same capture")
        rows = _rows(trace, batch)
        T, L, K, E = rows.stop - rows.start, trace.num_layers, trace.top_k, trace.num_experts
        pred = _empty(T, L, K, num_gpus, E)
        with torch.no_grad():
            for layer in range(1, L):
                h = torch.from_numpy(np.ascontiguousarray(self.hidden[rows, layer - 1], dtype=np.float32))
                bias = None if self.biases is None else torch.from_numpy(self.biases[layer])
                g = topk_gating(h @ torch.from_numpy(self.gates[layer]), self.gate_config, selection_bias_E=bias)
                pred.topk_ids[:, layer] = g.topk_ids.numpy()[:, :K]
        pred.layers[1:] = True
        pred.demand[:] = demand_of(pred.topk_ids, trace.src_gpu[rows], num_gpus, E)
        return pred

    @classmethod
    def from_model(cls, model: Any, hidden: np.ndarray) -> LookaheadPredictor:
        """From a :class:`~moebalance.lm.MoELM` (its gates, biases and gate config)."""
        gates, biases = [], []
        config = None
        for layer in range(model.config.num_layers):
            gate, _, config, bias = model.moe_parts(layer)
            gates.append(gate.float().numpy())
            biases.append(None if bias is None else bias.float().numpy())
        b = None if biases[0] is None else np.stack([np.asarray(x) for x in biases])
        return cls(np.stack(gates), b, config, hidden)


class PathPredictor(Predictor):
    """Lina's expert-selection-path table, built on ``build`` traces (see the module docstring).

    The table is built layer by layer (ranking every path's experts, a while on a large build split);
    ``progress(done, total)``, if given, is called with ``(0, L - 1)`` before the first layer's table and
    with the layers built so far after each of layers ``1 .. L - 1`` (a progress bar's position)."""

    name = "path"

    def __init__(self, build: Sequence[RoutingTrace], depth: int = 2,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 4:
            raise InputError(f"depth ({depth!r}) must be an integer from 1 to 4 (previous layers in a path)")
        if not build:
            raise InputError("the path predictor needs a build split: give --build with a token-level trace")
        shapes = {(t.num_layers, t.num_experts, t.top_k) for t in build}
        if len(shapes) != 1:
            raise InputError(f"the build traces disagree on [layers, experts, top-k]: {sorted(shapes)}")
        self.depth = depth
        (self.num_layers, self.num_experts, self.top_k), = shapes
        L, E = self.num_layers, self.num_experts
        if progress is not None:
            progress(0, max(L - 1, 0))
        top1 = np.concatenate([t.topk_ids[:, :, 0] for t in build])  # [N, L]
        ids = np.concatenate([t.topk_ids for t in build])  # [N, L, K]
        self.build_tokens = int(top1.shape[0])
        #: ``float64 [L, E]``: picks per expert in the build split (the last fallback and the tie-break).
        self.marginal = np.stack([np.bincount(ids[:, layer].ravel(), minlength=E) for layer in range(L)]).astype(float)
        # tables[layer][d - 1] = (sorted keys [U], ranked experts [U, E]) for paths of length d
        self.tables: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(L)]
        for layer in range(1, L):
            tie = self.marginal[layer] / (self.marginal[layer].sum() + 1.0)  # < 1: breaks ties only
            for d in range(1, min(depth, layer) + 1):
                keys = self._keys(top1, layer, d)
                uniq, inverse = np.unique(keys, return_inverse=True)
                counts = np.bincount((inverse[:, None] * E + ids[:, layer]).ravel(),
                                     minlength=uniq.size * E).reshape(uniq.size, E)
                self.tables[layer].append((uniq, _ranked_topk(counts + tie, self.top_k)))
            if progress is not None:
                progress(layer, L - 1)

    def _keys(self, top1_NL: np.ndarray, layer: int, d: int) -> np.ndarray:
        key = np.zeros(top1_NL.shape[0], dtype=np.int64)
        for j in range(layer - d, layer):
            key = key * self.num_experts + top1_NL[:, j]
        return key

    def predict(self, trace: RoutingTrace, batch: int, num_gpus: int) -> Prediction:
        if (trace.num_layers, trace.num_experts, trace.top_k) != (self.num_layers, self.num_experts, self.top_k):
            raise InputError(f"the path table was built on [layers, experts, top-k] = [{self.num_layers}, "
                             f"{self.num_experts}, {self.top_k}] but the trace has [{trace.num_layers}, "
                             f"{trace.num_experts}, {trace.top_k}]; build on routing of the same model")
        rows = _rows(trace, batch)
        ids = trace.topk_ids[rows]
        T, L, K, E = ids.shape[0], trace.num_layers, trace.top_k, trace.num_experts
        pred = _empty(T, L, K, num_gpus, E)
        top1 = ids[:, :, 0]
        kk = K
        for layer in range(1, L):
            out = np.broadcast_to(_ranked_topk(self.marginal[layer][None], K), (T, K)).copy()
            done = np.zeros(T, dtype=bool)
            for d in range(len(self.tables[layer]), 0, -1):  # longest path first
                uniq, ranked = self.tables[layer][d - 1]
                keys = self._keys(top1, layer, d)
                pos = np.searchsorted(uniq, keys)
                hit = ~done & (pos < uniq.size)
                hit[hit] = uniq[pos[hit]] == keys[hit]
                out[hit, :kk] = ranked[pos[hit], :kk]
                done |= hit
            pred.topk_ids[:, layer] = out
        pred.layers[1:] = True
        pred.demand[:] = demand_of(pred.topk_ids, trace.src_gpu[rows], num_gpus, E)
        return pred

    def describe(self) -> dict[str, Any]:
        return {"predictor": self.name, "depth": self.depth, "build_tokens": self.build_tokens}


class HistoryPredictor(Predictor):
    """The previous ``window`` batches' picks (see the module docstring)."""

    name = "history"
    needs_trace = False

    def __init__(self, window: int = 1) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InputError(f"window ({window!r}) must be a positive integer (batches of history)")
        self.window = window

    def predict(self, trace: RoutingTrace, batch: int, num_gpus: int) -> Prediction:
        rows = _rows(trace, batch)
        T, L, K, E = rows.stop - rows.start, trace.num_layers, trace.top_k, trace.num_experts
        pred = _empty(T, L, K, num_gpus, E)
        lo = max(0, batch - self.window)
        if lo == batch:
            return pred
        past = slice(*(int(i) for i in np.searchsorted(trace.batch, [lo, batch], side="left")))
        n = past.stop - past.start
        if n == 0:
            return pred
        demand = demand_of(trace.topk_ids[past], trace.src_gpu[past], num_gpus, E)
        pred.demand[:] = demand * (T / n)
        pred.topk_ids[:] = _ranked_topk(demand.sum(axis=1), K)[None]
        pred.layers[:] = True
        return pred

    def predict_counts(self, counts: np.ndarray, batch: int, num_gpus: int) -> np.ndarray | None:
        """``demand [L, G, E]`` from a load without token sources: the window's mean picks, spread evenly over
        GPUs, scaled to this batch's picks; ``None`` without history."""
        lo = max(0, batch - self.window)
        if lo == batch:
            return None
        past = counts[lo:batch].sum(axis=0).astype(float)  # [L, E]
        done = past.sum(axis=1, keepdims=True)
        now = counts[batch].sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            scaled = np.where(done > 0, past * (now / np.where(done > 0, done, 1)), 0.0)
        return np.repeat(scaled[:, None, :] / num_gpus, num_gpus, axis=1)

    def describe(self) -> dict[str, Any]:
        return {"predictor": self.name, "window": self.window}


def make_predictor(name: str, *, build: Sequence[RoutingTrace] = (), hidden: np.ndarray | None = None,
                   model: Any = None, depth: int = 2, window: int = 1,
                   progress: Callable[[int, int], None] | None = None) -> Predictor:
    """The predictor ``name`` (one of :data:`PREDICTORS`) with what it needs; ``progress`` follows the ``path``
    table's build (:class:`PathPredictor`), the one predictor whose build takes a while."""
    if name in EXACT:
        return ExactPredictor(name)
    if name == "history":
        return HistoryPredictor(window)
    if name == "path":
        return PathPredictor(build, depth, progress)
    if name == "lookahead":
        if hidden is None:
            raise InputError("the lookahead predictor needs hidden states: capture with --hidden-states "
                             "(moebalance capture ... --hidden-states)")
        if model is None:
            raise InputError("the lookahead predictor needs the model that made the capture (--checkpoint)")
        return LookaheadPredictor.from_model(model, hidden)
    raise InputError(f"unknown predictor {name!r}; choose one of: {', '.join(PREDICTORS)}")
