# One entry point for everything a developer (and CI) runs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: test install services browser peers lint typecheck unit integration conformance bench fleet dev clean

## test: everything CI runs: services, the browser, install, peers, lint, types, the whole test suite
test: services browser install peers lint typecheck
	$(BIN)/pytest

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,demo]'
	touch $@

services:
	scripts/ensure-services

## browser: Debian's Chromium for the Flower test (tests/integration/test_flower.py), installed when missing
browser:
	scripts/ensure-browser

peers:
	scripts/install-peers

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

unit: install
	$(BIN)/pytest tests/unit

integration: services browser install
	$(BIN)/pytest tests/integration

conformance: services install peers
	$(BIN)/pytest tests/conformance -v

## bench: the issue-4 benchmarks and issue 10's (AIP-151 vs google-api-core); PASS/FAIL, not in `make test`
bench: services install
	$(BIN)/python bench/dispatch_scale.py
	$(BIN)/python bench/lifecycle.py
	$(BIN)/python bench/aip_vs_api_core.py

## fleet: the demo MCP server, a worker and beat on the local Postgres and Redis (see README)
fleet: services install
	scripts/fleet

## dev: the whole fleet and its demo on embedded Postgres and Redis, nothing installed (longcall dev)
dev: install
	$(BIN)/longcall dev $(DEV_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
