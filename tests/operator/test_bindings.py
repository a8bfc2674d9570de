"""Binding decisions and the routing table (pure: no cluster)."""

from __future__ import annotations

import base64
import json
from typing import Any

from kvfence.api import conditions as C
from kvfence.contract.engine_config import EngineConfig
from kvfence.contract.routing import (
    ROUTING_SECRET_KEY,
    ROUTING_SECRET_NAME,
    RequestLimits,
    RoutingTable,
    encode_table,
    hash_api_key,
)
from kvfence.operator import bindings as R
from kvfence.operator import builders
from kvfence.operator.builders import OperatorOptions

OPTS = OperatorOptions()
KEY = b"\x07" * 32
NS = {"team-a": {"kvfence.dev/tenants": "gold"}, "team-b": {"kvfence.dev/tenants": "gold"}, "rogue": {}}


def keys(*pairs: tuple[str, str]) -> dict[str, R.KeyLookup]:
    return {b: R.KeyLookup(hashes=(hash_api_key(k),)) for b, k in pairs}


def test_hash_and_secret_parsing() -> None:
    assert hash_api_key("abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    enc = base64.b64encode(b"k1\n\nk2 \n").decode()
    secret = {"data": {"keys": enc, "other": base64.b64encode(b"k3").decode()}}
    assert R.api_keys_from_secret(secret, "keys") == ["k1", "k2"]
    assert R.api_keys_from_secret(secret, None) == ["k1", "k2", "k3"]
    assert R.api_keys_from_secret(secret, "missing") == []


def test_bound_binding_routes_with_hashed_keys(make_tc: Any, make_tb: Any) -> None:
    tc = make_tc(quotas={"defaults": {"requestsPerMinute": 60}, "limits": {"requestsPerMinute": 600}})
    tb = make_tb("acme", "acme", quotas={"requestsPerMinute": 120})
    out = R.decide({"gold": R.ClassState(tc, (KEY,))}, [tb], NS, keys(("team-a/acme", "secret-1")), OPTS)
    d = out.decisions["team-a/acme"]
    assert d.bound and not d.denied and d.reason == C.REASON_BOUND and d.api_keys == 1
    route = out.table.tenants["acme"]
    assert route.trust_class == "gold" and route.binding == "team-a/acme"
    assert route.api_key_hashes == [hash_api_key("secret-1")]
    assert "secret-1" not in R.table_json(out.table)
    assert route.quotas.requests_per_minute == 120
    cls = out.table.trust_classes["gold"]
    assert cls.signing_keys == [base64.b64encode(KEY).decode()]
    assert cls.endpoint == "http://kvfence-engine.kvf-gold.svc.cluster.local:8000"


def test_denied_bindings_never_route(make_tc: Any, make_tb: Any) -> None:
    classes = {
        "gold": R.ClassState(
            make_tc(
                engine={"adapters": [{"name": "a1"}], "numBlocks": 80},
                quotas={"limits": {"maxKVBlocks": 50}},
            ),
            (KEY,),
        ),
        "doomed": R.ClassState(make_tc("doomed"), (KEY,), deleting=True),
    }
    bindings = [
        make_tb("first", "dup", created="2026-01-01T00:00:00Z"),
        make_tb("second", "dup", namespace="team-b", created="2026-01-02T00:00:00Z"),
        make_tb("rogue", "rogue", namespace="rogue"),
        make_tb("missing", "missing", trust_class="platinum"),
        make_tb("deleting", "deleting", trust_class="doomed"),
        make_tb("adapter", "adapter", allowedAdapters=["a2"]),
        make_tb("greedy", "greedy", quotas={"maxKVBlocks": 51}),
        make_tb("nokeys", "nokeys"),
        make_tb("forbidden", "forbidden"),
        make_tb("samekey", "samekey", created="2026-01-03T00:00:00Z"),
        make_tb("hog1", "hog1", quotas={"maxKVBlocks": 50, "guaranteedKVBlocks": 50}),
        make_tb(
            "hog2",
            "hog2",
            quotas={"maxKVBlocks": 50, "guaranteedKVBlocks": 50},
            created="2026-01-04T00:00:00Z",
        ),
    ]
    lookups = keys(
        ("team-a/first", "k-first"),
        ("team-b/second", "k-second"),
        ("rogue/rogue", "k-rogue"),
        ("team-a/missing", "k-missing"),
        ("team-a/deleting", "k-deleting"),
        ("team-a/adapter", "k-adapter"),
        ("team-a/greedy", "k-greedy"),
        ("team-a/samekey", "k-first"),
        ("team-a/hog1", "k-hog1"),
        ("team-a/hog2", "k-hog2"),
    )
    lookups["team-a/nokeys"] = R.KeyLookup()
    lookups["team-a/forbidden"] = R.KeyLookup(error=C.REASON_SECRET_FORBIDDEN, message="forbidden")
    out = R.decide(classes, bindings, NS, lookups, OPTS)
    reasons = {k: (d.bound, d.denied, d.reason) for k, d in out.decisions.items()}
    assert reasons == {
        "team-a/first": (True, False, C.REASON_BOUND),
        "team-b/second": (False, True, C.REASON_DUPLICATE_TENANT_ID),
        "rogue/rogue": (False, True, C.REASON_NAMESPACE_NOT_ADMITTED),
        "team-a/missing": (False, True, C.REASON_TRUST_CLASS_NOT_FOUND),
        "team-a/deleting": (False, True, C.REASON_TRUST_CLASS_NOT_FOUND),
        "team-a/adapter": (False, True, C.REASON_ADAPTER_NOT_IN_CLASS),
        "team-a/greedy": (False, True, C.REASON_QUOTA_EXCEEDS_LIMIT),
        "team-a/nokeys": (False, True, C.REASON_NO_API_KEYS),
        "team-a/forbidden": (False, True, C.REASON_SECRET_FORBIDDEN),
        "team-a/samekey": (False, True, R.REASON_DUPLICATE_API_KEY),
        "team-a/hog1": (True, False, C.REASON_BOUND),
        "team-a/hog2": (False, True, R.REASON_KV_OVERCOMMITTED),
    }
    assert set(out.table.tenants) == {"dup", "hog1"}
    assert out.table.tenants["dup"].binding == "team-a/first"
    assert set(out.table.trust_classes) == {"gold"}
    assert out.tenant_quotas["gold"]["hog1"].guaranteed_kv_blocks == 50
    routed_hashes = {h for t in out.table.tenants.values() for h in t.api_key_hashes}
    for b, lk in lookups.items():
        if not out.decisions[b].bound:
            assert not (set(lk.hashes) - {hash_api_key("k-first")}) & routed_hashes


def test_denials_name_nothing_in_another_tenants_namespace(make_tc: Any, make_tb: Any) -> None:
    """A binding that loses a tenant id or an API key to an older one is told which binding only when
    that binding is in its own namespace."""
    classes = {"gold": R.ClassState(make_tc(), (KEY,))}
    bindings = [
        make_tb("winner", "dup", namespace="team-a", created="2026-01-01T00:00:00Z"),
        make_tb("loser", "dup", namespace="team-b", created="2026-01-02T00:00:00Z"),
        make_tb("loser-here", "dup", namespace="team-a", created="2026-01-03T00:00:00Z"),
        make_tb("key-loser", "other", namespace="team-b", created="2026-01-04T00:00:00Z"),
        make_tb("key-loser-here", "third", namespace="team-a", created="2026-01-05T00:00:00Z"),
    ]
    lookups = keys(
        ("team-a/winner", "k-1"),
        ("team-b/loser", "k-2"),
        ("team-a/loser-here", "k-3"),
        ("team-b/key-loser", "k-1"),
        ("team-a/key-loser-here", "k-1"),
    )
    out = R.decide(classes, bindings, NS, lookups, OPTS)
    d = out.decisions
    assert d["team-b/loser"].reason == C.REASON_DUPLICATE_TENANT_ID
    assert d["team-b/loser"].message == "tenant id 'dup' is already bound by an older TenantBinding"
    assert d["team-a/loser-here"].message == (
        "tenant id 'dup' is already bound by TenantBinding 'winner' of this namespace"
    )
    assert d["team-b/key-loser"].reason == R.REASON_DUPLICATE_API_KEY
    assert (
        d["team-b/key-loser"].message
        == "an API key of this binding is already used by an older TenantBinding"
    )
    assert "'winner' of this namespace" in d["team-a/key-loser-here"].message
    for key in ("team-b/loser", "team-b/key-loser"):
        assert "team-a" not in d[key].message and "winner" not in d[key].message


def test_guarantees_are_budgeted_against_the_reference_pool_or_1024_on_vllm(
    make_tc: Any, make_tb: Any
) -> None:
    def decide(tc: Any) -> dict[str, R.Decision]:
        tbs = [
            make_tb("a", "a", quotas={"guaranteedKVBlocks": 600}, created="2026-01-01T00:00:00Z"),
            make_tb("b", "b", quotas={"guaranteedKVBlocks": 600}, created="2026-01-02T00:00:00Z"),
        ]
        lookups = keys(("team-a/a", "k-a"), ("team-a/b", "k-b"))
        return R.decide({"gold": R.ClassState(tc, (KEY,))}, tbs, NS, lookups, OPTS).decisions

    # numBlocks unset on the reference engine: its default pool of 1024
    d = decide(make_tc())
    assert d["team-a/a"].bound and d["team-a/b"].reason == R.REASON_KV_OVERCOMMITTED
    assert "overcommit the 1024 blocks" in d["team-a/b"].message
    assert all(x.bound for x in decide(make_tc(engine={"numBlocks": 1200})).values())
    # vllm sizes its pool at start, out of the operator's sight: the same fixed budget, and it says so
    d = decide(make_tc(engine={"runtime": "vllm"}))
    assert d["team-a/a"].bound and d["team-a/b"].reason == R.REASON_KV_OVERCOMMITTED
    assert "1024 guaranteed blocks the operator admits on vllm TrustClass" in d["team-a/b"].message


def test_unset_selector_admits_none_and_empty_admits_all(make_tc: Any, make_tb: Any) -> None:
    tb = make_tb("acme", "acme", namespace="rogue")
    lk = keys(("rogue/acme", "k"))
    closed = make_tc(namespaceSelector=None)
    out = R.decide({"gold": R.ClassState(closed, (KEY,))}, [tb], NS, lk, OPTS)
    assert out.decisions["rogue/acme"].reason == C.REASON_NAMESPACE_NOT_ADMITTED
    open_ = make_tc(namespaceSelector={})
    out = R.decide({"gold": R.ClassState(open_, (KEY,))}, [tb], NS, lk, OPTS)
    assert out.decisions["rogue/acme"].bound


def test_class_without_key_is_not_ready_not_denied(make_tc: Any, make_tb: Any) -> None:
    out = R.decide(
        {"gold": R.ClassState(make_tc())}, [make_tb("acme", "acme")], NS, keys(("team-a/acme", "k")), OPTS
    )
    d = out.decisions["team-a/acme"]
    assert (d.bound, d.denied, d.reason) == (False, False, C.REASON_TRUST_CLASS_NOT_READY)
    assert out.table.tenants == {} and out.table.trust_classes == {}


def test_decision_does_not_depend_on_input_order(make_tc: Any, make_tb: Any) -> None:
    classes = {"gold": R.ClassState(make_tc(), (KEY,))}
    bs = [make_tb(f"b{i}", f"t{i % 3}", created=f"2026-01-0{i + 1}T00:00:00Z") for i in range(6)]
    lk = keys(*((f"team-a/b{i}", f"k{i}") for i in range(6)))
    a = R.decide(classes, bs, NS, lk, OPTS)
    b = R.decide(classes, list(reversed(bs)), NS, lk, OPTS)
    assert R.table_json(a.table) == R.table_json(b.table)
    assert a.decisions == b.decisions


def test_routing_secret_round_trips(make_tc: Any, make_tb: Any) -> None:
    out = R.decide(
        {"gold": R.ClassState(make_tc(), (KEY,))},
        [make_tb("acme", "acme")],
        NS,
        keys(("team-a/acme", "k")),
        OPTS,
    )
    s = R.routing_secret(out.table, OPTS)
    assert s["metadata"]["name"] == ROUTING_SECRET_NAME and s["metadata"]["namespace"] == "kvfence-system"
    parsed = RoutingTable.model_validate(json.loads(base64.b64decode(s["data"][ROUTING_SECRET_KEY])))
    assert parsed == out.table


def _big_table(n: int) -> RoutingTable:
    from kvfence.contract.routing import TenantRoute

    return RoutingTable(
        tenants={
            f"t{i}": TenantRoute(
                trust_class=f"c{i % 1000}",
                api_key_hashes=[hash_api_key(str(i))],
                binding=f"ns{i % 10}/t{i}",
            )
            for i in range(n)
        }
    )


def test_a_large_table_is_stored_compressed_under_the_same_key() -> None:
    from kvfence.contract.routing import GZIP_MAGIC, MAX_STORED_BYTES, encode_table, parse_table_bytes

    small = _big_table(10)
    assert encode_table(small)[:1] == b"{" and parse_table_bytes(encode_table(small)) == small
    big = _big_table(10_000)  # the largest benchmark: 10,000 tenants
    stored = encode_table(big)
    assert stored[:2] == GZIP_MAGIC and len(stored) <= MAX_STORED_BYTES
    assert encode_table(big) == stored  # deterministic: an unchanged table is never rewritten
    assert parse_table_bytes(stored) == big
    secret = R.routing_secret(big, OPTS)
    assert parse_table_bytes(base64.b64decode(secret["data"][ROUTING_SECRET_KEY])) == big


def test_a_table_too_large_for_a_secret_is_refused() -> None:
    import pytest

    from kvfence.contract.routing import RoutingTableTooLarge, encode_table

    with pytest.raises(RoutingTableTooLarge):
        encode_table(_big_table(40_000))


def _edited(tb: Any, accepted: dict[str, Any], generation: int = 2) -> Any:
    """``tb`` as a binding whose status records ``accepted`` (a spec) as its last accepted one."""
    body = tb.model_dump(by_alias=True)
    body["metadata"]["generation"] = generation
    body["status"] = {"acceptedSpec": accepted, "acceptedGeneration": 1}
    return type(tb).model_validate(body)


def test_an_edit_that_cannot_be_accepted_keeps_the_last_accepted_spec(make_tc: Any, make_tb: Any) -> None:
    tc = make_tc(
        engine={"adapters": [{"name": "a1"}]},
        quotas={"defaults": {"requestsPerMinute": 60}, "limits": {"requestsPerMinute": 600}},
    )
    classes = {"gold": R.ClassState(tc, (KEY,))}
    accepted = make_tb("acme", "acme", quotas={"requestsPerMinute": 120}).spec.wire()
    lookups = keys(("team-a/acme", "secret-1"))
    for edit, reason in [
        ({"quotas": {"requestsPerMinute": 6000}}, C.REASON_QUOTA_EXCEEDS_LIMIT),
        ({"allowedAdapters": ["a9"]}, C.REASON_ADAPTER_NOT_IN_CLASS),
        ({"trustClassName": "platinum"}, C.REASON_TRUST_CLASS_NOT_FOUND),
    ]:
        tb = _edited(make_tb("acme", "acme", **edit), accepted)
        out = R.decide(classes, [tb], NS, lookups, OPTS)
        d = out.decisions["team-a/acme"]
        assert d.bound and not d.denied, edit
        assert d.refused is not None and d.refused.reason == reason, edit
        # Served exactly as accepted: its quota, its adapters, its class.
        route = out.table.tenants["acme"]
        assert route.quotas.requests_per_minute == 120 and route.allowed_adapters == [], edit
        assert route.trust_class == "gold" and d.served_spec == tb.accepted_spec()

    # A key rotation to a Secret that does not exist yet: the old Secret's keys keep working.
    tb = _edited(make_tb("acme", "acme", apiKeySecretRef={"name": "new-keys"}), accepted)
    missing = {
        "team-a/acme": R.KeyLookup(error=C.REASON_SECRET_NOT_FOUND, message="not found"),
        R.accepted_key("team-a/acme"): R.KeyLookup(hashes=(hash_api_key("secret-1"),)),
    }
    out = R.decide(classes, [tb], NS, missing, OPTS)
    d = out.decisions["team-a/acme"]
    assert d.bound and d.refused is not None and d.refused.reason == C.REASON_SECRET_NOT_FOUND
    assert out.table.tenants["acme"].api_key_hashes == [hash_api_key("secret-1")]

    # An acceptable edit is the new spec in force.
    tb = _edited(make_tb("acme", "acme", quotas={"requestsPerMinute": 300}), accepted)
    out = R.decide(classes, [tb], NS, lookups, OPTS)
    d = out.decisions["team-a/acme"]
    assert d.bound and d.refused is None and d.served_spec == tb.spec
    assert out.table.tenants["acme"].quotas.requests_per_minute == 300


def test_a_revocation_is_not_masked_by_the_last_accepted_spec(make_tc: Any, make_tb: Any) -> None:
    tc = make_tc(quotas={"limits": {"requestsPerMinute": 600}})
    accepted = make_tb("acme", "acme").spec.wire()
    pending = _edited(make_tb("acme", "acme", quotas={"requestsPerMinute": 6000}), accepted)
    lookups = keys(("team-a/acme", "secret-1"))
    cases: list[tuple[dict[str, R.ClassState], dict[str, Any], dict[str, R.KeyLookup], str]] = [
        # the namespace no longer admitted
        ({"gold": R.ClassState(tc, (KEY,))}, {"team-a": {}}, lookups, C.REASON_NAMESPACE_NOT_ADMITTED),
        # the class deleted
        ({}, NS, lookups, C.REASON_TRUST_CLASS_NOT_FOUND),
        ({"gold": R.ClassState(tc, (KEY,), deleting=True)}, NS, lookups, C.REASON_TRUST_CLASS_NOT_FOUND),
        # the keys removed from the Secret both specs name
        ({"gold": R.ClassState(tc, (KEY,))}, NS, {"team-a/acme": R.KeyLookup()}, C.REASON_NO_API_KEYS),
    ]
    for classes, ns, lk, reason in cases:
        for tb in (pending, _edited(make_tb("acme", "acme"), accepted, generation=1)):
            out = R.decide(classes, [tb], ns, lk, OPTS)
            d = out.decisions["team-a/acme"]
            # The refusal reported is the binding's own spec's (checked in order: class, namespace,
            # quotas, keys): what must change for the current spec to be accepted.
            expect = (
                C.REASON_QUOTA_EXCEEDS_LIMIT if tb is pending and reason == C.REASON_NO_API_KEYS else reason
            )
            assert d.denied and not d.bound and d.reason == expect, reason
            assert "acme" not in out.table.tenants, reason


# --- a class edited under bound tenants: clamped, never revoked -------------------------------------
def _admitted(tb: Any) -> Any:
    """``tb`` as bound before: its spec is its last accepted one (same generation)."""
    return _edited(tb, tb.spec.wire(), generation=1)


def test_lowered_class_limits_clamp_an_admitted_binding_and_deny_a_new_one(
    make_tc: Any, make_tb: Any
) -> None:
    asked = {"requestsPerMinute": 6000, "maxKVBlocks": 200, "guaranteedKVBlocks": 100}
    lowered = make_tc(
        quotas={
            "defaults": {"requestsPerMinute": 60},
            "limits": {"requestsPerMinute": 600, "maxKVBlocks": 80},
        }
    )
    classes = {"gold": R.ClassState(lowered, (KEY,))}
    old = _admitted(make_tb("old", "old", quotas=asked))
    new = make_tb("new", "new", quotas=asked, created="2026-01-02T00:00:00Z")
    lookups = keys(("team-a/old", "k-old"), ("team-a/new", "k-new"))
    out = R.decide(classes, [old, new], NS, lookups, OPTS)
    d = out.decisions["team-a/old"]
    # Still Bound, its spec still the one in force (nothing refused), served within the class's limits.
    assert d.bound and not d.denied and d.reason == C.REASON_BOUND and d.refused is None
    assert d.served_spec == old.spec  # the tenant's own spec stays the accepted one: a raise restores it
    assert d.clamped == (
        "quotas lowered to the limits: requestsPerMinute 6000 -> 600, maxKVBlocks 200 -> 80",
        "guaranteedKVBlocks 100 -> 80 (the effective maxKVBlocks)",
    )
    route = out.table.tenants["old"]
    assert route.quotas.requests_per_minute == 600 and route.quotas.max_kv_blocks == 80
    q = out.tenant_quotas["gold"]["old"]
    assert (q.max_kv_blocks, q.guaranteed_kv_blocks) == (80, 80)
    assert d.quotas == q
    # A binding never admitted has nothing to keep: the same spec, above the limits, is Denied.
    n = out.decisions["team-a/new"]
    assert n.denied and n.reason == C.REASON_QUOTA_EXCEEDS_LIMIT and "new" not in out.table.tenants

    # The class raises its limits again: served as specified, nothing clamped.
    raised = make_tc(quotas={"limits": {"requestsPerMinute": 60000}})
    out = R.decide({"gold": R.ClassState(raised, (KEY,))}, [old], NS, lookups, OPTS)
    d = out.decisions["team-a/old"]
    assert d.bound and d.clamped == () and out.table.tenants["old"].quotas.requests_per_minute == 6000

    # An edit refused meanwhile: the accepted spec is served, clamped, and the refusal told too.
    pending = _edited(make_tb("old", "old", quotas={"requestsPerMinute": 9000}), old.spec.wire())
    out = R.decide(classes, [pending], NS, lookups, OPTS)
    d = out.decisions["team-a/old"]
    assert d.bound and d.refused is not None and d.refused.reason == C.REASON_QUOTA_EXCEEDS_LIMIT
    assert d.served_spec == old.spec and d.clamped
    assert out.table.tenants["old"].quotas.requests_per_minute == 600


def test_an_adapter_removed_from_the_class_is_dropped_from_an_admitted_binding(
    make_tc: Any, make_tb: Any
) -> None:
    tc = make_tc(engine={"adapters": [{"name": "a1"}]})
    classes = {"gold": R.ClassState(tc, (KEY,))}
    old = _admitted(make_tb("old", "old", allowedAdapters=["a1", "a2"]))
    new = make_tb("new", "new", allowedAdapters=["a1", "a2"], created="2026-01-02T00:00:00Z")
    out = R.decide(classes, [old, new], NS, keys(("team-a/old", "k-old"), ("team-a/new", "k-new")), OPTS)
    d = out.decisions["team-a/old"]
    assert d.bound and d.refused is None and d.clamped == ("adapters ['a2'] dropped (no longer served)",)
    assert out.table.tenants["old"].allowed_adapters == ["a1"]
    assert out.table.trust_classes["gold"].adapters == ["a1"]
    n = out.decisions["team-a/new"]
    assert n.denied and n.reason == C.REASON_ADAPTER_NOT_IN_CLASS


def test_a_shrunk_block_budget_reduces_the_newest_guarantees_first(make_tc: Any, make_tb: Any) -> None:
    tc = make_tc(engine={"numBlocks": 512})
    classes = {"gold": R.ClassState(tc, (KEY,))}
    g = {"guaranteedKVBlocks": 300, "maxKVBlocks": 400}
    bs = [
        _admitted(make_tb("first", "first", quotas=g, created="2026-01-01T00:00:00Z")),
        # in another tenant's namespace: its message must not name the older bindings
        _admitted(make_tb("second", "second", namespace="team-b", quotas=g, created="2026-01-02T00:00:00Z")),
        _admitted(make_tb("third", "third", quotas=g, created="2026-01-03T00:00:00Z")),
        make_tb("newcomer", "newcomer", quotas={"guaranteedKVBlocks": 1}, created="2026-01-04T00:00:00Z"),
    ]
    lookups = keys(
        ("team-a/first", "k-1"), ("team-b/second", "k-2"), ("team-a/third", "k-3"), ("team-a/newcomer", "k-4")
    )
    for order in (bs, list(reversed(bs))):
        out = R.decide(classes, order, NS, lookups, OPTS)
        d = out.decisions
        assert all(d[k].bound for k in ("team-a/first", "team-b/second", "team-a/third"))
        # The oldest keeps its guarantee; the next gets what is left; the next nothing (still served).
        got = {t: q.guaranteed_kv_blocks for t, q in out.tenant_quotas["gold"].items()}
        assert got == {"first": 300, "second": 212, "third": 0}
        assert d["team-a/first"].clamped == ()
        assert d["team-b/second"].clamped == (
            "guaranteedKVBlocks 300 -> 212 (what is left of the 512 blocks, 300 guaranteed to older "
            "bindings)",
        )
        assert "team-a" not in d["team-b/second"].clamped[0] and "first" not in d["team-b/second"].clamped[0]
        assert d["team-a/third"].clamped[0].startswith("guaranteedKVBlocks 300 -> 0 ")
        # A binding never admitted is not given a guarantee the pool no longer has.
        assert d["team-a/newcomer"].denied and d["team-a/newcomer"].reason == R.REASON_KV_OVERCOMMITTED
        assert sum(q.guaranteed_kv_blocks or 0 for q in out.tenant_quotas["gold"].values()) <= 512
        # The engine config the operator renders from it validates (its guarantees fit the pool).
        builders.engine_config(tc, out.tenant_quotas["gold"])


def test_a_revocation_still_revokes_a_binding_its_class_would_clamp(make_tc: Any, make_tb: Any) -> None:
    tc = make_tc(quotas={"limits": {"requestsPerMinute": 600}})
    tb = _admitted(make_tb("acme", "acme", quotas={"requestsPerMinute": 6000}))
    lookups = keys(("team-a/acme", "secret-1"))
    cases: list[tuple[dict[str, R.ClassState], dict[str, Any], dict[str, R.KeyLookup], str]] = [
        ({"gold": R.ClassState(tc, (KEY,))}, {"team-a": {}}, lookups, C.REASON_NAMESPACE_NOT_ADMITTED),
        ({}, NS, lookups, C.REASON_TRUST_CLASS_NOT_FOUND),
        ({"gold": R.ClassState(tc, (KEY,), deleting=True)}, NS, lookups, C.REASON_TRUST_CLASS_NOT_FOUND),
        # the keys removed: denied for that (not for what the class would have clamped)
        (
            {"gold": R.ClassState(tc, (KEY,))},
            NS,
            {"team-a/acme": R.KeyLookup()},
            C.REASON_NO_API_KEYS,
        ),
    ]
    for classes, ns, lk, reason in cases:
        out = R.decide(classes, [tb], ns, lk, OPTS)
        d = out.decisions["team-a/acme"]
        assert d.denied and not d.bound and d.reason == reason, reason
        assert "acme" not in out.table.tenants, reason


def test_a_binding_served_before_keeps_its_guarantee_and_id_ahead_of_an_older_one_never_admitted(
    make_tc: Any, make_tb: Any
) -> None:
    # An older binding that was never admitted (its Secret appears only now) comes second: it neither
    # takes the guarantee a bound tenant holds nor its tenant id.
    tc = make_tc(engine={"numBlocks": 512})
    classes = {"gold": R.ClassState(tc, (KEY,))}
    g = {"guaranteedKVBlocks": 300}
    late = make_tb("late", "late", quotas=g, created="2026-01-01T00:00:00Z")
    bound = _admitted(make_tb("bound", "bound", quotas=g, created="2026-01-02T00:00:00Z"))
    twin = make_tb("twin", "bound", namespace="team-b", created="2026-01-01T00:00:00Z")
    lookups = keys(("team-a/late", "k-late"), ("team-a/bound", "k-bound"), ("team-b/twin", "k-twin"))
    for order in ([late, bound, twin], [twin, bound, late]):
        out = R.decide(classes, order, NS, lookups, OPTS)
        d = out.decisions
        assert d["team-a/bound"].bound and d["team-a/bound"].clamped == ()
        assert out.tenant_quotas["gold"]["bound"].guaranteed_kv_blocks == 300
        assert d["team-a/late"].denied and d["team-a/late"].reason == R.REASON_KV_OVERCOMMITTED
        assert d["team-b/twin"].denied and d["team-b/twin"].reason == C.REASON_DUPLICATE_TENANT_ID
        assert out.table.tenants["bound"].binding == "team-a/bound"


def test_bindings_asking_the_same_quotas_share_one_object_and_keep_their_own_clamps(
    make_tc: Any, make_tb: Any
) -> None:
    """10,000 bindings asking the same quotas hold one effective quota object per class (memory), and a
    binding's clamp is still its own: the same quotas in two classes with other limits are decided
    per class."""
    gold = make_tc(quotas={"defaults": {"requestsPerMinute": 60}, "limits": {"requestsPerMinute": 600}})
    silver = make_tc(
        "silver", quotas={"defaults": {"requestsPerMinute": 60}, "limits": {"requestsPerMinute": 100}}
    )
    classes = {"gold": R.ClassState(gold, (KEY,)), "silver": R.ClassState(silver, (KEY,))}
    bindings = [make_tb(f"g{i}", f"g{i}", quotas={"requestsPerMinute": 300}) for i in range(3)]
    bindings += [make_tb(f"d{i}", f"d{i}") for i in range(2)]
    admitted = _admitted(make_tb("s0", "s0", trust_class="silver", quotas={"requestsPerMinute": 300}))
    bindings.append(admitted)
    lookups = keys(*[(b.key, f"k-{b.key}") for b in bindings])
    out = R.decide(classes, bindings, {**NS, "team-a": {"kvfence.dev/tenants": "gold"}}, lookups, OPTS)
    g = [out.decisions[f"team-a/g{i}"] for i in range(3)]
    assert all(d.bound and d.clamped == () for d in g)
    assert g[0].quotas is g[1].quotas is g[2].quotas and g[0].quotas.requests_per_minute == 300
    assert out.table.tenants["g0"].quotas is out.table.tenants["g1"].quotas
    d = [out.decisions[f"team-a/d{i}"] for i in range(2)]
    assert d[0].quotas is d[1].quotas and d[0].quotas.requests_per_minute == 60
    s = out.decisions["team-a/s0"]
    assert s.bound and s.quotas.requests_per_minute == 100
    assert s.clamped == ("quotas lowered to the limits: requestsPerMinute 300 -> 100",)


def test_a_class_request_limits_reach_the_routing_table_and_the_router(make_tc: Any, make_tb: Any) -> None:
    from kvfence.router.table import compile_table

    classes = {
        "gold": R.ClassState(make_tc(requestLimits={"maxN": 4, "maxPromptsPerRequest": 300}), (KEY,)),
        "plain": R.ClassState(make_tc("plain"), (KEY,)),
    }
    out = R.decide(classes, [make_tb("acme", "acme")], NS, keys(("team-a/acme", "s")), OPTS)
    gold, plain = out.table.trust_classes["gold"], out.table.trust_classes["plain"]
    assert gold.request_limits is not None and gold.request_limits.max_n == 4
    assert gold.request_limits.max_prompts_per_request == 300
    assert gold.request_limits.max_stop_sequences == RequestLimits().max_stop_sequences  # unset: default
    stored = json.loads(encode_table(out.table))  # what the Secret holds: nothing for a class that sets none
    assert plain.request_limits is None and "requestLimits" not in stored["trustClasses"]["plain"]
    compiled = compile_table(RoutingTable.model_validate_json(R.table_json(out.table)))
    assert compiled.classes["gold"].request_limits.max_n == 4
    assert compiled.classes["plain"].request_limits == RequestLimits()


def test_weights_come_from_the_binding_or_the_class_default_and_reach_the_engine_config(
    make_tc: Any, make_tb: Any
) -> None:
    tc = make_tc(quotas={"defaults": {"weight": 2}, "limits": {"weight": 4}})
    classes = {"gold": R.ClassState(tc, (KEY,))}
    tbs = [
        make_tb("heavy", "heavy", quotas={"weight": 4}),
        make_tb("plain", "plain"),
        make_tb("greedy", "greedy", quotas={"weight": 5}),
    ]
    lookups = keys(("team-a/heavy", "k1"), ("team-a/plain", "k2"), ("team-a/greedy", "k3"))
    out = R.decide(classes, tbs, NS, lookups, OPTS)
    assert out.decisions["team-a/heavy"].quotas is not None
    assert out.decisions["team-a/heavy"].quotas.weight == 4
    assert out.decisions["team-a/plain"].quotas is not None
    assert out.decisions["team-a/plain"].quotas.weight == 2
    greedy = out.decisions["team-a/greedy"]
    assert greedy.denied and greedy.reason == C.REASON_QUOTA_EXCEEDS_LIMIT and "weight" in greedy.message
    # Only a tenant whose weight differs from the class default is listed; the default carries the rest.
    assert set(out.tenant_quotas["gold"]) == {"heavy"}
    cfg = EngineConfig.model_validate(builders.engine_config(tc, out.tenant_quotas["gold"]))
    assert cfg.quotas.default.weight == 2
    assert cfg.quotas.tenants["heavy"].weight == 4
    assert cfg.quotas.weights() == {"heavy": 4}
    bare = EngineConfig.model_validate(builders.engine_config(make_tc()))
    assert bare.quotas.default.weight == 1
    assert "weight" not in builders.engine_config(make_tc())["quotas"]["default"]


def test_the_routing_table_carries_each_tenants_weight_and_leaves_out_a_weight_of_one(
    make_tc: Any, make_tb: Any
) -> None:
    tc = make_tc(quotas={"limits": {"weight": 8}})
    classes = {"gold": R.ClassState(tc, (KEY,))}
    tbs = [
        make_tb("heavy", "heavy", quotas={"weight": 4}),
        make_tb("one", "one", quotas={"weight": 1}),
        make_tb("plain", "plain"),
    ]
    lookups = keys(("team-a/heavy", "k1"), ("team-a/one", "k2"), ("team-a/plain", "k3"))
    out = R.decide(classes, tbs, NS, lookups, OPTS)
    assert out.table.tenants["heavy"].quotas.weight == 4
    assert out.table.tenants["one"].quotas.weight is None
    assert out.table.tenants["plain"].quotas.weight is None
    raw = encode_table(out.table)
    assert raw.count(b'"weight"') == 1 and b'"weight":4' in raw
