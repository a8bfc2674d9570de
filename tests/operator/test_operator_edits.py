"""A bad edit never takes a tenant offline, on the real control plane with traffic
through the real router to a real engine (tests/operator/livestack.py).

An edit the operator cannot accept keeps the tenant served with its last accepted spec, says so in
``SpecAccepted=False`` (reason, observedGeneration) and a Warning Event, and survives an operator
restart (the accepted spec is kept in the binding's status); only a revocation takes access away, and
within seconds. A TrustClass whose spec stops validating stays routed with its last accepted spec.
An edit of the TrustClass that a bound tenant's spec no longer fits clamps it instead of revoking it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from cluster.manifests import condition, secret, tenant_binding, trust_class
from router.support import Proc
from support.argocd import argocd_health
from support.livestack import LiveStack, Traffic, complete

from kvfence.operator import builders as B

pytestmark = pytest.mark.cluster

ROUTER_NS = "kvfence-system"
CLASS = "edits"
CLASS_NS = f"kvf-{CLASS}"
TENANT_NS = "team-edits"
MODEL = "tiny"
KEY = "sk-edits-0123456789"


def tc_body(**over: Any) -> dict[str, Any]:
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
        quotas={"defaults": {"requestsPerMinute": 6000}, "limits": {"requestsPerMinute": 60000}},
        **over,
    )


def binding(**spec: Any) -> dict[str, Any]:
    return tenant_binding("acme", TENANT_NS, "acme", CLASS, **spec)


class Live:
    def __init__(self, kv: Any, router: Proc, engine: Proc) -> None:
        self.kv, self.router, self.engine = kv, router, engine

    def tb(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.kv.json("get", "tb", "acme", "-n", TENANT_NS)
        return obj

    def served(self) -> dict[str, Any]:
        route: dict[str, Any] = self.kv.routing_table()["tenants"].get("acme", {})
        return route


@pytest.fixture(scope="module")
def live(kv: Any, bound_tenant: LiveStack) -> Live:
    return Live(kv, bound_tenant.router, bound_tenant.engine)


def refused(obj: dict[str, Any], reason: str) -> bool:
    c = condition(obj, "SpecAccepted")
    return (
        c.get("status") == "False"
        and c.get("reason") == reason
        and c.get("observedGeneration") == obj["metadata"]["generation"]
        and condition(obj, "Ready").get("status") == "True"
        and condition(obj, "Bound").get("status") == "True"
        and condition(obj, "Denied").get("status") == "False"
    )


def warning_events(kv: Any, reason: str) -> list[dict[str, Any]]:
    ev = kv.json("get", "events", "-n", TENANT_NS, "--field-selector", f"reason={reason}")
    return [e for e in (ev or {}).get("items", []) if e.get("type") == "Warning"]


def test_a_bad_edit_keeps_the_tenant_served_with_its_last_accepted_spec(
    live: Live, operator: Any, kv: Any, wait: Any
) -> None:
    accepted_gen = live.tb()["status"]["acceptedGeneration"]
    assert live.served()["quotas"]["requestsPerMinute"] == 6000
    edits = [
        # a quota above the class's limits
        ({"quotas": {"requestsPerMinute": 600000}}, "QuotaExceedsClassLimit"),
        # an adapter the class does not serve
        ({"allowedAdapters": ["nope"]}, "AdapterNotInTrustClass"),
        # a key rotation to a Secret that does not exist yet
        ({"apiKeySecretRef": {"name": "acme-keys-v2"}}, "ApiKeySecretNotFound"),
    ]
    with Traffic(live.router, KEY, MODEL).running() as traffic:
        for spec, reason in edits:
            assert kv.apply(binding(**spec)).returncode == 0
            wait(
                lambda r=reason: refused(live.tb(), r), f"SpecAccepted=False {reason}", 60, dump=operator.tail
            )
            wait(lambda r=reason: warning_events(kv, r), f"a Warning Event {reason}", 30)
            tb = live.tb()
            assert tb["status"]["acceptedGeneration"] == accepted_gen
            # Argo CD says Degraded (the sync did not take), kstatus Stalled, kubectl wait Ready still.
            health, message = argocd_health("tenantbinding", tb)
            assert health == "Degraded" and message.startswith(reason), (health, message)
            assert condition(tb, "Stalled").get("status") == "True"
            assert f"generation {accepted_gen}" in condition(tb, "SpecAccepted")["message"]
            # still served exactly as accepted
            route = live.served()
            assert route["quotas"]["requestsPerMinute"] == 6000 and not route.get("allowedAdapters")
            assert complete(live.router, KEY, MODEL) == 200

        # An operator restart while the edit is refused: the accepted spec lives in the status.
        operator.stop()
        operator.start()
        operator.wait_ready()
        wait(lambda: operator.reconciles("routing") >= 2, "routing decisions after the restart", 60)
        assert refused(live.tb(), "ApiKeySecretNotFound")
        assert complete(live.router, KEY, MODEL) == 200

    assert traffic.statuses and not traffic.failures(), traffic.failures()[:5]
    # The rotation completes: the new Secret appears, the new spec is accepted, the new key works.
    new_key = "sk-edits-rotated-0123456789"
    assert kv.apply(secret("acme-keys-v2", TENANT_NS, k0=new_key)).returncode == 0
    wait(
        lambda: (
            condition(live.tb(), "SpecAccepted").get("status") == "True"
            and live.tb()["status"]["acceptedGeneration"] == live.tb()["metadata"]["generation"]
        ),
        "the rotation accepted",
        60,
        dump=operator.tail,
    )
    wait(lambda: complete(live.router, new_key, MODEL) == 200, "the new key served", 30)
    # The old key went with its Secret leaving the spec in force (that is the rotation).
    wait(lambda: complete(live.router, KEY, MODEL) == 401, "the old key retired", 30)


def test_a_revocation_takes_access_away_within_seconds_even_while_an_edit_is_refused(
    live: Live, operator: Any, kv: Any, wait: Any
) -> None:
    key = "sk-edits-rotated-0123456789"
    # Make sure the previous test's end state is what this one starts from.
    assert (
        kv.apply(
            secret("acme-keys-v2", TENANT_NS, k0=key), binding(apiKeySecretRef={"name": "acme-keys-v2"})
        ).returncode
        == 0
    )
    wait(lambda: complete(live.router, key, MODEL) == 200, "served", 60)
    assert (
        kv.apply(
            binding(apiKeySecretRef={"name": "acme-keys-v2"}, quotas={"requestsPerMinute": 600000})
        ).returncode
        == 0
    )
    wait(lambda: refused(live.tb(), "QuotaExceedsClassLimit"), "the edit refused", 60, dump=operator.tail)
    assert complete(live.router, key, MODEL) == 200

    # Keys removed from the Secret in force: a revocation, whatever the pending edit.
    kv(
        "patch",
        "secret",
        "acme-keys-v2",
        "-n",
        TENANT_NS,
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/data/k0"}]',
    )
    wait(lambda: complete(live.router, key, MODEL) == 401, "keys removed: 401 within seconds", 10, 0.2)
    tb = live.tb()
    assert condition(tb, "Bound").get("status") == "False" and condition(tb, "Denied").get("status") == "True"

    # Keys back, then the namespace no longer admitted: revoked within seconds too.
    assert kv.apply(secret("acme-keys-v2", TENANT_NS, k0=key)).returncode == 0
    wait(lambda: complete(live.router, key, MODEL) == 200, "served again", 30)
    kv("label", "namespace", TENANT_NS, "kvfence.dev/tenants-", "--overwrite")
    wait(
        lambda: complete(live.router, key, MODEL) == 401,
        "namespace not admitted: 401 within seconds",
        10,
        0.2,
    )
    kv("label", "namespace", TENANT_NS, f"kvfence.dev/tenants={CLASS}", "--overwrite")
    wait(lambda: complete(live.router, key, MODEL) == 200, "admitted again", 30)

    # The binding deleted (its refused edit still pending): revoked within seconds as well.
    kv("delete", "tb", "acme", "-n", TENANT_NS, "--wait=false")
    wait(lambda: complete(live.router, key, MODEL) == 401, "binding deleted: 401 within seconds", 10, 0.2)
    assert kv.apply(binding(apiKeySecretRef={"name": "acme-keys-v2"})).returncode == 0
    wait(lambda: complete(live.router, key, MODEL) == 200, "bound again", 60)


def test_a_trust_class_whose_spec_stops_validating_stays_routed_with_its_last_accepted_spec(
    live: Live, operator: Any, kv: Any, wait: Any, cluster: Any
) -> None:
    """A spec the apiserver stored but the operator refuses (written under a CRD without the rule, as
    after an upgrade or with an older CRD installed): the CRD's rule is lifted for the write only."""
    key = "sk-edits-rotated-0123456789"
    secret_v2 = secret("acme-keys-v2", TENANT_NS, k0=key)
    assert kv.apply(secret_v2, binding(apiKeySecretRef={"name": "acme-keys-v2"})).returncode == 0
    wait(lambda: complete(live.router, key, MODEL) == 200, "served", 60)
    accepted = kv.json("get", "trustclass", CLASS)["status"]["acceptedGeneration"]
    crd = kv.json("get", "crd", "trustclasses.kvfence.dev")
    original = copy.deepcopy(crd)
    pc = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "prefixCache"
    ]
    pc["x-kubernetes-validations"] = [
        r for r in pc.get("x-kubernetes-validations", []) if "needs the prefix cache" not in r["message"]
    ]
    for k in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        crd["metadata"].pop(k, None)
    crd.pop("status", None)
    try:
        kv("replace", "-f", "-", input=json.dumps(crd))
        bad = tc_body(
            prefixCache={
                "enabled": False,
                "sharedPrefixes": [{"name": "sys", "form": "completion", "text": "x"}],
            }
        )
        res = kv.apply(bad)
        assert res.returncode == 0, res.stderr
        stored = kv.json("get", "trustclass", CLASS)
        assert stored["spec"]["prefixCache"]["enabled"] is False, (res.stdout, stored["spec"])
    finally:
        original["metadata"] = {"name": original["metadata"]["name"]}
        original.pop("status", None)
        kv.apply(original)

    def degraded() -> bool:
        obj = kv.json("get", "trustclass", CLASS)
        c = condition(obj, "Degraded")
        return bool(
            c.get("status") == "True"
            and c.get("reason") == "InvalidSpec"
            and c.get("observedGeneration") == obj["metadata"]["generation"]
            and f"generation {accepted}" in c.get("message", "")
        )

    wait(
        degraded,
        "Degraded: InvalidSpec, serving the last accepted spec",
        60,
        dump=lambda: json.dumps(kv.json("get", "trustclass", CLASS), indent=1)[-3000:] + operator.tail(30),
    )
    wait(lambda: warning_events_cluster(kv, "InvalidSpec"), "a Warning Event InvalidSpec", 30)
    # Still routed, the binding still Bound, the tenant still served.
    assert CLASS in kv.routing_table()["trustClasses"]
    assert condition(live.tb(), "Bound").get("status") == "True"
    assert complete(live.router, key, MODEL) == 200
    # Fixed: accepted again.
    assert kv.apply(tc_body()).returncode == 0
    wait(
        lambda: (
            kv.json("get", "trustclass", CLASS)["status"].get("acceptedGeneration")
            == kv.json("get", "trustclass", CLASS)["metadata"]["generation"]
        ),
        "the fixed spec accepted",
        60,
    )


def warning_events_cluster(kv: Any, reason: str) -> list[dict[str, Any]]:
    ev = kv.json("get", "events", "-A", "--field-selector", f"reason={reason}")
    return [e for e in (ev or {}).get("items", []) if e.get("type") == "Warning"]


def clamped(obj: dict[str, Any]) -> bool:
    c = condition(obj, "Clamped")
    return (
        c.get("status") == "True"
        and c.get("reason") == "ClampedToClassLimits"
        and c.get("observedGeneration") == obj["metadata"]["generation"]
        and condition(obj, "Ready").get("status") == "True"
        and condition(obj, "Bound").get("status") == "True"
        and condition(obj, "Denied").get("status") == "False"
        and condition(obj, "SpecAccepted").get("status") == "True"
    )


def engine_quota(kv: Any) -> dict[str, Any]:
    """The tenant's KV quota in the engine config the operator wrote for the class."""
    cm = kv.json("get", "configmap", B.CONFIG_NAME, "-n", CLASS_NS)
    tenants: dict[str, Any] = json.loads(cm["data"][B.CONFIG_KEY])["quotas"]["tenants"]
    return dict(tenants.get("acme", {}))


def test_a_class_edit_below_a_bound_tenants_quota_clamps_it_and_keeps_it_served(
    live: Live, operator: Any, kv: Any, wait: Any
) -> None:
    """The class's limits lowered below the tenant's own quota: not a revocation. The tenant stays
    Bound and served through the router, at the class's new limits (routing table and engine config),
    with ``Clamped=True`` and a Warning Event; a binding created now with that quota is Denied."""
    key = "sk-edits-rotated-0123456789"
    own = {"requestsPerMinute": 30000, "maxKVBlocks": 256}
    ref = {"apiKeySecretRef": {"name": "acme-keys-v2"}}
    res = kv.apply(tc_body(), secret("acme-keys-v2", TENANT_NS, k0=key), binding(**ref, quotas=own))
    assert res.returncode == 0, res.stderr
    wait(
        lambda: (
            live.served().get("quotas", {}).get("requestsPerMinute") == 30000
            and live.tb()["status"].get("acceptedGeneration") == live.tb()["metadata"]["generation"]
            and engine_quota(kv).get("maxBlocks") == 256
        ),
        "the tenant's own quota in force",
        60,
        dump=operator.tail,
    )
    accepted = live.tb()["status"]["acceptedSpec"]
    lowered = tc_body()
    lowered["spec"]["quotas"]["limits"] = {"requestsPerMinute": 12000, "maxKVBlocks": 128}
    with Traffic(live.router, key, MODEL).running() as traffic:
        assert kv.apply(lowered).returncode == 0
        wait(lambda: clamped(live.tb()), "Clamped=True, still Bound", 60, dump=operator.tail)
        wait(lambda: warning_events(kv, "ClampedToClassLimits"), "a Warning Event ClampedToClassLimits", 30)
        tb = live.tb()
        message = condition(tb, "Clamped")["message"]
        assert "requestsPerMinute 30000 -> 12000, maxKVBlocks 256 -> 128" in message, message
        assert tb["status"]["acceptedSpec"] == accepted  # the tenant's own spec is still the one in force
        assert condition(tb, "Stalled").get("reason") == "ClampedToClassLimits"
        assert argocd_health("tenantbinding", tb)[0] == "Degraded"
        wait(
            lambda: (
                live.served()["quotas"].get("maxKVBlocks") == 128
                and live.served()["quotas"].get("requestsPerMinute") == 12000
            ),
            "the clamped quota in the routing table",
            30,
        )
        wait(lambda: engine_quota(kv).get("maxBlocks") == 128, "the clamped quota in the engine config", 60)
        assert complete(live.router, key, MODEL) == 200
        # A binding never accepted has nothing to keep: the same quota is refused outright.
        newbie = tenant_binding("newbie", TENANT_NS, "newbie", CLASS, quotas=own)
        assert kv.apply(secret("newbie-keys", TENANT_NS, k0="sk-edits-newbie-0123"), newbie).returncode == 0
        wait(
            lambda: (
                condition(kv.json("get", "tb", "newbie", "-n", TENANT_NS) or {}, "Denied").get("reason")
                == "QuotaExceedsClassLimit"
            ),
            "a new binding above the limits Denied",
            60,
        )
        kv("delete", "tb", "newbie", "-n", TENANT_NS)
    assert traffic.statuses and not traffic.failures(), traffic.failures()[:5]

    # The class raises its limits again: served as specified.
    assert kv.apply(tc_body()).returncode == 0
    wait(
        lambda: (
            condition(live.tb(), "Clamped").get("status") == "False"
            and live.served()["quotas"].get("maxKVBlocks") == 256
        ),
        "the tenant's own quota in force again",
        60,
    )
    wait(lambda: engine_quota(kv).get("maxBlocks") == 256, "the tenant's own quota in the engine config", 60)
    assert complete(live.router, key, MODEL) == 200
