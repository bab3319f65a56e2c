# `make run` and `make test` work on a fresh machine: they create the virtual environment when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.cagflow-deps
PYTEST_ARGS ?=

.PHONY: install run test test-unit clean-store help

help:
	@echo "make run   - install, precompute the sample corpus, answer sample questions via cache and full prompt"
	@echo "make test  - install and run the whole test suite (starts its own SeaweedFS/OpenSearch on 127.0.0.1)"

# Dependencies are reinstalled only when a requirements file changes; the project itself is
# (re)linked every time so a venv kept outside the checkout always points at this checkout.
$(STAMP): requirements.txt requirements-nodeps.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip "setuptools>=68"
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	@touch $(STAMP)

install: $(STAMP)
	@$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .

run: install
	$(BIN)/cagflow demo

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest -m "not integration and not real_model" $(PYTEST_ARGS)
