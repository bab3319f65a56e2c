# `make run` and `make test` work on a fresh machine: they create the virtual environment when missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.cagflow-deps
PYTEST_ARGS ?=

.PHONY: install lint browser redis jaeger tools run stop test test-unit test-static images test-containers help

help:
	@echo "make run   - install, start OpenSearch, Triton, Airflow and the REST API, run the ingest and precompute"
	@echo "             DAGs on the sample corpus, then ask sample questions through the API"
	@echo "            TRACING=1 also starts a Jaeger collector and traces every request (README \"Tracing\")"
	@echo "make stop  - stop the services make run started"
	@echo "make test  - install and run the test suite (it starts its own servers on 127.0.0.1); not the tools tests"
	@echo "make test-unit - ruff, then the tests that need no server, no real model and no make tools (no network)"
	@echo "make test-static - the container files' static checks (compose, hadolint, promtool, kustomize; needs make tools)"
	@echo "make lint  - ruff check of the whole checkout (pyproject.toml's [tool.ruff])"
	@echo "make jaeger - build the Jaeger trace collector once (~10 min; make test needs it, make run TRACING=1 too)"
	@echo "make tools - build the container files' linters once (compose, promtool, kustomize, hadolint; ~11 min the first time)"
	@echo "make images - build every image docker/docker-compose.yml runs, without a registry (docker/build-local.sh)"
	@echo "make test-containers - run the compose stacks with the smallest model: the small stack (both DAGs, the demo,"
	@echo "            /readyz, /metrics), then the scale-out profile (Celery workers, one killed mid-precompute; two Triton"
	@echo "            replicas and two routers behind nginx; two OpenSearch nodes); SCALE=0 skips it, SCALE=only runs it alone"

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

# Where the local stack listens. Every component is told the same addresses through CAGFLOW__* variables,
# which the Airflow tasks and the Triton models inherit.
API_PORT ?= 8080
TRITON_HTTP_PORT ?= 8000
TRITON_GRPC_PORT ?= 8001
TRITON_METRICS_PORT ?= 8002
AIRFLOW_PORT ?= 8081
DEMO_QUESTIONS ?= 4  # per language: English, then Chinese
# TRACING=1: start a Jaeger collector (UI on :16686) and send every component's traces to it.
TRACING ?=
JAEGER_OTLP_PORT ?= 4318

# One step of `make run`: say what it does, run it, say how long it took, and note that for the summary.
RUN_STEPS := $(VENV)/.make-run-steps
define step
	@printf '\n==> %s\n' "$(1)"
	@start=$$(date +%s.%N); $(2) || exit $$?; \
	  seconds=$$(awk -v start=$$start -v end=$$(date +%s.%N) 'BEGIN {printf "%.1f", end - start}'); \
	  printf '<== %s: %s s\n' "$(1)" "$$seconds"; printf '%-50s %7s s\n' "$(1)" "$$seconds" >> $(RUN_STEPS)
endef

# The DAG's tasks run from this checkout, so the manifest path is made absolute for them. Triton starts
# before the DAGs so that the precompute run's last task can make it load the new release; the router
# starts after them so that it reads the fixed documents' chunks from the index at start-up. It serves
# HTTPS with a self-signed certificate for this machine (created once in ~/.cache/cagflow/tls/), which
# the demo and the other local clients verify.
run: export CAGFLOW__CORPUS__MANIFEST = $(CURDIR)/corpus/manifest.yaml
run: export CAGFLOW__SERVICE__PORT = $(API_PORT)
run: export CAGFLOW__SERVICE__TRITON_URL = 127.0.0.1:$(TRITON_HTTP_PORT)
run: export CAGFLOW__SERVICE__TRITON_GRPC_URL = 127.0.0.1:$(TRITON_GRPC_PORT)
run: export CAGFLOW__SERVICE__TRITON_METRICS_URL = http://127.0.0.1:$(TRITON_METRICS_PORT)/metrics
run: export CAGFLOW__PRECOMPUTE__TRITON_URL = 127.0.0.1:$(TRITON_HTTP_PORT)
run: export CAGFLOW__TRACING__ENDPOINT = $(if $(TRACING),http://127.0.0.1:$(JAEGER_OTLP_PORT))
run:
	@mkdir -p $(VENV) && : > $(RUN_STEPS)
	$(call step,install dependencies,$(MAKE) --no-print-directory install)
	$(call step,prepare the model,$(BIN)/cagflow model prepare)
	$(call step,start OpenSearch,$(BIN)/cagflow opensearch up)
	$(if $(TRACING),$(call step,start Jaeger (traces),$(MAKE) --no-print-directory jaeger && $(BIN)/cagflow jaeger up))
	$(call step,start Triton,$(BIN)/cagflow triton up --http-port $(TRITON_HTTP_PORT) \
		--grpc-port $(TRITON_GRPC_PORT) --metrics-port $(TRITON_METRICS_PORT))
	$(call step,start Airflow,$(BIN)/cagflow airflow up --port $(AIRFLOW_PORT))
	$(call step,ingest the variable documents (DAG),$(BIN)/cagflow airflow trigger cag_variable_ingest)
	$(call step,ingest and precompute the fixed documents (DAG),$(BIN)/cagflow airflow trigger cag_fixed_precompute)
	$(call step,issue local API keys,$(BIN)/cagflow keys init-local)
	$(call step,start the REST API (HTTPS),$(BIN)/cagflow router up --self-signed)
	$(call step,ask the sample questions,$(BIN)/cagflow demo --questions $(DEMO_QUESTIONS))
	@printf '\nmake run, step by step:\n'; cat $(RUN_STEPS); \
	  awk '{total += $$(NF-1)} END {printf "%-50s %7.1f s\n", "total", total}' $(RUN_STEPS)
	@echo "Services keep running; stop them with: make stop"

stop:
	-$(BIN)/cagflow router down
	-$(BIN)/cagflow airflow down
	-$(BIN)/cagflow triton down
	-$(BIN)/cagflow opensearch down
	-$(BIN)/cagflow jaeger down

# The Airflow UI test drives Debian's headless Chromium through ChromeDriver: installed here when missing.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "make test: the Airflow UI test needs Debian's chromium and chromium-driver (apt-get install as root)"

# The shared rate-limit tests (tests/integration/test_shared_rate_limit.py) start their own Debian redis-server on a
# free port: installed here when missing, and not left running as a service.
redis:
	@command -v redis-server >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null && \
	    { systemctl disable --now redis-server 2>/dev/null || service redis-server stop >/dev/null 2>&1 || :; }; } || \
	  echo "make test: the shared rate-limit tests need Debian's redis-server (apt-get install as root)"

# The container files' linters (tests/unit/test_container_files.py) and kustomize (tests/unit/test_k8s_manifests.py),
# cached in ~/.cache/cagflow/tools by version: built from the Go module proxy on the first run (~11 min on 2 cores),
# then found in a second.
tools: $(STAMP)
	@PYTHON=$(BIN)/python bash docker/static-tools.sh

# The linter comes with the requirements; it takes about a second, so both test targets start with it.
lint: $(STAMP)
	$(BIN)/ruff check

# The trace collector of the tracing tests and of `make run TRACING=1`: Jaeger v2, built from the Go module proxy
# into ~/.cache/cagflow/tools on the first run (~10 min on 2 cores), then found in a second.
jaeger:
	@bash docker/static-tools.sh jaeger >/dev/null

# Only tests/unit is collected (importing tests/integration's modules cost each worker about 4 s); the server run
# takes every other test, tests/integration's quick ones included (tests/conftest.py marks tests/unit's `unit`).
UNIT_TESTS = tests/unit -m "unit and not integration and not real_model and not tools"
SERVER_TESTS = -m "(integration or real_model or not unit) and not tools"
# The quick tests on two workers (a test module stays on one, so its fixtures are built once): make test-unit 71 s
# wall on this 2-core machine. The server tests on two workers as well, a module to a worker: most of their time
# is spent waiting on servers (starts, DAG runs, loads), so two at a time took 9 min against 12 one at a time.
UNIT_WORKERS = -n 2 --dist loadscope
SERVER_WORKERS = -n 2 --dist loadfile

# Every test but the container files' static checks (marked tools), which need the Go-built linters: `make test-static`.
# Both runs always run; the command fails when either does.
test: lint install browser redis jaeger
	$(BIN)/python -m pytest $(UNIT_TESTS) $(UNIT_WORKERS) $(PYTEST_ARGS); unit=$$?; \
	  $(BIN)/python -m pytest $(SERVER_TESTS) $(SERVER_WORKERS) $(PYTEST_ARGS); servers=$$?; \
	  exit $$(( unit || servers ))

# The quick tests, offline: no server (integration), no real model (real_model) and no Go build (tools).
test-unit: lint install
	$(BIN)/python -m pytest $(UNIT_TESTS) $(UNIT_WORKERS) $(PYTEST_ARGS)

# The container files checked without a Docker daemon (compose config, hadolint, promtool, kustomize): `make tools`
# builds the linters once (~11 min the first time), then these tests take seconds.
test-static: install tools
	$(BIN)/python -m pytest -m tools $(PYTEST_ARGS)

# The container images, built from package registries only (no image registry): the Debian and Python bases, local
# equivalents of the third-party images and the project's image (docker/build-local.sh; --rebuild: REBUILD=1).
images: install tools
	@PYTHON=$(BIN)/python bash docker/build-local.sh $(if $(REBUILD),--rebuild)

# The compose stacks, really run with the smallest model tier (docker/test-containers.sh): builds the missing images,
# runs both DAGs and the demo through the containers, checks /readyz and /metrics; then the scale-out profile (Celery
# workers with one killed mid-precompute, two Triton replicas with one killed under load, two routers behind nginx
# sharing keys and rate limits, two OpenSearch nodes); removes its containers. SCALE=0: the small stack only;
# SCALE=only: the scale-out profile only.
test-containers: test-static
	@PYTHON=$(BIN)/python bash docker/test-containers.sh
