#!/usr/bin/env bash
# Build the kvfence wheel, the one every image installs (engine-image/build-images.sh calls this):
#
#   engine-image/build-wheel.sh OUTDIR        # prints the wheel's path
#
# One wheel, tagged cp311-abi3: its compiled modules (the prefix cache's walk, _prefix_walk.c, and the
# vLLM fence's records, _records.c) are built against CPython's stable ABI (setup.py), so the same file
# loads in this machine's Python and in the GPU vLLM image's, which is vLLM's own. The script refuses a
# wheel without that tag or without both modules.
#
# The build backend's own wheels (setuptools, wheel) are kept in $BUILD_SYSTEM, so an offline run
# (KVFENCE_OFFLINE=1) builds from an earlier run's copies.
# Environment: PYTHON (.venv/bin/python), KVFENCE_OFFLINE (0), BUILD_SYSTEM (build/images/build-system).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
BUILD_SYSTEM="${BUILD_SYSTEM:-$ROOT/build/images/build-system}"
ABI3_TAG=cp311-abi3
die() { printf 'build-wheel.sh: %s\n' "$*" >&2; exit 1; }

[ $# = 1 ] || die "usage: build-wheel.sh OUTDIR"
out="$1"
mkdir -p "$out" "$BUILD_SYSTEM"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
rm -f "$out"/kvfence-*.whl
# setuptools packs everything under its build/lib.* directory: a per-version module an older build left
# there would ride along and, where it loads, shadow the abi3 one.
find "$ROOT/build" -path "$ROOT/build/lib.*/kvfence/*" -name '*.so' ! -name '*.abi3.so' -delete 2>/dev/null || true
pip_args=(wheel --quiet --no-deps --find-links "$BUILD_SYSTEM" --wheel-dir "$out")
if [ "${KVFENCE_OFFLINE:-0}" = 1 ]; then
  pip_args+=(--no-index)
else
  "$PYTHON" -m pip wheel --quiet --wheel-dir "$BUILD_SYSTEM" "setuptools>=77" wheel \
    || die "pip wheel setuptools failed (no package index? set KVFENCE_OFFLINE=1 after one online run)"
fi
"$PYTHON" -m pip "${pip_args[@]}" "$ROOT" >&2 || die "pip wheel kvfence failed"

whl="$out/kvfence-$version-$ABI3_TAG-linux_$(uname -m).whl"
[ -f "$whl" ] || die "no $ABI3_TAG wheel was built: $(ls "$out")"
"$PYTHON" - "$whl" <<'PY' || die "$whl does not hold exactly the two abi3 modules"
import sys, zipfile
have = {n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(".so")}
want = {"kvfence/isolation/_prefix_walk.abi3.so", "kvfence/vllm/_records.abi3.so"}
sys.exit(f"missing {sorted(want - have)}, unexpected {sorted(have - want)}" if have != want else 0)
PY
echo "$whl"
