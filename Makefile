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

## browser: Debian's Chromium for the Flower test (tests/integration/fleet/test_flower.py), installed when missing
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
	$(BIN)/pytest tests/integration tests/migrations

conformance: services install peers
	$(BIN)/pytest tests/conformance -v

## bench: every benchmark (bench/run_all.py): each figure with its target, the 100k-operation model, a
## PASS/FAIL summary; exits non-zero when a target fails. `make bench BENCH_ARGS=--quick`: a short run
bench: services install
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

## fleet: the demo MCP server, a worker and beat on the local Postgres and Redis (see docs/getting-started.md)
fleet: services install
	scripts/fleet

## dev: the whole fleet and its demo on embedded Postgres and Redis, nothing installed (longcall dev)
dev: install
	$(BIN)/longcall dev $(DEV_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
