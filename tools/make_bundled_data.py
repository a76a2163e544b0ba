"""Regenerate the traces bundled in ``src/moebalance/workloads/data`` (``--load bundled:NAME``), bit for bit.

Every bundled trace but one is synthetic (``moebalance.workloads.synth``, docs/synth.md) and fully determined by the
recipe below; arrays are stored in the narrowest integer type that holds them, so the files stay small. The real
one, ``esft-law`` (DeepSeek's ESFT routing), is made by ``bench/make_bundled_esft.py`` instead.
Run: .venv/bin/python tools/make_bundled_data.py [NAME ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moebalance.models import get_model
from moebalance.workloads.synth import synthesize

DATA = Path(__file__).resolve().parents[1] / "src" / "moebalance" / "workloads" / "data"

#: name -> (preset, batches, tokens per batch, data-parallel ranks, token level)
RECIPES: dict[str, tuple[str, int, int, int, bool]] = {
    # the demo's load: DeepSeek-V3-like counts for 8 x 8 GPUs
    "deepseek-v3-8x8": ("deepseek-v3", 200, 4096, 64, False),
    # MoETuner's model: Mixtral-8x7B-like token-level trace, tokens on 8 ranks
    "mixtral-8x7b-tokens": ("mixtral-8x7b", 64, 512, 8, True),
    # GRACE's models: OLMoE-like and Qwen3-30B-A3B-like token-level traces, tokens on 8 ranks
    "olmoe-1b-7b-tokens": ("olmoe-1b-7b", 64, 256, 8, True),
    "qwen3-30b-a3b-tokens": ("qwen3-30b-a3b", 64, 256, 8, True),
}


def _narrow(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind not in "iu" or a.size == 0:
        return a
    for dt in (np.uint8, np.uint16, np.uint32):
        if a.min() >= 0 and a.max() <= np.iinfo(dt).max:
            return a.astype(dt)
    return a


def make(name: str) -> Path:
    preset, batches, tokens, gpus, token_level = RECIPES[name]
    arrays = synthesize(get_model(preset), num_batches=batches, tokens_per_batch=tokens, num_gpus=gpus,
                        seed=0, token_level=token_level)
    path = DATA / (name.replace("-", "_") + ".npz")
    np.savez_compressed(path, **{k: _narrow(np.asarray(v)) for k, v in arrays.items()})
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"from {', '.join(RECIPES)} (default: all)")
    names = parser.parse_args().names or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown bundled trace {unknown[0]!r}; choose from {', '.join(RECIPES)}")
    for name in names:
        path = make(name)
        print(f"wrote {path.relative_to(DATA.parents[2])} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
