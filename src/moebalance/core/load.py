"""Load matrices ``counts [B, L, E]`` and the files that hold them.

A load matrix counts the tokens routed to expert ``e`` of layer ``l`` in batch ``b`` (a token picked by top-k
counts once per picked expert), as CRAFT's offline load distribution ``W`` (CRAFT Appendix A, Alg. 1).
Files (``docs/design.md``, "Data formats"): ``.npy`` holding ``[L, E]`` or ``[B, L, E]``, or ``.npz`` with key ``counts`` and, for a
token-level trace, ``topk_ids``, ``src_gpu`` and ``batch``. Nothing is ever unpickled.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.io import write_npz
from moebalance.core.limits import MAX_TOKENS, check_alloc
from moebalance.core.trace import RoutingTrace
from moebalance.models import MODELS, ModelSpec

__all__ = ["BUNDLED_PREFIX", "LM_PRESET", "LoadMatrix", "bundled_names", "check_counts", "check_preset",
           "check_same_model", "concatenate_loads", "parse_batch_range", "preset_names", "read_bundled", "read_load", "write_load"]

_TOKEN_KEYS = ("topk_ids", "src_gpu", "batch")

#: ``preset`` of the traces that ``moebalance capture`` records with the bundled MoE LM (``moebalance.lm``).
LM_PRESET = "moebalance-moe-lm"


def preset_names() -> list[str]:
    """The names a load's ``preset`` may hold: the models of :data:`moebalance.models.MODELS` and
    :data:`LM_PRESET`."""
    return [*sorted(MODELS), LM_PRESET]


def check_preset(name: object, source: str = "load") -> str:
    """``name`` if it is a known preset (:func:`preset_names`), else a one-line :class:`InputError`."""
    known = preset_names()
    if not isinstance(name, str) or name not in known:
        raise InputError(f"{source}: preset {name!r} is not a known model; name one of {', '.join(known)} (or "
                         "drop 'preset')")
    return name


def check_counts(value: object, name: str = "counts") -> np.ndarray:
    """Validate a load array and return it as ``int64 [B, L, E]`` (a 2-D ``[L, E]`` is one batch).

    Counts are whole, non-negative and below :data:`~moebalance.core.limits.MAX_TOKENS`, and so is their total,
    so that no sum of them wraps int64. Floating-point counts are converted exactly (or refused).
    """
    arr = np.asarray(value)
    if arr.dtype == object:
        raise InputError(f"{name} is an object array; store plain integer counts")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise InputError(f"{name} has dtype {arr.dtype}; it must hold non-negative integer token counts")
    if arr.ndim not in (2, 3):
        raise InputError(f"{name} has shape {arr.shape}; expected [L, E] or [B, L, E]")
    if 0 in arr.shape:
        raise InputError(f"{name} has shape {arr.shape}; every dimension must be at least 1")
    if arr.ndim == 2:
        arr = arr[None]
    if np.issubdtype(arr.dtype, np.floating):
        if arr.dtype.itemsize < 8:  # exact; float16 cannot even hold the limit below
            arr = arr.astype(np.float64)
        if not np.all(np.isfinite(arr)):
            bad = _first(~np.isfinite(arr))
            raise InputError(f"{name}{list(bad)} is {arr[bad]}; counts must be finite")
        if np.any(arr != np.round(arr)):
            bad = _first(arr != np.round(arr))
            raise InputError(f"{name}{list(bad)} is {arr[bad]}; counts must be whole numbers of tokens")
    if arr.min() < 0:
        bad = _first(arr < 0)
        raise InputError(f"{name}{list(bad)} is {arr[bad]}; counts must be non-negative")
    peak = arr.max()
    if peak >= MAX_TOKENS:
        bad = _first(arr >= MAX_TOKENS)
        raise InputError(f"{name}{list(bad)} is {arr[bad]:.4g}; counts must be below 2**62 tokens")
    if int(peak) * arr.size >= MAX_TOKENS:  # Python ints: the bound cannot wrap; only then the exact total
        total = _exact_total(arr)
        if total >= MAX_TOKENS:
            B, L, E = arr.shape
            raise InputError(f"{name} sums to {total:.4g} tokens over its {B} batches x {L} layers x {E} experts; "
                             "the total must be below 2**62 so that no sum of counts wraps int64: store token "
                             "counts, not scaled values")
    return arr.astype(np.int64, copy=False)


def _exact_total(arr: np.ndarray) -> int:
    """The exact sum of whole non-negative counts below ``2**62``, as a Python int (float64 would round near the
    limit): each count split into its high and low 31 bits, summed in int64 chunks that cannot wrap."""
    flat = arr.reshape(-1)
    total = 0
    step = 1 << 24  # a chunk's sum of 31-bit halves stays below 2**55
    for start in range(0, flat.size, step):
        part = flat[start:start + step].astype(np.int64)
        total += (int((part >> 31).sum()) << 31) + int((part & ((1 << 31) - 1)).sum())
    return total


def _first(mask: np.ndarray) -> tuple[int, ...]:
    """The index of the first true entry of ``mask`` (one is known to exist)."""
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))


@dataclass(frozen=True, slots=True)
class LoadMatrix:
    """Per-batch expert load ``counts [B, L, E]``, optionally with the token-level trace behind it.

    Example: ``LoadMatrix(np.array([[[3, 1], [0, 4]]]))`` is one batch, two layers of two experts.
    """

    #: ``int64 [B, L, E]``: tokens routed to expert ``e`` of layer ``l`` in batch ``b``.
    counts: np.ndarray
    #: The token-level trace whose counts these are, if known.
    trace: RoutingTrace | None = None
    #: Name of the model the data was generated for or captured from, if any: a key of
    #: :data:`moebalance.models.MODELS`, or :data:`LM_PRESET` (anything else is refused, :func:`preset_names`);
    #: stored in ``.npz`` files as ``preset``.
    preset: str | None = None
    #: ``int64 [L]``: the model's decoder-layer index of each layer, strictly increasing, when the load leaves dense
    #: layers out (token-level engine dumps); ``None``: layer ``l`` is the model's layer ``l`` (dense layers, if
    #: any, are all-zero rows). Stored in ``.npz`` files as ``layer_ids``.
    layer_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        counts = check_counts(self.counts)
        object.__setattr__(self, "counts", counts)
        if self.preset is not None:
            check_preset(self.preset)
        if self.layer_ids is not None:
            ids = np.asarray(self.layer_ids)
            if ids.ndim != 1 or ids.size != counts.shape[1] or not np.issubdtype(ids.dtype, np.integer) \
                    or (ids.size and (ids.min() < 0 or np.any(np.diff(ids) <= 0))):
                raise InputError(f"layer_ids {ids.tolist()} must be {counts.shape[1]} increasing non-negative "
                                 "integers: the model's layer index of each layer")
            object.__setattr__(self, "layer_ids", ids.astype(np.int64))
        if self.trace is not None:
            tr = self.trace
            if (tr.num_batches, tr.num_layers, tr.num_experts) != counts.shape:
                raise InputError(
                    f"the token-level arrays describe [B, L, E] = {[tr.num_batches, tr.num_layers, tr.num_experts]} "
                    f"but counts has shape {list(counts.shape)}"
                )
            implied = tr.counts()
            if not np.array_equal(implied, counts):
                bad = tuple(int(i) for i in np.argwhere(implied != counts)[0])
                raise InputError(
                    f"counts{list(bad)} is {counts[bad]} but topk_ids routes {implied[bad]} tokens there; "
                    "counts must equal what topk_ids implies (drop counts to recompute it)"
                )

    @property
    def model(self) -> ModelSpec | None:
        """The :class:`~moebalance.models.ModelSpec` named by ``preset``; ``None`` if unnamed or :data:`LM_PRESET`.

        Example: ``read_bundled("mixtral-8x7b-tokens").model.top_k == 2``.
        """
        return None if self.preset is None else MODELS.get(self.preset)

    def check_model(self, spec: ModelSpec, *, what: str = "the load", fix: str = "give the load's --model") -> None:
        """Refuse ``spec`` where it is not this load's model (:meth:`moebalance.models.ModelSpec.misfit`, with the
        layer ids the load recorded, else the rows that carry load: a dense layer has none), in one line."""
        ids = None if self.layer_ids is None else [int(i) for i in self.layer_ids]
        loaded = None if ids is not None else (self.counts.sum(axis=(0, 2)) > 0).tolist()
        spec.check_fits(self.num_layers, self.num_experts, ids, loaded, what=what, fix=fix)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B, L, E)``: batches, layers, experts."""
        B, L, E = (int(n) for n in self.counts.shape)
        return B, L, E

    num_batches = property(lambda self: self.shape[0], doc="``B``: batches.")
    num_layers = property(lambda self: self.shape[1], doc="``L``: MoE layers.")
    num_experts = property(lambda self: self.shape[2], doc="``E``: experts per layer.")

    def total(self) -> np.ndarray:
        """``int64 [L, E]``: the load summed over batches."""
        return self.counts.sum(axis=0)

    def select_batches(self, start: int, stop: int) -> LoadMatrix:
        """Batches ``start <= b < stop`` (Python slice semantics, clipped to the data)."""
        start, stop, _ = slice(start, stop).indices(self.num_batches)
        if stop <= start:
            raise InputError(
                f"batch range {start}:{stop} is empty; the load has {self.num_batches} batches (valid: 0:{self.num_batches})"
            )
        trace = None if self.trace is None else self.trace.select_batches(start, stop)
        return LoadMatrix._checked(self.counts[start:stop], trace, self.preset, self.layer_ids)

    @classmethod
    def _checked(cls, counts: np.ndarray, trace: RoutingTrace | None, preset: str | None,
                 layer_ids: np.ndarray | None) -> LoadMatrix:
        """A load from parts of a validated one (a batch range): counts are not recounted from the trace."""
        load = object.__new__(cls)
        for name, value in (("counts", counts), ("trace", trace), ("preset", preset), ("layer_ids", layer_ids)):
            object.__setattr__(load, name, value)
        return load

    def split(self, train_frac: float) -> tuple[LoadMatrix, LoadMatrix]:
        """Split into (planning, held-out scoring) batches, the first ``train_frac`` for planning (CRAFT 5.1).

        ``train_frac == 1`` plans and scores on all batches (in-sample).
        """
        if not 0.0 < train_frac <= 1.0:
            raise InputError(f"train fraction ({train_frac}) must be in (0, 1]")
        if train_frac == 1.0:
            return self, self
        if self.num_batches < 2:
            raise InputError(
                "the load has 1 batch, so none can be held out for scoring; give more batches or --train-frac 1"
            )
        cut = min(max(1, round(self.num_batches * train_frac)), self.num_batches - 1)
        return self.select_batches(0, cut), self.select_batches(cut, self.num_batches)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The ``.npz`` contents of this load (``docs/design.md``, "Data formats")."""
        out: dict[str, np.ndarray] = {"counts": self.counts}
        if self.trace is not None:
            out["topk_ids"] = self.trace.topk_ids
            out["src_gpu"] = self.trace.src_gpu
            out["batch"] = self.trace.batch
        if self.preset is not None:
            out["preset"] = np.array(self.preset)
        if self.layer_ids is not None:
            out["layer_ids"] = self.layer_ids
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], source: str = "input") -> LoadMatrix:
        """Build from ``.npz``-style arrays: ``counts`` and/or ``topk_ids`` + ``src_gpu`` + ``batch``."""
        present = [k for k in _TOKEN_KEYS if k in arrays]
        if present and len(present) != len(_TOKEN_KEYS):
            missing = [k for k in _TOKEN_KEYS if k not in arrays]
            raise InputError(f"{source} has {', '.join(present)} but lacks {', '.join(missing)}; a token-level trace needs all three")
        if "counts" not in arrays and not present:
            raise InputError(f"{source} has no 'counts' array (keys: {sorted(arrays)}); save counts [B, L, E] under 'counts'")
        preset = None
        if "preset" in arrays:
            p = np.asarray(arrays["preset"])
            if p.dtype.kind != "U" or p.ndim != 0:
                raise InputError(f"{source}: 'preset' must be a 0-d string array, got {p.dtype} {p.shape}")
            preset = check_preset(str(p), source)
        trace = None
        if present:
            counts = check_counts(arrays["counts"]) if "counts" in arrays else None
            ids = np.asarray(arrays["topk_ids"])
            if counts is not None:
                num_experts, num_batches = counts.shape[2], counts.shape[0]
            else:
                if ids.dtype == object or not np.issubdtype(ids.dtype, np.integer):
                    raise InputError(f"topk_ids has dtype {ids.dtype}; it must hold integer expert ids")
                num_experts = int(ids.max()) + 1 if ids.size else 1
                num_batches = -1
            trace = RoutingTrace(ids, arrays["src_gpu"], arrays["batch"], num_experts=num_experts, num_batches=num_batches)
            if counts is None:
                counts = trace.counts()
            return cls(counts, trace, preset, arrays.get("layer_ids"))
        return cls(arrays["counts"], None, preset, arrays.get("layer_ids"))


#: Prefix naming a trace shipped with the package: ``bundled:mixtral-8x7b-tokens``.
BUNDLED_PREFIX = "bundled:"


def bundled_names() -> list[str]:
    """Names of the traces shipped in ``moebalance/data`` (``bundled:NAME`` loads one)."""
    from importlib import resources

    return sorted(f.name.removesuffix(".npz").replace("_", "-")
                  for f in (resources.files("moebalance.workloads") / "data").iterdir() if f.name.endswith(".npz"))


def read_bundled(name: str) -> LoadMatrix:
    """The bundled trace ``name`` (see :func:`bundled_names`; ``docs/synth.md`` says how each was made)."""
    from importlib import resources

    if name not in bundled_names():
        raise InputError(f"no bundled trace {name!r}; bundled: {', '.join(bundled_names())}")
    with resources.as_file(resources.files("moebalance.workloads") / "data" / (name.replace("-", "_") + ".npz")) as p:
        return read_load(p)


def read_load(path: str | os.PathLike[str]) -> LoadMatrix:
    """Read a ``.npy`` or ``.npz`` load file without unpickling anything; errors name the problem.

    ``bundled:NAME`` reads a trace shipped with the package (:func:`bundled_names`).
    """
    if isinstance(path, str) and path.startswith(BUNDLED_PREFIX):
        return read_bundled(path.removeprefix(BUNDLED_PREFIX))
    p = Path(path)
    if not p.exists():
        raise InputError(f"load file {str(p)!r} does not exist")
    if p.suffix not in (".npy", ".npz"):
        raise InputError(f"load file {str(p)!r} must end in .npy ([L, E] or [B, L, E] counts) or .npz")
    try:
        if p.suffix == ".npy":
            arrays = {"counts": np.asarray(np.load(p, allow_pickle=False))}
        else:
            arrays = _read_npz(p)
    except InputError:
        raise  # already names the file and the fix
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as exc:
        raise InputError(f"cannot read {str(p)!r}: {_why(exc)}") from None
    except MemoryError:
        raise InputError(f"cannot read {str(p)!r}: its header claims an array larger than memory "
                         "(is the file damaged?)") from None
    return LoadMatrix.from_arrays(arrays, source=str(p))


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an ``.npz``; ``topk_ids`` read by :func:`_read_ids` (compact, in pieces or memory-mapped)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files if k != "topk_ids"}
        if "topk_ids" in data.files:
            counts = arrays.get("counts")
            num_experts = int(counts.shape[-1]) if counts is not None and counts.ndim in (2, 3) else None
            member = "topk_ids.npy" if "topk_ids.npy" in data.zip.namelist() else "topk_ids"
            arrays["topk_ids"] = _read_ids(path, data.zip, member, num_experts)
    return arrays


_CHUNK_BYTES = 1 << 26  # a wide id array is converted 64 MB of the file at a time
#: Ids larger than this (in their compact type) that cannot be mapped from the file are spilled to a temporary file
#: and mapped (:func:`_read_ids`).
SPILL_BYTES = 1 << 28


def _read_ids(path: Path, zf: zipfile.ZipFile, member: str, num_experts: int | None) -> np.ndarray:
    """The ``topk_ids`` member of an ``.npz`` without holding it in a wider type than the trace keeps.

    - stored uncompressed (``numpy.savez``) as ``int16``/``int32``: memory-mapped, read-only, no copy;
    - compressed, or stored as 64-bit integers: decompressed and converted piece by piece into the compact type
      of ``num_experts`` (:func:`moebalance.core.tally.id_dtype`; without ``counts`` in the file, ``E`` is the
      largest id + 1, found in a first pass). Ids of more than :data:`SPILL_BYTES` in that type go to a
      temporary file (unlinked at once: it vanishes with the process) that is then memory-mapped like a stored
      member, so a trace never sits in memory whole; smaller ones are held in memory;
    - anything else: read as it is (``RoutingTrace`` then checks and converts it).
    """
    from moebalance.core.tally import id_dtype

    info = zf.getinfo(member)
    with zf.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        if version not in ((1, 0), (2, 0)):
            return _plain(zf, member)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(fh)
        header_len = fh.tell()
    if fortran or dtype.hasobject or dtype.kind not in "iu" or len(shape) != 3:
        return _plain(zf, member)
    native = dtype.newbyteorder("=") == dtype
    if dtype.itemsize <= 4 and info.compress_type == zipfile.ZIP_STORED and native and not info.flag_bits & 0x1:
        with open(path, "rb") as raw:  # the member's data starts after its local header (fixed 30 bytes + names)
            raw.seek(info.header_offset + 26)
            name_len, extra_len = np.frombuffer(raw.read(4), dtype="<u2")
        offset = info.header_offset + 30 + int(name_len) + int(extra_len) + header_len
        return np.asarray(np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape))
    if dtype.itemsize <= 4 and int(np.prod(shape)) * dtype.itemsize <= SPILL_BYTES:
        return _plain(zf, member)
    row_bytes = dtype.itemsize * int(np.prod(shape[1:]))  # one token's ids
    rows = max(1, _CHUNK_BYTES // max(1, row_bytes))

    def pieces() -> Iterator[np.ndarray]:
        with zf.open(info) as fh:
            fh.seek(header_len)
            for lo in range(0, shape[0], rows):
                n = min(rows, shape[0] - lo)
                data = fh.read(n * row_bytes)
                if len(data) < n * row_bytes:
                    raise InputError(f"{str(path)!r}: topk_ids ends after about {lo + len(data) // row_bytes} of its "
                                     f"{shape[0]} tokens (is the file damaged?)")
                yield np.frombuffer(data, dtype=dtype).reshape((n, *shape[1:]))

    if num_experts is None:  # no counts to say E: the largest id says it
        hi = max((int(piece.max()) for piece in pieces() if piece.size), default=0)
        if hi >= np.iinfo(np.int32).max:
            raise InputError(f"{str(path)!r}: topk_ids holds expert id {hi}; ids must be below 2**31 - 1 (is the "
                             "file damaged?)")
        num_experts = hi + 1
    target = id_dtype(max(1, num_experts))
    lo_ok, hi_ok = np.iinfo(target).min, np.iinfo(target).max
    nbytes = int(np.prod(shape)) * target.itemsize

    def checked() -> Iterator[np.ndarray]:
        for piece in pieces():
            if piece.size and (int(piece.min()) < lo_ok or int(piece.max()) > hi_ok):
                bad = int(piece.min()) if int(piece.min()) < lo_ok else int(piece.max())
                raise InputError(f"{str(path)!r}: topk_ids holds expert id {bad}; ids must lie in [0, {num_experts})")
            yield piece

    if nbytes > SPILL_BYTES:
        return _spill(checked(), shape, target, f"{str(path)!r}: its {nbytes / 1e9:.1f} GB of expert ids")
    check_alloc(shape, target.itemsize, f"{str(path)!r}: topk_ids [T, L, K]", "is the file damaged?")
    out = np.empty(shape, dtype=target)
    row = 0
    for piece in checked():
        out[row:row + piece.shape[0]] = piece
        row += piece.shape[0]
    return out


def _spill(pieces: Iterator[np.ndarray], shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    """``pieces`` (consecutive rows) written to an unlinked temporary file as ``dtype``, then memory-mapped
    read-only: an array the size of the file that this process does not hold."""
    with tempfile.TemporaryFile(prefix="moebalance-ids-") as tmp:
        try:
            for piece in pieces:
                tmp.write(np.ascontiguousarray(piece, dtype=dtype).tobytes())
            tmp.flush()
        except OSError as exc:
            raise InputError(f"{what} (above the {SPILL_BYTES >> 20} MB held in memory) could not be spilled to "
                             f"{tempfile.gettempdir()} ({exc.strerror}); free that much disk there or set TMPDIR to a "
                             "larger disk") from None
        if not shape[0]:
            return np.empty(shape, dtype=dtype)
        return np.asarray(np.memmap(tmp, dtype=dtype, mode="r", shape=shape))  # the mapping outlives the file


def _plain(zf: zipfile.ZipFile, member: str) -> np.ndarray:
    with zf.open(member) as fh:
        return np.asarray(np.lib.format.read_array(fh, allow_pickle=False))


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "Object arrays" in text:
        return "it holds pickled Python objects, which are never loaded; save plain integer arrays"
    if "pickled (object) data" in text or "pickled data" in text:
        return "it has no numpy header, so it is not a .npy/.npz file; save the counts with numpy.save or numpy.savez"
    return f"{text} (is the file truncated, or not written by numpy?)"


def check_same_model(first_name: str, first: LoadMatrix, name: str, load: LoadMatrix, flag: str = "--load") -> None:
    """Two workloads (``--load`` files named ``first_name`` and ``name``, the second given by ``flag``) must be loads
    of one model: the same layers and experts, layer ids and named model; else a one-line :class:`InputError`."""
    if (load.num_layers, load.num_experts) != (first.num_layers, first.num_experts):
        raise InputError(f"{flag} {name} is [layers, experts] = [{load.num_layers}, {load.num_experts}] but --load "
                         f"{first_name} is [{first.num_layers}, {first.num_experts}]; give workloads of one model")
    ids = [None if x.layer_ids is None else x.layer_ids.tolist() for x in (first, load)]
    if ids[0] != ids[1]:
        raise InputError(f"{flag} {name} holds the model's layers {ids[1]} but --load {first_name} holds {ids[0]}; "
                         "give workloads recorded the same way")
    if None not in (first.preset, load.preset) and first.preset != load.preset:
        raise InputError(f"{flag} {name} names model {load.preset} but --load {first_name} names {first.preset}; "
                         "give workloads of one model (or --model M for both)")


def concatenate_loads(parts: list[LoadMatrix]) -> LoadMatrix:
    """``parts``' batches one after another (their token-level traces too when all have one with the same top-k)."""
    B = sum(p.num_batches for p in parts)
    _, L, E = parts[0].shape
    check_alloc((B, L, E), 8, "the --load files' counts together", "give fewer or shorter --load files (--batches)")
    counts = np.concatenate([p.counts for p in parts])
    traces = [p.trace for p in parts]
    trace = None
    if all(t is not None for t in traces) and len({t.top_k for t in traces if t is not None}) == 1:
        offsets = np.cumsum([0] + [p.num_batches for p in parts[:-1]])
        trace = RoutingTrace(np.concatenate([t.topk_ids for t in traces if t is not None]),
                             np.concatenate([t.src_gpu for t in traces if t is not None]),
                             np.concatenate([t.batch + o for t, o in zip(traces, offsets, strict=True)
                                             if t is not None]), num_experts=E, num_batches=B)
    preset = next((p.preset for p in parts if p.preset is not None), None)
    return LoadMatrix(counts, trace, preset, parts[0].layer_ids)


def write_load(path: str | os.PathLike[str], load: LoadMatrix) -> None:
    """Write ``load`` as a compressed ``.npz``, atomically (temporary file, then rename)."""
    write_npz(path, load.to_arrays())


def parse_batch_range(text: str | None, num_batches: int) -> tuple[int, int]:
    """Parse ``a:b`` (either side may be empty) into a clipped ``(start, stop)``."""
    if text is None:
        return 0, num_batches
    parts = text.split(":")
    if len(parts) != 2:
        raise InputError(f"batch range {text!r} must look like a:b, a: or :b")
    try:
        start = int(parts[0]) if parts[0] else 0
        stop = int(parts[1]) if parts[1] else num_batches
    except ValueError:
        raise InputError(f"batch range {text!r} must hold integers, like 0:100") from None
    start, stop, _ = slice(start, stop).indices(num_batches)
    if stop <= start:
        raise InputError(f"batch range {text!r} is empty; the load has {num_batches} batches")
    return start, stop
