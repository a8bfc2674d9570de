"""Least-privilege RBAC of the operator, as data (the Helm chart renders the same objects:
``python -m kvfence.operator.rbac`` prints them as YAML).

What the operator may do, and why:

* ``kvfence.dev``: read and watch TrustClasses and TenantBindings, patch their status, patch a
  TrustClass to add/remove its own finalizer, update ``trustclasses/finalizers`` (owner references
  with ``blockOwnerDeletion``).
* Namespaces: watch (a namespace's labels decide which bindings a class admits), create/patch the
  class namespaces, delete one when its class is deleted.
* Deployments, Services, ConfigMaps, NetworkPolicies, PodDisruptionBudgets, PersistentVolumeClaims
  (the model cache): watch (drift repair) and create/patch. Never delete: garbage collection does it
  through owner references (a retained model-cache claim has none).
* Secrets: **no get, list or watch of arbitrary Secrets.** ``create`` (which reveals nothing),
  get/patch/update only on the two names it owns (``kvfence-signing-key`` in class namespaces,
  ``kvfence-routing`` in the router's namespace), and list/watch of ``kvfence-signing-key`` only
  (``resourceNames``: the API server allows such a list or watch only with the field selector
  ``metadata.name=kvfence-signing-key``), so that a deleted or edited signing key is repaired at once.
* Tenants' API-key Secrets: only where a namespace opts in, by binding the ClusterRole
  ``kvfence-operator-tenant-secrets`` to the operator with a RoleBinding in that namespace: get, and
  list/watch so that a rotated key reaches the routing table within seconds (the operator asks for
  metadata only and ignores every Secret no binding references). Elsewhere a binding is ``Denied``
  with reason ``ApiKeySecretForbidden``. The same grant in a class namespace lets the operator check
  that a class's model token Secret (``engine.model.tokenSecretRef``) exists before an engine refers to
  it; without it that class is Stalled with reason ``ModelTokenSecretForbidden``.
* Events: create. Leases: only its own, in its own namespace (a Role).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from kvfence.api.common import GROUP
from kvfence.contract.routing import ROUTING_SECRET_NAME
from kvfence.operator.builders import SIGNING_SECRET_NAME, TENANT_SECRETS_ROLE

Obj = dict[str, Any]
NAME = "kvfence-operator"
LABELS = {
    "app.kubernetes.io/name": "kvfence",
    "app.kubernetes.io/component": "operator",
    "app.kubernetes.io/part-of": "kvfence",
}
RBAC = "rbac.authorization.k8s.io/v1"
WRITE = ["create", "patch"]
WATCH = ["get", "list", "watch"]


def cluster_role() -> Obj:
    return {
        "apiVersion": RBAC,
        "kind": "ClusterRole",
        "metadata": {"name": NAME, "labels": LABELS},
        "rules": [
            {"apiGroups": [GROUP], "resources": ["trustclasses", "tenantbindings"], "verbs": WATCH},
            {"apiGroups": [GROUP], "resources": ["trustclasses"], "verbs": ["patch"]},
            {
                "apiGroups": [GROUP],
                "resources": ["trustclasses/status", "tenantbindings/status"],
                "verbs": ["get", "patch", "update"],
            },
            {"apiGroups": [GROUP], "resources": ["trustclasses/finalizers"], "verbs": ["update"]},
            {"apiGroups": [""], "resources": ["namespaces"], "verbs": [*WATCH, *WRITE, "delete"]},
            {
                "apiGroups": [""],
                "resources": ["services", "configmaps", "persistentvolumeclaims"],
                "verbs": [*WATCH, *WRITE],
            },
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": [*WATCH, *WRITE]},
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": [*WATCH, *WRITE]},
            {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": [*WATCH, *WRITE]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [SIGNING_SECRET_NAME, ROUTING_SECRET_NAME],
                "verbs": ["get", "patch", "update"],
            },
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [SIGNING_SECRET_NAME],
                "verbs": ["list", "watch"],
            },
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    }


def tenant_secrets_role() -> Obj:
    """Bound per tenant namespace (RoleBinding) by whoever admits that namespace's tenants."""
    return {
        "apiVersion": RBAC,
        "kind": "ClusterRole",
        "metadata": {"name": TENANT_SECRETS_ROLE, "labels": LABELS},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": WATCH}],
    }


def tenant_secrets_binding(namespace: str, operator_namespace: str) -> Obj:
    return {
        "apiVersion": RBAC,
        "kind": "RoleBinding",
        "metadata": {"name": TENANT_SECRETS_ROLE, "namespace": namespace, "labels": LABELS},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": TENANT_SECRETS_ROLE,
        },
        "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": operator_namespace}],
    }


def lease_role(namespace: str, lease_name: str = NAME) -> Obj:
    return {
        "apiVersion": RBAC,
        "kind": "Role",
        "metadata": {"name": f"{NAME}-leader-election", "namespace": namespace, "labels": LABELS},
        "rules": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [lease_name],
                "verbs": ["get", "update"],
            },
        ],
    }


def manifests(namespace: str = "kvfence-system") -> list[Obj]:
    """ServiceAccount, roles and bindings of an operator running in ``namespace``."""
    subject = [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": NAME, "namespace": namespace, "labels": LABELS},
        },
        cluster_role(),
        tenant_secrets_role(),
        {
            "apiVersion": RBAC,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": LABELS},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": subject,
        },
        lease_role(namespace),
        {
            "apiVersion": RBAC,
            "kind": "RoleBinding",
            "metadata": {"name": f"{NAME}-leader-election", "namespace": namespace, "labels": LABELS},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"{NAME}-leader-election",
            },
            "subjects": subject,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ns = args[0] if args else "kvfence-system"
    sys.stdout.write(yaml.safe_dump_all(manifests(ns), sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
