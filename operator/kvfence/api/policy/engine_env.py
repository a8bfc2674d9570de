"""``engine.extraEnv``: the variables a class may set in its engine container (an allowlist).

A variable is allowed only when it is named in :data:`ALLOWED_ENV`: tuning that changes neither the code
the engine loads, nor how it handles requests, nor what kvfence configures itself. Every other name is
refused, with the reason of the first group of :data:`REFUSED_ENV` it falls in (or :data:`NOT_LISTED`).
A platform team that needs another variable adds it here, with the reason it is harmless (see
docs/operations.md).
"""

from __future__ import annotations

import re

from pydantic import JsonValue

#: Variables ``engine.extraEnv`` may set (exact names).
ALLOWED_ENV: frozenset[str] = frozenset(
    {
        # threads of the numeric libraries and the tokenizers
        "OMP_NUM_THREADS",
        "OMP_PROC_BIND",
        "OMP_PLACES",
        "OMP_WAIT_POLICY",
        "OMP_DYNAMIC",
        "OMP_STACKSIZE",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "NUMEXPR_MAX_THREADS",
        "NUMEXPR_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "RAYON_NUM_THREADS",
        "TORCHINDUCTOR_COMPILE_THREADS",
        # CUDA and NCCL tuning and diagnostics (never their plugin variables, which load libraries)
        "CUDA_LAUNCH_BLOCKING",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_MODULE_LOADING",
        "PYTORCH_CUDA_ALLOC_CONF",
        "NCCL_DEBUG",
        "NCCL_DEBUG_SUBSYS",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_DISABLE",
        "NCCL_IB_HCA",
        "NCCL_IB_GID_INDEX",
        "NCCL_P2P_DISABLE",
        "NCCL_SHM_DISABLE",
        "NCCL_CUMEM_ENABLE",
        "NCCL_NVLS_ENABLE",
        # downloads from the Hugging Face hub (the cache and the token are kvfence's: modelCache,
        # model.tokenSecretRef)
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_ENABLE_HF_TRANSFER",
        "HF_HUB_DOWNLOAD_TIMEOUT",
        "HF_HUB_ETAG_TIMEOUT",
        "HF_HUB_DISABLE_TELEMETRY",
        "HF_HUB_DISABLE_PROGRESS_BARS",
        "HF_ENDPOINT",
        # outbound proxies and the CA bundle of downloads
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        # locale and time zone of the logs
        "TZ",
        "LANG",
        "LC_ALL",
        # vLLM's logging, telemetry, timeouts and CPU tuning (each one a variable of the pinned vLLM's
        # vllm/envs.py; tests/vllm/test_vllm_args.py checks that)
        "VLLM_LOGGING_LEVEL",
        "VLLM_LOGGING_PREFIX",
        "VLLM_LOGGING_COLOR",
        "VLLM_LOG_STATS_INTERVAL",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "DO_NOT_TRACK",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
        "VLLM_IMAGE_FETCH_TIMEOUT",
        "VLLM_VIDEO_FETCH_TIMEOUT",
        "VLLM_AUDIO_FETCH_TIMEOUT",
        "VLLM_CPU_NUM_OF_RESERVED_CPU",
    }
)

#: Why a name that is not allowed is refused: the first group (an RE2 pattern) it matches.
REFUSED_ENV: tuple[tuple[str, str], ...] = (
    ("^KVFENCE_", "kvfence's own settings: the operator sets them"),
    (
        "^(CUSTOM_|SAGEMAKER_|SUPERVISOR_)",
        "vLLM's API server reads these (its SageMaker hosting layer) to load handlers and middleware "
        "that run outside the kvfence middleware",
    ),
    (
        "^VLLM_",
        "vLLM's switches load plugins, allow runtime LoRA loading or dev endpoints, pick attention "
        "backends and logging handlers; only the harmless ones are allowed",
    ),
    ("^(PYTHON|LD_)", "it changes the code the interpreter or the dynamic loader loads"),
    (
        "^(NVIDIA_|CUDA_VISIBLE_DEVICES$|HIP_VISIBLE_DEVICES$)",
        "it chooses the accelerators the container sees: resources.gpu decides that",
    ),
    (
        "^(HF_HOME|HF_HUB_CACHE|HF_TOKEN|HUGGING_FACE_HUB_TOKEN)$",
        "kvfence sets the model cache and the token: use engine.modelCache and engine.model.tokenSecretRef",
    ),
    ("^(HOME|PATH)$", "kvfence sets HOME, and PATH chooses the programs the engine runs"),
)
NOT_LISTED = "not on the allowlist of engine.extraEnv (kvfence.api.policy.engine_env; see docs/operations.md)"


def env_reason(name: str) -> str:
    """Why ``name`` is refused (assuming it is not allowed)."""
    for pattern, why in REFUSED_ENV:
        if re.match(pattern, name):
            return why
    return NOT_LISTED


def env_refusal(name: str) -> str | None:
    """Why ``engine.extraEnv`` may not set ``name`` (the CRD rule's message), or None."""
    if name in ALLOWED_ENV:
        return None
    return f"engine.extraEnv: {name} refused: {env_reason(name)}"


def _cel_string(s: str) -> str:
    """A CEL string literal (single-quoted) of ``s``."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def env_rule() -> dict[str, JsonValue]:
    """The CRD's rule on one EnvVar (``self`` is the item of extraEnv), from the same tables."""
    allowed = "[" + ", ".join(_cel_string(n) for n in sorted(ALLOWED_ENV)) + "]"
    reason = _cel_string(NOT_LISTED)
    for pattern, why in reversed(REFUSED_ENV):
        reason = f"self.name.matches({_cel_string(pattern)}) ? {_cel_string(why)} : {reason}"
    return {
        "rule": f"self.name in {allowed}",
        "messageExpression": f"'engine.extraEnv: ' + self.name + ' refused: ' + ({reason})",
        "fieldPath": ".name",
        "reason": "FieldValueForbidden",
    }
