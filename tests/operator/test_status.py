"""TrustClass status computed from what the reconciler read (operator/status.py; no cluster)."""

from __future__ import annotations

from typing import Any

from kvfence.api import conditions as C
from kvfence.api.trustclass import TrustClass
from kvfence.operator.status import (
    ACCEPTED_SPEC,
    deployment_status_read,
    rolled_out,
    status_differs,
    status_patch,
    trust_class_status,
)

SPEC = {"engine": {"image": "x", "model": {"name": "m"}}, "replicas": 2, "resources": {"gpu": {"count": 0}}}


def body(generation: int = 3, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "TrustClass",
        "metadata": {"name": "gold", "generation": generation},
        "spec": SPEC,
        "status": status or {},
    }


def deployment(*, gen: int = 5, observed: int = 5, replicas: int = 2, updated: int = 2, available: int = 2,
               ready: int = 2, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {"generation": gen},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": updated,
            "availableReplicas": available,
            "readyReplicas": ready,
            "conditions": conditions or [],
        },
    }


def untimed(status: dict[str, Any]) -> dict[str, Any]:
    """A status without its conditions' transition times (new ones are stamped with the clock)."""
    conds = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]]
    return {**status, "conditions": conds}


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_rolled_out_is_one_predicate_over_the_deployment() -> None:
    assert rolled_out(deployment(), 2)
    assert not rolled_out(deployment(observed=4), 2)  # the controller has not seen the new template
    assert not rolled_out(deployment(updated=1), 2)
    assert not rolled_out(deployment(replicas=3), 2)  # an old pod still there
    assert not rolled_out(deployment(available=1), 2)
    assert not rolled_out(None, 1)
    assert rolled_out(None, 0)  # nothing asked for, nothing to roll out


def test_a_class_status_reads_of_the_deployment_status_only_what_deployment_status_read_keeps() -> None:
    """The operator skips Deployment events that change none of it (handlers, child_digest): a class
    status computed from two Deployments with the same read is the same; each field it keeps matters."""
    tc = TrustClass.model_validate(body())
    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": "m",
    }
    for dep in (deployment(), deployment(updated=1, available=1), deployment(conditions=[deadline])):
        other = {**dep, "status": {**dep["status"], "unavailableReplicas": 7, "collisionCount": 2}}
        other["status"]["conditions"] = [
            {**c, "lastUpdateTime": "2026-12-02T00:00:09Z", "lastTransitionTime": "2026-12-02T00:00:08Z"}
            for c in dep["status"]["conditions"]
        ]
        assert deployment_status_read(other) == deployment_status_read(dep)
        a, b = (trust_class_status(body(), tc, deployment=d) for d in (other, dep))
        assert untimed(a.status) == untimed(b.status) and a.rolled_out == b.rolled_out
        assert (a.ready_flipped is None) == (b.ready_flipped is None)
    base = deployment(conditions=[deadline])
    for field in ("observedGeneration", "replicas", "readyReplicas", "availableReplicas", "updatedReplicas"):
        changed = {**base, "status": {**base["status"], field: 9}}
        assert deployment_status_read(changed) != deployment_status_read(base), field
    for key in ("type", "status", "reason", "message"):
        changed = {**base, "status": {**base["status"], "conditions": [{**deadline, key: "Other"}]}}
        assert deployment_status_read(changed) != deployment_status_read(base), key


def test_a_rolled_out_class_is_ready_and_its_spec_is_in_force() -> None:
    tc = TrustClass.model_validate(body())
    out = trust_class_status(
        body(), tc, endpoint="http://e", bound_tenants=4, deployment=deployment(), key=b"k" * 32
    )
    s = out.status
    assert out.rolled_out and s["observedGeneration"] == 3
    assert cond(s, C.READY)["status"] == "True" and cond(s, C.READY)["observedGeneration"] == 3
    assert cond(s, C.PROGRESSING)["status"] == "False" and cond(s, C.RECONCILING)["status"] == "False"
    assert cond(s, C.STALLED)["status"] == "False"
    assert (s["replicas"], s["readyReplicas"], s["desiredReplicas"], s["boundTenants"]) == (2, 2, 2, 4)
    assert s[ACCEPTED_SPEC] == SPEC and s["signingKeyId"]
    assert out.ready_flipped is not None  # it was not Ready before: an Event


def test_a_rollout_in_progress_is_reconciling_and_a_stuck_one_stalled() -> None:
    tc = TrustClass.model_validate(body())
    rolling = trust_class_status(body(), tc, deployment=deployment(updated=1, available=1)).status
    assert cond(rolling, C.READY)["status"] == "False" and cond(rolling, C.PROGRESSING)["status"] == "True"
    assert cond(rolling, C.RECONCILING)["status"] == "True" and cond(rolling, C.STALLED)["status"] == "False"
    deadline = {"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "timed out"}
    stuck_dep = deployment(updated=1, conditions=[deadline])
    stuck = trust_class_status(body(), tc, deployment=stuck_dep).status
    assert cond(stuck, C.DEGRADED)["status"] == "True" and cond(stuck, C.STALLED)["status"] == "True"
    assert cond(stuck, C.RECONCILING)["status"] == "False"  # never both


def test_a_new_class_rolling_out_is_no_event_but_a_stuck_one_is() -> None:
    tc = TrustClass.model_validate(body())
    assert trust_class_status(body(), tc, deployment=deployment(updated=1, available=1)).ready_flipped is None
    deadline = {"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "timed out"}
    stuck = trust_class_status(body(), tc, deployment=deployment(updated=1, conditions=[deadline]))
    assert stuck.ready_flipped is not None and stuck.ready_flipped["status"] == "False"
    # once Ready, losing it is news
    was_ready = body()
    was_ready["status"] = {"conditions": [{"type": C.READY, "status": "True", "reason": C.REASON_AVAILABLE}]}
    lost = trust_class_status(was_ready, tc, deployment=deployment(updated=1, available=1))
    assert lost.ready_flipped is not None and lost.ready_flipped["reason"] == C.REASON_UNAVAILABLE


def test_a_degraded_class_keeps_its_last_accepted_spec_and_says_why() -> None:
    before = {ACCEPTED_SPEC: {"replicas": 1}, "acceptedGeneration": 2}
    out = trust_class_status(body(status=before), None, degraded=(C.REASON_INVALID_SPEC, "bad field"))
    s = out.status
    assert s[ACCEPTED_SPEC] == {"replicas": 1} and s["acceptedGeneration"] == 2
    assert cond(s, C.READY)["reason"] == C.REASON_INVALID_SPEC and cond(s, C.STALLED)["status"] == "True"
    assert not out.rolled_out


def test_scaled_to_zero_is_not_ready_but_rolled_out() -> None:
    b = body()
    b["spec"] = {**SPEC, "replicas": 0}
    tc = TrustClass.model_validate(b)
    out = trust_class_status(b, tc, deployment=deployment(replicas=0, updated=0, available=0, ready=0))
    assert out.rolled_out and cond(out.status, C.READY)["reason"] == C.REASON_SCALED_TO_ZERO


#: What an earlier reconcile wrote: the counts a degraded class must not leave standing.
STALE = {"desiredReplicas": 3, "replicas": 3, "readyReplicas": 3}


def test_a_degraded_class_reports_the_pods_its_engine_runs_as_last_rendered() -> None:
    tc = TrustClass.model_validate(body())
    running = deployment(replicas=2, ready=1)  # one pod of the last rendering lost readiness
    why = (C.REASON_FORBIDDEN_EXTRA_ARGS, "no")
    s = trust_class_status(body(status=STALE), tc, deployment=running, degraded=why).status
    assert (s["desiredReplicas"], s["replicas"], s["readyReplicas"]) == (2, 2, 1)
    assert cond(s, C.DEGRADED)["status"] == "True" and cond(s, C.READY)["status"] == "False"
    # no engine (the namespace is someone else's, or nothing was ever rendered): none of its pods run
    s = trust_class_status(body(status=STALE), tc, deployment=None, degraded=why).status
    assert (s["desiredReplicas"], s["replicas"], s["readyReplicas"]) == (2, 0, 0)


def test_a_class_that_does_not_validate_reports_what_its_deployment_asks_for_and_runs() -> None:
    before = {ACCEPTED_SPEC: {"replicas": 1}, "acceptedGeneration": 2, **STALE}
    running = deployment(replicas=4, ready=4)  # sized since by an autoscaler, say
    why = (C.REASON_INVALID_SPEC, "bad field")
    s = trust_class_status(body(status=before), None, deployment=running, degraded=why).status
    assert (s["desiredReplicas"], s["replicas"], s["readyReplicas"]) == (4, 4, 4)
    s = trust_class_status(body(status=before), None, deployment=None, degraded=why).status
    assert (s["replicas"], s["readyReplicas"]) == (0, 0)
    assert "desiredReplicas" not in s  # nothing asks for any: left as the patch finds it


def test_a_status_is_written_once_even_where_it_leaves_fields_alone() -> None:
    """A degraded status sets no signingKeyId (the key is not read): the merge patch keeps the live
    one, so the next reconcile, which computes the same status, has nothing to write."""
    tc = TrustClass.model_validate(body())
    live = {**STALE, "signingKeyId": "abc", "conditions": []}
    why = (C.REASON_FORBIDDEN_EXTRA_ARGS, "no")
    desired = trust_class_status(body(status=live), tc, deployment=deployment(), degraded=why).status
    assert status_differs(desired, live)
    written = {k: v for k, v in {**live, **status_patch(desired, live)}.items() if v is not None}
    assert written["signingKeyId"] == "abc" and written["replicas"] == 2
    again = trust_class_status(body(status=written), tc, deployment=deployment(), degraded=why).status
    assert not status_differs(again, written)
    # a field the status sets, changed, is written again
    assert status_differs(again, {**written, "readyReplicas": 0})
