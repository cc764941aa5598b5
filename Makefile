# Two commands do all the set-up: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: demo test install install-shellcheck bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[test,train]"
	@rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

# tests/test_launch_scripts.py runs shellcheck on scripts/*.sh (and fails without it).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
install-shellcheck:
	@command -v shellcheck >/dev/null || ($(SUDO) apt-get install -y shellcheck || ($(SUDO) apt-get update && $(SUDO) apt-get install -y shellcheck))

test: $(STAMP) install-shellcheck
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/demo.py

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python scripts/bench_offline.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
