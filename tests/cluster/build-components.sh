#!/usr/bin/env bash
# Builds the upstream Kubernetes components the test cluster runs, from the Go module proxy, with the
# versions pinned in components.env. Binaries are cached under $KVFENCE_CACHE (default
# ~/.cache/kvfence/bin/<component>-<version>/), so a warm machine skips every step.
#
#   tests/cluster/build-components.sh              # build what is missing, print the bin dir
#   tests/cluster/build-components.sh --real-node  # also kube-router and CoreDNS (realnode.py)
#   tests/cluster/build-components.sh --print      # print the bin dir only
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=components.env
. "$here/components.env"
cache=${KVFENCE_CACHE:-$HOME/.cache/kvfence}
bindir="$cache/bin/k8s-v$K8S_VERSION-etcd-v$ETCD_VERSION-kwok-v$KWOK_VERSION-helm-v$HELM_VERSION"
if [[ "${1:-}" == "--print" ]]; then echo "$bindir"; exit 0; fi
mkdir -p "$bindir"
export CGO_ENABLED=0 GOFLAGS="-mod=mod -modcacherw" GOTOOLCHAIN=local
log() { printf '[build-components] %s\n' "$*" >&2; }
scratch() { local d; d=$(mktemp -d "${TMPDIR:-/tmp}/kvfence-build.XXXXXX"); echo "$d"; }

# Go's build and module caches live in a scratch directory, removed when the script ends: the binaries
# are what is kept (by version), and the caches (about 10 GB for Kubernetes) would serve only a build
# of other versions, while a fresh machine (CI) needs that disk for the images its tests build.
gotmp=""
go_scratch() {
  [[ -n "$gotmp" ]] && return 0
  gotmp=$(scratch)
  export GOCACHE="$gotmp/cache" GOMODCACHE="$gotmp/mod"
}
trap '[[ -z "$gotmp" ]] || rm -rf "$gotmp"' EXIT

k8s_pkg() { # binary name -> package in k8s.io/kubernetes
  case $1 in
    agnhost) echo k8s.io/kubernetes/test/images/agnhost ;;
    *) echo "k8s.io/kubernetes/cmd/$1" ;;
  esac
}

build_k8s() {
  # agnhost is Kubernetes' own e2e test image (HTTP server, `connect` probe): the real node's tests use it.
  local want=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy agnhost)
  local missing=()
  for b in "${want[@]}"; do [[ -x "$bindir/$b" ]] || missing+=("$b"); done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  log "kubernetes v$K8S_VERSION: building ${missing[*]}"
  go_scratch
  local d; d=$(scratch)
  (
    cd "$d"
    go mod init kvfence.dev/build/k8s >/dev/null 2>&1
    go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" >/dev/null
    local modfile; modfile=$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/v$K8S_VERSION.mod
    # Every staging module k8s.io/<name> is published as v0.<minor>.<patch>.
    local minor=${K8S_VERSION#*.}; local staging="v0.$minor"
    {
      echo "require k8s.io/kubernetes v$K8S_VERSION"
      sed -nE 's#^\s*(k8s\.io/[a-z0-9-]+) => \./staging/.*#replace \1 => \1 '"$staging"'#p' "$modfile"
    } >> go.mod
    printf 'package tools\n\nimport (\n' > tools.go
    for b in "${missing[@]}"; do printf '\t_ "%s"\n' "$(k8s_pkg "$b")" >> tools.go; done
    printf ')\n' >> tools.go
    sed -i '1s/.*/\/\/go:build tools\n\npackage tools/' tools.go
    go mod tidy -e >/dev/null 2>&1 || true
    local now; now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    local minornum=${minor%%.*}
    local ld="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minornum"
      ld+=" -X $p.gitTreeState=clean -X $p.buildDate=$now -X $p.gitCommit=v$K8S_VERSION"
    done
    for b in "${missing[@]}"; do
      go build -trimpath -tags tools -ldflags "$ld" -o "$bindir/$b.tmp" "$(k8s_pkg "$b")"
      mv "$bindir/$b.tmp" "$bindir/$b"
      log "built $b"
    done
  )
  rm -rf "$d"
}

build_etcd() {
  [[ -x "$bindir/etcd" ]] && return 0
  log "etcd v$ETCD_VERSION"
  go_scratch
  local d; d=$(scratch)
  (
    cd "$d"
    go mod init kvfence.dev/build/etcd >/dev/null 2>&1
    cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
    go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >/dev/null 2>&1
    go mod tidy >/dev/null 2>&1
    go build -trimpath -ldflags "-s -w" -o "$bindir/etcd.tmp" .
    mv "$bindir/etcd.tmp" "$bindir/etcd"
  )
  rm -rf "$d"
}

build_tool() { # name module-path version; a stamp file records the version that was built
  local name=$1 pkg=$2 ver=$3
  [[ -x "$bindir/$name" && "$(cat "$bindir/$name.version" 2>/dev/null)" == "$ver" ]] && return 0
  log "$name v$ver"
  go_scratch
  GOBIN="$bindir" go install -trimpath -ldflags "-s -w" "$pkg@v$ver"
  echo "$ver" > "$bindir/$name.version"
}

start=$(date +%s)
build_etcd
build_tool kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
build_tool helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
build_k8s
if [[ "${1:-}" == "--real-node" ]]; then
  build_tool kube-router github.com/cloudnativelabs/kube-router/v2/cmd/kube-router "$KUBE_ROUTER_VERSION"
  build_tool coredns github.com/coredns/coredns "$COREDNS_VERSION"
fi
end=$(date +%s)
log "components ready in $((end - start)) s: $bindir"
echo "$bindir"
