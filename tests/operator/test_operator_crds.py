"""The generated CRDs on the real API server: they install, `kubectl explain` reads them, and bad
manifests are rejected with messages that name the field."""

from __future__ import annotations

from typing import Any

import pytest
from cluster.manifests import tenant_binding, trust_class

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (
            {"prefixCache": {"hashAlgorithm": "xxhash"}},
            "spec.prefixCache.hashAlgorithm",
            'Unsupported value: "xxhash"',
        ),
        (
            {
                "engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}},
                "prefixCache": {"hashAlgorithm": "blake2b"},
            },
            "spec.prefixCache.hashAlgorithm",
            "only the sha256",
        ),
        (
            {
                "engine": {"image": "x", "model": {"name": "m"}, "tensorParallelSize": 4},
                "resources": {"gpu": {"count": 2}},
            },
            "spec.engine.tensorParallelSize",
            "must not exceed resources.gpu.count",
        ),
        (
            {"quotas": {"defaults": {"maxKVBlocks": 10, "guaranteedKVBlocks": 20}}},
            "spec.quotas.defaults.guaranteedKVBlocks",
            "must not exceed maxKVBlocks",
        ),
        (
            {"quotas": {"defaults": {"requestsPerMinute": 100}, "limits": {"requestsPerMinute": 10}}},
            "spec.quotas.defaults.requestsPerMinute",
            "must not exceed limits.requestsPerMinute",
        ),
        (
            {"resources": {"gpu": {"resourceName": "not a resource"}}},
            "spec.resources.gpu.resourceName",
            "should match",
        ),
        ({"resources": {"memory": "lots"}}, "spec.resources.memory", "should match"),
        (
            {"engine": {"image": "x", "model": {"name": "m"}, "runtime": "sglang"}},
            "spec.engine.runtime",
            "Unsupported value",
        ),
        ({"engine": {"image": "x"}}, "spec.engine.model", "Required value"),
        ({"prefixCache": {"scope": "Global"}}, "spec.prefixCache.scope", 'Unsupported value: "Global"'),
        ({"replicas": -1}, "spec.replicas", "should be greater than or equal to 0"),
        (
            {"engine": {"image": "x", "model": {"name": "m"}, "gpuMemoryUtilization": 0}},
            "spec.engine.gpuMemoryUtilization",
            "greater than 0",
        ),
    ],
)
def test_bad_trustclass_is_rejected_with_the_field_named(
    installed: Any, kv: Any, spec: Any, field: str, words: str
) -> None:
    res = kv.apply(trust_class("crd-bad", **spec))
    assert res.returncode != 0, f"accepted: {spec}"
    assert field in res.stderr and words in res.stderr, res.stderr
    assert kv.json("get", "trustclass", "crd-bad") is None


def test_trustclass_name_length_and_immutable_namespace(installed: Any, kv: Any) -> None:
    res = kv.apply(trust_class("x" * 60))
    assert res.returncode != 0 and "metadata.name must be at most 59 characters" in res.stderr
    try:
        ok = kv.apply(trust_class("crd-immutable", namespace="crd-immutable-engines", replicas=0))
        assert ok.returncode == 0, ok.stderr
        moved = kv.apply(trust_class("crd-immutable", namespace="elsewhere", replicas=0))
        assert moved.returncode != 0 and "namespace is immutable" in moved.stderr
        got = kv.json("get", "trustclass", "crd-immutable")
        # defaults are applied by the API server, from the schema
        assert got["spec"]["prefixCache"] == {"enabled": True, "scope": "Tenant", "hashAlgorithm": "sha256"}
        assert got["spec"]["resources"]["gpu"] == {"count": 1, "resourceName": "nvidia.com/gpu"}
        assert got["spec"]["engine"]["runtime"] == "reference"
    finally:
        kv("delete", "trustclass", "crd-immutable", "--ignore-not-found", "--wait=false")


def test_bad_tenantbinding_is_rejected_with_the_field_named(installed: Any, kv: Any) -> None:
    kv("create", "namespace", "crd-tb")
    try:
        bad = [
            (tenant_binding("a", "crd-tb", tenantId="Not_Valid!"), "spec.tenantId"),
            (
                tenant_binding("b", "crd-tb", quotas={"maxKVBlocks": 1, "guaranteedKVBlocks": 5}),
                "spec.quotas.guaranteedKVBlocks",
            ),
            (tenant_binding("c", "crd-tb", apiKeySecretRef={}), "spec.apiKeySecretRef.name"),
            (tenant_binding("d", "crd-tb", quotas={"requestsPerMinute": 0}), "spec.quotas.requestsPerMinute"),
        ]
        for obj, field in bad:
            res = kv.apply(obj)
            assert res.returncode != 0 and field in res.stderr, res.stderr
        ok = kv.apply(tenant_binding("e", "crd-tb"))
        assert ok.returncode == 0, ok.stderr
        renamed = kv.apply(tenant_binding("e", "crd-tb", tenantId="other"))
        assert renamed.returncode != 0 and "tenantId is immutable" in renamed.stderr
    finally:
        kv("delete", "namespace", "crd-tb", "--wait=false")


def test_kubectl_explain_and_columns(installed: Any, kv: Any) -> None:
    out = kv("explain", "trustclass.spec.placement.dedicatedNodes").stdout
    assert "anti-affinity" in out and "tolerateTaint" in out
    out = kv("explain", "tenantbinding.spec.apiKeySecretRef").stdout
    assert "SHA-256" in out
    names = kv("api-resources", "--api-group=kvfence.dev", "-o", "wide").stdout
    assert "tc" in names and "tb" in names and "kvfence" in names
    header = kv("get", "tc").stdout.splitlines()
    assert not header or header[0].split()[:3] == ["NAME", "RUNTIME", "MODEL"]
