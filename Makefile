# elasticrun — the targets users know from kubebuilder projects.
#
#   make demo     set up, start a local control plane + operator, run the elastic demo job
#   make test     set up (venv, torch, local cluster) and run the whole test suite
#   make bench    benchmarks against torch's c10d and etcd-v2 backends (docs/benchmarks.md);
#                 ARGS='--only resize --column after' measures the Resize section alone
#                 (k8s beside c10d, a few minutes) and merges it into docs/benchmarks.json
#   make bench-scale  rounds of 64 to 2,048 nodes, simulated and real (docs/benchmarks-scale.md)
#   make lint     ruff + mypy
#   make chart-files  copy deploy/crds and deploy/admission into the chart (after editing them)
#   make dist     the wheel and the sdist into dist/ (python -m build, offline)
#   make cluster / cluster-down   a local single-node Kubernetes (kubelet, containerd) for
#                 kubectl, helm and the examples; CLUSTER_MODE=apiserver for etcd + API server only;
#                 CLUSTER_ADDONS=kubeflow adds the JobSet and Kubeflow Trainer controllers,
#                 CLUSTER_ADDONS=kueue Kueue's (kubeflow,kueue for all three)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS := torch,operator,test,bench,lint
CLUSTER_DIR ?= .cluster
CLUSTER_MODE ?= node
CONTROLPLANE_BIN = $$(bash tests/controlplane/build.sh --node)
RUNTIME_BIN = $$(bash tests/controlplane/build-runtime.sh)
PYTEST_ARGS ?=
ARGS ?=

CLUSTER_ADDONS ?=
export CLUSTER_ADDONS

.PHONY: help setup controlplane node helm addons test test-fast lint chart-files dist actionlint demo bench bench-quick bench-scale cluster cluster-down clean

help:
	@grep -E '^#   make' Makefile | sed 's/^#   //'

# The venv is rebuilt when a pyproject.toml changes; pip's cache makes that cheap.
# tests/controlplane is the local-cluster tooling (import name `controlplane`).
$(VENV)/.installed: pyproject.toml tests/controlplane/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]' -e tests/controlplane
	@touch $@

setup: $(VENV)/.installed

# Built once from Go modules and cached in ~/.cache/elasticrun (times printed on the first build).
controlplane:
	@bash tests/controlplane/build.sh >/dev/null

node: controlplane
	@bash tests/controlplane/build.sh --node >/dev/null
	@bash tests/controlplane/build-runtime.sh >/dev/null

helm:
	@bash tests/helmtool/build.sh >/dev/null

# The workflow linter tests/unit/test_release_workflow.py runs (its own Go module).
actionlint:
	@bash tests/actionlint/build.sh >/dev/null

# JobSet and Kubeflow Trainer controllers (tests/controlplane/addons) and Kueue's
# (tests/controlplane/kueue, a module of its own), for CLUSTER_ADDONS.
addons:
	@bash tests/controlplane/build-addons.sh >/dev/null
	@bash tests/controlplane/build-addons.sh kueue >/dev/null

# What the chart's monitoring kit is checked against: the prometheus-operator CRDs
# (ServiceMonitor, PodMonitor, PrometheusRule; YAML from its Go module) and
# promql-check (Prometheus' PromQL parser, tests/controlplane/promqlcheck).
.PHONY: monitoring
monitoring:
	@bash tests/controlplane/build-monitoring.sh >/dev/null

test: setup node helm addons monitoring actionlint
	CONTROLPLANE_BIN="$(CONTROLPLANE_BIN)" RUNTIME_BIN="$(RUNTIME_BIN)" $(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup controlplane
	CONTROLPLANE_BIN="$$(bash tests/controlplane/build.sh)" $(PY) -m pytest -m "not slow and not torchrun and not node" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check handler operator tests bench demo
	$(VENV)/bin/mypy

# The chart carries real copies of these (helm warns about, and a registry drops,
# links); tests/unit/test_chart_files.py fails while they differ.
CHART_FILES := crds/elasticrun.dev_elasticruns.yaml admission/elasticrun-leases.yaml
chart-files:
	@for f in $(CHART_FILES); do cp deploy/$$f charts/elasticrun/files/$$f; done

# No build isolation: the venv's setuptools (the test extra pins it), no index.
dist: setup
	$(PY) -m build --no-isolation --outdir dist .

demo: setup controlplane
	$(PY) demo/run_demo.py

bench: setup controlplane
	$(PY) bench/run.py $(ARGS)

bench-quick: setup controlplane
	$(PY) bench/run.py --quick

# Bounded: about 15 minutes on 2 cores; writes docs/benchmarks-scale.md, embedded in
# benchmarks.md.  BASELINE is the protocol it is compared with (the commit before issue 14).
BASELINE ?= 3849ad2
bench-scale: setup controlplane
	$(PY) bench/scale.py --baseline $(BASELINE)

cluster: setup $(if $(filter node,$(CLUSTER_MODE)),node,controlplane) $(if $(CLUSTER_ADDONS),addons helm)
	@$(PY) -m controlplane.localcluster up --dir $(CLUSTER_DIR) --mode $(CLUSTER_MODE)
	@KUBECONFIG=$(CLUSTER_DIR)/kubeconfig $(VENV)/bin/kubectl apply --server-side -f deploy/crds/ >&2

cluster-down:
	@test ! -x $(PY) || $(PY) -m controlplane.localcluster down --dir $(CLUSTER_DIR)

clean: cluster-down
	rm -rf $(CLUSTER_DIR) .pytest_cache .mypy_cache .ruff_cache
