"""``moebalance import`` a file at a time: SGLang per-token dump folders and vLLM routed experts written into an
``.npz`` in memory that does not grow with the tokens (docs/design.md, "Large traces").

:func:`moebalance.engines.sglang.read_dumps` and :func:`moebalance.engines.vllm.read_routed_experts` hold every
file's tokens at once. :func:`import_dumps` and :func:`import_routed_experts` write the arrays those readers give
(they are the reference; the tests compare the two) in two passes over the files:

- the first reads one file at a time, makes every check of the readers (one line naming the file) and computes,
  incrementally, what the readers compute over all tokens at once: SGLang's passes (the same on every rank, in id
  order), the layers no token picks in (dense, left out) and the picks per token; vLLM's shapes, the largest id
  (the expert count), the dense layers (every token picking one expert ``k`` times, expert 0 when ``k == 1``) and
  each request's tokens (its batch of ``--batch-tokens`` and its rank of ``--gpus``);
- the second writes the token-level members ``topk_ids``, ``src_gpu`` and ``batch`` uncompressed (``ZIP_STORED``,
  so that later commands memory-map ``topk_ids``: :func:`moebalance.core.load.read_load`), a chunk of tokens at a
  time after a ``.npy`` header whose shape the first pass found, counting ``counts [B, L, E]`` on the way; then the
  small members (``counts``, ``preset``, ``layer_ids``) compressed, as :func:`moebalance.core.io.write_npz` writes
  them. SGLang's ids come back from a staging file the first pass wrote (a pass's tokens are spread over every
  rank's file, so the output's order needs them all; the file lies beside the output, unlinked from the start:
  it needs about as much free disk there as the output); vLLM's files are read again and must hold the same
  requests.

The ``.npz`` is written to a temporary file and renamed (:func:`moebalance.core.io.atomic_path`): an error leaves
no output. Memory is one file's contents, a chunk of :data:`CHUNK_PICKS` picks and ``counts``. A folder of SGLang
dumps without per-token ids (``per_pass`` mode) is small: it is read whole by :func:`~moebalance.engines.sglang.
read_dumps`, as before.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from moebalance.core import tally
from moebalance.core.errors import InputError
from moebalance.core.io import atomic_path
from moebalance.core.limits import check_alloc, machine_memory_bytes
from moebalance.core.load import LoadMatrix, write_load
from moebalance.engines.files import load_model
from moebalance.engines.sglang import read_dumps, read_rank_dump
from moebalance.engines.vllm import deal, experts_of, request_files, requests_in

__all__ = ["CHUNK_PICKS", "Streamed", "import_dumps", "import_routed_experts"]

#: Picks converted and written at a time in the second pass (int64 temporaries of 32 MB).
CHUNK_PICKS = 1 << 22


@dataclass(frozen=True, slots=True)
class Streamed:
    """What an import wrote: the load's ``counts``, model and layer ids (the token-level trace stays in the file:
    ``num_tokens`` tokens; ``None`` for counts alone)."""

    load: LoadMatrix
    num_tokens: int | None


# ----- sizes ------------------------------------------------------------------------------------------------------

def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _check_each_fits(files: list[Path], kind: str) -> None:
    """Refuse, before reading, a file that alone is larger than this machine's memory (each is read whole)."""
    limit = machine_memory_bytes()
    for f in files:
        size = _size(f)
        if size > limit:
            raise InputError(f"{str(f)!r} alone holds {size / 2**30:.1f} GiB of {kind} dumps, and import reads one "
                             f"file at a time whole; this machine has {limit / 2**30:.1f} GiB: record shorter dumps "
                             "(fewer passes or requests per file)")


# ----- the .npz, member by member ---------------------------------------------------------------------------------

def _write(fh: IO[bytes], arr: np.ndarray, dtype: np.dtype | None = None) -> None:
    data = np.ascontiguousarray(arr, dtype=dtype)
    if data.size:
        fh.write(data.reshape(-1).view(np.uint8).data)


@contextmanager
def _stored(zf: zipfile.ZipFile, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> Iterator[IO[bytes]]:
    """An uncompressed member ``name.npy`` of ``shape``: its header written, the caller writes the data in C order."""
    info = zipfile.ZipInfo(f"{name}.npy")
    info.compress_type = zipfile.ZIP_STORED
    with zf.open(info, "w", force_zip64=True) as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                  "fortran_order": False, "shape": shape})
        yield fh


def _column(zf: zipfile.ZipFile, name: str, runs: Iterable[tuple[int, int]], total: int) -> None:
    """An uncompressed ``int64 [total]`` member of ``(value, length)`` runs."""
    step = CHUNK_PICKS
    with _stored(zf, name, np.dtype(np.int64), (total,)) as fh:
        for value, n in runs:
            for lo in range(0, n, step):
                _write(fh, np.full(min(step, n - lo), value, dtype=np.int64))


def _small(zf: zipfile.ZipFile, load: LoadMatrix) -> None:
    """The members that do not grow with the tokens (``load`` has no trace: ``counts``, ``preset``, ``layer_ids``),
    compressed (the archive's default)."""
    for name, arr in load.to_arrays().items():
        with zf.open(f"{name}.npy", "w", force_zip64=True) as fh:
            np.lib.format.write_array(fh, arr, allow_pickle=False)


def _check_distinct(ids: np.ndarray, num_experts: int, layer_ids: np.ndarray, where: str, first: int) -> None:
    """Refuse a token of ``ids [n, L, K]`` (tokens ``first ..`` of ``where``) that picks an expert twice."""
    try:
        tally.check_picks(ids, num_experts)
    except InputError as exc:
        ordered = np.sort(ids, axis=2)
        found = np.argwhere((ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2))
        if not found.size:
            raise InputError(f"{where}: {exc}") from None
        t, layer = (int(i) for i in found[0])
        raise InputError(f"{where}: token {first + t} picks the same expert twice in layer {int(layer_ids[layer])}; "
                         "top-k picks are distinct (is the file damaged?)") from None


# ----- SGLang ------------------------------------------------------------------------------------------------------

def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class _Dumps:
    """The first pass over SGLang's per-rank dumps (:func:`import_dumps`), the first file's values set by it."""

    files: list[Path]
    staged: IO[bytes]
    m: np.ndarray = field(default_factory=_empty)  # int64 [L, P], every rank's
    passes: list[int] = field(default_factory=list)  # forward pass ids, sorted
    token_level: bool = True  # every rank's every pass has topk_ids_of_layer
    used: np.ndarray = field(default_factory=_empty)  # bool [L]: a layer some token picks in
    kmin: np.ndarray = field(default_factory=_empty)  # int64 [L]: fewest and most picks of a token in the layer
    kmax: np.ndarray = field(default_factory=_empty)
    #: ``(rank, pass id) -> (offset in staged, tokens, width)`` of its ids ``[tokens, L, width]``.
    segments: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    widths: dict[int, str] = field(default_factory=dict)  # each width of topk_ids_of_layer, and a file that has it

    @property
    def stage_dtype(self) -> np.dtype:
        return np.dtype(np.int16 if self.m.shape[1] <= np.iinfo(np.int16).max else np.int32)

    def add(self, rank: int, f: Path) -> None:
        """Read, check and stage rank ``rank``'s file ``f`` (its contents are freed on return)."""
        m, records = read_rank_dump(f)
        if rank == 0:
            L = m.shape[0]
            self.m, self.used = m, np.zeros(L, dtype=bool)
            self.kmin, self.kmax = np.full(L, np.iinfo(np.int64).max), np.zeros(L, dtype=np.int64)
        elif m.shape != self.m.shape or not np.array_equal(m, self.m):
            raise InputError(f"the ranks disagree: {f.name} and {self.files[0].name} hold different "
                             "last_physical_to_logical_map; use the dumps of one run")
        fids: set[int] = set()
        mine: dict[int, tuple[tuple[int, int, int], np.ndarray, np.ndarray, np.ndarray]] = {}
        for fid, _, t in records:
            fids.add(fid)
            if t is not None:  # a pass recorded twice: the last record counts, as in read_dumps
                mine[fid] = self._stage(t, f)
        ids = sorted(fids)
        if rank == 0:
            self.passes = ids
        elif ids != self.passes:
            raise InputError(f"the ranks disagree: {f.name} and {self.files[0].name} record different forward "
                             "passes; use the dumps of one recording")
        self.token_level = self.token_level and len(mine) == len(ids)
        for fid, (segment, used, kmin, kmax) in mine.items():
            self.segments[rank, fid] = segment
            self.used |= used
            self.kmin, self.kmax = np.minimum(self.kmin, kmin), np.maximum(self.kmax, kmax)

    def _stage(self, t: np.ndarray, f: Path) -> tuple[tuple[int, int, int], np.ndarray, np.ndarray, np.ndarray]:
        """Append one pass's ids ``[L, T, W]`` to the staging file token-major; its segment, its layers with a pick
        and each layer's fewest and most picks per token."""
        L, T, W = t.shape
        self.widths.setdefault(W, f.name)
        offset = self.staged.seek(0, os.SEEK_END)
        _write(self.staged, t.transpose(1, 0, 2), self.stage_dtype)
        picked = t >= 0
        k = picked.sum(axis=2)  # [L, T]
        kmin = k.min(axis=1) if T else np.full(L, np.iinfo(np.int64).max)
        kmax = k.max(axis=1) if T else np.zeros(L, dtype=np.int64)
        used = np.asarray(picked.any(axis=(1, 2)))
        return (offset, T, W), used, np.asarray(kmin), np.asarray(kmax)

    def read(self, offset: int, shape: tuple[int, int, int]) -> np.ndarray:
        """Staged ids of ``shape`` from ``offset``."""
        self.staged.seek(offset)
        size = int(np.prod(shape)) * self.stage_dtype.itemsize
        data = self.staged.read(size)
        if len(data) != size:
            raise InputError("the staging file of the dumps' ids ended early; is the disk beside the output full?")
        return np.frombuffer(data, dtype=self.stage_dtype).reshape(shape)


def import_dumps(folder: str | os.PathLike[str], out: str | os.PathLike[str], *, model: str | None = None) -> Streamed:
    """A folder of SGLang's per-rank ``per_token`` dumps written to the ``.npz`` ``out`` as
    :func:`~moebalance.engines.sglang.read_dumps` reads it and :func:`~moebalance.core.load.write_load` writes it
    (module docstring), one file at a time."""
    d, dest = Path(folder), Path(out)
    files = sorted(d.glob("*.pt"))
    if not files:
        raise InputError(f"{str(d)!r} has no .pt files; SGLang's per_pass/per_token dumps are one "
                         "expert_distribution_recorder_*_{rank}.pt per rank")
    _check_each_fits(files, "SGLang")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(prefix=f".{dest.name}.ids.", dir=dest.parent) as staged:
        scan = _Dumps(files, staged)
        for rank, f in enumerate(files):
            scan.add(rank, f)
        if not scan.passes:
            raise InputError(f"{str(d)!r}: the dumps hold no records; record at least one forward pass")
        if not scan.token_level:  # per_pass counts: small, read whole as before
            total = sum(_size(f) for f in files)
            if total > machine_memory_bytes():
                raise InputError(f"{str(d)!r} holds {total / 2**30:.1f} GiB of per_pass dumps (some pass has no "
                                 "topk_ids_of_layer), which are read whole: import a folder of some of the files at "
                                 "a time")
            load = read_dumps(d, model=model, files=files)
            write_load(dest, load)
            return Streamed(load, None)
        return _write_dumps(scan, str(d), dest, model)


def _write_dumps(scan: _Dumps, source: str, dest: Path, model: str | None) -> Streamed:
    """The second pass: the staged ids in pass-major, rank-major order, as logical experts of the layers kept."""
    m, passes, files = scan.m, scan.passes, scan.files
    if len(scan.widths) > 1:
        (w1, f1), (w2, f2) = list(scan.widths.items())[:2]
        raise InputError(f"topk_ids_of_layer is {w1} wide in {f1} but {w2} in {f2}; SGLang pads every pass to the "
                         "same width (is a file damaged?)")
    keep = np.flatnonzero(scan.used)
    if keep.size == 0:
        raise InputError(f"{source}: topk_ids_of_layer holds no pick in any layer")
    K, fewest = int(scan.kmax[keep].max()), int(scan.kmin[keep].min())
    if fewest != K:
        raise InputError(f"{source}: tokens pick different numbers of experts ({fewest} to {K}) in the MoE layers")
    L, E, B = m.shape[0], int(m.max()) + 1, len(passes)
    layer_ids = keep if keep.size < L else None
    preset = load_model(keep.size, E, None if layer_ids is None else layer_ids.tolist(), None, model)
    check_alloc((B, keep.size, E), 8, "the counts [B, L, E] of this trace",
                "expert ids must lie below the model's expert count and batch ids below the number of batches "
                "(is the file damaged?)")
    order = [(b, fid, rank) for b, fid in enumerate(passes) for rank in range(len(files))]
    total = sum(scan.segments[rank, fid][1] for _, fid, rank in order)
    dtype, table, rows = tally.id_dtype(E), m[keep], np.arange(keep.size)[None, :, None]
    counts = np.zeros((B, keep.size, E), dtype=np.int64)
    with atomic_path(dest) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
        with _stored(zf, "topk_ids", dtype, (total, keep.size, K)) as fh:
            for b, fid, rank in order:
                offset, T, W = scan.segments[rank, fid]
                step = max(1, CHUNK_PICKS // (L * W))
                for lo in range(0, T, step):
                    n = min(step, T - lo)
                    phys = scan.read(offset + lo * L * W * scan.stage_dtype.itemsize, (n, L, W))
                    ids = table[rows, phys[:, keep, :K]].astype(dtype)  # each slot's logical expert
                    _check_distinct(ids, E, keep, f"{str(files[rank])!r}, forward pass {fid}", lo)
                    counts[b] += tally.count_picks(ids, np.zeros(n, np.int64), 1, E)[0]
                    _write(fh, ids)
        _column(zf, "src_gpu", ((rank, scan.segments[rank, fid][1]) for _, fid, rank in order), total)
        _column(zf, "batch", ((b, scan.segments[rank, fid][1]) for b, fid, rank in order), total)
        load = LoadMatrix(counts, None, preset, layer_ids)
        _small(zf, load)
    return Streamed(load, total)


# ----- vLLM --------------------------------------------------------------------------------------------------------

@dataclass
class _Requests:
    """The first pass over vLLM's routed experts (:func:`import_routed_experts`)."""

    source: str
    shape: tuple[int, ...] | None = None  # [L, k] of every request
    first: str = ""  # the file of the first request
    top: int = 0  # the largest id, and its file
    top_file: str = ""
    same: np.ndarray = field(default_factory=_empty)  # bool [L]: every token picks one expert (0 when k == 1)
    lengths: list[list[int]] = field(default_factory=list)  # tokens of each request, per file

    def add(self, f: Path) -> None:
        """Read and check the requests of ``f`` (freed on return)."""
        lengths: list[int] = []
        for a in requests_in(f):
            if a.ndim != 3 or not np.issubdtype(a.dtype, np.integer):
                raise InputError(f"{str(f)!r}: routed_experts must be integer [tokens, layers, top-k], got {a.dtype} "
                                 f"{a.shape}")
            if self.shape is None:
                self.shape, self.first, self.same = a.shape[1:], f.name, np.ones(a.shape[1], dtype=bool)
            elif a.shape[1:] != self.shape:
                raise InputError(f"{self.source!r}: the requests disagree on [layers, top-k]: "
                                 f"{sorted({self.shape, a.shape[1:]})} ({self.first} and {f.name}); one model's output")
            if a.size and int(a.min()) < 0:
                raise InputError(f"{str(f)!r}: routed_experts holds a negative expert id")
            if a.size and int(a.max()) > self.top:
                self.top, self.top_file = int(a.max()), str(f)
            self.same &= (a == a[:, :, :1]).all(axis=(0, 2))
            if a.shape[2] == 1:
                self.same &= (a[:, :, 0] == 0).all(axis=0)
            lengths.append(len(a))
        self.lengths.append(lengths)


def import_routed_experts(path: str | os.PathLike[str], out: str | os.PathLike[str], *, gpus: int = 1,
                          batch_tokens: int = 4096, num_experts: int | None = None,
                          model: str | None = None) -> Streamed:
    """vLLM's routed experts (a folder, a JSON response file or a ``.npy``) written to the ``.npz`` ``out`` as
    :func:`~moebalance.engines.vllm.read_routed_experts` reads them with ``gpus``, ``batch_tokens`` and
    ``num_experts`` and :func:`~moebalance.core.load.write_load` writes them (module docstring), one file at a
    time."""
    p, dest = Path(path), Path(out)
    entries = request_files(p)
    _check_each_fits(entries, "vLLM")
    scan = _Requests(str(p))
    for f in entries:
        scan.add(f)
    lengths = [n for per_file in scan.lengths for n in per_file]
    if scan.shape is None:
        raise InputError(f"{str(p)!r} holds no request")
    L, K = scan.shape
    keep = np.flatnonzero(~scan.same)
    if keep.size == 0:
        raise InputError(f"{str(p)!r}: every layer looks dense (each token picks one expert {K} times)")
    num_experts, limit = experts_of(num_experts, model)
    E = scan.top + 1 if num_experts is None else num_experts
    if scan.top >= E:
        raise InputError(f"{scan.top_file!r}: expert id {scan.top} is not below {limit} {E}")
    batch, src, B = deal(np.array(lengths, dtype=np.int64), gpus, batch_tokens)  # as read_routed_experts lays them out
    check_alloc((B, keep.size, E), 8, f"{str(p)!r}: counts [B, L, E] with E = {E:,} experts",
                "give --experts the model's expert count (ids in the file must be below it)")
    layer_ids = keep if keep.size < L else None
    preset = load_model(keep.size, E, None if layer_ids is None else layer_ids.tolist(), None, model)
    total, dtype = sum(lengths), tally.id_dtype(E)
    counts = np.zeros((B, keep.size, E), dtype=np.int64)
    with atomic_path(dest) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
        with _stored(zf, "topk_ids", dtype, (total, keep.size, K)) as fh:
            first = 0
            for f, want in zip(entries, scan.lengths, strict=True):
                _write_requests(fh, f, want, scan.shape, keep, dtype, batch[first:first + len(want)], counts)
                first += len(want)
        _column(zf, "src_gpu", zip(src, lengths, strict=True), total)
        _column(zf, "batch", zip(batch, lengths, strict=True), total)
        load = LoadMatrix(counts, None, preset, layer_ids)
        _small(zf, load)
    return Streamed(load, total)


def _write_requests(fh: IO[bytes], f: Path, want: list[int], shape: tuple[int, ...], keep: np.ndarray,
                    dtype: np.dtype, batch: np.ndarray, counts: np.ndarray) -> None:
    """The second pass over one file of requests: its ids of the layers ``keep`` written to ``fh`` in ``dtype``, a
    chunk at a time, and counted into ``counts`` by each request's batch (the file is freed on return)."""
    E = counts.shape[2]
    reqs = requests_in(f)
    if [len(a) for a in reqs] != want or any(a.shape[1:] != shape for a in reqs) or \
            any(a.size and (int(a.min()) < 0 or int(a.max()) >= E) for a in reqs):
        raise InputError(f"{str(f)!r} changed while it was imported; import files that no engine is still writing")
    step = max(1, CHUNK_PICKS // int(np.prod(shape)))
    for q, (a, b) in enumerate(zip(reqs, batch, strict=True)):
        for lo in range(0, len(a), step):
            ids = a[lo:lo + step][:, keep].astype(dtype)
            _check_distinct(ids, E, keep, f"{str(f)!r}, request {q}", lo)
            counts[b] += tally.count_picks(ids, np.zeros(len(ids), np.int64), 1, E)[0]
            _write(fh, ids)
