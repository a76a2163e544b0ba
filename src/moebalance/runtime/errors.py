"""Errors that every rank of a group raises alike, and how they travel between ranks (docs/design.md, "Errors").

A rank's error crosses to the other ranks as a class code and one line of text (:func:`error_code`,
:func:`one_line`); each rank rebuilds it with :func:`raise_coded`. When several ranks failed, they all raise
the lowest failing rank's error, as ``rank r: <its line>`` (:func:`agreed_message`).

:class:`GroupError` is the error of the group itself: a rank that did not arrive within the timeout, or left
the group (killed, crashed) while the others waited for it in a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from moebalance.core.errors import BudgetError, InputError, MoebalanceError, PlanError

__all__ = ["GroupError", "agreed_message", "error_code", "one_line", "raise_coded"]


class GroupError(MoebalanceError):
    """A rank did not join the process group in time, or left it while the others waited for it."""


#: The classes an error code stands for: code ``i + 1`` is ``CLASSES[i]``; an error of no other class is the last.
CLASSES: tuple[type[Exception], ...] = (InputError, PlanError, BudgetError, GroupError, MoebalanceError, RuntimeError)


def error_code(error: BaseException | None) -> int:
    """0 for no error, else the code of its class (an :class:`OSError` counts as an :class:`InputError`:
    a missing or unreadable file)."""
    if error is None:
        return 0
    if isinstance(error, OSError):
        return 1
    for i, cls in enumerate(CLASSES[:-1]):
        if isinstance(error, cls):
            return i + 1
    return len(CLASSES)


def one_line(error: BaseException) -> str:
    """The error as the command line prints it: its message on one line (the class name too, unless it is a
    :class:`MoebalanceError`; an :class:`OSError` as ``<reason>: <file>``)."""
    if isinstance(error, OSError) and (error.strerror or error.filename):
        text = f"{error.strerror or error}: {error.filename or ''}"
    else:
        text = str(error)
    text = " ".join(text.split()) or type(error).__name__
    return text if isinstance(error, MoebalanceError | OSError) else f"{type(error).__name__}: {text}"


def agreed_message(texts: Mapping[int, str]) -> str:
    """The one line every rank raises given each failing rank's line: the lowest rank's, as ``rank r: ...``,
    noting the others (the same text, or that they failed too)."""
    failed = sorted(texts)
    first = failed[0]
    text = texts[first] if texts[first].startswith(f"rank {first} ") else f"rank {first}: {texts[first]}"
    if len(failed) > 1:
        others = ", ".join(map(str, failed[1:]))
        same = all(texts[r] == texts[first] for r in failed)
        text += f" (the same on ranks {others})" if same else f" (ranks {others} failed too)"
    return text


def raise_coded(code: int, message: str, cause: BaseException | None = None) -> NoReturn:
    """Raise the error of class code ``code`` (:func:`error_code`, at least 1) with ``message``."""
    raise CLASSES[min(max(code, 1), len(CLASSES)) - 1](message) from cause
