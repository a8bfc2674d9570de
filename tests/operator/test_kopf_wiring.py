"""How the operator configures kopf (no cluster): only event handlers, so no diff base and no per-object
record is built or kept."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from kvfence.operator import handlers, kopf_settings
from kvfence.operator.builders import ANNOTATION_ROTATE
from kvfence.operator.keys import ROUTING, ClassKey
from kvfence.operator.workqueue import Controller


def test_the_operator_registers_only_event_handlers() -> None:
    registry = kopf.get_default_registry()
    kopf_settings.ensure_only_event_handlers(registry)
    ids = {h.id for h in registry._watching.get_all_handlers()}
    assert {"trustclass_event", "tenantbinding_event", "child-deployments", "signing-key-secrets"} <= ids


def test_a_handler_that_needs_a_diff_base_is_refused_at_start() -> None:
    registry = kopf.OperatorRegistry()

    @kopf.on.create("kvfence.dev", "v1alpha1", "trustclasses", registry=registry, id="on-create")
    def created(**_: Any) -> None:
        pass

    with pytest.raises(RuntimeError, match=r"on-create.*diff base"):
        kopf_settings.ensure_only_event_handlers(registry)


def test_an_index_handler_is_refused_at_start() -> None:
    """An index lives in kopf's per-object records, which EventOnlyMemories does not keep."""
    registry = kopf.OperatorRegistry()

    @kopf.index("kvfence.dev", "v1alpha1", "trustclasses", registry=registry, id="by-name")
    def by_name(name: str, **_: Any) -> str:
        return name

    with pytest.raises(RuntimeError, match=r"by-name.*per-object records"):
        kopf_settings.ensure_only_event_handlers(registry)


def test_kopf_keeps_no_record_of_the_objects_it_has_seen() -> None:
    """Each event gets a fresh record (kopf's ``ephemeral``), with a copy of the operator's memo."""

    async def run() -> None:
        memories = kopf_settings.EventOnlyMemories()
        memo = kopf.Memo(controller="the-controller")
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a", "uid": "u-1"}}
        first = await memories.recall(body, memobase=memo, noticed_by_listing=True)
        second = await memories.recall(body, memobase=memo)
        assert first is not second
        assert first.memo is not memo and first.memo.controller == "the-controller"
        assert first.noticed_by_listing and not second.noticed_by_listing
        assert list(memories.iter_all_memories()) == []
        await memories.forget(body)  # a deletion of an object never remembered is fine

    asyncio.run(run())


def test_no_diff_base_is_copied_or_stored() -> None:
    storage = kopf_settings.NoDiffBase()
    body = kopf.Body({"metadata": {"name": "a", "annotations": {"x": "1"}}, "spec": {"replicas": 2}})
    assert storage.build(body=body) == {}
    assert storage.fetch(body=body) is None
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=kopf.BodyEssence(spec={"replicas": 2}))
    assert not patch  # nothing written onto the object


class _Reconciler:
    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.kube: Any = None

    def forget_api_keys(self, binding: str | None = None) -> None:
        assert binding is not None
        self.forgotten.append(binding)

    def secret_untracked(self, secret: tuple[str, str]) -> None:
        pass


class _NoDelay:
    """The controller's loop, with the coalescing delay taken away: a queued key shows at once."""

    def call_later(self, delay: float, fn: Any, *args: Any) -> None:
        fn(*args)


async def _binding_event(c: Controller, type: str | None, generation: int) -> None:
    spec = {"tenantId": "t", "trustClassName": "c", "apiKeySecretRef": {"name": "t-keys"}}
    await handlers.tenantbinding_event(
        namespace="ns",
        name="b",
        type=type,
        meta={"generation": generation},
        spec=spec,
        status={},
        memo=kopf.Memo(controller=c),
    )


def test_a_bindings_api_keys_are_read_again_when_its_spec_changes_not_on_its_first_event() -> None:
    async def run() -> list[str]:
        r = _Reconciler()
        c = Controller(r)  # type: ignore[arg-type]
        c._loop, c._queue = asyncio.get_running_loop(), asyncio.Queue()
        await _binding_event(c, None, 1)  # first sight: the decision that listed it read its keys
        await _binding_event(c, "MODIFIED", 1)  # its status written: same spec
        assert r.forgotten == []
        await _binding_event(c, "MODIFIED", 2)  # the spec changed
        await _binding_event(c, "DELETED", 2)
        return r.forgotten

    assert asyncio.run(run()) == ["ns/b", "ns/b"]


def test_a_bindings_own_status_write_coming_back_queues_no_routing_decision() -> None:
    """A decision over 10,000 bindings writes 10,000 statuses; their events (same generation: the spec
    and the accepted spec a decision reads are unchanged) must not queue a second decision over them
    all. A new binding, a spec change and a deletion do."""

    async def run() -> list[bool]:
        c = Controller(_Reconciler())  # type: ignore[arg-type]
        c._loop, c._queue = _NoDelay(), asyncio.Queue()  # type: ignore[assignment]
        queued = []
        for type_, generation in ((None, 1), ("MODIFIED", 1), (None, 1), ("MODIFIED", 2), ("DELETED", 2)):
            await _binding_event(c, type_, generation)
            queued.append(ROUTING in c._queued)
            c._queued.clear()
        return queued

    # first sight, its status written, a relist, the spec edited, deleted
    assert asyncio.run(run()) == [True, False, False, True, True]


def test_a_trust_class_event_queues_a_routing_decision_only_for_what_a_decision_reads() -> None:
    """A new class, a spec edit (generation), a deletion: a decision follows. Its finalizer added by its
    first reconcile, or a rotation requested: the class is reconciled, no decision over every binding
    (the reconcile tells the router of a new key itself)."""

    async def run() -> list[tuple[bool, bool]]:
        c = Controller(_Reconciler())  # type: ignore[arg-type]
        c._loop, c._queue = _NoDelay(), asyncio.Queue()  # type: ignore[assignment]
        c.watched_body = lambda *_: None  # type: ignore[method-assign]
        out = []
        steps: list[tuple[str | None, dict[str, Any]]] = [
            (None, {"generation": 1}),
            ("MODIFIED", {"generation": 1, "finalizers": ["kvfence.dev/cleanup"]}),
            ("MODIFIED", {"generation": 1, "finalizers": ["kvfence.dev/cleanup"]}),  # its status written
            (
                "MODIFIED",
                {
                    "generation": 1,
                    "finalizers": ["kvfence.dev/cleanup"],
                    "annotations": {ANNOTATION_ROTATE: "1"},
                },
            ),
            (
                "MODIFIED",
                {
                    "generation": 2,
                    "finalizers": ["kvfence.dev/cleanup"],
                    "annotations": {ANNOTATION_ROTATE: "1"},
                },
            ),
            ("MODIFIED", {"generation": 3, "deletionTimestamp": "t", "finalizers": ["kvfence.dev/cleanup"]}),
            ("DELETED", {"generation": 3}),
        ]
        for type_, meta in steps:
            await handlers.trustclass_event(
                name="gold", type=type_, meta=meta, body={}, memo=kopf.Memo(controller=c)
            )
            out.append((ClassKey("gold") in c._queued, ROUTING in c._queued))
            c._queued.clear()
        return out

    assert asyncio.run(run()) == [
        (True, True),  # new
        (True, False),  # its finalizer
        (False, False),  # its own status write
        (True, False),  # a rotation asked
        (True, True),  # the spec edited
        (True, True),  # being deleted
        (True, True),  # gone
    ]


def test_a_namespace_event_queues_a_routing_decision_only_where_bindings_live() -> None:
    """A namespace's labels decide which classes admit its bindings: a label change where bindings live
    queues a decision; the namespaces the operator creates for new classes (no bindings) do not."""

    async def namespace(c: Controller, name: str, labels: dict[str, str], type_: str = "MODIFIED") -> bool:
        await handlers.namespace_event(
            name=name, type=type_, labels=labels, meta={"resourceVersion": "1"}, memo=kopf.Memo(controller=c)
        )
        queued = ROUTING in c._queued
        c._queued.clear()
        return queued

    async def run() -> list[bool]:
        r = _Reconciler()
        r.child_event = lambda *_: False  # type: ignore[attr-defined]
        c = Controller(r)  # type: ignore[arg-type]
        c._loop, c._queue = _NoDelay(), asyncio.Queue()  # type: ignore[assignment]
        out = [await namespace(c, "ns", {"team": "a"})]  # no binding known there yet
        await _binding_event(c, None, 1)  # ns/b
        c._queued.clear()
        out.append(await namespace(c, "ns", {"team": "b"}))  # relabelled where a binding lives
        out.append(await namespace(c, "ns", {"team": "b"}))  # unchanged
        out.append(await namespace(c, "kvf-gold", {"kvfence.dev/trust-class": "gold"}))  # a class's own
        await _binding_event(c, "DELETED", 1)
        c._queued.clear()
        out.append(await namespace(c, "ns", {"team": "c"}))  # no binding left there
        return out

    assert asyncio.run(run()) == [False, True, False, False, False]
