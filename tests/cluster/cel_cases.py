"""Specs the API server refuses, shared by both checks of each rule: the CRD's (CEL and schema) on a real
API server in tests/operator/test_operator_crds.py, and the pydantic model's in
tests/operator/test_cel_parity.py, which also requires every CEL rule of the generated CRDs to be
tripped by one of these cases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cluster.manifests import ENGINE, POD_EXTRAS_CASES, VLLM_ENGINE, tenant_binding, trust_class

VLLM_CPU = {"runtime": "vllm", "device": "CPU", "image": "x", "model": {"name": "m"}}
CASE_NAME = "crd-bad"
CASE_NAMESPACE = "crd-tb"
#: Why the model accepts a case: the CRD's rule is the only check of it.
CEL_ONLY = "the model does not re-state this rule: the API server is its only check"
#: Why the model accepts a case: it reads what an earlier CRD stored there as unset, so that stored
#: objects stay readable (tests/operator/test_api.py).
READS_AS_UNSET = "the model reads the field, as an earlier CRD stored it, as unset"


@dataclass(frozen=True)
class Case:
    """A spec of ``kind`` that is refused, the field the API server names and words of its message.
    ``spec`` overrides the top-level fields of :func:`trust_class` / :func:`tenant_binding`."""

    kind: Literal["TrustClass", "TenantBinding"]
    spec: dict[str, Any]
    field: str
    words: str
    model_accepts: str = ""
    """Non-empty where the pydantic model accepts the spec: it says why."""

    def manifest(self) -> dict[str, Any]:
        if self.kind == "TrustClass":
            return trust_class(CASE_NAME, **self.spec)
        return tenant_binding(CASE_NAME, CASE_NAMESPACE, **self.spec)

    def id(self) -> str:
        return f"{self.kind}:{self.field}:{self.words[:40]}"


def _tc(spec: dict[str, Any], field_: str, words: str, accepts: str = "") -> Case:
    return Case("TrustClass", spec, field_, words, accepts)


def _tb(spec: dict[str, Any], field_: str, words: str, accepts: str = "") -> Case:
    return Case("TenantBinding", spec, field_, words, accepts)


def _quota_pair(name: str, default: int, limit: int) -> Case:
    return _tc(
        {"quotas": {"defaults": {name: default}, "limits": {name: limit}}},
        f"spec.quotas.defaults.{name}",
        f"defaults.{name} must not exceed limits.{name}",
        CEL_ONLY,
    )


def _prefixes(*prefixes: dict[str, Any], **cache: Any) -> dict[str, Any]:
    return {"prefixCache": {**cache, "sharedPrefixes": list(prefixes)}}


_QUOTAS = [
    _tc(
        {"quotas": {"defaults": {"maxKVBlocks": 10, "guaranteedKVBlocks": 20}}},
        "spec.quotas.defaults.guaranteedKVBlocks",
        "must not exceed maxKVBlocks",
        CEL_ONLY,
    ),
    _tc(
        {"quotas": {"limits": {"maxKVBlocks": 10, "guaranteedKVBlocks": 20}}},
        "spec.quotas.limits.guaranteedKVBlocks",
        "guaranteedKVBlocks must not exceed maxKVBlocks",
        CEL_ONLY,
    ),
    _quota_pair("requestsPerMinute", 100, 10),
    _quota_pair("tokensPerMinute", 100, 10),
    _quota_pair("maxConcurrentRequests", 10, 5),
    _quota_pair("maxKVBlocks", 100, 50),
    _quota_pair("guaranteedKVBlocks", 10, 5),
    _quota_pair("weight", 5, 4),
    _tc({"quotas": {"limits": {"weight": 1001}}}, "spec.quotas.limits.weight", "less than or equal to 1000"),
    _tc(
        {"quotas": {"limits": {"maxKVBlocks": 1025}}},
        "spec.quotas.limits.maxKVBlocks",
        "must not exceed engine.numBlocks (1024 when unset)",
        CEL_ONLY,
    ),
    _tc(
        {
            "engine": {"image": "x", "model": {"name": "m"}, "numBlocks": 512},
            "quotas": {"limits": {"maxKVBlocks": 513}},
        },
        "spec.quotas.limits.maxKVBlocks",
        "must not exceed engine.numBlocks",
        CEL_ONLY,
    ),
]

_ENGINE = [
    _tc(
        {"prefixCache": {"hashAlgorithm": "xxhash"}},
        "spec.prefixCache.hashAlgorithm",
        'Unsupported value: "xxhash"',
    ),
    _tc(
        {
            "engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}},
            "prefixCache": {"hashAlgorithm": "blake2b"},
        },
        "spec.prefixCache.hashAlgorithm",
        "only the sha256",
        CEL_ONLY,
    ),
    _tc(
        {
            "engine": {"image": "x", "model": {"name": "m"}, "tensorParallelSize": 4},
            "resources": {"gpu": {"count": 2}},
        },
        "spec.engine.tensorParallelSize",
        "must not exceed resources.gpu.count",
        CEL_ONLY,
    ),
    _tc(
        {"resources": {"gpu": {"resourceName": "not a resource"}}},
        "spec.resources.gpu.resourceName",
        "should match",
    ),
    _tc({"resources": {"memory": "lots"}}, "spec.resources.memory", "should match", CEL_ONLY),
    _tc(
        {"engine": {"image": "x", "model": {"name": "m"}, "runtime": "sglang"}},
        "spec.engine.runtime",
        "Unsupported value",
    ),
    _tc({"engine": {"image": "x"}}, "spec.engine.model", "Required value"),
    _tc({"replicas": -1}, "spec.replicas", "should be greater than or equal to 0"),
    _tc(
        {"replicasManagedExternally": True, "replicas": 2},
        "spec.replicas",
        "spec.replicas must be unset with replicasManagedExternally",
    ),
    _tc(
        {"engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}, "gpuMemoryUtilization": 0}},
        "spec.engine.gpuMemoryUtilization",
        "greater than 0",
    ),
    _tc(
        {"engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}, "numBlocks": 4096}},
        "spec.engine.numBlocks",
        "Forbidden: engine.numBlocks applies to the reference runtime only: vLLM sizes its KV pool",
    ),
    _tc(
        # the value an earlier CRD defaulted is no exception for a new write
        {"engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}, "numBlocks": 1024}},
        "spec.engine.numBlocks",
        "applies to the reference runtime only",
        READS_AS_UNSET,
    ),
    _tc(
        {"engine": {"image": "x", "model": {"name": "m"}, "gpuMemoryUtilization": 0.5}},
        "spec.engine.gpuMemoryUtilization",
        "Forbidden: engine.gpuMemoryUtilization applies to the vllm runtime only: the reference engine",
    ),
    _tc(
        {
            "engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}},
            "resources": {"gpu": {"count": 0}},
        },
        "spec.resources.gpu.count",
        "the vllm runtime needs at least one GPU (resources.gpu.count), unless engine.device is CPU",
        CEL_ONLY,
    ),
    _tc(
        {"engine": {**VLLM_CPU, "kvCacheMemory": "1Gi"}},  # gpu.count defaults to 1
        "spec.resources.gpu.count",
        "engine.device CPU requests no GPU: resources.gpu.count must be 0",
    ),
    _tc(
        {"engine": VLLM_CPU, "resources": {"gpu": {"count": 0}}},
        "spec.engine.kvCacheMemory",
        "Required value: engine.kvCacheMemory is required with engine.device CPU",
    ),
    _tc(
        {
            "engine": {**VLLM_CPU, "kvCacheMemory": "1Gi", "gpuMemoryUtilization": 0.5},
            "resources": {"gpu": {"count": 0}},
        },
        "spec.engine.kvCacheMemory",
        "not both",
    ),
    _tc(
        {"engine": {**VLLM_CPU, "kvCacheMemory": "1.5Gi"}, "resources": {"gpu": {"count": 0}}},
        "spec.engine.kvCacheMemory",
        "should match",
    ),
    _tc(
        {"engine": {"image": "x", "model": {"name": "m"}, "device": "GPU"}},
        "spec.engine.device",
        "Forbidden: engine.device GPU applies to the vllm runtime only",
    ),
    _tc(
        {"engine": {"image": "x", "model": {"name": "m"}, "kvCacheMemory": "1Gi"}},
        "spec.engine.kvCacheMemory",
        "Forbidden: engine.kvCacheMemory applies to the vllm runtime only",
    ),
    _tc(
        {"engine": {**ENGINE, "rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}},
        "spec.engine.rollout",
        "maxSurge and maxUnavailable cannot both be 0",
    ),
    _tc(
        {"engine": {**ENGINE, "rollout": {"maxSurge": "150%"}}},
        "spec.engine.rollout.maxSurge",
        "should match",
    ),
    _tc(
        {"engine": {**VLLM_ENGINE, "extraEnv": [{"name": "TZ", "valueFrom": {}}]}},
        "spec.engine.extraEnv[0].valueFrom",
        "valueFrom: set exactly one of secretKeyRef and configMapKeyRef",
    ),
    _tc(
        {
            "engine": {
                **VLLM_ENGINE,
                "runtime": "reference",
                "adapters": [{"name": "a", "source": "/adapters/a"}],
            }
        },
        "spec.engine.adapters",
        "Forbidden: engine.adapters[].source applies to the vllm runtime only",
        READS_AS_UNSET,
    ),
]

_PREFIX_CACHE = [
    _tc({"prefixCache": {"scope": "Global"}}, "spec.prefixCache.scope", 'Unsupported value: "Global"'),
    _tc(
        _prefixes(
            {"name": "sys", "form": "chat", "text": "a"}, {"name": "sys", "form": "completion", "text": "b"}
        ),
        "spec.prefixCache.sharedPrefixes",
        "sharedPrefixes names must be unique",
    ),
    _tc(
        _prefixes({"name": "sys", "form": "chat"}),
        "spec.prefixCache.sharedPrefixes[0]",
        "set exactly one of text and configMapKeyRef",
    ),
    _tc(
        _prefixes({"name": "sys", "form": "chat", "text": "a", "configMapKeyRef": {"name": "p", "key": "k"}}),
        "spec.prefixCache.sharedPrefixes[0]",
        "set exactly one of text and configMapKeyRef",
    ),
    _tc(
        _prefixes({"name": "sys", "form": "system", "text": "a"}),
        "spec.prefixCache.sharedPrefixes[0].form",
        'Unsupported value: "system"',
    ),
    _tc(
        _prefixes({"name": "sys", "form": "chat", "text": "a"}, enabled=False),
        "spec.prefixCache.sharedPrefixes",
        "needs the prefix cache",
    ),
]

TRUST_CLASS_CASES = _QUOTAS + _ENGINE + _PREFIX_CACHE

TENANT_BINDING_CASES = [
    _tb({"tenantId": "Not_Valid!"}, "spec.tenantId", "should match"),
    _tb(
        {"quotas": {"maxKVBlocks": 1, "guaranteedKVBlocks": 5}},
        "spec.quotas.guaranteedKVBlocks",
        "guaranteedKVBlocks must not exceed maxKVBlocks",
        CEL_ONLY,
    ),
    _tb({"apiKeySecretRef": {}}, "spec.apiKeySecretRef.name", "Required value"),
    _tb({"quotas": {"requestsPerMinute": 0}}, "spec.quotas.requestsPerMinute", "greater than or equal to 1"),
    _tb({"quotas": {"weight": 0}}, "spec.quotas.weight", "greater than or equal to 1"),
]

#: The refused engines of POD_EXTRAS_CASES (tested on both sides by their own tests), as cases.
POD_EXTRAS_REFUSALS = [
    _tc({"engine": {**VLLM_ENGINE, **engine}}, field_, words)
    for engine, field_, words in POD_EXTRAS_CASES
    if field_ is not None and words is not None
]

#: Every case, for the model's check and the coverage of the CRDs' CEL rules.
ALL_CASES = TRUST_CLASS_CASES + TENANT_BINDING_CASES + POD_EXTRAS_REFUSALS
