# Developer and CI entry points. `make test` is what .ci/run runs.
#
# torch is installed on its own, pinned exactly, before the package: pip then sees `torch>=2.4` already
# satisfied and never resolves torch itself (an unpinned resolve pulls a multi-GB CUDA build). On the
# CPU dev/CI machines pip takes the local CPU wheel for this exact pin.

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
PYTEST_TIMEOUT_S ?= 1200

.DEFAULT_GOAL := help
.PHONY: help venv demo test lint format clean

help:
	@echo "make venv    create $(VENV) ($(TORCH_SPEC), then pip install -e '.[dev]')"
	@echo "make demo    run the tiny-preset CPU demo (python -m rmuscle_ros.demo)"
	@echo "make test    ruff check, ruff format --check, pytest (GPU tests skip without CUDA)"
	@echo "make lint    ruff check + ruff format --check"
	@echo "make format  ruff format + ruff check --fix"
	@echo "make clean   remove $(VENV) and build artefacts"

venv: $(STAMP)

# Re-runs only when the package metadata changes; an existing venv is reused, not recreated.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install '$(TORCH_SPEC)'
	$(PY) -m pip install -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(PY) -m rmuscle_ros.demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# GPU tests are collected too and skip with their reason on a machine without CUDA; on the device
# machine, `python -m pytest -m gpu` runs only them.
test: lint
	timeout -k 10 $(PYTEST_TIMEOUT_S) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build dist .eggs *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
