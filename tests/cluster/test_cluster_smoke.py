"""The local control plane is a real cluster: scheduling, garbage collection, schema validation and RBAC
are done by the upstream components, not by anything of ours."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until

from cluster.localcluster import LocalCluster

pytestmark = pytest.mark.cluster


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def fresh_namespace(cluster: LocalCluster, prefix: str) -> str:
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    wait_until(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
        f"default ServiceAccount in {ns}",
    )
    return ns


def deployment(
    name: str, ns: str, limits: dict[str, str], tolerate_gpu_taint: bool = False
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "example.invalid/engine:1", "resources": {"limits": limits}}]
    }
    if tolerate_gpu_taint:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def pods(cluster: LocalCluster, ns: str, app: str) -> list[dict[str, Any]]:
    return list(get_json(cluster, "pods", "-n", ns, "-l", f"app={app}")["items"])


def test_server_reports_the_pinned_version(cluster: LocalCluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    pinned = _pinned_k8s_version()
    assert version["serverVersion"]["gitVersion"] == f"v{pinned}"
    assert version["clientVersion"]["gitVersion"] == f"v{pinned}"


def _pinned_k8s_version() -> str:
    for line in (Path(__file__).parent / "components.env").read_text().splitlines():
        if line.startswith("K8S_VERSION="):
            return line.split("=", 1)[1].strip()
    raise AssertionError("K8S_VERSION missing from components.env")


def test_fake_gpu_nodes_advertise_gpus(cluster: LocalCluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in get_json(cluster, "nodes")["items"]}
    assert set(cluster.gpu_nodes) <= set(nodes)
    h100 = nodes["kvf-gpu-h100-0"]
    assert h100["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert h100["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert any(t["key"] == "nvidia.com/gpu" for t in nodes["kvf-gpu-a100-0"]["spec"]["taints"])
    assert nodes["kvf-gpu-mig-0"]["status"]["allocatable"]["nvidia.com/mig-1g.5gb"] == "7"
    assert "nvidia.com/gpu" not in nodes["kvf-cpu-0"]["status"]["allocatable"]


def test_gpu_deployment_is_scheduled_onto_a_gpu_node_and_runs(cluster: LocalCluster) -> None:
    ns = fresh_namespace(cluster, "smoke-gpu")
    cluster.apply(deployment("engine", ns, {"nvidia.com/gpu": "1"}))

    def running() -> list[dict[str, Any]]:
        return [p for p in pods(cluster, ns, "engine") if p["status"].get("phase") == "Running"]

    (pod,) = wait_until(running, "a Running GPU pod")
    node = get_json(cluster, "node", pod["spec"]["nodeName"])
    assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 1
    # Without a toleration it can only land on an untainted GPU node.
    assert not node["spec"].get("taints")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_mig_request_lands_on_the_mig_node(cluster: LocalCluster) -> None:
    ns = fresh_namespace(cluster, "smoke-mig")
    cluster.apply(deployment("mig", ns, {"nvidia.com/mig-1g.5gb": "1"}, tolerate_gpu_taint=True))

    def running() -> list[dict[str, Any]]:
        return [p for p in pods(cluster, ns, "mig") if p["status"].get("phase") == "Running"]

    (pod,) = wait_until(running, "a Running MIG pod")
    assert pod["spec"]["nodeName"] == "kvf-gpu-mig-0"


def test_more_gpus_than_any_node_has_stays_pending(cluster: LocalCluster) -> None:
    ns = fresh_namespace(cluster, "smoke-big")
    cluster.apply(deployment("huge", ns, {"nvidia.com/gpu": "64"}, tolerate_gpu_taint=True))

    def failed_scheduling() -> list[dict[str, Any]]:
        events = get_json(cluster, "events", "-n", ns)["items"]
        return [e for e in events if e["reason"] == "FailedScheduling"]

    events = wait_until(failed_scheduling, "a FailedScheduling event")
    assert "Insufficient nvidia.com/gpu" in events[0]["message"]
    (pod,) = pods(cluster, ns, "huge")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_deleting_an_owner_garbage_collects_its_children(cluster: LocalCluster) -> None:
    ns = fresh_namespace(cluster, "smoke-gc")
    cluster.apply(deployment("owner", ns, {"cpu": "100m"}))
    wait_until(lambda: pods(cluster, ns, "owner"), "the Deployment's pod")
    assert get_json(cluster, "replicasets", "-n", ns)["items"]

    # A plain owner reference, set by us, is honoured by the same collector.
    parent = json.loads(cluster.kubectl("create", "configmap", "parent", "-n", ns, "-o", "json").stdout)
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "namespace": ns,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "parent", "uid": parent["metadata"]["uid"]}
            ],
        },
    }
    cluster.apply(child)

    cluster.kubectl("delete", "deployment", "owner", "-n", ns, "--wait=false")
    cluster.kubectl("delete", "configmap", "parent", "-n", ns, "--wait=false")
    wait_until(lambda: not get_json(cluster, "replicasets", "-n", ns)["items"], "ReplicaSets collected")
    wait_until(lambda: not pods(cluster, ns, "owner"), "pods collected")
    wait_until(
        lambda: cluster.kubectl("get", "configmap", "child", "-n", ns, check=False).returncode != 0,
        "the child ConfigMap collected",
    )


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.smoke.kvfence.dev"},
    "spec": {
        "group": "smoke.kvfence.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "replicas": {"type": "integer", "minimum": 1},
                                    "size": {"type": "string", "enum": ["small", "large"]},
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_crd_schema_violations_are_rejected_naming_the_field(cluster: LocalCluster) -> None:
    cluster.apply(WIDGET_CRD)
    cluster.wait_established("widgets.smoke.kvfence.dev")
    ns = fresh_namespace(cluster, "smoke-crd")

    def widget(spec: dict[str, Any]) -> str:
        obj = {
            "apiVersion": "smoke.kvfence.dev/v1",
            "kind": "Widget",
            "metadata": {"name": "w", "namespace": ns},
        }
        return json.dumps({**obj, "spec": spec})

    bad = cluster.kubectl("create", "-f", "-", input=widget({"replicas": 0, "size": "huge"}), check=False)
    assert bad.returncode != 0
    assert "spec.replicas" in bad.stderr and "spec.size" in bad.stderr, bad.stderr
    assert cluster.kubectl("get", "widgets", "-n", ns, "-o", "name").stdout.strip() == ""
    cluster.kubectl("create", "-f", "-", input=widget({"replicas": 2, "size": "small"}))


def test_service_account_without_a_binding_is_denied(cluster: LocalCluster) -> None:
    ns = fresh_namespace(cluster, "smoke-rbac")
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", ns)
    token = cluster.kubectl("create", "token", "nobody", "-n", ns).stdout.strip()

    def as_sa(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(cluster.bin_dir / "kubectl"),
                f"--server={cluster.server}",
                f"--certificate-authority={cluster.pki / 'ca.crt'}",
                f"--token={token}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )

    denied = as_sa("get", "pods", "-n", ns)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert f"system:serviceaccount:{ns}:nobody" in denied.stderr

    # The token itself is valid: with a RoleBinding the same call succeeds.
    cluster.kubectl("create", "role", "pod-reader", "-n", ns, "--verb=list", "--resource=pods")
    cluster.kubectl(
        "create",
        "rolebinding",
        "nobody-reads",
        "-n",
        ns,
        "--role=pod-reader",
        f"--serviceaccount={ns}:nobody",
    )
    wait_until(
        lambda: as_sa("get", "pods", "-n", ns).returncode == 0, "RBAC to allow the bound ServiceAccount"
    )
    # ... and nothing more than what was bound.
    assert as_sa("get", "secrets", "-n", ns).returncode != 0
