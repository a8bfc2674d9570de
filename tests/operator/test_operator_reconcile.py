"""The operator as a process, under its own ServiceAccount, against the real control plane: engines
scheduled onto fake GPU nodes, dedicated nodes, bindings and the routing table, drift repair, key
rotation, deletion, and least-privilege RBAC."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster.manifests import (
    condition,
    keys_secret,
    ready,
    sha,
    tenant_binding,
    tenant_namespace,
    trust_class,
)

from kvfence.api.policy import engine_args
from kvfence.operator import rbac

pytestmark = pytest.mark.cluster
#: a short key propagation delay, so that the rotation test sees the router switch to the new key
OPERATOR_ARGS = ("--signing-key-propagation-seconds", "5")

ROOT = Path(__file__).resolve().parents[2]
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def pods(kv: Any, ns: str) -> list[dict[str, Any]]:
    got = kv.json("get", "pods", "-n", ns)
    return [p for p in (got or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]


@pytest.fixture
def cleanup(kv: Any, wait: Any) -> Iterator[list[str]]:
    """TrustClasses (and namespaces) a test created: deleted afterwards, waiting until they are gone
    so that their pods do not affect the next test's scheduling."""
    classes: list[str] = []
    yield classes
    for name in classes:
        kv("delete", "trustclass", name, "--ignore-not-found", "--wait=false")
    for name in classes:
        wait(lambda n=name: kv.json("get", "trustclass", n) is None, f"TrustClass {name} deleted", 120)
        wait(
            lambda n=name: kv.json("get", "namespace", f"kvf-{n}") is None, f"namespace kvf-{name} gone", 180
        )


def test_operator_rbac_is_least_privilege(installed: Any, kv: Any) -> None:
    sa = f"--as=system:serviceaccount:kvfence-system:{rbac.NAME}"

    def can(*args: str) -> bool:
        return kv("auth", "can-i", *args, sa, check=False).stdout.strip() == "yes"

    # what it needs
    assert can("watch", "trustclasses.kvfence.dev")
    assert can("patch", "trustclasses.kvfence.dev", "--subresource=status")
    assert can("patch", "deployments", "-n", "kvf-anything")
    assert can("patch", "persistentvolumeclaims", "-n", "kvf-anything")  # the model cache
    assert can("watch", "persistentvolumeclaims", "--all-namespaces")
    assert can("get", "secret/kvfence-signing-key", "-n", "kvf-anything")
    assert can("patch", "secret/kvfence-routing", "-n", "kvfence-system")
    assert can("update", "lease/kvfence-operator", "-n", "kvfence-system")
    # what it must not do
    assert not can("get", "secrets", "-n", "kube-system")
    assert not can("get", "secret/some-tenant-secret", "-n", "default")
    assert not can("list", "secrets", "--all-namespaces")
    assert not can("watch", "secrets", "-n", "kvfence-system")
    assert not can("delete", "deployments", "-n", "kvf-anything")
    assert not can("delete", "persistentvolumeclaims", "-n", "kvf-anything")
    assert not can("get", "secret/hf-token", "-n", "kvf-anything")  # only where a namespace grants it
    assert not can("create", "pods", "-n", "kvf-anything")
    assert not can("create", "clusterrolebindings")
    assert not can("update", "lease/someone-else", "-n", "kvfence-system")
    assert not can("delete", "trustclasses.kvfence.dev")
    assert not can("*", "*")


def test_gpu_engines_land_on_gpu_nodes_with_the_right_resource_names(
    cluster: Any, operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup += ["gpu-h100", "gpu-mig", "gpu-vllm"]
    res = kv.apply(
        trust_class(
            "gpu-h100",
            replicas=2,
            resources={"gpu": {"count": 2}, "cpu": "2", "memory": "8Gi"},
            placement={"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        ),
        trust_class(
            "gpu-mig",
            resources={"gpu": {"count": 1, "resourceName": "nvidia.com/mig-1g.5gb"}},
            placement={"tolerations": [GPU_TOLERATION]},
        ),
        trust_class(
            "gpu-vllm",
            engine={
                "runtime": "vllm",
                "image": "vllm/vllm-openai:latest",
                "model": {"name": "org/model", "servedName": "m"},
                "tensorParallelSize": 2,
            },
            resources={"gpu": {"count": 2}},
            placement={"tolerations": [GPU_TOLERATION]},
        ),
    )
    assert res.returncode == 0, res.stderr
    for name in ("gpu-h100", "gpu-mig", "gpu-vllm"):
        wait(lambda n=name: ready(kv, n), f"{name} Ready", 180, dump=operator.tail)
    (vllm,) = pods(kv, "kvf-gpu-vllm")
    assert vllm["spec"]["nodeName"] in cluster.gpu_nodes
    args = " ".join(vllm["spec"]["containers"][0]["args"])
    assert "--tensor-parallel-size 2" in args and "--prefix-caching-hash-algo sha256" in args
    assert "--middleware kvfence.vllm.middleware.KvfenceMiddleware" in args
    assert "--scheduler-cls kvfence.vllm.scheduler.FencedScheduler" in args
    assert vllm["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    h100 = pods(kv, "kvf-gpu-h100")
    assert len(h100) == 2
    for p in h100:
        assert p["spec"]["nodeName"] in cluster.gpu_nodes and "h100" in p["spec"]["nodeName"]
        assert p["status"]["phase"] == "Running"
        res_ = p["spec"]["containers"][0]["resources"]
        assert res_["limits"]["nvidia.com/gpu"] == "2" and res_["requests"]["nvidia.com/gpu"] == "2"
        assert res_["limits"]["memory"] == "8Gi"
    (mig,) = pods(kv, "kvf-gpu-mig")
    assert mig["spec"]["nodeName"] == "kvf-gpu-mig-0"
    assert mig["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-1g.5gb": "1"}
    # hardened pods
    spec = mig["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    status = kv.json("get", "trustclass", "gpu-h100")["status"]
    assert status["readyReplicas"] == 2 and status["namespace"] == "kvf-gpu-h100"
    assert condition({"status": status}, "Progressing")["status"] == "False"
    assert condition({"status": status}, "Degraded")["status"] == "False"


def test_too_many_gpus_stay_pending_and_are_reported(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup.append("gpu-huge")
    assert kv.apply(trust_class("gpu-huge", resources={"gpu": {"count": 16}})).returncode == 0
    wait(lambda: pods(kv, "kvf-gpu-huge"), "a pod", 120)

    def not_ready() -> bool:
        obj = kv.json("get", "trustclass", "gpu-huge")
        return (
            condition(obj, "Ready").get("reason") == "EngineUnavailable"
            and condition(obj, "Progressing")["status"] == "True"
        )

    wait(not_ready, "Ready=False EngineUnavailable", 120, dump=operator.tail)
    (p,) = pods(kv, "kvf-gpu-huge")
    assert p["status"]["phase"] == "Pending" and not p["spec"].get("nodeName")


def test_dedicated_trust_classes_never_share_a_node(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup += ["ded-a", "ded-b", "shared-c"]
    dedicated = {"dedicatedNodes": {"enabled": True}, "tolerations": [GPU_TOLERATION]}
    res = kv.apply(
        trust_class("ded-a", replicas=2, resources={"gpu": {"count": 1}}, placement=dedicated),
        trust_class("ded-b", replicas=2, resources={"gpu": {"count": 1}}, placement=dedicated),
    )
    assert res.returncode == 0, res.stderr
    for name in ("ded-a", "ded-b"):
        wait(lambda n=name: ready(kv, n), f"{name} Ready", 180, dump=operator.tail)
    # A class that does not ask for dedicated nodes, allowed everywhere, with more replicas than the
    # nodes left over: the dedicated classes' anti-affinity keeps it off their nodes anyway.
    shared = trust_class(
        "shared-c", replicas=6, resources={"gpu": {"count": 0}}, placement={"tolerations": [GPU_TOLERATION]}
    )
    assert kv.apply(shared).returncode == 0
    wait(lambda: ready(kv, "shared-c"), "shared-c Ready", 180, dump=operator.tail)
    by_node: dict[str, set[str]] = {}
    for name in ("ded-a", "ded-b", "shared-c"):
        for p in pods(kv, f"kvf-{name}"):
            by_node.setdefault(p["spec"]["nodeName"], set()).add(
                p["metadata"]["labels"]["kvfence.dev/trust-class"]
            )
    dedicated_nodes = {n for n, cs in by_node.items() if cs & {"ded-a", "ded-b"}}
    assert dedicated_nodes
    for node in dedicated_nodes:
        assert len(by_node[node]) == 1, f"{node} runs {by_node[node]}"
    assert sum(1 for cs in by_node.values() if "shared-c" in cs) >= 1


def test_bindings_and_the_routing_table(operator: Any, kv: Any, wait: Any, cleanup: list[str]) -> None:
    cleanup += ["route-gold", "route-silver"]
    objs = [
        trust_class(
            "route-gold",
            replicas=0,
            engine={
                "image": "kvfence/engine:dev",
                "model": {"name": "kvfence/tiny", "servedName": "tiny"},
                "adapters": [{"name": "support"}],
            },
            namespaceSelector={"matchLabels": {"kvfence.dev/tenants": "gold"}},
            quotas={
                "defaults": {"requestsPerMinute": 60},
                "limits": {"requestsPerMinute": 600, "maxKVBlocks": 512},
            },
        ),
        trust_class("route-silver", replicas=0, namespaceSelector={}),
        *tenant_namespace("rt-a", label="gold", grant=True),
        *tenant_namespace("rt-b", label="gold", grant=True),
        *tenant_namespace("rt-rogue", label=None, grant=True),
        *tenant_namespace("rt-closed", label="gold", grant=False),
    ]
    assert kv.apply(*objs).returncode == 0
    bindings = [
        (
            "ok",
            "rt-a",
            "t-ok",
            "route-gold",
            {"allowedAdapters": ["support"], "quotas": {"requestsPerMinute": 120, "maxKVBlocks": 256}},
        ),
        ("silver", "rt-rogue", "t-silver", "route-silver", {}),
        ("rogue", "rt-rogue", "t-rogue", "route-gold", {}),
        ("missing", "rt-a", "t-missing", "route-platinum", {}),
        ("forbidden", "rt-closed", "t-forbidden", "route-gold", {}),
        ("adapter", "rt-a", "t-adapter", "route-gold", {"allowedAdapters": ["other"]}),
        ("greedy", "rt-a", "t-greedy", "route-gold", {"quotas": {"requestsPerMinute": 6000}}),
        ("nosecret", "rt-a", "t-nosecret", "route-gold", {}),
    ]
    for name, ns, tenant, cls, spec in bindings:
        secret = [keys_secret(name, ns, f"sk-{name}")] if name != "nosecret" else []
        assert kv.apply(*secret, tenant_binding(name, ns, tenant, cls, **spec)).returncode == 0
    # a later binding claiming an existing tenant id, with the first one's API key as well
    wait(
        lambda: condition(kv.json("get", "tb", "ok", "-n", "rt-a"), "Bound").get("status") == "True",
        "ok Bound",
        120,
    )
    dup = tenant_binding("dup", "rt-b", "t-ok", "route-gold")
    assert kv.apply(keys_secret("dup", "rt-b", "sk-dup"), dup).returncode == 0
    expected = {
        ("rt-a", "ok"): ("True", "False", "Bound"),
        ("rt-rogue", "silver"): ("True", "False", "Bound"),
        ("rt-rogue", "rogue"): ("False", "True", "NamespaceNotAdmitted"),
        ("rt-a", "missing"): ("False", "True", "TrustClassNotFound"),
        ("rt-closed", "forbidden"): ("False", "True", "ApiKeySecretForbidden"),
        ("rt-a", "adapter"): ("False", "True", "AdapterNotInTrustClass"),
        ("rt-a", "greedy"): ("False", "True", "QuotaExceedsClassLimit"),
        ("rt-a", "nosecret"): ("False", "True", "ApiKeySecretNotFound"),
        ("rt-b", "dup"): ("False", "True", "DuplicateTenantId"),
    }

    def statuses() -> dict[tuple[str, str], tuple[str, str, str]]:
        out = {}
        for item in kv.json("get", "tenantbindings", "-A")["items"]:
            key = (item["metadata"]["namespace"], item["metadata"]["name"])
            if key in expected:
                b, d = condition(item, "Bound"), condition(item, "Denied")
                reason = d.get("reason") if d.get("status") == "True" else b.get("reason")
                out[key] = (b.get("status"), d.get("status"), reason)
                assert b.get("observedGeneration") == item["metadata"]["generation"]
        return out

    wait(
        lambda: statuses() == expected,
        "binding statuses",
        120,
        dump=lambda: f"{statuses()}\n{operator.tail()}",
    )
    table = kv.routing_table()
    assert set(table["tenants"]) == {"t-ok", "t-silver"}
    ok = table["tenants"]["t-ok"]
    assert ok["trustClass"] == "route-gold" and ok["binding"] == "rt-a/ok"
    assert ok["apiKeyHashes"] == [sha("sk-ok")]
    assert ok["allowedAdapters"] == ["support"] and ok["quotas"]["requestsPerMinute"] == 120

    # the tenant's KV quota reaches the engine config, without restarting the engine
    def engine_tenants() -> Any:
        cm = kv.json("get", "configmap", "kvfence-engine-config", "-n", "kvf-route-gold")
        return json.loads(cm["data"]["engine.json"])["quotas"]["tenants"]

    wait(
        lambda: engine_tenants() == {"t-ok": {"maxBlocks": 256, "guaranteedBlocks": 0}}, "tenant KV quota", 60
    )
    assert (
        kv.json("get", "deployment", "kvfence-engine", "-n", "kvf-route-gold")["metadata"]["generation"] == 1
    )
    gold = table["trustClasses"]["route-gold"]
    assert gold["endpoint"] == "http://kvfence-engine.kvf-route-gold.svc.cluster.local:8000"
    assert gold["servedModels"] == ["tiny"] and gold["adapters"] == ["support"]
    signing = kv.json("get", "secret", "kvfence-signing-key", "-n", "kvf-route-gold")["data"]["current"]
    assert gold["signingKeys"] == [signing]
    text = json.dumps(table)
    for name, *_ in bindings:
        assert f"sk-{name}" not in text  # only hashes
        if name not in ("ok", "silver"):
            assert sha(f"sk-{name}") not in text, f"denied binding {name} reached the routing table"
    assert sha("sk-dup") not in text
    # Events tell what happened
    events = kv("get", "events", "-n", "rt-rogue", "--field-selector", "involvedObject.name=rogue").stdout
    assert "NamespaceNotAdmitted" in events
    # admitting the namespace later binds the tenant
    kv("label", "namespace", "rt-rogue", "kvfence.dev/tenants=gold")
    wait(
        lambda: "t-rogue" in kv.routing_table()["tenants"],
        "t-rogue routed after its namespace is admitted",
        120,
    )
    # the class's status counts its tenants
    wait(
        lambda: kv.json("get", "trustclass", "route-gold")["status"].get("boundTenants") == 2,
        "boundTenants",
        60,
    )
    # a key rotated in the tenant's Secret is picked up (resync)
    kv.apply(keys_secret("ok", "rt-a", "sk-ok-2"))
    wait(
        lambda: kv.routing_table()["tenants"]["t-ok"]["apiKeyHashes"] == [sha("sk-ok-2")],
        "rotated API key",
        60,
    )
    for ns in ("rt-a", "rt-b", "rt-rogue", "rt-closed"):
        kv("delete", "namespace", ns, "--wait=false")


def test_health_metrics_and_json_logs(operator: Any) -> None:
    assert operator._get("/healthz")[0] == 200 and operator.ready()
    m = operator.metrics()
    assert any(k.startswith("kvfence_operator_reconciles_total") for k in m)
    assert any(k.startswith("kvfence_operator_reconcile_duration_seconds") for k in m)
    assert m["kvfence_operator_leader"] == 1
    lines = [line for line in operator.log.read_text().splitlines() if line.strip()]
    assert lines
    for line in lines:
        rec = json.loads(line)
        assert {"time", "level", "logger", "message"} <= set(rec)


def test_drift_is_repaired(operator: Any, kv: Any, wait: Any, cleanup: list[str]) -> None:
    cleanup.append("drift")
    assert kv.apply(trust_class("drift", replicas=2, resources={"gpu": {"count": 1}})).returncode == 0
    wait(lambda: ready(kv, "drift"), "drift Ready", 180, dump=operator.tail)
    ns = "kvf-drift"
    kv("scale", "deployment/kvfence-engine", "-n", ns, "--replicas=0")
    wait(
        lambda: kv.json("get", "deployment", "kvfence-engine", "-n", ns)["spec"]["replicas"] == 2,
        "replicas restored",
        60,
        dump=operator.tail,
    )
    kv("delete", "service", "kvfence-engine", "-n", ns)
    wait(lambda: kv.json("get", "service", "kvfence-engine", "-n", ns) is not None, "service back", 60)
    kv(
        "patch",
        "configmap",
        "kvfence-engine-config",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"data":{"engine.json":"{}"}}',
    )
    wait(
        lambda: (
            json.loads(
                kv.json("get", "configmap", "kvfence-engine-config", "-n", ns)["data"]["engine.json"]
            ).get("trustClass")
            == "drift"
        ),
        "config restored",
        60,
    )
    kv("delete", "networkpolicy", "kvfence-engine-ingress", "-n", ns)
    np = wait(
        lambda: kv.json("get", "networkpolicy", "kvfence-engine-ingress", "-n", ns),
        "netpol back",
        60,
    )
    assert len(np["spec"]["ingress"]) == 1  # the router only: no metrics scraper unless configured
    kv("delete", "pdb", "kvfence-engine", "-n", ns)
    wait(lambda: kv.json("get", "pdb", "kvfence-engine", "-n", ns) is not None, "pdb back", 60)
    # The signing-key Secret is watched by name: a deleted one comes back (a new key).
    kv("delete", "secret", "kvfence-signing-key", "-n", ns)
    wait(
        lambda: kv.json("get", "secret", "kvfence-signing-key", "-n", ns) is not None, "signing key back", 60
    )
    wait(lambda: ready(kv, "drift"), "drift Ready again", 120)


def test_shared_prefixes_reach_the_engine_config_without_a_restart(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup.append("shared")
    ns = "kvf-shared"
    prefixes = [
        {"name": "support", "form": "chat", "text": "You are the support bot of ACME."},
        {"name": "tools", "form": "completion", "configMapKeyRef": {"name": "prompts", "key": "tools"}},
    ]
    tc = trust_class(
        "shared", replicas=1, resources={"gpu": {"count": 0}}, prefixCache={"sharedPrefixes": prefixes}
    )
    assert kv.apply(tc).returncode == 0

    def degraded() -> dict[str, Any]:
        c = condition(kv.json("get", "trustclass", "shared"), "Degraded")
        return c if c.get("reason") == "SharedPrefixUnresolved" else {}

    c = wait(degraded, "Degraded: SharedPrefixUnresolved", 60, dump=operator.tail)
    assert (
        f"ConfigMap {ns}/prompts does not exist" in c["message"] and "sharedPrefixes[tools]" in c["message"]
    )
    assert kv.json("get", "configmap", "kvfence-engine-config", "-n", ns) is None  # nothing half-applied

    def engine_config() -> dict[str, Any]:
        cm = kv.json("get", "configmap", "kvfence-engine-config", "-n", ns)
        return json.loads(cm["data"]["engine.json"]) if cm else {}

    def template() -> dict[str, Any]:
        return kv.json("get", "deployment", "kvfence-engine", "-n", ns)["spec"]["template"]  # type: ignore[no-any-return]

    prompts = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "prompts", "namespace": ns, "labels": {"kvfence.dev/shared-prefixes": "true"}},
        "data": {"tools": "Tools: search(query). Answer with JSON."},
    }
    assert kv.apply(prompts).returncode == 0
    wait(lambda: ready(kv, "shared"), "shared Ready", 180, dump=operator.tail)
    assert engine_config()["prefixCache"]["sharedPrefixes"] == [
        {"name": "support", "form": "chat", "text": "You are the support bot of ACME."},
        {"name": "tools", "form": "completion", "text": "Tools: search(query). Answer with JSON."},
    ]
    before = template()
    # an edit of the labelled ConfigMap reaches the engine config (the watch), the pods stay
    prompts["data"]["tools"] = "Tools: search(query), order(id). Answer with JSON."
    assert kv.apply(prompts).returncode == 0
    wait(
        lambda: engine_config()["prefixCache"]["sharedPrefixes"][1]["text"] == prompts["data"]["tools"],
        "new tools text in the engine config",
        60,
        dump=operator.tail,
    )
    patch = [
        {"op": "replace", "path": "/spec/prefixCache/sharedPrefixes/0/text", "value": "You are ACME's bot."}
    ]
    kv("patch", "trustclass", "shared", "--type=json", "-p", json.dumps(patch))
    wait(
        lambda: engine_config()["prefixCache"]["sharedPrefixes"][0]["text"] == "You are ACME's bot.",
        "new inline text in the engine config",
        60,
    )
    wait(lambda: ready(kv, "shared"), "shared Ready", 120)
    assert template() == before  # no engine restart for either change


def test_signing_key_rotation(operator: Any, kv: Any, wait: Any, cleanup: list[str]) -> None:
    cleanup.append("rotate")
    assert kv.apply(trust_class("rotate", replicas=1, resources={"gpu": {"count": 0}})).returncode == 0
    wait(lambda: ready(kv, "rotate"), "rotate Ready", 180, dump=operator.tail)
    before = kv.json("get", "secret", "kvfence-signing-key", "-n", "kvf-rotate")["data"]
    assert set(before) == {"current"} and len(base64.b64decode(before["current"])) == 32
    # reconciling again keeps the key
    kv("annotate", "trustclass", "rotate", "example.com/poke=1")
    kv("annotate", "trustclass", "rotate", "kvfence.dev/rotate-signing-key=r1")

    def rotated() -> bool:
        data = kv.json("get", "secret", "kvfence-signing-key", "-n", "kvf-rotate")["data"]
        return data.get("previous") == before["current"] and data["current"] != before["current"]

    template = kv.json("get", "deployment", "kvfence-engine", "-n", "kvf-rotate")["spec"]["template"]
    wait(rotated, "key rotated", 60, interval=0.1, dump=operator.tail)
    after = kv.json("get", "secret", "kvfence-signing-key", "-n", "kvf-rotate")["data"]
    # the router signs with the old key until the new one has propagated (--signing-key-propagation-seconds)
    keys = wait(
        lambda: kv.routing_table()["trustClasses"]["rotate"]["signingKeys"] or None, "routing keys", 10
    )
    assert keys in ([after["previous"], after["current"]], [before["current"]]), keys
    wait(
        lambda: (
            kv.routing_table()["trustClasses"]["rotate"]["signingKeys"]
            == [after["current"], after["previous"]]
        ),
        "routing table carries both keys, new first",
        60,
    )
    # no engine restart: the kubelet refreshes the mounted Secret and the engines reload it
    assert kv.json("get", "deployment", "kvfence-engine", "-n", "kvf-rotate")["spec"]["template"] == template
    # the same token does not rotate again
    kv("annotate", "trustclass", "rotate", "example.com/poke=2", "--overwrite")
    wait(lambda: ready(kv, "rotate"), "rotate Ready", 120)
    assert kv.json("get", "secret", "kvfence-signing-key", "-n", "kvf-rotate")["data"] == after


def test_deleting_a_trustclass_removes_everything(operator: Any, kv: Any, wait: Any) -> None:
    objs = [
        trust_class("doomed", replicas=1, resources={"gpu": {"count": 1}}, namespaceSelector={}),
        *tenant_namespace("doomed-tenants", label=None, grant=True),
        keys_secret("victim", "doomed-tenants", "sk-victim"),
        tenant_binding("victim", "doomed-tenants", "t-victim", "doomed"),
    ]
    assert kv.apply(*objs).returncode == 0
    wait(lambda: ready(kv, "doomed"), "doomed Ready", 180, dump=operator.tail)
    wait(lambda: "t-victim" in kv.routing_table()["tenants"], "victim routed", 60)
    obj = kv.json("get", "trustclass", "doomed")
    assert "kvfence.dev/cleanup" in obj["metadata"]["finalizers"]
    ns = kv.json("get", "namespace", "kvf-doomed")
    assert ns["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    for kind in ("deployment", "service", "configmap", "networkpolicy", "pdb"):
        child = kv.json("get", kind, "-n", "kvf-doomed", "-l", "kvfence.dev/trust-class=doomed")["items"]
        assert child and all(c["metadata"]["ownerReferences"][0]["kind"] == "TrustClass" for c in child)
    kv("delete", "trustclass", "doomed", "--wait=false")
    # A revocation: the class and its tenants leave the routing table within seconds of the delete,
    # before the finalizer has taken the class's children down.
    wait(
        lambda: (
            "t-victim" not in kv.routing_table()["tenants"]
            and "doomed" not in kv.routing_table()["trustClasses"]
        ),
        "class deleted: its tenants unrouted within seconds",
        10,
        0.2,
    )
    wait(lambda: kv.json("get", "trustclass", "doomed") is None, "TrustClass gone (finalizer released)", 120)
    table = kv.routing_table()
    assert "doomed" not in table["trustClasses"] and "t-victim" not in table["tenants"]
    wait(lambda: kv.json("get", "namespace", "kvf-doomed") is None, "namespace and children gone", 180)
    wait(
        lambda: (
            condition(kv.json("get", "tb", "victim", "-n", "doomed-tenants"), "Denied").get("reason")
            == "TrustClassNotFound"
        ),
        "binding Denied",
        60,
    )
    kv("delete", "namespace", "doomed-tenants", "--wait=false")


def test_namespace_conflict_is_degraded_not_adopted(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    kv("create", "namespace", "someone-elses")
    cleanup.append("squatter")
    assert kv.apply(trust_class("squatter", namespace="someone-elses", replicas=0)).returncode == 0

    def degraded() -> bool:
        return (
            condition(kv.json("get", "trustclass", "squatter"), "Degraded").get("reason")
            == "NamespaceConflict"
        )

    wait(degraded, "Degraded NamespaceConflict", 60, dump=operator.tail)
    assert kv.json("get", "deployments", "-n", "someone-elses")["items"] == []
    kv("delete", "trustclass", "squatter", "--wait=false")
    wait(lambda: kv.json("get", "trustclass", "squatter") is None, "squatter deleted", 60)
    assert kv.json("get", "namespace", "someone-elses") is not None  # never deleted: not ours
    cleanup.clear()
    kv("delete", "namespace", "someone-elses", "--wait=false")


def test_a_stored_class_with_a_forbidden_extra_arg_is_degraded_and_its_engine_left_alone(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    """A TrustClass stored before the CRD refused a flag in engine.extraArgs (here: the CRD without that
    rule, for as long as it takes to write one): the operator never renders the flag, keeps the engine it
    last rendered and the class's routes, and says why in a condition and an Event naming the flag."""
    cleanup.append("extra-args")
    crd_path = ROOT / "crds" / "kvfence.dev_trustclasses.yaml"
    current = yaml.safe_load(crd_path.read_text())
    lax = copy.deepcopy(current)
    spec_props = lax["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    del spec_props["engine"]["properties"]["extraArgs"]["items"]["x-kubernetes-validations"]
    good = trust_class("extra-args", resources={"gpu": {"count": 0}}, replicas=0)
    assert kv.apply(good).returncode == 0
    wait(lambda: "extra-args" in kv.routing_table()["trustClasses"], "class routed", 120, dump=operator.tail)
    wait(lambda: kv.json("get", "deploy", "kvfence-engine", "-n", "kvf-extra-args"), "engine", 60)
    before = kv.json("get", "deploy", "kvfence-engine", "-n", "kvf-extra-args")["metadata"]["generation"]
    bad_args = ["--log-level=DEBUG", "--signing-key-dir=/tmp/mine"]
    bad = trust_class("extra-args", resources={"gpu": {"count": 0}}, replicas=0)
    bad["spec"]["engine"] = {**bad["spec"]["engine"], "extraArgs": bad_args}

    def install(crd: dict[str, Any]) -> None:
        kv("apply", "--server-side", "--force-conflicts", "--field-manager=kvfence-tests", "-f", "-",
           input=json.dumps(crd))  # fmt: skip

    try:
        install(lax)
        wait(lambda: kv.apply(bad).returncode == 0, "the class stored without the rule", 60)
    finally:
        install(current)
        wait(
            lambda: kv.apply({**bad, "metadata": {"name": "extra-args-probe"}}).returncode != 0,
            "the rule in force again",
            60,
        )
    msg = f"engine.extraArgs: --signing-key-dir=/tmp/mine refused: {engine_args.reason('--signing-key-dir')}"

    def degraded() -> bool:
        obj = kv.json("get", "trustclass", "extra-args")
        c = condition(obj, "Degraded")
        return bool(
            c.get("status") == "True"
            and c.get("reason") == "ForbiddenExtraArgs"
            and msg in c.get("message", "")
            and c.get("observedGeneration") == obj["metadata"]["generation"]
            and condition(obj, "Ready").get("status") == "False"
        )

    wait(degraded, "Degraded: ForbiddenExtraArgs naming the flag", 60, dump=operator.tail)
    events = kv.json("get", "events", "-n", "default", "--field-selector", "reason=ForbiddenExtraArgs")
    assert any(msg in e["message"] for e in events["items"]), events
    dep = kv.json("get", "deploy", "kvfence-engine", "-n", "kvf-extra-args")
    assert dep["metadata"]["generation"] == before
    assert not any(
        "signing-key-dir" in a for a in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    )
    assert "extra-args" in kv.routing_table()["trustClasses"]
    # dropping the flag clears it
    assert (
        kv.apply(
            {**bad, "spec": {**bad["spec"], "engine": {**bad["spec"]["engine"], "extraArgs": bad_args[:1]}}}
        ).returncode
        == 0
    )
    wait(
        lambda: condition(kv.json("get", "trustclass", "extra-args"), "Degraded").get("status") == "False",
        "not Degraded once the flag is gone",
        60,
        dump=operator.tail,
    )
    wait(
        lambda: (
            "--log-level=DEBUG"
            in kv.json("get", "deploy", "kvfence-engine", "-n", "kvf-extra-args")["spec"]["template"]["spec"][
                "containers"
            ][0]["command"]
        ),
        "the allowed flag rendered",
        60,
    )


def test_kubectl_scale_sizes_the_engine_through_the_scale_subresource(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup.append("scaled")
    assert kv.apply(trust_class("scaled", resources={"gpu": {"count": 0}})).returncode == 0
    wait(lambda: ready(kv, "scaled"), "one replica ready", 180, dump=operator.tail)
    kv("scale", "trustclass", "scaled", "--replicas", "2")
    assert kv.json("get", "trustclass", "scaled")["spec"]["replicas"] == 2

    def scaled_to(n: int) -> dict[str, Any] | None:
        obj = kv.json("get", "trustclass", "scaled")
        st = obj.get("status") or {}
        ok = ready(kv, "scaled") if n else condition(obj, "Ready").get("reason") == "ScaledToZero"
        return st if ok and st.get("desiredReplicas") == n and st.get("readyReplicas") == n else None

    st = wait(lambda: scaled_to(2), "two replicas ready", 180, dump=operator.tail)
    assert st["replicas"] == 2
    dep = kv.json("get", "deploy", "kvfence-engine", "-n", "kvf-scaled")
    assert dep["spec"]["replicas"] == 2
    scale = kv.json("get", "trustclass", "scaled", "--subresource=scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    selector = scale["status"]["selector"]
    assert selector == "app.kubernetes.io/instance=scaled,app.kubernetes.io/name=kvfence-engine"
    assert len(pods_with(kv, "kvf-scaled", selector)) == 2
    kv("scale", "trustclass", "scaled", "--replicas", "0")
    wait(lambda: scaled_to(0), "scaled to zero", 180, dump=operator.tail)
    wait(lambda: not pods_with(kv, "kvf-scaled", selector), "no engine pods", 120)


def pods_with(kv: Any, ns: str, selector: str) -> list[dict[str, Any]]:
    got = kv.json("get", "pods", "-n", ns, "-l", selector)
    return [p for p in (got or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]


def test_an_autoscaler_owns_the_engine_replicas_with_replicas_managed_externally(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    """An HPA or KEDA in the class namespace writes deployment/kvfence-engine's /scale: with
    ``replicasManagedExternally`` the operator never fights it, and hands the count over unchanged."""
    cleanup.append("autoscaled")
    ns = "kvf-autoscaled"
    assert kv.apply(trust_class("autoscaled", replicas=2, resources={"gpu": {"count": 0}})).returncode == 0
    wait(lambda: ready(kv, "autoscaled"), "two replicas ready", 180, dump=operator.tail)

    def dep() -> dict[str, Any]:
        got: dict[str, Any] = kv.json("get", "deploy", "kvfence-engine", "-n", ns, "--show-managed-fields")
        return got

    def managers_of_replicas() -> set[str]:
        return {
            m["manager"]
            for m in dep()["metadata"]["managedFields"]
            if "f:replicas" in (m.get("fieldsV1") or {}).get("f:spec", {})
        }

    assert "kvfence-operator" in managers_of_replicas()
    # Both at once is refused, naming the field (and the fix).
    both = trust_class(
        "autoscaled", replicas=2, replicasManagedExternally=True, resources={"gpu": {"count": 0}}
    )
    res = kv.apply(both)
    assert res.returncode != 0 and "spec.replicas" in res.stderr and "replicasManagedExternally" in res.stderr
    # Hand the replicas over: the tests' field manager drops spec.replicas in the same apply.
    ext = trust_class("autoscaled", replicasManagedExternally=True, resources={"gpu": {"count": 0}})
    assert kv.apply(ext).returncode == 0
    assert "replicas" not in kv.json("get", "trustclass", "autoscaled")["spec"]
    wait(lambda: "kvfence-operator" not in managers_of_replicas(), "the operator lets go of replicas", 60)
    assert dep()["spec"]["replicas"] == 2  # kept, not reset to the Deployment default
    generation = dep()["metadata"]["generation"]

    # What an HPA controller does: write the Deployment's /scale.
    kv("scale", "deployment/kvfence-engine", "-n", ns, "--replicas=3")

    def status_at(n: int) -> bool:
        st = kv.json("get", "trustclass", "autoscaled").get("status") or {}
        return st.get("desiredReplicas") == n and st.get("readyReplicas") == n and ready(kv, "autoscaled")

    wait(lambda: status_at(3), "status shows the autoscaler's 3 replicas, ready", 180, dump=operator.tail)
    # A reconcile after the write (a class edit that needs no new pods) leaves it alone.
    edited = trust_class(
        "autoscaled",
        replicasManagedExternally=True,
        resources={"gpu": {"count": 0}},
        quotas={"defaults": {"requestsPerMinute": 100}},
    )
    assert kv.apply(edited).returncode == 0
    tc_gen = kv.json("get", "trustclass", "autoscaled")["metadata"]["generation"]
    wait(
        lambda: kv.json("get", "trustclass", "autoscaled")["status"].get("observedGeneration") == tc_gen,
        "the edit reconciled",
        60,
    )
    assert dep()["spec"]["replicas"] == 3 and dep()["metadata"]["generation"] == generation + 1
    # kubectl scale on the TrustClass is refused while the autoscaler owns the count.
    res = kv("scale", "trustclass", "autoscaled", "--replicas", "1", check=False)
    assert res.returncode != 0 and "replicasManagedExternally" in res.stderr, res.stderr
    kv("scale", "deployment/kvfence-engine", "-n", ns, "--replicas=1")
    wait(lambda: status_at(1), "status follows the autoscaler down to 1", 180, dump=operator.tail)

    # Back to the operator: spec.replicas is the count again, and drift is repaired.
    assert kv.apply(trust_class("autoscaled", replicas=2, resources={"gpu": {"count": 0}})).returncode == 0
    wait(
        lambda: dep()["spec"]["replicas"] == 2, "the operator sizes the engine again", 60, dump=operator.tail
    )
    assert "kvfence-operator" in managers_of_replicas()
    wait(lambda: status_at(2), "two replicas ready", 180)


def hpa_manifest(ns: str, min_replicas: int, max_replicas: int = 4) -> dict[str, Any]:
    """An ``autoscaling/v2`` HPA on the class's engine, on vLLM's queue (docs/operations.md). No
    custom metrics API is served here, so it never reads the metric: the HPA controller only raises a
    target below ``minReplicas`` to it (and lowers one above ``maxReplicas``), which needs none."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "kvfence-engine", "namespace": ns},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvfence-engine"},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm:num_requests_waiting"},
                        "target": {"type": "AverageValue", "averageValue": "4"},
                    },
                }
            ],
        },
    }


def test_a_real_hpa_sizes_an_externally_managed_engine_and_the_operator_never_fights_it(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    """kube-controller-manager's HPA controller (the cluster runs it), not a simulation of it: it
    writes deployment/kvfence-engine's /scale, the operator leaves the count alone across a later
    reconcile, and the class's status follows the Deployment."""
    cleanup.append("hpa")
    ns = "kvf-hpa"
    spec: dict[str, Any] = {"replicasManagedExternally": True, "resources": {"gpu": {"count": 0}}}
    assert kv.apply(trust_class("hpa", **spec)).returncode == 0

    def dep() -> dict[str, Any]:
        got: dict[str, Any] = kv.json("get", "deploy", "kvfence-engine", "-n", ns, "--show-managed-fields")
        return got

    def operator_owns_replicas() -> bool:
        return any(
            m["manager"] == "kvfence-operator" and "f:replicas" in (m.get("fieldsV1") or {}).get("f:spec", {})
            for m in dep()["metadata"]["managedFields"]
        )

    def status_at(n: int) -> dict[str, Any] | None:
        st: dict[str, Any] = kv.json("get", "trustclass", "hpa").get("status") or {}
        ok = st.get("desiredReplicas") == n and st.get("replicas") == n and st.get("readyReplicas") == n
        return st if ok and ready(kv, "hpa") else None

    # Created without replicas: the Deployment default, 1 (an HPA leaves a target at 0 alone).
    wait(lambda: status_at(1), "one replica ready", 180, dump=operator.tail)
    assert kv.apply(hpa_manifest(ns, min_replicas=2)).returncode == 0
    wait(lambda: dep()["spec"]["replicas"] == 2, "the HPA raises the engine to minReplicas", 120)
    events = kv.json("get", "events", "-n", ns, "--field-selector", "reason=SuccessfulRescale")
    assert any(
        e["involvedObject"]["kind"] == "HorizontalPodAutoscaler" and "below Spec.MinReplicas" in e["message"]
        for e in events["items"]
    ), events
    assert not operator_owns_replicas()  # what the HPA wrote through /scale is not the operator's
    wait(lambda: status_at(2), "status shows the HPA's 2 replicas, ready", 180, dump=operator.tail)
    # ... and the HPA, at its next sync, finds the count it set: nothing to change.
    wait(
        lambda: (
            (kv.json("get", "hpa", "kvfence-engine", "-n", ns).get("status") or {}).get("currentReplicas")
            == 2
        ),
        "the HPA sees 2 replicas",
        90,
    )

    # An unrelated class edit (a quota: the engine's config, not its pod template): the operator
    # applies the engine Deployment again and leaves the count alone. The Deployment keeps its
    # generation: a count set back by the operator and raised again by the HPA would be two more.
    generation = dep()["metadata"]["generation"]
    edited = trust_class("hpa", **spec, quotas={"defaults": {"requestsPerMinute": 100}})
    assert kv.apply(edited).returncode == 0
    tc_gen = kv.json("get", "trustclass", "hpa")["metadata"]["generation"]
    wait(
        lambda: (kv.json("get", "trustclass", "hpa").get("status") or {}).get("observedGeneration") == tc_gen,
        "the edit reconciled",
        60,
        dump=operator.tail,
    )
    wait(lambda: status_at(2), "two replicas ready after the edit", 180, dump=operator.tail)
    assert dep()["spec"]["replicas"] == 2 and dep()["metadata"]["generation"] == generation
    assert not operator_owns_replicas()

    # The HPA keeps driving: a higher floor raises the engine, and the status follows.
    assert kv.apply(hpa_manifest(ns, min_replicas=3)).returncode == 0
    wait(lambda: status_at(3), "status shows the HPA's 3 replicas, ready", 180, dump=operator.tail)
    assert dep()["metadata"]["generation"] == generation + 1
