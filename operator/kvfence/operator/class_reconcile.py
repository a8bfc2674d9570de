"""The reconcile of one TrustClass: its namespace, signing key, engine and the other children applied
as desired, its status written, and its removal from routing and cleanup when it is deleted.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from kvfence.api import conditions
from kvfence.api.common import API_VERSION
from kvfence.api.trustclass import TrustClass
from kvfence.contract import key_id
from kvfence.operator import builders, modelcache
from kvfence.operator.apply import KubeError, manages, now_rfc3339
from kvfence.operator.bookkeeping import ChildBookkeeping, with_spec_hash
from kvfence.operator.events import Event
from kvfence.operator.keys import ROUTING, ClassKey, Key
from kvfence.operator.reconcile_base import Obj, Requeue
from kvfence.operator.status import (
    ACCEPTED_GENERATION,
    accepted_trust_class,
    object_condition,
    status_differs,
    status_patch,
    trust_class_status,
)

log = logging.getLogger("kvfence.operator")

FINALIZER = "kvfence.dev/cleanup"


FINALIZER_MANAGER = "kvfence-operator-finalizer"


#: How often a class waiting for its model token Secret (missing, or not readable) looks again.
TOKEN_RETRY_SECONDS = 3.0


class Refused(Exception):
    """The class is refused: its status and a Warning Event say why, and nothing more is applied."""


class ClassReconcile(ChildBookkeeping):
    def reconcile_class(self, name: str) -> set[Key]:
        # Only a reconcile that started after the decision marked the class renders for it (one in
        # flight then had seen the class unrouted, and the decision queued another).
        with self._renders:
            marked = name in self._rendering
        try:
            return self._reconcile_class(name)
        finally:
            if marked:
                with self._renders:
                    self._rendering.discard(name)
                    if not self._rendering:
                        self._renders.notify_all()
            if name not in self.state.class_tried:
                self.state.class_tried.add(name)
                if name not in self.state.signing:
                    # No key came of its first reconcile (refused, failed): its bindings are told so.
                    self.later(ROUTING, 0)

    def _reconcile_class(self, name: str) -> set[Key]:
        body = self.kube.get(API_VERSION, "TrustClass", name)
        if body is None:
            self._forget(name)
            return {ROUTING}
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return self._finalize(body)
        if FINALIZER not in (meta.get("finalizers") or []):
            self._set_finalizer(body, present=True)
        try:
            return self._apply_class(body)
        except Refused:
            return set()

    def _apply_class(self, body: Obj) -> set[Key]:
        """Apply what the TrustClass ``body`` asks for, in order: its namespace, its signing key, the
        wait for its first routing decision, a requested rotation, its children; then its status and
        the keys the router signs with. :class:`Refused` when the class is refused (its status says why)."""
        tc = self._validated(body)
        name = tc.name
        self.state.class_namespace[name] = tc.target_namespace
        owner = builders.owner_reference(body)
        changed: list[str] = []
        fresh = self._apply_namespace(body, tc, owner, changed)
        routed_keys = self.state.signing.get(name)
        rotation = (body["metadata"].get("annotations") or {}).get(builders.ANNOTATION_ROTATE)
        live_secret, live_keys = self._first_signing_key(tc, owner, fresh, rotation, changed)
        waiting = self._wait_for_routing(name, changed)
        if waiting and not fresh:
            # The engine config holds the class's tenants' quotas: rendered once a routing decision
            # has routed the class (that decision queues this class again). A running engine keeps
            # the config it has until then (after an operator restart, say).
            return {ROUTING}
        keys = self._plan_signing_keys(body, live_keys, rotation)
        objs = self._desired_children(body, tc, keys, waiting, owner)
        lives = self._read_children(body, tc, objs, live_secret, fresh)
        deployment_live = self._apply_children(body, tc, objs, lives, changed)
        changed[:0] = self.state.applied_early.pop(name, [])
        if changed:
            self._emit(Event(body, "Applied", "applied " + ", ".join(changed)))
        return self._publish_signing_keys(body, tc, keys, routed_keys, deployment_live)

    def _validated(self, body: Obj) -> TrustClass:
        """The TrustClass ``body`` validated; else :class:`Refused`, with nothing applied: the class
        stays routed with its last accepted spec, if it has one (see :func:`accepted_trust_class`),
        as its engines keep running as last rendered."""
        meta = body["metadata"]
        try:
            return TrustClass.model_validate(body)
        except ValidationError as e:
            last = accepted_trust_class(body)
            msg = str(e)
            if last is not None:
                msg = (
                    f"generation {meta.get('generation')} is not accepted; serving the last accepted spec "
                    f"(generation {(body.get('status') or {}).get(ACCEPTED_GENERATION)}): {msg}"
                )
            was = object_condition(body, conditions.DEGRADED)
            if (was.get("reason"), was.get("observedGeneration")) != (
                conditions.REASON_INVALID_SPEC,
                meta.get("generation"),
            ):
                self._emit(Event(body, conditions.REASON_INVALID_SPEC, msg[:1024], "Warning"))
            self._class_status(body, None, degraded=(conditions.REASON_INVALID_SPEC, msg))
            raise Refused from None

    def _apply_namespace(self, body: Obj, tc: TrustClass, owner: Obj, changed: list[str]) -> bool:
        """Apply the class's namespace; return whether it is new (it then holds none of the children:
        nothing to read). :class:`Refused` when it exists and belongs to someone else; :class:`Requeue`
        while it is terminating."""
        name, ns_name = tc.name, tc.target_namespace
        desired_ns = builders.namespace(tc, self.opts, owner)
        # Ours and as desired when last seen, and its watch reported no other version since: it is
        # still ours, not terminating, nothing to read.
        known_ns = self._unchanged(desired_ns)
        live_ns = None if known_ns else self.kube.get("v1", "Namespace", ns_name)
        if (
            live_ns is not None
            and (live_ns["metadata"].get("labels") or {}).get(builders.LABEL_TRUST_CLASS) != name
        ):
            msg = f"namespace {ns_name!r} exists and does not belong to TrustClass {name!r}"
            self._class_status(body, tc, degraded=(conditions.REASON_NAMESPACE_CONFLICT, msg))
            self._emit(Event(body, conditions.REASON_NAMESPACE_CONFLICT, msg, "Warning"))
            raise Refused
        if live_ns is not None and live_ns["metadata"].get("deletionTimestamp"):
            raise Requeue(f"namespace {ns_name} is still terminating", delay=5)
        if not known_ns:
            self._ensure(desired_ns, live_ns, changed)
        return live_ns is None and not known_ns

    def _first_signing_key(
        self, tc: TrustClass, owner: Obj, fresh: bool, rotation: str | None, changed: list[str]
    ) -> tuple[Obj | None, builders.SigningKeys]:
        """The class's signing-key Secret as it is, and its keys; a class without one gets its key
        here, before its engine is rendered, so that the routing decision the engine config waits for
        can already route the class and bind its tenants. That key is news to the decision."""
        ns_name = tc.target_namespace
        live_secret = None if fresh else self.kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, ns_name)
        live_keys = builders.read_signing_secret(live_secret)
        if live_keys is None:
            live_keys = builders.plan_signing_keys(None, rotation, self._new_key(), now_rfc3339())
            live_secret = self._ensure(
                builders.signing_secret(tc, live_keys, self.opts, owner), live_secret, changed
            )
            self.state.signing[tc.name] = builders.router_signing_keys(live_keys, propagated=True)
        return live_secret, live_keys

    def _wait_for_routing(self, name: str, changed: list[str]) -> bool:
        """Whether the class waits for a routing decision that routes it (its engine config holds its
        tenants' quotas); what was applied so far is then told in the one "Applied" Event of the
        reconcile that renders the engine.

        A new class (its namespace made just now) renders its engine at once all the same, its config
        marked ``tenantsPending``: its pods start (image, model) while the routing decision computes
        the tenants' quotas, and are not ready until the config the decision's wake-up rewrites, with
        those quotas and without the mark, reaches them. The router routes none of its tenants before
        that decision either (it writes the routing table)."""
        with self._routed_lock:
            waiting = name not in self.state.routed
            if waiting:
                self.state.awaiting_routing.add(name)
        if waiting:
            self.state.applied_early.setdefault(name, []).extend(changed)
            changed.clear()
        return waiting

    def _plan_signing_keys(
        self, body: Obj, live_keys: builders.SigningKeys, rotation: str | None
    ) -> builders.SigningKeys:
        """The keys to apply: kept, or rotated on request. A second rotation waits until the first has
        reached every engine (the key it would retire may still be the one signing)."""
        name = body["metadata"]["name"]
        if rotation and rotation != live_keys.rotated_for:
            wait = builders.key_propagation_left(
                live_keys, self._clock(), self.opts.signing_key_propagation_seconds
            )
            if wait > 0:
                log.info("class %s: rotation %r waits %.0fs for the previous one", name, rotation, wait)
                self.later(ClassKey(name), wait + 0.5)
                rotation = live_keys.rotated_for
        needs_key = bool(rotation and rotation != live_keys.rotated_for)
        keys = builders.plan_signing_keys(
            live_keys, rotation, self._new_key() if needs_key else b"", now_rfc3339()
        )
        if keys.current != live_keys.current:
            self._emit(
                Event(
                    body,
                    "SigningKeyRotated",
                    f"signing key rotated, new key id {key_id(keys.current)}; the router signs with it "
                    f"once every engine holds it ({self.opts.signing_key_propagation_seconds:.0f}s)",
                )
            )
        return keys

    def _desired_children(
        self, body: Obj, tc: TrustClass, keys: builders.SigningKeys, waiting: bool, owner: Obj
    ) -> list[Obj]:
        """The children the class asks for. :class:`Refused` (or :class:`Requeue` for what may appear:
        a shared-prefix ConfigMap, the model token Secret) with nothing applied: the engines keep
        serving with the last config they were given, and never with a refused flag."""
        ns_name = tc.target_namespace
        try:
            shared_texts = self._shared_prefix_texts(tc, ns_name)
        except LookupError as e:
            self._class_status(body, tc, degraded=(conditions.REASON_SHARED_PREFIX_UNRESOLVED, str(e)))
            self._emit(Event(body, conditions.REASON_SHARED_PREFIX_UNRESOLVED, str(e), "Warning"))
            raise Requeue(str(e), delay=10) from None
        if self._model_token_unavailable(body, tc, ns_name):
            raise Requeue("the model token Secret is not available", delay=TOKEN_RETRY_SECONDS)
        try:
            return builders.children(
                tc,
                signing=keys,
                tenant_quotas=None if waiting else self.state.tenant_quotas.get(tc.name),
                tenants_pending=waiting,
                opts=self.opts,
                owner=owner,
                shared_texts=shared_texts,
            )
        except builders.RefusedExtraArgs as e:
            self._class_status(body, tc, degraded=(conditions.REASON_FORBIDDEN_EXTRA_ARGS, str(e)))
            self._emit(Event(body, conditions.REASON_FORBIDDEN_EXTRA_ARGS, str(e), "Warning"))
            raise Refused from None
        except ValueError as e:
            self._class_status(body, tc, degraded=(conditions.REASON_INVALID_ENGINE_CONFIG, str(e)))
            raise Refused from None

    def _read_children(
        self, body: Obj, tc: TrustClass, objs: list[Obj], live_secret: Obj | None, fresh: bool
    ) -> dict[int, Obj | None]:
        """The live object of each child to apply, by its index in ``objs``; a child left out is as
        desired when last seen, and its watch reported no other version since (nothing to apply).
        The model cache claim is planned against the live one (``objs`` updated); :class:`Refused`
        when it cannot be, and the engine keeps the claim it mounts, as last rendered."""
        lives: dict[int, Obj | None] = {}
        for i, obj in enumerate(objs):
            if obj["kind"] == "Secret":
                lives[i] = live_secret
            elif fresh:
                lives[i] = None
            elif obj["kind"] not in ("Deployment", "PersistentVolumeClaim") and self._unchanged(obj):
                continue
            else:
                lives[i] = self.kube.get(
                    obj["apiVersion"], obj["kind"], obj["metadata"]["name"], tc.target_namespace
                )
            if obj["kind"] == "PersistentVolumeClaim":
                objs[i], refusal = modelcache.plan_claim(obj, lives[i])
                if refusal is not None:
                    self._refuse(body, tc, conditions.REASON_MODEL_CACHE_CLAIM_REFUSED, refusal)
                    raise Refused
        return lives

    def _apply_children(
        self, body: Obj, tc: TrustClass, objs: list[Obj], lives: dict[int, Obj | None], changed: list[str]
    ) -> Obj | None:
        """Apply the children read in ``lives``; return the engine Deployment as applied (None: not
        applied). A claim the API server refuses (say, an expansion the StorageClass does not allow)
        is :class:`Refused`: the engine is left as it was, with the claim as it is."""
        deployment_live: Obj | None = None
        for i, obj in enumerate(objs):
            if i not in lives:
                continue
            live = lives[i]
            if obj["kind"] == "Deployment" and tc.spec.replicas_managed_externally:
                self._hand_over_replicas(live)
            try:
                applied = self._ensure(obj, live, changed)
            except KubeError as e:
                if obj["kind"] != "PersistentVolumeClaim" or e.status not in (403, 422):
                    raise
                claim = f"{tc.target_namespace}/{obj['metadata']['name']}"
                msg = f"engine.modelCache.volumeClaim: claim {claim}: {e}"
                self._refuse(body, tc, conditions.REASON_MODEL_CACHE_CLAIM_REFUSED, msg[:2048])
                raise Refused from None
            if obj["kind"] == "Deployment":
                deployment_live = applied
        return deployment_live

    def _publish_signing_keys(
        self,
        body: Obj,
        tc: TrustClass,
        keys: builders.SigningKeys,
        routed_keys: tuple[bytes, ...] | None,
        deployment_live: Obj | None,
    ) -> set[Key]:
        """Write the class's status and hand the router its keys (a routing decision follows when they
        changed from ``routed_keys``, those it held before this reconcile).

        After a rotation the router keeps signing with the previous key until every engine holds the
        new one: the kubelet refreshes the mounted Secret in place (no new pod) and the engines reload
        it, within the propagation delay counted from the rotation time on the Secret (it survives an
        operator restart). Then the new key goes first. Engines verify both keys throughout."""
        name = tc.name
        wait = builders.key_propagation_left(keys, self._clock(), self.opts.signing_key_propagation_seconds)
        if wait > 0:
            self.later(ClassKey(name), wait + 0.5)
        router_keys = builders.router_signing_keys(keys, propagated=wait == 0)
        self._class_status(body, tc, deployment=deployment_live, key=router_keys[0])
        if routed_keys == router_keys:
            return set()
        if routed_keys is not None and routed_keys[0] != router_keys[0]:
            self._emit(
                Event(body, "SigningKeyActive", f"the router signs with key id {key_id(router_keys[0])}")
            )
        self.state.signing[name] = router_keys
        return {ROUTING}

    def _refuse(self, body: Obj, tc: TrustClass, reason: str, msg: str) -> None:
        """Degraded and Stalled for ``reason``; a Warning Event when that is news (not at every retry)."""
        was = object_condition(body, conditions.DEGRADED)
        if (was.get("reason"), was.get("message"), was.get("observedGeneration")) != (
            reason,
            msg,
            body["metadata"].get("generation"),
        ):
            self._emit(Event(body, reason, msg, "Warning"))
        self._class_status(body, tc, degraded=(reason, msg))

    def _model_token_unavailable(self, body: Obj, tc: TrustClass, ns: str) -> bool:
        """Whether the class's model token Secret (``engine.model.tokenSecretRef``) cannot be used yet;
        if so the class is Degraded/Stalled with a reason naming the Secret and key (never a value)."""
        ref = tc.spec.engine.model.token_secret_ref
        if ref is None:
            return False
        try:
            secret = self.kube.get("v1", "Secret", ref.name, ns)
        except KubeError as e:
            if not e.forbidden:
                raise
            msg = (
                f"engine.model.tokenSecretRef: the operator may not read Secret {ns}/{ref.name} (bind the "
                f"{self.opts.tenant_secrets_role} ClusterRole to it in namespace {ns})"
            )
            self._refuse(body, tc, conditions.REASON_MODEL_TOKEN_FORBIDDEN, msg)
            return True
        why = modelcache.token_refusal(ref, ns, secret)
        if why is None:
            return False
        self._refuse(body, tc, conditions.REASON_MODEL_TOKEN_MISSING, why)
        return True

    def _hand_over_replicas(self, live: Obj | None) -> None:
        """Before the operator applies an engine Deployment without replicas: if it owns them, another
        field manager applies the live count first, so that dropping them from the operator's apply
        keeps the count (server-side apply would otherwise remove the field: back to 1 replica) until
        the autoscaler writes its own through /scale."""
        if live is not None and "managedFields" not in live["metadata"]:
            # read from the watch cache, which keeps no managed fields: who owns the replicas is there
            meta = live["metadata"]
            live = self.kube.get("apps/v1", "Deployment", meta["name"], meta["namespace"], cached=False)
        if live is None or not manages(live, builders.FIELD_MANAGER, "spec", "replicas"):
            return
        meta = live["metadata"]
        count = (live.get("spec") or {}).get("replicas", 1)
        self.kube.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "spec": {"replicas": count},
            },
            field_manager=builders.REPLICAS_HANDOVER_MANAGER,
        )
        log.info(
            "engine replicas of %s handed over at %s (replicasManagedExternally)", meta["namespace"], count
        )

    def _shared_prefix_texts(self, tc: TrustClass, ns: str) -> dict[str, str]:
        """The text of each shared prefix kept in a ConfigMap of the class's namespace, by prefix name;
        LookupError names the first ConfigMap or key that is missing."""
        texts: dict[str, str] = {}
        for p in tc.spec.prefix_cache.shared_prefixes:
            ref = p.config_map_key_ref
            if ref is None:
                continue
            cm = self.kube.get("v1", "ConfigMap", ref.name, ns)
            text = None if cm is None else (cm.get("data") or {}).get(ref.key)
            if not text:
                what = (
                    f"ConfigMap {ns}/{ref.name}"
                    if cm is None
                    else f"key {ref.key!r} of ConfigMap {ns}/{ref.name}"
                )
                raise LookupError(f"prefixCache.sharedPrefixes[{p.name}]: {what} does not exist or is empty")
            texts[p.name] = text
        return texts

    def check_class_secret(self, name: str) -> set[Key]:
        """The resync's cheap check of what the operator cannot watch (its signing-key Secret): one GET
        per class; a full reconcile only when the Secret is gone or not what was applied. Every other
        child is watched, so its drift has already been repaired."""
        ns, keys = self.state.class_namespace.get(name), self.state.signing.get(name)
        if ns is None or keys is None:
            return {ClassKey(name)}
        secret = self.kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, ns)
        return set() if self.signing_secret_is_current(name, secret) else {ClassKey(name)}

    def signing_secret_is_current(self, name: str, secret: Obj | None) -> bool:
        """Whether ``secret`` (read, or as its watch event carried it) holds exactly the keys the
        router holds for class ``name``: its own write coming back, say, which needs no reconcile."""
        keys = self.state.signing.get(name)
        if keys is None or name not in self.state.class_namespace:
            return False
        held = builders.read_signing_secret(secret)
        live = (
            set()
            if held is None
            else {held.current}
            if held.previous is None
            else {held.current, held.previous}
        )
        return live == set(keys)

    def _set_finalizer(self, body: Obj, *, present: bool) -> None:
        patch = {
            "apiVersion": API_VERSION,
            "kind": "TrustClass",
            "metadata": {"name": body["metadata"]["name"], "finalizers": [FINALIZER] if present else []},
        }
        self.kube.apply(patch, field_manager=FINALIZER_MANAGER)

    def _finalize(self, body: Obj) -> set[Key]:
        name = body["metadata"]["name"]
        if FINALIZER not in (body["metadata"].get("finalizers") or []):
            return {ROUTING}
        self._forget(name)
        # Take the class out of the routing table first: nothing may route to what is going away.
        follow = self.reconcile_routing()
        tc: TrustClass | None
        try:
            tc = TrustClass.model_validate(body)
        except ValidationError:
            tc = accepted_trust_class(body)
        done = "its namespace is being deleted"
        if tc is not None:
            live_ns = self.kube.get("v1", "Namespace", tc.target_namespace)
            if (
                live_ns is not None
                and (live_ns["metadata"].get("labels") or {}).get(builders.LABEL_TRUST_CLASS) == name
            ):
                if modelcache.keeps_namespace(tc):
                    # The claim outlives the class, and so must its namespace: no owner reference left
                    # for garbage collection to follow (every other child still has one).
                    self.kube.apply(with_spec_hash(builders.namespace(tc, self.opts, None)))
                    done = (
                        f"its namespace {tc.target_namespace} is kept with the model cache claim "
                        f"{builders.model_cache_claim_name(tc)} (retained); delete it to release the claim"
                    )
                else:
                    self.kube.delete("v1", "Namespace", tc.target_namespace)
        self._emit(Event(body, "Deleted", f"trust class removed from routing; {done}"))
        self._set_finalizer(body, present=False)
        return follow

    def _forget(self, name: str) -> None:
        with self._routed_lock:
            self.state.awaiting_routing.discard(name)
            self.state.routed.discard(name)
        self.state.applied_early.pop(name, None)
        ns = self.state.class_namespace.get(name)
        if ns is not None:
            # What was remembered of the class's children (and of its namespace) goes with it.
            for memo in (self.state.seen, self.state.watched, self.state.digests):
                for ref in [r for r in memo if r[1] == ns or r == ("Namespace", "", ns)]:
                    del memo[ref]
        self.state.signing.pop(name, None)
        self.state.tenant_quotas.pop(name, None)
        self.state.bound_count.pop(name, None)
        self.state.class_namespace.pop(name, None)

    def _class_status(
        self,
        body: Obj,
        tc: TrustClass | None,
        *,
        deployment: Obj | None = None,
        key: bytes | None = None,
        degraded: tuple[str, str] | None = None,
    ) -> bool:
        """Patch the TrustClass status if it changed (:func:`status.trust_class_status`); return
        whether the engine rolled out. A degraded class applied nothing, so its engine Deployment is
        read here: its status shows the pods that run (as last rendered), never stale counts."""
        if degraded is not None and deployment is None:
            deployment = self._engine_deployment(body, tc, degraded[0])
        out = trust_class_status(
            body,
            tc,
            endpoint=builders.endpoint(tc, self.opts) if tc is not None else None,
            bound_tenants=self.state.bound_count.get(tc.name, 0) if tc is not None else 0,
            deployment=deployment,
            key=key,
            degraded=degraded,
        )
        if out.ready_flipped is not None:
            c = out.ready_flipped
            ok = c["status"] == "True"
            self._emit(Event(body, c["reason"], c["message"] or c["reason"], "Normal" if ok else "Warning"))
        live_status: Obj = body.get("status") or {}
        if status_differs(out.status, live_status):
            self.kube.patch_status(
                API_VERSION,
                "TrustClass",
                body["metadata"]["name"],
                None,
                status_patch(out.status, live_status),
            )
        return out.rolled_out

    def _engine_deployment(self, body: Obj, tc: TrustClass | None, reason: str) -> Obj | None:
        """The class's engine Deployment as it runs, for the status of a class that applied nothing:
        in its namespace (for a class that does not validate, its last accepted spec's, else the one
        its status names); None where it has none (the namespace is someone else's, or unknown)."""
        if reason == conditions.REASON_NAMESPACE_CONFLICT:
            return None
        served = tc or accepted_trust_class(body)
        ns = served.target_namespace if served is not None else (body.get("status") or {}).get("namespace")
        if not ns:
            return None
        return self.kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, ns)
