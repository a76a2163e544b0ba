"""Check moebalance's engine files and vLLM plug-in with the engines' own code (``make engines``).

Runs in the scratch environment ``make engines`` builds (.venv-engines: CPU torch, vLLM and SGLang installed
without their dependencies, plus the few modules their imports need). No GPU, no model weights, no server:

- vLLM: ``vllm.plugins.load_general_plugins()`` finds the ``moebalance_eplb`` entry point, vLLM's
  ``EPLB_POLICIES["default"]`` is then our policy (and the plug-in logged so), it plans as balanced as vLLM's own
  default policy, and after an elastic scale-up (``-1`` in the current map) it returns no empty slot;
- advise: SGLang reads the placement ``moebalance advise`` writes, its own argument parser takes the whole command
  advise prints, and vLLM's own ``EPLBConfig`` validates advise's ``--eplb-config``;
- SGLang: ``compute_initial_expert_location_metadata`` reads our exported ``--init-expert-location`` files and
  derives the maps we meant (each expert's slots, layer by layer); the files have one row per decoder layer
  (``num_hidden_layers``, which SGLang's own DeepSeek model description gives) for a plan made on the MoE layers
  alone and for one made on a load with the MTP layer.

SGLang's configuration getters (``get_exec``, ``get_parallel``, ``get_device``) need a full server start-up to be
set; they are replaced by the values a launch with ``--ep-size 16 --ep-num-redundant-experts 32 --nnodes 2`` would
publish, and the model description comes from SGLang's own ``get_model_config_for_expert_location`` of
``DeepseekV2ForCausalLM``, read from its source (importing the model module needs GPU-only packages). Exit code 0
when every check passes; each check prints one line.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

from moebalance.core.cluster import Cluster
from moebalance.core.plan import Placement
from moebalance.engines.sglang import write_placement
from moebalance.engines.slots import slot_table
from moebalance.engines.vllm_plugin import ENV, balancedness
from moebalance.eplb import rebalance_experts

E, DENSE, H = 256, 3, 61  # DeepSeek-V3/R1
G, S = 16, 18  # 2 nodes x 8 GPUs, 18 slots each: 32 redundant experts
FAILED: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok:   " if ok else "FAIL: ") + what)
    if not ok:
        FAILED.append(what)


def vllm_checks() -> None:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("moebalance").addHandler(Keep())
    logging.getLogger("moebalance").setLevel(logging.INFO)
    os.environ[ENV] = "move-aware"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.distributed.eplb.policy import EPLB_POLICIES
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    ours = EPLB_POLICIES["default"]
    check(getattr(ours, "variant", None) == "move-aware", f"vLLM's EPLB_POLICIES['default'] is {ours.__name__}")
    check(any("move-aware" in r for r in records), f"the plug-in logged: {records[-1] if records else '(nothing)'}")
    w = (torch.rand(4, E, generator=torch.Generator().manual_seed(0)) ** 4 * 1000).round() + 1
    got = ours.rebalance_experts(w, G * S, 8, 2, G)
    theirs = DefaultEplbPolicy.rebalance_experts(w, G * S, 8, 2, G)
    wn = w.double().numpy()
    check(np.allclose(balancedness(np.asarray(got), wn, G), balancedness(np.asarray(theirs), wn, G)),
          "move-aware plans as balanced as vLLM's default policy (DeepSeek-V3 shape, 2 nodes x 8 GPUs)")
    old = np.asarray(theirs).copy()
    old[:, -S:] = -1  # the slots an elastic scale-up added, as vLLM marks them
    for name, weight in (("busy", w), ("idle", torch.zeros_like(w))):
        after = np.asarray(ours.rebalance_experts(weight, G * S, 8, 2, G, torch.from_numpy(old)))
        check(bool((after >= 0).all()) and after.shape == old.shape,
              f"after a scale-up (-1 slots), {name} window: no empty slot returned")
    # an elastic scale-down: vLLM passes the 16 ranks' map and asks for the survivors' slots (ranks 0..n-1 stay);
    # 40 slots per rank, so that 8 ranks still hold the 256 experts
    S2 = 40
    current = np.asarray(DefaultEplbPolicy.rebalance_experts(w, G * S2, 8, 2, G))
    w2 = (torch.rand(4, E, generator=torch.Generator().manual_seed(1)) ** 4 * 1000).round() + 1
    for n in (8, 12):
        args = (w2, n * S2, 8, 2, n, torch.from_numpy(current))
        mine, default = np.asarray(ours.rebalance_experts(*args)), np.asarray(DefaultEplbPolicy.rebalance_experts(*args))
        kept = [int((m == current[:, : n * S2]).sum()) for m in (mine, default)]
        print(f"      scale-down 16 -> {n} ranks: slots kept in place, move-aware {kept[0]}, vLLM's default {kept[1]}")
        check(kept[0] >= kept[1], f"scale-down 16 -> {n} ranks: move-aware keeps at least the slots vLLM's default "
                                  f"keeps ({kept[0]} against {kept[1]})")


def _sglang_model_config(el: types.ModuleType) -> object:
    """SGLang's own ``DeepseekV2ForCausalLM.get_model_config_for_expert_location``, from its source."""
    import sglang

    source = Path(sglang.__file__).parent / "srt" / "models" / "deepseek_v2.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV2ForCausalLM")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_model_config_for_expert_location")
    holder = ast.ClassDef(name="Holder", bases=[], keywords=[], body=[fn], decorator_list=[])
    space: dict[str, object] = {"ModelConfigForExpertLocation": el.ModelConfigForExpertLocation}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[holder], type_ignores=[])), str(source), "exec"), space)
    config = types.SimpleNamespace(num_hidden_layers=H, n_routed_experts=E, n_group=8)  # DeepSeek-V3's config.json
    return space["Holder"].get_model_config_for_expert_location(config)  # type: ignore[attr-defined]


def sglang_checks(tmp: Path) -> None:
    import sglang.srt.eplb.expert_location as el

    spec = _sglang_model_config(el)
    check(spec.num_layers == H, f"SGLang's DeepSeek model description has num_layers {spec.num_layers}")
    ns = types.SimpleNamespace
    moe = ns(init_expert_location="", ep_num_redundant_experts=G * S - E, ep_join_mode="none",
             ep_dispatch_algorithm="static", moe_a2a_backend="none", eplb_algorithm="auto")
    el.get_exec = lambda: ns(moe=moe)
    el.get_parallel = lambda: ns(ep_size=G, nnodes=2, elastic_ep_initial_size=None, tp_size=G, ep_join_rank_offset=0)
    el.get_device = lambda: ns(device="cpu")
    el.ModelConfigForExpertLocation.from_model_config = staticmethod(lambda model_config: spec)
    cluster = Cluster(num_nodes=2, gpus_per_node=8)
    rng = np.random.default_rng(1)
    cases = {"the MoE layers alone ([58, 256] load)": (58, ()), "a load with the MTP layer ([62, 256])": (62, (0, 1, 2))}
    for name, (rows, dense) in cases.items():
        phy2log = rebalance_experts(rng.random((rows, E)) * 100, G * S, 8, 2, G)[0]
        plan = Placement.from_eplb(phy2log, cluster, num_experts=E, params={"dense_layers": list(dense)})
        path = tmp / f"init_{rows}.json"
        write_placement(path, plan)
        moe.init_expert_location = str(path)
        meta = el.compute_initial_expert_location_metadata(ns(), moe_ep_rank=0)
        m = meta.physical_to_logical_map.numpy()
        check(m.shape == (H, G * S), f"{name}: SGLang reads a map of {m.shape[0]} rows (num_hidden_layers {H})")
        planned = slot_table(plan).phy2log
        moe_rows = planned[-(H - DENSE):] if rows == 58 else planned[DENSE:H]
        check(np.array_equal(m[DENSE:], moe_rows) and bool((m[:DENSE] == np.arange(G * S) % E).all()),
              f"{name}: layers 3..60 are the plan's, layers 0-2 SGLang's trivial layout")
        slots_of = meta.logical_to_all_physical_map.numpy()
        same = all(sorted(x for x in slots_of[layer, e] if x >= 0) == np.flatnonzero(m[layer] == e).tolist()
                   for layer in (DENSE, H - 1) for e in range(E))
        check(same, f"{name}: SGLang's logical_to_all_physical_map lists each expert's slots of the plan")
    doc = json.loads((tmp / "init_58.json").read_text())
    check(list(doc) == ["physical_to_logical_map"], "the file holds physical_to_logical_map only")


def advise_checks(tmp: Path) -> None:
    """``moebalance advise`` on SGLang's published decode statistics: SGLang reads the placement it writes with
    the flags it prints (ep size 64, the redundant experts it names), SGLang's own argument parser takes every flag; with
    ``--engine vllm`` the ``--eplb-config`` it prints validates as vLLM's own ``EPLBConfig``."""
    import subprocess

    import sglang.srt.eplb.expert_location as el

    stats = Path(__file__).resolve().parent.parent / "tests" / "data" / "sglang-deepseek-v3"
    out = tmp / "advice"
    done = subprocess.run([sys.executable, "-m", "moebalance", "advise", "--load", str(stats / "decode_in1000out1000.json"),
                           "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100-80gb", "--out-dir", str(out), "--json"],
                          capture_output=True, text=True, check=False)
    check(done.returncode == 0, "advise on SGLang's decode statistics ran" +
          ("" if done.returncode == 0 else f": {done.stderr.strip()[-300:]}"))
    if done.returncode != 0:
        return
    rec = json.loads(done.stdout)["recommendation"]
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs

    # the command's first line, after "python -m sglang.launch_server", its multi-node placeholders filled in
    command = shlex.split((out / "launch.txt").read_text().splitlines()[0])
    fill = {"$NODE_RANK": "0", "$DIST_INIT_ADDR": "127.0.0.1:5000"}
    flags = [fill.get(w, w) for w in command[command.index("sglang.launch_server") + 1:]]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # SGLang's own command line
    parsed, unknown = parser.parse_known_args(flags)
    check(not unknown and parsed.model_path == "deepseek-ai/DeepSeek-V3" and parsed.ep_size == 64 and
          parsed.init_expert_location == flags[flags.index("--init-expert-location") + 1],
          f"SGLang's own argument parser takes the whole command advise prints: {flags}")
    path = Path(flags[flags.index("--init-expert-location") + 1])
    redundant = int(flags[flags.index("--ep-num-redundant-experts") + 1])
    check(redundant == rec["redundant_experts"], f"the flags name the recommendation's {redundant} redundant experts")
    ns = types.SimpleNamespace
    slots = E + redundant
    moe = ns(init_expert_location=str(path), ep_num_redundant_experts=redundant, ep_join_mode="none",
             ep_dispatch_algorithm="static", moe_a2a_backend="none", eplb_algorithm="auto")
    el.get_exec = lambda: ns(moe=moe)
    el.get_parallel = lambda: ns(ep_size=64, nnodes=8, elastic_ep_initial_size=None, tp_size=64, ep_join_rank_offset=0)
    meta = el.compute_initial_expert_location_metadata(ns(), moe_ep_rank=0)
    m = meta.physical_to_logical_map.numpy()
    written = np.array(json.loads(path.read_text())["physical_to_logical_map"])
    check(m.shape == (H, slots) and np.array_equal(m, written),
          f"SGLang reads advise's placement as written ({m.shape[0]} x {m.shape[1]})")
    from vllm.config.parallel import EPLBConfig

    vllm_out = tmp / "advice-vllm"
    done = subprocess.run([sys.executable, "-m", "moebalance", "advise", "--load", str(stats / "decode_in1000out1000.json"),
                           "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100-80gb", "--engine", "vllm",
                           "--out-dir", str(vllm_out), "--json"], capture_output=True, text=True, check=False)
    line = shlex.split((vllm_out / "launch.txt").read_text().splitlines()[0]) if done.returncode == 0 else []
    given = json.loads(line[line.index("--eplb-config") + 1]) if "--eplb-config" in line else None
    try:
        config = EPLBConfig(**given) if given is not None else None
    except Exception as exc:  # vLLM's own validation: pydantic's error, whatever its class
        check(False, f"vLLM's EPLBConfig refuses advise's --eplb-config {given}: {exc}")
        return
    check(config is not None and config.num_redundant_experts == json.loads(done.stdout)["recommendation"][
        "redundant_experts"], f"vLLM's own EPLBConfig validates the --eplb-config advise prints: {given}")


def main() -> int:
    vllm_checks()
    with tempfile.TemporaryDirectory() as tmp:
        sglang_checks(Path(tmp))
        advise_checks(Path(tmp))
    print(f"{'all engine checks passed' if not FAILED else f'{len(FAILED)} engine checks failed'}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
