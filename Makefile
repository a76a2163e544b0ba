# `make demo` and `make test` work from a fresh clone: they create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch pinned for dev and CI (the package itself declares a range). The +cpu build comes from a local
	# wheel where the machine has one, else from PyTorch's CPU index: never a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" 2>/dev/null || \
	  $(PY) -m pip install --quiet --disable-pip-version-check --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moebalance demo --out-dir demo-out

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -n 2 tests

bench: $(STAMP)
	$(PY) bench/bench_eplb.py
	$(PY) bench/bench_replay.py
	$(PY) bench/bench_craft.py
	$(PY) bench/craft_acceptance.py
	$(PY) bench/moetuner_acceptance.py
	$(PY) bench/grace_ablation.py
	$(PY) bench/bench_runtime.py

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache
