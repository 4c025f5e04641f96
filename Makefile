# Nightjar sidecar — entry points. `make demo` and `make test` are all a newcomer needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help install demo test lint proto check-proto bench bench-quick bench-rpc clean

help:
	@echo "make demo       start the sidecar and drive it with a synthetic engine loop"
	@echo "make test       create $(VENV), install, run the test suite"
	@echo "make lint       ruff + mypy"
	@echo "make proto      regenerate the checked-in gRPC stubs from proto/"
	@echo "make bench      policies x workloads x profiles in the serving simulator -> docs/BENCHMARKS.md"
	@echo "make bench-quick  the same, reduced (< 2 min)"
	@echo "make bench-rpc  measure decide cost and RPC round trips -> docs/BENCHMARKS.md"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sim]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m policy_server.demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) proto/generate.py

check-proto: $(STAMP)
	$(PY) proto/generate.py --check

bench: $(STAMP)
	$(PY) -m policy_server.sim.bench --out docs/BENCHMARKS.md

bench-quick: $(STAMP)
	$(PY) -m policy_server.sim.bench --quick --out docs/BENCHMARKS.md

bench-rpc: $(STAMP)
	$(PY) -m policy_server.bench_rpc --out docs/BENCHMARKS.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
