# Two commands on a fresh clone: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo report docs docs-pictures test test-all lint bench gpu-check clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# NOTE: pin torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,docs]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/gpipe demo

report: $(STAMP)
	$(BIN)/gpipe report

# The docs site, built offline into site/; any warning fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Redraw the pictures the docs show, with gpipe itself (about 5 minutes on 2 cores).
docs-pictures: $(STAMP)
	$(BIN)/gpipe demo --out docs/demo
	$(BIN)/gpipe report --out docs/report
	$(BIN)/python docs/pictures.py

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

# Everything, the slow tests too; one of them builds the docs with warnings as errors.
test-all: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/latency.py
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/plan.py
	$(BIN)/python benchmarks/memory.py

# On a machine with a GPU: CUDA tests, parity and speed, one report in benchmarks/runs/.
# NOTE: the machine's own python3 and torch, not .venv: a lent GPU reaches no registry.
gpu-check:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
