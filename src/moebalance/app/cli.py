"""The ``moebalance`` command line: the top parser, one sub-parser per command module, and the exit codes.

User mistakes (bad files, bad budgets, unknown names, abbreviated or unknown options) print one line
``moebalance: error: ...`` and exit 2, leaving no output file behind; an interrupt exits 130. Long steps show a
progress bar on stderr. Each command is a module of :mod:`moebalance.app.commands`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

import moebalance
from moebalance.app.commands import COMMANDS
from moebalance.app.console import drop_notes, flush_notes
from moebalance.core.errors import MoebalanceError
from moebalance.core.io import install_sigterm_handler

__all__ = ["Parser", "build_parser", "main"]


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, exit code 2, and no abbreviated options (an abbreviation would change meaning
    when a longer option is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"moebalance: error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moebalance", description="Plan, score and compare expert placements for MoE inference.")
    parser.add_argument("--version", action="version", version=f"moebalance {moebalance.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (a scheduler, torchrun's agent, `kill`) stops a command as Ctrl-C does: no temporary file is left
    previous = install_sigterm_handler() if threading.current_thread() is threading.main_thread() else None
    try:
        args.func(args)
        flush_notes()
    except MoebalanceError as exc:
        drop_notes()
        sys.stderr.write(f"moebalance: error: {exc}\n")
        return 2
    except OSError as exc:  # unwritable output folder, disk full, ...
        drop_notes()
        sys.stderr.write(f"moebalance: error: {exc.strerror or exc}: {exc.filename or ''}\n")
        return 2
    except MemoryError:  # a size no check foresaw: still one line, never a traceback
        drop_notes()
        sys.stderr.write("moebalance: error: out of memory; the inputs ask for more than this machine (or its ulimit) "
                         "holds: use fewer GPUs, slots, batches or tokens\n")
        return 2
    except KeyboardInterrupt:
        drop_notes()
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
