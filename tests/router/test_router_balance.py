"""Replica choice without any I/O: the consistent-hash ring, the load bound, drain bookkeeping
(:mod:`kvfence.router.balance`, :mod:`kvfence.router.endpoints`). The same rules are proven with
real engine processes in ``test_router_replicas.py``."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.router.balance import LOAD_FACTOR, Ring, bound, hash64
from kvfence.router.endpoints import ClassEndpoints, Member
from kvfence.router.slices import ENGINE_PORT_NAME, ENGINE_SERVICE, members_of, service_of


def _never(host: str, port: int) -> Any:
    raise AssertionError("no pool is opened by these tests")


def _class(n: int, policy: str = "affinity") -> ClassEndpoints:
    ce = ClassEndpoints("gold", "", _never, policy)
    ce.set_members([Member(f"10.0.0.{i}", 8000) for i in range(1, n + 1)])
    return ce


def test_hash_is_stable_across_processes() -> None:
    # blake2b, not Python's randomised hash(): every router replica puts a tenant on the same replica.
    import hashlib

    expected = int.from_bytes(hashlib.blake2b(b"tenant/gold/alice", digest_size=8).digest(), "big")
    assert hash64("tenant/gold/alice") == expected
    assert hash64("a") != hash64("b")


def test_the_ring_spreads_keys_evenly_and_moves_only_the_keys_of_a_replica_that_leaves() -> None:
    five = Ring([f"10.0.0.{i}:8000" for i in range(5)])
    keys = [hash64(f"tenant/gold/t{i}") for i in range(5000)]
    homes = [five.members[five.order(k)[0]] for k in keys]
    shares = Counter(homes)
    assert len(shares) == 5 and all(700 <= c <= 1300 for c in shares.values()), shares
    four = Ring([m for m in five.members if m != "10.0.0.2:8000"])
    for k, home in zip(keys, homes, strict=True):
        new_home = four.members[four.order(k)[0]]
        if home != "10.0.0.2:8000":
            assert new_home == home  # everyone else keeps its warm cache
        else:
            # ...and the leaver's tenants go where their order said next.
            assert new_home == five.members[five.order(k)[1]]


def test_a_tenant_stays_home_until_its_home_reaches_the_bound_then_spills() -> None:
    ce = _class(3)
    key = hash64("tenant/gold/alice")
    home, hit = ce.pick(key) or (None, False)
    assert home is not None and hit
    held = []
    for _ in range(30):
        picked = ce.pick(key)
        assert picked is not None
        ep, hit = picked
        assert ep.inflight < bound(ce.inflight, 3)
        assert hit == (ep is home)
        ce.begin(ep)
        held.append(ep)
        # the bound: no replica above ceil(1.25 * average)
        assert max(e.inflight for e in ce.serving) <= bound(ce.inflight - 1, 3)
    loads = Counter(e.key for e in held)
    assert len(loads) == 3  # one tenant's burst spread over every replica
    assert loads[home.key] == max(loads.values())  # its home still took the largest part
    for ep in held:
        ce.end(ep)
    assert ce.inflight == 0 and all(e.inflight == 0 for e in ce.serving)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 12),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=120),
)
def test_no_replica_ever_exceeds_the_load_bound(n: int, ops: list[tuple[bool, int]]) -> None:
    """Property (Mirrokni et al.): whatever the arrivals and departures, a request is placed on a
    replica below ceil(c * (in_flight + 1) / n)."""
    ce = _class(n)
    held = []
    for arrive, tenant in ops:
        if arrive or not held:
            picked = ce.pick(hash64(f"tenant/gold/t{tenant}"))
            assert picked is not None
            ep, _ = picked
            assert ep.inflight < bound(ce.inflight, n, LOAD_FACTOR)
            ce.begin(ep)
            held.append(ep)
        else:
            ce.end(held.pop(tenant % len(held)))
        assert ce.inflight == sum(e.inflight for e in ce.serving) == len(held)


def test_not_ready_and_unhealthy_endpoints_never_serve_and_leavers_drain() -> None:
    ce = ClassEndpoints("gold", "", _never)
    ce.set_members([Member("10.0.0.1", 8000), Member("10.0.0.2", 8000, ready=False)])
    assert [e.key for e in ce.serving] == ["10.0.0.1:8000"]
    for t in range(50):
        picked = ce.pick(hash64(f"t{t}"))
        assert picked is not None and picked[0].key == "10.0.0.1:8000"
    one = ce.members["10.0.0.1:8000"]
    ce.begin(one)  # a request in flight on it
    gone = ce.set_members([Member("10.0.0.2", 8000)])  # 1 leaves, 2 becomes ready
    assert gone == [one] and one.inflight == 1  # the request goes on...
    assert ce.inflight == 0  # ...but no longer counts for the bound of the others
    assert [e.key for e in ce.serving] == ["10.0.0.2:8000"]
    ce.end(one)
    assert one.inflight == 0 and ce.inflight == 0
    two = ce.members["10.0.0.2:8000"]
    two.healthy = False
    ce.refresh()
    assert ce.pick(1) is None  # nothing serves: the proxy answers 503 at once


def test_a_retry_avoids_the_replicas_it_tried() -> None:
    ce = _class(3)
    first = ce.pick(7)
    assert first is not None
    second = ce.pick(7, (first[0],))
    assert second is not None and second[0] is not first[0] and not second[1]
    third = ce.pick(7, (first[0], second[0]))
    assert third is not None and third[0] not in (first[0], second[0])
    assert ce.pick(7, tuple(ce.serving)) is None


def test_random_policy_ignores_affinity() -> None:
    ce = _class(3, "random")
    seen = Counter()
    for _ in range(300):
        picked = ce.pick(hash64("tenant/gold/alice"))
        assert picked is not None
        seen[picked[0].key] += 1
    assert len(seen) == 3


def _slice(ports: list[tuple[str | None, int]], eps: list[tuple[str, bool | None, bool | None]]) -> Any:
    """An EndpointSlice as the API serves it (JSON; unset conditions are absent)."""

    def conditions(r: bool | None, t: bool | None) -> dict[str, bool]:
        return {k: v for k, v in (("ready", r), ("serving", r), ("terminating", t)) if v is not None}

    return {
        "ports": [{"port": p, **({"name": n} if n is not None else {})} for n, p in ports],
        "endpoints": [{"addresses": [a], "conditions": conditions(r, t)} for a, r, t in eps],
    }


def test_endpoint_slices_read_as_the_api_documents_them() -> None:
    s = _slice(
        [("metrics", 9000), (ENGINE_PORT_NAME, 8000)],
        [
            ("10.1.0.1", True, None),
            ("10.1.0.2", None, None),
            ("10.1.0.3", False, None),
            ("10.1.0.4", True, True),
        ],
    )
    assert [(m.host, m.port, m.ready) for m in members_of(s)] == [
        ("10.1.0.1", 8000, True),
        ("10.1.0.2", 8000, True),  # unset ready: "interpret as ready"
        ("10.1.0.3", 8000, False),
        ("10.1.0.4", 8000, False),  # terminating: drained, even while still serving
    ]
    assert [m.port for m in members_of(_slice([(None, 8123)], [("10.1.0.1", True, None)]))] == [8123]
    assert members_of(_slice([("a", 1), ("b", 2)], [("10.1.0.1", True, None)])) == []


def test_service_of_names_only_in_cluster_services() -> None:
    assert service_of(f"http://{ENGINE_SERVICE}.kvf-gold.svc.cluster.local:8000") == (
        "kvf-gold",
        ENGINE_SERVICE,
    )
    assert service_of("http://kvfence-engine.kvf-gold.svc:8000") == ("kvf-gold", "kvfence-engine")
    assert service_of("http://127.0.0.1:8000") is None
    assert service_of("https://engine.example.com") is None


def test_the_router_follows_the_engine_service_the_operator_creates() -> None:
    from kvfence.operator.builders import ENGINE_NAME

    assert ENGINE_NAME == ENGINE_SERVICE
