# elasticrun — the targets users know from kubebuilder projects.
#
#   make demo     set up, start a local control plane + operator, run the elastic demo job
#   make test     set up (venv, torch, control plane) and run the whole test suite
#   make bench    benchmarks against torch's c10d and etcd-v2 backends (docs/benchmarks.md)
#   make lint     ruff + mypy
#   make cluster / cluster-down   a local kube-apiserver + etcd for kubectl and experiments

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS := torch,operator,test,bench,lint
CLUSTER_DIR ?= .cluster
PYTEST_ARGS ?=

.PHONY: help setup controlplane helm test test-fast lint demo bench bench-quick cluster cluster-down clean

help:
	@grep -E '^#   make' Makefile | sed 's/^#   //'

# The venv is rebuilt when pyproject.toml changes; pip's cache makes that cheap.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	@touch $@

setup: $(VENV)/.installed

controlplane:
	@bash tests/controlplane/build.sh >/dev/null

helm:
	@bash tests/helmtool/build.sh >/dev/null

test: setup controlplane
	CONTROLPLANE_BIN="$$(bash tests/controlplane/build.sh)" $(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup controlplane
	CONTROLPLANE_BIN="$$(bash tests/controlplane/build.sh)" $(PY) -m pytest -m "not slow and not torchrun" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check handler operator tests bench demo
	$(VENV)/bin/mypy

demo: setup controlplane
	$(PY) demo/run_demo.py

bench: setup controlplane
	$(PY) bench/run.py

bench-quick: setup controlplane
	$(PY) bench/run.py --quick

cluster: setup controlplane
	@$(PY) tests/controlplane/localcluster.py up --dir $(CLUSTER_DIR)
	@KUBECONFIG=$(CLUSTER_DIR)/kubeconfig $(VENV)/bin/kubectl apply --server-side -f deploy/crds/ >&2

cluster-down:
	@$(PY) tests/controlplane/localcluster.py down --dir $(CLUSTER_DIR)

clean: cluster-down
	rm -rf $(CLUSTER_DIR) .pytest_cache .mypy_cache .ruff_cache
