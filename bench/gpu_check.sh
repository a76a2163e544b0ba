#!/usr/bin/env bash
# The one command a GPU machine runs for bench/gpu_check.py (read its docstring): the machine's own python3, which
# holds CUDA torch, with moebalance from src/ (nothing is installed); writes to $OUT (or --out DIR). Arguments go to
# gpu_check.py. Wheels carried in .whl/ (none are needed on the machines' image as of this writing) are installed
# outside the tree first.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
echo "python: $(command -v "$PY") ($("$PY" --version 2>&1))"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -n 2
exec "$PY" bench/gpu_check.py "$@"
