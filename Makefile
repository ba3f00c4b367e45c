# Tidemark: `make up` starts the local stack and runs the demo; `make test` runs the suite.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   := .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
PORT   ?= 54329
STATE  := .tidemark
PGDIR  := $(STATE)/pg
ENVF   := $(STATE)/env
UV_VERSION := 0.13.9

.PHONY: help venv spark-archive lock browser pg connect connect-down up down cluster cluster-down test test-fast lint bench chaos clean

help:
	@echo "make up         local PostgreSQL + ledger + demo data + Airflow (demo DAG unpaused)"
	@echo "make up CONNECT=1  the same, with a local Spark Connect server the runs use"
	@echo "make connect    a local Spark Connect server (loopback, this venv's Python)"
	@echo "make down       stop what 'make up' started"
	@echo "make cluster    a Spark standalone cluster here: master + 2 workers (make cluster-down)"
	@echo "make test       lint and the whole test suite (starts its own servers)"
	@echo "make test-fast  the tests that need no Spark and no Airflow (PostgreSQL only): 2-3 minutes"
	@echo "make bench      the replay benchmark (2M records; small runs of 1K and 10K)"
	@echo "make chaos      randomized fault checker (STEPS=300 SEED=<n>; default seed random)"
	@echo "make lock       recompile requirements.txt from pyproject.toml"

venv: $(VENV)/.installed

$(BIN)/uv:
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)

# Exactly the lock: `uv pip sync` resolves nothing (so nothing re-adds a package the lock
# excludes) and removes what the lock does not list. Removing pyspark-client from a venv made
# before the lock excluded it deletes files it shared with pyspark: reinstall pyspark first.
# --compile-bytecode: uv leaves no .pyc, and where PYTHONDONTWRITEBYTECODE is set (CI, many
# container images) every run, Spark worker and DAG parse compiled GX, pandas and PySpark from
# source again: 3.3 s of GX's import alone (docs/operations.md, "Start-up").
$(VENV)/.installed: requirements.txt pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	if $(BIN)/uv pip show -q --python $(PY) pyspark-client; then \
	  $(BIN)/uv pip uninstall -q --python $(PY) pyspark-client && \
	  $(BIN)/uv pip install -q --python $(PY) --no-deps --reinstall-package pyspark \
	    -r requirements.txt; \
	fi
	$(BIN)/uv pip sync -q --compile-bytecode --python $(PY) requirements.txt
	$(BIN)/uv pip install -q --python $(PY) --no-deps -e .
	touch $@

# The Spark driver JVM's class archive (tidemark/engine/cds.py): a no-op once built.
spark-archive: venv
	$(BIN)/tidemark spark archive

# Recompile requirements.txt from pyproject.toml (every extra), keeping the current pins
# unless they must move; `make lock UPGRADE=--upgrade` takes the newest allowed versions.
lock: $(BIN)/uv
	$(BIN)/uv pip compile pyproject.toml --all-extras --excludes requirements-excludes.txt \
	  --python-version 3.11 -o requirements.txt $(UPGRADE)

# The browser tests drive Debian's Chromium (Playwright downloads nothing).
CHROMIUM := /usr/bin/chromium
browser:
	@if [ ! -x $(CHROMIUM) ]; then \
	  echo "installing Debian's chromium for the browser tests"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; \
	fi

# The local cluster, unless TIDEMARK_LEDGER_DSN points at an existing server. The env file
# holds DSNs with passwords: umask 077 creates it 0600.
pg: venv
	@mkdir -p $(STATE)
	@umask 077; rm -f $(ENVF); if [ -n "$$TIDEMARK_LEDGER_DSN" ]; then \
	  echo "using the server at TIDEMARK_LEDGER_DSN"; \
	  printf 'TIDEMARK_LEDGER_DSN=%s\nTIDEMARK_DEMO_SOURCE_DSN=%s\nTIDEMARK_DEMO_SINK_DSN=%s\n' \
	    "$$TIDEMARK_LEDGER_DSN" "$${TIDEMARK_DEMO_SOURCE_DSN:-$$TIDEMARK_LEDGER_DSN}" \
	    "$${TIDEMARK_DEMO_SINK_DSN:-$$TIDEMARK_LEDGER_DSN}" > $(ENVF); \
	else \
	  $(PY) -m tidemark.devstack.localpg start --dir $(PGDIR) --port $(PORT) && \
	  ledger=$$($(PY) -m tidemark.devstack.localpg dsn --dir $(PGDIR) --port $(PORT) --database tidemark) && \
	  sink=$$($(PY) -m tidemark.devstack.localpg dsn --dir $(PGDIR) --port $(PORT) --database warehouse) && \
	  printf 'TIDEMARK_LEDGER_DSN=%s\nTIDEMARK_DEMO_SOURCE_DSN=%s\nTIDEMARK_DEMO_SINK_DSN=%s\n' \
	    "$$ledger" "$$ledger" "$$sink" > $(ENVF); \
	fi

# A local Spark Connect server (tidemark/devstack/connect_server.py): loopback, a free port
# unless CONNECT_PORT, this venv's Python in its workers. Its URL goes into the env file as
# TIDEMARK_SPARK_REMOTE: runs then write through it (docs/production.md, "Spark Connect").
CONNECT_DIR := $(STATE)/connect
connect: pg
	$(PY) -m tidemark.devstack.connect_server start --dir $(CONNECT_DIR) \
	  $(if $(CONNECT_PORT),--port $(CONNECT_PORT))
	@umask 077; sed -i '/^TIDEMARK_SPARK_REMOTE=/d' $(ENVF); \
	  echo "TIDEMARK_SPARK_REMOTE=$$($(PY) -m tidemark.devstack.connect_server url --dir $(CONNECT_DIR))" >> $(ENVF)

connect-down:
	@if [ -d $(CONNECT_DIR) ]; then $(PY) -m tidemark.devstack.connect_server stop --dir $(CONNECT_DIR); fi
	@if [ -f $(ENVF) ]; then sed -i '/^TIDEMARK_SPARK_REMOTE=/d' $(ENVF); fi

up: pg spark-archive $(if $(CONNECT),connect)
	$(BIN)/tidemark db upgrade
	$(BIN)/tidemark demo load
	$(BIN)/tidemark airflow up
	@echo
	@echo "Tidemark is up: the DAG tidemark_flights replays the demo now and then hourly."
	@echo "CLI: source $(VENV)/bin/activate && tidemark status flights"

down: connect-down cluster-down
	@if [ -x $(BIN)/tidemark ] && [ -d $(STATE)/airflow ]; then $(BIN)/tidemark airflow down; fi
	@if [ -d $(PGDIR) ]; then $(PY) -m tidemark.devstack.localpg stop --dir $(PGDIR) --port $(PORT); fi

# A Spark standalone master and two workers (1 core each) from the venv's PySpark, which has
# no start-master.sh: tidemark/devstack/spark_cluster.py, the daemons the cluster tests use.
# Loopback unless SPARK_CLUSTER_HOST is set; state and logs in $(STATE)/spark. Idempotent.
SPARK_CLUSTER_HOST ?= 127.0.0.1
SPARK_MASTER_PORT  ?= 7077
SPARK_UI_PORT      ?= 8091
cluster: venv
	$(PY) -m tidemark.devstack.spark_cluster up --dir $(STATE)/spark --host $(SPARK_CLUSTER_HOST) \
	  --port $(SPARK_MASTER_PORT) --ui-port $(SPARK_UI_PORT)

cluster-down:
	@if [ -f $(STATE)/spark/state.json ]; then $(PY) -m tidemark.devstack.spark_cluster down --dir $(STATE)/spark; fi

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two pytest-xdist workers (2 cores): while one waits on a Spark job, an Airflow task or a
# job process, the other runs. tests/conftest.py puts the Airflow tests, the Connect ones, and
# each module taking the SparkSession or a module fixture, onto one worker each (each worker
# starts its own SparkSession), and hands the longest out first.
# `make test XDIST=` runs them in one process. Not 3: measured on a fresh clone, 2 quiet cores,
# -n 3 took 22 min 17 s of pytest against 20 min 26 s for -n 2, its three workers ending within
# 2 s of each other: the cores were full (JVMs, Airflow, PostgreSQL), not waiting.
XDIST ?= -n 2 --dist loadgroup
test: venv browser lint spark-archive
	$(BIN)/pytest $(XDIST)

# A selection of the one suite by marker (pyproject.toml): units, the layer check, migrations,
# the CLI and the ledger against its own PostgreSQL. Tests taking the spark fixture are marked
# spark by tests/conftest.py; those starting Spark or Airflow processes carry their marker.
FAST := not slow and not spark and not airflow
test-fast: venv
	$(BIN)/pytest $(XDIST) -m "$(FAST)"

bench: pg spark-archive
	$(BIN)/tidemark db upgrade
	$(PY) bench/replay_bench.py
	set -a && . $(ENVF) && set +a && $(PY) bench/dlq_bench.py
	set -a && . $(ENVF) && set +a && $(PY) bench/pipelines_bench.py
	set -a && . $(ENVF) && set +a && $(PY) bench/idle_bench.py

# A seeded random sequence of operations and faults against a scratch cluster, with the
# invariants checked after every step. `make chaos STEPS=300 SEED=42`.
STEPS ?= 300
SEED  ?=
chaos: venv
	$(BIN)/tidemark chaos --steps $(STEPS) $(if $(SEED),--seed $(SEED))

clean: down
	rm -rf $(STATE) $(VENV)
