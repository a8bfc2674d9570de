"""The kvfence objects the cluster suites create, and how they read what the operator reports.

(A home shared by the operator suites: a helper module under tests/operator/ could not be imported as
``operator.…`` without shadowing the standard library's ``operator``.)
"""

from __future__ import annotations

from typing import Any

from kvfence.contract.routing import hash_api_key
from kvfence.operator import rbac

API_VERSION = "kvfence.dev/v1alpha1"
ENGINE = {"image": "kvfence/engine:dev", "model": {"name": "kvfence/tiny"}}
#: A TrustClass whose engine needs no GPU and admits bindings from any namespace.
CPU_ANY_NAMESPACE: dict[str, Any] = {"resources": {"gpu": {"count": 0}}, "namespaceSelector": {}}

#: (extraArgs, the arguments refused on the vllm runtime): what the model (tests/operator/test_api.py) and
#: the CRD's CEL rules on the API server (tests/operator/test_operator_crds.py) must agree on.
EXTRA_ARGS_CASES: list[tuple[list[str], list[str]]] = [
    (["--max-num-seqs", "8", "--enforce-eager"], []),
    (["--max_num_seqs=8", "--max-num-batched-tokens", "2k", "--kv-cache-dtype", "fp8"], []),
    (["--seed", "-1", "--log-level=DEBUG", "--reasoning-parser", "qwen3"], []),
    (["--prefix-caching-hash-algo", "xxhash"], ["--prefix-caching-hash-algo"]),
    (["--prefix_caching_hash_algo=sha256_cbor"], ["--prefix_caching_hash_algo=sha256_cbor"]),
    (["--kv-transfer-config.kv_connector", "X"], ["--kv-transfer-config.kv_connector"]),
    (["--max-num", "8", "--enforce-eage"], ["--max-num", "--enforce-eage"]),  # abbreviations
    (["--enable-prompt-embeds", "--trust-request-chat-template"],
     ["--enable-prompt-embeds", "--trust-request-chat-template"]),
    (["--scheduling-policy", "priority", "--data-parallel-size", "2", "--api-server-count=2"],
     ["--scheduling-policy", "--data-parallel-size", "--api-server-count=2"]),
    (["-dp", "2", "-tp", "2", "-ep", "-O3", "-O", "3"], ["-dp", "-tp", "-ep", "-O3", "-O"]),  # short forms
    (["--seed", "-1.5"], ["-1.5"]),  # vLLM reads "-1.5" as a dotted flag, not a number
    (["--enforce-eager", "--middleware", "m.M", "--scheduler-cls=x.Y"],
     ["--middleware", "--scheduler-cls=x.Y"]),
    (["--config", "/tmp/x.yaml", "--help"], ["--config", "--help"]),
    (["--", "-x", "-"], ["--", "-x", "-"]),
    (["--signing-key-dir", "/x", "--port-file", "/tmp/p"], ["--signing-key-dir", "--port-file"]),
    (["--enable-log-requests", "--allowed-local-media-path", "/"],
     ["--enable-log-requests", "--allowed-local-media-path"]),
    (["--middlewarex", "--kv-offloading-backend", "lmcache"], ["--middlewarex", "--kv-offloading-backend"]),
]  # fmt: skip

#: A vLLM engine on GPU (the runtime that downloads weights and loads adapters).
VLLM_ENGINE: dict[str, Any] = {"runtime": "vllm", "image": "x", "model": {"name": "org/m"}}
ADAPTER_VOLUME: dict[str, Any] = {
    "extraVolumes": [{"name": "loras", "persistentVolumeClaim": {"claimName": "loras"}}],
    "extraVolumeMounts": [{"name": "loras", "mountPath": "/adapters"}],
}

#: (engine fields over :data:`VLLM_ENGINE`, the field the API server names, words both the model
#: (tests/operator/test_api.py) and the CRD (tests/operator/test_operator_crds.py) say; None: accepted).
POD_EXTRAS_CASES: list[tuple[dict[str, Any], str | None, str | None]] = [
    (
        {
            "model": {"name": "org/gated", "tokenSecretRef": {"name": "hf"}},
            "modelCache": {"volumeClaim": {"size": "100Gi", "storageClassName": "fast"}},
            "imagePullSecrets": [{"name": "registry"}],
            "extraEnv": [
                {"name": "HF_HUB_OFFLINE", "value": "1"},
                {"name": "OMP_NUM_THREADS", "valueFrom": {"configMapKeyRef": {"name": "tune", "key": "omp"}}},
            ],
            "adapters": [
                {"name": "support-bot", "source": "/adapters/support-bot"},
                {"name": "cached", "source": "/cache/loras/cached"},
                {"name": "hub", "source": "org/lora"},
            ],
            **ADAPTER_VOLUME,
        },
        None,
        None,
    ),
    ({"modelCache": {"existingClaim": {"name": "weights"}}}, None, None),
    (
        {"modelCache": {"existingClaim": {"name": "w"}, "volumeClaim": {"size": "1Gi"}}},
        "spec.engine.modelCache",
        "set exactly one of existingClaim and volumeClaim",
    ),
    ({"modelCache": {}}, "spec.engine.modelCache", "set exactly one of existingClaim and volumeClaim"),
    ({"modelCache": {"volumeClaim": {}}}, "spec.engine.modelCache.volumeClaim.size", "Required value"),
    (
        {"modelCache": {"volumeClaim": {"size": "1Gi", "accessModes": ["ReadOnlyMany"]}}},
        "spec.engine.modelCache.volumeClaim.accessModes[0]",
        "ReadOnlyMany",
    ),
    (
        {"modelCache": {"volumeClaim": {"size": "1Gi", "retentionPolicy": {"whenDeleted": "Orphan"}}}},
        "spec.engine.modelCache.volumeClaim.retentionPolicy.whenDeleted",
        "Orphan",
    ),
    (
        {"extraEnv": [{"name": "VLLM_PLUGINS", "value": "evil"}]},
        "spec.engine.extraEnv[0].name",
        "engine.extraEnv: VLLM_PLUGINS refused: vLLM's switches load plugins",
    ),
    (
        {"extraEnv": [{"name": "CUSTOM_PRE_PROCESS", "value": "m:f"}]},
        "spec.engine.extraEnv[0].name",
        "engine.extraEnv: CUSTOM_PRE_PROCESS refused: vLLM's API server reads these",
    ),
    (
        {"extraEnv": [{"name": "CUSTOM_FASTAPI_MIDDLEWARE_THROTTLE", "value": "m:f"}]},
        "spec.engine.extraEnv[0].name",
        "CUSTOM_FASTAPI_MIDDLEWARE_THROTTLE refused",
    ),
    (
        {"extraEnv": [{"name": "OMP_TOOL_LIBRARIES", "value": "/x.so"}]},
        "spec.engine.extraEnv[0].name",
        "engine.extraEnv: OMP_TOOL_LIBRARIES refused: not on the allowlist of engine.extraEnv",
    ),
    (
        {"extraEnv": [{"name": "TZ", "value": "UTC"}, {"name": "LD_PRELOAD", "value": "/x.so"}]},
        "spec.engine.extraEnv[1].name",
        "engine.extraEnv: LD_PRELOAD refused",
    ),
    ({"extraEnv": [{"name": "PYTHONPATH", "value": "/x"}]}, "spec.engine.extraEnv[0].name", "PYTHONPATH"),
    ({"extraEnv": [{"name": "HF_TOKEN", "value": "hf_x"}]}, "spec.engine.extraEnv[0].name", "HF_TOKEN"),
    (
        {"extraEnv": [{"name": "KVFENCE_ENGINE_CONFIG", "value": "/x"}]},
        "spec.engine.extraEnv[0].name",
        "KVFENCE_ENGINE_CONFIG refused",
    ),
    (
        {"extraEnv": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
        "spec.engine.extraEnv[0].name",
        "NVIDIA_VISIBLE_DEVICES refused",
    ),
    ({"extraEnv": [{"name": "A-B", "value": "1"}]}, "spec.engine.extraEnv[0].name", "should match"),
    ({"extraEnv": [{"name": "TZ"}]}, "spec.engine.extraEnv[0]", "TZ: set exactly one of value and valueFrom"),
    (
        {"extraVolumes": [{"name": "host", "emptyDir": {}, "secret": {"secretName": "s"}}]},
        "spec.engine.extraVolumes[0]",
        "engine.extraVolumes[host]: set exactly one of configMap, secret, persistentVolumeClaim and emptyDir",
    ),
    (
        {"extraVolumes": [{"name": "tmp", "emptyDir": {}}]},
        "spec.engine.extraVolumes[0].name",
        "engine.extraVolumes: tmp is a volume kvfence mounts itself",
    ),
    (
        {
            "extraVolumes": [{"name": "x", "emptyDir": {}}],
            "extraVolumeMounts": [{"name": "y", "mountPath": "/data"}],
        },
        "spec.engine.extraVolumeMounts",
        "every mount must name a volume of engine.extraVolumes",
    ),
    (
        {
            "extraVolumes": [{"name": "x", "emptyDir": {}}],
            "extraVolumeMounts": [{"name": "x", "mountPath": "/etc/kvfence/keys"}],
        },
        "spec.engine.extraVolumeMounts[0].mountPath",
        "should match",
    ),
    (
        {
            "extraVolumes": [{"name": "x", "emptyDir": {}}],
            "extraVolumeMounts": [{"name": "x", "mountPath": "/data/../etc"}],
        },
        "spec.engine.extraVolumeMounts[0].mountPath",
        "should match",
    ),
    (
        {"adapters": [{"name": "support-bot", "source": "/adapters/support-bot"}]},
        "spec.engine.adapters",
        "an absolute path must lie under a mountPath of engine.extraVolumeMounts",
    ),
    (
        {"adapters": [{"name": "c", "source": "/cache/loras/c"}]},
        "spec.engine.adapters",
        "an absolute path must lie under a mountPath",
    ),
    (
        {"adapters": [{"name": "a", "source": "/adaptersX/a"}], **ADAPTER_VOLUME},
        "spec.engine.adapters",
        "an absolute path must lie under a mountPath",
    ),
    (
        {"runtime": "reference", "modelCache": {"existingClaim": {"name": "w"}}},
        "spec.engine.modelCache",
        "engine.modelCache applies to the vllm runtime only",
    ),
    (
        {"runtime": "reference", "model": {"name": "m", "tokenSecretRef": {"name": "hf"}}},
        "spec.engine.model.tokenSecretRef",
        "engine.model.tokenSecretRef applies to the vllm runtime only",
    ),
    (
        {"adapters": [{"name": "hub", "source": "org/lora"}, {"name": "nowhere"}]},
        "spec.engine.adapters",
        "engine.adapters[].source is required on the vllm runtime",
    ),
    ({"runtime": "reference", "adapters": [{"name": "seeded"}]}, None, None),
]


def trust_class(name: str, **spec: Any) -> dict[str, Any]:
    """A TrustClass with the dev engine; ``spec`` overrides or adds top-level spec fields."""
    return {
        "apiVersion": API_VERSION,
        "kind": "TrustClass",
        "metadata": {"name": name},
        "spec": {"engine": ENGINE, **spec},
    }


def tenant_binding(
    name: str, ns: str, tenant: str | None = None, trust_class: str = "gold", **spec: Any
) -> dict[str, Any]:
    """A TenantBinding whose API keys are in the Secret ``<name>-keys``."""
    base = {
        "tenantId": tenant or name,
        "trustClassName": trust_class,
        "apiKeySecretRef": {"name": f"{name}-keys"},
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "TenantBinding",
        "metadata": {"name": name, "namespace": ns},
        "spec": {**base, **spec},
    }


def secret(name: str, ns: str, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": ns},
        "stringData": data,
    }


def keys_secret(binding: str, ns: str, *keys: str) -> dict[str, Any]:
    """The API-key Secret of :func:`tenant_binding` ``binding``: one data key per API key."""
    return secret(f"{binding}-keys", ns, **{f"k{i}": k for i, k in enumerate(keys)})


def tenant_namespace(name: str, *, grant: bool, label: str | None = None) -> list[dict[str, Any]]:
    """A tenant namespace, optionally labelled ``kvfence.dev/tenants=<label>``, and with ``grant`` the
    RoleBinding that lets the operator read (and watch) its API-key Secrets."""
    ns: dict[str, Any] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    if label:
        ns["metadata"]["labels"] = {"kvfence.dev/tenants": label}
    return [ns, *([rbac.tenant_secrets_binding(name, "kvfence-system")] if grant else [])]


sha = hash_api_key


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions", []):
        if c["type"] == ctype:
            return dict(c)
    return {}


def ready(kv: Any, name: str) -> bool:
    """TrustClass ``name`` is Ready for its current generation."""
    obj = kv.json("get", "trustclass", name)
    c = condition(obj, "Ready")
    return bool(
        obj and c.get("status") == "True" and c.get("observedGeneration") == obj["metadata"]["generation"]
    )
