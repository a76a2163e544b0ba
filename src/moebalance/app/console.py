"""The command line's consoles, progress bar and output-path check, shared by its command modules."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moebalance.core.errors import InputError

__all__ = ["check_out", "drop_notes", "err", "flush_notes", "note", "out", "progress"]

# Wide enough for the comparison table when stdout is a file or a pipe (rich would assume 80 columns).
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)


#: Notes a command made (the model an engine file's shape named, the predictor libra chose), shown when it ends.
_notes: list[str] = []


def note(text: str) -> None:
    """Say ``text`` on stderr as ``note: text`` once the command has succeeded: a user mistake found later stays
    the one line ``moebalance: error: ...``."""
    _notes.append(text)


def flush_notes() -> None:
    """Print the notes made so far (after a command succeeded)."""
    for text in _notes:
        err.print(f"note: {text}")
    _notes.clear()


def drop_notes() -> None:
    """Forget the notes made so far (a command failed: its error line is all the user sees)."""
    _notes.clear()


def progress() -> Progress:
    """A progress bar on stderr, shown only on a terminal."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def check_out(path: str, suffix: str) -> Path:
    """An output file path ending in ``suffix`` that is not a folder."""
    p = Path(path)
    if p.suffix != suffix:
        raise InputError(f"output {path!r} must end in {suffix}")
    if p.exists() and p.is_dir():
        raise InputError(f"output {path!r} is a folder; give a file name ending in {suffix}")
    return p
