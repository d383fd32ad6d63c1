# The two commands an operator needs: `make demo` and `make test`.
# Both do their own set-up on a fresh Debian 12 machine (apt packages, virtualenv).

# Debian's own python3: the local cluster's jobs run as alice and use this venv too (real
# torch), and an interpreter under /root (pyenv) is not hers to run.
PYTHON ?= /usr/bin/python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test demo bench screenshots lint typecheck unit system-packages venv cluster-up cluster-down clean

system-packages:
	deploy/install-system-packages

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,postgres,train]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

test: system-packages venv lint typecheck
	$(BIN)/pytest

unit: venv
	$(BIN)/pytest -m 'not cluster and not postgres and not root and not users and not chromium'

demo: system-packages venv
	$(BIN)/python deploy/demo.py

bench: system-packages venv
	$(BIN)/python -m tests.bench $(BENCH)

# The README's pictures of the web page, from a seeded record, in Debian's chromium.
screenshots: system-packages venv
	$(BIN)/python -m tests.screenshots

cluster-up: system-packages
	deploy/devcluster/up

cluster-down:
	deploy/devcluster/down

clean: cluster-down
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
