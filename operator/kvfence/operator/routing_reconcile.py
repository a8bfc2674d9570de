"""The routing decision: every TenantBinding decided against every TrustClass at once
(:func:`kvfence.operator.bindings.decide`), the routing table written for the router, each binding's
status written, and the classes whose tenants changed queued to render their engines.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from kvfence.api import conditions
from kvfence.api.common import API_VERSION
from kvfence.api.tenantbinding import TenantBinding
from kvfence.api.trustclass import TrustClass
from kvfence.contract.routing import ROUTING_SECRET_NAME
from kvfence.operator import builders, memory
from kvfence.operator.apikeys import ApiKeyCache
from kvfence.operator.bindings import (
    ClassState,
    Decision,
    Outcome,
    decide,
    routing_secret,
)
from kvfence.operator.bookkeeping import needs_apply, with_spec_hash
from kvfence.operator.events import Event
from kvfence.operator.keys import ClassKey, Key
from kvfence.operator.reconcile_base import Obj
from kvfence.operator.status import (
    ACCEPTED_GENERATION,
    ACCEPTED_SPEC,
    BindingStatus,
    accepted_trust_class,
    status_differs,
    status_patch,
    tenant_binding_status,
)

log = logging.getLogger("kvfence.operator")

#: The longest a routing decision holds its bindings' status writes back while the classes it has just
#: routed for the first time write their tenants' quotas into their engine configs (see
#: :meth:`RoutingReconcile._await_renders`).
RENDER_PRECEDENCE_SECONDS = 120.0


#: The metadata a routing decision reads of a binding: its identity, versions and age (the decision's
#: order), and what its status write and Events name.
BINDING_VIEW_METADATA = ("name", "namespace", "uid", "generation", "resourceVersion", "creationTimestamp")


@dataclass(frozen=True, slots=True)
class ListedBinding:
    """What a routing decision keeps of a listed TenantBinding (10,000 of them at once at scale): the
    model it decides with, validated from :data:`BINDING_VIEW_METADATA`, the spec and the status
    reduced to the accepted spec (the only part of the status a decision reads); and the whole status
    as compact JSON, which only the binding's status write reads (its conditions' transition times).
    Parsed, that status is most of a listed binding's memory (eight conditions: ~4 KB of dicts and
    strings, against ~1.2 KB of JSON)."""

    model: TenantBinding
    status_json: bytes

    def status(self) -> Obj:
        """The status as listed (a new object on every call: the caller may change it)."""
        status: Obj = json.loads(self.status_json)
        return status

    def body(self) -> Obj:
        """The binding as its status write and Events name it: identity, versions and status."""
        return {
            "apiVersion": API_VERSION,
            "kind": "TenantBinding",
            "metadata": self.model.metadata,
            "status": self.status(),
        }


def list_binding(body: Obj) -> ListedBinding | None:
    """:class:`ListedBinding` of a listed TenantBinding, made as each page of the list arrives, so a
    decision never holds the bindings' whole bodies (labels, annotations, owner references) or their
    parsed statuses; None for a binding that does not validate (the decision leaves it alone)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    try:
        model = TenantBinding.model_validate(
            {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "metadata": {k: meta[k] for k in BINDING_VIEW_METADATA if k in meta},
                "spec": body.get("spec"),
                "status": {k: status[k] for k in (ACCEPTED_SPEC, ACCEPTED_GENERATION) if k in status},
            }
        )
    except ValidationError:
        return None
    return ListedBinding(model, json.dumps(status, separators=(",", ":")).encode())


class RoutingReconcile(ApiKeyCache):
    def reconcile_routing(self) -> set[Key]:
        with self._routing_lock:
            try:
                return self._reconcile_routing()
            finally:
                # the decision's every binding, listed and validated at once, is garbage now
                memory.release_free_memory()

    def _reconcile_routing(self) -> set[Key]:
        # Taken before any key is read: a class reconcile stores its new key before it counts as
        # tried, so a class tried by now whose key this decision does not find truly has none.
        tried = set(self.state.class_tried)
        tc_bodies = self.kube.list(API_VERSION, "TrustClass")
        listed = [b for b in self.kube.list(API_VERSION, "TenantBinding", each=list_binding) if b is not None]
        namespaces = {
            n["metadata"]["name"]: dict(n["metadata"].get("labels") or {})
            for n in self.kube.list("v1", "Namespace")
        }
        classes = self._class_states(tc_bodies)
        bindings = [lb.model for lb in listed]
        raw = {lb.model.key: lb for lb in listed}
        del listed
        out = decide(classes, bindings, namespaces, self.api_key_lookups(bindings), self.opts)
        follow = self._remember_decision(classes, out)
        woken, precedence = self._wake_routed(classes)
        follow |= {ClassKey(n) for n in woken}
        self.state.routing_ready.set()
        classes_next = {k for k in follow if isinstance(k, ClassKey) and k.name in classes}
        if self.notify is not None:
            # Queued now, not after the bindings' status writes below: the woken classes render their
            # engines while those are sent.
            for ck in classes_next:
                self.later(ck, 0)
        else:
            self.state.pending_follow |= classes_next
        to_write = self._statuses_to_write(classes, bindings, out, tried)
        self._write_routing_table(out)
        if precedence:
            self._await_renders(len(woken))
        # list(): wait for every write, and raise the first failure (the routing key is retried).
        list(self._fanout.map(lambda b: self._binding_status(raw[b.key], out.decisions[b.key]), to_write))
        done, self.state.pending_follow = self.state.pending_follow, set()
        return done

    def _class_states(self, tc_bodies: list[Obj]) -> dict[str, ClassState]:
        """Each listed TrustClass as the decision sees it: validated (else its last accepted spec;
        neither: left out), with the keys the router holds for it, and whether it is being deleted."""
        classes: dict[str, ClassState] = {}
        for body in tc_bodies:
            try:
                tc = TrustClass.model_validate(body)
            except ValidationError:
                last = accepted_trust_class(body)
                if last is None:
                    continue
                tc = last
            deleting = bool(body["metadata"].get("deletionTimestamp"))
            keys = () if deleting else self._signing_keys(tc)
            classes[tc.name] = ClassState(tc, keys, deleting)
        return classes

    def _remember_decision(self, classes: dict[str, ClassState], out: Outcome) -> set[Key]:
        """Remember the decision's tenant quotas and bound counts; return the classes whose engine
        config or status changes with them."""
        follow: set[Key] = set()
        bound: dict[str, int] = {}
        for d in out.decisions.values():
            if d.bound and d.trust_class:
                bound[d.trust_class] = bound.get(d.trust_class, 0) + 1
        for name in set(classes) | set(self.state.tenant_quotas) | set(out.tenant_quotas):
            if self.state.tenant_quotas.get(name, {}) != out.tenant_quotas.get(name, {}):
                follow.add(ClassKey(name))
        for name in classes:
            if self.state.bound_count.get(name, 0) != bound.get(name, 0):
                follow.add(ClassKey(name))
        self.state.tenant_quotas = out.tenant_quotas
        self.state.bound_count = bound
        return follow

    def _wake_routed(self, classes: dict[str, ClassState]) -> tuple[set[str], bool]:
        """The classes waiting for a decision that routes them which this one does (woken), and
        whether the bindings' status writes wait for their renders (see :meth:`_await_renders`).

        The decisions are made: engines can be configured even if the table's write fails (say, the
        router's namespace does not exist yet); the follow-ups survive a failed attempt."""
        with self._routed_lock:
            self.state.routed = {n for n, c in classes.items() if c.signing_keys}
            woken = self.state.awaiting_routing & self.state.routed
            self.state.awaiting_routing -= woken
        precedence = bool(woken) and self.notify is not None and self.renders_meanwhile
        if precedence:
            with self._renders:
                self._rendering |= woken
        return woken, precedence

    @staticmethod
    def _statuses_to_write(
        classes: dict[str, ClassState], bindings: list[TenantBinding], out: Outcome, tried: set[str]
    ) -> list[TenantBinding]:
        """The bindings whose status this decision writes. A class not reconciled yet in this process
        and without a key is about to get one: its bindings keep their status until the decision it
        queues (no "not ready" flip first)."""
        untried = {n for n, c in classes.items() if not c.signing_keys and not c.deleting and n not in tried}
        return [
            b
            for b in bindings
            if not (
                out.decisions[b.key].reason == conditions.REASON_TRUST_CLASS_NOT_READY
                and out.decisions[b.key].trust_class in untried
            )
        ]

    def _write_routing_table(self, out: Outcome) -> None:
        secret = with_spec_hash(routing_secret(out.table, self.opts))
        live = self.kube.get("v1", "Secret", ROUTING_SECRET_NAME, self.opts.router_namespace)
        if needs_apply(secret, live):
            self.kube.apply(secret)
            log.info(
                "routing table written: %d trust classes, %d tenants",
                len(out.table.trust_classes),
                len(out.table.tenants),
            )

    def _await_renders(self, count: int) -> None:
        """Wait (at most :data:`RENDER_PRECEDENCE_SECONDS`) until the classes this decision routed for
        the first time have been reconciled, so their engine configs name their tenants' quotas
        before the bindings are told ``Bound``. The bindings' status writes (one per binding) only
        report what the routing table, written first, already does; sent beside the renders,
        ROUTING_CONCURRENCY at a time against the renders' one per worker, they would hold the
        renders back."""
        started = time.monotonic()
        with self._renders:
            done = self._renders.wait_for(lambda: not self._rendering, RENDER_PRECEDENCE_SECONDS)
            left = len(self._rendering)
            if not done:
                # what is left renders beside the status writes
                self._rendering.clear()
        waited = time.monotonic() - started
        if not done:
            log.warning(
                "binding statuses waited %.0fs for the engines of %d newly routed trust classes; %d not "
                "rendered yet, writing the statuses now",
                waited,
                count,
                left,
            )
        elif waited >= 1.0:
            log.info("binding statuses written after the engines of %d trust classes (%.1fs)", count, waited)

    def _signing_keys(self, tc: TrustClass) -> tuple[bytes, ...]:
        cached = self.state.signing.get(tc.name)
        if cached is not None:
            return cached
        secret = self.kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, tc.target_namespace)
        held = builders.read_signing_secret(secret)
        if held is None:
            return ()
        # (after a restart) the order reconcile_class uses: the previous key first until propagated
        wait = builders.key_propagation_left(held, self._clock(), self.opts.signing_key_propagation_seconds)
        keys = builders.router_signing_keys(held, propagated=wait == 0)
        self.state.signing[tc.name] = keys
        return keys

    def _binding_status(self, listed: ListedBinding, d: Decision) -> None:
        body = listed.body()
        meta = body["metadata"]
        live_status: Obj = body["status"]
        out = tenant_binding_status(live_status, d, meta.get("generation"))
        if not status_differs(out.status, live_status):
            return
        self.kube.patch_status(
            API_VERSION,
            "TenantBinding",
            meta["name"],
            meta["namespace"],
            status_patch(out.status, live_status),
        )
        self._binding_events(body, d, live_status.get("conditions", []), out)

    def _binding_events(self, body: Obj, d: Decision, existing: list[Obj], out: BindingStatus) -> None:
        """One Event per transition of a binding's status (its conditions were ``existing``)."""
        old = {c.get("type"): c for c in existing}
        bound_c, denied_c = out.status["conditions"][0], out.status["conditions"][1]
        spec_c, clamp_c = out.spec_accepted, out.clamped
        # None for a new binding's first decision when it binds (its status says so; an Event is for
        # news: a denial, a binding waiting, a change of fate).
        first_bind = d.bound and conditions.BOUND not in old
        if not first_bind and (
            old.get(conditions.BOUND, {}).get("status") != bound_c["status"]
            or old.get(conditions.DENIED, {}).get("reason") != denied_c["reason"]
        ):
            self._emit(Event(body, d.reason, d.message, "Normal" if d.bound or not d.denied else "Warning"))
        was = old.get(conditions.SPEC_ACCEPTED, {})
        refused = d.refused
        if refused is not None and (was.get("status"), was.get("reason")) != ("False", refused.reason):
            self._emit(Event(body, refused.reason, spec_c["message"], "Warning"))
        # Told when a clamp starts or changes (the class edited again, the guarantees of older
        # bindings changed what is left), and when it ends with the tenant still served.
        was = old.get(conditions.CLAMPED, {})
        if clamp_c["status"] == "True" and (was.get("status"), was.get("message")) != (
            "True",
            clamp_c["message"],
        ):
            self._emit(Event(body, conditions.REASON_CLAMPED, clamp_c["message"], "Warning"))
        elif d.bound and clamp_c["status"] == "False" and was.get("status") == "True":
            self._emit(
                Event(
                    body,
                    conditions.REASON_WITHIN_CLASS_LIMITS,
                    f"the spec in force is served as specified again: TrustClass {d.trust_class!r} allows it",
                )
            )
