"""The options the commands share (:mod:`moebalance.app.options`): the one ``--set`` rule, the bounded argument types,
``--model`` naming a load's model, no abbreviated options, the version's one source, and the command modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_user_error, run_cli

import moebalance
from moebalance.app import options
from moebalance.app.cli import build_parser
from moebalance.app.commands import COMMANDS
from moebalance.app.compare import Scenario, run_comparison
from moebalance.app.demo import DEMO
from moebalance.app.sweep import canonical, sweep_keys
from moebalance.core.budget import Budget
from moebalance.core.cluster import Cluster
from moebalance.core.errors import InputError
from moebalance.core.load import LoadMatrix
from moebalance.engines import LOAD_FORMATS

ROOT = Path(__file__).resolve().parents[1]


# ----- the --set rule ----------------------------------------------------------------------------------------------

def test_plain_items_go_to_every_policy_that_has_the_key() -> None:
    got = options.resolve_set(["num_groups=2", "allocation=uniform"], ["contiguous", "eplb", "craft"])
    assert got == {"contiguous": {}, "eplb": {"num_groups": 2}, "craft": {"allocation": "uniform"}}


def test_dotted_items_go_to_one_policy() -> None:
    got = options.resolve_set(["grace.seed=3", "seed=1"], ["grace", "moetuner"])
    assert got == {"grace": {"seed": 1}, "moetuner": {"seed": 1}}  # the later plain item wins for both
    got = options.resolve_set(["seed=1", "grace.seed=3"], ["grace", "moetuner"])
    assert got == {"grace": {"seed": 3}, "moetuner": {"seed": 1}}


@pytest.mark.parametrize(("items", "want"), [
    (["eplb.num_groups=4", "num_groups=2"], 2),
    (["num_groups=2", "eplb.num_groups=4"], 4),
    (["num_groups=2", "num_groups=3"], 3),
])
def test_later_items_win_whatever_their_form(items: list[str], want: int) -> None:
    assert options.resolve_set(items, ["eplb"])["eplb"] == {"num_groups": want}


def test_a_dedicated_flag_is_an_item_placed_first() -> None:
    first = [("--groups", "num_groups", 8)]
    assert options.resolve_set(None, ["greedy", "eplb"], first=first)["eplb"] == {"num_groups": 8}
    assert options.resolve_set(["num_groups=1"], ["eplb"], first=first)["eplb"] == {"num_groups": 1}
    assert options.resolve_set(["eplb.num_groups=1"], ["eplb"], first=first)["eplb"] == {"num_groups": 1}
    with pytest.raises(InputError, match=r"^--groups: policy 'greedy' has no parameter 'num_groups'; it takes none$"):
        options.resolve_set(None, ["greedy"], first=first)


def test_values_parse_as_json_where_they_can() -> None:
    got = options.resolve_set(["ratio=1.5", "replication=fixed", "seed=7"], ["grace"])["grace"]
    assert got == {"ratio": 1.5, "replication": "fixed", "seed": 7}
    assert options.resolve_set(["replica_counts=[1, 2]"], ["craft"])["craft"] == {"replica_counts": [1, 2]}


def test_a_value_too_long_to_convert_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A 5,000-digit ``--set`` or ``--router-set`` value raised Python's ValueError (integer string conversion
    limit) out of ``json.loads``: a traceback instead of one line."""
    long = "9" * 5000
    with pytest.raises(InputError, match=r"^--set seed: 9{20}\.\.\. cannot be read \(Exceeds the limit") as info:
        options.resolve_set([f"seed={long}"], ["grace"])
    assert "\n" not in str(info.value) and len(str(info.value)) < 200
    assert_user_error(["plan", "--load", "bundled:olmoe-1b-7b-tokens", "--policy", "grace", "--nodes", 1,
                       "--gpus-per-node", 8, "--replicas-per-gpu", 1, "--set", f"seed={long}", "--out", "p.json"],
                      capsys, "--set seed: 999")
    assert_user_error(["evaluate", "--plan", "p.json", "--load", "x.npy", "--router", "rebalance", "--router-set",
                       f"eps={long}"], capsys, "--router-set eps: 999")


@pytest.mark.parametrize(("items", "policies", "message"), [
    (["speed=3"], ["greedy"], "--set speed: policy 'greedy' has no parameter 'speed'; it takes none"),
    (["speed=3"], ["eplb", "greedy"], "--set speed: no policy among --policies eplb,greedy has parameter 'speed'; "
                                      "eplb: num_groups, avoid_duplicates, objective, workload_batches; greedy: none"),
    (["eplb.speed=3"], ["eplb"], "--set eplb.speed: policy 'eplb' has no parameter 'speed'; its parameters: "
                                 "num_groups, avoid_duplicates, objective, workload_batches"),
    (["craft.objective=gain"], ["eplb", "greedy"], "--set craft.objective: 'craft' is not among --policies "
                                                   "eplb,greedy"),
    (["novalue"], ["eplb"], "--set 'novalue' must look like key=value"),
    (["=3"], ["eplb"], "--set '=3' must look like key=value"),
])
def test_unknown_keys_are_one_line_naming_the_known_ones(items: list[str], policies: list[str], message: str) -> None:
    with pytest.raises(InputError) as info:
        options.resolve_set(items, policies)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(InputError, match=r"unknown policy 'magic'; choose one of: contiguous, .*libra"):
        options.resolve_set(None, ["magic"])


def test_policy_keys_are_the_config_fields() -> None:
    assert options.policy_keys("eplb") == ("num_groups", "avoid_duplicates", "objective", "workload_batches")
    assert options.policy_keys("greedy") == ()
    assert "predictor" in (options.policy_keys("libra") or ())


def test_the_sweep_policies_take_their_policy_options() -> None:
    assert "allocation" not in sweep_keys("craft-uniform") and "objective" in sweep_keys("craft-uniform")
    assert sweep_keys("craft") == options.policy_keys("craft")
    got = options.resolve_set(["objective=weighted"], ["craft", "craft-uniform", "eplb"], keys=sweep_keys)
    assert got == {"craft": {"objective": "weighted"}, "craft-uniform": {"objective": "weighted"},
                   "eplb": {"objective": "weighted"}}  # eplb reads craft's "weighted" as its "sum"


def test_sweeps_uniform_is_an_alias_that_names_no_router() -> None:
    assert canonical(["uniform", "craft", "craft-uniform"]) == ["craft-uniform", "craft"]
    with pytest.raises(InputError, match="sweep policy 'random' is unknown; choose from craft, craft-uniform"):
        canonical(["random"])


# ----- argument types ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "message"), [
    ("0", "0 must be >= 1"),
    ("-2", "-2 must be >= 1"),
    ("x", "'x' is not an integer"),
    ("65537", "65,537 is more than 65,536"),
])
def test_bounded_counts(text: str, message: str) -> None:
    parse = options.count(options.MAX_GPUS)
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(message)}$"):
        parse(text)
    assert parse("65536") == 65536 and options.non_negative("0") == 0


@pytest.mark.parametrize("text", ["0", "2", "-0.5", "nan", "inf", "x"])
def test_fraction_is_in_zero_one(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        options.fraction(text)
    assert options.fraction("1") == 1.0 and options.fraction("0.79") == 0.79


def test_a_number_with_a_newline_is_named_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """float() accepts surrounding whitespace, and the message quoted the text as given: a newline in the value
    split the error over two lines."""
    for parse in (options.fraction, options.non_negative_float):
        with pytest.raises(argparse.ArgumentTypeError) as info:
            parse("-2\n")
        assert str(info.value).startswith("-2 must be") and "\n" not in str(info.value)
    assert_user_error(["cost", "--model", "deepseek-v3", "--gpu", "h100-80gb", "--nodes", 1, "--gpus-per-node", 8,
                       "--memory-fraction", "2\n"], capsys, "--memory-fraction: 2 must be in (0, 1]")


def test_replicas_per_gpu_type() -> None:
    assert options.replicas("auto") == "auto" and options.replicas("8") == 8
    with pytest.raises(argparse.ArgumentTypeError, match="more than 1,048,576"):
        options.replicas(str(10**9))


# ----- --model names a load's model ------------------------------------------------------------------------------

def test_load_model_names_the_loads_model() -> None:
    counts = np.ones((1, 61, 256), dtype=np.int64)
    counts[:, :3] = 0  # DeepSeek-V3's 61 decoder layers, the 3 dense ones without load
    load = LoadMatrix(counts)
    named = options.load_model(load, "deepseek-v3")
    assert named.preset == "deepseek-v3" and named.model is not None and named.model.num_groups == 8
    assert options.load_model(named, "deepseek-v3") is named
    assert options.load_model(named, "deepseek-r1").preset == "deepseek-r1"  # a model of the same shape
    assert options.load_model(load, None) is load
    with pytest.raises(InputError, match=r"the load \(--model kimi-k2\) does not fit model 'kimi-k2': it has 256 experts "
                                         r"per layer, but Kimi-K2 has 384; give the load's --model"):
        options.load_model(load, "kimi-k2")
    # the one rule of ModelSpec.misfit: the MoE layers alone (58), the decoder layers (61), or with the MTP layer (62)
    for rows in (58, 61, 62):
        rows_load = np.ones((1, rows, 256), dtype=np.int64)
        rows_load[:, :3] *= rows == 58  # the decoder layers' dense rows carry no load
        assert options.load_model(LoadMatrix(rows_load), "deepseek-v3").num_layers == rows
    with pytest.raises(InputError, match=r"it has load in layer 0, which is dense in DeepSeek-V3 \(layers 0\.\.2\)"):
        options.load_model(LoadMatrix(np.ones((1, 61, 256), dtype=np.int64)), "deepseek-v3")
    with pytest.raises(InputError, match=r"it has 59 layers, but DeepSeek-V3 has 61 decoder layers \(3 dense, then 58 "
                                         r"MoE\) and 1 MTP layer of 256 experts"):
        options.load_model(LoadMatrix(np.ones((1, 59, 256), dtype=np.int64)), "deepseek-v3")


# ----- the parser --------------------------------------------------------------------------------------------------

def test_every_command_is_a_module_with_add_parser_and_run() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["synth", "plan", "evaluate", "compare", "sweep", "stats", "demo", "import", "export",
                                 "cost", "calibrate", "predict", "online", "advise", "watch", "capture", "run"]
    for command in COMMANDS:
        assert callable(command.add_parser) and callable(command.run)
    for name, p in sub.choices.items():
        assert p.get_default("func").__module__.startswith("moebalance.app.commands."), name
        assert p.allow_abbrev is False, name


@pytest.mark.parametrize(("argv", "fragment"), [
    # an abbreviation is never read as the option it starts (--gpus was --gpus-per-node before)
    (["online", "--load", "x.npz", "--policy", "eplb", "--nodes", "1", "--gpus-per-node", "2", "--slots-per-gpu",
      "4", "--warmup", "0:1", "--gpus", "2"], "unrecognized option --gpus;"),
    (["plan", "--load", "x.npz", "--policy", "greedy", "--nodes", "1", "--gpus-per-node", "2", "--slots-per-gpu",
      "4", "--batch", "0:1", "--out", "p.json"], "unrecognized option --batch; did you mean --batches?"),
])
def test_abbreviated_options_are_refused(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_user_error(argv, capsys, fragment)


def test_the_version_has_one_source(capsys: pytest.CaptureFixture[str]) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert moebalance.__version__ == importlib.metadata.version("moebalance") == declared
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.strip() == f"moebalance {declared}"
    written = [p for p in (ROOT / "src" / "moebalance").rglob("*.py") if f'"{declared}"' in p.read_text()]
    assert written == [], f"the version is written again in {written}"


def test_export_names_the_engine_with_to_and_keeps_format_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    base = ["export", "--plan", "p.json", "--out", "x.json"]
    assert parser.parse_args([*base, "--to", "sglang"]).to == "sglang"
    assert parser.parse_args([*base, "--format", "trtllm"]).to == "trtllm"  # the old name still runs
    export = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["export"]
    assert "--format" not in export.format_help() and "--to" in export.format_help()
    # the load's format takes every engine's load format, vLLM's included
    assert parser.parse_args([*base, "--to", "vllm", "--load-format", "vllm"]).load_format == "vllm"
    assert next(a for a in export._actions if a.dest == "load_format").choices == LOAD_FORMATS
    assert_user_error([*base, "--to", "sglang", "--format", "trtllm"], capsys, "not allowed with argument --to")
    assert_user_error(base, capsys, "one of the arguments --to is required")


# ----- comparisons keyed by scenario name ------------------------------------------------------------------------

def test_demo_notes_quote_rows_by_scenario_name_not_label() -> None:
    @dataclasses.dataclass
    class Row:
        score: Any

    quoted = {"eplb-global-random": 0.1111, "eplb-global": 0.2222, "eplb-global-rebalance": 0.3333,
              "eplb-global-minmax": 0.4444}  # the rows part 1's note quotes, each with its own value
    for _, comparison, _ in DEMO:
        rows = {sc.key: Row(type("S", (), {"balancedness": quoted.get(sc.key, 0.5)})())
                for sc in comparison.scenarios}
        notes = comparison.notes(rows)  # every row a note quotes exists under its scenario's key
        assert notes and all(isinstance(line, str) and line.startswith("- ") for line in notes)
        if comparison is DEMO[0][1]:
            assert set(quoted) <= set(rows)
            assert "balancedness 0.1111 (equal split: 0.2222); with Libra's token rebalancer 0.3333, with the best " \
                   "split of each batch (minmax router) 0.4444." in " ".join(notes)
        relabelled = [dataclasses.replace(sc, label=f"{sc.display} *") for sc in comparison.scenarios]
        named = {sc.key: rows[orig.key] for sc, orig in zip(relabelled, comparison.scenarios, strict=True)
                 if sc.name is not None}
        assert all(sc.key == orig.key for sc, orig in zip(relabelled, comparison.scenarios, strict=True)
                   if sc.name is not None)  # named rows keep their keys when their labels change
        assert comparison.notes(named) == notes  # and the notes quote the same rows


def test_two_scenarios_of_one_name_are_refused() -> None:
    load = LoadMatrix(np.ones((2, 1, 4), dtype=np.int64))
    twice = [Scenario("greedy", Budget(slots_per_gpu=2)), Scenario("contiguous", Budget(slots_per_gpu=2),
                                                                   label="greedy")]
    with pytest.raises(InputError, match="two rows of the comparison are named 'greedy'"):
        run_comparison(load, Cluster(num_nodes=1, gpus_per_node=2), twice)


@pytest.mark.parametrize("command", ["compare", "online", "evaluate", "stats", "sweep", "cost", "predict"])
def test_a_second_load_is_refused_where_one_is_read(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse keeps the last of a repeated flag: a second --load was silently the only one read."""
    from conftest import assert_user_error

    assert_user_error([command, "--load", "a.npz", "--load", "b.npz"], capsys, "--load: given twice",
                      "plan or advise")
