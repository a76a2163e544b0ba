"""The ``moebalance`` command line: the top parser, one sub-parser per command module, and the exit codes.

User mistakes (bad files, bad budgets, unknown names, abbreviated or unknown options) print one line
``moebalance: error: ...`` and exit 2, leaving no output file behind; an interrupt exits 130. Long steps show a
progress bar on stderr, and a first run says that it compiles numba's kernels. Each command is a module of
:mod:`moebalance.app.commands`, imported only when it runs (``--help`` imports none).
"""

from __future__ import annotations

import argparse
import difflib
import re
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

import moebalance
from moebalance.app import commands
from moebalance.core.errors import MoebalanceError
from moebalance.core.io import install_sigterm_handler

__all__ = ["CommandParser", "Parser", "build_parser", "main"]


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, exit code 2, and no abbreviated options (an abbreviation would change meaning
    when a longer option is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"moebalance: error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(2)


#: What argparse reads as a number rather than an option (``--seed -1``).
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class CommandParser(Parser):
    """A command's parser: an option it does not have is named, with the closest one it has, before any other check
    (argparse would first say that a required option is missing when the unknown one is that option misspelled)."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if args is not None:
            self._refuse_unknown(list(args))
        return super().parse_known_args(args, namespace)

    def _refuse_unknown(self, args: list[str]) -> None:
        """One line naming the first token argparse would read as an option this command lacks."""
        for arg in args:
            if arg == "--":  # the rest are positional
                return
            if not arg.startswith("-") or arg == "-" or _NUMBER.match(arg) or " " in arg:
                continue
            name = arg.split("=", 1)[0] if arg.startswith("--") else arg
            if name in self._option_string_actions:
                continue
            shown = [s for a in self._actions if a.help != argparse.SUPPRESS for s in a.option_strings]
            close = difflib.get_close_matches(name.lstrip("-"), [s.lstrip("-") for s in shown], n=1, cutoff=0.6)
            best = next((s for s in shown if close and s.lstrip("-") == close[0]), None)
            self.error(f"unrecognized option {name}" + (f"; did you mean {best}?" if best else ""))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's options, or with ``only`` that command's alone (the others are
    their name and summary, which is all ``moebalance --help`` and a wrong command name show), so that parsing
    imports one command's module, not every module's torch, scipy and numba."""
    parser = Parser(prog="moebalance", description="Plan, score and compare expert placements for MoE inference.")
    parser.add_argument("--version", action="version", version=f"moebalance {moebalance.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, summary in commands.SUMMARIES.items():
        if only is None or name == only:
            commands.load(name).add_parser(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def _command(argv: Sequence[str]) -> str:
    """The command ``argv`` names: its first token that is not an option (the top parser's only options are
    ``--help`` and ``--version``, which take no value); ``""`` when it names none."""
    return next((arg for arg in argv if not arg.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # SIGTERM (a scheduler, torchrun's agent, `kill`) stops a command as Ctrl-C does: no temporary file is left.
    # Installed before the parser imports the command's module (torch, numba: seconds), when a signal may come too.
    previous = install_sigterm_handler() if threading.current_thread() is threading.main_thread() else None
    try:
        return _run(build_parser(_command(argv)).parse_args(argv))
    except KeyboardInterrupt:  # before the command started (its module was being imported)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command: 0, or 2 with one line for a user mistake, or 130 on an interrupt."""
    from moebalance.app.console import announce_compiles, drop_notes, flush_notes  # rich: --help needs none

    announce_compiles()  # a first run compiles numba's kernels for minutes: it says so, once, on a terminal
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
