"""Key rotation and revocation, end to end: a tenant's API-key Secret and TenantBinding change, the
operator rewrites the routing table, the router (which follows that Secret through the API) refuses
the old key and then the deleted binding. Collected only when the suite runs against a cluster."""

from __future__ import annotations

import json
import uuid

from e2esupport import Kube, Router, Tenant, wait_until


def _apply(kube: Kube, *objs: dict[str, object]) -> None:
    kube.run("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))


def test_rotated_key_and_deleted_binding_are_refused(
    kube: Kube, router: Router, tenants: dict[str, Tenant]
) -> None:
    acme = tenants["acme"]  # borrow its namespace and trust class
    name = f"revocable-{uuid.uuid4().hex[:6]}"
    old, new = f"sk-{name}-old", f"sk-{name}-new"

    def secret(*keys: str) -> dict[str, object]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-keys", "namespace": acme.namespace},
            "stringData": {"keys": "\n".join(keys)},
        }

    binding = {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "TenantBinding",
        "metadata": {"name": name, "namespace": acme.namespace},
        "spec": {
            "tenantId": name,
            "trustClassName": acme.trust_class,
            "apiKeySecretRef": {"name": f"{name}-keys", "key": "keys"},
        },
    }

    def status(key: str) -> int:
        return router.request("GET", "/v1/models", key=key).status

    try:
        _apply(kube, secret(old, new), binding)
        wait_until(lambda: status(old) == 200 and status(new) == 200, "both keys of the new binding routed")
        body = {"model": acme.model, "prompt": f"{uuid.uuid4().hex} hello", "max_tokens": 2}
        r = router.request("POST", "/v1/completions", key=old, body=body)
        assert r.status == 200, r.body

        _apply(kube, secret(new))  # rotation done: the old key is removed
        wait_until(lambda: status(old) == 401, "the removed key refused")
        assert status(new) == 200
        assert router.request("POST", "/v1/completions", key=old, body=body).status == 401

        kube.run("delete", "tenantbinding", name, "-n", acme.namespace, "--wait=true")
        wait_until(lambda: status(new) == 401, "the deleted binding's key refused")
        assert status(acme.api_key) == 200  # the neighbour in the same namespace and class is untouched
    finally:
        kube.run("delete", "tenantbinding", name, "-n", acme.namespace, "--ignore-not-found", check=False)
        kube.run("delete", "secret", f"{name}-keys", "-n", acme.namespace, "--ignore-not-found", check=False)
