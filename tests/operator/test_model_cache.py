"""Weights and adapters, pure: the engine pod a class with a model cache, a token Secret, pull secrets,
extra env and volumes renders, the claim the operator creates, and what may change on one that exists
(no cluster; tests/operator/test_operator_model_cache.py runs the same on the real control plane)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvfence.api.trustclass import SecretKeySelector
from kvfence.operator import builders as B
from kvfence.operator import modelcache

OPTS = B.OperatorOptions()
KEY = b"\x01" * 32
OWNER = {"apiVersion": "kvfence.dev/v1alpha1", "kind": "TrustClass", "name": "gold", "uid": "u"}
VLLM = {"runtime": "vllm", "image": "kvfence/engine-vllm:dev", "model": {"name": "org/m"}}


def _engine_pod(tc: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = B.deployment(tc, "h", OPTS, OWNER)["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_without_a_model_cache_hf_home_is_an_empty_dir(make_tc: Any) -> None:
    pod, c = _engine_pod(make_tc(engine=VLLM))
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HOME"]["value"] == "/cache/huggingface" and "HF_TOKEN" not in env
    assert {"name": "cache", "emptyDir": {}} in pod["volumes"]
    assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
    assert "imagePullSecrets" not in pod
    assert B.model_cache_claim(make_tc(engine=VLLM), OPTS, OWNER) is None


def test_a_gpu_class_with_weights_token_pull_secrets_env_volumes_and_adapters(make_tc: Any) -> None:
    tc = make_tc(
        engine={
            **VLLM,
            "model": {
                "name": "meta-llama/Llama-3.1-8B-Instruct",
                "tokenSecretRef": {"name": "hf", "key": "t"},
            },
            "modelCache": {"volumeClaim": {"size": "200Gi", "storageClassName": "fast"}},
            "imagePullSecrets": [{"name": "registry"}],
            "extraEnv": [
                {"name": "HF_HUB_OFFLINE", "value": "0"},
                {"name": "OMP_NUM_THREADS", "valueFrom": {"configMapKeyRef": {"name": "tune", "key": "omp"}}},
                {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {"name": "proxy", "key": "url"}}},
            ],
            "extraVolumes": [
                {"name": "loras", "persistentVolumeClaim": {"claimName": "lora-store"}},
                {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
                {"name": "templates", "configMap": {"name": "chat-templates"}},
                {"name": "certs", "secret": {"secretName": "ca"}},
            ],
            "extraVolumeMounts": [
                {"name": "loras", "mountPath": "/adapters"},
                {"name": "scratch", "mountPath": "/data/scratch", "readOnly": False},
                {"name": "templates", "mountPath": "/mnt/templates"},
                {"name": "certs", "mountPath": "/mnt/certs"},
            ],
            "adapters": [{"name": "support-bot", "source": "/adapters/support-bot"}],
        }
    )
    pod, c = _engine_pod(tc)
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "kvfence-model-cache"}}
    assert vols["loras"]["persistentVolumeClaim"] == {"claimName": "lora-store", "readOnly": True}
    assert vols["scratch"]["emptyDir"] == {"sizeLimit": "1Gi"}
    assert vols["templates"]["configMap"] == {"name": "chat-templates"}
    assert vols["certs"]["secret"] == {"secretName": "ca"}
    # the operator's own volumes are all still there, once each
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names)) and {"config", "signing-key", "tmp", "dshm"} <= set(names)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/cache"]["name"] == "cache"
    assert mounts["/adapters"] == {"name": "loras", "mountPath": "/adapters", "readOnly": True}
    assert mounts["/data/scratch"]["readOnly"] is False
    env = {e["name"]: e for e in c["env"]}
    # the token is a reference to the Secret: no value anywhere in what the operator writes
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}
    assert env["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "0"}
    assert env["OMP_NUM_THREADS"]["valueFrom"] == {"configMapKeyRef": {"name": "tune", "key": "omp"}}
    assert env["HTTPS_PROXY"]["valueFrom"] == {"secretKeyRef": {"name": "proxy", "key": "url"}}
    assert len(c["env"]) == len(env)  # no name twice
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    # the adapter is loaded from where it is mounted
    args = c["args"]
    assert args[args.index("--lora-modules") + 1] == "support-bot=/adapters/support-bot"
    # the claim, applied before the engine
    objs = B.children(tc, signing=B.SigningKeys(KEY), tenant_quotas=None, opts=OPTS, owner=OWNER)
    kinds = [o["kind"] for o in objs]
    assert kinds[0] == "PersistentVolumeClaim"  # a refused claim change stops before anything is applied
    claim = objs[kinds.index("PersistentVolumeClaim")]
    assert claim["metadata"]["name"] == "kvfence-model-cache" and claim["metadata"]["namespace"] == "kvf-gold"
    assert claim["metadata"]["labels"]["app.kubernetes.io/component"] == "model-cache"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "200Gi"}},
        "storageClassName": "fast",
    }
    # Retain (the default): no owner reference for garbage collection to follow
    assert "ownerReferences" not in claim["metadata"]
    assert modelcache.keeps_namespace(tc)


def test_a_claim_deleted_with_its_class_is_owned_by_it(make_tc: Any) -> None:
    tc = make_tc(
        engine={
            **VLLM,
            "modelCache": {"volumeClaim": {"size": "1Gi", "retentionPolicy": {"whenDeleted": "Delete"}}},
        }
    )
    claim = B.model_cache_claim(tc, OPTS, OWNER)
    assert claim is not None and claim["metadata"]["ownerReferences"] == [OWNER]
    assert "storageClassName" not in claim["spec"]  # the cluster's default
    assert not modelcache.keeps_namespace(tc)
    assert not modelcache.keeps_namespace(make_tc(engine=VLLM))


def test_an_existing_claim_is_mounted_and_never_created(make_tc: Any) -> None:
    tc = make_tc(engine={**VLLM, "modelCache": {"existingClaim": {"name": "weights"}}})
    pod, _ = _engine_pod(tc)
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "weights"}} in pod["volumes"]
    assert B.model_cache_claim(tc, OPTS, OWNER) is None
    objs = B.children(tc, signing=B.SigningKeys(KEY), tenant_quotas=None, opts=OPTS, owner=OWNER)
    assert "PersistentVolumeClaim" not in [o["kind"] for o in objs]
    assert modelcache.keeps_namespace(tc)  # the namespace holding someone else's claim is never deleted


def test_extra_env_volumes_and_pull_secrets_reach_a_reference_engine_too(make_tc: Any) -> None:
    tc = make_tc(
        engine={
            "extraEnv": [{"name": "TZ", "value": "UTC"}],
            "extraVolumes": [{"name": "data", "emptyDir": {}}],
            "extraVolumeMounts": [{"name": "data", "mountPath": "/data"}],
            "imagePullSecrets": [{"name": "registry"}],
        }
    )
    pod, c = _engine_pod(tc)
    assert {"name": "TZ", "value": "UTC"} in c["env"]
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in c["volumeMounts"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert "cache" not in [v["name"] for v in pod["volumes"]]


def _claim(size: str = "10Gi", sc: str | None = "fast", modes: list[str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": modes or ["ReadWriteOnce"],
        "resources": {"requests": {"storage": size}},
    }
    if sc is not None:
        spec["storageClassName"] = sc
    return {"metadata": {"name": "kvfence-model-cache", "namespace": "kvf-gold"}, "spec": spec}


def test_a_new_claim_is_applied_as_desired() -> None:
    assert modelcache.plan_claim(_claim(), None) == (_claim(), None)


def test_a_claim_may_grow() -> None:
    planned, why = modelcache.plan_claim(_claim("20Gi"), _claim("10Gi"))
    assert why is None and planned["spec"]["resources"]["requests"]["storage"] == "20Gi"
    # the same size written differently is no change
    assert modelcache.plan_claim(_claim("10240Mi"), _claim("10Gi"))[1] is None


@pytest.mark.parametrize(
    ("desired", "live", "words"),
    [
        (_claim("5Gi"), _claim("10Gi"), "requests 10Gi; a claim cannot shrink to 5Gi"),
        (
            _claim(sc="slow"),
            _claim(sc="fast"),
            "kvfence-model-cache has storage class 'fast', which cannot change",
        ),
        (_claim(sc="fast"), _claim(sc=None), "has storage class None"),
        (
            _claim(modes=["ReadWriteMany"]),
            _claim(),
            "accessModes: claim kvf-gold/kvfence-model-cache has ['ReadWriteOnce'], which cannot change",
        ),
    ],
)
def test_what_a_claim_cannot_take_is_refused_naming_the_field(
    desired: dict[str, Any], live: dict[str, Any], words: str
) -> None:
    _, why = modelcache.plan_claim(desired, live)
    assert why is not None and words in why and why.startswith("engine.modelCache.volumeClaim."), why


def test_an_unset_storage_class_keeps_the_one_the_claim_was_created_with() -> None:
    desired = _claim(sc=None)
    planned, why = modelcache.plan_claim(desired, _claim(sc="standard"))
    assert why is None and planned["spec"]["storageClassName"] == "standard"
    assert "storageClassName" not in desired["spec"]  # the input is left alone


def test_the_token_secret_is_checked_by_name_and_key_and_never_quoted() -> None:
    ref = SecretKeySelector(name="hf", key="token")
    secret = {"metadata": {"name": "hf"}, "data": {"token": "aGZfc2VjcmV0"}}  # hf_secret
    assert modelcache.token_refusal(ref, "kvf-gold", secret) is None
    assert modelcache.token_refusal(ref, "kvf-gold", None) == (
        "engine.model.tokenSecretRef: Secret kvf-gold/hf does not exist"
    )
    other = copy.deepcopy(secret)
    other["data"] = {"other": "aGZfc2VjcmV0"}
    why = modelcache.token_refusal(ref, "kvf-gold", other)
    assert why == "engine.model.tokenSecretRef: Secret kvf-gold/hf has no key 'token' (or it is empty)"
    assert "aGZf" not in json.dumps(why) and "hf_secret" not in json.dumps(why)
