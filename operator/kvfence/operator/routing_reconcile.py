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
    accepted_key,
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
    accepted_trust_class,
    kstatus_conditions,
    set_condition,
    status_differs,
    status_patch,
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
        bindings = [lb.model for lb in listed]
        raw = {lb.model.key: lb for lb in listed}
        del listed
        self._list_api_keys(bindings)
        lookups = dict(
            zip(
                [b.key for b in bindings],
                self._fanout.map(lambda b: self._api_keys(b, b.spec, b.key), bindings),
                strict=True,
            )
        )
        for b in bindings:
            accepted = b.accepted_spec()
            if accepted is not None and accepted.api_key_secret_ref != b.spec.api_key_secret_ref:
                lookups[accepted_key(b.key)] = self._api_keys(b, accepted, accepted_key(b.key))
        live_keys = set(lookups)
        for k in list(self.state.keys):
            if k not in live_keys:
                del self.state.keys[k]
        out = decide(classes, bindings, namespaces, lookups, self.opts)

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
        # The decisions are made: engines can be configured even if the write below fails (say, the
        # router's namespace does not exist yet); the follow-ups survive a failed attempt.
        with self._routed_lock:
            self.state.routed = {n for n, c in classes.items() if c.signing_keys}
            woken = self.state.awaiting_routing & self.state.routed
            self.state.awaiting_routing -= woken
        follow |= {ClassKey(n) for n in woken}
        precedence = bool(woken) and self.notify is not None and self.renders_meanwhile
        if precedence:
            with self._renders:
                self._rendering |= woken
        self.state.routing_ready.set()
        classes_next = {k for k in follow if isinstance(k, ClassKey) and k.name in classes}
        if self.notify is not None:
            # Queued now, not after the bindings' status writes below: the woken classes render their
            # engines while those are sent.
            for ck in classes_next:
                self.later(ck, 0)
        else:
            self.state.pending_follow |= classes_next
        # A class not reconciled yet in this process and without a key is about to get one: its
        # bindings keep their status until the decision it queues (no "not ready" flip first).
        untried = {n for n, c in classes.items() if not c.signing_keys and not c.deleting and n not in tried}
        to_write = [
            b
            for b in bindings
            if not (
                out.decisions[b.key].reason == conditions.REASON_TRUST_CLASS_NOT_READY
                and out.decisions[b.key].trust_class in untried
            )
        ]

        secret = with_spec_hash(routing_secret(out.table, self.opts))
        live = self.kube.get("v1", "Secret", ROUTING_SECRET_NAME, self.opts.router_namespace)
        if needs_apply(secret, live):
            self.kube.apply(secret)
            log.info(
                "routing table written: %d trust classes, %d tenants",
                len(out.table.trust_classes),
                len(out.table.tenants),
            )
        if precedence:
            self._await_renders(len(woken))
        # list(): wait for every write, and raise the first failure (the routing key is retried).
        list(self._fanout.map(lambda b: self._binding_status(raw[b.key], out.decisions[b.key]), to_write))
        done, self.state.pending_follow = self.state.pending_follow, set()
        return done

    def _await_renders(self, count: int) -> None:
        """Wait (at most :data:`RENDER_PRECEDENCE_SECONDS`) until the classes this decision routed for
        the first time have been reconciled, so their engine configs name their tenants' quotas
        before the bindings are told ``Bound``. The bindings' status writes (one per binding) only
        report what the routing table written above already does; sent beside the renders,
        ROUTING_CONCURRENCY at a time against the renders' one per worker, they held the renders
        back (docs/operator.md, issue 16, eighth pass)."""
        started = time.monotonic()
        with self._renders:
            done = self._renders.wait_for(lambda: not self._rendering, RENDER_PRECEDENCE_SECONDS)
            left = len(self._rendering)
            if not done:
                # what is left renders beside the status writes, as before this wait
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
        gen = meta.get("generation")
        live_status: Obj = body["status"]
        existing = live_status.get("conditions", [])
        bound_reason = d.reason if not d.bound else conditions.REASON_BOUND
        conds = [
            set_condition(existing, conditions.BOUND, d.bound, bound_reason, d.message, gen),
            set_condition(
                existing,
                conditions.DENIED,
                d.denied,
                d.reason if d.denied else conditions.REASON_NOT_DENIED,
                d.message if d.denied else "",
                gen,
            ),
            set_condition(existing, conditions.READY, d.bound, bound_reason, d.message, gen),
        ]
        accepted_spec, accepted_gen = live_status.get(ACCEPTED_SPEC), live_status.get(ACCEPTED_GENERATION)
        refused = d.refused
        if d.bound and refused is None and d.served_spec is not None:
            accepted_spec, accepted_gen = d.served_spec.wire(), gen
        if refused is not None:
            refusal = (
                f"generation {gen} is not accepted: {refused.message}; the tenant is served with its last "
                f"accepted spec (generation {accepted_gen})"
            )
            spec_c = set_condition(existing, conditions.SPEC_ACCEPTED, False, refused.reason, refusal, gen)
        elif d.bound:
            spec_c = set_condition(
                existing, conditions.SPEC_ACCEPTED, True, conditions.REASON_ACCEPTED, "", gen
            )
        else:
            spec_c = set_condition(existing, conditions.SPEC_ACCEPTED, False, d.reason, d.message, gen)
        # The class edited under the spec in force: served within the class's current bounds.
        if d.bound and d.clamped:
            clamp = (
                f"the spec in force (generation {accepted_gen}) asks for more than TrustClass "
                f"{d.trust_class!r} allows now; the tenant is served within it: " + "; ".join(d.clamped)
            )
            clamp_c = set_condition(existing, conditions.CLAMPED, True, conditions.REASON_CLAMPED, clamp, gen)
        elif d.bound:
            clamp_c = set_condition(
                existing, conditions.CLAMPED, False, conditions.REASON_WITHIN_CLASS_LIMITS, "", gen
            )
        else:
            clamp_c = set_condition(existing, conditions.CLAMPED, False, conditions.REASON_NOT_BOUND, "", gen)
        conds += [spec_c, clamp_c]
        # A refused edit or a clamped spec needs a change by someone (the tenant is served meanwhile).
        stalled: tuple[str, str] | None = None
        if d.denied:
            stalled = (d.reason, d.message)
        elif refused is not None:
            stalled = (refused.reason, spec_c["message"])
        elif clamp_c["status"] == "True":
            stalled = (conditions.REASON_CLAMPED, clamp_c["message"])
        conds += kstatus_conditions(
            existing,
            reconciling=None
            if d.bound or d.denied or refused is not None
            else {"reason": d.reason, "message": d.message},
            stalled=stalled,
            generation=gen,
        )
        status: Obj = {"observedGeneration": gen, "conditions": conds}
        if accepted_spec is not None:
            status[ACCEPTED_SPEC] = accepted_spec
            status[ACCEPTED_GENERATION] = accepted_gen
        if d.trust_class:
            status["trustClass"] = d.trust_class
        if d.api_keys is not None:
            status["apiKeys"] = d.api_keys
        if not status_differs(status, live_status):
            return
        self.kube.patch_status(
            API_VERSION, "TenantBinding", meta["name"], meta["namespace"], status_patch(status, live_status)
        )
        old = {c.get("type"): c for c in existing}
        # One Event per transition; none for a new binding's first decision when it binds (its
        # status says so; an Event is for news: a denial, a binding waiting, a change of fate).
        first_bind = d.bound and conditions.BOUND not in old
        if not first_bind and (
            old.get(conditions.BOUND, {}).get("status") != conds[0]["status"]
            or old.get(conditions.DENIED, {}).get("reason") != conds[1]["reason"]
        ):
            self._emit(Event(body, d.reason, d.message, "Normal" if d.bound or not d.denied else "Warning"))
        was = old.get(conditions.SPEC_ACCEPTED, {})
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
