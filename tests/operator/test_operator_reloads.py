"""No restarts for what reloads, on the real control plane with traffic through the
real router to a real engine (tests/support/livestack.py plays the kubelet: it refreshes the mounted
ConfigMap and signing Secret in place, as a kubelet does, ``refresh`` seconds apart).

A signing-key rotation and quota changes (the class's defaults and a tenant's own) reach the running
engine without changing the engine Deployment's pod template, and no request fails meanwhile: the
router keeps signing with the previous key until the propagation delay recorded on the signing Secret
has passed (``--signing-key-propagation-seconds``), and a second rotation waits for the first.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import pytest
from cluster.manifests import tenant_binding, trust_class
from router.support import Proc, auth, request
from support.livestack import LiveStack, Traffic
from support.waiting import wait_until

from kvfence.contract import key_id
from kvfence.operator import builders as B

pytestmark = pytest.mark.cluster

PROPAGATION = 15.0
OPERATOR_ARGS = ("--signing-key-propagation-seconds", str(PROPAGATION))
ROUTER_NS = "kvfence-system"
CLASS = "reloads"
CLASS_NS = f"kvf-{CLASS}"
TENANT_NS = "team-reloads"
MODEL = "tiny"
KEY = "sk-reloads-0123456789"
#: ~40 KV blocks of 16 tokens (the reference engine's byte tokenizer): above the tightened default
BIG_PROMPT = "the quick brown fox jumps over the lazy dog " * 14


def tc_body(**quotas: Any) -> dict[str, Any]:
    return trust_class(
        CLASS,
        replicas=1,
        resources={"gpu": {"count": 0}},
        engine={
            "image": "kvfence/engine:dev",
            "model": {"name": "kvfence/tiny", "servedName": MODEL},
            "numBlocks": 512,
        },
        namespaceSelector={"matchLabels": {"kvfence.dev/tenants": CLASS}},
        quotas={"defaults": {"requestsPerMinute": 60000, **quotas}},
    )


def binding(**spec: Any) -> dict[str, Any]:
    return tenant_binding("acme", TENANT_NS, "acme", CLASS, **spec)


@pytest.fixture(scope="module")
def live(bound_tenant: LiveStack) -> LiveStack:
    return bound_tenant


def big(router: Proc) -> int:
    body = {"model": MODEL, "prompt": BIG_PROMPT, "max_tokens": 2}
    return request("POST", router.url + "/v1/completions", body, headers=auth(KEY), timeout=30)[0]


def signing(kv: Any) -> B.SigningKeys:
    keys = B.read_signing_secret(kv.json("get", "secret", B.SIGNING_SECRET_NAME, "-n", CLASS_NS))
    assert keys is not None
    return keys


def router_keys(kv: Any) -> list[bytes]:
    return [base64.b64decode(k) for k in kv.routing_table()["trustClasses"][CLASS]["signingKeys"]]


def engine_deployment(kv: Any) -> dict[str, Any]:
    dep: dict[str, Any] = kv.json("get", "deployment", B.ENGINE_NAME, "-n", CLASS_NS)
    return dep


def test_key_rotation_and_quota_changes_reach_the_engine_without_a_restart_or_a_failed_request(
    live: LiveStack, operator: Any, kv: Any, wait: Any
) -> None:
    before = engine_deployment(kv)
    k0 = signing(kv).current
    assert big(live.router) == 200
    with Traffic(live.router, KEY, MODEL).running() as traffic:
        # The class's default KV quota tightened: the running engine refuses what can never fit, with a
        # 400 that clients do not retry.
        assert kv.apply(tc_body(maxKVBlocks=8)).returncode == 0
        wait(lambda: big(live.router) == 400, "the new default quota applied by the engine", 60)
        # The tenant's own quota: the engine re-reads it too.
        assert kv.apply(binding(quotas={"maxKVBlocks": 128})).returncode == 0
        wait(lambda: big(live.router) == 200, "the tenant's own quota applied by the engine", 60)

        # A rotation: the router keeps signing with the old key until the new one has propagated.
        kv("annotate", "trustclass", CLASS, f"{B.ANNOTATION_ROTATE}=r1")
        wait(lambda: signing(kv).previous == k0, "the key rotated", 60, interval=0.1, dump=operator.tail)
        r1 = signing(kv)
        assert r1.rotated_for == "r1" and r1.rotated_at is not None
        wait(lambda: len(router_keys(kv)) == 2, "both keys in the routing table", 30, interval=0.1)
        assert router_keys(kv) == [k0, r1.current]  # still signing with the old key
        # A second rotation asked for at once waits until the first has reached every engine.
        kv("annotate", "trustclass", CLASS, f"{B.ANNOTATION_ROTATE}=r2", "--overwrite")
        wait(lambda: router_keys(kv)[0] == r1.current, "the router signs with the first new key", 60)
        wait(lambda: signing(kv).rotated_for == "r2", "the second rotation", 60, dump=operator.tail)
        r2 = signing(kv)
        assert r2.previous == r1.current and r2.rotated_at is not None
        waited = B.rfc3339_seconds(r2.rotated_at) - B.rfc3339_seconds(r1.rotated_at)
        assert waited >= PROPAGATION - 1, waited  # (the times have whole seconds)
        assert router_keys(kv)[0] == r1.current  # K0 is gone from the Secret; K1 signs meanwhile
        wait(lambda: router_keys(kv) == [r2.current, r1.current], "the router signs with the second key", 60)
        # a few requests signed with the newest key
        n = len(traffic.statuses)
        wait_until(lambda: len(traffic.statuses) >= n + 5, "requests after the last switch", 30)

    assert len(traffic.statuses) > 20 and not traffic.failures(), traffic.failures()[:5]
    after = engine_deployment(kv)
    assert after["spec"]["template"] == before["spec"]["template"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    # the status says which key signs, and Events say when the router switched
    wait(
        lambda: kv.json("get", "trustclass", CLASS)["status"]["signingKeyId"] == key_id(r2.current),
        "status",
        30,
    )
    events = kv.json("get", "events", "-n", "default", "--field-selector", "reason=SigningKeyActive")
    active = [e["message"] for e in events["items"] if e["involvedObject"]["name"] == CLASS]
    assert any(key_id(r1.current) in m for m in active) and any(key_id(r2.current) in m for m in active), (
        active
    )


def test_an_operator_restart_keeps_the_previous_key_signing_until_the_recorded_time(
    live: LiveStack, operator: Any, kv: Any, wait: Any
) -> None:
    """The rotation time is on the signing Secret: a new operator process does not switch early."""
    old = signing(kv).current
    wait(lambda: router_keys(kv)[0] == old, "the current key signs", 60)
    with Traffic(live.router, KEY, MODEL).running() as traffic:
        kv("annotate", "trustclass", CLASS, f"{B.ANNOTATION_ROTATE}=r3", "--overwrite")
        wait(lambda: signing(kv).rotated_for == "r3", "the key rotated", 60, interval=0.1, dump=operator.tail)
        rotated = signing(kv)
        assert rotated.rotated_at is not None
        operator.stop()
        operator.start()
        operator.wait_ready()
        wait(lambda: operator.reconciles("class") >= 1, "a class reconcile after the restart", 60)
        switch_at = B.rfc3339_seconds(rotated.rotated_at) + PROPAGATION
        if time.time() < switch_at - 1:  # (the recorded time has whole seconds)
            assert router_keys(kv) == [old, rotated.current]
        wait(lambda: router_keys(kv) == [rotated.current, old], "the new key signs", 60, dump=operator.tail)
        assert time.time() >= switch_at - 1
        n = len(traffic.statuses)
        wait_until(lambda: len(traffic.statuses) >= n + 5, "requests after the switch", 30)
    assert not traffic.failures(), traffic.failures()[:5]
