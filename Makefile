# `make demo` and `make test` work from a fresh clone: they create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench lock clean

# constraints.txt pins every tested version (transitive ones included): installs are reproducible and a new
# release of a dependency never turns CI red by surprise. The package itself declares ranges for users.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch pinned for dev and CI (the package itself declares a range). The +cpu build comes from a local
	# wheel where the machine has one, else from PyTorch's CPU index: never a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" 2>/dev/null || \
	  $(PY) -m pip install --quiet --disable-pip-version-check --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	# compile the routers' numba kernels once, into numba's cache (else every test process and rank compiles them)
	$(PY) -m moebalance.algorithms.jit
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
	$(PY) bench/bench_routing.py
	$(PY) bench/routers_report.py
	$(PY) bench/bench_craft.py
	$(PY) bench/craft_acceptance.py
	$(PY) bench/moetuner_acceptance.py
	$(PY) bench/grace_ablation.py
	$(PY) bench/bench_runtime.py
	$(PY) bench/moe_lm_report.py
	$(PY) bench/libra_report.py  # needs MOEBALANCE_ESFT_DIR (docs/results/libra.md says what); skips without it
	$(PY) bench/real_report.py  # the same
	$(PY) bench/cost_report.py
	$(PY) bench/bench_large.py  # a 1M-token trace: about 12 minutes, most of it synth

# Refresh constraints.txt on purpose: the newest releases within pyproject's ranges, in a scratch venv; the lint
# and the tests must pass with them before the file is replaced (then `make test` reinstalls .venv from it).
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" 2>/dev/null || \
	  $(LOCK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
	$(LOCK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --upgrade -e ".[dev]"
	{ sed -n '1,2p' constraints.txt; $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v -E '^(torch==|#|-e )'; } > constraints.txt.new
	$(LOCK_VENV)/bin/ruff check src tests bench tools && $(LOCK_VENV)/bin/mypy && $(LOCK_VENV)/bin/pytest -n 2 tests
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)
	@git diff --stat constraints.txt || true

clean:
	rm -rf $(VENV) $(LOCK_VENV) demo-out .pytest_cache .mypy_cache .ruff_cache
