"""A small mixed-integer linear program builder and its HiGHS driver (``highspy``).

Legend: ``n`` variables, ``R`` rows (linear constraints), ``k`` non-zeros per row of one block.

Policies that solve integer programs (``moetuner``) build a :class:`Milp` from numpy index arrays, the way
they are written on paper (``x[c, e]`` is ``index[c, e]``), and call :meth:`Milp.solve`. The driver runs
HiGHS single-threaded with a fixed random seed, so a solve that ends on its own (optimal, or within the gap)
gives the same answer on every run; one stopped by its time limit returns the best solution found so far,
which depends on the machine's speed, and says so (:attr:`MilpResult.time_limit_hit`).

Why HiGHS (``highspy``): one wheel with no dependencies that gives what the policies need, a warm start, a
relative and an absolute gap tolerance, a time limit and the proven dual bound, and takes fractional
coefficients (MoETuner's ILP 2 has bandwidth weights). ``scipy.optimize.milp`` runs the same HiGHS without
warm starts. Do not import OR-Tools in the same process: it bundles its own HiGHS, and
whichever is imported second fails with undefined symbols.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebalance.core.errors import PlanError

__all__ = ["ABS_GAP", "Milp", "MilpResult"]

#: The absolute gap (objective units) at which HiGHS stops whatever relative gap was asked: its documented
#: default ``mip_abs_gap``, which the driver never lowers. A solve asked for ``mip_gap = 0`` is therefore proven
#: optimal only to within ``ABS_GAP``: its objective and bound may differ by that much (highspy 1.16 stops at
#: such a difference where 1.15 happened to close it), and so may its objective and the true optimum.
ABS_GAP = 1e-6


@dataclass(frozen=True, slots=True)
class MilpResult:
    """The outcome of one solve.

    Example: a solve that proved its optimum has ``status == "optimal"``, ``gap == 0.0`` (or at most the
    requested gap) and ``bound <= objective``.
    """

    #: ``float64 [n]``: the best solution found (integer variables rounded to integers).
    x: np.ndarray
    #: Objective value of ``x``.
    objective: float
    #: Proven lower bound on the optimum (minimisation).
    bound: float
    #: ``"optimal"`` (within the requested gap), ``"time_limit"`` (stopped; ``x`` is the best point found, the
    #: warm start if HiGHS found none), ``"infeasible"`` (proven: no point) or ``"no_solution"`` (stopped before
    #: finding a point and no warm start given; ``x`` is NaN, ``objective`` inf).
    status: str
    #: Wall-clock seconds of the solve.
    seconds: float

    @property
    def gap(self) -> float:
        """Proven relative gap ``(objective - bound) / |objective|``: 0 when they meet, inf with no bound or no point."""
        if not math.isfinite(self.objective):
            return math.inf
        diff = self.objective - self.bound
        if diff <= 1e-9 * max(1.0, abs(self.objective)):
            return 0.0
        return diff / abs(self.objective) if self.objective else math.inf

    @property
    def time_limit_hit(self) -> bool:
        return self.status in ("time_limit", "no_solution")


class Milp:
    """A minimisation MILP built block by block from numpy arrays.

    Example::

        m = Milp()
        x = m.add_vars((2, 3), cost=1.0)                  # 6 binaries, x[i, j] is a column index
        m.add_rows(x, 1.0, lower=1.0, upper=1.0)          # each row of x sums to one
        result = m.solve(time_limit=None, mip_gap=0.0, seed=0)
    """

    def __init__(self) -> None:
        self._lb: list[np.ndarray] = []
        self._ub: list[np.ndarray] = []
        self._cost: list[np.ndarray] = []
        self._integer: list[np.ndarray] = []
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.num_vars = 0

    def add_vars(self, shape: int | tuple[int, ...], *, lb: float | np.ndarray = 0.0, ub: float | np.ndarray = 1.0,
                 cost: float | np.ndarray = 0.0, integer: bool = True) -> np.ndarray:
        """Add variables (binary by default); returns their column indices, ``int64`` of ``shape``.

        ``lb``, ``ub`` and ``cost`` broadcast to ``shape``.
        """
        size = math.prod(shape) if isinstance(shape, tuple) else int(shape)
        idx = np.arange(self.num_vars, self.num_vars + size, dtype=np.int64).reshape(shape)
        self.num_vars += size

        def full(v: float | np.ndarray) -> np.ndarray:
            return np.broadcast_to(np.asarray(v, dtype=np.float64), idx.shape).ravel().copy()

        self._lb.append(full(lb))
        self._ub.append(full(ub))
        self._cost.append(full(cost))
        self._integer.append(np.full(size, integer, dtype=bool))
        return idx

    def add_rows(self, index: np.ndarray, value: float | np.ndarray, *, lower: float | np.ndarray = -np.inf,
                 upper: float | np.ndarray = np.inf) -> None:
        """Add ``lower <= sum_k value[..., k] * x[index[..., k]] <= upper`` for every leading position.

        ``index`` is ``[..., k]`` (the last axis runs over a row's terms); ``value`` broadcasts to it;
        ``lower`` and ``upper`` broadcast to ``index.shape[:-1]``. Terms with a zero value are dropped.
        """
        index = np.asarray(index, dtype=np.int64)
        val = np.broadcast_to(np.asarray(value, dtype=np.float64), index.shape)
        k = index.shape[-1]
        index2 = index.reshape(-1, k)
        val2 = val.reshape(-1, k)
        R = index2.shape[0]
        lo = np.broadcast_to(np.asarray(lower, dtype=np.float64), index.shape[:-1]).reshape(R)
        hi = np.broadcast_to(np.asarray(upper, dtype=np.float64), index.shape[:-1]).reshape(R)
        self._rows.append((index2, val2, lo, hi))

    def objective(self, x: np.ndarray) -> float:
        """The objective at ``x [n]``."""
        return float(np.concatenate(self._cost) @ np.asarray(x, dtype=np.float64)) if self.num_vars else 0.0

    def violation(self, x: np.ndarray) -> float:
        """The largest amount by which ``x [n]`` breaks a variable bound, a row or integrality (0 if feasible)."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.num_vars,) or not np.all(np.isfinite(x)):
            return math.inf
        worst = 0.0
        if self.num_vars:
            lb, ub = np.concatenate(self._lb), np.concatenate(self._ub)
            integer = np.concatenate(self._integer)
            worst = max(float(np.max(lb - x)), float(np.max(x - ub)),
                        float(np.max(np.abs(x - np.round(x)) * integer)), 0.0)
        for index, val, lo, hi in self._rows:
            act = (val * x[index]).sum(axis=1)
            if len(act):
                worst = max(worst, float(np.max(lo - act)), float(np.max(act - hi)))
        return worst

    def solve(self, *, time_limit: float | None, mip_gap: float, seed: int, abs_gap: float = 0.0,
              start: np.ndarray | None = None) -> MilpResult:
        """Minimise with HiGHS (one thread, ``seed``); ``start [n]`` is an optional feasible warm start.

        The solve stops once the incumbent is proven within ``mip_gap`` (relative) or ``abs_gap`` (absolute,
        in objective units) of the optimum, or at ``time_limit`` seconds. A time limit that stops HiGHS before
        it has taken up the warm start returns the start (status ``"time_limit"``), never a worse answer.
        """
        if start is not None:  # HiGHS silently drops an infeasible start: a caller's bug, caught here
            start = np.asarray(start, dtype=np.float64)
            bad = self.violation(start)
            if bad > 1e-6:  # an internal invariant: callers build their starts from feasible assignments
                raise RuntimeError(f"internal error: the MILP warm start breaks a bound or row by {bad}")
        import highspy

        t0 = time.perf_counter()
        h = _quiet_highs(highspy)
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", int(seed))
        h.setOptionValue("mip_rel_gap", float(mip_gap))
        h.setOptionValue("mip_abs_gap", max(float(abs_gap), ABS_GAP))
        if time_limit is not None:
            h.setOptionValue("time_limit", max(float(time_limit), 1e-3))
        n = self.num_vars
        inf = highspy.kHighsInf
        lb = np.concatenate(self._lb) if self._lb else np.zeros(0)
        ub = np.concatenate(self._ub) if self._ub else np.zeros(0)
        h.addVars(n, np.where(np.isinf(lb), -inf, lb), np.where(np.isinf(ub), inf, ub))
        cols = np.arange(n, dtype=np.int32)
        h.changeColsCost(n, cols, np.concatenate(self._cost))
        integer = np.concatenate(self._integer)
        kinds = np.where(integer, int(highspy.HighsVarType.kInteger), int(highspy.HighsVarType.kContinuous))
        h.changeColsIntegrality(n, cols, kinds.astype(np.uint8))
        for index, val, lo, hi in self._rows:
            keep = val != 0.0
            counts = keep.sum(axis=1)
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
            h.addRows(len(lo), np.where(np.isinf(lo), -inf, lo), np.where(np.isinf(hi), inf, hi), int(counts.sum()),
                      starts, index[keep].astype(np.int32), val[keep])
        if start is not None:
            h.setSolution(n, cols, np.asarray(start, dtype=np.float64))
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        seconds = time.perf_counter() - t0
        if status == highspy.HighsModelStatus.kOptimal:
            kind = "optimal"
        elif status == highspy.HighsModelStatus.kTimeLimit:
            kind = "time_limit"
        elif status == highspy.HighsModelStatus.kInfeasible:
            return MilpResult(x=np.full(n, np.nan), objective=math.inf, bound=math.inf, status="infeasible",
                              seconds=seconds)
        else:  # every model we build is bounded and feasible or proven infeasible; anything else is unusable
            raise PlanError(f"the MILP solver HiGHS ended with status {h.modelStatusToString(status)!r}, "
                            "which gives no usable solution")
        if info.primal_solution_status != highspy.kSolutionStatusFeasible and start is not None:
            objective = float(np.concatenate(self._cost) @ start)  # stopped before taking up the start: keep it
            return MilpResult(x=start.copy(), objective=objective, bound=min(float(info.mip_dual_bound), objective),
                              status="time_limit", seconds=seconds)
        if info.primal_solution_status != highspy.kSolutionStatusFeasible:  # stopped before finding a point
            return MilpResult(x=np.full(n, np.nan), objective=math.inf, bound=float(info.mip_dual_bound),
                              status="no_solution", seconds=seconds)
        x = np.asarray(h.getSolution().col_value, dtype=np.float64)
        x = np.where(integer, np.round(x), x)
        objective = float(info.objective_function_value)
        bound = float(info.mip_dual_bound) if integer.any() else objective
        return MilpResult(x=x, objective=objective, bound=min(bound, objective), status=kind, seconds=seconds)


def _quiet_highs(highspy: Any) -> Any:
    """A ``Highs`` instance without its start-up banner, which HiGHS writes to the process's standard output
    before any option can silence it (and which would break ``--json`` output)."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 1)
            h = highspy.Highs()
            h.setOptionValue("output_flag", False)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h
