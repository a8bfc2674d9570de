"""TrustClass status computed from what the reconciler read (operator/status.py; no cluster)."""

from __future__ import annotations

from typing import Any

from kvfence.api import conditions as C
from kvfence.api.trustclass import TrustClass
from kvfence.operator.status import ACCEPTED_SPEC, rolled_out, trust_class_status

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
