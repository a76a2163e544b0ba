"""Fit the compute model's constants to grouped-GEMM times measured on a GPU.

A measurement file (CSV, written by ``bench/bench_gemm.py``) has one row per run with the columns
``experts,tokens_per_expert,hidden_size,ffn_size,seconds``: ``experts`` gated FFNs of size ``hidden_size x ffn_size``
each ran on ``tokens_per_expert`` tokens, and the whole grouped GEMM took ``seconds`` (a median of repeats).
:func:`fit` chooses the :class:`~moebalance.cost.time.Calibration` whose roofline (:func:`expert_seconds`) best
matches the times in relative terms: a grid over the two efficiencies and the kernel's M-tile (:data:`TILE_ROWS`:
none, or 64, 128 or 256 rows, each expert's FLOPs counted on its rows in whole tiles), and for each the launch cost
that centres the residuals; the error is the mean absolute log ratio of modelled to measured time. A tile is kept
only where it fits better than none, which needs runs whose rows are not already whole tiles. An efficiency that no
measurement depends on (all runs bound by the other resource) is not determined: among equal errors the fit keeps
the largest value, and :func:`fit` says which regimes the runs covered. A fit needs at least as many distinct
measurement points (runs of distinct sizes) as the constants it fits (:data:`FITTED`), else any error is zero.

A calibration records the GPU it was fitted on (``gpu``): it prices that GPU and those of the same silicon
(:func:`same_silicon`); :func:`resolve_calibration` refuses it for another GPU unless asked (``any_gpu``), and then
says so in its ``source``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moebalance.core.errors import InputError
from moebalance.core.io import atomic_write_text, dumps, read_json
from moebalance.cost.hardware import GPUS, GpuSpec, get_gpu
from moebalance.cost.time import PRECISION_BYTES, Calibration, gemm_work, peak_rates

__all__ = [
    "AUTO",
    "COLUMNS",
    "FITTED",
    "FIT_ERROR_KEY",
    "FORMAT",
    "LIMITS",
    "PEAKS",
    "PROFILES",
    "Measurements",
    "auto_profile",
    "check_measurement",
    "fit",
    "profile_names",
    "read_calibration",
    "read_measurements",
    "resolve_calibration",
    "same_silicon",
    "write_calibration",
]

#: ``--calibration auto`` (the default): the shipped profile fitted on the deployment's GPU, else the published peaks;
#: ``--calibration peaks``: the published peaks.
AUTO, PEAKS = "auto", "peaks"

#: The shipped profiles: calibration files ``bench/profiles.py`` fits from committed measurements and published kernel
#: tables, which ``--calibration NAME`` reads by name (docs/results/profiles.md lists them).
PROFILES = Path(__file__).parent / "profiles"

#: The ``format`` of a calibration file.
FORMAT = "moebalance.calibration"
#: A calibration file's fit error: the mean absolute log error of the fitted roofline (``advise``'s margin reads it).
FIT_ERROR_KEY = "mean_abs_log_error"

COLUMNS = ("experts", "tokens_per_expert", "hidden_size", "ffn_size", "seconds")
#: The constants :func:`fit` fits (the M-tile is chosen among :data:`TILE_ROWS`, not fitted): it needs as many
#: distinct measurement points, runs of distinct sizes (``COLUMNS`` but ``seconds``).
FITTED = ("flops_efficiency", "bandwidth_efficiency", "launch_us")
_GRID = np.geomspace(0.01, 1.0, 121)  # efficiencies tried, 1% to 100% of peak
#: M-tile sizes tried (0: no tiles); grouped-GEMM kernels tile rows in powers of two of this order.
TILE_ROWS = (0, 64, 128, 256)
#: The range of each column: sizes are whole numbers far beyond any real grouped GEMM at the top (so no product
#: of them overflows float64), and a time is at least 100 ns (below a kernel launch) and at most an hour.
LIMITS: dict[str, tuple[float, float]] = {"experts": (1, 2**20), "tokens_per_expert": (1, 2**32),
                                          "hidden_size": (1, 2**20), "ffn_size": (1, 2**20), "seconds": (1e-7, 3600.0)}


@dataclass(frozen=True, slots=True)
class Measurements:
    """Columns of a measurement file, ``float64 [N]`` each."""

    experts: np.ndarray
    tokens_per_expert: np.ndarray
    hidden_size: np.ndarray
    ffn_size: np.ndarray
    seconds: np.ndarray

    def __post_init__(self) -> None:
        size = np.asarray(self.seconds).size
        for c in COLUMNS:
            try:
                col = np.asarray(getattr(self, c), dtype=np.float64)
            except (TypeError, ValueError):
                raise InputError(f"measurement column {c} must hold numbers") from None
            if col.ndim != 1 or col.size != size or size == 0:
                raise InputError(f"measurement column {c} must be 1-D with one value per run, like the others "
                                 f"({size}), got shape {col.shape}")
            for i, value in enumerate(col):
                check_measurement(c, float(value), f"run {i}")
            object.__setattr__(self, c, col)


def check_measurement(column: str, value: float, where: str) -> float:
    """``value`` if it lies in ``LIMITS[column]`` (and is whole for a size), else a one-line error naming ``where``."""
    lo, hi = LIMITS[column]
    if not (math.isfinite(value) and lo <= value <= hi):
        unit = " s (seconds of one grouped GEMM: was it written in other units?)" if column == "seconds" else ""
        bounds = f"[{lo:g}, {hi:g}]" if column == "seconds" else f"[{lo:,.0f}, {hi:,.0f}]"
        raise InputError(f"{where}: {column} is {value}; it must lie in {bounds}{unit}")
    if column != "seconds" and value != math.floor(value):
        raise InputError(f"{where}: {column} is {value}; it must be a whole number")
    return value


def read_measurements(path: str | Path) -> Measurements:
    """Read a measurement CSV (UTF-8, with or without a byte-order mark); a missing or repeated column, a non-number or
    a value outside :data:`LIMITS` is a one-line error."""
    p = Path(path)
    try:
        with open(p, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            header = list(reader.fieldnames or [])
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"cannot read measurements {str(p)!r}: {exc}") from None
    repeated = next((c for i, c in enumerate(header) if c in header[:i]), None)
    if repeated is not None:
        raise InputError(f"{str(p)!r} has column {repeated!r} more than once (columns "
                         f"{', '.join(str(i + 1) for i, c in enumerate(header) if c == repeated)}); keep one: "
                         f"expected {','.join(COLUMNS)}")
    if not rows:
        raise InputError(f"{str(p)!r} holds no measurements; expected a CSV with columns {','.join(COLUMNS)}")
    missing = [c for c in COLUMNS if c not in rows[0]]
    if missing:
        raise InputError(f"{str(p)!r} lacks column {missing[0]!r}; expected {','.join(COLUMNS)} (bench/bench_gemm.py)")
    cols: dict[str, list[float]] = {c: [] for c in COLUMNS}
    for i, row in enumerate(rows, start=2):
        for c in COLUMNS:
            try:
                value = float(row[c])
            except (TypeError, ValueError):
                raise InputError(f"{str(p)!r} line {i}: {c} is {row[c]!r}, not a number") from None
            cols[c].append(check_measurement(c, value, f"{str(p)!r} line {i}"))
    return Measurements(**{c: np.asarray(v) for c, v in cols.items()})


def fit(m: Measurements, gpu: GpuSpec, *, precision: str = "bf16", source: str = "measurements",
        label: str = "measurements") -> tuple[Calibration, float, tuple[int, int]]:
    """The calibration that best matches ``m`` on ``gpu``, its mean absolute log error, and how many runs the fitted
    roofline has bound by FLOPs and by memory (module docstring). ``precision`` is the measured GEMMs' (``bf16``, or
    ``fp8``: one byte per weight, the mean of FP8 and bf16 per activation, the GPU's FP8 peak), which the calibration
    records. Fewer distinct measurement points than :data:`FITTED` constants is a one-line error naming ``label``."""
    if precision not in PRECISION_BYTES:
        raise InputError(f"precision {precision!r} is unknown; choose one of: {', '.join(PRECISION_BYTES)}")
    sizes = np.stack([m.experts, m.tokens_per_expert, m.hidden_size, m.ffn_size], axis=1)  # [N, 4]
    points = int(np.unique(sizes, axis=0).shape[0])
    if points < len(FITTED):
        raise InputError(f"{label}: {points} distinct measurement point{'' if points == 1 else 's'} (runs of "
                         f"distinct {', '.join(COLUMNS[:-1])}); fitting {len(FITTED)} constants "
                         f"({', '.join(FITTED)}) needs at least {len(FITTED)}: measure more sizes (bench/bench_gemm.py)")
    n = m.experts * m.tokens_per_expert
    w = PRECISION_BYTES[precision]
    peak_flops, peak_bytes = peak_rates(gpu, precision=precision)
    log_measured = np.log(m.seconds)
    best: tuple[float, float, float, float, int] = (math.inf, 1.0, 1.0, 0.0, 0)
    for tile in TILE_ROWS:
        padded = m.experts * (tile * np.ceil(m.tokens_per_expert / tile) if tile else m.tokens_per_expert)
        flops, traffic = gemm_work(n, m.experts, m.hidden_size, m.ffn_size, weight_bytes=w,
                                   activation_bytes=(w + PRECISION_BYTES["bf16"]) / 2, padded=padded)
        compute = flops[None, :] / (peak_flops * _GRID[:, None])  # [grid, N]
        memory = traffic[None, :] / (peak_bytes * _GRID[:, None])
        for i in range(_GRID.size - 1, -1, -1):  # from the largest efficiency down: among equal errors, the largest
            roof = np.maximum(compute[i][None, :], memory)  # [grid (bandwidth), N]
            launch = np.maximum(0.0, np.median(m.seconds[None, :] - roof, axis=1))  # [grid]
            err = np.abs(np.log(roof + launch[:, None]) - log_measured[None, :]).mean(axis=1)
            j = _GRID.size - 1 - int(np.argmin(err[::-1]))  # the largest bandwidth efficiency among equal errors
            if err[j] < best[0] - 1e-9:  # a tile only where it fits better than none
                best = (float(err[j]), float(_GRID[i]), float(_GRID[j]), float(launch[j]), tile)
    error, flops_eff, bandwidth_eff, launch_s, tile = best
    padded = m.experts * (tile * np.ceil(m.tokens_per_expert / tile) if tile else m.tokens_per_expert)
    flops, traffic = gemm_work(n, m.experts, m.hidden_size, m.ffn_size, weight_bytes=w,
                               activation_bytes=(w + PRECISION_BYTES["bf16"]) / 2, padded=padded)
    bound_by_flops = int(np.count_nonzero(flops / (peak_flops * flops_eff) >= traffic / (peak_bytes * bandwidth_eff)))
    return (Calibration(flops_efficiency=flops_eff, bandwidth_efficiency=bandwidth_eff, launch_us=launch_s * 1e6,
                        tile_rows=tile, source=source, gpu=gpu.name, precision=precision), error,
            (bound_by_flops, n.size - bound_by_flops))


def write_calibration(path: str | Path, calibration: Calibration, error: float | None) -> None:
    """Write ``calibration`` with its fit ``error`` (``None``: nothing fitted, none recorded) as the JSON
    :func:`read_calibration` reads (atomically)."""
    doc = {"format": FORMAT, **{f.name: getattr(calibration, f.name) for f in dataclasses.fields(calibration)}}
    if error is not None:
        doc[FIT_ERROR_KEY] = round(float(error), 6)
    atomic_write_text(Path(path), dumps(doc))


def profile_names() -> list[str]:
    """The shipped profiles' names (:data:`PROFILES`), sorted."""
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def auto_profile(gpu: str) -> str | None:
    """The shipped profile for GPU ``gpu``: fitted on it, or on a GPU of the same silicon (:func:`same_silicon`), the
    first by name where several are; else ``None``."""
    get_gpu(gpu)  # a one-line error for an unknown name
    fitted = {name: read_calibration(name)[0].gpu for name in profile_names()}
    return next((n for n, g in fitted.items() if g == gpu), None) or \
        next((n for n, g in fitted.items() if same_silicon(g, gpu)), None)


def same_silicon(a: str, b: str) -> bool:
    """Whether GPUs ``a`` and ``b`` (:data:`GPUS` names) are the same silicon: the same bf16 and FP8 peaks, memory
    bandwidth and memory (the H800 is the H100's; the GB200 and the MI355X share the first three, not the last), so
    that shares of one's peaks hold for the other; an unknown name is none."""
    if a == b:
        return True
    x, y = GPUS.get(a), GPUS.get(b)
    return x is not None and y is not None and (x.bf16_tflops, x.fp8_tflops, x.memory_bandwidth, x.memory_gib) == \
        (y.bf16_tflops, y.fp8_tflops, y.memory_bandwidth, y.memory_gib)


def resolve_calibration(name: str | Path | None, gpu: str, *,
                        any_gpu: bool = False) -> tuple[Calibration, float | None]:
    """What ``--calibration`` names for a deployment on ``gpu``: a file or a shipped profile (:func:`read_calibration`),
    ``peaks`` the published peaks, or ``auto`` (and ``None``) the shipped profile fitted on that GPU, else the
    published peaks, saying so. A file or profile fitted on another GPU (not :func:`same_silicon`) is a one-line error
    naming both, unless ``any_gpu`` (``--calibration-any-gpu``): then its ``source`` says so. One that records no GPU
    (written before calibrations did, or links only) prices any."""
    if str(name) == PEAKS:
        return Calibration(), None
    if name is not None and str(name) != AUTO:
        cal, error = read_calibration(name)
        if not cal.gpu or same_silicon(cal.gpu, gpu):
            return cal, error
        if not any_gpu:
            raise InputError(f"--calibration {str(name)!r} was fitted on GPU {cal.gpu}, not on --gpu {gpu}: its shares "
                             f"of the peaks need not hold there; calibrate on {gpu} ('moebalance calibrate'), or pass "
                             "--calibration-any-gpu to price with it anyway")
        return dataclasses.replace(cal, source=f"{cal.source} (from another GPU: fitted on {cal.gpu}, priced for "
                                               f"{gpu})"), error
    profile = auto_profile(gpu)
    if profile is None:
        return Calibration(source=f"published peaks (no profile for {gpu})"), None
    cal, error = read_calibration(profile)
    return dataclasses.replace(cal, source=f"{cal.source} (auto for {gpu})"), error


def read_calibration(path: str | Path) -> tuple[Calibration, float | None]:
    """A calibration file's constants and its fit error (``None`` where the file records none), or a shipped
    profile's by name (:func:`profile_names`); anything else is a one-line :class:`InputError` naming the file."""
    shipped = PROFILES / f"{path}.json"
    if isinstance(path, str) and "/" not in path and not path.endswith(".json"):
        if not shipped.is_file():
            raise InputError(f"no calibration file or shipped profile {path!r}; give a JSON file from 'moebalance "
                             f"calibrate' or a profile: {', '.join(profile_names())}")
        path = shipped
    doc = read_json(Path(path), "calibration")
    fields = {f.name for f in dataclasses.fields(Calibration)}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not set(doc) - {"format", FIT_ERROR_KEY} <= fields:
        raise InputError(f"{str(path)!r} is not a calibration written by 'moebalance calibrate' (keys: format, "
                         f"{', '.join(sorted(fields))}, {FIT_ERROR_KEY})")
    error = doc.get(FIT_ERROR_KEY)
    if error is not None and (isinstance(error, bool) or not isinstance(error, int | float) or
                              not math.isfinite(error) or error < 0):
        raise InputError(f"{str(path)!r}: {FIT_ERROR_KEY} is {error!r}; it must be a number >= 0")
    try:
        calibration = Calibration(**{k: v for k, v in doc.items() if k not in ("format", FIT_ERROR_KEY)})
    except TypeError as exc:
        raise InputError(f"{str(path)!r}: {exc}") from None
    if not isinstance(calibration.gpu, str):
        raise InputError(f"{str(path)!r}: gpu is {calibration.gpu!r}; it must be the name of the GPU it was fitted on "
                         "(or empty: any GPU)")
    return calibration, None if error is None else float(error)
