# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export UV_PYTHON_DOWNLOADS := never
export SPARK_LOCAL_IP := 127.0.0.1
export PYSPARK_PYTHON := $(abspath $(VENV))/bin/python
export PYSPARK_DRIVER_PYTHON := $(abspath $(VENV))/bin/python
export PYTHONPATH := $(abspath .)

.PHONY: install system-deps bytecode jar test test-fast demo ui bench lint clean

# --locked: the versions in uv.lock, and a stop if pyproject.toml changed without
# `uv lock`. The dev extra includes every runtime extra ([all]). --compile-bytecode: uv
# writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (as on our CI
# machines) every process (Spark's Python workers, Airflow's task processes, each `ckpt`)
# would compile Airflow, pandas and pyspark from source again: 7.6 s against 3.1 s to
# import them.
$(VENV)/.installed: pyproject.toml uv.lock
	@command -v uv >/dev/null || python3 -m pip install --quiet "uv==0.13.8"
	uv sync --locked --extra dev --python python3.11 --compile-bytecode
	@touch $@

install: $(VENV)/.installed

# The JVM state reader (statebackend/spark/jvm_reader.py): javac against pyspark's own
# jars (Spark's DataSource V2 API, rocksdbjni, aircompressor, Jackson), no build tool.
# Without a JDK read_state reads through Python and the JVM reader's tests fail under CI.
JAR := statebackend/spark/jars/ckpt-state-reader.jar
JAVA_SOURCES := $(wildcard jvm/src/ckpt/reader/*.java)
$(JAR): $(VENV)/.installed $(JAVA_SOURCES)
	@if command -v javac >/dev/null; then \
		jars="$$($(PY) -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')/jars"; \
		rm -rf build/jvm && mkdir -p build/jvm $(dir $(JAR)) && \
		javac --release 17 -nowarn -d build/jvm -cp "$$jars/*" $(JAVA_SOURCES) && \
		jar cf $(JAR) -C build/jvm . && echo "built $(JAR)"; \
	else echo "no javac: the JVM state reader is not built (read_state reads through Python)"; fi

jar: $(JAR)

# Headless Chromium renders the reports and the Airflow page in tests; PostgreSQL serves
# the external state backend's tests (Debian packages).
system-deps:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@# PostgreSQL's server for the external state backend's tests (started on 127.0.0.1 by them)
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }

# ruff and mypy as the pre-commit hooks run them (.pre-commit-config.yaml).
# This tree's own bytecode, for the same reason as --compile-bytecode above (what
# changed since the last time is compiled again); a venv installed without it (before
# --compile-bytecode was added) is compiled once, the first time (about 30 s).
bytecode: install
	@ls $(VENV)/lib/python3.11/site-packages/pyspark/__pycache__/*.pyc >/dev/null 2>&1 || \
		$(PY) -m compileall -q -j0 $(VENV)/lib/python3.11/site-packages >/dev/null 2>&1 || true
	@$(PY) -m compileall -q -j0 statebackend jobs dags plugins examples demo bench tests >/dev/null

test: install system-deps bytecode jar
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q --timeout=900 --durations=25

test-fast: install jar
	$(VENV)/bin/pytest -q -m "not slow"

demo: install bytecode jar
	$(PY) -m demo.pipeline_demo

# The Airflow UI on the demo's data (run `make demo` first): http://localhost:8080, user
# admin, password in $AIRFLOW_HOME/simple_auth_manager_passwords.json.generated, the
# Checkpoints page at /ckpt/ (registered by the installed package's `airflow.plugins`
# entry point; plugins/ is the plugins folder for a deployment's own). `airflow
# standalone` starts its components as `airflow` from PATH, so the venv's bin goes first.
# AIRFLOW_HOME, CKPT_STORAGE and CKPT_DATA may be set beforehand (the default is the
# demo's); Ctrl-C stops it (demo/ui.py: SIGINT, then SIGTERM after 5 s to what is left).
ui: install
	AIRFLOW_HOME="$${AIRFLOW_HOME:-$(CURDIR)/.demo/airflow_home}" \
	AIRFLOW__CORE__DAGS_FOLDER="$(CURDIR)/dags" AIRFLOW__CORE__PLUGINS_FOLDER="$(CURDIR)/plugins" \
	AIRFLOW__CORE__LOAD_EXAMPLES=False \
	CKPT_STORAGE="$${CKPT_STORAGE:-file://$(CURDIR)/.demo/checkpoints}" \
	CKPT_DATA="$${CKPT_DATA:-$(CURDIR)/.demo/data}" \
	PATH="$(abspath $(VENV))/bin:$$PATH" exec $(PY) -m demo.ui

bench: install jar
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .demo .pytest_cache
