"""`helm install` of charts/kvfence into the real local control plane (tests/cluster).

The apiserver validates every object (schemas, the CRDs' own OpenAPI and CEL rules, RBAC); kwok plays
the kubelet, so the pods "run" without images and the Deployments become available. RBAC is checked
with the apiserver's own authorizer (``kubectl auth can-i --as`` the operator's ServiceAccount).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from chart.chartsupport import CHART, helm
from cluster.localcluster import LocalCluster
from support.waiting import wait_until

from kvfence.contract.routing import ROUTING_SECRET_NAME
from kvfence.operator.builders import SIGNING_SECRET_NAME

pytestmark = pytest.mark.cluster
CRDS = ("trustclasses.kvfence.dev", "tenantbindings.kvfence.dev")


@dataclass
class Release:
    cluster: LocalCluster
    name: str
    namespace: str
    env: dict[str, str]

    @property
    def fullname(self) -> str:
        return f"{self.name}-kvfence"

    def helm(self, *args: str, check: bool = True) -> str:
        res = helm(*args, "--namespace", self.namespace, check=check, env=self.env)
        return res.stdout + res.stderr

    def get(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl("get", *args, "-o", "json").stdout)

    def can_i(self, verb: str, resource: str, namespace: str | None = None, subresource: str = "") -> bool:
        sa = f"system:serviceaccount:{self.namespace}:{self.fullname}-operator"
        args = ["auth", "can-i", verb, resource, f"--as={sa}"]
        args += [f"--subresource={subresource}"] if subresource else []
        args += [f"--namespace={namespace}"] if namespace else []
        res = self.cluster.kubectl(*args, check=False)
        assert res.stdout.strip() in ("yes", "no"), res.stdout + res.stderr
        return res.stdout.strip() == "yes"


def new_namespace(cluster: LocalCluster, prefix: str) -> str:
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    return ns


@pytest.fixture
def release(cluster: LocalCluster, tmp_path: Path) -> Iterator[Release]:
    ns = new_namespace(cluster, "kvf-chart")
    env = {
        **cluster.env(),
        "HELM_CACHE_HOME": str(tmp_path / "helm-cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "helm-config"),
        "HELM_DATA_HOME": str(tmp_path / "helm-data"),
    }
    rel = Release(cluster, f"r{uuid.uuid4().hex[:6]}", ns, env)
    yield rel
    rel.helm("uninstall", rel.name, "--wait", check=False)
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def available(rel: Release, name: str) -> bool:
    d = rel.get("deployment", name, "-n", rel.namespace)
    want = d["spec"].get("replicas", 1)
    st = d.get("status", {})
    return bool(st.get("availableReplicas", 0) == want and st.get("updatedReplicas", 0) == want)


def test_install_upgrade_uninstall(release: Release, cluster: LocalCluster) -> None:
    tenants = new_namespace(cluster, "kvf-tenant")
    out = release.helm(
        "install",
        release.name,
        str(CHART),
        "--set",
        f"operator.tenantNamespaces={{{tenants}}}",
        "--set",
        "router.ingress.enabled=true",
        "--wait",
        "--timeout",
        "3m",
    )
    # NOTES.txt tells how to reach the router and that Helm never upgrades CRDs.
    assert "kubectl apply --server-side -f charts/kvfence/crds/" in out
    assert f"port-forward svc/{release.fullname}-router" in out
    assert "STATUS: deployed" in out

    # The CRDs are installed and served (the apiserver accepted their schemas).
    for crd in CRDS:
        c = release.get("crd", crd)
        conditions = {x["type"]: x["status"] for x in c["status"]["conditions"]}
        assert conditions.get("Established") == "True", conditions

    # Every object of the release is there, and both Deployments become available under kwok.
    op, router = f"{release.fullname}-operator", f"{release.fullname}-router"
    wait_until(lambda: available(release, op), "the operator Deployment to be available")
    wait_until(lambda: available(release, router), "the router Deployment to be available")
    ns = release.namespace
    for kind, name in [
        ("serviceaccount", op),
        ("serviceaccount", router),
        ("service", router),
        ("service", f"{op}-metrics"),
        ("role", f"{op}-leader-election"),
        ("rolebinding", f"{op}-leader-election"),
        ("poddisruptionbudget", op),
        ("poddisruptionbudget", router),
        ("ingress", router),
        ("configmap", f"{release.fullname}-dashboard"),
    ]:
        assert (
            release.get(kind, name, "-n", ns)["metadata"]["labels"]["app.kubernetes.io/instance"]
            == release.name
        )
    for kind, name in [
        ("clusterrole", op),
        ("clusterrole", f"{op}-tenant-secrets"),
        ("clusterrolebinding", op),
    ]:
        assert release.get(kind, name)["metadata"]["name"] == name
    assert release.get("rolebinding", f"{op}-tenant-secrets", "-n", tenants)["roleRef"]["name"] == (
        f"{op}-tenant-secrets"
    )
    pods = release.get("pods", "-n", ns, "-l", "app.kubernetes.io/component=router")["items"]
    assert len(pods) == 2 and all(p["spec"]["nodeName"] for p in pods)

    # The operator's rights, as the apiserver's RBAC authorizer sees them.
    assert release.can_i("watch", "trustclasses.kvfence.dev")
    assert release.can_i("patch", "tenantbindings.kvfence.dev", "any-ns", subresource="status")
    assert not release.can_i("patch", "tenantbindings.kvfence.dev", "any-ns")
    assert release.can_i("create", "deployments.apps", "kvf-gold")
    assert release.can_i("create", "secrets", "kvf-gold")
    assert release.can_i("get", f"secrets/{ROUTING_SECRET_NAME}", ns)
    assert release.can_i("patch", f"secrets/{SIGNING_SECRET_NAME}", "kvf-gold")
    assert release.can_i("update", f"leases.coordination.k8s.io/{op}", ns)
    assert release.can_i("get", "secrets/tenant-keys", tenants)
    assert release.can_i("watch", "secrets", tenants)  # API-key rotations seen within seconds
    assert release.can_i("watch", f"secrets/{SIGNING_SECRET_NAME}", "kvf-gold")
    assert not release.can_i("watch", f"secrets/{ROUTING_SECRET_NAME}", ns)
    assert not release.can_i("list", "secrets", ns)
    assert not release.can_i("watch", "secrets", "default")
    assert not release.can_i("get", "secrets/tenant-keys", "default")
    assert not release.can_i("delete", "deployments.apps", "kvf-gold")
    assert not release.can_i("update", "leases.coordination.k8s.io/someone-else", ns)
    assert not release.can_i("create", "pods", ns)

    # upgrade: values change in place.
    release.helm(
        "upgrade",
        release.name,
        str(CHART),
        "--reuse-values",
        "--set",
        "router.replicaCount=3",
        "--wait",
        "--timeout",
        "3m",
    )
    assert release.get("deployment", router, "-n", ns)["spec"]["replicas"] == 3
    wait_until(lambda: available(release, router), "the scaled router Deployment")
    args = release.get("deployment", router, "-n", ns)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--replicas=3" in args

    # uninstall removes everything the release made, but leaves the CRDs (and so the user's data).
    release.helm("uninstall", release.name, "--wait", "--timeout", "3m")
    left = cluster.kubectl(
        "get",
        "deploy,svc,sa,role,rolebinding,pdb,ingress,configmap",
        "-n",
        ns,
        "-l",
        f"app.kubernetes.io/instance={release.name}",
        "-o",
        "name",
    ).stdout.split()
    assert left == []
    for kind, name in [
        ("clusterrole", op),
        ("clusterrolebinding", op),
        ("rolebinding", f"{op}-tenant-secrets"),
    ]:
        res = cluster.kubectl("get", kind, name, "-n", tenants, check=False)
        assert res.returncode != 0 and "NotFound" in res.stderr, (kind, name)
    for crd in CRDS:
        assert release.get("crd", crd)["metadata"]["name"] == crd


# Minimal stand-ins for the Prometheus Operator and Gateway API CRDs (group, kind and version only,
# schema left open): enough for the apiserver to accept the chart's objects of those kinds. Their
# contents are checked by the template tests, not by these stubs.
STUB_CRDS = [
    ("monitoring.coreos.com", "ServiceMonitor", "servicemonitors", "v1"),
    ("monitoring.coreos.com", "PodMonitor", "podmonitors", "v1"),
    ("monitoring.coreos.com", "PrometheusRule", "prometheusrules", "v1"),
    ("gateway.networking.k8s.io", "HTTPRoute", "httproutes", "v1"),
]


def stub_crd(group: str, kind: str, plural: str, version: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{group}",
            # *.k8s.io groups are protected: the apiserver wants this annotation on their CRDs.
            "annotations": {"api-approved.kubernetes.io": "unapproved, kvfence test stub"},
        },
        "spec": {
            "group": group,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


def test_install_with_monitoring_and_gateway(release: Release, cluster: LocalCluster) -> None:
    for group, kind, plural, version in STUB_CRDS:
        if cluster.kubectl("get", "crd", f"{plural}.{group}", check=False).returncode != 0:
            cluster.apply(stub_crd(group, kind, plural, version))
    cluster.wait_established(*(f"{plural}.{group}" for group, _, plural, _ in STUB_CRDS))
    release.helm(
        "install",
        release.name,
        str(CHART),
        "-f",
        str(CHART / "ci" / "monitoring-values.yaml"),
        "--wait",
        "--timeout",
        "3m",
    )
    ns = release.namespace
    names = {
        (o["kind"], o["metadata"]["name"])
        for o in release.get(
            "servicemonitors.monitoring.coreos.com,podmonitors.monitoring.coreos.com,"
            "prometheusrules.monitoring.coreos.com,httproutes.gateway.networking.k8s.io",
            "-n",
            ns,
        )["items"]
    }
    fn = release.fullname
    assert names == {
        ("ServiceMonitor", f"{fn}-router"),
        ("ServiceMonitor", f"{fn}-operator"),
        ("PodMonitor", f"{fn}-engines"),
        ("PrometheusRule", fn),
        ("HTTPRoute", f"{fn}-router"),
    }
    rule = release.get("prometheusrules.monitoring.coreos.com", fn, "-n", ns)
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "KvfenceHashCollisionDetected",
        "KvfenceEngineUnavailable",
        "KvfenceTenantQuotaSaturated",
    } <= alerts
    release.helm("uninstall", release.name, "--wait", "--timeout", "3m")
    assert release.get("prometheusrules.monitoring.coreos.com", "-n", ns)["items"] == []
