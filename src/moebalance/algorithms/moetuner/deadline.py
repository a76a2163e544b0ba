"""The wall-clock budget MoETuner's solves share: one :class:`Deadline` passed down to every solve.

How the policy splits its ``time_limit`` between ILP 1, its layers and ILP 2 is described in
``docs/papers/moetuner.md`` ("Time budget").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["DEFAULT_MIP_GAP", "DEFAULT_TIME_LIMIT", "MIN_SOLVE_SECONDS", "Deadline"]

#: Relative MIP gap of the paper's Section 5.1 ("Both ILPs were set to execute until reaching a tolerance of 0.025").
DEFAULT_MIP_GAP = 0.025
#: Default total time budget of the policy, in seconds.
DEFAULT_TIME_LIMIT = 60.0
#: A solve given less time than this is not started: the caller keeps its warm start and reports the limit hit.
MIN_SOLVE_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point in :func:`time.perf_counter` time by which work must end; ``end is None`` means no limit.

    Example: ``Deadline.after(10.0).share(0.5)`` ends five seconds from now; ``Deadline.after(None).left()``
    is ``None``.
    """

    end: float | None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """The deadline ``seconds`` from now (``None``: none)."""
        return cls(None if seconds is None else time.perf_counter() + seconds)

    @property
    def unlimited(self) -> bool:
        return self.end is None

    def left(self, parts: int = 1) -> float | None:
        """Seconds left (never negative), divided into ``parts`` equal shares; ``None`` without a limit."""
        return None if self.end is None else max(self.end - time.perf_counter(), 0.0) / parts

    def share(self, fraction: float) -> Deadline:
        """A deadline ending after ``fraction`` of the time left now."""
        left = self.left()
        return self if left is None else Deadline(time.perf_counter() + left * fraction)

    def expired(self, margin: float = 0.0) -> bool:
        """True when at most ``margin`` seconds are left (never without a limit)."""
        left = self.left()
        return left is not None and left <= margin

    def too_short(self) -> bool:
        """True when less than :data:`MIN_SOLVE_SECONDS` is left: too little to build and start a solve."""
        left = self.left()
        return left is not None and left < MIN_SOLVE_SECONDS
