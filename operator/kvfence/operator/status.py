"""TrustClass and TenantBinding status, computed: conditions (Ready, Progressing, Degraded, Bound,
Denied, SpecAccepted, Clamped, and kstatus's Reconciling and Stalled), replica counts, the spec in
force. Pure functions over the objects the reconciler read; :class:`kvfence.operator.reconciler.Reconciler`
only patches what they return and emits the Events.

One predicate says whether the engine rolled out (:func:`rolled_out`); everything that depends on it
(Ready, Progressing, the router's key switch before keys reloaded without a restart) reads it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvfence.api import conditions
from kvfence.api.trustclass import TrustClass
from kvfence.contract import key_id
from kvfence.operator import builders
from kvfence.operator.apply import now_rfc3339
from kvfence.operator.bindings import Decision

Obj = dict[str, Any]

#: Status fields of the spec in force (a TrustClass's, a TenantBinding's): see docs/operator.md.
ACCEPTED_SPEC = "acceptedSpec"
ACCEPTED_GENERATION = "acceptedGeneration"


def find_condition(existing: list[Obj], ctype: str) -> Obj:
    """The condition of type ``ctype`` among ``existing`` (an empty dict when there is none)."""
    return next((c for c in existing if c.get("type") == ctype), {})


def object_condition(obj: Obj, ctype: str) -> Obj:
    """The condition of type ``ctype`` in ``obj``'s status (an empty dict when there is none)."""
    return find_condition((obj.get("status") or {}).get("conditions") or [], ctype)


def set_condition(
    existing: list[Obj], ctype: str, status: bool, reason: str, message: str, generation: int | None
) -> Obj:
    """A metav1.Condition; lastTransitionTime kept unless the status flips."""
    st = "True" if status else "False"
    old = find_condition(existing, ctype)
    ltt = old["lastTransitionTime"] if old.get("status") == st and old.get("lastTransitionTime") else None
    cond: Obj = {
        "type": ctype,
        "status": st,
        "reason": reason,
        "message": message,
        "lastTransitionTime": ltt or now_rfc3339(),
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def kstatus_conditions(
    existing: list[Obj], *, reconciling: Obj | None, stalled: tuple[str, str] | None, generation: int | None
) -> list[Obj]:
    """``Reconciling`` and ``Stalled`` as kstatus reads them: ``reconciling`` is the (reason, message)
    of work in progress, ``stalled`` that of a state only a change by someone can leave; each False
    (reason ``Reconciled``/``AsExpected``) otherwise. Stalled wins: never both True."""
    if stalled is not None:
        reconciling = None
    return [
        set_condition(
            existing,
            conditions.RECONCILING,
            reconciling is not None,
            (reconciling or {}).get("reason") or conditions.REASON_RECONCILED,
            (reconciling or {}).get("message", ""),
            generation,
        ),
        set_condition(
            existing,
            conditions.STALLED,
            stalled is not None,
            stalled[0] if stalled else conditions.REASON_AS_EXPECTED,
            stalled[1] if stalled else "",
            generation,
        ),
    ]


def _strip_times(status: Obj) -> Obj:
    out = dict(status)
    out["conditions"] = sorted(
        ({k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions", [])),
        key=lambda c: str(c.get("type")),
    )
    return out


def status_differs(desired: Obj, live: Obj | None) -> bool:
    """Whether the merge patch that writes ``desired`` (:func:`status_patch`) would change ``live``: a
    key ``desired`` does not set is left as it is by the patch, so it is not compared (else a status
    that leaves a field alone would be written again at every reconcile, to no effect)."""
    live = live or {}
    patched = {k: v for k, v in {**live, **desired}.items() if v is not None}
    return _strip_times(patched) != _strip_times(live)


def _with_removals(new: Obj, old: Obj) -> Obj:
    """``new`` as a JSON merge patch over ``old``: every key of ``old`` that ``new`` lacks is null."""
    out: Obj = {}
    for k, v in new.items():
        was = old.get(k)
        out[k] = _with_removals(v, was) if isinstance(v, dict) and isinstance(was, dict) else v
    for k in old:
        if k not in new:
            out[k] = None
    return out


def status_patch(desired: Obj, live: Obj) -> Obj:
    """The merge patch that writes ``desired``: ``acceptedSpec`` replaced whole (a field the new spec
    no longer sets must not survive from the old one)."""
    out = dict(desired)
    if isinstance(desired.get(ACCEPTED_SPEC), dict) and isinstance(live.get(ACCEPTED_SPEC), dict):
        out[ACCEPTED_SPEC] = _with_removals(desired[ACCEPTED_SPEC], live[ACCEPTED_SPEC])
    return out


def desired_replicas(tc: TrustClass, deployment: Obj | None) -> int:
    """The engine replicas asked for: the spec's, or with replicasManagedExternally the Deployment's
    (what its autoscaler set; 1, the Deployment default, before it exists)."""
    if not tc.spec.replicas_managed_externally:
        return tc.spec.desired_replicas
    return int(((deployment or {}).get("spec") or {}).get("replicas", 1))


def observed_replicas(deployment: Obj | None) -> tuple[int, int]:
    """The engine pods the Deployment reports, and how many are ready (0 and 0: there is none)."""
    dstat: Obj = (deployment or {}).get("status") or {}
    return int(dstat.get("replicas", 0) or 0), int(dstat.get("readyReplicas", 0) or 0)


def deployment_status_read(deployment: Obj) -> Obj:
    """The part of an engine Deployment's status that a TrustClass's status is computed from
    (:func:`observed_replicas`, :func:`rolled_out`, :func:`trust_class_status`): a change anywhere
    else in it (a condition's ``lastUpdateTime``, ``unavailableReplicas``) changes no class status,
    and its watch event needs no reconcile."""
    dstat: Obj = deployment.get("status") or {}
    read: Obj = {k: dstat.get(k) for k in DEPLOYMENT_STATUS_FIELDS}
    conds = dstat.get("conditions") or ()
    read["conditions"] = sorted(
        [str(c.get(k)) for k in ("type", "status", "reason", "message")] for c in conds
    )
    return read


#: The Deployment status fields :func:`deployment_status_read` keeps (besides its conditions' type,
#: status, reason and message: all but their timestamps)
DEPLOYMENT_STATUS_FIELDS = (
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "availableReplicas",
    "updatedReplicas",
)


def rolled_out(deployment: Obj | None, want: int) -> bool:
    """Whether the engine Deployment runs ``want`` replicas of its current template, all available
    (always, for 0 replicas): the one "rolled out" predicate of the operator."""
    if want == 0:
        return True
    dep = deployment or {}
    dstat: Obj = dep.get("status") or {}
    dgen_ok = dstat.get("observedGeneration", 0) >= (dep.get("metadata") or {}).get("generation", 1)
    available = int(dstat.get("availableReplicas", 0) or 0)
    updated = int(dstat.get("updatedReplicas", 0) or 0)
    total = int(dstat.get("replicas", 0) or 0)
    return bool(dgen_ok and updated >= want and total == want and available >= want)


@dataclass(frozen=True)
class ClassStatus:
    """What a TrustClass's status should be, whether its engine rolled out, and the Ready condition
    when its status flipped (the reconciler emits it as an Event)."""

    status: Obj
    rolled_out: bool
    ready_flipped: Obj | None = None


def trust_class_status(
    body: Obj,
    tc: TrustClass | None,
    *,
    endpoint: str | None = None,
    bound_tenants: int = 0,
    deployment: Obj | None = None,
    key: bytes | None = None,
    degraded: tuple[str, str] | None = None,
) -> ClassStatus:
    """The status of the TrustClass ``body`` (``tc`` its validated form, None if it does not
    validate), given its engine Deployment as read (None: there is none), the key the router signs
    with, and a reason it is degraded before anything was applied (``degraded``: reason, message).

    ``replicas`` and ``readyReplicas`` are always the Deployment's, Degraded or not: a degraded class's
    engine keeps running as last rendered, and its status says how many of its pods run. A class that
    does not validate has no spec to ask for replicas: its ``desiredReplicas`` is what the Deployment
    (rendered from the last accepted spec) asks for."""
    gen = body["metadata"].get("generation")
    existing = (body.get("status") or {}).get("conditions", [])
    status = _class_status_fields(body, tc, endpoint, bound_tenants, deployment, key, degraded)
    if degraded is not None:
        reason, msg = degraded
        status["conditions"] = [
            set_condition(existing, conditions.READY, False, reason, msg, gen),
            set_condition(existing, conditions.PROGRESSING, False, reason, msg, gen),
            set_condition(existing, conditions.DEGRADED, True, reason, msg, gen),
            *kstatus_conditions(existing, reconciling=None, stalled=(reason, msg), generation=gen),
        ]
        return ClassStatus(status, False)
    assert tc is not None
    want = desired_replicas(tc, deployment)
    status["conditions"], flipped = _rollout_conditions(
        existing, deployment, want, status["readyReplicas"], gen
    )
    return ClassStatus(status, rolled_out(deployment, want), flipped)


def _class_status_fields(
    body: Obj,
    tc: TrustClass | None,
    endpoint: str | None,
    bound_tenants: int,
    deployment: Obj | None,
    key: bytes | None,
    degraded: tuple[str, str] | None,
) -> Obj:
    """Every field of :func:`trust_class_status` but the conditions."""
    gen = body["metadata"].get("generation")
    live_status: Obj = body.get("status") or {}
    status: Obj = {"observedGeneration": gen}
    if tc is not None:
        status["namespace"] = tc.target_namespace
        status["endpoint"] = endpoint
        status["boundTenants"] = bound_tenants
        status["desiredReplicas"] = desired_replicas(tc, deployment)
        status["selector"] = ",".join(
            f"{k}={v}" for k, v in sorted(builders.selector_labels(tc.name).items())
        )
    elif deployment is not None:
        status["desiredReplicas"] = int((deployment.get("spec") or {}).get("replicas", 1))
    status["replicas"], status["readyReplicas"] = observed_replicas(deployment)
    if key is not None:
        status["signingKeyId"] = key_id(key)
    if degraded is None and tc is not None:
        # Everything the spec asks for was rendered and applied: it is the spec in force.
        status[ACCEPTED_SPEC], status[ACCEPTED_GENERATION] = body.get("spec") or {}, gen
    elif isinstance(live_status.get(ACCEPTED_SPEC), dict):
        status[ACCEPTED_SPEC] = live_status[ACCEPTED_SPEC]
        status[ACCEPTED_GENERATION] = live_status.get(ACCEPTED_GENERATION)
    return status


def _rollout_conditions(
    existing: list[Obj], deployment: Obj | None, want: int, ready: int, gen: Any
) -> tuple[list[Obj], Obj | None]:
    """The conditions of a class that applied what it asks for, from its engine's rollout (``want``
    replicas, ``ready`` of them ready), and its Ready condition when that flipped (else None)."""
    dstat: Obj = (deployment or {}).get("status") or {}
    available = int(dstat.get("availableReplicas", 0) or 0)
    updated = int(dstat.get("updatedReplicas", 0) or 0)
    dconds = {c.get("type"): c for c in dstat.get("conditions", [])}
    rolled = rolled_out(deployment, want)
    replicas = f"{available}/{want} engine replicas available"
    if want == 0:
        ready_c = set_condition(
            existing, conditions.READY, False, conditions.REASON_SCALED_TO_ZERO, "replicas is 0", gen
        )
    elif rolled:
        ready_c = set_condition(existing, conditions.READY, True, conditions.REASON_AVAILABLE, replicas, gen)
    else:
        ready_c = set_condition(
            existing, conditions.READY, False, conditions.REASON_UNAVAILABLE, replicas, gen
        )
    if rolled or want == 0:
        prog = set_condition(
            existing, conditions.PROGRESSING, False, conditions.REASON_ROLLOUT_COMPLETE, "", gen
        )
    else:
        progress = f"{updated}/{want} updated, {ready}/{want} ready"
        prog = set_condition(
            existing, conditions.PROGRESSING, True, conditions.REASON_ROLLING_OUT, progress, gen
        )
    stuck = dconds.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded"
    failure = dconds.get("ReplicaFailure", {}).get("status") == "True"
    if stuck or failure:
        why = (dconds.get("ReplicaFailure") or dconds.get("Progressing") or {}).get("message", "")
        deg = set_condition(existing, conditions.DEGRADED, True, conditions.REASON_UNAVAILABLE, why, gen)
    else:
        deg = set_condition(existing, conditions.DEGRADED, False, conditions.REASON_AS_EXPECTED, "", gen)
    conds = [
        ready_c,
        prog,
        deg,
        *kstatus_conditions(
            existing,
            reconciling=None if deg["status"] == "True" or prog["status"] != "True" else prog,
            stalled=(deg["reason"], deg["message"]) if deg["status"] == "True" else None,
            generation=gen,
        ),
    ]
    old_ready = find_condition(existing, conditions.READY)
    # A new class whose engine is rolling out is no news (nor a problem): its first Ready is
    # told when it becomes True, or when the rollout is stuck (Degraded).
    first_rollout = not old_ready and prog["status"] == "True" and deg["status"] == "False"
    flipped = ready_c if old_ready.get("status") != ready_c["status"] and not first_rollout else None
    return conds, flipped


def accepted_trust_class(body: Obj) -> TrustClass | None:
    """The TrustClass as last accepted (``status.acceptedSpec``), or None (none, or it fails too)."""
    spec = (body.get("status") or {}).get(ACCEPTED_SPEC)
    if not isinstance(spec, dict):
        return None
    try:
        return TrustClass.model_validate({**body, "spec": spec})
    except ValidationError:
        return None


@dataclass(frozen=True)
class BindingStatus:
    """What a TenantBinding's status should be after a routing decision, with the two conditions
    its Events are told from."""

    status: Obj
    spec_accepted: Obj
    clamped: Obj


def _spec_accepted_condition(existing: list[Obj], d: Decision, gen: Any, accepted_gen: Any) -> Obj:
    refused = d.refused
    if refused is not None:
        refusal = (
            f"generation {gen} is not accepted: {refused.message}; the tenant is served with its last "
            f"accepted spec (generation {accepted_gen})"
        )
        return set_condition(existing, conditions.SPEC_ACCEPTED, False, refused.reason, refusal, gen)
    if d.bound:
        return set_condition(existing, conditions.SPEC_ACCEPTED, True, conditions.REASON_ACCEPTED, "", gen)
    return set_condition(existing, conditions.SPEC_ACCEPTED, False, d.reason, d.message, gen)


def _clamped_condition(existing: list[Obj], d: Decision, gen: Any, accepted_gen: Any) -> Obj:
    """The class edited under the spec in force: the tenant is served within the class's current bounds."""
    if d.bound and d.clamped:
        clamp = (
            f"the spec in force (generation {accepted_gen}) asks for more than TrustClass "
            f"{d.trust_class!r} allows now; the tenant is served within it: " + "; ".join(d.clamped)
        )
        return set_condition(existing, conditions.CLAMPED, True, conditions.REASON_CLAMPED, clamp, gen)
    if d.bound:
        return set_condition(
            existing, conditions.CLAMPED, False, conditions.REASON_WITHIN_CLASS_LIMITS, "", gen
        )
    return set_condition(existing, conditions.CLAMPED, False, conditions.REASON_NOT_BOUND, "", gen)


def tenant_binding_status(live_status: Obj, d: Decision, gen: Any) -> BindingStatus:
    """The status of a TenantBinding (its status as listed: ``live_status``; its generation: ``gen``)
    after the routing decision ``d``. A bound binding's spec becomes the spec in force
    (``acceptedSpec``) unless its edit is refused; a refused edit or a clamped spec is Stalled, as it
    needs a change by someone (the tenant is served meanwhile)."""
    existing = live_status.get("conditions", [])
    bound_reason = d.reason if not d.bound else conditions.REASON_BOUND
    denied_reason = d.reason if d.denied else conditions.REASON_NOT_DENIED
    conds = [
        set_condition(existing, conditions.BOUND, d.bound, bound_reason, d.message, gen),
        set_condition(
            existing, conditions.DENIED, d.denied, denied_reason, d.message if d.denied else "", gen
        ),
        set_condition(existing, conditions.READY, d.bound, bound_reason, d.message, gen),
    ]
    accepted_spec, accepted_gen = live_status.get(ACCEPTED_SPEC), live_status.get(ACCEPTED_GENERATION)
    spec_c = _spec_accepted_condition(existing, d, gen, accepted_gen)
    if d.bound and d.refused is None and d.served_spec is not None:
        accepted_spec, accepted_gen = d.served_spec.wire(), gen
    clamp_c = _clamped_condition(existing, d, gen, accepted_gen)
    conds += [spec_c, clamp_c]
    stalled: tuple[str, str] | None = None
    if d.denied:
        stalled = (d.reason, d.message)
    elif d.refused is not None:
        stalled = (d.refused.reason, spec_c["message"])
    elif clamp_c["status"] == "True":
        stalled = (conditions.REASON_CLAMPED, clamp_c["message"])
    reconciling = (
        None if d.bound or d.denied or d.refused is not None else {"reason": d.reason, "message": d.message}
    )
    conds += kstatus_conditions(existing, reconciling=reconciling, stalled=stalled, generation=gen)
    status: Obj = {"observedGeneration": gen, "conditions": conds}
    if accepted_spec is not None:
        status[ACCEPTED_SPEC] = accepted_spec
        status[ACCEPTED_GENERATION] = accepted_gen
    if d.trust_class:
        status["trustClass"] = d.trust_class
    if d.api_keys is not None:
        status["apiKeys"] = d.api_keys
    return BindingStatus(status, spec_c, clamp_c)
