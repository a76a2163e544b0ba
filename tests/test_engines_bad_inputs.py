"""Engine files a user may hand over damaged or absurd: each is one line naming the problem, never a traceback, a
MemoryError or a numpy warning, and nothing is allocated at the size a file claims before it is checked (the sizes
below are far beyond any machine's memory, so an allocation would fail here with MemoryError instead)."""

from __future__ import annotations

import base64
import io
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import save_file

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, MoebalanceError, PlanError
from moebalance.engines import read_any_load, read_any_plan

E = 256


@pytest.fixture(autouse=True)
def warnings_are_errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a leaked numpy warning fails the test
        yield


def one_line(call: Callable[[], Any], kind: type[MoebalanceError], *fragments: str) -> str:
    with pytest.raises(kind) as exc:
        call()
    text = str(exc.value)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    return text


def _stats(folder: Path, keys: dict[str, np.ndarray], meta: Any = None) -> Path:
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": 8}
                                                      if meta is None else meta))
    save_file(keys, str(folder / "rank0.safetensors"))
    return folder


def _response(*arrays_or_bytes: np.ndarray | bytes) -> dict[str, Any]:
    def b64(a: np.ndarray | bytes) -> str:
        if isinstance(a, bytes):
            return base64.b64encode(a).decode()
        buf = io.BytesIO()
        np.save(buf, a)
        return base64.b64encode(buf.getvalue()).decode()

    return {"choices": [{"index": i, "routed_experts": b64(a)} for i, a in enumerate(arrays_or_bytes)]}


def _routed(tokens: int, layers: int = 61, top_k: int = 8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, size=top_k, replace=False) for _ in range(layers)])
                     for _ in range(tokens)]).astype(np.int32)


def test_trtllm_statistics(tmp_path: Path) -> None:
    counts = np.ones(E, dtype=np.int64)
    folder = _stats(tmp_path / "far", {"0_3": counts, "0_1000000000": counts})
    one_line(lambda: read_any_load(folder), InputError, "layers 0..1000000000", "more than this machine's")
    folder = _stats(tmp_path / "bool", {"0_3": counts}, meta={"num_experts": True, "num_experts_per_token": 8})
    one_line(lambda: read_any_load(folder), InputError, "num_experts", "positive integer")
    folder = _stats(tmp_path / "gap", {"0_3": counts, "1000000000000_3": counts})  # checked without listing the gap
    one_line(lambda: read_any_load(folder), InputError, "with gaps")
    folder = _stats(tmp_path / "deep", {"0_3": counts})
    (folder / "meta_info.json").write_text("[" * 100_000 + "]" * 100_000)
    one_line(lambda: read_any_load(folder), InputError, "nests too deeply to read")


def test_trtllm_yaml(tmp_path: Path) -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    (tmp_path / "deep.yaml").write_text("[" * 100_000 + "]" * 100_000)
    one_line(lambda: read_any_plan(tmp_path / "deep.yaml", cluster), InputError, "deep.yaml")
    (tmp_path / "far.yaml").write_text(yaml.safe_dump({"num_slots": 4, "initial_global_assignments":
                                                       {10**12: [0, 1, 2, 3]}}))
    one_line(lambda: read_any_plan(tmp_path / "far.yaml", cluster), InputError, "more than this machine's")
    (tmp_path / "big.yaml").write_text(yaml.safe_dump({"num_slots": 4, "initial_global_assignments":
                                                       {3: [0, 1, 2, 10**12]}}))
    one_line(lambda: read_any_plan(tmp_path / "big.yaml", cluster), PlanError, "names expert 1000000000000", "4 slots")
    (tmp_path / "bool.yaml").write_text(yaml.safe_dump({"num_slots": True, "initial_global_assignments": {3: [0]}}))
    one_line(lambda: read_any_plan(tmp_path / "bool.yaml", cluster), InputError, "num_slots must be a positive")


def test_vllm_npy_header_is_checked_before_reading(tmp_path: Path) -> None:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i4", "fortran_order": False, "shape": (10**9, 61, 8)})
    magic = b"\x93NUMPY\x01\x00"
    (tmp_path / "huge.json").write_text(json.dumps(_response(magic + header.getvalue()[8:] + b"\0" * 64)))
    one_line(lambda: read_any_load(tmp_path / "huge.json", "vllm"), InputError, "[1000000000, 61, 8]",
             "more than this machine's")
    whole = io.BytesIO()
    np.save(whole, _routed(3))
    (tmp_path / "cut.json").write_text(json.dumps(_response(whole.getvalue()[:-100])))
    one_line(lambda: read_any_load(tmp_path / "cut.json", "vllm"), InputError, "is it truncated?")
    (tmp_path / "floats.json").write_text(json.dumps(_response(np.zeros((2, 3, 2)))))
    one_line(lambda: read_any_load(tmp_path / "floats.json", "vllm"), InputError, "float64", "integer expert ids")


def test_vllm_expert_ids_and_experts(tmp_path: Path) -> None:
    ids = _routed(2)
    ids[0, 5, 0] = 2**31 - 2
    (tmp_path / "id.json").write_text(json.dumps(_response(ids)))
    one_line(lambda: read_any_load(tmp_path / "id.json", "vllm"), InputError, "2,147,483,647 experts",
             "more than this machine's", "--experts")
    np.save(tmp_path / "req.npy", _routed(2))
    one_line(lambda: read_any_load(tmp_path / "req.npy", "vllm", num_experts=10**9), InputError,
             "1,000,000,000 experts", "more than this machine's")
    one_line(lambda: read_any_load(tmp_path / "req.npy", "vllm", num_experts=0), InputError, "--experts (0)")
    (tmp_path / "deep.json").write_text('{"choices": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_line(lambda: read_any_load(tmp_path / "deep.json", "vllm"), InputError, "nests too deeply to read")


def _dumps(folder: Path, records: list[dict[str, Any]], phy2log: torch.Tensor) -> Path:
    folder.mkdir()
    torch.save({"records": records, "last_physical_to_logical_map": phy2log}, folder / "expert_distribution_recorder_1_0.pt")
    return folder


def test_sglang_per_pass_dumps(tmp_path: Path) -> None:
    m = torch.arange(10).repeat(3, 1)
    count = torch.ones(3, 10, dtype=torch.int32)
    huge = m.clone()
    huge[1, 4] = 10**12
    folder = _dumps(tmp_path / "huge", [{"forward_pass_id": 1, "global_physical_count": count}], huge)
    one_line(lambda: read_any_load(folder), InputError, "expert id 1000000000000", "10 slots")
    for name, fid in (("abc", "abc"), ("list", [1, 2]), ("bool", True)):
        folder = _dumps(tmp_path / name, [{"forward_pass_id": fid, "global_physical_count": count}], m)
        one_line(lambda folder=folder: read_any_load(folder), InputError, f"forward_pass_id {fid!r} must be an integer")


def test_sglang_json(tmp_path: Path) -> None:
    (tmp_path / "digits.json").write_text('{"logical_count": [[1, ' + "9" * 5000 + "]]}")
    one_line(lambda: read_any_load(tmp_path / "digits.json"), InputError, "holds a value that cannot be read")
    (tmp_path / "big.json").write_text('{"logical_count": [[1, ' + "9" * 4000 + "]]}")  # parsed: too big for 64 bits
    one_line(lambda: read_any_load(tmp_path / "big.json"), InputError, "not a rectangular array of 64-bit numbers")
    (tmp_path / "deep.json").write_text('{"logical_count": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_line(lambda: read_any_load(tmp_path / "deep.json"), InputError, "nests too deeply to read")
    # as a plan: the format is sniffed from the JSON, which must not recurse without end either
    (tmp_path / "deep_plan.json").write_text("[" * 100_000 + "]" * 100_000)
    one_line(lambda: read_any_plan(tmp_path / "deep_plan.json"), PlanError, "nests too deeply to read")


def test_sglang_placement_values(tmp_path: Path) -> None:
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    (tmp_path / "inf.json").write_text('{"physical_to_logical_map": [[0, 1, 2, 1e308]]}')
    one_line(lambda: read_any_plan(tmp_path / "inf.json", cluster), PlanError, "expert id 1e+308", "outside [0, 4)")
    (tmp_path / "nan.json").write_text('{"physical_to_logical_map": [[0, 1, 2, NaN]]}')
    one_line(lambda: read_any_plan(tmp_path / "nan.json", cluster), PlanError, "integer expert ids")
    (tmp_path / "neg.json").write_text('{"physical_to_logical_map": [[0, 1, 2, -3]]}')
    one_line(lambda: read_any_plan(tmp_path / "neg.json", cluster), PlanError, "expert id -3")


def test_trtllm_digit_keys_too_long_for_int(tmp_path: Path) -> None:
    """A quoted 5,000-digit layer key (YAML) or statistics key: Python refuses to convert it. Before: a ValueError
    traceback."""
    cluster = Cluster(num_nodes=1, gpus_per_node=2)
    (tmp_path / "key.yaml").write_text(yaml.safe_dump({"num_slots": 4, "initial_global_assignments":
                                                       {"9" * 5000: [0, 1, 2, 3]}}))
    text = one_line(lambda: read_any_plan(tmp_path / "key.yaml", cluster), InputError, "layer id", "non-negative")
    assert len(text) < 400
    counts = np.ones(E, dtype=np.int64)
    folder = _stats(tmp_path / "stats", {"0_3": counts, "0_" + "9" * 5000: counts})
    text = one_line(lambda: read_any_load(folder), InputError, "'{iteration}_{layer}'")
    assert len(text) < 400


def test_an_engine_dump_larger_than_memory_is_refused_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine files are read whole: one larger than the machine's memory is refused in one line, naming its size and
    what to do, before any of it is read."""
    from moebalance.engines import detect

    dump = Path(__file__).parent / "data" / "sglang-deepseek-v3" / "decode_in1000out1000.json"
    monkeypatch.setattr(detect, "machine_memory_bytes", lambda: 1024)
    with pytest.raises(InputError) as info:
        read_any_load(str(dump), "sglang")
    text = str(info.value)
    assert "GiB of sglang dumps" in text and "this machine has 0.0 GiB" in text and "import the dumps in parts" in text
    monkeypatch.setattr(detect, "machine_memory_bytes", lambda: 1 << 40)
    assert read_any_load(str(dump), "sglang").num_experts == 256


def test_vllm_routed_experts_are_held_in_their_own_range(tmp_path: Path) -> None:
    """Ids above int16's range survive the narrow reading (no wrap): 40,000 experts, the picks counted where they
    are; below it the trace holds int16."""
    from moebalance.engines.vllm import read_routed_experts

    ids = np.zeros((4, 2, 2), dtype=np.int64)
    ids[:, :, 0], ids[:, :, 1] = 39_999, np.arange(4)[:, None] + 1
    np.save(tmp_path / "wide.npy", ids)
    load = read_routed_experts(tmp_path / "wide.npy", num_experts=40_000)
    assert load.trace is not None and load.trace.topk_ids.dtype == np.int32
    assert load.counts[0, :, 39_999].tolist() == [4, 4] and int(load.counts.sum()) == 16
    np.save(tmp_path / "narrow.npy", ids % 10)
    assert read_routed_experts(tmp_path / "narrow.npy").trace.topk_ids.dtype == np.int16


@pytest.mark.parametrize(("extra", "fragment"), [
    (["--slots-per-gpu", "3"], "slots_per_gpu (3) cannot hold 256 experts on 64 GPUs"),
    (["--slots-per-gpu", "5", "--batches", "50:60"], "batch range '50:60' is empty"),
])
def test_a_mistake_on_an_engine_file_is_one_line_without_the_model_note(tmp_path: Path, extra: list[str],
                                                                       fragment: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The note that names the model an engine file's shape fits ("note: the load names no model; ...") came on
    stderr before the error line: two lines for one mistake; nothing is left in the output folder."""
    from conftest import assert_user_error

    H, DENSE = 61, 3  # DeepSeek-V3/R1: 61 decoder layers, the first 3 dense
    counts = np.random.default_rng(0).integers(1, 50, size=(2, H, E))
    counts[:, :DENSE] = 0  # as SGLang's rank 0 writes a stat dump: int32 [B, 61, 256], the dense layers all zero
    load = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": torch.from_numpy(counts.astype(np.int32)),
                "average_utilization_rate_over_window": None}, load)
    out = tmp_path / "out"
    out.mkdir()
    assert_user_error(["plan", "--load", load, "--policy", "eplb", "--nodes", 8, "--gpus-per-node", 8, *extra,
                       "--out", out / "p.json"], capsys, fragment)
    assert list(out.iterdir()) == []
