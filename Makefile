# gacc-template: `make demo` bakes a project and trains it with 2 CPU processes; `make test` runs
# the whole suite; `make bench` runs the baked project's benchmarks into bench/. Each creates .venv
# from requirements-dev.txt when it is missing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

# Without a GPU, DeepSpeed compiles its shared-memory collectives when a job first starts (about a
# minute on 2 cores, minutes under the suite's load, past a test's timeout): compile them once here.
$(VENV)/.installed: requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

venv: $(VENV)/.installed ## create .venv with the pinned development environment

demo: $(VENV)/.installed ## bake a project, train each entry point with 2 CPU processes, plot their losses
	$(PY) tools/demo.py

bench: $(VENV)/.installed ## bake a project, run its benchmarks: bench/results.json and plots (BENCH="flags")
	$(PY) tools/bench.py $(BENCH)

test: $(VENV)/.installed ## run the whole suite (template, hooks, and the baked projects' own suites)
	$(PY) -m pytest

lint: $(VENV)/.installed ## ruff on the template's own code
	$(PY) -m ruff check hooks tests tools

assets: $(VENV)/.installed ## regenerate the tokenizer and datasets that ship with every project
	$(PY) tools/make_assets.py

config: $(VENV)/.installed ## write the project's configs/train.yaml from the defaults in its config.py
	$(PY) tools/sync_config.py

.PHONY: help venv demo bench test lint assets config
