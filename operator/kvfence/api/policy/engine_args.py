"""``engine.extraArgs``: the flags a class may add to its engine's command line (an allowlist).

Every option of the pinned vLLM's ``vllm serve`` parser, and of the reference engine's
``kvfence-engine``, is classified in :data:`VLLM_SERVE_FLAGS` and :data:`REFERENCE_FLAGS`: allowed
(tuning that changes neither what the engine loads nor how it treats a tenant's request), set by kvfence
(from a TrustClass field), or refused with the reason. Anything else is refused as well, so a flag a
new vLLM adds is refused until it is classified here; tests/vllm/test_vllm_args.py fails until then.

How an argument is read (as vLLM's ``FlexibleArgumentParser`` and argparse read it):

* an argument that does not start with ``-``, or is a negative integer, is a value;
* any other names a flag: the part before the first ``=`` or ``.`` (vLLM's ``--flag.key value`` form),
  with ``_`` read as ``-``. It must be spelled out: argparse would take any unique abbreviation, and
  vLLM's short forms (``-tp``, ``-O3``) are other spellings of long flags, so both are refused.

The CRD's CEL rules (:func:`extra_arg_item_rule`, :func:`extra_args_runtime_rules`) are generated from the
same tables and read an argument the same way (tests/operator/test_operator_crds.py sends every
classified flag to a real API server and compares its messages with :func:`extra_args_refusals`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import JsonValue

Runtime = Literal["vllm", "reference"]


@dataclass(frozen=True)
class Verdict:
    """How ``engine.extraArgs`` treats one flag."""

    allowed: bool
    why: str = ""


ALLOWED = Verdict(True)


def kvfence(field: str) -> Verdict:
    """A flag the operator renders itself, from ``field`` of the TrustClass."""
    return Verdict(False, f"kvfence sets it from {field}")


def refused(why: str) -> Verdict:
    return Verdict(False, why)


# --- reasons shared by many flags --------------------------------------------------------------------
LOADS_CODE = refused("it loads code, classes or plugins into the engine beside what kvfence ships")
TRUSTS_TENANT = refused(
    "the engine would trust what a tenant sends: a template it renders, tensors it deserialises, "
    "processor arguments"
)
PROCESSES = refused(
    "it runs several engine or API-server processes: the tenants' quotas and the nonce checks are "
    "kept per process and would not be exact across them"
)
MOVES_KV = refused(
    "it moves KV-cache blocks or their hashes out of the fenced pool (transfer, offload or events), "
    "where tenant isolation does not follow them"
)
HASHING = refused(
    "it changes how prefix-cache blocks are hashed and matched, which tenant isolation relies on"
)
REQUESTS = refused(
    "it changes how the API server treats a tenant's request (what it may send or what it is told); "
    "the router decides that per tenant"
)
ENDPOINTS = refused("it opens endpoints, listeners or protocols beside the one kvfence guards")
LOGS_TENANTS = refused("it writes tenants' prompts or outputs to the engine's log or to a trace collector")
MODEL_FILES = refused(
    "it changes which model files, config, tokenizer or loader the engine uses: engine.model is their "
    "one source"
)
DEVICES = refused(
    "it sizes the devices or memory the engine uses beyond what the pod requests (resources, "
    "engine.tensorParallelSize, engine.kvCacheMemory)"
)
SCHEDULING = refused(
    "it changes how the kvfence scheduler's requests are ordered or driven, which its quotas and fair "
    "share are written against"
)
CONFIG_FILE = refused("it reads further flags from a file, which this check never sees")
EXITS = refused("it prints and exits: the engine would never serve")

#: The reason for a flag no table classifies (or an abbreviation of one).
NOT_LISTED = (
    "not a flag engine.extraArgs allows: spell out a flag of the allowlist "
    "(kvfence.api.policy.engine_args; see docs/operations.md)"
)

#: The reference engine's flags (``kvfence-engine``, engine-image/kvfence/engine/cli.py).
REFERENCE_FLAGS: dict[str, Verdict] = {
    "-h": EXITS,
    "--help": EXITS,
    "--config": kvfence("the TrustClass (the engine config the operator writes)"),
    "--host": kvfence("the pod (the engine listens on every address of its pod)"),
    "--port": kvfence("engine.port"),
    "--num-blocks": kvfence("engine.numBlocks"),
    "--signing-key-dir": kvfence("the class's signing keys (a Secret the operator writes)"),
    "--port-file": refused("it writes a file at a path the class chooses; nothing in the pod reads it"),
    "--log-level": ALLOWED,
}

TEMPLATE = refused("it loads a Jinja template the engine renders with every tenant's messages")
TASK = refused(
    "it changes what the engine serves (pooling, drafting, diffusion, encoding only): kvfence fences "
    "text generation"
)
SLEEP = refused("it lets the engine drop its weights and KV cache on request (sleep mode), under the tenants")
KV_LAYOUT = refused("it splits or retains KV blocks in ways the fence's block accounting is not tested with")
SPECULATIVE = refused(
    "speculative decoding loads a second model (or a custom class) and allocates KV blocks the fence is "
    "not tested with"
)
KV_MANAGER = refused("it chooses vLLM's KV-cache manager, which the kvfence fence overrides")
RAY = refused("Ray executors are not used: engine.extraArgs cannot choose --distributed-executor-backend")
TLS = refused(
    "TLS and CORS on the engine: the router and the probes reach engine.port over plain HTTP, inside the "
    "class's NetworkPolicy"
)
WRITES_FILES = refused("it writes files at a path the class chooses; nothing in the pod reads them")

#: ``vllm serve``'s options in the pinned vLLM (engine-image/vllm.env), in its parser's groups. A key
#: spells one or more options: ``--[no-]x`` is ``--x`` and ``--no-x``; a single-dash word is a short
#: form, refused (its long flag's reason when that is refused too).
_VLLM_SERVE: list[tuple[str, Verdict]] = [
    ("-h --help", EXITS),
    ("--headless", PROCESSES),
    ("--api-server-count -asc", PROCESSES),
    ("--config", CONFIG_FILE),
    ("--grpc", ENDPOINTS),
    # Frontend
    ("--lora-modules", kvfence("engine.adapters")),
    ("--chat-template", TEMPLATE),
    ("--chat-template-content-format", ALLOWED),
    ("--[no-]trust-request-chat-template", TRUSTS_TENANT),
    ("--[no-]trust-request-mm-kwargs", TRUSTS_TENANT),
    ("--default-chat-template-kwargs", ALLOWED),
    ("--response-role", ALLOWED),
    ("--[no-]return-tokens-as-token-ids", ALLOWED),
    ("--[no-]enable-auto-tool-choice", ALLOWED),
    ("--[no-]exclude-tools-when-tool-choice-none", ALLOWED),
    ("--tool-call-parser", ALLOWED),
    ("--tool-parser-plugin", LOADS_CODE),
    ("--tool-strict-level", ALLOWED),
    (
        "--tool-server",
        refused("requests could call tool servers (the demo one runs model-written Python) from the engine"),
    ),
    ("--max-log-len", ALLOWED),
    ("--[no-]enable-prompt-tokens-details", ALLOWED),
    ("--[no-]enable-per-request-metrics", ALLOWED),
    (
        "--[no-]enable-server-load-tracking",
        refused("it publishes the engine's load, a side channel on the other tenants' traffic"),
    ),
    ("--[no-]enable-force-include-usage", ALLOWED),
    ("--sse-keep-alive-interval", ALLOWED),
    ("--[no-]enable-tokenizer-info-endpoint", ENDPOINTS),
    ("--[no-]enable-log-outputs", LOGS_TENANTS),
    ("--[no-]enable-log-deltas", LOGS_TENANTS),
    ("--[no-]cohere-is-reasoning-model", ALLOWED),
    ("--cohere-format", ALLOWED),
    ("--anthropic-disabled-thinking-effort", ALLOWED),
    ("--[no-]log-error-stack", ALLOWED),
    ("--[no-]tokens-only", ENDPOINTS),
    ("--[no-]enable-scale-out", ENDPOINTS),
    ("--fingerprint-mode", ALLOWED),
    ("--fingerprint-value", ALLOWED),
    ("--host", kvfence("the pod (vLLM listens on every address of its pod)")),
    ("--port", kvfence("engine.port")),
    ("--grpc-port", ENDPOINTS),
    ("--data-parallel-supervisor-port", PROCESSES),
    ("--dp-supervisor-probe-interval-s", PROCESSES),
    ("--dp-supervisor-probe-timeout-s", PROCESSES),
    ("--dp-supervisor-probe-failure-threshold", PROCESSES),
    ("--uds", refused("it moves the server to a Unix socket: the router and the probes reach engine.port")),
    ("--uvicorn-log-level", ALLOWED),
    ("--[no-]disable-uvicorn-access-log", ALLOWED),
    ("--disable-access-log-for-endpoints", ALLOWED),
    ("--[no-]allow-credentials", TLS),
    ("--allowed-origins", TLS),
    ("--allowed-methods", TLS),
    ("--allowed-headers", TLS),
    (
        "--api-key",
        refused(
            "tenants authenticate at the router, which signs what it forwards; an engine key would "
            "refuse the router"
        ),
    ),
    ("--ssl-keyfile", TLS),
    ("--ssl-certfile", TLS),
    ("--ssl-ca-certs", TLS),
    ("--[no-]enable-ssl-refresh", TLS),
    ("--ssl-cert-reqs", TLS),
    ("--ssl-ciphers", TLS),
    ("--root-path", refused("it moves the API under a path prefix the router and the probes do not use")),
    (
        "--middleware",
        refused(
            "kvfence sets it to its own middleware, which guards every request; another loads code beside it"
        ),
    ),
    ("--[no-]enable-request-id-headers", ALLOWED),
    ("--[no-]disable-fastapi-docs", ALLOWED),
    ("--h11-max-incomplete-event-size", ALLOWED),
    ("--h11-max-header-count", ALLOWED),
    ("--[no-]enable-offline-docs", ALLOWED),
    ("--[no-]enable-flash-late-interaction", ALLOWED),
    # ModelConfig
    ("--model", kvfence("engine.model.name")),
    ("--runner", TASK),
    ("--convert", TASK),
    ("--tokenizer", MODEL_FILES),
    ("--tokenizer-mode", MODEL_FILES),
    ("--[no-]trust-remote-code", LOADS_CODE),
    ("--dtype", kvfence("engine.dtype")),
    ("--seed", ALLOWED),
    ("--hf-config-path", MODEL_FILES),
    (
        "--allowed-local-media-path",
        refused("a tenant's request could read files of the engine's file system"),
    ),
    ("--allowed-media-domains", ALLOWED),
    ("--revision", kvfence("engine.model.revision")),
    ("--code-revision", LOADS_CODE),
    ("--tokenizer-revision", MODEL_FILES),
    ("--max-model-len", kvfence("engine.maxModelLen")),
    ("--quantization -q", kvfence("engine.quantization (part of every prefix-cache key)")),
    ("--quantization-config", kvfence("engine.quantization (part of every prefix-cache key)")),
    ("--[no-]allow-deprecated-quantization", ALLOWED),
    ("--[no-]enforce-eager", ALLOWED),
    ("--[no-]enable-return-routed-experts", ALLOWED),
    ("--[no-]return-sampling-mask", ALLOWED),
    ("--max-logprobs", ALLOWED),
    ("--logprobs-mode", ALLOWED),
    ("--[no-]use-fp64-gumbel", ALLOWED),
    ("--[no-]enable-trace-replay", REQUESTS),
    ("--[no-]disable-sliding-window", ALLOWED),
    ("--[no-]disable-cascade-attn", ALLOWED),
    ("--[no-]skip-tokenizer-init", REQUESTS),
    ("--[no-]enable-prompt-embeds", TRUSTS_TENANT),
    ("--served-model-name", kvfence("engine.model.servedName")),
    ("--config-format", MODEL_FILES),
    ("--hf-token", kvfence("engine.model.tokenSecretRef (a flag would put the token in the pod spec)")),
    ("--hf-overrides", MODEL_FILES),
    ("--model-class-overrides", LOADS_CODE),
    ("--pooler-config", TASK),
    ("--generation-config", REQUESTS),
    ("--override-generation-config", REQUESTS),
    ("--[no-]enable-sleep-mode", SLEEP),
    ("--[no-]sleep-mode-offload-cudagraph", SLEEP),
    ("--sleep-preserve-parameter-names", SLEEP),
    ("--[no-]enable-cumem-allocator", ALLOWED),
    ("--[no-]enable-nccl-comm-suspend", SLEEP),
    ("--model-impl", MODEL_FILES),
    ("--logits-processors", LOADS_CODE),
    ("--io-processor-plugin", LOADS_CODE),
    ("--renderer-num-workers", ALLOWED),
    # LoadConfig
    ("--load-format", MODEL_FILES),
    ("--download-dir", kvfence("engine.modelCache")),
    ("--safetensors-load-strategy", ALLOWED),
    ("--safetensors-prefetch-num-threads", ALLOWED),
    ("--safetensors-prefetch-block-size", ALLOWED),
    ("--model-loader-extra-config", MODEL_FILES),
    ("--ignore-patterns", MODEL_FILES),
    ("--[no-]use-tqdm-on-load", ALLOWED),
    ("--pt-load-map-location", ALLOWED),
    # AttentionConfig, MambaConfig
    ("--attention-backend", ALLOWED),
    ("--mamba-backend", ALLOWED),
    ("--mamba-ssu-algorithm", ALLOWED),
    ("--[no-]enable-mamba-cache-stochastic-rounding", ALLOWED),
    ("--mamba-cache-philox-rounds", ALLOWED),
    # StructuredOutputsConfig
    ("--reasoning-parser", ALLOWED),
    ("--reasoning-parser-plugin", LOADS_CODE),
    # ParallelConfig
    ("--distributed-executor-backend", LOADS_CODE),
    ("--pipeline-parallel-size -pp", DEVICES),
    ("--master-addr", PROCESSES),
    ("--master-port", PROCESSES),
    ("--nnodes -n", PROCESSES),
    ("--node-rank -r", PROCESSES),
    ("--distributed-timeout-seconds", ALLOWED),
    ("--cpu-distributed-timeout-seconds", ALLOWED),
    ("--[no-]numa-bind", ALLOWED),
    ("--numa-bind-nodes", ALLOWED),
    ("--numa-bind-cpus", ALLOWED),
    ("--device-ids", DEVICES),
    ("--tensor-parallel-size -tp", kvfence("engine.tensorParallelSize")),
    ("--decode-context-parallel-size -dcp", KV_LAYOUT),
    ("--dcp-comm-backend", KV_LAYOUT),
    ("--[no-]dcp-q-replicate", KV_LAYOUT),
    ("--dcp-kv-cache-interleave-size", KV_LAYOUT),
    ("--cp-kv-cache-interleave-size", KV_LAYOUT),
    ("--prefill-context-parallel-size -pcp", KV_LAYOUT),
    ("--data-parallel-size -dp", PROCESSES),
    ("--data-parallel-rank -dpn", PROCESSES),
    ("--data-parallel-start-rank -dpr", PROCESSES),
    ("--data-parallel-size-local -dpl", PROCESSES),
    ("--data-parallel-address -dpa", PROCESSES),
    ("--data-parallel-rpc-port -dpp", PROCESSES),
    ("--data-parallel-backend -dpb", PROCESSES),
    ("--[no-]data-parallel-hybrid-lb -dph", PROCESSES),
    ("--[no-]data-parallel-external-lb -dpe", PROCESSES),
    ("--data-parallel-multi-port-external-lb -dpm", PROCESSES),
    ("--[no-]enable-hc-sp", ALLOWED),
    ("--[no-]enable-expert-parallel -ep", ALLOWED),
    ("--[no-]enable-batch-sharded-sampling", ALLOWED),
    ("--[no-]enable-ep-weight-filter", ALLOWED),
    ("--all2all-backend", ALLOWED),
    ("--[no-]enable-dbo", ALLOWED),
    ("--[no-]enable-shm-tensor-arena", ALLOWED),
    ("--ubatch-size", ALLOWED),
    ("--[no-]enable-elastic-ep", PROCESSES),
    ("--elastic-ep-max-dp-size", PROCESSES),
    ("--dbo-decode-token-threshold", ALLOWED),
    ("--dp-sync-interval", PROCESSES),
    ("--dbo-prefill-token-threshold", ALLOWED),
    ("--[no-]disable-nccl-for-dp-synchronization", PROCESSES),
    ("--[no-]enable-eplb", ALLOWED),
    ("--eplb-config", ALLOWED),
    ("--expert-placement-strategy", ALLOWED),
    ("--max-parallel-loading-workers", ALLOWED),
    ("--[no-]ray-workers-use-nsight", RAY),
    ("--[no-]disable-custom-all-reduce", ALLOWED),
    ("--worker-cls", LOADS_CODE),
    ("--worker-extension-cls", LOADS_CODE),
    ("--[no-]enable-fault-tolerance", PROCESSES),
    ("--fault-tolerance-config", PROCESSES),
    # CacheConfig
    ("--block-size", kvfence("engine.blockSize")),
    ("--gpu-memory-utilization --device-memory-utilization", kvfence("engine.gpuMemoryUtilization")),
    ("--kv-cache-memory-bytes", kvfence("engine.kvCacheMemory")),
    ("--kv-cache-dtype", ALLOWED),
    ("--num-gpu-blocks-override", kvfence("engine.kvCacheMemory or engine.gpuMemoryUtilization")),
    ("--[no-]enable-prefix-caching", kvfence("prefixCache.enabled")),
    (
        "--prefix-caching-hash-algo",
        kvfence("prefixCache (always sha256: a weaker hash lets tenants forge matches)"),
    ),
    (
        "--prefix-cache-retention-interval",
        refused("it changes how long cached blocks are kept, which the fence's per-tenant eviction decides"),
    ),
    ("--kv-cache-dtype-skip-layers", ALLOWED),
    ("--[no-]kv-sharing-fast-prefill", ALLOWED),
    ("--[no-]swa-bounded-replay", KV_LAYOUT),
    ("--mamba-cache-dtype", ALLOWED),
    ("--mamba-ssm-cache-dtype", ALLOWED),
    ("--mamba-block-size", HASHING),
    ("--prefix-match-unit", HASHING),
    ("--mamba-cache-mode", HASHING),
    ("--[no-]enable-mamba-shared-prefix-checkpoint", HASHING),
    ("--replayssm-buffer-len", ALLOWED),
    ("--[no-]use-replayssm", ALLOWED),
    ("--kv-offloading-size", MOVES_KV),
    ("--kv-offloading-backend", MOVES_KV),
    # OffloadConfig (weights, not KV)
    ("--offload-backend", ALLOWED),
    ("--cpu-offload-gb", ALLOWED),
    ("--cpu-offload-params", ALLOWED),
    ("--offload-group-size", ALLOWED),
    ("--offload-num-in-group", ALLOWED),
    ("--offload-prefetch-step", ALLOWED),
    ("--offload-params", ALLOWED),
    # MultiModalConfig
    ("--[no-]language-model-only", ALLOWED),
    ("--limit-mm-per-prompt", ALLOWED),
    ("--[no-]enable-mm-embeds", TRUSTS_TENANT),
    ("--media-io-kwargs", ALLOWED),
    ("--mm-processor-kwargs", ALLOWED),
    ("--mm-processor-cache-gb", ALLOWED),
    ("--mm-processor-cache-type", ALLOWED),
    ("--mm-hasher-algorithm", HASHING),
    ("--mm-shm-cache-max-object-size-mb", ALLOWED),
    ("--[no-]mm-encoder-only", TASK),
    ("--mm-encoder-tp-mode", ALLOWED),
    ("--mm-encoder-attn-backend", ALLOWED),
    ("--mm-encoder-attn-dtype", ALLOWED),
    ("--mm-encoder-fp8-scale-path", MODEL_FILES),
    ("--mm-encoder-fp8-scale-save-path", WRITES_FILES),
    ("--mm-encoder-fp8-scale-save-margin", ALLOWED),
    ("--[no-]interleave-mm-strings", ALLOWED),
    ("--[no-]skip-mm-profiling", ALLOWED),
    ("--video-pruning-rate", ALLOWED),
    ("--video-pruning-method", ALLOWED),
    ("--mm-tensor-ipc", ALLOWED),
    ("--mm-processor-device", ALLOWED),
    ("--mm-ipc-gpu-memory-gb", ALLOWED),
    ("--[no-]mm-device-do-normalize", ALLOWED),
    # LoRAConfig
    ("--[no-]enable-lora", kvfence("engine.adapters")),
    ("--max-loras", kvfence("engine.adapters")),
    ("--max-lora-rank", ALLOWED),
    ("--lora-dtype", ALLOWED),
    ("--[no-]enable-tower-connector-lora", ALLOWED),
    ("--max-cpu-loras", ALLOWED),
    ("--[no-]fully-sharded-loras", ALLOWED),
    ("--lora-target-modules", ALLOWED),
    ("--default-mm-loras", kvfence("engine.adapters")),
    ("--[no-]specialize-active-lora", ALLOWED),
    ("--[no-]enable-mixed-moe-lora-format", ALLOWED),
    ("--[no-]enable-moe-shared-loras", ALLOWED),
    ("--max-lora-cls-labels", ALLOWED),
    # LoggingConfig (a logging config names handler classes)
    ("--logging-config", LOADS_CODE),
    ("--log-level", ALLOWED),
    ("--log-config-file", LOADS_CODE),
    # ObservabilityConfig
    ("--show-hidden-metrics-for-version", ALLOWED),
    ("--otlp-traces-endpoint", LOGS_TENANTS),
    ("--collect-detailed-traces", LOGS_TENANTS),
    ("--per-request-spec-decode-metrics", ALLOWED),
    ("--[no-]kv-cache-metrics", ALLOWED),
    ("--kv-cache-metrics-sample", ALLOWED),
    ("--custom-histogram-buckets", ALLOWED),
    ("--[no-]cudagraph-metrics", ALLOWED),
    ("--[no-]enable-layerwise-nvtx-tracing", ALLOWED),
    ("--[no-]enable-mfu-metrics", ALLOWED),
    ("--[no-]enable-logging-iteration-details", ALLOWED),
    ("--jit-monitor-mode", ALLOWED),
    ("--[no-]jit-monitor-verbose", ALLOWED),
    # SchedulerConfig
    ("--max-num-batched-tokens", ALLOWED),
    ("--max-num-scheduled-tokens", ALLOWED),
    ("--max-num-seqs", ALLOWED),
    ("--max-num-active-seqs", ALLOWED),
    ("--max-num-queued-reqs", ALLOWED),
    ("--max-num-queued-tokens", ALLOWED),
    ("--long-prefill-token-threshold", ALLOWED),
    ("--[no-]long-prefill-token-threshold-adaptive", ALLOWED),
    ("--scheduling-policy", SCHEDULING),
    ("--[no-]enable-chunked-prefill", ALLOWED),
    ("--[no-]disable-chunked-mm-input", ALLOWED),
    ("--scheduler-cls", kvfence("the TrustClass (the kvfence scheduler keeps the tenants' KV quotas)")),
    ("--[no-]scheduler-reserve-full-isl", SCHEDULING),
    ("--watermark", SCHEDULING),
    ("--prefill-schedule-interval", SCHEDULING),
    ("--[no-]disable-hybrid-kv-cache-manager", KV_MANAGER),
    ("--[no-]async-scheduling", SCHEDULING),
    ("--stream-interval", ALLOWED),
    # CompilationConfig, KernelConfig
    ("--cudagraph-capture-sizes", ALLOWED),
    ("--max-cudagraph-capture-size", ALLOWED),
    ("--ir-op-priority", ALLOWED),
    ("--[no-]enable-flashinfer-autotune", ALLOWED),
    ("--moe-backend", ALLOWED),
    ("--linear-backend", ALLOWED),
    ("--sparse-indexer-topk-backend", ALLOWED),
    # VllmConfig
    ("--speculative-config -sc", SPECULATIVE),
    ("--spec-method", SPECULATIVE),
    ("--spec-model", SPECULATIVE),
    ("--spec-tokens", SPECULATIVE),
    (
        "--watermark-config",
        refused(
            "it puts a secret watermarking key in the TrustClass, where every reader of the class sees it"
        ),
    ),
    ("--diffusion-config -dc", TASK),
    ("--kv-transfer-config", MOVES_KV),
    ("--kv-events-config", MOVES_KV),
    ("--ec-transfer-config", MOVES_KV),
    ("--ec-manager-config", LOADS_CODE),
    (
        "--compilation-config -cc",
        refused("a compilation config names passes and custom ops, code the engine loads"),
    ),
    ("--attention-config -ac", ALLOWED),
    ("--engram-config", ALLOWED),
    ("--reasoning-config", ALLOWED),
    ("--kernel-config", ALLOWED),
    ("--additional-config", refused("it hands arbitrary settings to platform plugins")),
    (
        "--structured-outputs-config",
        refused("a structured-outputs config names a reasoning-parser plugin, code the engine loads"),
    ),
    ("--aux-output-config", ALLOWED),
    ("--profiler-config", ENDPOINTS),
    ("--optimization-level", ALLOWED),
    ("--performance-mode", ALLOWED),
    ("--weight-transfer-config", refused("it lets the model's weights be replaced at run time")),
    # AsyncEngineArgs
    ("--disable-log-stats", ALLOWED),
    ("--aggregate-engine-logging", ALLOWED),
    ("--[no-]fail-on-environ-validation", ALLOWED),
    ("--shutdown-timeout", ALLOWED),
    ("--gdn-prefill-backend", ALLOWED),
    ("--kda-prefill-backend", ALLOWED),
    ("--kda-decode-backend", ALLOWED),
    ("--[no-]enable-log-requests", LOGS_TENANTS),
]


def _expand(rows: list[tuple[str, Verdict]]) -> dict[str, Verdict]:
    """One entry per option string (see :data:`_VLLM_SERVE`)."""
    out: dict[str, Verdict] = {}
    for spellings, verdict in rows:
        words = spellings.split()
        for w in words:
            if w.startswith("--"):
                for name in (w.replace("[no-]", ""), w.replace("[no-]", "no-")) if "[no-]" in w else (w,):
                    out[name] = verdict
            else:
                long = next(x for x in words if x.startswith("--")).replace("[no-]", "")
                out[w] = (
                    refused(f"a short form of {long}: spell out the long flag")
                    if verdict.allowed
                    else verdict
                )
    return out


#: Every option of ``vllm serve`` (the pinned vLLM), classified.
VLLM_SERVE_FLAGS: dict[str, Verdict] = _expand(_VLLM_SERVE)

#: The programs whose flags each runtime's table classifies (for messages).
PROGRAMS: dict[Runtime, str] = {"vllm": "vllm serve", "reference": "kvfence-engine"}
TABLES: dict[Runtime, Mapping[str, Verdict]] = {"vllm": VLLM_SERVE_FLAGS, "reference": REFERENCE_FLAGS}
#: The longest argument ``engine.extraArgs`` admits (bounds the cost of the CRD's rules).
MAX_EXTRA_ARG_LENGTH = 512
NEGATIVE_INT = re.compile(r"-[0-9]+")


def allowed_flags(runtime: Runtime) -> frozenset[str]:
    return frozenset(f for f, v in TABLES[runtime].items() if v.allowed)


def any_allowed() -> frozenset[str]:
    """The flags some runtime allows: what the CRD's rule on one argument admits."""
    return allowed_flags("vllm") | allowed_flags("reference")


def flag_name(arg: str) -> str | None:
    """The flag an argument names, as the check reads it, or ``None`` for a value."""
    if not arg.startswith("-") or NEGATIVE_INT.fullmatch(arg):
        return None
    return arg.replace("_", "-").split("=")[0].split(".")[0]


def reason(name: str) -> str:
    """Why the flag ``name`` is refused (assuming no runtime allows it)."""
    for table in TABLES.values():
        v = table.get(name)
        if v is not None and not v.allowed:
            return v.why
    return NOT_LISTED


def _other(runtime: Runtime) -> Runtime:
    return "reference" if runtime == "vllm" else "vllm"


def runtime_reason(runtime: Runtime) -> str:
    """Why a flag that only the other runtime allows is refused on ``runtime``."""
    other = _other(runtime)
    return f"a flag of the {other} runtime only ({PROGRAMS[other]}), which {PROGRAMS[runtime]} does not take"


def item_refusals(args: list[str]) -> list[str]:
    """Why each argument no runtime allows is refused, in order (the CRD's rule on each argument)."""
    everywhere = any_allowed()
    out = []
    for a in args:
        name = flag_name(a)
        if name is not None and name not in everywhere:
            out.append(f"engine.extraArgs: {a} refused: {reason(name)}")
    return out


def runtime_refusals(args: list[str], runtime: Runtime) -> list[str]:
    """Why each argument only the other runtime allows is refused on ``runtime``, in order (the CRD's
    rule on the engine names the first)."""
    foreign = any_allowed() - allowed_flags(runtime)
    why = runtime_reason(runtime)
    return [f"engine.extraArgs: {a} refused: {why}" for a in args if flag_name(a) in foreign]


def extra_args_refusals(args: list[str], runtime: Runtime) -> list[str]:
    """Why each refused argument of ``args`` is refused on ``runtime``."""
    return item_refusals(args) + runtime_refusals(args, runtime)


def extra_args_refusal(args: list[str], runtime: Runtime) -> str | None:
    """Why ``args`` cannot be passed to the engine of ``runtime``, or ``None``."""
    refusals = extra_args_refusals(args, runtime)
    return "; ".join(refusals) if refusals else None


# --- the CRD's rules, from the same tables -----------------------------------------------------------
def _cel_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _cel_list(items: list[str]) -> str:
    return "[" + ", ".join(_cel_string(s) for s in items) + "]"


def _cel_name(var: str) -> str:
    """CEL of :func:`flag_name`'s flag of the string ``var`` (which starts with ``-``)."""
    return f"{var}.replace('_', '-').split('=')[0].split('.')[0]"


def _cel_is_value(var: str) -> str:
    return f"(!{var}.startsWith('-') || {var}.matches('^-[0-9]+$'))"


def _cel_reason(var: str) -> str:
    """CEL of :func:`reason` of the flag ``var`` names: the distinct reasons are listed once, and a map
    gives each refused flag's index."""
    texts: list[str] = []
    index: dict[str, int] = {}
    for runtime in TABLES:
        for flag, v in TABLES[runtime].items():
            if v.allowed or flag in index or flag in any_allowed():
                continue
            if v.why not in texts:
                texts.append(v.why)
            index[flag] = texts.index(v.why)
    texts.append(NOT_LISTED)
    mapping = "{" + ", ".join(f"{_cel_string(f)}: {i}" for f, i in sorted(index.items())) + "}"
    name = _cel_name(var)
    return f"{_cel_list(texts)}[{name} in {mapping} ? {mapping}[{name}] : {len(texts) - 1}]"


def extra_arg_item_rule() -> dict[str, JsonValue]:
    """The CRD's rule on one argument (``self``): a value, or a flag some runtime allows."""
    return {
        "rule": f"{_cel_is_value('self')} || {_cel_name('self')} in {_cel_list(sorted(any_allowed()))}",
        "messageExpression": f"'engine.extraArgs: ' + self + ' refused: ' + {_cel_reason('self')}",
        "reason": "FieldValueForbidden",
    }


def extra_args_runtime_rules() -> list[JsonValue]:
    """The CRD's rules on the engine (``self``): no flag only the other runtime allows."""
    out: list[JsonValue] = []
    for runtime in TABLES:
        foreign = sorted(any_allowed() - allowed_flags(runtime))
        if not foreign:
            continue
        bad = f"!{_cel_is_value('a')} && {_cel_name('a')} in {_cel_list(foreign)}"
        out.append(
            {
                "rule": f"self.runtime != '{runtime}' || !has(self.extraArgs) "
                f"|| !self.extraArgs.exists(a, {bad})",
                "messageExpression": f"'engine.extraArgs: ' + self.extraArgs.filter(a, {bad})[0] + "
                f"' refused: ' + {_cel_string(runtime_reason(runtime))}",
                "fieldPath": ".extraArgs",
                "reason": "FieldValueForbidden",
            }
        )
    return out
