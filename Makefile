# elasticrun — the targets users know from kubebuilder projects.
#
#   make demo     set up, start a local control plane + operator, run the elastic demo job
#   make test     set up (venv, torch, local cluster), lint, and run the whole test suite: the
#                 three tiers below in one session; its JUnit report goes to .reports/junit.xml
#   make test-unit        tier 1: tests/unit, pure, no server
#   make test-integration tier 2: tests/integration against the suite's own API server
#                 (not torchrun, slow, node or addons)
#   make test-e2e         tier 3: torchrun agents, chaos and scale (slow), the bench smoke
#                 runs, the real node and its add-ons (node, addons: root)
#   make durations  docs/test-durations.md from the last make test's report (per tier, the
#                 30 slowest tests)
#   make bench    benchmarks against torch's c10d and etcd-v2 backends (docs/benchmarks.md);
#                 ARGS='--only resize --column after' measures the Resize section alone
#                 (k8s beside c10d, a few minutes) and merges it into docs/benchmarks.json
#   make bench-scale  rounds of 64 to 2,048 nodes, simulated and real (docs/benchmarks-scale.md)
#   make lint     ruff + mypy + the import contracts (lint-imports; pyproject.toml)
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
# The JUnit report of make test, which make durations reads; each tier writes its own beside it.
REPORTS ?= .reports
JUNIT ?= $(REPORTS)/junit.xml
ARGS ?=

CLUSTER_ADDONS ?=
export CLUSTER_ADDONS

.PHONY: help setup controlplane node helm addons test test-unit test-integration test-e2e \
	durations test-fast lint chart-files dist actionlint demo bench bench-quick bench-scale cluster cluster-down clean

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

# Tiers in the Kubernetes style: conftest marks every torchrun, slow, node and addons test
# `e2e` (tests/conftest.py, tier); the rest of tests/integration is the integration tier.
# One session, no parallel workers: the report measures the suite as CI runs it.
# lint first: CI runs make test only, and a lint error fails it before the builds.
test: setup lint node helm addons monitoring actionlint
	@mkdir -p $(dir $(JUNIT))
	CONTROLPLANE_BIN="$(CONTROLPLANE_BIN)" RUNTIME_BIN="$(RUNTIME_BIN)" $(PY) -m pytest \
	  --junitxml=$(JUNIT) $(PYTEST_ARGS)

test-unit: setup actionlint
	@mkdir -p $(REPORTS)
	$(PY) -m pytest tests/unit --junitxml=$(REPORTS)/junit-unit.xml $(PYTEST_ARGS)

test-integration: setup controlplane helm monitoring
	@mkdir -p $(REPORTS)
	CONTROLPLANE_BIN="$$(bash tests/controlplane/build.sh)" $(PY) -m pytest tests/integration \
	  -m "not e2e" --junitxml=$(REPORTS)/junit-integration.xml $(PYTEST_ARGS)

test-e2e: setup node helm addons monitoring
	@mkdir -p $(REPORTS)
	CONTROLPLANE_BIN="$(CONTROLPLANE_BIN)" RUNTIME_BIN="$(RUNTIME_BIN)" $(PY) -m pytest \
	  tests/integration -m e2e --junitxml=$(REPORTS)/junit-e2e.xml $(PYTEST_ARGS)

# Standard library only: no venv needed.  JUNIT=... reads another report (a tier's).
durations:
	$(PYTHON) tests/durations.py --report $(JUNIT) --out docs/test-durations.md

test-fast: setup controlplane
	CONTROLPLANE_BIN="$$(bash tests/controlplane/build.sh)" $(PY) -m pytest -m "not slow and not torchrun and not node" $(PYTEST_ARGS)

# lint-imports checks the import contracts in pyproject.toml ([tool.importlinter]) on
# this checkout's code (the path pytest and mypy use), whichever checkout the venv names.
lint: setup
	$(VENV)/bin/ruff check handler operator tests bench demo
	$(VENV)/bin/mypy
	PYTHONPATH=handler:operator $(VENV)/bin/lint-imports --no-cache

# The chart carries real copies of these (helm warns about, and a registry drops,
# links); tests/unit/test_chart_files.py fails while they differ.
CHART_FILES := crds/elasticrun.dev_elasticruns.yaml crds/elasticrun.dev_elasticrunslices.yaml admission/elasticrun-leases.yaml
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
	rm -rf $(CLUSTER_DIR) $(REPORTS) .pytest_cache .mypy_cache .ruff_cache
