"""Shared fixtures and hypothesis settings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from moebalance.models import ModelSpec

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def random_replica_layers(rng: object, num_layers: int, num_experts: int, num_gpus: int) -> list[list[list[int]]]:
    """``[L][G]`` expert lists where every expert sits on a random non-empty set of distinct GPUs."""
    import numpy as np

    assert isinstance(rng, np.random.Generator)
    layers = []
    for _ in range(num_layers):
        gpus: list[list[int]] = [[] for _ in range(num_gpus)]
        for e in range(num_experts):
            for g in rng.choice(num_gpus, size=int(rng.integers(1, num_gpus + 1)), replace=False):
                gpus[int(g)].append(e)
        layers.append(gpus)
    return layers


def tiny_model_spec(**changes: object) -> ModelSpec:
    """A small valid ``ModelSpec`` (8 experts, top-2, 2 layers) with ``changes`` applied."""
    fields: dict[str, object] = dict(name="tiny", display_name="Tiny", num_layers=2, num_dense_layers=0, num_experts=8,
                                     top_k=2, hidden_size=16, moe_intermediate_size=32, num_shared_experts=0,
                                     num_groups=1, source="https://example.org/config.json")
    fields.update(changes)
    return ModelSpec(**fields)  # type: ignore[arg-type]


def run_cli(argv: Sequence[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``moebalance argv`` in process; argparse's SystemExit counts as the exit
    code."""
    from moebalance.app.cli import main

    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse reports its errors by raising SystemExit(2)
        rc = 0 if exc.code is None else exc.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    return int(rc), captured.out, captured.err


def assert_user_error(argv: Sequence[Any], capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    """A user mistake: exit code 2, nothing on stdout, exactly one stderr line ``moebalance: error: ...`` holding
    every fragment, no traceback. Returns the line."""
    rc, out, err = run_cli(argv, capsys)
    assert "Traceback" not in err, err
    assert not out, out
    lines = err.strip().splitlines()
    assert rc == 2, f"exit code {rc}, stderr: {err!r}"
    assert len(lines) == 1, f"expected exactly one stderr line, got: {err!r}"
    assert lines[0].startswith("moebalance: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


_COMPILE = """
import sys
import triton
from importlib import import_module
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, signature, variants, options = eval(sys.argv[1])
fn = import_module(module).kernel(False)
for arch in (80, 90):
    for constexprs in variants:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                           target=GPUTarget("cuda", arch, 32), options=options)
        assert k.asm["cubin"], (arch, constexprs)
print("compiled")
"""


def assert_compiles_for_gpus(module: str, signature: dict[str, str], variants: Sequence[dict[str, Any]],
                             options: dict[str, Any] | None = None, *, timeout: float = 600,
                             env: dict[str, str] | None = None) -> None:
    """``module``'s Triton kernel (its ``kernel(False)``) compiles down to a cubin for the A100 (sm_80) and the H100
    (sm_90) with each of ``variants``' constexprs, in a fresh process with Triton's interpreter off: no GPU needed,
    and a construct the interpreter accepts but the compiler rejects fails here."""
    spec = repr((module, signature, list(variants), options or {}))
    proc = subprocess.run([sys.executable, "-c", _COMPILE, spec], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TRITON_INTERPRET": "0", **(env or {})})
    assert proc.returncode == 0 and proc.stdout.strip() == "compiled", proc.stderr[-2000:]
