"""GitOps-ready status on the real control plane: the conditions kstatus reads (Flux, kpt,
cli-utils) and ``kubectl wait`` on both kinds, and the chart's Argo CD health checks (Lua, run by a
real Lua runtime) against statuses the operator really wrote."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from cluster.manifests import (
    CPU_ANY_NAMESPACE,
    condition,
    keys_secret,
    ready,
    tenant_binding,
    tenant_namespace,
    trust_class,
)
from support.argocd import argocd_health

pytestmark = pytest.mark.cluster

tc = functools.partial(trust_class, **CPU_ANY_NAMESPACE)


def kstatus(obj: dict[str, Any]) -> str:
    """What kstatus' generic rules say of a custom resource (sigs.k8s.io/cli-utils/pkg/kstatus/status,
    checkGenericProperties): InProgress until status.observedGeneration is the generation, InProgress
    while Reconciling is True, Failed while Stalled is True, else Current."""
    st = obj.get("status") or {}
    if st.get("observedGeneration") != obj["metadata"]["generation"]:
        return "InProgress"
    if condition(obj, "Reconciling").get("status") == "True":
        return "InProgress"
    if condition(obj, "Stalled").get("status") == "True":
        return "Failed"
    return "Current"


def current_conditions(obj: dict[str, Any]) -> bool:
    """Every condition carries the generation it was computed from."""
    gen = obj["metadata"]["generation"]
    return all(c.get("observedGeneration") == gen for c in obj["status"]["conditions"])


@pytest.fixture
def cleanup(kv: Any, wait: Any) -> Any:
    made: list[str] = []
    yield made
    for name in made:
        kind = "namespace" if name.startswith("ns/") else "trustclass"
        kv("delete", kind, name.removeprefix("ns/"), "--ignore-not-found", "--wait=false")
    for name in made:
        if not name.startswith("ns/"):
            wait(lambda n=name: kv.json("get", "trustclass", n) is None, f"TrustClass {name} deleted", 120)


def test_kubectl_wait_kstatus_and_argocd_health_follow_what_the_operator_writes(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup += [
        "go-ok",
        "go-stuck",
        "go-zero",
        "go-conflict",
        "ns/go-tenants",
        "ns/go-outsiders",
        "ns/go-taken",
    ]
    nowhere = {"nodeSelector": {"kvfence.dev/test": "no-such-node"}}
    kv("create", "namespace", "go-taken")
    objs = [
        tc("go-ok"),
        tc("go-stuck", placement=nowhere),
        tc("go-zero", replicas=0),
        tc("go-conflict", namespace="go-taken", replicas=0),
        *tenant_namespace("go-tenants", grant=True),
        keys_secret("go-bound", "go-tenants", "sk-go-bound"),
        tenant_binding("go-bound", "go-tenants", trust_class="go-ok"),
        keys_secret("go-denied", "go-tenants", "sk-go-denied"),
        tenant_binding("go-denied", "go-tenants", trust_class="go-missing"),
    ]
    assert kv.apply(*objs).returncode == 0
    # kubectl wait on both kinds
    res = kv("wait", "--for=condition=Ready", "trustclass/go-ok", "--timeout=180s", check=False)
    assert res.returncode == 0, res.stderr + operator.tail()
    res = kv("wait", "--for=condition=Ready", "-n", "go-tenants", "tenantbinding/go-bound", "--timeout=60s",
             check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr + operator.tail()

    def tc_state(name: str, status: str) -> dict[str, Any] | None:
        obj = kv.json("get", "trustclass", name)
        if obj and obj.get("status") and kstatus(obj) == status and current_conditions(obj):
            return dict(obj)
        return None

    ok = wait(lambda: tc_state("go-ok", "Current"), "go-ok Current", 60, dump=operator.tail)
    assert ready(kv, "go-ok")
    assert condition(ok, "Reconciling")["status"] == "False"
    assert condition(ok, "Stalled")["status"] == "False"
    assert argocd_health("trustclass", ok)[0] == "Healthy"

    # The engine is applied in the class's first reconcile: its first InProgress status can come before
    # the Deployment controller has counted the new pod ("0/1 updated"). The operator follows the
    # Deployment's status, so the message catches up.
    rolling = ("Progressing", "EngineRollingOut: 1/1 updated, 0/1 ready")

    def stuck_state() -> dict[str, Any] | None:
        obj = tc_state("go-stuck", "InProgress")
        return obj if obj is not None and argocd_health("trustclass", obj) == rolling else None

    stuck = wait(stuck_state, "go-stuck InProgress, 1/1 updated", 60, dump=operator.tail)
    assert condition(stuck, "Reconciling")["status"] == "True"
    assert condition(stuck, "Ready")["status"] == "False"

    zero = wait(lambda: tc_state("go-zero", "Current"), "go-zero Current", 60, dump=operator.tail)
    assert condition(zero, "Ready")["reason"] == "ScaledToZero"
    assert argocd_health("trustclass", zero)[0] == "Suspended"

    conflict = wait(lambda: tc_state("go-conflict", "Failed"), "go-conflict Failed", 60, dump=operator.tail)
    assert condition(conflict, "Stalled")["reason"] == "NamespaceConflict"
    assert condition(conflict, "Reconciling")["status"] == "False"
    status, message = argocd_health("trustclass", conflict)
    assert status == "Degraded" and message.startswith("NamespaceConflict: namespace 'go-taken' exists")
    res = kv("wait", "--for=condition=Ready", "trustclass/go-conflict", "--timeout=2s", check=False)
    assert res.returncode != 0

    def tb_state(name: str, status: str) -> dict[str, Any] | None:
        obj = kv.json("get", "tenantbinding", name, "-n", "go-tenants")
        if obj and obj.get("status") and kstatus(obj) == status and current_conditions(obj):
            return dict(obj)
        return None

    bound = wait(lambda: tb_state("go-bound", "Current"), "go-bound Current", 60, dump=operator.tail)
    assert condition(bound, "Ready")["status"] == "True" and condition(bound, "Bound")["status"] == "True"
    assert argocd_health("tenantbinding", bound)[0] == "Healthy"
    denied = wait(lambda: tb_state("go-denied", "Failed"), "go-denied Failed", 60, dump=operator.tail)
    assert condition(denied, "Stalled")["reason"] == "TrustClassNotFound"
    assert condition(denied, "Ready")["status"] == "False"
    assert argocd_health("tenantbinding", denied) == (
        "Degraded",
        "TrustClassNotFound: TrustClass 'go-missing' does not exist",
    )

    # a new generation: InProgress (kstatus) and Progressing (Argo CD) until the operator observed it
    newer = {**ok, "metadata": {**ok["metadata"], "generation": ok["metadata"]["generation"] + 1}}
    assert kstatus(newer) == "InProgress"
    assert argocd_health("trustclass", newer)[0] == "Progressing"
    # and one the operator has not written a status for yet
    fresh = {k: v for k, v in bound.items() if k != "status"}
    assert argocd_health("tenantbinding", fresh)[0] == "Progressing"
    assert argocd_health("trustclass", {k: v for k, v in ok.items() if k != "status"})[0] == "Progressing"
