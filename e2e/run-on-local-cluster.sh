#!/usr/bin/env bash
# The e2e suite, unchanged, against the project's own cluster with a real node: start a fresh cluster,
# build the images from the current tree and import them, run `pytest e2e`, stop the cluster (always).
# `make test` calls this after the unit and integration tests; CI therefore runs the e2e suite.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=$(tests/cluster/build-components.sh --print)
DIR=${KVFENCE_E2E_CLUSTER_DIR:-.cluster-e2e}
PY=${PY:-.venv/bin/python}
if [[ -f .cluster/state.json ]] && grep -q '"realNode": true' .cluster/state.json; then
  echo "e2e: a cluster with a real node from \`make up\` is running (one per host): run \`make down\` first" >&2
  exit 2
fi
"$PY" tests/cluster/localcluster.py down --dir "$DIR" >/dev/null
rm -rf "$DIR"
trap '"$PY" tests/cluster/localcluster.py down --dir "$DIR" >/dev/null' EXIT
"$PY" tests/cluster/localcluster.py up --real-node --dir "$DIR" --bin-dir "$BIN_DIR"
export KVFENCE_E2E_KUBECONFIG="$PWD/$DIR/kubeconfig" KVFENCE_E2E_CONTAINERD="$PWD/$DIR/node/containerd.sock"
export KVFENCE_E2E_REBUILD=${KVFENCE_E2E_REBUILD:-1} KVFENCE_BIN_DIR="$BIN_DIR" PATH="$BIN_DIR:$PATH"
.venv/bin/pytest e2e -p no:cacheprovider --timeout=1800
