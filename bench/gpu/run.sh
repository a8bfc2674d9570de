#!/usr/bin/env bash
# The plugin's cost on a GPU, as the GPU image ships it: the scheduler-step benchmark and the
# end-to-end benchmark, inside the kvfence vLLM image, with no network; one table at the end.
#
#   bench/gpu/run.sh --model DIR [--image kvfence/engine-vllm:<version>] [--out DIR] [--quick]
#
#   --model DIR   a model directory on this host (config, weights, tokenizer): mounted read-only as
#                 /model and served as is; nothing is downloaded
#   --image IMG   the image engine-image/build-images.sh vllm built (default kvfence/engine-vllm:<version
#                 in pyproject.toml>)
#   --out DIR     where the results go (default bench/results/gpu-<time>)
#   --quick       fewer rounds and prompts (a check that everything runs, in a few minutes)
#
# Environment: CONTAINER_TOOL (docker, or podman with the NVIDIA CDI spec), GPU_FLAGS (default
# "--gpus all" for docker, "--device nvidia.com/gpu=all" for podman).
#
# What runs, in the image's own Python, with the image's installed kvfence (only bench/ and tests/ of
# this tree are mounted, never operator/ or engine-image/, so the fence records are the image's):
#   1. bench/bench_vllm.py --lockstep --variants "no quotas" --floor --split: the fenced scheduler's
#      step against vLLM's, in lockstep, with the A/A floor and the fence alone (fair share patched
#      out) as a third side (no model runs: the scheduler alone), on the saturated default mix and
#      on a light engine (--users 2,2,2: six requests, none ever waiting);
#   2. bench/bench_e2e.py --device gpu: stock vllm serve, the kvfence engine direct (signed requests),
#      and the kvfence engine behind kvfence-router, loaded by vllm bench serve at several rates;
#   3. bench/gpu/report.py: both in one table.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)"
IMAGE="kvfence/engine-vllm:$VERSION"
OUT="$ROOT/bench/results/gpu-$(date -u +%Y%m%dT%H%M%S)"
MODEL=""
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --image) IMAGE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "run.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
die() { echo "run.sh: $*" >&2; exit 1; }
[ -n "$MODEL" ] || die "--model DIR is required: a model directory on this host (no network in the container)"
[ -f "$MODEL/config.json" ] || die "$MODEL has no config.json: give the directory of a model (weights + tokenizer)"
TOOL="${CONTAINER_TOOL:-docker}"
command -v "$TOOL" >/dev/null || die "$TOOL is not installed (or set CONTAINER_TOOL)"
"$TOOL" image inspect "$IMAGE" >/dev/null 2>&1 || die "no local image $IMAGE: engine-image/build-images.sh vllm"
if [ "$TOOL" = podman ]; then GPU_FLAGS="${GPU_FLAGS:---device nvidia.com/gpu=all}"; else GPU_FLAGS="${GPU_FLAGS:---gpus all}"; fi
MODEL="$(cd "$MODEL" && pwd)"
mkdir -p "$OUT" "$ROOT/bench/results"  # the second: the mount point of $OUT inside the read-only bench/
chmod 0777 "$OUT"  # the image runs as UID 65532
COMMIT="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
git -C "$ROOT" diff --quiet HEAD -- bench tests 2>/dev/null || COMMIT="$COMMIT+uncommitted"

if [ "$QUICK" = 1 ]; then
  STEP_ARGS=(--quick --rounds 2)
  E2E_ARGS=(--rates 8,inf --rounds 2 --num-prompts 128 --max-concurrency 64 --max-num-seqs 128)
else
  STEP_ARGS=(--rounds 5)
  # a GPU serves far more than the CPU VMs: higher rates and concurrency than bench_e2e.py's defaults
  E2E_ARGS=(--rates 8,32,inf --rounds 3 --num-prompts 320 --max-concurrency 64 --max-num-seqs 128)
fi

# shellcheck disable=SC2086  # GPU_FLAGS is a list of flags
"$TOOL" run --rm --network none $GPU_FLAGS --ipc host \
  -v "$ROOT/bench:/src/bench:ro" -v "$ROOT/tests:/src/tests:ro" -v "$OUT:/src/bench/results" \
  -v "$MODEL:/model:ro" \
  -e HF_HUB_OFFLINE=1 -e TRANSFORMERS_OFFLINE=1 -e KVFENCE_BENCH_COMMIT="$COMMIT" \
  -e VLLM_TARGET_DEVICE=cuda -e PYTHONDONTWRITEBYTECODE=1 \
  --entrypoint bash "$IMAGE" -euc '
    cd /tmp
    python3 -c "from kvfence.vllm import records; print(\"fence records:\", \"compiled\" if records.COMPILED else \"pure Python\")"
    python3 /src/bench/bench_vllm.py --lockstep --variants "no quotas" --floor --split '"${STEP_ARGS[*]}"'
    python3 /src/bench/bench_vllm.py --lockstep --variants "no quotas" --floor --split '"${STEP_ARGS[*]}"' \
      --users 2,2,2 --requests-per-user 24
    python3 /src/bench/bench_e2e.py --device gpu --model /model --vllm-python "$(command -v python3)" \
      --plugin-path "" --results-dir /src/bench/results '"${E2E_ARGS[*]}"' \
      --note "GPU: $(nvidia-smi -L 2>/dev/null | head -1)"
    python3 /src/bench/gpu/report.py /src/bench/results
  '
echo "results in $OUT"
