# shardtensor — the commands.
#
#   make demo    create .venv if missing, install, then run `python -m shardtensor.demo`
#   make test    create .venv if missing, install, then `make lint` and the whole test suite
#   make lint    ruff check, mypy and ruff format --check (configured in pyproject.toml)
#   make bench   create .venv if missing, install, then run bench/overhead.py
#
# Variables (override on the command line, e.g. `make test PYTEST_ARGS='-k mesh -x'`):
#   PYTHON       the interpreter that creates the venv (default python3)
#   VENV         where the venv lives (default .venv)
#   TORCH        the torch requirement installed first. Keep it pinned: on this machine any
#                other version or an open range pulls a multi-GB CUDA build from PyPI.
#   PYTEST_ARGS  extra arguments for pytest; DEMO_ARGS, BENCH_ARGS likewise.
#   TEST_ISA     environment for the suite's processes: by default torch's, oneDNN's and MKL's CPU
#                kernels capped at AVX2, so a machine with AVX-512 computes what an AVX2-only one
#                does (each is a ceiling: a CPU without AVX2 keeps its own). `make test TEST_ISA=`
#                runs with this CPU's own kernels.
#   LINT_PATHS   what ruff checks (mypy checks the package: `files` in pyproject.toml).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# -qq: errors only (this machine's pip config makes -q print a warning per package).
PIP_FLAGS ?= -qq --disable-pip-version-check
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
TEST_ISA ?= ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
DEMO_ARGS ?=
BENCH_ARGS ?=
LINT_PATHS ?= shardtensor tests bench setup.py

PY := $(VENV)/bin/python
# Written after a successful install; redone when pyproject.toml changes (or .venv is removed).
STAMP := $(VENV)/.shardtensor-installed

.DEFAULT_GOAL := install
.PHONY: install demo lint test bench clean distclean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# The package is built against the venv's own torch (--no-build-isolation, so its build setup needs
# that torch and pyproject's setuptools installed first): pip does not set up a second torch in a
# throw-away build environment, and setup.py compiles the C++ device guard into the source tree,
# where the editable install finds it. A changed device_guard.cpp (or a part it includes) is recompiled here.
$(STAMP): pyproject.toml setup.py shardtensor/tensor/device_guard.cpp shardtensor/tensor/replay_*.h | $(PY)
	@echo "==> installing $(TORCH) into $(VENV) (the first time takes a few minutes)"
	$(PY) -m pip install $(PIP_FLAGS) '$(TORCH)' 'setuptools>=77'
	@echo "==> installing shardtensor (editable, compiling its C++ device guard) with its test extra"
	$(PY) -m pip install $(PIP_FLAGS) --no-build-isolation -e '.[test]'
	@touch $@

demo: $(STAMP)
	$(PY) -m shardtensor.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy
	$(PY) -m ruff format --check $(LINT_PATHS)

# lint first: it takes under a minute (mypy from a cold cache), the suite many
# (bytecode caching on, whatever the environment says: the workers and the many test subprocesses
# would otherwise each compile shardtensor's sources and rewrite the test modules again), with the
# CPU kernels of TEST_ISA (the workers and every test subprocess inherit them)
test: $(STAMP) lint
	PYTHONDONTWRITEBYTECODE= $(TEST_ISA) $(PY) -m pytest -n $(PYTEST_WORKERS) --durations=20 $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(PY) bench/overhead.py $(BENCH_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
	rm -f shardtensor/tensor/_device_ext*.so $(STAMP)
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
