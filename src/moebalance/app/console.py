"""The command line's consoles, progress bar, first-compile notice and output-path check, shared by its command
modules."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moebalance.core.errors import InputError

__all__ = ["COMPILING", "announce_compiles", "check_out", "drop_notes", "err", "flush_notes", "note", "out", "progress",
           "step", "write_files"]

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


@contextmanager
def step(description: str) -> Iterator[None]:
    """A step of unknown length (reading or writing a large file) on :func:`progress`'s bar: its description, a
    pulsing bar and the time elapsed, while the ``with`` block runs."""
    with progress() as bar:
        bar.add_task(description, total=None)
        yield


def write_files(files: Sequence[tuple[str, Callable[[], object]]]) -> None:
    """Write ``files``, ``(name, write)`` pairs, one after another on :func:`progress`'s bar: ``writing NAME`` while
    ``write()`` makes the file ``name``, and how many are written (a report's charts and its page each take a
    while). Nothing may be printed on stdout meanwhile: the bar is drawn over the terminal until the last is
    written."""
    with progress() as bar:
        task = bar.add_task("writing", total=len(files))
        for name, write in files:
            bar.update(task, description=f"writing {name}", refresh=True)
            write()
            bar.advance(task)


#: What :func:`announce_compiles` says, once, before numba compiles the first of moebalance's kernels.
COMPILING = ("compiling moebalance's numba kernels (a first run only, up to a few minutes: later runs load them from "
             "numba's cache; `python -m moebalance.algorithms.jit` compiles them all at once)...")

#: Whether the listener is installed and whether it has spoken: once per process, however often ``main`` runs in it.
_notice = {"installed": False, "said": False}


def announce_compiles() -> None:
    """Say :data:`COMPILING` on stderr, on a terminal (as the progress bar), when numba starts compiling the first
    kernel of moebalance in this process. numba compiles a kernel only when its cache holds no code for it (a fresh
    install, an edited source; :mod:`moebalance.algorithms.jit`), so a run that finds the kernels cached says
    nothing; its ``numba:compile`` event starts a compilation only, never a load from the cache."""
    if _notice["installed"] or not err.is_terminal:
        return
    from numba.core import event  # only here: a run that shows nothing imports no numba for it

    class Notice(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            dispatcher = (ev.data or {}).get("dispatcher")
            module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
            if not _notice["said"] and module.startswith("moebalance.") and err.is_terminal:
                _notice["said"] = True
                err.print(COMPILING, markup=False)

        def on_end(self, ev: event.Event) -> None:
            pass

    _notice["installed"] = True
    event.register("numba:compile", Notice())


def check_out(path: str, suffix: str) -> Path:
    """An output file path ending in ``suffix`` that is not a folder."""
    p = Path(path)
    if p.suffix != suffix:
        raise InputError(f"output {path!r} must end in {suffix}")
    if p.exists() and p.is_dir():
        raise InputError(f"output {path!r} is a folder; give a file name ending in {suffix}")
    return p
