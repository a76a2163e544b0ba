"""Exceptions for user mistakes.

Every error a user can cause (a bad file, a bad budget, a bad plan) is a :class:`MoebalanceError`. Its
message is one line that names the bad value and says how to fix it; the CLI prints it and exits 2.
Internal invariants use ``assert``.
"""

from __future__ import annotations

__all__ = ["BudgetError", "InputError", "MoebalanceError", "PlanError"]


class MoebalanceError(ValueError):
    """Base class of all user-facing errors."""


class InputError(MoebalanceError):
    """A load matrix, routing trace or other input array is malformed."""


class PlanError(MoebalanceError):
    """A placement plan is malformed or does not fit the model or cluster."""


class BudgetError(MoebalanceError):
    """A memory budget cannot be met by the requested policy."""
