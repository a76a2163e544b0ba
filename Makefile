# `make demo` and `make test` work from a fresh clone: they create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench lock clean engines live

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
	$(PY) bench/online_time.py  # needs MOEBALANCE_ESFT_DIR, as libra_report.py
	$(PY) bench/bench_online_time.py  # a 1M-token trace: synth about 7 minutes, then 14 online runs
	$(PY) bench/bench_large.py  # a 1M-token trace: about 12 minutes, most of it synth
	$(PY) bench/robust_report.py  # needs MOEBALANCE_ESFT_DIR, as libra_report.py
	$(PY) bench/decode_report.py
	$(PY) bench/advise_report.py
	$(PY) bench/bench_exact.py
	$(PY) bench/profiles.py  # the shipped profiles (src/moebalance/cost/profiles/), before the reports that use them
	$(PY) bench/fidelity_report.py
	$(PY) bench/bench_watch.py
	$(PY) bench/dashboard_screenshot.py  # needs Chromium

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

# Check our engine files and the vLLM plug-in with the engines' own code (tools/engines_check.py says what): a
# scratch environment with CPU torch, moebalance, vLLM and SGLang at the versions below installed without their
# dependencies (their pinned CUDA stack cannot install here), and only the modules their imports of the EPLB and
# plug-in code need (pinned as tried). About 2 GB and a few minutes; not part of `make test`.
engines:
	test -f .venv-engines/.installed || { \
	  test -x .venv-engines/bin/python || $(PYTHON) -m venv .venv-engines; \
	  echo '*' > .venv-engines/.gitignore; \
	  .venv-engines/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" 2>/dev/null || \
	    .venv-engines/bin/python -m pip install --quiet --disable-pip-version-check --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"; \
	  .venv-engines/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e . && \
	  .venv-engines/bin/python -m pip install --quiet --disable-pip-version-check --no-deps vllm==0.33.0 sglang==0.5.23 \
	    transformers==5.19.0 tokenizers==0.23.2 huggingface_hub==2.4.0 pydantic==2.14.4 pydantic_core==2.50.5 \
	    typing-inspection==0.4.5 annotated-types==0.8.0 cbor2==6.3.0 psutil==7.2.2 orjson==3.13.0 msgspec==0.22.0 \
	    pybase64==1.5.1 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 \
	    idna==3.20 tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 truststore==0.10.5 anyio==4.16.0 \
	    sniffio==1.3.1 starlette==1.10.0 ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 \
	    aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 attrs==26.1.0 \
	    openai==3.57.0 openai-harmony==0.0.8 triton==3.9.0 einops==0.8.1 && \
	  touch .venv-engines/.installed; }
	.venv-engines/bin/python -W ignore tools/engines_check.py

# watch with the real parts around it: SGLang's recorder writes the dumps, a Prometheus server scrapes watch, vLLM's
# EPLB policy writes the plug-in's records (tools/live_check.py); needs Debian's prometheus package
live: engines
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "make live needs Prometheus: apt-get install prometheus"; exit 2; }
	.venv-engines/bin/python -W ignore tools/live_check.py

clean:
	rm -rf $(VENV) $(LOCK_VENV) .venv-engines demo-out .pytest_cache .mypy_cache .ruff_cache
