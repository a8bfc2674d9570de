"""The reconciler's decisions against an in-memory API (no cluster): what it applies, what it refuses
to apply, and that a reconcile of a cluster already as it should be writes nothing. The same paths run
against a real kube-apiserver in test_operator_reconcile.py; this is the fast lane's view of them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kvfence.api import conditions
from kvfence.api.common import API_VERSION
from kvfence.operator import builders
from kvfence.operator.keys import ROUTING, ClassKey
from kvfence.operator.reconciler import Reconciler, Requeue

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

    def __init__(self) -> None:
        self.objs: dict[tuple[str, str, str, str], Obj] = {}
        self.writes: list[tuple[str, str, str]] = []
        self._uid = 0

    @staticmethod
    def _key(api: str, kind: str, ns: str | None, name: str) -> tuple[str, str, str, str]:
        return (api, kind, ns or "", name)

    def put(self, obj: Obj) -> None:
        m = obj["metadata"]
        m.setdefault("generation", 1)
        self._uid += 1
        m.setdefault("uid", f"uid-{self._uid}")
        self.objs[self._key(obj["apiVersion"], obj["kind"], m.get("namespace"), m["name"])] = obj

    def get(self, api: str, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        return copy.deepcopy(self.objs.get(self._key(api, kind, namespace, name)))

    def list(
        self, api: str, kind: str, namespace: str | None = None, label_selector: str | None = None
    ) -> list[Obj]:
        out = [
            copy.deepcopy(o)
            for (a, k, ns, _), o in sorted(self.objs.items())
            if a == api and k == kind and (namespace is None or ns == namespace)
        ]
        return out

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


def condition(obj: Obj | None, ctype: str) -> Obj:
    return next((c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == ctype), {})


def test_a_class_is_rendered_into_its_namespace_and_a_second_pass_writes_nothing(world: Any) -> None:
    kube, rec, route = world
    kube.put(trust_class())
    route()
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
    kube, rec, route = world
    ref = {"name": "tools", "form": "completion", "configMapKeyRef": {"name": "prompts", "key": "tools"}}
    kube.put(trust_class(prefixCache={"sharedPrefixes": [ref]}))
    route()
    with pytest.raises(Requeue, match=r"sharedPrefixes\[tools\]"):
        rec.reconcile(ClassKey("gold"))
    assert kube.get("v1", "ConfigMap", builders.CONFIG_NAME, "kvf-gold") is None
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


def test_a_class_is_not_rendered_before_the_first_routing_decision(world: Any) -> None:
    kube, rec, _ = world
    kube.put(trust_class())
    with pytest.raises(Requeue, match="first routing decision"):
        rec.reconcile(ClassKey("gold"))
    assert kube.get("apps/v1", "Deployment", "kvfence-engine", "kvf-gold") is None
