"""The reconciler's decisions against an in-memory API (no cluster): what it applies, what it refuses
to apply, and that a reconcile of a cluster already as it should be writes nothing. The same paths run
against a real kube-apiserver in test_operator_reconcile.py; this is the fast lane's view of them."""

from __future__ import annotations

import base64
import copy
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cluster.manifests import condition
from support.argocd import argocd_health

from kvfence.api import conditions
from kvfence.api.common import API_VERSION
from kvfence.contract.routing import ROUTING_SECRET_KEY, decode_table_bytes, hash_api_key
from kvfence.operator import apikeys, builders, routing_reconcile
from kvfence.operator.apply import KubeError
from kvfence.operator.bookkeeping import child_digest
from kvfence.operator.events import Event
from kvfence.operator.keys import ROUTING, BindingSecretKey, ClassKey
from kvfence.operator.reconcile_base import Requeue
from kvfence.operator.reconciler import Reconciler

Obj = dict[str, Any]


def merge(live: Obj, applied: Obj) -> Obj:
    """Server-side apply by the only field manager there is, roughly: what ``applied`` sets replaces,
    maps merge key by key (a patch of metadata alone leaves the spec alone)."""
    out = copy.deepcopy(live)
    for k, v in applied.items():
        out[k] = (
            merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        )
    return out


class FakeKube:
    """The part of :class:`kvfence.operator.apply.Kube` the reconciler uses, in memory: apply replaces
    what it names (one field manager, so server-side apply's merge is a replacement here)."""

    cache = None  # no watch cache: every read is a GET

    def __init__(self) -> None:
        self.objs: dict[tuple[str, str, str, str], Obj] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.reads: list[str] = []  # kinds read one by one (GET)
        self._uid = 0
        self._version = 0

    @staticmethod
    def _key(api: str, kind: str, ns: str | None, name: str) -> tuple[str, str, str, str]:
        return (api, kind, ns or "", name)

    def put(self, obj: Obj) -> None:
        m = obj["metadata"]
        m.setdefault("generation", 1)
        self._uid += 1
        m.setdefault("uid", f"uid-{self._uid}")
        self._version += 1
        m["resourceVersion"] = str(self._version)
        self.objs[self._key(obj["apiVersion"], obj["kind"], m.get("namespace"), m["name"])] = obj

    def get(
        self, api: str, kind: str, name: str, namespace: str | None = None, *, cached: bool = True
    ) -> Obj | None:
        self.reads.append(kind)
        return copy.deepcopy(self.objs.get(self._key(api, kind, namespace, name)))

    def list(
        self,
        api: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        *,
        each: Callable[[Obj], Obj] | None = None,
    ) -> list[Obj]:
        out = [
            copy.deepcopy(o)
            for (a, k, ns, _), o in sorted(self.objs.items())
            if a == api and k == kind and (namespace is None or ns == namespace)
        ]
        return out if each is None else [each(o) for o in out]

    def apply(self, obj: Obj, *, field_manager: str = "", subresource: str = "") -> Obj:
        m = obj["metadata"]
        key = self._key(obj["apiVersion"], obj["kind"], m.get("namespace"), m["name"])
        self.writes.append(("apply", obj["kind"], m["name"]))
        live = self.objs.get(key)
        new = copy.deepcopy(obj) if live is None else merge(live, obj)
        if live is not None and new.get("spec") != live.get("spec"):
            new["metadata"]["generation"] = live["metadata"].get("generation", 1) + 1
        self.put(new)
        return copy.deepcopy(new)

    def patch_status(self, api: str, kind: str, name: str, namespace: str | None, status: Obj) -> Obj:
        key = self._key(api, kind, namespace, name)
        self.writes.append(("status", kind, name))
        live = self.objs[key]
        merged = {**(live.get("status") or {}), **status}
        live["status"] = {k: v for k, v in merged.items() if v is not None}
        return copy.deepcopy(live)

    def delete(self, api: str, kind: str, name: str, namespace: str | None = None) -> bool:
        self.writes.append(("delete", kind, name))
        return self.objs.pop(self._key(api, kind, namespace, name), None) is not None


def trust_class(name: str = "gold", **spec: Any) -> Obj:
    base = {"engine": {"image": "kvfence/engine-reference:t", "model": {"name": "m"}}, "replicas": 1}
    return {
        "apiVersion": API_VERSION,
        "kind": "TrustClass",
        "metadata": {"name": name},
        "spec": {**base, **spec},
    }


@pytest.fixture
def world() -> tuple[FakeKube, Reconciler, Callable[[], None]]:
    kube = FakeKube()
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvfence-system"}})
    rec = Reconciler(kube, builders.OperatorOptions(), new_key=lambda: bytes(range(32)))  # type: ignore[arg-type]

    def route() -> None:
        rec.reconcile(ROUTING)

    return kube, rec, route


def engine_config(kube: FakeKube, namespace: str = "kvf-gold") -> Any:
    cm = kube.get("v1", "ConfigMap", builders.CONFIG_NAME, namespace)
    return json.loads(cm["data"][builders.CONFIG_KEY])


def first_pass(rec: Reconciler, name: str = "gold") -> None:
    """A new class's first reconcile creates its signing key and waits for a routing decision that
    routes it; that decision wakes it (the work queue's order, by hand)."""
    assert rec.reconcile(ClassKey(name)) == {ROUTING}
    assert ClassKey(name) in rec.reconcile(ROUTING)


def test_a_class_is_rendered_into_its_namespace_and_a_second_pass_writes_nothing(world: Any) -> None:
    kube, rec, _ = world
    kube.put(trust_class())
    first_pass(rec)
    rec.reconcile(ClassKey("gold"))
    kinds = {k for (_, k, ns, _) in kube.objs if ns == "kvf-gold"}
    assert kinds == {"ConfigMap", "Secret", "Service", "NetworkPolicy", "PodDisruptionBudget", "Deployment"}
    assert kube.get("v1", "Namespace", "kvf-gold") is not None
    tc = kube.get(API_VERSION, "TrustClass", "gold")
    assert condition(tc, conditions.READY)["status"] == "False"  # no pod is available yet
    assert condition(tc, conditions.PROGRESSING)["status"] == "True"
    # the cluster as it should be: the next reconcile reads and writes nothing
    kube.writes.clear()
    rec.reconcile(ClassKey("gold"))
    assert kube.writes == []


def test_a_namespace_of_someone_else_is_never_adopted(world: Any) -> None:
    kube, rec, route = world
    kube.put(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvf-gold", "labels": {"team": "x"}}}
    )
    kube.put(trust_class())
    route()
    rec.reconcile(ClassKey("gold"))
    assert [k for (_, k, ns, _) in kube.objs if ns == "kvf-gold"] == []  # nothing written into it
    c = condition(kube.get(API_VERSION, "TrustClass", "gold"), conditions.DEGRADED)
    assert c["status"] == "True" and c["reason"] == conditions.REASON_NAMESPACE_CONFLICT


def test_a_missing_shared_prefix_configmap_applies_nothing_and_says_so(world: Any) -> None:
    kube, rec, _ = world
    ref = {"name": "tools", "form": "completion", "configMapKeyRef": {"name": "prompts", "key": "tools"}}
    kube.put(trust_class(prefixCache={"sharedPrefixes": [ref]}))
    # A new class's namespace, made by its first reconcile, cannot hold the ConfigMap yet; nor does it
    # when the routing decision wakes the class.
    with pytest.raises(Requeue, match=r"sharedPrefixes\[tools\]"):
        rec.reconcile(ClassKey("gold"))
    assert ClassKey("gold") in rec.reconcile(ROUTING)
    with pytest.raises(Requeue, match=r"sharedPrefixes\[tools\]"):
        rec.reconcile(ClassKey("gold"))
    assert kube.get("v1", "ConfigMap", builders.CONFIG_NAME, "kvf-gold") is None
    assert kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, "kvf-gold") is None
    c = condition(kube.get(API_VERSION, "TrustClass", "gold"), conditions.DEGRADED)
    assert c["reason"] == conditions.REASON_SHARED_PREFIX_UNRESOLVED
    meta = {"name": "prompts", "namespace": "kvf-gold"}
    kube.put(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"tools": "Tools: search(q)."}}
    )
    rec.reconcile(ClassKey("gold"))
    assert (
        "Tools: search(q)."
        in kube.get("v1", "ConfigMap", builders.CONFIG_NAME, "kvf-gold")["data"][builders.CONFIG_KEY]
    )


def test_a_degraded_class_reports_its_running_engine_and_writes_its_status_once(world: Any) -> None:
    """A class whose edit applies nothing keeps its engine as last rendered: its status counts that
    engine's pods (read for it), follows them while it stays degraded, and is not written again when
    nothing changed."""
    kube, rec, _ = world
    kube.put(trust_class(replicas=2))
    first_pass(rec)
    rec.reconcile(ClassKey("gold"))
    dep_ref = ("apps/v1", "Deployment", builders.ENGINE_NAME, "kvf-gold")

    def engine_pods(total: int, ready: int) -> None:
        dep = kube.get(*dep_ref)
        dep["status"] = {"replicas": total, "readyReplicas": ready, "availableReplicas": ready}
        kube.put(dep)

    engine_pods(2, 2)
    rec.reconcile(ClassKey("gold"))
    st = kube.get(API_VERSION, "TrustClass", "gold")["status"]
    assert (st["desiredReplicas"], st["replicas"], st["readyReplicas"]) == (2, 2, 2)
    # an edit that needs a ConfigMap that does not exist: nothing is applied, the class is Degraded
    ref = {"name": "tools", "form": "completion", "configMapKeyRef": {"name": "prompts", "key": "tools"}}
    tc = kube.get(API_VERSION, "TrustClass", "gold")
    tc["spec"]["prefixCache"] = {"sharedPrefixes": [ref]}
    kube.put(tc)
    engine_pods(2, 1)  # meanwhile one engine pod lost readiness
    with pytest.raises(Requeue):
        rec.reconcile(ClassKey("gold"))
    tc = kube.get(API_VERSION, "TrustClass", "gold")
    assert condition(tc, conditions.DEGRADED)["reason"] == conditions.REASON_SHARED_PREFIX_UNRESOLVED
    st = tc["status"]
    assert (st["desiredReplicas"], st["replicas"], st["readyReplicas"]) == (2, 2, 1)
    assert st["signingKeyId"]  # left as it was
    # the retry finds the same: nothing to write
    kube.writes.clear()
    with pytest.raises(Requeue):
        rec.reconcile(ClassKey("gold"))
    assert kube.writes == []
    engine_pods(1, 1)
    with pytest.raises(Requeue):
        rec.reconcile(ClassKey("gold"))
    st = kube.get(API_VERSION, "TrustClass", "gold")["status"]
    assert (st["replicas"], st["readyReplicas"]) == (1, 1)
    assert kube.writes == [("status", "TrustClass", "gold")]


def tenant(kube: FakeKube, name: str = "acme", trust_class: str = "gold", **quotas: int) -> None:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
    data = {"key": base64.b64encode(f"sk-{name}".encode()).decode()}
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-keys", "namespace": "team-a"},
            "data": data,
        }
    )
    kube.put(
        {
            "apiVersion": API_VERSION,
            "kind": "TenantBinding",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {
                "tenantId": name,
                "trustClassName": trust_class,
                "apiKeySecretRef": {"name": f"{name}-keys"},
                **({"quotas": quotas} if quotas else {}),
            },
        }
    )


def test_a_new_class_starts_its_engine_at_once_and_its_tenant_binds_in_one_status_write() -> None:
    kube = FakeKube()
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvfence-system"}})
    events: list[Event] = []
    rec = Reconciler(kube, builders.OperatorOptions(), emit=events.append, new_key=lambda: bytes(range(32)))  # type: ignore[arg-type]
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube, maxKVBlocks=64)  # a KV quota: the engine config names the tenant
    binding = ("status", "TenantBinding", "acme")
    # A decision made before the class's first reconcile leaves its binding alone: the class is
    # about to get a key, and "not ready yet" would be true for a moment only.
    rec.reconcile(ROUTING)
    assert binding not in kube.writes and "status" not in kube.get(
        API_VERSION, "TenantBinding", "acme", "team-a"
    )
    # The class's first reconcile: its key, then its engine, whose config names no tenant yet (their
    # quotas come from the routing decision this reconcile queues); nothing is read in the namespace
    # it has just made, and nothing polls.
    kube.reads.clear()
    assert rec.reconcile(ClassKey("gold")) == {ROUTING}
    assert sorted(kube.reads) == ["Namespace", "TrustClass"]
    assert builders.read_signing_secret(kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, "kvf-gold"))
    deployment = kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, "kvf-gold")
    assert deployment is not None
    assert engine_config(kube)["quotas"]["tenants"] == {}
    assert engine_config(kube)["tenantsPending"] is True  # its pods are not ready until it is gone
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"]
        == "/ready"
    )
    assert rec.take_later() == {}
    assert "acme" not in decode(kube)["tenants"]  # the router routes none of its tenants yet
    # That decision binds the tenant at once and wakes the class.
    assert ClassKey("gold") in rec.reconcile(ROUTING)
    tb = kube.get(API_VERSION, "TenantBinding", "acme", "team-a")
    assert condition(tb, conditions.BOUND)["status"] == "True"
    assert condition(tb, conditions.READY)["reason"] == conditions.REASON_BOUND
    assert kube.writes.count(binding) == 1
    # A new binding that binds gets no Event (its status says so); the class's key did.
    assert [e.reason for e in events if e.obj["kind"] == "TenantBinding"] == []
    # The class woken: its engine config gets the tenant's quotas; the engine re-reads the file, its
    # pods are not replaced (the pod template is the same, not applied again).
    kube.writes.clear()
    rec.reconcile(ClassKey("gold"))
    assert "acme" in engine_config(kube)["quotas"]["tenants"]
    assert "tenantsPending" not in engine_config(kube)
    assert ("apply", "ConfigMap", builders.CONFIG_NAME) in kube.writes
    assert [w for w in kube.writes if w[1] == "Deployment"] == []
    assert kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, "kvf-gold") == deployment
    applied = [e.message for e in events if e.reason == "Applied"]
    assert len(applied) == 2 and "Namespace" in applied[0] and "Deployment" in applied[0]
    assert applied[1] == f"applied ConfigMap/{builders.CONFIG_NAME}"
    # A change of fate is news: one Warning Event (its class is gone: the binding is denied).
    kube.delete(API_VERSION, "TrustClass", "gold")
    rec.reconcile(ROUTING)
    assert (
        condition(kube.get(API_VERSION, "TenantBinding", "acme", "team-a"), conditions.DENIED)["status"]
        == "True"
    )
    assert [(e.reason, e.type) for e in events if e.obj["kind"] == "TenantBinding"] == [
        (conditions.REASON_TRUST_CLASS_NOT_FOUND, "Warning")
    ]


def test_after_a_restart_a_running_engine_keeps_its_tenants_until_the_decision_routes_its_class() -> None:
    """Only a new class renders its engine before the routing decision: a restarted operator's first
    reconcile of a class whose engine runs leaves it alone (its config would name no tenant)."""
    kube = FakeKube()
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvfence-system"}})
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube, maxKVBlocks=64)
    rec = Reconciler(kube, builders.OperatorOptions(), new_key=lambda: bytes(range(32)))  # type: ignore[arg-type]
    first_pass(rec)
    rec.reconcile(ClassKey("gold"))
    assert "acme" in engine_config(kube)["quotas"]["tenants"]
    restarted = Reconciler(kube, builders.OperatorOptions(), new_key=lambda: bytes(range(32, 64)))  # type: ignore[arg-type]
    kube.writes.clear()
    assert restarted.reconcile(ClassKey("gold")) == {ROUTING}
    assert [w for w in kube.writes if w[0] == "apply"] == []
    assert "acme" in engine_config(kube)["quotas"]["tenants"]
    assert ClassKey("gold") in restarted.reconcile(ROUTING)
    restarted.reconcile(ClassKey("gold"))
    assert [w for w in kube.writes if w[0] == "apply"] == []
    assert "acme" in engine_config(kube)["quotas"]["tenants"]


def test_a_class_that_gets_no_key_on_its_first_reconcile_has_its_bindings_told(world: Any) -> None:
    kube, rec, route = world
    kube.put(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvf-gold", "labels": {"team": "x"}}}
    )
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube)
    route()
    assert "status" not in kube.get(API_VERSION, "TenantBinding", "acme", "team-a")
    assert rec.reconcile(ClassKey("gold")) == set()  # NamespaceConflict: no key
    assert rec.take_later() == {ROUTING: 0}  # its bindings are decided again at once
    route()
    c = condition(kube.get(API_VERSION, "TenantBinding", "acme", "team-a"), conditions.BOUND)
    assert (c["status"], c["reason"]) == ("False", conditions.REASON_TRUST_CLASS_NOT_READY)


def test_a_child_seen_as_desired_is_not_read_again_until_its_watch_reports_another_version(
    world: Any,
) -> None:
    kube, rec, _ = world
    kube.put(trust_class())
    first_pass(rec)
    rec.reconcile(ClassKey("gold"))
    kube.reads.clear()
    rec.reconcile(ClassKey("gold"))
    # the Deployment is read for its status, the signing key for its keys; the others (the namespace
    # too) were applied as desired and nothing says they changed since
    assert sorted(kube.reads) == ["Deployment", "Secret", "TrustClass"]
    cm_ref = ("v1", "ConfigMap", builders.CONFIG_NAME, "kvf-gold")
    applied = kube.get(*cm_ref)
    assert (
        rec.child_event("ConfigMap", "kvf-gold", builders.CONFIG_NAME, applied["metadata"]["resourceVersion"])
        is False
    )
    # an edit by someone else is news: the class's next reconcile reads the object and puts it back
    edited = copy.deepcopy(applied)
    edited["data"] = {builders.CONFIG_KEY: "{}"}
    kube.put(edited)
    assert (
        rec.child_event("ConfigMap", "kvf-gold", builders.CONFIG_NAME, edited["metadata"]["resourceVersion"])
        is True
    )
    kube.writes.clear()
    rec.reconcile(ClassKey("gold"))
    assert kube.writes == [("apply", "ConfigMap", builders.CONFIG_NAME)]
    assert kube.get(*cm_ref)["data"] == applied["data"]
    # and so is a deletion
    kube.delete(*cm_ref)
    assert rec.child_event("ConfigMap", "kvf-gold", builders.CONFIG_NAME, "") is True
    rec.reconcile(ClassKey("gold"))
    assert kube.get(*cm_ref)["data"] == applied["data"]
    # the resync forgets what was seen: every child is read again
    rec.forget_children()
    kube.reads.clear()
    rec.reconcile(ClassKey("gold"))
    assert {"ConfigMap", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= set(kube.reads)


def test_a_child_change_only_where_the_operator_never_looks_is_no_news_and_needs_no_read(
    world: Any,
) -> None:
    """A PodDisruptionBudget's status (its disruption controller's) or a Deployment's condition
    timestamps change nothing the operator reads: their events queue no reconcile, and the next
    reconcile does not read the PodDisruptionBudget. Anything it reads is still news."""
    kube, rec, _ = world
    kube.put(trust_class())
    first_pass(rec)
    rec.reconcile(ClassKey("gold"))
    pdb_ref = ("policy/v1", "PodDisruptionBudget", builders.ENGINE_NAME, "kvf-gold")
    pdb = kube.get(*pdb_ref)

    def event(obj: Obj) -> bool:
        m = obj["metadata"]
        return rec.child_event(
            obj["kind"], m["namespace"], m["name"], m["resourceVersion"], child_digest(obj)
        )

    assert event(pdb) is False  # its own write coming back
    pdb["status"] = {"currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1}
    kube.put(pdb)
    assert event(pdb) is False  # only its status: not news ...
    kube.reads.clear()
    rec.reconcile(ClassKey("gold"))
    assert "PodDisruptionBudget" not in kube.reads  # ... and known as desired still
    pdb["metadata"]["labels"] = {**pdb["metadata"]["labels"], "edited": "yes"}
    kube.put(pdb)
    assert event(pdb) is True  # its metadata is read: news
    kube.writes.clear()
    rec.reconcile(ClassKey("gold"))  # read and seen as desired (a label added is not drift)
    pdb = kube.get(*pdb_ref)
    assert event(pdb) is False
    pdb["spec"] = {**pdb["spec"], "maxUnavailable": 5}
    kube.put(pdb)
    assert event(pdb) is True  # its spec: news, and put back
    rec.reconcile(ClassKey("gold"))
    assert kube.get(*pdb_ref)["spec"]["maxUnavailable"] != 5

    dep = kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, "kvf-gold")
    assert event(dep) is False
    progressing = {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
    dep["status"] = {"conditions": [{**progressing, "lastUpdateTime": "2026-12-02T00:00:00Z"}]}
    kube.put(dep)
    assert event(dep) is True  # a status the class's status is computed from changed
    kube.put(dep)  # the same status again, a new version
    dep = kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, "kvf-gold")
    assert event(dep) is True  # the last event was not a version the operator saw as desired
    rec.reconcile(ClassKey("gold"))
    dep = kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, "kvf-gold")
    assert event(dep) is False
    dep["status"]["conditions"][0]["lastUpdateTime"] = "2026-12-02T00:00:09Z"
    dep["status"]["unavailableReplicas"] = 0
    kube.put(dep)
    assert event(dep) is False  # nothing the class status reads
    dep["status"]["availableReplicas"] = 1
    kube.put(dep)
    assert event(dep) is True
    assert rec.child_event("PodDisruptionBudget", "kvf-gold", builders.ENGINE_NAME, "") is True  # deleted


def test_what_was_remembered_of_a_deleted_class_children_goes_with_it(world: Any) -> None:
    """The versions seen and watched are per child: a deleted class (and the deletion events of its
    children that garbage collection sends afterwards) leaves none of them behind."""
    kube, rec, _ = world
    kube.put(trust_class())
    first_pass(rec)
    rec.reconcile(ClassKey("gold"))
    for kind, name in (("ConfigMap", builders.CONFIG_NAME), ("Service", builders.ENGINE_NAME)):
        rec.child_event(kind, "kvf-gold", name, "12345", "digest")  # versions the watches reported
    assert any(ref[1] == "kvf-gold" for ref in rec.state.seen)
    kube.delete(API_VERSION, "TrustClass", "gold")
    rec.reconcile(ClassKey("gold"))
    for kind, name in (("ConfigMap", builders.CONFIG_NAME), ("Deployment", builders.ENGINE_NAME)):
        assert rec.child_event(kind, "kvf-gold", name, "") is True  # garbage collection, afterwards
    memos = (rec.state.seen, rec.state.watched, rec.state.digests)
    leftover = [ref for memo in memos for ref in memo if "kvf-gold" in ref]
    assert leftover == []


def test_a_signing_key_event_is_news_unless_it_carries_the_keys_the_router_holds(world: Any) -> None:
    """The watch of a class's signing-key Secret needs no GET for the operator's own write coming
    back, and only for that: other keys, no key, or another class's Secret are news."""
    kube, rec, _ = world
    kube.put(trust_class())
    first_pass(rec)
    secret = kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, "kvf-gold")
    assert rec.signing_secret_is_current("gold", secret)
    forged = copy.deepcopy(secret)
    forged["data"][builders.SIGNING_KEY_CURRENT] = base64.b64encode(bytes(32)).decode()
    assert not rec.signing_secret_is_current("gold", forged)
    added = copy.deepcopy(secret)
    added["data"][builders.SIGNING_KEY_PREVIOUS] = base64.b64encode(bytes(32)).decode()
    assert not rec.signing_secret_is_current("gold", added)
    assert not rec.signing_secret_is_current("gold", {"data": {}, "metadata": {}})
    assert not rec.signing_secret_is_current("gold", None)
    assert not rec.signing_secret_is_current("silver", secret)  # no keys held for that class


def test_an_api_key_secret_event_rereads_only_a_version_not_read_yet(world: Any) -> None:
    """The binding's keys are read again when the watch reports a version other than the one read
    (a rotation), and not for the version already read (a restarted watch lists every Secret again)."""
    kube, rec, route = world
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube)
    first_pass(rec)
    route()
    read_at = rec.cached_secret_version("team-a/acme")
    assert read_at is not None
    got: list[tuple[str, str | None, str]] = []
    get = kube.get

    def recording_get(api: str, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        got.append((kind, namespace, name))
        return get(api, kind, name, namespace)

    kube.get = recording_get  # type: ignore[method-assign]
    api_key_secret = ("Secret", "team-a", "acme-keys")
    rec.secret_changed("team-a", "acme-keys", read_at)
    rec.reconcile(BindingSecretKey("team-a", "acme-keys"))
    rec.reconcile(ROUTING)
    assert api_key_secret not in got
    # A rotation: new content, a new version; the watch says so, the decision reads it.
    rotated = get("v1", "Secret", "acme-keys", "team-a")
    assert rotated is not None
    rotated["data"] = {"key": base64.b64encode(b"sk-acme-rotated").decode()}
    kube.put(rotated)
    rec.secret_changed("team-a", "acme-keys", rotated["metadata"]["resourceVersion"])
    rec.reconcile(BindingSecretKey("team-a", "acme-keys"))
    rec.reconcile(ROUTING)
    assert got.count(api_key_secret) == 1
    assert rec.cached_secret_version("team-a/acme") == rotated["metadata"]["resourceVersion"]


def test_the_classes_a_decision_wakes_are_queued_before_it_writes_the_bindings_statuses(world: Any) -> None:
    kube, rec, route = world
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube)
    route()
    assert rec.reconcile(ClassKey("gold")) == {ROUTING}
    handed: list[Any] = []
    rec.notify = lambda: handed.extend(rec.take_later())  # the work queue takes them at once
    at_write: list[list[Any]] = []
    patch_status = kube.patch_status

    def recording(api: str, kind: str, name: str, namespace: str | None, status: Obj) -> Obj:
        if kind == "TenantBinding":
            at_write.append(list(handed))
        return patch_status(api, kind, name, namespace, status)

    kube.patch_status = recording  # type: ignore[method-assign]
    follow = rec.reconcile(ROUTING)
    # the class renders its engine while the decision's status writes are sent, and is queued once
    assert at_write == [[ClassKey("gold")]]
    assert ClassKey("gold") not in follow


def _status_writes_seeing_the_engine(kube: FakeKube) -> list[bool]:
    """At each TenantBinding status write: whether class gold's engine config names tenant acme yet
    (its engine Deployment was applied, without tenants, by the class's first reconcile)."""
    at_write: list[bool] = []
    patch_status = kube.patch_status

    def recording(api: str, kind: str, name: str, namespace: str | None, status: Obj) -> Obj:
        if kind == "TenantBinding":
            assert ("apps/v1", "Deployment", "kvf-gold", builders.ENGINE_NAME) in kube.objs
            at_write.append("acme" in engine_config(kube)["quotas"]["tenants"])
        return patch_status(api, kind, name, namespace, status)

    kube.patch_status = recording  # type: ignore[method-assign]
    return at_write


def test_with_other_workers_a_decision_writes_binding_statuses_after_the_engines_it_woke(world: Any) -> None:
    """The work queue has more than one worker: the classes a decision routes for the first time render
    their engines (on another worker) before the decision sends its bindings' status writes, which
    would otherwise take most of the API server's answers from those renders."""
    kube, rec, _ = world
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube, maxKVBlocks=64)
    assert rec.reconcile(ClassKey("gold")) == {ROUTING}
    other_worker = ThreadPoolExecutor(1)
    rendered: list[Any] = []

    def notify() -> None:  # the work queue hands the class to another worker
        for key in rec.take_later():
            if isinstance(key, ClassKey):
                # a render slower than the decision's own requests, as on a busy API server
                rendered.append(other_worker.submit(lambda k=key: (time.sleep(0.3), rec.reconcile(k))[1]))

    rec.notify = notify
    rec.renders_meanwhile = True
    at_write = _status_writes_seeing_the_engine(kube)
    rec.reconcile(ROUTING)
    assert at_write == [True]
    assert len(rendered) == 1 and rendered[0].result() == set()
    tb = kube.get(API_VERSION, "TenantBinding", "acme", "team-a")
    assert condition(tb, conditions.BOUND)["status"] == "True"
    other_worker.shutdown()


def test_a_decision_waits_for_the_renders_it_queued_only_so_long(
    world: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No worker takes the class (all busy, or the render hangs): the statuses are written after
    RENDER_PRECEDENCE_SECONDS anyway, with a warning, and the next decision does not wait for it."""
    kube, rec, _ = world
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube, maxKVBlocks=64)
    assert rec.reconcile(ClassKey("gold")) == {ROUTING}
    rec.notify = lambda: None
    rec.renders_meanwhile = True
    monkeypatch.setattr(routing_reconcile, "RENDER_PRECEDENCE_SECONDS", 0.2)
    at_write = _status_writes_seeing_the_engine(kube)
    rec.reconcile(ROUTING)
    assert at_write == [False]
    assert "1 not rendered yet, writing the statuses now" in caplog.text
    assert not rec._rendering


def test_a_class_reconcile_in_flight_when_the_decision_routes_it_does_not_count_as_its_render(
    world: Any,
) -> None:
    """A reconcile that started before the decision saw the class unrouted and rendered nothing: only
    the reconcile the decision queued releases the status writes."""
    kube, rec, _ = world
    kube.put(trust_class(namespaceSelector={}))
    tenant(kube, maxKVBlocks=64)
    rec.notify = lambda: None
    rec.renders_meanwhile = True
    real = rec._reconcile_class
    routed = threading.Event()
    finished = threading.Event()

    def first_reconcile_meets_the_decision(name: str) -> set[Any]:
        out = real(name)  # the key is made; the class waits for a decision
        routed.wait(5)  # ... which runs now, before this reconcile ends
        return out

    rec._reconcile_class = first_reconcile_meets_the_decision  # type: ignore[method-assign]
    at_write = _status_writes_seeing_the_engine(kube)
    worker = threading.Thread(target=lambda: (rec.reconcile(ClassKey("gold")), finished.set()))
    worker.start()
    deadline = time.monotonic() + 5
    while "gold" not in rec.state.signing and time.monotonic() < deadline:
        time.sleep(0.01)
    rec._reconcile_class = real  # type: ignore[method-assign]
    decision = threading.Thread(target=rec.reconcile, args=(ROUTING,))
    decision.start()
    deadline = time.monotonic() + 5
    while "gold" not in rec._rendering and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "gold" in rec._rendering
    routed.set()
    assert finished.wait(5)
    time.sleep(0.2)
    # still waiting: the in-flight reconcile rendered nothing
    assert "gold" in rec._rendering and at_write == [] and decision.is_alive()
    rec.reconcile(ClassKey("gold"))  # the render the decision queued
    decision.join(5)
    assert not decision.is_alive() and not rec._rendering and at_write == [True]
    worker.join(5)


def test_a_class_edit_under_a_bound_tenant_clamps_it_and_says_so_once(world: Any) -> None:
    """Lower quota limits on the class: the binding stays Bound and Ready with its spec accepted,
    ``Clamped=True`` and kstatus ``Stalled`` say what was clamped, one Warning Event tells it, the
    routing table and the engine config carry the clamped quota; raised again: served as specified."""
    kube, rec, route = world
    events: list[Event] = []
    rec._emit = events.append
    limits = {"requestsPerMinute": 60000, "maxKVBlocks": 512}
    kube.put(trust_class(namespaceSelector={}, quotas={"limits": limits}))
    tenant(kube)
    tb_key = (API_VERSION, "TenantBinding", "team-a", "acme")
    kube.objs[tb_key]["spec"]["quotas"] = {"requestsPerMinute": 30000, "maxKVBlocks": 256}
    first_pass(rec)
    rec.reconcile(ClassKey("gold"))
    tb = kube.get(API_VERSION, "TenantBinding", "acme", "team-a")
    assert condition(tb, conditions.CLAMPED)["reason"] == conditions.REASON_WITHIN_CLASS_LIMITS
    accepted = tb["status"]["acceptedSpec"]

    def engine_tenants() -> Any:
        return engine_config(kube)["quotas"]["tenants"]

    assert engine_tenants()["acme"]["maxBlocks"] == 256

    def edit_class(**lim: int) -> None:
        tc = kube.objs[(API_VERSION, "TrustClass", "", "gold")]
        tc["spec"]["quotas"] = {"limits": lim}
        tc["metadata"]["generation"] += 1
        rec.reconcile(ClassKey("gold"))
        rec.reconcile(ROUTING)
        rec.reconcile(ClassKey("gold"))  # the decision's follow-up: the tenants' KV quotas

    events.clear()
    edit_class(requestsPerMinute=12000, maxKVBlocks=128)
    tb = kube.get(API_VERSION, "TenantBinding", "acme", "team-a")
    for ctype, status in (
        (conditions.BOUND, "True"),
        (conditions.READY, "True"),
        (conditions.DENIED, "False"),
        (conditions.SPEC_ACCEPTED, "True"),
        (conditions.CLAMPED, "True"),
        (conditions.STALLED, "True"),
        (conditions.RECONCILING, "False"),
    ):
        assert condition(tb, ctype)["status"] == status, (ctype, tb["status"])
    clamp = condition(tb, conditions.CLAMPED)
    assert clamp["reason"] == conditions.REASON_CLAMPED == condition(tb, conditions.STALLED)["reason"]
    assert "requestsPerMinute 30000 -> 12000, maxKVBlocks 256 -> 128" in clamp["message"]
    assert clamp["observedGeneration"] == tb["metadata"]["generation"]
    assert tb["status"]["acceptedSpec"] == accepted  # the tenant's own spec stays the one in force
    assert argocd_health("tenantbinding", tb) == ("Degraded", f"ClampedToClassLimits: {clamp['message']}")
    route_ = decode(kube)["tenants"]["acme"]
    assert route_["quotas"]["requestsPerMinute"] == 12000 and route_["quotas"]["maxKVBlocks"] == 128
    assert engine_tenants()["acme"]["maxBlocks"] == 128
    told = [(e.reason, e.type) for e in events if e.obj["kind"] == "TenantBinding"]
    assert told == [(conditions.REASON_CLAMPED, "Warning")]
    # Decided again with nothing changed: no write, no second Event.
    kube.writes.clear()
    route()
    assert ("status", "TenantBinding", "acme") not in kube.writes
    assert len([e for e in events if e.obj["kind"] == "TenantBinding"]) == 1

    edit_class(requestsPerMinute=60000, maxKVBlocks=512)
    tb = kube.get(API_VERSION, "TenantBinding", "acme", "team-a")
    assert condition(tb, conditions.CLAMPED)["status"] == "False"
    assert condition(tb, conditions.STALLED)["status"] == "False"
    assert argocd_health("tenantbinding", tb)[0] == "Healthy"
    assert decode(kube)["tenants"]["acme"]["quotas"]["requestsPerMinute"] == 30000
    assert engine_tenants()["acme"]["maxBlocks"] == 256
    told = [(e.reason, e.type) for e in events if e.obj["kind"] == "TenantBinding"]
    assert told == [(conditions.REASON_CLAMPED, "Warning"), (conditions.REASON_WITHIN_CLASS_LIMITS, "Normal")]


def decode(kube: FakeKube) -> Any:
    s = kube.get("v1", "Secret", "kvfence-routing", "kvfence-system")
    return json.loads(decode_table_bytes(base64.b64decode(s["data"][ROUTING_SECRET_KEY])))


def test_a_namespace_full_of_new_bindings_has_its_api_keys_read_by_one_list(world: Any) -> None:
    """The first decision over many bindings of one namespace reads their API-key Secrets with one
    paged LIST, not a GET each; the keys are those a GET would have given (each tenant routed with
    its own key's hash), a Secret that is missing still denies its binding, and a Secret that no
    binding names is not kept. A namespace that refuses the LIST has its keys read one by one."""
    kube, rec, _ = world
    kube.put(trust_class(namespaceSelector={}))
    n = apikeys.API_KEYS_LIST_MIN + 4
    for i in range(n):
        tenant(kube, f"t{i}")
    kube.objs.pop(("v1", "Secret", "team-a", "t3-keys"))
    unrelated = {"name": "app-db-password", "namespace": "team-a"}
    kube.put({"apiVersion": "v1", "kind": "Secret", "metadata": unrelated, "data": {"pw": "c2VjcmV0"}})
    first_pass(rec)
    # the routing Secret, and the missing one (a LIST's absence is not cached: a Secret created later
    # is read): no other Secret is read by GET
    assert kube.reads.count("Secret") == 2
    tenants = decode(kube)["tenants"]
    assert len(tenants) == n - 1
    for tid, t in tenants.items():
        assert t["apiKeyHashes"] == [hash_api_key(f"sk-{tid}")]
    denied = condition(kube.get(API_VERSION, "TenantBinding", "t3", "team-a"), conditions.DENIED)
    assert denied["reason"] == conditions.REASON_SECRET_NOT_FOUND
    assert sorted(cached[0][0] for cached in rec.state.keys.values()) == sorted(
        f"t{i}-keys" for i in range(n) if i != 3
    )

    class NoList(FakeKube):
        def list(self, api: str, kind: str, *args: Any, **kw: Any) -> list[Obj]:
            if kind == "Secret":
                raise KubeError(403, "Forbidden", "{}")
            return super().list(api, kind, *args, **kw)

    kube2 = NoList()
    kube2.objs = copy.deepcopy(kube.objs)
    rec2 = Reconciler(kube2, builders.OperatorOptions(), new_key=lambda: bytes(range(32)))  # type: ignore[arg-type]
    rec2.reconcile(ROUTING)
    # each API key by GET (the missing one too), the signing key (a new process), the routing Secret
    assert kube2.reads.count("Secret") == n + 2
    assert decode(kube2)["tenants"] == tenants
