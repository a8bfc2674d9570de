"""The real node runs pods for real: containers start, Services route, DNS resolves, the apiserver
reaches the kubelet (logs), and NetworkPolicies are enforced.

The workload is agnhost, Kubernetes' own e2e test image, built from the pinned sources and imported
into the node's containerd (no registry)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from support.waiting import wait_until

from cluster.localcluster import LocalCluster
from cluster.realnode import NODE_NAME

pytestmark = pytest.mark.cluster
AGNHOST = "kvfence.local/agnhost:test"


def pod(
    name: str, ns: str, args: list[str], labels: dict[str, str], *, restart: str = "Always"
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": AGNHOST,
        "imagePullPolicy": "Never",
        "args": args,
        # What the namespace's `restricted` Pod Security level demands (and what kvfence's own pods set).
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "runAsUser": 65534,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if args[0] == "netexec":
        container["ports"] = [{"containerPort": 8080}]
        container["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"restartPolicy": restart, "containers": [container], "terminationGracePeriodSeconds": 1},
    }


def connect(cluster: LocalCluster, ns: str, source: str, target: str) -> bool:
    """From inside pod ``source``, try a TCP connection to ``target`` (agnhost connect); True if it
    got through. Runs through `kubectl exec`, i.e. apiserver -> kubelet -> containerd streaming."""
    res = cluster.kubectl(
        "exec", source, "-n", ns, "--", "/agnhost", "connect", target, "--timeout=2s", check=False
    )
    return res.returncode == 0


def settles(check: Callable[[], bool], what: str) -> None:
    """NetworkPolicies are programmed asynchronously: wait until ``check`` holds three times in a row."""
    streak = 0

    def ok() -> bool:
        nonlocal streak
        streak = streak + 1 if check() else 0
        return streak >= 3

    wait_until(ok, what)


@pytest.fixture(scope="module")
def server(real_cluster: LocalCluster) -> tuple[LocalCluster, str, str]:
    c = real_cluster
    ns = f"node-{uuid.uuid4().hex[:6]}"
    c.kubectl("create", "namespace", ns)
    c.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    wait_until(lambda: c.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0, "default SA")
    c.apply(pod("web", ns, ["netexec", "--http-port=8080"], {"app": "web"}))
    c.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
        }
    )
    for name, role in (("client", "client"), ("stranger", "stranger")):
        c.apply(pod(name, ns, ["pause"], {"role": role}))
    for name in ("web", "client", "stranger"):
        c.kubectl("wait", "--for=condition=Ready", f"pod/{name}", "-n", ns, "--timeout=120s")
    return c, ns, json.loads(c.kubectl("get", "pod", "web", "-n", ns, "-o", "json").stdout)["status"]["podIP"]


def test_pods_really_run_on_the_real_node(server: tuple[LocalCluster, str, str]) -> None:
    c, ns, ip = server
    p = json.loads(c.kubectl("get", "pod", "web", "-n", ns, "-o", "json").stdout)
    assert p["spec"]["nodeName"] == NODE_NAME
    assert ip.startswith("198.18.0.")
    # The kubelet answered a real HTTP readiness probe, and the apiserver can read the container's log
    # through the kubelet.
    assert any(cond["type"] == "Ready" and cond["status"] == "True" for cond in p["status"]["conditions"])
    wait_until(lambda: "Started HTTP server" in c.kubectl("logs", "web", "-n", ns).stdout, "netexec log line")


def test_services_and_dns_route_to_pods(server: tuple[LocalCluster, str, str]) -> None:
    c, ns, ip = server
    assert connect(c, ns, "client", f"{ip}:8080")
    # kube-proxy and CoreDNS learn of a new Service asynchronously: wait until it routes ...
    wait_until(lambda: connect(c, ns, "client", f"web.{ns}.svc.cluster.local:80"), "the Service by DNS name")
    # ... then it does so for everyone, by short name too (resolv.conf search path).
    assert connect(c, ns, "stranger", f"web.{ns}:80")
    # A port nothing listens on is refused: the probe can fail.
    assert not connect(c, ns, "client", f"{ip}:9999")


def test_network_policy_is_enforced(server: tuple[LocalCluster, str, str]) -> None:
    c, ns, ip = server
    c.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "web-from-clients", "namespace": ns},
            "spec": {
                "podSelector": {"matchLabels": {"app": "web"}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}],
            },
        }
    )
    svc = f"web.{ns}.svc.cluster.local:80"
    settles(lambda: not connect(c, ns, "stranger", f"{ip}:8080"), "the policy to block the stranger")
    assert not connect(c, ns, "stranger", svc)
    assert connect(c, ns, "client", f"{ip}:8080")
    assert connect(c, ns, "client", svc)

    c.kubectl("delete", "networkpolicy", "web-from-clients", "-n", ns)
    settles(lambda: connect(c, ns, "stranger", svc), "the policy's removal to let the stranger in")
