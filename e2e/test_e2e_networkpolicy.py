"""The engines' NetworkPolicy, enforced by the cluster's network plugin: only router pods reach an
engine. Collected only when the suite runs against a cluster (not in the process-level local mode)."""

from __future__ import annotations

import json
import uuid

from e2esupport import NAMESPACE, RELEASE, Kube, wait_until

# Tries until it gets through or its time is up: a network plugin programs a new pod's rules a little
# after the pod starts, so one attempt would say nothing either way.
PROBE = """
import sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
error = "none"
while time.monotonic() < deadline:
    try:
        print("RESULT", urllib.request.urlopen(url, timeout=3).status)
        break
    except Exception as e:
        error = type(e).__name__
        time.sleep(1)
else:
    print("RESULT blocked", error)
"""


def probe(kube: Kube, namespace: str, labels: dict[str, str], url: str, seconds: float) -> str:
    """Run a one-shot pod (the control-plane image has Python) and return what it could do."""
    image = json.loads(kube.run("get", "deploy", f"{RELEASE}-router", "-n", NAMESPACE, "-o", "json"))["spec"][
        "template"
    ]["spec"]["containers"][0]["image"]
    name = f"kvf-netpol-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", PROBE, url, str(seconds)],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }
    kube.run("apply", "-f", "-", input=json.dumps(pod))
    try:

        def done() -> bool:
            phase = kube.run(
                "get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}", check=False
            )
            return phase.strip() in ("Succeeded", "Failed")

        wait_until(done, f"probe pod {namespace}/{name}", seconds + 180, 1)
        out = kube.run("logs", name, "-n", namespace)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), "")
        assert line, out
        return line.removeprefix("RESULT ").strip()
    finally:
        kube.run("delete", "pod", name, "-n", namespace, "--wait=false", check=False)


def engine_url(kube: Kube, trust_class: str) -> str:
    tc = json.loads(kube.run("get", "trustclass", trust_class, "-o", "json"))
    return f"{tc['status']['endpoint']}/health"


def router_pod_labels(kube: Kube) -> dict[str, str]:
    d = json.loads(kube.run("get", "deploy", f"{RELEASE}-router", "-n", NAMESPACE, "-o", "json"))
    labels: dict[str, str] = d["spec"]["selector"]["matchLabels"]
    return dict(labels)


def test_only_router_pods_reach_an_engine(kube: Kube) -> None:
    url = engine_url(kube, "gold")
    # Positive control: a pod that looks like a router, in the router's namespace, gets through; so a
    # refusal below is the policy, not broken DNS or networking.
    assert probe(kube, NAMESPACE, router_pod_labels(kube), url, 90) == "200"
    # Same namespace, not a router: never gets through, also not in its first seconds.
    assert probe(kube, NAMESPACE, {"app": "intruder"}, url, 20).startswith("blocked")
    # A tenant namespace, with the router's labels copied: the namespace does not match.
    assert probe(kube, "kvfence-team-a", router_pod_labels(kube), url, 20).startswith("blocked")
    # The other trust class's engine is just as closed.
    silver = engine_url(kube, "silver")
    assert probe(kube, "kvfence-team-b", {"app": "intruder"}, silver, 20).startswith("blocked")
