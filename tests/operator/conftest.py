"""Factories for the operator's unit tests (pure: no cluster)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kvfence.api.tenantbinding import TenantBinding
from kvfence.api.trustclass import TrustClass


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and v and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


TC_BASE: dict[str, Any] = {
    "apiVersion": "kvfence.dev/v1alpha1",
    "kind": "TrustClass",
    "metadata": {"name": "gold", "uid": "11111111-2222-3333-4444-555555555555", "generation": 1},
    "spec": {
        "engine": {"runtime": "reference", "image": "kvfence/engine:dev", "model": {"name": "kvfence/tiny"}},
        "namespaceSelector": {"matchLabels": {"kvfence.dev/tenants": "gold"}},
    },
}


@pytest.fixture
def make_tc() -> Callable[..., TrustClass]:
    def make(name: str = "gold", **spec: Any) -> TrustClass:
        body = copy.deepcopy(TC_BASE)
        body["metadata"]["name"] = name
        body["spec"] = _merge(body["spec"], spec)
        return TrustClass.model_validate(body)

    return make


@pytest.fixture
def make_tb() -> Callable[..., TenantBinding]:
    def make(
        name: str,
        tenant: str,
        trust_class: str = "gold",
        namespace: str = "team-a",
        created: str = "2026-01-01T00:00:00Z",
        **spec: Any,
    ) -> TenantBinding:
        body = {
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created, "generation": 1},
            "spec": {
                "tenantId": tenant,
                "trustClassName": trust_class,
                "apiKeySecretRef": {"name": f"{name}-keys"},
                **spec,
            },
        }
        return TenantBinding.model_validate(body)

    return make
