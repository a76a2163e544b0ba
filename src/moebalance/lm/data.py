"""Two text domains present on every Python installation, so training and capture need no download.

- ``code``: the Python source of the running interpreter's standard library, the ``*.py`` files directly
  in ``sysconfig.get_paths()["stdlib"]`` (no sub-packages), sorted by name.
- ``prose``: English documentation prose shipped in the standard library as ``pydoc_data/topics.py``: the
  values of its ``topics`` dict (the Python Language Reference text that ``help()`` shows), sorted by key.

Each domain is one token stream, its documents in that order, each as ``<bos> bytes <eos>``. The stream is
cut into chunks of :data:`CHUNK` tokens; chunk ``j`` is **held out** when ``j % 10 == 9`` (every tenth chunk:
capture and evaluation text the model never trained on), else it is training text. (Whole documents would
not do: the prose has a few very long topics, and every tenth topic is 2% of the text.) A split is its
chunks concatenated in order, cut at a token budget.
Everything is deterministic for one Python version; :func:`provenance` records what was read (paths,
Python version, SHA-256 of each split) so a checkpoint names the exact text it was trained on.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moebalance.core.errors import InputError
from moebalance.lm.moe_lm import BOS, EOS

__all__ = ["CHUNK", "DOMAINS", "HELD_OUT_EVERY", "Domain", "Split", "domain_documents", "domain_tokens", "provenance",
           "text_tokens"]

Domain = Literal["code", "prose"]
Split = Literal["train", "heldout"]
DOMAINS: tuple[Domain, ...] = ("code", "prose")
#: Chunk ``j`` of a domain's stream is held out when ``j % HELD_OUT_EVERY == HELD_OUT_EVERY - 1``.
HELD_OUT_EVERY = 10
#: Tokens per chunk of the train / held-out split.
CHUNK = 4096


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code_documents() -> Iterator[tuple[str, bytes]]:
    root = _stdlib()
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise InputError(f"no Python source files in the standard library folder {str(root)!r}")
    return ((p.name, p.read_bytes()) for p in files)  # read lazily: a budget may need only the first files


def _prose_documents() -> Iterator[tuple[str, bytes]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise InputError("this Python has no pydoc_data.topics module (the prose domain); give --text FILE") from None
    return ((key, str(topics[key]).encode("utf-8")) for key in sorted(topics))


def _documents(domain: Domain) -> Iterator[tuple[str, bytes]]:
    if domain == "code":
        return _code_documents()
    if domain == "prose":
        return _prose_documents()
    raise InputError(f"unknown domain {domain!r}; choose one of: {', '.join(DOMAINS)}")


def domain_documents(domain: Domain) -> list[tuple[str, bytes]]:
    """``[(name, bytes)]`` of every document of ``domain``, in the fixed order."""
    return list(_documents(domain))


def _stream(docs: Iterable[tuple[str, bytes]], need: int | None = None) -> np.ndarray:
    """The documents as ``<bos> bytes <eos>``, concatenated; stops reading once ``need`` tokens are there."""
    parts: list[np.ndarray] = []
    size = 0
    for _, data in docs:
        parts.append(np.concatenate([[BOS], np.frombuffer(data, dtype=np.uint8).astype(np.int64), [EOS]]))
        size += parts[-1].size
        if need is not None and size >= need:
            break
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _split(stream: np.ndarray, split: Split, budget: int | None) -> np.ndarray:
    chunk = np.arange(stream.size) // CHUNK
    held = chunk % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    out = stream[held] if split == "heldout" else stream[~held]
    return out if budget is None else out[:budget]


def _stream_needed(split: Split, budget: int) -> int:
    """Stream tokens that hold at least ``budget`` tokens of ``split`` (held out: 1 chunk in 10)."""
    if split == "heldout":
        return HELD_OUT_EVERY * (budget + CHUNK)
    return budget + budget // (HELD_OUT_EVERY - 1) + 2 * CHUNK


def domain_tokens(domain: Domain, split: Split, budget: int | None = None) -> np.ndarray:
    """``int64 [n]``: the token stream of one split of ``domain``, at most ``budget`` tokens.

    With a budget only the documents it needs are read; the result is the same prefix either way.
    """
    if split not in ("train", "heldout"):
        raise InputError(f"split ({split!r}) must be 'train' or 'heldout'")
    if budget is not None and budget < 1:
        raise InputError(f"token budget ({budget}) must be positive")
    need = None if budget is None else _stream_needed(split, budget)
    return _split(_stream(_documents(domain), need), split, budget)


def text_tokens(path: str | Path, budget: int | None = None) -> np.ndarray:
    """``int64 [n]``: ``<bos>`` and the bytes of a text file, at most ``budget`` tokens."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"text file {str(p)!r} does not exist")
    data = p.read_bytes()
    if not data:
        raise InputError(f"text file {str(p)!r} is empty")
    out = _stream([(p.name, data)])
    return out if budget is None else out[:budget]


def provenance(budgets: dict[str, dict[str, int | None]]) -> dict[str, Any]:
    """What the splits are made of: source, Python version, documents and a SHA-256 of each split's tokens.

    ``budgets[domain][split]`` is the token budget used for that split (``None``: all of it).
    """
    out: dict[str, Any] = {
        "python_version": sys.version.split()[0],
        "python_implementation": sys.implementation.name,
        "held_out_rule": f"chunk j (tokens j*{CHUNK} .. (j+1)*{CHUNK}-1 of the domain stream) is held out when "
                         f"j % {HELD_OUT_EVERY} == {HELD_OUT_EVERY - 1}",
        "layout": "<bos> document bytes <eos>, documents concatenated in order",
    }
    for domain in budgets:
        docs = domain_documents(domain)  # type: ignore[arg-type]
        if domain == "code":
            source = {"kind": "Python standard library source", "path": str(_stdlib()), "glob": "*.py (sorted)"}
        else:
            import pydoc_data.topics as mod

            source = {"kind": "Python documentation prose (pydoc_data.topics.topics values, sorted by key)",
                      "path": str(mod.__file__)}
        splits: dict[str, Any] = {}
        for split, budget in budgets[domain].items():
            toks = domain_tokens(domain, split, budget)  # type: ignore[arg-type]
            splits[split] = {"tokens": int(toks.size), "budget": budget,
                             "sha256": hashlib.sha256(toks.astype("<u2").tobytes()).hexdigest()}
        out[domain] = {**source, "documents": len(docs), "stream_tokens": int(sum(len(b) + 2 for _, b in docs)),
                       "first_documents": [n for n, _ in docs[:3]], **splits}
    return out
