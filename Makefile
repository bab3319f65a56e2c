# `make run` and `make test` work on a fresh machine: they create the virtual environment when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.cagflow-deps
PYTEST_ARGS ?=

.PHONY: install run stop test test-unit help

help:
	@echo "make run   - install, start OpenSearch and Airflow, run the precompute DAG on the sample corpus,"
	@echo "             then answer sample questions via cache and via full prompt"
	@echo "make stop  - stop the services make run started"
	@echo "make test  - install and run the whole test suite (it starts its own servers on 127.0.0.1)"

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

# The DAG's tasks run from this checkout, so the manifest path is made absolute for them.
run: export CAGFLOW__CORPUS__MANIFEST = $(CURDIR)/corpus/manifest.yaml
run: install
	$(BIN)/cagflow opensearch up
	$(BIN)/cagflow airflow up
	$(BIN)/cagflow airflow trigger cag_fixed_precompute
	$(BIN)/cagflow demo
	@$(BIN)/cagflow airflow status
	@$(BIN)/cagflow opensearch status
	@echo "Services keep running (Airflow UI above); stop them with: make stop"

stop:
	-$(BIN)/cagflow airflow down
	-$(BIN)/cagflow opensearch down

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest -m "not integration and not real_model" $(PYTEST_ARGS)
