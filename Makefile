# kvfence — developer entry points. The README names two of them: `make up` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CLUSTER_DIR ?= .cluster
BIN_DIR = $(shell tests/cluster/build-components.sh --print)
# The Python of the pinned vLLM for CPU (engine-image/vllm.env), in its own cached venv (`make vllm`).
VLLM_PY = $(shell tests/vllm/install-vllm.sh --print)
# The vLLM lane runs under that Python, on tests/vllm_engine only (the main lane ignores it: see
# pyproject's addopts, which this replaces).
VLLM_LANE_ADDOPTS = -ra --strict-markers --import-mode=importlib -p no:cacheprovider

.PHONY: help venv components host-deps vllm up down unit test lint typecheck crds clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/'

# The compiled modules are abi3 builds (setup.py): a per-version build left in the tree by an older
# install would be imported before them, so it is removed first.
$(VENV)/.installed: pyproject.toml setup.py engine-image/kvfence/isolation/_prefix_walk.c engine-image/kvfence/vllm/_records.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	rm -f engine-image/kvfence/isolation/_prefix_walk.cpython-*.so engine-image/kvfence/vllm/_records.cpython-*.so
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed ## Create .venv with kvfence and its dev tools

components: host-deps ## Build (or reuse the cached) kube-apiserver, etcd, kwok, helm, kubelet, ...
	tests/cluster/build-components.sh --real-node >/dev/null

host-deps: ## Install the Debian packages the real node and the image build need (containerd, podman, ...)
	tests/cluster/install-host-deps.sh

vllm: ## Install real vLLM for CPU (cached) and build the tiny test model
	tests/vllm/install-vllm.sh
	$(VLLM_PY) tests/vllm/tinymodel.py

up: venv components ## The whole system on a local cluster with a real node; prints how to send a request
	$(PY) tests/cluster/localcluster.py up --real-node --dir $(CLUSTER_DIR) --bin-dir $(BIN_DIR)
	PATH=$(BIN_DIR):$$PATH $(PY) e2e/bringup.py --dir $(CLUSTER_DIR)

down: ## Stop everything `make up` started
	$(PY) tests/cluster/localcluster.py down --dir $(CLUSTER_DIR)

lint: venv ## ruff
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv ## mypy (strict)
	$(VENV)/bin/mypy

crds: venv ## Regenerate crds/ and charts/kvfence/crds/ from the API models (tests fail when they drift)
	$(VENV)/bin/kvfence-crdgen

# The fast lane: every test that needs no cluster and no vLLM (tests/support/lanes.py marks the others
# from the fixtures they use). T narrows it: `make unit T=tests/router`, `make unit T="-k quota"`.
T ?=
unit: venv ## Every test that needs no cluster and no vLLM (about a minute); T=tests/DIR narrows it
	KVFENCE_BIN_DIR=$(BIN_DIR) $(VENV)/bin/pytest -m "not cluster and not vllm" $(T)

test: venv components vllm lint typecheck ## Install, build, lint, type-check, run every test, then e2e on a real node
	KVFENCE_BIN_DIR=$(BIN_DIR) KVFENCE_VLLM_PYTHON=$(VLLM_PY) $(VENV)/bin/pytest
	KVFENCE_VLLM_PYTHON=$(VLLM_PY) VLLM_TARGET_DEVICE=cpu \
	  $(VLLM_PY) -m pytest -o addopts="$(VLLM_LANE_ADDOPTS)" tests/vllm_engine
	e2e/run-on-local-cluster.sh

clean: down
	rm -rf $(CLUSTER_DIR) .cluster-e2e

.PHONY: chart e2e

chart: venv components ## Helm chart: lint (strict, every ci/ values file) and the chart tests
	$(BIN_DIR)/helm lint --strict charts/kvfence
	for f in charts/kvfence/ci/*-values.yaml; do $(BIN_DIR)/helm lint --strict charts/kvfence -f $$f || exit 1; done
	KVFENCE_BIN_DIR=$(BIN_DIR) $(VENV)/bin/pytest tests/chart

# Not part of `make test`: it needs a cluster that runs real pods. Without a target it says so and
# fails (exit 2); it never reports a pass it did not earn. See e2e/conftest.py and docs/operations.md.
e2e: venv ## End-to-end suite: KVFENCE_E2E_KUBECONFIG=FILE, or kind+docker, or KVFENCE_E2E_LOCAL=1 (processes)
	@if [ -z "$$KVFENCE_E2E_KUBECONFIG" ] && [ "$$KVFENCE_E2E_LOCAL" != 1 ] && \
	  ! { command -v kind >/dev/null && command -v docker >/dev/null && docker info >/dev/null 2>&1; }; then \
	  echo "e2e: NOT RUN. No target: set KVFENCE_E2E_KUBECONFIG=<kubeconfig of a cluster that runs pods>," >&2; \
	  echo "e2e: or install kind and docker, or set KVFENCE_E2E_LOCAL=1 (router + reference engines as" >&2; \
	  echo "e2e: processes, no Kubernetes). This is not a pass." >&2; \
	  exit 2; \
	fi
	KVFENCE_BIN_DIR=$(BIN_DIR) $(VENV)/bin/pytest e2e -p no:cacheprovider
