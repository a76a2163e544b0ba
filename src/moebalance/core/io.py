"""File input and output shared by every reader and writer: atomic writes, JSON reading, SIGTERM handling.

Atomic output: a writer writes to a temporary file in the destination folder, then renames it over the target,
so readers never see a partial file and a failed write leaves nothing behind. The file gets the ordinary
permissions ``0o666 & ~umask`` (``mkstemp`` would leave it private to the owner). A temporary is named
``.NAME.<pid>@<host>.<random>.tmp``: a process killed where it cannot clean up (SIGKILL, a power cut) leaves one
behind, and the next write of ``NAME`` removes every such file of this host whose process is gone
(docs/design.md, "Errors").

Atomic output folders (``--out-dir``): :func:`atomic_dir` yields an empty temporary folder beside the target
(``.NAME.<pid>@<host>.<random>.tmpdir``); when the body succeeds the old folder is renamed aside, the new one renamed
into place and the old one removed, so a reader sees all the old files or all the new ones, never a mix; when the
body fails the temporary folder is removed and the old folder is untouched. Only a folder moebalance wrote (it holds
:data:`OUT_DIR_MARK`), an empty one or a new one is replaced (:func:`check_out_dir`): never the current folder, one
above it or a folder of the user's own files (docs/design.md, "Errors").

:func:`read_json` reads a JSON document with the failures of a hand-edited or damaged file (missing, not
UTF-8, not JSON, nested past Python's recursion limit, an integer too long to convert) as one-line errors.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moebalance.core.errors import InputError, MoebalanceError

__all__ = ["OUT_DIR_MARK", "atomic_dir", "atomic_path", "atomic_write_text", "check_out_dir", "dumps",
           "install_sigterm_handler", "read_json", "remove_stale_temporaries", "save_png", "write_npz"]


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


#: The file that marks a folder as one moebalance wrote (an ``--out-dir``): :func:`atomic_dir` replaces such a folder
#: as a whole, and refuses to replace a folder of other files that lacks it.
OUT_DIR_MARK = ".moebalance-out"


def check_out_dir(path: str | os.PathLike[str], flag: str = "--out-dir") -> Path:
    """``path`` with symbolic links resolved, checked to be a folder :func:`atomic_dir` may replace as a whole: a new
    one, an empty one or one moebalance wrote (it holds :data:`OUT_DIR_MARK`). A file, the current folder or one
    above it, and a folder of other files are each a one-line :class:`InputError` naming ``flag``. Commands call it
    before their work too, so that a mistake costs no wait."""
    shown = f"{flag} {str(path)!r}"
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_dir():
        raise InputError(f"{shown} is a file; give a folder")
    try:
        cwd: Path | None = Path.cwd().resolve()
    except OSError:  # the current folder was removed: nothing of it to protect
        cwd = None
    if cwd is not None and (target == cwd or target in cwd.parents):
        raise InputError(f"{shown} is the current folder or one above it, and moebalance replaces its output folder "
                         f"as a whole; give a folder of its own, e.g. {flag} results")
    if target.is_dir() and not (target / OUT_DIR_MARK).is_file():
        try:
            first = min((p.name for p in target.iterdir()), default=None)
        except OSError as exc:
            raise InputError(f"cannot read {shown}: {exc.strerror or exc}") from None
        if first is not None:
            raise InputError(f"{shown} is not a folder moebalance wrote (it holds {first!r} but no {OUT_DIR_MARK}), "
                             "and moebalance replaces its output folder as a whole; give a new or empty folder, or "
                             "remove this one if it holds only old results")
    return target


def _remove_stale_folders(target: Path) -> None:
    """Remove the temporary and set-aside folders of ``target`` (``.NAME.<pid>@<host>.*.tmpdir`` and ``.old``) that a
    process of this host left when it was killed; those of live processes and other hosts are kept."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.([1-9]\d*)@{re.escape(_host())}\.[^.]+\.(tmpdir|old)$",
                         re.ASCII)
    try:
        candidates = list(target.parent.iterdir())
    except OSError:
        return
    for path in candidates:
        m = pattern.match(path.name)
        if m is not None and not _alive(int(m.group(1))) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def _swap_in(tmp: Path, target: Path) -> None:
    """Put folder ``tmp`` in the place of ``target``: the old folder renamed aside, ``tmp`` renamed into place, the old
    folder removed. Readers see the old folder or the new one (or, between the two renames, none). Tried again when
    another writer puts a folder there in between."""
    for _ in range(8):
        aside = target.parent / f".{target.name}.{os.getpid()}@{_host()}.{secrets.token_hex(4)}.old"
        old: Path | None = aside
        try:
            os.rename(target, aside)
        except FileNotFoundError:  # no folder yet (or another writer set it aside first)
            old = None
        try:
            os.rename(tmp, target)
        except OSError as exc:
            if old is not None:
                try:
                    os.rename(old, target)
                except OSError:  # another writer's folder took the place: it is newer than ours
                    shutil.rmtree(old, ignore_errors=True)
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                continue
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    raise OSError(errno.EBUSY, f"cannot put the new folder in the place of {str(target)!r}: other writers keep "
                               "replacing it")


@contextmanager
def atomic_dir(path: str | os.PathLike[str], flag: str = "--out-dir") -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; when the body succeeds it replaces ``path`` as a whole
    (with :data:`OUT_DIR_MARK` added), when it fails it is removed and ``path`` stays as it was.

    ``path`` is checked first (:func:`check_out_dir`; ``flag`` names it in errors) and stale temporary folders of
    killed processes are removed. Files written into the folder are read from ``path`` afterwards: text in them that
    names a file must name it under ``path``, never under the temporary folder.
    """
    target = check_out_dir(path, flag)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_folders(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}@{_host()}.", suffix=".tmpdir",
                                dir=target.parent))
    try:
        yield tmp
        (tmp / OUT_DIR_MARK).write_text("moebalance wrote this folder (--out-dir) and replaces it as a whole when it "
                                        "writes there again\n")
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is the owner's alone
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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


def _numpy_plain(value: Any) -> Any:
    """A numpy scalar or array as the Python number, bool or list it holds (``json.dumps``'s ``default``); anything
    else is the usual ``TypeError``."""
    import numpy as np

    if isinstance(value, np.bool_ | np.number | np.ndarray):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def dumps(obj: Any) -> str:
    """``obj`` as indented JSON with a final newline (the format of every JSON report we write). numpy scalars and
    arrays are written as the Python values they hold (``np.int64(3)`` as ``3``, an array as a list), so a count or
    a time summed by numpy needs no conversion first."""
    return json.dumps(obj, indent=2, default=_numpy_plain) + "\n"


def save_png(fig: Any, path: str | os.PathLike[str]) -> None:
    """Save a matplotlib figure as PNG atomically and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
