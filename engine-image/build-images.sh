#!/usr/bin/env bash
# Build kvfence's container images with podman (or docker), without any container registry.
#
#   engine-image/build-images.sh [control-plane] [reference] [vllm-cpu] [vllm]
#                                                                  (default: control-plane reference)
#
# 1. Base image: unless $BASE_IMAGE names one that exists locally, a Debian bookworm root filesystem
#    is made with debootstrap (python3, python3-venv, ca-certificates) and imported as
#    localhost/kvfence/debian-base:bookworm. The root filesystem tarball is kept in $OUT, so later
#    runs need no Debian mirror either.
# 2. Wheels: the kvfence wheel (engine-image/build-wheel.sh: one cp311-abi3 wheel, its compiled modules
#    built against CPython's stable ABI, so every image installs the same one, the vLLM image's Python
#    included) and every dependency, built on this machine into $OUT/context/wheels (pip needs a
#    package index, or an earlier run's wheelhouse with KVFENCE_OFFLINE=1).
# 3. Images, built with --network none from that context: nothing is downloaded during the build.
#      kvfence/control-plane:<version>     kvfence-operator and kvfence-router (the Helm chart's image)
#      kvfence/engine-reference:<version>  the CPU reference engine
#      kvfence/engine-vllm-cpu:<version>   vLLM for CPU (engine-image/vllm.env) + the kvfence plugin +
#                                          a tiny model built in, from a wheelhouse downloaded on this
#                                          machine (engine-image/vllm-wheelhouse.sh, cached in
#                                          ~/.cache/kvfence/wheels): about 6 GB, what the e2e suite's
#                                          vLLM class runs
#      kvfence/engine-vllm:<version>       vLLM + the kvfence middleware and scheduler (the same abi3
#                                          kvfence wheel, in vLLM's Python): needs the vllm/vllm-openai
#                                          base pulled beforehand (VLLM_IMAGE), so never built offline
# 4. Smoke test of each image (its entry point runs as non-root on a read-only root filesystem), and
#    an archive per image in $OUT, kvfence-<image>-<version>.oci.tar (an OCI archive of zstd layers
#    with podman, a docker archive with docker; `kind load image-archive` and `ctr images import`
#    read both).
#
# Environment: CONTAINER_TOOL (podman), OUT (build/images), BASE_IMAGE, VLLM_CPU_BASE_IMAGE, DEBIAN_MIRROR
# (http://deb.debian.org/debian), PYTHON (.venv/bin/python), KVFENCE_OFFLINE (0), VLLM_IMAGE.
#
# podman on hosts with a hybrid cgroup hierarchy (this project's CI machines): crun fails there, so
# /etc/containers/containers.conf should say
#   [containers] default_ulimits = []      [engine] runtime = "runc"  cgroup_manager = "cgroupfs"
# (the script passes --runtime runc --cgroup-manager cgroupfs itself when it runs podman).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOL="${CONTAINER_TOOL:-podman}"
OUT="${OUT:-$ROOT/build/images}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
LOCAL_BASE="localhost/kvfence/debian-base:$SUITE"
VLLM_IMAGE="${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}"  # engine-image/vllm.env (tests/vllm/test_vllm_pins.py)
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
IMAGES=("$@")
PULL_NEVER=()
[ "$TOOL" != podman ] || PULL_NEVER=(--pull=never)
[ ${#IMAGES[@]} -gt 0 ] || IMAGES=(control-plane reference)

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'build-images.sh: %s\n' "$*" >&2; exit 1; }

tool() {
  if [ "$TOOL" = podman ]; then
    podman --runtime runc --cgroup-manager cgroupfs "$@"
  else
    "$TOOL" "$@"
  fi
}

image_exists() {
  if [ "$TOOL" = podman ]; then tool image exists "$1"; else tool image inspect "$1" >/dev/null 2>&1; fi
}

for image in "${IMAGES[@]}"; do
  if [ "$image" = vllm ] && ! image_exists "$VLLM_IMAGE"; then
    die "the vLLM base $VLLM_IMAGE is not a local image: pull it where a registry is reachable (pin it by digest), or set VLLM_IMAGE"
  fi
done
command -v "$TOOL" >/dev/null || die "$TOOL is not installed (apt-get install podman, or CONTAINER_TOOL=docker)"
mkdir -p "$OUT"

# --- 1. base image -------------------------------------------------------------------------------
make_base() {  # TAG TARBALL INCLUDES: a debootstrapped Debian root filesystem imported as TAG
  local tag="$1" tarball="$2" includes="$3"
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root to make $tarball"
    local rootfs="$OUT/rootfs"
    rm -rf "$rootfs"
    log "debootstrap $SUITE from $MIRROR ($includes)"
    debootstrap --variant=minbase --include="$includes" \
      "$SUITE" "$rootfs" "$MIRROR" >"$OUT/debootstrap.log" 2>&1 \
      || die "debootstrap failed; see $OUT/debootstrap.log"
    # Smaller and reproducible-ish: no apt lists, caches, logs or docs.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/log/* \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  log "import $tarball as $tag"
  tool import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' "$tarball" "$tag" >/dev/null
}

BASE_INCLUDES=python3,python3-venv,ca-certificates
if [ -n "${BASE_IMAGE:-}" ]; then
  image_exists "$BASE_IMAGE" || die "BASE_IMAGE=$BASE_IMAGE is not a local image"
  BASE="$BASE_IMAGE"
else
  image_exists "$LOCAL_BASE" || make_base "$LOCAL_BASE" "$OUT/debian-$SUITE-rootfs.tar" "$BASE_INCLUDES"
  BASE="$LOCAL_BASE"
fi
# vLLM for CPU also needs libnuma (its CPU kernels link it): a base of its own, so the other images
# keep theirs. With BASE_IMAGE, VLLM_CPU_BASE_IMAGE names one that has libnuma.so.1.
vllm_cpu_base() {
  if [ -n "${VLLM_CPU_BASE_IMAGE:-}" ]; then
    image_exists "$VLLM_CPU_BASE_IMAGE" || die "VLLM_CPU_BASE_IMAGE=$VLLM_CPU_BASE_IMAGE is not a local image"
    echo "$VLLM_CPU_BASE_IMAGE"
    return
  fi
  local tag="localhost/kvfence/debian-base-vllm-cpu:$SUITE"
  image_exists "$tag" || make_base "$tag" "$OUT/debian-$SUITE-vllm-cpu-rootfs.tar" "$BASE_INCLUDES,libnuma1"
  echo "$tag"
}

# --- 2. wheels -------------------------------------------------------------------------------------
CTX="$OUT/context"
mkdir -p "$CTX/wheels"
rm -f "$CTX"/wheels/kvfence-*.whl
log "wheels into $CTX/wheels"
# The kvfence wheel first (the build backend's own wheels are kept in $OUT/build-system, so offline runs
# can build it), then its dependencies beside it.
KVFENCE_WHEEL="$(PYTHON="$PYTHON" BUILD_SYSTEM="$OUT/build-system" "$ROOT/engine-image/build-wheel.sh" "$OUT/kvfence-wheel")" \
  || die "building the kvfence wheel failed"
pip_args=(wheel --quiet)
[ "${KVFENCE_OFFLINE:-0}" != 1 ] || pip_args+=(--no-index --find-links "$CTX/wheels")
"$PYTHON" -m pip "${pip_args[@]}" --wheel-dir "$CTX/wheels" "$KVFENCE_WHEEL" \
  || die "pip wheel failed (no package index? set KVFENCE_OFFLINE=1 after one online run)"
ls "$CTX"/wheels/kvfence-*.whl >/dev/null

# --- 3. images -------------------------------------------------------------------------------------
build() {  # NAME DOCKERFILE [BUILD ARGS...]; the context is $BUILD_CTX (default $CTX)
  local name="$1" dockerfile="$2"; shift 2
  local tag="localhost/kvfence/$name:$VERSION"
  log "build $tag from $dockerfile"
  tool build --network none "${PULL_NEVER[@]}" -f "$ROOT/engine-image/$dockerfile" -t "$tag" \
    -t "docker.io/kvfence/$name:$VERSION" "$@" "${BUILD_CTX:-$CTX}"
}

smoke() {  # the image's entry point runs as 65532 on a read-only root filesystem with a /tmp mount
  local name="$1"; shift
  log "smoke test kvfence/$name: $*"
  tool run --rm --network none --read-only --tmpfs /tmp "localhost/kvfence/$name:$VERSION" "$@" >/dev/null
  local uid
  uid="$(tool image inspect --format '{{.Config.User}}' "localhost/kvfence/$name:$VERSION")"
  [ "$uid" = "65532:65532" ] || die "kvfence/$name runs as '$uid', not 65532:65532"
  # The UID has a name (kopf and torch ask for it with getpass.getuser()).
  tool run --rm --network none --read-only --entrypoint python3 "localhost/kvfence/$name:$VERSION" \
    -c 'import getpass; assert getpass.getuser() == "kvfence"' \
    || die "kvfence/$name: UID 65532 has no passwd entry"
}

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

http_status() {  # METHOD URL -> HTTP status, retried for up to 30 s while the server starts
  "$PYTHON" - "$@" <<'PY'
import sys, time, urllib.error, urllib.request
method, url = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 30
while True:
    try:
        req = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
        print(urllib.request.urlopen(req, timeout=3).status)
        break
    except urllib.error.HTTPError as e:
        print(e.code)
        break
    except OSError:
        if time.monotonic() > deadline:
            print("unreachable")
            break
        time.sleep(0.5)
PY
}

serve_check() {  # NAME PATH=STATUS... -- ARGS: run the image serving on the host network, probe it
  local name="$1"; shift
  local probes=()
  while [ "$1" != -- ]; do probes+=("$1"); shift; done
  shift
  local cid
  cid="$(tool run -d --network host --read-only --tmpfs /tmp -v "$OUT/smoke:/etc/kvfence:ro" \
    "localhost/kvfence/$name:$VERSION" "$@")"
  local ok=1
  for probe in "${probes[@]}"; do
    local method="${probe%% *}" rest="${probe#* }"
    local url="${rest%=*}" want="${rest##*=}" got
    got="$(http_status "$method" "$url")"
    if [ "$got" = "$want" ]; then log "kvfence/$name: $method $url -> $got"; else ok=0; log "kvfence/$name: $method $url -> $got, want $want"; fi
  done
  [ $ok = 1 ] || tool logs "$cid" >&2 || true
  tool rm -f "$cid" >/dev/null
  [ $ok = 1 ] || die "kvfence/$name does not serve as expected"
}

save() {
  local name="$1" archive="$OUT/kvfence-$1-$VERSION.oci.tar"
  rm -f "$archive"
  if [ "$TOOL" = podman ]; then
    # zstd layers: the CPU vLLM image's archive is 3 GB instead of 6.7, and so is its copy in the
    # node's containerd content store (containerd 1.5 and later unpack zstd).
    tool push --quiet --compression-format zstd "docker.io/kvfence/$name:$VERSION" \
      "oci-archive:$archive:docker.io/kvfence/$name:$VERSION"
  else  # docker writes its own archive format, which kind and `ctr images import` read as well
    tool save -o "$archive" "docker.io/kvfence/$name:$VERSION"
  fi
  log "saved $archive"
}

for image in "${IMAGES[@]}"; do
  case "$image" in
    control-plane)
      build control-plane Dockerfile.control-plane --build-arg "BASE_IMAGE=$BASE"
      smoke control-plane kvfence-router --help
      smoke control-plane kvfence-operator --help
      # The router serves without a routing table yet: alive, not ready (what the chart's probes expect).
      mkdir -p "$OUT/smoke"
      port="$(free_port)"
      serve_check control-plane "GET http://127.0.0.1:$port/healthz=200" "GET http://127.0.0.1:$port/readyz=503" -- \
        kvfence-router --routing-table /etc/kvfence/routing/routing.json --host 127.0.0.1 --port "$port"
      save control-plane
      ;;
    reference)
      build engine-reference Dockerfile.reference --build-arg "BASE_IMAGE=$BASE"
      smoke engine-reference --help
      # It serves, and refuses a request without the router's signature.
      port="$(free_port)"
      mkdir -p "$OUT/smoke/config" "$OUT/smoke/keys"
      head -c 32 /dev/urandom >"$OUT/smoke/keys/current"
      chmod 0644 "$OUT/smoke/keys/current"
      printf '{"trustClass": "smoke", "model": {"name": "kvfence/tiny", "revision": "1"}, "numBlocks": 64, "maxModelLen": 128, "signingKeyDir": "/etc/kvfence/keys", "listen": {"host": "127.0.0.1", "port": %s}}\n' "$port" >"$OUT/smoke/config/engine.json"
      serve_check engine-reference "GET http://127.0.0.1:$port/health=200" "POST http://127.0.0.1:$port/v1/completions=401" -- \
        --config /etc/kvfence/config/engine.json
      save engine-reference
      ;;
    vllm-cpu)
      # shellcheck source=vllm.env
      . "$ROOT/engine-image/vllm.env"
      wheelhouse="$(PYTHON="$PYTHON" "$ROOT/engine-image/vllm-wheelhouse.sh")"
      vctx="$OUT/vllm-cpu-context"
      rm -rf "$vctx"
      mkdir -p "$vctx/wheels"
      # Hard links where the cache is on the same filesystem (3 GB not copied), else a copy.
      cp -al "$wheelhouse" "$vctx/vllm-wheels" 2>/dev/null || cp -a "$wheelhouse" "$vctx/vllm-wheels"
      cp "$CTX"/wheels/kvfence-*.whl "$vctx/wheels/"
      cp "$ROOT/tests/vllm/tinymodel.py" "$vctx/"
      vbase="$(vllm_cpu_base)"
      wheel_sha="$(sha256sum "$vctx"/wheels/kvfence-*.whl | cut -d' ' -f1)"
      BUILD_CTX="$vctx" build engine-vllm-cpu Dockerfile.vllm-cpu --build-arg "BASE_IMAGE=$vbase" \
        --build-arg "VLLM_VERSION=$VLLM_VERSION" --build-arg "VLLM_TORCH_VERSION=$VLLM_TORCH_VERSION" \
        --build-arg "KVFENCE_WHEEL_SHA256=$wheel_sha"
      rm -rf "$vctx"
      smoke engine-vllm-cpu --help
      # vLLM's CLI, the kvfence plugin and the built-in model, on a read-only root filesystem.
      tool run --rm --network none --read-only --tmpfs /tmp --entrypoint python3 \
        -e VLLM_TARGET_DEVICE=cpu "localhost/kvfence/engine-vllm-cpu:$VERSION" -c "
import importlib.metadata as m, json, kvfence.vllm.middleware, kvfence.vllm.scheduler, kvfence.vllm.records, vllm.entrypoints.cli.main
assert kvfence.vllm.records.COMPILED, 'the kvfence wheel lacks the compiled prefix-cache records (_records.c)'
from transformers import AutoTokenizer
assert m.version('vllm') == '$VLLM_VERSION+cpu', m.version('vllm')
assert json.load(open('/opt/kvfence/models/tiny/config.json'))['model_type'] == 'llama'
assert len(AutoTokenizer.from_pretrained('/opt/kvfence/models/tiny')('hello kvfence')['input_ids']) > 0
from safetensors import safe_open
assert len(list(safe_open('/opt/kvfence/models/tiny/model.safetensors', 'pt').keys())) > 0
" || die "kvfence/engine-vllm-cpu: vLLM, the kvfence plugin or the model is missing"
      save engine-vllm-cpu
      ;;
    vllm)
      image_exists "$VLLM_IMAGE" || die "the vLLM base $VLLM_IMAGE is not a local image: pull it where a registry is reachable (pin it by digest), or set VLLM_IMAGE"
      # vLLM's image has a Python of its own, not this host's: the abi3 kvfence wheel loads there too
      # (Dockerfile.vllm fails the build if its compiled records do not).
      gctx="$OUT/vllm-context"
      rm -rf "$gctx"
      mkdir -p "$gctx/wheels"
      cp "$KVFENCE_WHEEL" "$gctx/wheels/"
      BUILD_CTX="$gctx" build engine-vllm Dockerfile.vllm --build-arg "VLLM_IMAGE=$VLLM_IMAGE"
      rm -rf "$gctx"
      save engine-vllm
      ;;
    *) die "unknown image $image (control-plane, reference, vllm-cpu, vllm)" ;;
  esac
done
# Intermediate build stages are of no further use.
tool image prune -f >/dev/null || true
log "done: ${IMAGES[*]}"
