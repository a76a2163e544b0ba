"""Atomic file output: write to a temporary file in the destination folder, then rename over the target.

Readers never see a partial file, and a failed write leaves nothing behind. The file gets the ordinary
permissions ``0o666 & ~umask`` (``mkstemp`` would leave it private to the owner).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "atomic_write_text", "dumps", "save_png", "write_npz"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is renamed to ``path``, on error removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_npz(path: str | os.PathLike[str], arrays: dict[str, Any]) -> None:
    """Write ``arrays`` as a compressed ``.npz`` at ``path`` (which must end in ``.npz``), atomically."""
    import numpy as np

    from moebalance.core.errors import InputError

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
