"""File input and output shared by every reader and writer: atomic writes, JSON reading, SIGTERM handling.

Atomic output: a writer writes to a temporary file in the destination folder, then renames it over the target,
so readers never see a partial file and a failed write leaves nothing behind. The file gets the ordinary
permissions ``0o666 & ~umask`` (``mkstemp`` would leave it private to the owner). A temporary is named
``.NAME.<pid>@<host>.<random>.tmp``: a process killed where it cannot clean up (SIGKILL, a power cut) leaves one
behind, and the next write of ``NAME`` removes every such file of this host whose process is gone
(docs/design.md, "Errors").

:func:`read_json` reads a JSON document with the failures of a hand-edited or damaged file (missing, not
UTF-8, not JSON, nested past Python's recursion limit, an integer too long to convert) as one-line errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moebalance.core.errors import InputError, MoebalanceError

__all__ = ["atomic_path", "atomic_write_text", "dumps", "install_sigterm_handler", "read_json",
           "remove_stale_temporaries", "save_png", "write_npz"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _host() -> str:
    """This host's name for temporary names: as it is when it is at most 32 characters of ``[A-Za-z0-9_-]``, else
    its first 23 such characters and 8 hex digits of its SHA-256, so that two hosts whose names share a long prefix
    or differ only in other characters (``a.b``, ``a-b``) never take each other's temporaries for their own."""
    name = socket.gethostname()
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", name)
    if safe == name and 0 < len(name) <= 32:
        return name
    return f"{safe[:23]}-{hashlib.sha256(name.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process; or a number no process has: not ours to judge
        return True
    return True


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporaries of ``target`` (``.NAME.<pid>@<host>.*.tmp``) that a process of this host left when it
    was killed; returns them. Those of live processes, of other hosts and of other names are kept."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.([1-9]\d*)@{re.escape(_host())}\.[^.]+\.tmp$", re.ASCII)
    removed: list[Path] = []
    try:
        candidates = list(target.parent.iterdir())
    except OSError:
        return removed
    for path in candidates:
        m = pattern.match(path.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            path.unlink()
        except FileNotFoundError:  # another writer removed it first
            continue
        except OSError:  # not ours to remove (permissions): it stays, as it would have before
            continue
        removed.append(path)
    return removed


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is renamed to ``path``, on error removed.

    Stale temporaries of ``path`` left by killed processes are removed first (:func:`remove_stale_temporaries`).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}@{_host()}.", suffix=".tmp",
                                    dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def install_sigterm_handler() -> Any:
    """Make SIGTERM raise :class:`KeyboardInterrupt` in the main thread, as SIGINT does, so that ``finally`` blocks
    run and :func:`atomic_path` removes its temporary file; returns the previous handler.

    Call it once from a command-line entry point (it must run in the main thread); a library never installs it.
    """
    return signal.signal(signal.SIGTERM, _raise_interrupt)


def read_json(path: str | os.PathLike[str], what: str, *, error: type[MoebalanceError] = InputError) -> Any:
    """The JSON document in ``path``; every way the file can be unreadable is one line of ``error``.

    ``what`` names the file for the user (``"plan file"``, ``"SGLang load"``): messages read
    ``plan file 'p.json' is not valid JSON (...)``.
    """
    p = Path(path)
    name = f"{what} {str(p)!r}"
    if not p.exists():
        raise error(f"{name} does not exist")
    if not p.is_file():
        raise error(f"{name} is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{name} is not UTF-8 text, so not JSON; is it a binary file?") from None
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{name} is not valid JSON ({str(exc).splitlines()[0]}); is it truncated?") from None
    except RecursionError:
        raise error(f"{name} nests too deeply to read (arrays or objects inside each other past Python's "
                    "recursion limit); is it damaged?") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise error(f"{name} holds a value that cannot be read ({str(exc).splitlines()[0]}); is it damaged?") from None


def write_npz(path: str | os.PathLike[str], arrays: dict[str, Any]) -> None:
    """Write ``arrays`` as a compressed ``.npz`` at ``path`` (which must end in ``.npz``), atomically."""
    import numpy as np

    p = Path(path)
    if p.suffix != ".npz":
        raise InputError(f"output {str(p)!r} must end in .npz")
    with atomic_path(p) as tmp, open(tmp, "wb") as fh:
        np.savez_compressed(fh, **arrays)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so no partial file is ever seen."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def dumps(obj: Any) -> str:
    """``obj`` as indented JSON with a final newline (the format of every JSON report we write)."""
    return json.dumps(obj, indent=2) + "\n"


def save_png(fig: Any, path: str | os.PathLike[str]) -> None:
    """Save a matplotlib figure as PNG atomically and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
