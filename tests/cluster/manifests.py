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

#: (extraArgs, the arguments refused): what the model (tests/operator/test_api.py) and the CRD's CEL rule
#: on the API server (tests/operator/test_operator_crds.py) must agree on.
EXTRA_ARGS_CASES: list[tuple[list[str], list[str]]] = [
    (["--max-num-seqs", "8", "--enforce-eager"], []),
    (["--prefix-caching-hash-algo", "xxhash"], ["--prefix-caching-hash-algo"]),
    (["--prefix_caching_hash_algo=sha256_cbor"], ["--prefix_caching_hash_algo=sha256_cbor"]),
    (["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1"}'], ["--kv-transfer-config"]),
    (["--kv-transfer-config.kv_connector", "X"], ["--kv-transfer-config.kv_connector"]),
    (["--kv-transfer-conf", "{}"], ["--kv-transfer-conf"]),  # argparse's abbreviation
    (["--enforce-eager", "--middleware", "m.M"], ["--middleware"]),
    (["--scheduler-cls=x.Y"], ["--scheduler-cls=x.Y"]),
    (["--no-enable-prefix-caching"], ["--no-enable-prefix-caching"]),
    (["--kv-events-config", "{}", "--worker-cls", "a.B"], ["--kv-events-config", "--worker-cls"]),
    (["--config", "/tmp/x.yaml"], ["--config"]),
    (["--signing-key-dir", "/x"], ["--signing-key-dir"]),
    (["--log-level=DEBUG", "--conf=/x"], ["--conf=/x"]),
    (["--middlewarex", "--kv-cache-dtype", "fp8", "--", "-x"], []),
]  # fmt: skip


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
