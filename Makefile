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
#   LINT_PATHS   what ruff checks (mypy checks the package: `files` in pyproject.toml).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# -qq: errors only (this machine's pip config makes -q print a warning per package).
PIP_FLAGS ?= -qq --disable-pip-version-check
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=
LINT_PATHS ?= shardtensor tests bench

PY := $(VENV)/bin/python
# Written after a successful install; redone when pyproject.toml changes (or .venv is removed).
STAMP := $(VENV)/.shardtensor-installed

.DEFAULT_GOAL := install
.PHONY: install demo lint test bench clean distclean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@echo "==> installing $(TORCH) into $(VENV) (the first time takes a few minutes)"
	$(PY) -m pip install $(PIP_FLAGS) '$(TORCH)'
	@echo "==> installing shardtensor (editable) with its test extra"
	$(PY) -m pip install $(PIP_FLAGS) -e '.[test]'
	@touch $@

demo: $(STAMP)
	$(PY) -m shardtensor.demo $(DEMO_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy
	$(PY) -m ruff format --check $(LINT_PATHS)

# lint first: it takes under a minute (mypy from a cold cache), the suite many
test: $(STAMP) lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) --durations=20 $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(PY) bench/overhead.py $(BENCH_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
