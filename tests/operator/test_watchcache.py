"""The watches' cache of TrustClasses, engine Deployments and signing keys (no cluster): what it
answers, and that it never answers with a version older than one the operator has seen."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvfence.operator.builders import ENGINE_NAME, SIGNING_SECRET_NAME
from kvfence.operator.watchcache import WatchCache, operator_objects

TC = ("TrustClass", "", "gold")


def tc(version: int, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfence.dev/v1alpha1",
        "kind": "TrustClass",
        "metadata": {
            "name": "gold",
            "resourceVersion": str(version),
            "managedFields": [{"manager": "kvfence-operator", "fieldsV1": {"f:spec": {}}}],
        },
        "spec": {"runtime": "reference"},
        "status": status,
    }


def test_a_delivered_body_is_read_without_managed_fields_and_a_reader_may_change_its_copy() -> None:
    cache = WatchCache()
    cache.event(TC, tc(5, phase="Ready"))
    got = cache.read(TC)
    assert got is not None
    assert got["metadata"] == {"name": "gold", "resourceVersion": "5"}
    assert got["status"] == {"phase": "Ready"}
    got["status"]["phase"] = "changed by the reader"
    again = cache.read(TC)
    assert again is not None and again["status"] == {"phase": "Ready"}
    assert len(cache) == 1


def test_only_the_operators_three_kinds_are_held() -> None:
    assert operator_objects(("TrustClass", "", "x"))
    assert operator_objects(("Deployment", "ns", ENGINE_NAME))
    assert operator_objects(("Secret", "ns", SIGNING_SECRET_NAME))
    # an API key, another Deployment, a ConfigMap: always read from the API server
    others = (("Secret", "ns", "acme-keys"), ("Deployment", "ns", "other"), ("ConfigMap", "ns", ENGINE_NAME))
    for ref in others:
        assert not operator_objects(ref)
        cache = WatchCache()
        cache.event(ref, {"kind": ref[0], "metadata": {"name": ref[2], "resourceVersion": "1"}})
        assert cache.read(ref) is None and len(cache) == 0


def test_a_version_learnt_from_a_request_waits_for_the_watch_to_deliver_it() -> None:
    """The operator patched the status (version 7): the watch still delivers 6, which is stored but
    not read (a reconcile would see the status it wrote flip back); 7 arrives and is read."""
    cache = WatchCache()
    cache.event(TC, tc(5))
    cache.learnt(tc(7, phase="Ready"))
    assert cache.read(TC) is None
    cache.event(TC, tc(6))
    assert cache.read(TC) is None
    cache.event(TC, tc(7, phase="Ready"))
    got = cache.read(TC)
    assert got is not None and got["metadata"]["resourceVersion"] == "7"
    cache.event(TC, tc(8, phase="Degraded"))  # someone else's later write: news, read at once
    got = cache.read(TC)
    assert got is not None and got["status"] == {"phase": "Degraded"}


def test_a_request_that_finds_the_version_the_cache_holds_makes_it_readable_again() -> None:
    """A version the watch skipped (kopf delivers the latest of a burst) is never delivered: a GET
    that answers with the version the cache holds shows the cache is current."""
    cache = WatchCache()
    cache.learnt(tc(7))
    cache.event(TC, tc(8))  # 7 was skipped
    assert cache.read(TC) is None
    cache.learnt(tc(8))  # the GET the miss caused
    got = cache.read(TC)
    assert got is not None and got["metadata"]["resourceVersion"] == "8"


def test_a_deletion_or_the_resync_empties_the_entry_and_an_absent_entry_is_a_miss() -> None:
    cache = WatchCache()
    assert cache.read(TC) is None  # never seen: read from the API server, not "absent"
    cache.event(TC, tc(3))
    cache.event(TC, None)
    assert cache.read(TC) is None and len(cache) == 0
    cache.event(TC, tc(4))
    cache.learnt(tc(9))
    cache.clear()
    assert len(cache) == 0
    # the awaited version outlives the resync: an older event cached after it is not read
    cache.event(TC, tc(5))
    assert cache.read(TC) is None
    cache.event(TC, tc(9))
    assert cache.read(TC) is not None


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("write"), st.just(0)),  # the operator writes the next version
            st.tuples(st.just("other"), st.just(0)),  # another client writes the next version
            st.tuples(st.just("deliver"), st.integers(1, 3)),  # the watch delivers (up to 3 of) what is due
            st.tuples(st.just("skip"), st.just(0)),  # the watch skips one version (a burst)
            st.tuples(st.just("get"), st.just(0)),  # a miss: the operator GETs the latest
        ),
        max_size=40,
    )
)
def test_a_read_is_never_older_than_what_the_operator_has_seen(steps: list[tuple[str, int]]) -> None:
    """Whatever the interleaving of writes, watch deliveries (in order, some skipped) and GETs, a
    read answers with a version at least as new as every version the operator has learnt."""
    cache = WatchCache()
    latest = 0  # the server's version
    undelivered: list[int] = []  # versions the watch has still to deliver, in order
    seen_by_operator = 0
    for op, n in steps:
        if op in ("write", "other"):
            latest += 1
            undelivered.append(latest)
            if op == "write":
                cache.learnt(tc(latest))
                seen_by_operator = max(seen_by_operator, latest)
        elif op == "deliver":
            for _ in range(min(n, len(undelivered))):
                cache.event(TC, tc(undelivered.pop(0)))
        elif op == "skip" and undelivered:
            undelivered.pop(0)
        elif op == "get" and latest:
            cache.learnt(tc(latest))
            seen_by_operator = max(seen_by_operator, latest)
        got = cache.read(TC)
        if got is not None:
            version = int(got["metadata"]["resourceVersion"])
            assert version >= seen_by_operator
            seen_by_operator = version  # what a reconcile read, it has seen
