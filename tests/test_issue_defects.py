"""User mistakes found by an independent pass over the command line that no other test file covers: each must be
exit code 2 and exactly one stderr line ``moebalance: error: ...`` (never a note before it, never a traceback or a
MemoryError), with nothing left in the output folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_user_error, run_cli

H, DENSE, E = 61, 3, 256  # DeepSeek-V3/R1: 61 decoder layers, the first 3 dense, 256 routed experts


def _sglang_stat_dump(path: Path) -> Path:
    """As SGLang's rank 0 writes a stat dump of DeepSeek-V3: int32 ``[B, 61, 256]``, the dense layers all zero."""
    counts = np.random.default_rng(0).integers(1, 50, size=(2, H, E))
    counts[:, :DENSE] = 0
    torch.save({"rank": 0, "logical_count": torch.from_numpy(counts.astype(np.int32)),
                "average_utilization_rate_over_window": None}, path)
    return path


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--slots-per-gpu", "3"], "slots_per_gpu (3) cannot hold 256 experts on 64 GPUs"),
    (["--slots-per-gpu", "5", "--batches", "50:60"], "batch range '50:60' is empty"),
])
def test_a_mistake_on_an_engine_file_is_one_line_without_the_model_note(tmp_path: Path, extra: list[str],
                                                                       fragment: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The note that names the model an engine file's shape fits ("note: the load names no model; ...") came on
    stderr before the error line: two lines for one mistake."""
    load = _sglang_stat_dump(tmp_path / "expert_distribution_recorder_1.pt")
    out = tmp_path / "out"
    out.mkdir()
    assert_user_error(["plan", "--load", load, "--policy", "eplb", "--nodes", 8, "--gpus-per-node", 8, *extra,
                       "--out", out / "p.json"], capsys, fragment)
    assert list(out.iterdir()) == []


def test_a_mistake_in_online_libra_is_one_line_without_the_predictor_note(capsys: pytest.CaptureFixture[str]) -> None:
    """"note: libra predicts with path ..." came on stderr before the error line of a warm-up over all 64 batches
    (none left to serve)."""
    assert_user_error(["online", "--load", "bundled:olmoe-1b-7b-tokens", "--policy", "libra", "--nodes", 1,
                       "--gpus-per-node", 8, "--slots-per-gpu", 10, "--warmup", "0:64"], capsys, "warm-up (0:64)")


def test_moetuner_on_thousands_of_gpus_is_a_plan_or_one_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """moetuner's Eq. 13 repair built a ``[G, G, G]`` int64 swap table without a size check: 4,096 GPUs asked for
    512 GiB and died in a MemoryError traceback (6.9e10 entries, beyond this machine's memory)."""
    np.save(tmp_path / "c.npy", np.random.default_rng(0).integers(0, 100, size=(6, 4, 16)))
    out = tmp_path / "out"
    out.mkdir()
    argv = ["plan", "--load", tmp_path / "c.npy", "--policy", "moetuner", "--nodes", 64, "--gpus-per-node", 64,
            "--slots-per-gpu", 1, "--out", out / "p.json"]
    rc, _, err = run_cli(argv, capsys)  # before: numpy's MemoryError raised out of main()
    assert "Traceback" not in err and "MemoryError" not in err, err[-2000:]
    if rc == 0:
        assert [p.name for p in out.iterdir()] == ["p.json"]
    else:
        assert_user_error(argv, capsys)
        assert list(out.iterdir()) == []
