"""Weights and adapters on the real control plane, with the operator under its own ServiceAccount: the
engine pods a GPU class with a model cache, a gated model's token, pull secrets, extra env and an
adapter volume renders; the model-cache claim across the class's life (Retain keeps it and its
namespace, a class created again mounts it again, Delete takes it); an existing claim never deleted;
a token Secret the operator may not read or that does not exist reported as a condition and an Event
until it is there (nothing applied meanwhile, the class never touched); claim changes Kubernetes
cannot make refused with a condition; a deleted claim created again."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from cluster.manifests import condition, secret, trust_class

from kvfence.operator import rbac

pytestmark = pytest.mark.cluster

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
#: the gated model's token: it must never appear outside its own Secret
TOKEN = "hf_kvfence-test-token-0123456789"


def vllm_class(name: str, **engine: Any) -> dict[str, Any]:
    return trust_class(
        name,
        engine={
            "runtime": "vllm",
            "image": "kvfence/engine-vllm:dev",
            "model": {"name": "org/gated-model"},
            **engine,
        },
        resources={"gpu": {"count": 1}},
        placement={"tolerations": [GPU_TOLERATION]},
    )


@pytest.fixture
def namespaces(kv: Any, wait: Any) -> Iterator[list[str]]:
    """Classes' namespaces a test leaves behind on purpose (kept claims): deleted afterwards."""
    names: list[str] = []
    yield names
    for ns in names:
        kv("delete", "namespace", ns, "--ignore-not-found", "--wait=false")
    for ns in names:
        wait(lambda n=ns: kv.json("get", "namespace", n) is None, f"namespace {ns} gone", 180)


def _delete_class(kv: Any, wait: Any, name: str) -> None:
    kv("delete", "trustclass", name, "--ignore-not-found", "--wait=false")
    wait(lambda: kv.json("get", "trustclass", name) is None, f"TrustClass {name} gone", 120)


def _stalled(kv: Any, name: str, reason: str) -> dict[str, Any] | None:
    obj = kv.json("get", "trustclass", name)
    gen = obj["metadata"]["generation"]
    st, deg = condition(obj, "Stalled"), condition(obj, "Degraded")
    ok = (
        st.get("status") == "True"
        and st.get("reason") == reason
        and deg.get("reason") == reason
        and st.get("observedGeneration") == gen
    )
    return obj if ok else None


def _events(kv: Any, reason: str, name: str) -> list[dict[str, Any]]:
    got = kv.json("get", "events", "-n", "default", "--field-selector", f"reason={reason}")
    return [e for e in got["items"] if e["involvedObject"]["name"] == name]


def _claim_uid(kv: Any, ns: str, name: str = "kvfence-model-cache") -> str | None:
    pvc = kv.json("get", "pvc", name, "-n", ns)
    if pvc is None or pvc["metadata"].get("deletionTimestamp"):
        return None
    return str(pvc["metadata"]["uid"])


def test_a_gated_model_with_a_retained_cache_and_adapters(
    operator: Any, kv: Any, wait: Any, namespaces: list[str]
) -> None:
    name, ns = "mc-gated", "kvf-mc-gated"
    namespaces.append(ns)
    body = vllm_class(
        name,
        model={"name": "org/gated-model", "tokenSecretRef": {"name": "hf-token"}},
        modelCache={"volumeClaim": {"size": "1Gi"}},  # Retain by default
        imagePullSecrets=[{"name": "registry"}],
        extraEnv=[{"name": "HF_HUB_ENABLE_HF_TRANSFER", "value": "1"}],
        extraVolumes=[{"name": "loras", "persistentVolumeClaim": {"claimName": "lora-adapters"}}],
        extraVolumeMounts=[{"name": "loras", "mountPath": "/adapters"}],
        adapters=[{"name": "support-bot", "source": "/adapters/support-bot"}],
    )
    assert kv.apply(body).returncode == 0
    # 1. The operator may not read Secrets in the class namespace yet: Stalled, an Event, no engine.
    wait(
        lambda: _stalled(kv, name, "ModelTokenSecretForbidden"),
        "Stalled: token forbidden",
        60,
        dump=operator.tail,
    )
    msg = condition(kv.json("get", "trustclass", name), "Stalled")["message"]
    assert f"Secret {ns}/hf-token" in msg and rbac.TENANT_SECRETS_ROLE in msg, msg
    assert kv.json("get", "deployment", "kvfence-engine", "-n", ns) is None
    wait(lambda: _events(kv, "ModelTokenSecretForbidden", name), "Event ModelTokenSecretForbidden", 30)
    # 2. Granted, but no Secret: the condition says so, naming the Secret and the key.
    assert kv.apply(rbac.tenant_secrets_binding(ns, "kvfence-system")).returncode == 0
    wait(
        lambda: _stalled(kv, name, "ModelTokenSecretMissing"),
        "Stalled: token missing",
        60,
        dump=operator.tail,
    )
    msg = condition(kv.json("get", "trustclass", name), "Stalled")["message"]
    assert msg == f"engine.model.tokenSecretRef: Secret {ns}/hf-token does not exist", msg
    wait(lambda: _events(kv, "ModelTokenSecretMissing", name), "Event ModelTokenSecretMissing", 30)
    assert kv.json("get", "deployment", "kvfence-engine", "-n", ns) is None
    # ... a Secret without the key is no better
    assert kv.apply(secret("hf-token", ns, other=TOKEN)).returncode == 0
    wait(
        lambda: "has no key 'token'" in condition(kv.json("get", "trustclass", name), "Stalled")["message"],
        "Stalled: the key named",
        60,
    )
    # 3. The Secret appears: the class goes on by itself (never touched), and the engine is rendered.
    generation = kv.json("get", "trustclass", name)["metadata"]["generation"]
    kv("delete", "secret", "hf-token", "-n", ns)
    assert kv.apply(secret("hf-token", ns, token=TOKEN)).returncode == 0
    dep = wait(lambda: kv.json("get", "deployment", "kvfence-engine", "-n", ns), "engine Deployment", 60)
    wait(
        lambda: condition(kv.json("get", "trustclass", name), "Stalled").get("status") == "False",
        "Stalled cleared",
        60,
        dump=operator.tail,
    )
    tc = kv.json("get", "trustclass", name)
    assert tc["metadata"]["generation"] == generation
    assert condition(tc, "Degraded")["status"] == "False"
    # the claim: created by the operator, labelled, not owned (Retain)
    pvc = kv.json("get", "pvc", "kvfence-model-cache", "-n", ns)
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["metadata"]["labels"]["app.kubernetes.io/component"] == "model-cache"
    assert pvc["metadata"]["labels"]["kvfence.dev/trust-class"] == name
    assert not pvc["metadata"].get("ownerReferences")
    claim_uid = pvc["metadata"]["uid"]
    # the rendered pods, as the ReplicaSet created them from the Deployment
    pod = wait(
        lambda: (kv.json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}") or {}).get(
            "items"
        ),
        "engine pod created",
        60,
    )[0]
    spec = pod["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"]["claimName"] == "kvfence-model-cache"
    assert vols["loras"]["persistentVolumeClaim"] == {"claimName": "lora-adapters", "readOnly": True}
    (c,) = spec["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/cache"]["name"] == "cache" and mounts["/adapters"]["readOnly"] is True
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HOME"]["value"] == "/cache/huggingface"
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    assert env["HF_HUB_ENABLE_HF_TRANSFER"]["value"] == "1"
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert "support-bot=/adapters/support-bot" in c["args"]
    # the token's value is nowhere but its Secret: not in the Deployment, its pods, a ConfigMap, an
    # annotation, an Event, the TrustClass or the operator's log
    encoded = base64.b64encode(TOKEN.encode()).decode()
    for what in (
        ["get", "deployments,replicasets,pods,configmaps,events", "-n", ns],
        ["get", "events", "-n", "default"],
        ["get", "trustclass", name],
        ["get", "namespace", ns],
    ):
        text = json.dumps(kv.json(*what))
        assert TOKEN not in text and encoded not in text, what
    assert TOKEN not in operator.log.read_text() and encoded not in operator.log.read_text()
    assert dep is not None

    # 4. Deleting the class keeps the claim (Retain) and so the namespace that holds it; every other
    # child goes with the class.
    _delete_class(kv, wait, name)
    wait(lambda: kv.json("get", "deployment", "kvfence-engine", "-n", ns) is None, "engine GC'd", 120)
    wait(lambda: kv.json("get", "configmap", "kvfence-engine-config", "-n", ns) is None, "config GC'd", 120)
    kept = kv.json("get", "namespace", ns)
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    assert not kept["metadata"].get("ownerReferences")
    assert _claim_uid(kv, ns) == claim_uid
    assert any("kept with the model cache claim" in e["message"] for e in _events(kv, "Deleted", name))

    # 5. The class created again adopts its namespace and mounts the same claim.
    assert kv.apply(body).returncode == 0
    wait(
        lambda: kv.json("get", "deployment", "kvfence-engine", "-n", ns),
        "engine Deployment again",
        60,
        dump=operator.tail,
    )
    again = kv.json("get", "trustclass", name)
    owners = kv.json("get", "namespace", ns)["metadata"].get("ownerReferences") or []
    assert [o["uid"] for o in owners] == [again["metadata"]["uid"]]
    assert _claim_uid(kv, ns) == claim_uid

    # 6. Delete as its policy: the claim becomes the class's, and goes with it and its namespace.
    delete = json.loads(json.dumps(body))
    delete["spec"]["engine"]["modelCache"]["volumeClaim"]["retentionPolicy"] = {"whenDeleted": "Delete"}
    assert kv.apply(delete).returncode == 0
    wait(
        lambda: (
            [
                o["uid"]
                for o in kv.json("get", "pvc", "kvfence-model-cache", "-n", ns)["metadata"].get(
                    "ownerReferences", []
                )
            ]
            == [again["metadata"]["uid"]]
        ),
        "the claim owned by the class",
        60,
    )
    _delete_class(kv, wait, name)
    wait(lambda: kv.json("get", "namespace", ns) is None, "namespace and claim gone", 180)


def test_an_existing_claim_is_mounted_and_never_deleted(
    operator: Any, kv: Any, wait: Any, namespaces: list[str]
) -> None:
    name, ns = "mc-existing", "kvf-mc-existing"
    namespaces.append(ns)
    # The platform team prepares the class namespace (labelled for the class, so the operator adopts
    # it) with the claim holding the weights.
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "weights", "namespace": ns},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "5Gi"}}},
    }
    prepared = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": ns, "labels": {"kvfence.dev/trust-class": name}},
    }
    assert kv.apply(prepared).returncode == 0
    assert kv.apply(claim).returncode == 0
    uid = _claim_uid(kv, ns, "weights")
    assert kv.apply(vllm_class(name, modelCache={"existingClaim": {"name": "weights"}})).returncode == 0
    dep = wait(
        lambda: kv.json("get", "deployment", "kvfence-engine", "-n", ns),
        "engine Deployment",
        60,
        dump=operator.tail,
    )
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"] == {"claimName": "weights"}
    assert kv.json("get", "pvc", "kvfence-model-cache", "-n", ns) is None  # none created
    live = kv.json("get", "pvc", "weights", "-n", ns)
    assert not live["metadata"].get("ownerReferences")  # never adopted
    _delete_class(kv, wait, name)
    wait(lambda: kv.json("get", "deployment", "kvfence-engine", "-n", ns) is None, "engine GC'd", 120)
    kept = kv.json("get", "namespace", ns)
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    assert _claim_uid(kv, ns, "weights") == uid


def test_claim_changes_kubernetes_cannot_make_are_refused_with_a_condition(
    operator: Any, kv: Any, wait: Any, namespaces: list[str]
) -> None:
    name, ns = "mc-resize", "kvf-mc-resize"
    namespaces.append(ns)
    cache = {"volumeClaim": {"size": "2Gi", "retentionPolicy": {"whenDeleted": "Delete"}}}
    body = vllm_class(name, modelCache=cache)
    body["spec"]["replicas"] = 0
    assert kv.apply(body).returncode == 0
    first = wait(lambda: _claim_uid(kv, ns), "claim created", 60, dump=operator.tail)
    dep = wait(lambda: kv.json("get", "deployment", "kvfence-engine", "-n", ns), "engine Deployment", 60)
    # drift: a deleted claim is created again (the operator watches its claims)
    kv("delete", "pvc", "kvfence-model-cache", "-n", ns, "--wait=false")
    wait(lambda: _claim_uid(kv, ns) not in (None, first), "claim created again", 60, dump=operator.tail)
    template = dep["spec"]["template"]

    def refused(words: str) -> bool:
        obj = _stalled(kv, name, "ModelCacheClaimRefused")
        return obj is not None and words in condition(obj, "Stalled")["message"]

    for change, words in (
        ({"accessModes": ["ReadWriteMany"]}, "accessModes: claim kvf-mc-resize/kvfence-model-cache has"),
        ({"size": "1Gi"}, "requests 2Gi; a claim cannot shrink to 1Gi"),
        ({"storageClassName": "fast"}, "has storage class None, which cannot change"),
        # growth is the API server's to allow: this claim has no StorageClass that can expand it
        ({"size": "4Gi"}, "engine.modelCache.volumeClaim: claim kvf-mc-resize/kvfence-model-cache: 4"),
    ):
        edited = json.loads(json.dumps(body))
        edited["spec"]["engine"]["modelCache"]["volumeClaim"].update(change)
        assert kv.apply(edited).returncode == 0
        wait(lambda w=words: refused(w), f"refused: {change}", 60, dump=operator.tail)
        live = kv.json("get", "pvc", "kvfence-model-cache", "-n", ns)
        assert live["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert live["spec"]["resources"]["requests"]["storage"] == "2Gi"
        assert kv.json("get", "deployment", "kvfence-engine", "-n", ns)["spec"]["template"] == template
    assert _events(kv, "ModelCacheClaimRefused", name)
    # back to what the claim is: accepted again
    assert kv.apply(body).returncode == 0
    wait(
        lambda: condition(kv.json("get", "trustclass", name), "Stalled").get("status") == "False",
        "accepted again",
        60,
    )
    _delete_class(kv, wait, name)
