"""Pure pieces of the reconciler and the leader election (no cluster)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from kvfence.api.common import API_VERSION
from kvfence.operator.apply import _resource_of, is_subset, path_for
from kvfence.operator.bookkeeping import needs_apply, with_spec_hash
from kvfence.operator.leader import _parse
from kvfence.operator.routing_reconcile import list_binding
from kvfence.operator.status import set_condition, status_differs


def test_is_subset_ignores_server_defaults_but_not_drift() -> None:
    desired = {
        "spec": {
            "replicas": 2,
            "template": {"containers": [{"name": "e", "resources": {"limits": {"nvidia.com/gpu": 2}}}]},
        }
    }
    live = {
        "spec": {
            "replicas": 2,
            "progressDeadlineSeconds": 600,
            "template": {
                "containers": [
                    {
                        "name": "e",
                        "imagePullPolicy": "Always",
                        "resources": {"limits": {"nvidia.com/gpu": "2"}},
                    }
                ]
            },
        }
    }
    assert is_subset(desired, live)
    live["spec"]["replicas"] = 0
    assert not is_subset(desired, live)
    assert not is_subset({"a": [1, 2]}, {"a": [1]})
    assert not is_subset({"a": True}, {"a": "True"})
    assert is_subset({"a": {}}, {"a": {"b": 1}})


def test_spec_hash_notices_a_removed_field() -> None:
    full = with_spec_hash({"kind": "X", "metadata": {"name": "x"}, "spec": {"a": 1, "b": 2}})
    smaller = with_spec_hash({"kind": "X", "metadata": {"name": "x"}, "spec": {"a": 1}})
    assert not needs_apply(full, full)
    # the live object still has b, so a plain subset check would say "nothing to do"; the hash says otherwise
    assert needs_apply(smaller, full)
    assert needs_apply(full, None)


def test_conditions_keep_transition_time_unless_status_flips() -> None:
    old = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "A",
            "message": "",
            "lastTransitionTime": "2020-01-01T00:00:00Z",
        }
    ]
    same = set_condition(old, "Ready", True, "B", "m", 3)
    assert same["lastTransitionTime"] == "2020-01-01T00:00:00Z" and same["observedGeneration"] == 3
    flipped = set_condition(old, "Ready", False, "C", "m", 3)
    assert flipped["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    a = {"observedGeneration": 1, "conditions": [same]}
    b = {"observedGeneration": 1, "conditions": [dict(same, lastTransitionTime="2030-01-01T00:00:00Z")]}
    assert not status_differs(a, b)
    assert status_differs(a, {"observedGeneration": 2, "conditions": [same]})


def test_paths() -> None:
    assert path_for("apps/v1", "Deployment", "ns", "d") == "/apis/apps/v1/namespaces/ns/deployments/d"
    assert path_for("v1", "Namespace", None, "n") == "/api/v1/namespaces/n"
    assert (
        path_for("kvfence.dev/v1alpha1", "TrustClass", None, "t")
        == "/apis/kvfence.dev/v1alpha1/trustclasses/t"
    )
    assert _resource_of("/api/v1/namespaces/ns/secrets/s") == "secrets"
    assert _resource_of("/api/v1/namespaces/ns") == "namespaces"
    assert _resource_of("/apis/kvfence.dev/v1alpha1/trustclasses/t/status") == "trustclasses"


def test_lease_times_parse() -> None:
    t = _parse("2026-01-02T03:04:05.123456Z")
    assert t == dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)
    assert _parse("2026-01-02T03:04:05Z") is not None
    assert _parse(None) is None and _parse("garbage") is None


def test_liveness_flag_sets_the_health_endpoint() -> None:
    from kvfence.operator.main import parse_args

    a = parse_args(["--liveness", "http://127.0.0.1:9999/healthz"])
    assert (a.health_host, a.health_port) == ("127.0.0.1", 9999)
    b = parse_args([])
    assert b.health_port == 8080 and b.leader_elect and b.log_format == "json"


def test_a_routing_decision_keeps_of_a_binding_only_what_it_reads() -> None:
    """The decision holds every binding at once (10,000 of them at scale), not its whole body: the
    model it decides with (identity, versions and age for its order, status writes and Events; the
    spec; the status reduced to the accepted spec) and the whole status as compact JSON, which only
    the status write reads."""
    spec = {"tenantId": "t", "trustClassName": "gold", "apiKeySecretRef": {"name": "k"}}
    accepted = {**spec, "quotas": {"maxKVBlocks": 10}}
    cond = {"type": "Bound", "status": "True", "reason": "Bound", "message": "", "lastTransitionTime": "x"}
    identity = {
        "name": "b",
        "namespace": "ns",
        "uid": "u-1",
        "generation": 3,
        "resourceVersion": "77",
        "creationTimestamp": "2026-12-01T00:00:00Z",
    }
    status = {"conditions": [cond], "acceptedSpec": accepted, "acceptedGeneration": 2, "apiKeys": 1}
    body = {
        "apiVersion": API_VERSION,
        "kind": "TenantBinding",
        "metadata": {
            **identity,
            "labels": {"team": "x" * 200},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}" * 100},
            "ownerReferences": [{"kind": "App", "name": "a"}],
            "managedFields": [{"manager": "kubectl"}],
        },
        "spec": spec,
        "status": status,
    }
    listed = list_binding(body)
    assert listed is not None
    model = listed.model
    assert model.metadata == identity and model.key == "ns/b"
    assert model.status.conditions == []  # not held as models for every binding
    accepted_spec = model.accepted_spec()
    assert accepted_spec is not None and accepted_spec.quotas.max_kv_blocks == 10
    assert model.status.accepted_generation == 2
    # the status write and Events see the binding's identity and its whole status, each call a copy
    assert listed.status() == status and listed.status() is not listed.status()
    assert listed.body() == {
        "apiVersion": API_VERSION,
        "kind": "TenantBinding",
        "metadata": identity,
        "status": status,
    }
    assert b" " not in listed.status_json  # compact
    no_status = list_binding(
        {"apiVersion": API_VERSION, "kind": "TenantBinding", "metadata": {"name": "n"}, "spec": spec}
    )
    assert no_status is not None and no_status.status() == {}
    # a binding that does not validate is left out of the decision
    invalid = {
        "apiVersion": API_VERSION,
        "kind": "TenantBinding",
        "metadata": {"name": "n"},
        "spec": {"tenantId": "t"},
    }
    assert list_binding(invalid) is None


def test_freed_memory_is_given_back_on_glibc() -> None:
    """After a routing decision the operator hands the C heap's free pages back (glibc's
    malloc_trim); this machine's Python runs on glibc, so the call is made."""
    from kvfence.operator import memory

    assert memory.release_free_memory() is True


def test_a_leadership_term_waits_until_the_api_server_serves_the_custom_resources() -> None:
    """kopf discovers what it watches once per term: a term begun right after an API server restart,
    before the CRDs' group is served again, would watch nothing. Each term waits for the group first
    (unreachable, 404, a partial list: all "not yet"), and gives up only when told to stop."""
    import threading

    from kvfence.operator.apply import KubeError
    from kvfence.operator.main import WATCHED_CUSTOM, wait_until_served

    assert set(WATCHED_CUSTOM) == {"trustclasses", "tenantbindings"}
    full = {"resources": [{"name": n} for n in (*WATCHED_CUSTOM, "trustclasses/status")]}
    answers: list[Any] = [
        ConnectionRefusedError("connection refused"),
        KubeError(404, "Not Found", "the server could not find the requested resource"),
        {"resources": [{"name": "trustclasses"}]},
        full,
    ]

    class Discovery:
        paths: list[str] = []

        def request(self, method: str, path: str) -> Any:
            assert method == "GET"
            self.paths.append(path)
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    kube = Discovery()
    stop = threading.Event()
    assert wait_until_served(kube, stop, interval=0.0) is True  # type: ignore[arg-type]
    assert kube.paths == ["/apis/kvfence.dev/v1alpha1"] * 4 and not answers

    calls = 0

    class Never:
        def request(self, method: str, path: str) -> Any:
            nonlocal calls
            calls += 1
            if calls == 3:
                stop.set()  # SIGTERM, or the lease lost, while waiting
            return {"resources": []}

    assert wait_until_served(Never(), stop, interval=0.0) is False  # type: ignore[arg-type]
    assert calls == 3
