"""Which model an engine file is for, and each engine's rows for it (MTP layers included).

Facts used (docs/formats.md, "Layers, models and MTP"): DeepSeek-V3/R1 has ``num_hidden_layers`` 61, the first 3
dense, 256 experts in 8 groups and one MTP layer; SGLang's ``physical_to_logical_map`` has one row per decoder layer
(61) and its MTP draft layer does not read it; TensorRT-LLM registers MTP layer ``i`` with its load balancer as
decoder layer ``61 + i``; vLLM's EPLB numbers the MoE layers of the main model. The files are written here in the
engines' formats (as tests/test_engines.py writes them); expected rows are derived from those facts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import save_file

from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError, PlanError
from moebalance.core.load import LoadMatrix
from moebalance.core.plan import Placement
from moebalance.engines import open_load, plan_layers, read_any_load, read_any_plan, slot_table
from moebalance.engines.sglang import write_placement
from moebalance.engines.trtllm import read_config, write_config
from moebalance.engines.vllm import write_map
from moebalance.eplb import rebalance_experts
from moebalance.policies import Budget, make_plan

H, DENSE, E = 61, 3, 256  # DeepSeek-V3/R1
CLUSTER = Cluster(num_nodes=2, gpus_per_node=8)


def _layer_counts(rows: int, dense: int, seed: int, batches: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 40, size=(batches, rows, E)) * (rng.random((1, rows, E)) < 0.7) + 1
    c[:, :dense] = 0
    return c.astype(np.int64)


def _plan(rows: int, dense: tuple[int, ...] = (), params: dict[str, Any] | None = None, seed: int = 0) -> Placement:
    """A plan of ``rows`` layers of DeepSeek-V3's 256 experts on 2 x 8 GPUs, 18 slots each (EPLB on random load);
    ``dense`` rows recorded as dense."""
    w = np.random.default_rng(seed).random((rows, E)) * 100
    phy2log = rebalance_experts(w, 16 * 18, 1, 1, 16)[0]
    return Placement.from_eplb(phy2log, CLUSTER, num_experts=E, params={**(params or {}), "dense_layers": list(dense)})


def _stat_dump(path: Path, counts: np.ndarray) -> None:
    torch.save({"rank": 0, "logical_count": torch.from_numpy(counts.astype(np.int32)),
                "average_utilization_rate_over_window": None}, path)


# ------------------------------------------------------------------------------------------ the model of a load

def test_an_sglang_dump_of_deepseek_v3_is_planned_as_the_engines_plan_it(tmp_path: Path) -> None:
    """61 x 256 with layers 0-2 idle is DeepSeek-V3/R1 alone: the load names it, a note says so, and eplb then runs
    hierarchical with its 8 groups on 2 nodes (as SGLang's EPLB does), not global."""
    path = tmp_path / "expert_distribution_recorder_1.pt"
    _stat_dump(path, _layer_counts(H, DENSE, 1))
    opened = open_load(path)
    assert opened.load.preset == "deepseek-v3" and opened.format == "sglang"
    (note,) = opened.notes
    assert "DeepSeek-V3/R1" in note and "61 layers x 256 experts" in note and "--model" in note and "--groups 1" in note
    plan, _ = make_plan("eplb", opened.load, CLUSTER, Budget(slots_per_gpu=18))
    assert plan.params["num_groups"] == 8 and plan.params["mode"] == "hierarchical"
    named, _ = make_plan("eplb", opened.load, CLUSTER, Budget(slots_per_gpu=18), num_groups=8)
    assert named.gpu_experts == plan.gpu_experts
    told, _ = make_plan("eplb", opened.load, CLUSTER, Budget(slots_per_gpu=18), num_groups=1)
    assert told.params["mode"] == "global" and told.gpu_experts != plan.gpu_experts  # --groups 1 still overrides
    # the caller names the model: checked against the shape, no note
    r1 = open_load(path, model="deepseek-r1")
    assert r1.load.preset == "deepseek-r1" and r1.notes == ()
    with pytest.raises(InputError, match="does not fit model 'kimi-k2': it has 256 experts per layer, but Kimi-K2 "
                                         "has 384"):
        open_load(path, model="kimi-k2")
    with pytest.raises(InputError, match="unknown model 'deepseek-v9'"):
        open_load(path, model="deepseek-v9")


def test_each_engine_reader_names_the_model_from_its_shape(tmp_path: Path) -> None:
    # TensorRT-LLM statistics with the MTP layer (keys up to 61): 62 rows, layers 0-2 without keys
    folder = tmp_path / "stats"
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": 8}))
    counts = _layer_counts(H + 1, DENSE, 2, batches=1)[0]
    save_file({f"7_{layer}": counts[layer] for layer in range(DENSE, H + 1)}, str(folder / "rank0.safetensors"))
    load = read_any_load(folder)
    assert load.counts.shape == (1, 62, E) and load.preset == "deepseek-v3"
    # vLLM routed experts [tokens, 61, 8], dense layers all zeros: layers 3..60 kept
    rng = np.random.default_rng(3)
    routed = np.zeros((4, H, 8), dtype=np.uint16)
    for t in range(4):
        for layer in range(DENSE, H):
            routed[t, layer] = rng.choice(E, size=8, replace=False)
    np.save(tmp_path / "req.npy", routed)
    load = read_any_load(tmp_path / "req.npy", "vllm", num_experts=E)
    assert load.layer_ids is not None and load.layer_ids.tolist() == list(range(DENSE, H))
    assert load.preset == "deepseek-v3"
    # a shape no model has (and a model's experts with load in a dense layer) names none, and says nothing
    _stat_dump(tmp_path / "small.pt", _layer_counts(5, 2, 4)[:, :, :8])
    assert open_load(tmp_path / "small.pt").load.preset is None and open_load(tmp_path / "small.pt").notes == ()
    _stat_dump(tmp_path / "busy.pt", _layer_counts(H, 0, 5))
    assert read_any_load(tmp_path / "busy.pt").preset is None


# ---------------------------------------------------------------------------------------------- SGLang's rows

def test_sglang_file_has_num_hidden_layers_rows(tmp_path: Path) -> None:
    # a plan on a plain [58, 256] load (the MoE layers alone): the model's rows 3..60, rows 0-2 SGLang's trivial ones
    moe = _plan(58)
    info = write_placement(tmp_path / "a.json", moe)
    m = np.asarray(json.loads((tmp_path / "a.json").read_text())["physical_to_logical_map"])
    assert m.shape == (H, 288) and info["num_hidden_layers"] == H
    assert (m[:DENSE] == np.arange(288) % E).all()
    assert np.array_equal(m[DENSE:], slot_table(moe).phy2log)
    assert any("MoE layers 3..60" in n for n in info["notes"]) and any("DeepSeek-V3/R1" in n for n in info["notes"])
    # a plan on a load with the MTP layer (62 rows, 0-2 dense): 61 rows, the MTP row left out, and said so
    mtp = _plan(62, dense=(0, 1, 2))
    info = write_placement(tmp_path / "b.json", mtp)
    m = np.asarray(json.loads((tmp_path / "b.json").read_text())["physical_to_logical_map"])
    assert m.shape == (H, 288) and np.array_equal(m[DENSE:], slot_table(mtp).phy2log[DENSE:H])
    assert any("MTP layer (61) left out" in n for n in info["notes"])
    # the model recorded in the plan, or named by the caller, decides; a model the plan does not fit is refused
    recorded = _plan(58, params={"model": "deepseek-r1"})
    assert plan_layers(recorded).spec is not None and plan_layers(recorded).spec.name == "deepseek-r1"  # type: ignore[union-attr]
    with pytest.raises(PlanError, match="does not fit model 'qwen3-30b-a3b'"):
        write_placement(tmp_path / "c.json", moe, model="qwen3-30b-a3b")
    assert not (tmp_path / "c.json").exists()


def test_sglang_refuses_a_plan_that_cannot_say_its_rows(tmp_path: Path) -> None:
    """4 layers of 8 experts, all with load, no model: they may be all of a model's layers or its MoE layers alone."""
    rng = np.random.default_rng(6)
    plan = Placement.from_eplb(rebalance_experts(rng.random((4, 8)), 8, 1, 1, 2)[0], Cluster(num_nodes=1, gpus_per_node=2))
    with pytest.raises(PlanError, match="the plan's 4 layers all carry load and it names no model") as exc:
        write_placement(tmp_path / "x.json", plan)
    assert "\n" not in str(exc.value) and "--model" in str(exc.value)
    assert not (tmp_path / "x.json").exists()
    info = write_placement(tmp_path / "x.json", plan, num_hidden_layers=6)  # dense layers first, as DeepSeek's
    m = np.asarray(json.loads((tmp_path / "x.json").read_text())["physical_to_logical_map"])
    assert m.shape == (6, 8) and (m[:2] == np.arange(8) % 8).all() and np.array_equal(m[2:], slot_table(plan).phy2log)
    assert info["num_hidden_layers"] == 6


# ----------------------------------------------------------------------------------------- TensorRT-LLM's MTP key

def test_trtllm_yaml_gets_the_mtp_layer(tmp_path: Path) -> None:
    plan = _plan(H, dense=(0, 1, 2))  # a plan on a 61-layer load: no MTP row
    info = write_config(tmp_path / "plain.yaml", plan)
    assert sorted(yaml.safe_load((tmp_path / "plain.yaml").read_text())["initial_global_assignments"]) == \
        list(range(DENSE, H))
    info = write_config(tmp_path / "mtp.yaml", plan, mtp_layers=1)
    assign = yaml.safe_load((tmp_path / "mtp.yaml").read_text())["initial_global_assignments"]
    assert sorted(assign) == [*range(DENSE, H), 61]  # TensorRT-LLM's layer_idx of the MTP layer: 61 + 0
    assert assign[61] == [p % E for p in range(288)]  # no load for it: the engine's default order
    assert any("MTP layer 61" in n and "default order" in n for n in info["notes"])
    # a plan on a load that has the MTP layer (TensorRT-LLM statistics with key 61): its row, without being asked
    with_mtp = _plan(H + 1, dense=(0, 1, 2), seed=1)
    write_config(tmp_path / "load.yaml", with_mtp)
    assign = yaml.safe_load((tmp_path / "load.yaml").read_text())["initial_global_assignments"]
    assert sorted(assign) == [*range(DENSE, H), 61] and assign[61] == slot_table(with_mtp).phy2log[61].tolist()
    info = write_config(tmp_path / "off.yaml", with_mtp, mtp_layers=0)  # served without MTP
    assert 61 not in yaml.safe_load((tmp_path / "off.yaml").read_text())["initial_global_assignments"]
    assert any("61 left out" in n for n in info["notes"])
    # the MoE layers alone: the model's decoder-layer ids, not 0..57
    write_config(tmp_path / "moe.yaml", _plan(58), mtp_layers=1)
    assert sorted(yaml.safe_load((tmp_path / "moe.yaml").read_text())["initial_global_assignments"]) == \
        [*range(DENSE, H), 61]
    # the written file reads back as the plan, on the load with the MTP layer
    load = LoadMatrix(_layer_counts(H + 1, DENSE, 7))
    back = read_any_plan(tmp_path / "load.yaml", CLUSTER, load=load)
    assert back.gpu_experts[DENSE:] == with_mtp.gpu_experts[DENSE:]


def test_trtllm_mtp_needs_the_models_layers(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    plan = Placement.from_eplb(rebalance_experts(rng.random((4, 8)), 8, 1, 1, 2)[0], Cluster(num_nodes=1, gpus_per_node=2))
    with pytest.raises(PlanError, match="MTP layers are numbered after the model's decoder layers"):
        write_config(tmp_path / "x.yaml", plan, mtp_layers=1)
    with pytest.raises(PlanError, match=r"mtp_layers \(-1\) must be a non-negative integer"):
        write_config(tmp_path / "x.yaml", plan, mtp_layers=-1)
    write_config(tmp_path / "x.yaml", plan, mtp_layers=2, num_hidden_layers=4)
    assert sorted(yaml.safe_load((tmp_path / "x.yaml").read_text())["initial_global_assignments"]) == [0, 1, 2, 3, 4, 5]


def test_trtllm_yaml_with_string_layer_keys(tmp_path: Path) -> None:
    """TensorRT-LLM's pydantic config reads the key "3" as layer 3; so do we."""
    ids = [0, 1, 2, 3, 4, 5, 6, 7]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"num_slots": 8, "initial_global_assignments": {"3": ids, "4": ids},
                                                     "layer_updates_per_iter": 0}))
    plan = read_config(tmp_path / "s.yaml", Cluster(num_nodes=1, gpus_per_node=2), 5, 8, [3, 4])
    assert plan.gpu_experts[3] == ((0, 1, 2, 3), (4, 5, 6, 7)) and plan.num_layers == 5
    (tmp_path / "twice.yaml").write_text(yaml.safe_dump({"num_slots": 8, "initial_global_assignments": {"3": ids, 3: ids}}))
    with pytest.raises(InputError, match="layer 3 is listed twice"):
        read_config(tmp_path / "twice.yaml", Cluster(num_nodes=1, gpus_per_node=2))
    (tmp_path / "word.yaml").write_text(yaml.safe_dump({"num_slots": 8, "initial_global_assignments": {"three": ids}}))
    with pytest.raises(InputError, match="layer id 'three' must be a non-negative integer"):
        read_config(tmp_path / "word.yaml", Cluster(num_nodes=1, gpus_per_node=2))


def test_vllm_map_leaves_the_mtp_layer_out(tmp_path: Path) -> None:
    plan = _plan(H + 1, dense=(0, 1, 2), seed=2)
    info = write_map(tmp_path / "m.json", plan)
    rows = json.loads((tmp_path / "m.json").read_text())
    assert len(rows) == 58 and rows == slot_table(plan).phy2log[DENSE:H].tolist()
    assert any("MTP layer (61) left out" in n for n in info["notes"])


# ------------------------------------------------------------------------------------------ review fixes

def test_an_exported_file_scores_on_the_moe_only_load_it_was_planned_on(tmp_path: Path) -> None:
    """A plan on a plain [58, 256] load is written with DeepSeek-V3's 61 rows (SGLang) or keys 3..60 (TensorRT-LLM);
    read back against that same load, rows 3..60 are its 58 layers. Before: 'the plan has 61 layers ... but the load
    has 58' and 'places layer 60 but the load has 58 layers'."""
    load = LoadMatrix(_layer_counts(58, 0, 11))
    plan = _plan(58, seed=3)
    write_placement(tmp_path / "init.json", plan)
    write_config(tmp_path / "lb.yaml", plan, mtp_layers=1)
    for name in ("init.json", "lb.yaml"):
        back = read_any_plan(tmp_path / name, CLUSTER, load=load)
        assert back.num_layers == 58 and back.gpu_experts == plan.gpu_experts, name
    # a load that names no model and fits none keeps its own rows: a 61-row file does not fit it
    other = LoadMatrix(_layer_counts(57, 0, 12))
    with pytest.raises(PlanError, match="places layer 61 but the load has 57 layers"):
        read_any_plan(tmp_path / "lb.yaml", CLUSTER, load=other)


def test_vllm_routed_experts_of_a_named_model_have_its_experts(tmp_path: Path) -> None:
    """One short request never picks expert 255: the ids alone say 255 experts. Named as DeepSeek-V3 it has 256.
    Before: 'does not fit model 'deepseek-v3': it has 255 experts per layer'."""
    rng = np.random.default_rng(13)
    routed = np.zeros((1, H, 8), dtype=np.uint16)
    for layer in range(DENSE, H):
        routed[0, layer] = rng.choice(E - 1, size=8, replace=False)
    np.save(tmp_path / "req.npy", routed)
    load = read_any_load(tmp_path / "req.npy", "vllm", model="deepseek-v3")
    assert load.num_experts == E and load.preset == "deepseek-v3" and load.counts[..., E - 1].sum() == 0
    assert read_any_load(tmp_path / "req.npy", "vllm").num_experts == E - 1  # no model named: the ids decide
    routed[0, DENSE, 0] = E
    np.save(tmp_path / "bad.npy", routed)
    with pytest.raises(InputError, match="expert id 256 is not below"):
        read_any_load(tmp_path / "bad.npy", "vllm", model="deepseek-v3")


# ----- the registry: one record per engine, and nothing else names them -----------------------------------------------

def test_the_commands_offer_exactly_the_registered_engines() -> None:
    """--engine, export --to, watch --engine and the formats a load or plan is read in are the registry's names."""
    from moebalance.app.advise import ENGINES as ADVISED
    from moebalance.app.commands.export import EXPORT_FORMATS
    from moebalance.engines.detect import LOAD_FORMATS, PLAN_FORMATS
    from moebalance.engines.registry import DETECTION, ENGINES

    assert set(ENGINES) == {"sglang", "trtllm", "vllm"} == set(ADVISED) == set(EXPORT_FORMATS)
    assert sorted(e.name for e in DETECTION) == sorted(ENGINES) and LOAD_FORMATS == ("moebalance", "sglang", "trtllm", "vllm")
    assert PLAN_FORMATS == ("moebalance", *sorted(n for n, e in ENGINES.items() if e.read_plan is not None))
    assert all(e.name == name for name, e in ENGINES.items())


def test_no_command_branches_on_an_engine_name() -> None:
    """Outside the engine modules, no code compares a value with an engine's name, keys a table by it, indexes with it
    or passes it to a call (a keyword's default, ``watch --engine``'s, is a choice, not a branch): what differs per
    engine is its Engine record's."""
    import ast

    names = {"sglang", "trtllm", "vllm"}
    src = Path(__file__).resolve().parents[1] / "src" / "moebalance"
    own = {src / "engines" / f"{n}.py" for n in names} | {src / "engines" / "vllm_plugin.py"}
    found = []
    for path in sorted(src.rglob("*.py")):
        if path in own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            consts: list[ast.expr] = []
            if isinstance(node, ast.Compare):
                consts = [node.left, *node.comparators]
                consts += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts]
            elif isinstance(node, ast.Dict):
                consts = [k for k in node.keys if k is not None]
            elif isinstance(node, ast.Subscript):  # ENGINES["sglang"]
                consts = [node.slice]
            elif isinstance(node, ast.Call):  # ENGINES.get("vllm"), get_engine("trtllm")
                consts = list(node.args)
            found += [f"{path.relative_to(src)}:{node.lineno}" for c in consts
                      if isinstance(c, ast.Constant) and c.value in names]
    assert not found, f"engine names branched on outside the engine modules: {found}"


@pytest.mark.parametrize("name", ["sglang", "trtllm", "vllm"])
def test_every_engine_writes_a_plan_its_own_reader_takes_back(name: str, tmp_path: Path) -> None:
    """Each engine's placement writer and reader agree (vLLM's is moebalance's plan, which its plug-in reads)."""
    from moebalance.core.load import LoadMatrix
    from moebalance.core.plan import Placement, read_plan
    from moebalance.engines import read_any_plan
    from moebalance.engines.registry import ENGINES

    cluster = Cluster(num_nodes=1, gpus_per_node=4)
    plan = Placement([[[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]]] * 32, 8, cluster)  # Mixtral's shape, 4 copied
    engine = ENGINES[name]
    dest = tmp_path / f"plan{engine.export_suffix}"
    engine.write_plan(dest, plan, None)
    load = LoadMatrix(np.ones((1, 32, 8), dtype=np.int64))
    back = read_plan(dest) if engine.read_plan is None else read_any_plan(dest, cluster, name, load)
    assert [sorted(map(sorted, layer)) for layer in back.gpu_experts] == [sorted(map(sorted, layer))
                                                                           for layer in plan.gpu_experts]
