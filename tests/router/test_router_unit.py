"""Unit tests of the router's pure pieces: table compilation, auth, quotas, body/header building."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router.support import GOLD_KEY, KEYS, SILVER_KEY, auth, standard_table, write_table
from support.ports import free_port

from kvfence.contract import (
    CLIENT_FORBIDDEN_HEADERS,
    HEADER_NONCE,
    HEADER_PREFIX,
    HEADER_SIGNATURE,
    HEADER_TENANT,
    CacheScope,
    Verifier,
    cache_namespace,
    derive_cache_salt,
    strip_client_headers,
)
from kvfence.contract.routing import Quotas, RequestLimits, RoutingTable, encode_table, hash_api_key
from kvfence.router.auth import AuthError, authenticate
from kvfence.router.endpoints import ClassEndpoints, Endpoint
from kvfence.router.metrics import RouterMetrics
from kvfence.router.proxy import (
    FORWARD_HEADERS,
    RECOVERY_PROBE_INTERVAL,
    Proxy,
    ProxyConfig,
    _UsageScanner,
    build_body,
    build_head,
    forwarded_headers,
)
from kvfence.router.quotas import QuotaManager, Rejection, Reservation
from kvfence.router.server import RouterError, config_from_args, parse_args, parse_body, reserve_tokens
from kvfence.router.surface import check_request
from kvfence.router.table import ClassPlan, TableError, TableWatcher, compile_table, parse_table


def _table(**overrides: object) -> bytes:
    return json.dumps(standard_table("http://gold:8000", "http://silver:8000", **overrides)).encode()


def test_compile_precomputes_identity_salt_and_models() -> None:
    t = parse_table(_table())
    alice = t.tenants["alice"]
    ns = cache_namespace("gold", "alice", CacheScope.TENANT)
    assert alice.identity.namespace == ns
    assert alice.cache_salt == derive_cache_salt(GOLD_KEY, "gold", ns)
    # the first key signs; adapters are those allowed AND served
    assert alice.trust_class.signing_key == GOLD_KEY
    assert alice.allowed_models == {"tiny", "support-bot"}
    assert [m["id"] for m in json.loads(alice.models_body)["data"]] == ["tiny", "support-bot"]
    # no allowedAdapters: base models only
    assert t.tenants["bob"].allowed_models == {"tiny"}
    # TrustClass scope: tenants of the class share one namespace and salt
    assert t.tenants["carol"].cache_salt == t.tenants["grace"].cache_salt
    assert t.tenants["carol"].cache_salt == derive_cache_salt(SILVER_KEY, "silver", "class/silver")
    assert t.tenants["alice"].cache_salt != t.tenants["bob"].cache_salt


def test_compile_drops_unsafe_entries_with_warnings() -> None:
    raw = standard_table("http://gold:8000", "http://silver:8000")
    raw["tenants"]["mallory"] = {"trustClass": "nope", "apiKeyHashes": [hash_api_key("m")]}
    raw["tenants"]["bob"]["apiKeyHashes"].append(hash_api_key(KEYS["alice"]))  # shared with alice
    raw["tenants"]["bob"]["apiKeyHashes"].append("md5:abc")
    raw["trustClasses"]["broken"] = {"endpoint": "ftp://x", "servedModels": ["m"], "signingKeys": ["AAAA"]}
    t = parse_table(json.dumps(raw).encode())
    assert "mallory" not in t.tenants and "broken" not in t.classes
    with pytest.raises(AuthError):
        authenticate(t, f"Bearer {KEYS['alice']}")  # ambiguous key authenticates nobody
    assert authenticate(t, f"Bearer {KEYS['alice2']}").name == "alice"
    assert len(t.warnings) >= 4


def test_invalid_table_is_refused() -> None:
    with pytest.raises(TableError):
        parse_table(b"{not json")
    with pytest.raises(TableError):
        parse_table(json.dumps({"tenants": {"x": {"trustClass": 3}}}).encode())


def test_auth() -> None:
    t = parse_table(_table())
    assert authenticate(t, auth(KEYS["alice"])["Authorization"]).name == "alice"
    assert authenticate(t, f"bearer {KEYS['carol']}").name == "carol"
    for header in (None, "", "Basic abc", "Bearer ", f"Bearer {KEYS['alice']}x", "Bearer " + "a" * 600):
        with pytest.raises(AuthError):
            authenticate(t, header)


def test_watcher_reload_keeps_old_table_on_error(tmp_path: Path) -> None:
    path = tmp_path / "routing.json"
    table = standard_table("http://gold:8000", "http://silver:8000")
    write_table(path, table)
    seen: list[str] = []
    w = TableWatcher(str(path), on_result=seen.append)
    assert w.check() and w.loaded
    first = w.table
    assert not w.check()  # unchanged
    path.write_text("{broken")
    assert not w.check()
    assert w.table is first and seen == ["loaded", "invalid"]
    del table["tenants"]["bob"]
    write_table(path, table)
    assert w.check()
    assert "bob" not in w.table.tenants


def test_watcher_follows_symlink_swap(tmp_path: Path) -> None:
    """Kubernetes updates a Secret mount by re-pointing a ``..data`` symlink."""
    table = standard_table("http://gold:8000", "http://silver:8000")
    (tmp_path / "v1").mkdir()
    write_table(tmp_path / "v1" / "routing.json", table)
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "routing.json").symlink_to("..data/routing.json")
    w = TableWatcher(str(tmp_path / "routing.json"))
    assert w.check()
    del table["tenants"]["alice"]
    (tmp_path / "v2").mkdir()
    write_table(tmp_path / "v2" / "routing.json", table)
    (tmp_path / "..data_tmp").symlink_to("v2")
    (tmp_path / "..data_tmp").replace(tmp_path / "..data")
    assert w.check()
    assert "alice" not in w.table.tenants


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_quota_concurrency_and_rpm() -> None:
    clock = Clock()
    q = QuotaManager(clock=clock)
    quotas = Quotas(maxConcurrentRequests=2, requestsPerMinute=3)
    q.sync([("t", quotas)])
    a = q.acquire("t", quotas, 10)
    b = q.acquire("t", quotas, 10)
    c = q.acquire("t", quotas, 10)
    assert isinstance(a, Reservation) and isinstance(b, Reservation)
    assert isinstance(c, Rejection) and c.quota == "concurrency" and c.retry_after == 1
    q.release(a, None)
    d = q.acquire("t", quotas, 10)
    assert isinstance(d, Reservation)
    q.release(b, None)
    q.release(d, None)
    e = q.acquire("t", quotas, 10)
    assert isinstance(e, Rejection) and e.quota == "requests" and e.retry_after == 20
    clock.t += 20
    assert isinstance(q.acquire("t", quotas, 10), Reservation)


def test_quota_charges_sequences() -> None:
    clock = Clock()
    q = QuotaManager(clock=clock)
    quotas = Quotas(maxConcurrentRequests=1500, requestsPerMinute=2000)
    q.sync([("t", quotas)])
    big = q.acquire("t", quotas, 10, 1200)  # 300 prompts x n=4
    assert isinstance(big, Reservation)
    st = q.state("t")
    assert st is not None and st.inflight == 1200 and st.rpm is not None and st.rpm.level == 800
    over = q.acquire("t", quotas, 10, 301)  # 1501 > 1500: waiting cures it
    assert isinstance(over, Rejection) and over.quota == "concurrency" and not over.limit
    fits = q.acquire("t", quotas, 10, 300)
    assert isinstance(fits, Reservation) and st.inflight == 1500
    q.release(big, None)
    q.release(fits, None)
    assert st.inflight == 0
    # more sequences than a limit at all: final, names the limit, charges nothing
    never = q.acquire("t", quotas, 10, 1501)
    assert isinstance(never, Rejection) and never.limit == "maxConcurrentRequests"
    rpm_only = Quotas(requestsPerMinute=100)
    q.sync([("t", quotas), ("u", rpm_only)])
    never = q.acquire("u", rpm_only, 10, 101)
    assert isinstance(never, Rejection) and never.limit == "requestsPerMinute"
    u = q.state("u")
    assert u is not None and u.inflight == 0 and u.rpm is not None and u.rpm.level == 100
    # with two replicas each admits half: 60 sequences can never pass one of them
    q.set_replicas(2)
    never = q.acquire("u", rpm_only, 10, 60)
    assert isinstance(never, Rejection) and never.limit == "requestsPerMinute" and "50" in never.message


def test_quota_tokens_reserve_and_correct() -> None:
    clock = Clock()
    q = QuotaManager(clock=clock)
    quotas = Quotas(tokensPerMinute=600)
    q.sync([("t", quotas)])
    a = q.acquire("t", quotas, 500)
    assert isinstance(a, Reservation)
    r = q.acquire("t", quotas, 200)
    assert isinstance(r, Rejection) and r.quota == "tokens" and r.retry_after == 10
    q.release(a, 50)  # refund 450
    b = q.acquire("t", quotas, 200)
    assert isinstance(b, Reservation)
    q.release(b, 700)  # more than reserved: charged extra, the bucket goes into debt
    st = q.state("t")
    assert st is not None and st.tpm is not None and st.tpm.level < 0
    big = q.acquire("t", quotas, 10_000)
    assert isinstance(big, Rejection)
    clock.t += 600  # full bucket again: a request larger than the allowance gets in, capped
    big2 = q.acquire("t", quotas, 10_000)
    assert isinstance(big2, Reservation) and big2.tokens == 600


def test_quota_state_survives_sync_and_divides_by_replicas() -> None:
    clock = Clock()
    q = QuotaManager(replicas=3, clock=clock)
    quotas = Quotas(maxConcurrentRequests=7, requestsPerMinute=30)
    q.sync([("t", quotas)])
    st = q.state("t")
    assert st is not None and st.limits.concurrent == 2 and st.limits.rpm == 10
    a = q.acquire("t", quotas, 1)
    assert isinstance(a, Reservation)
    q.sync([("t", Quotas(maxConcurrentRequests=3, requestsPerMinute=30))])
    assert q.state("t") is st and st.inflight == 1 and st.limits.concurrent == 1
    assert isinstance(q.acquire("t", quotas, 1), Rejection)
    q.sync([])  # tenant removed while in flight: state kept until released
    assert q.state("t") is st
    q.release(a, None)
    q.sync([])
    assert q.state("t") is None


def test_build_body_strips_and_salts_and_signature_verifies() -> None:
    t = parse_table(_table())
    alice = t.tenants["alice"]
    body = {"model": "tiny", "prompt": "hi", "cache_salt": "evil", "extra_key": "x", "kv_transfer_params": {}}
    payload = build_body(alice, body)
    sent = json.loads(payload)
    assert sent == {"model": "tiny", "prompt": "hi", "cache_salt": alice.cache_salt}
    client = [("X-Tenant-ID", "bob"), ("X-Kvfence-Tenant", "bob"), ("User-Agent", "t"), ("Cookie", "c")]
    head = build_head(alice, "/v1/completions", strip_client_headers(client), payload)
    assert head.endswith(b"\r\n") and b"\r\n\r\n" not in head
    lines = head.decode("latin-1").split("\r\n")[:-1]
    names = [line.split(": ", 1)[0] for line in lines]
    assert len(names) == len(set(names))  # each header once
    headers = dict(line.split(": ", 1) for line in lines)
    assert headers[HEADER_TENANT] == "alice" and headers["User-Agent"] == "t"
    assert headers["Content-Type"] == "application/json"
    assert "X-Tenant-ID" not in headers and "Cookie" not in headers
    # every call signs afresh: another nonce, so that a retry is not refused as a replay
    again_lines = build_head(alice, "/v1/completions", [], payload).decode().split("\r\n")[:-1]
    again = dict(line.split(": ", 1) for line in again_lines)
    assert again[HEADER_NONCE] != headers[HEADER_NONCE]
    v = Verifier("gold", [GOLD_KEY])
    assert v.verify(again, "POST", "/v1/completions", payload).cache_salt == alice.cache_salt
    verified = v.verify(headers, "POST", "/v1/completions", payload)
    assert verified.cache_salt == alice.cache_salt
    sig = headers[HEADER_SIGNATURE]
    headers[HEADER_SIGNATURE] = sig[:-1] + ("1" if sig[-1] == "0" else "0")
    with pytest.raises(Exception, match="signature"):
        Verifier("gold", [GOLD_KEY]).verify(headers, "POST", "/v1/completions", payload)


def test_parse_body_and_reservation() -> None:
    # 1e400 overflows to infinity, which the router would re-send as Infinity (not JSON): refused too
    for bad in (
        b"",
        b"[]",
        b"nan",
        b'{"a": NaN}',
        b'{"temperature": 1e400}',
        b'{"a": -1E999}',
        b"\xff",
        b"[" * 100_000,
    ):
        with pytest.raises(RouterError) as e:
            parse_body(bad)
        assert e.value.status == 400
    assert parse_body(b'{"temperature": 0.7, "top_p": 1e-300}') == {"temperature": 0.7, "top_p": 1e-300}
    raw = b'{"model":"m","prompt":"abc","max_tokens":10,"n":2}'
    assert reserve_tokens(len(raw), *shape_of(parse_body(raw))) == len(raw) + 20
    raw = b'{"model":"m","prompt":["a","b","c"],"max_tokens":10,"n":2}'
    assert reserve_tokens(len(raw), *shape_of(parse_body(raw))) == len(raw) + 60  # 6 sequences
    chat = "/v1/chat/completions"
    assert reserve_tokens(5, *shape_of({"messages": [{}], "max_completion_tokens": 7}, chat)) == 12
    both = {"messages": [{}], "max_completion_tokens": 7, "max_tokens": 3}
    assert reserve_tokens(5, *shape_of(both, chat)) == 12
    assert reserve_tokens(5, *shape_of({"prompt": "x"})) == 104
    for bad_body in ({"max_tokens": -1}, {"max_tokens": True}, {"max_tokens": "3"}, {"n": 0}, {"n": 1000}):
        with pytest.raises(RouterError) as e:
            shape_of({"prompt": "x", **bad_body})
        assert e.value.status == 400 and e.value.param == next(iter(bad_body))


def shape_of(body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, int]:
    """(sequences, max_tokens) of ``body``."""
    sequences, max_tokens, _, _ = check_request(body, path, RequestLimits(), 99)
    return sequences, max_tokens


_JSON_TEXT = st.one_of(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    ).map(json.dumps),
    st.text(alphabet=' \t\n\r\x0c{}[]":,01eE.-+truefalsn\\u', max_size=24),
)


@settings(max_examples=400, deadline=None)
@given(lead=st.sampled_from(["", " ", "\n\t", "\r\n ", "\x0c", "\ufeff"]), doc=_JSON_TEXT,
       trail=st.sampled_from(["", " ", "\n", " \t\r\n", "x", " {}", "\x0c"]))  # fmt: skip
def test_parse_body_accepts_and_refuses_what_the_json_decoder_does(lead: str, doc: str, trail: str) -> None:
    """parse_body calls the decoder's C scanner itself (no JSONDecoder.decode frames): the same
    documents are accepted, with the same value, and the same are refused."""
    text = lead + doc + trail
    try:
        want = json.JSONDecoder(parse_constant=_refuse, parse_float=_finite).decode(text)
    except (ValueError, RecursionError):
        want = None
    try:
        got = parse_body(text.encode("utf-8", "surrogatepass"))
    except RouterError as e:
        assert e.status == 400
        assert want is None or not isinstance(want, dict), (text, want)
        return
    assert isinstance(want, dict) and got == want, (text, want, got)


def _refuse(name: str) -> object:
    raise ValueError(name)


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(text)
    return value


def test_the_forwarding_allowlist_holds_no_header_the_contract_strips() -> None:
    for name in FORWARD_HEADERS:
        assert name == name.lower()
        assert name not in CLIENT_FORBIDDEN_HEADERS and not name.startswith(HEADER_PREFIX)
        assert strip_client_headers([(name, "v")]) == [(name, "v")]


_HEADER_NAMES = st.sampled_from(
    [
        "Host", "Authorization", "Content-Type", "Content-Length", "User-Agent", "X-Request-Id",
        "traceparent", "Accept", "Cookie", "X-Tenant-ID", "x-cache-salt", "X-Kvfence-Tenant",
        "X-KVFENCE-Signature", "x-kvfence-", "X-Kvfence", "X-Forwarded-For", "x-user-id", "Tracestate",
        *sorted(CLIENT_FORBIDDEN_HEADERS),
    ]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_HEADER_NAMES, st.sampled_from(["v", "", "a b"])), max_size=8))
def test_forwarded_headers_are_the_allowlisted_survivors_of_the_strip(headers: list[tuple[str, str]]) -> None:
    """The router's fast path (set operations on the lower-case names) forwards exactly what the
    contract's strip followed by the allowlist keeps, and counts exactly what the strip removed."""
    kept = strip_client_headers(headers)
    want = [h for h in kept if h[0].lower() in FORWARD_HEADERS]
    got, stripped = forwarded_headers(headers, [k.lower() for k, _ in headers])
    assert got == want
    assert stripped == len(headers) - len(kept)


def test_usage_scanner_finds_usage_across_chunk_boundaries() -> None:
    events = [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for cut in range(1, len(stream)):
        s = _UsageScanner()
        s.feed(stream[:cut])
        s.feed(stream[cut:])
        assert s.total == 4 and s.events == 3


def test_metrics_render() -> None:
    m = RouterMetrics()
    m.requests.inc(("a", "gold", "/v1/completions", "200"))
    m.duration.observe(0.003, ("gold", "/v1/completions"))
    m.tokens.inc(('we"ird\n',), 5)
    text = m.render().decode()
    assert (
        'kvfence_router_requests_total{tenant="a",trust_class="gold",endpoint="/v1/completions",code="200"} 1'
        in text
    )
    assert (
        'kvfence_router_request_duration_seconds_bucket{trust_class="gold",'
        'endpoint="/v1/completions",le="0.005"} 1' in text
    )
    assert 'kvfence_router_tokens_total{tenant="we\\"ird\\n"} 5' in text
    assert "# TYPE kvfence_router_request_duration_seconds histogram" in text


def test_metrics_of_several_workers_merge() -> None:
    """--workers: counters and histograms add up; gauges of what each worker holds add up, gauges of
    a state each worker observes keep the worst (min) or the widest (max) view; the live registry is
    left alone."""
    a, b = RouterMetrics(), RouterMetrics()
    a.requests.inc(("t", "gold", "/v1/completions", "200"), 2)
    b.requests.inc(("t", "gold", "/v1/completions", "200"), 3)
    b.requests.inc(("u", "gold", "/v1/completions", "429"))
    a.duration.observe(0.003, ("gold", "/v1/completions"))
    b.duration.observe(0.003, ("gold", "/v1/completions"))
    b.duration.observe(7.0, ("gold", "/v1/completions"))
    a.inflight.set(2, ("gold",))
    b.inflight.set(1, ("gold",))
    a.engine_healthy.set(1, ("gold",))
    b.engine_healthy.set(0, ("gold",))
    a.router_replicas.set(2)
    b.router_replicas.set(3)
    b.table_generation.set(4)
    a.table_generation.set(5)
    snap = json.loads(json.dumps(b.snapshot()))  # what crosses the socket
    text = a.merged([snap]).render().decode()
    assert 'tenant="t",trust_class="gold",endpoint="/v1/completions",code="200"} 5' in text
    assert 'tenant="u",trust_class="gold",endpoint="/v1/completions",code="429"} 1' in text
    assert (
        'kvfence_router_request_duration_seconds_count{trust_class="gold",endpoint="/v1/completions"} 3'
        in text
    )
    assert 'endpoint="/v1/completions",le="0.005"} 2' in text
    assert 'kvfence_router_inflight_requests{trust_class="gold"} 3' in text
    assert 'kvfence_router_engine_healthy{trust_class="gold"} 0' in text
    assert "kvfence_router_replicas 3" in text
    assert "kvfence_router_routing_table_generation 4" in text
    # The live registry is unchanged by a scrape.
    assert a.requests.get(("t", "gold", "/v1/completions", "200")) == 2
    assert a.inflight.get(("gold",)) == 2


def test_metrics_merge_refuses_what_it_cannot_read() -> None:
    a = RouterMetrics()
    with pytest.raises(ValueError, match="unknown here"):
        a.merged([{"kvfence_router_made_up_total": [[[], 1]]}])
    with pytest.raises(ValueError, match="buckets"):
        a.merged([{"kvfence_router_request_duration_seconds": [[["gold", "/v1/completions"], [1, 2], 0.5]]}])


def test_compile_is_pure_function_of_table() -> None:
    from kvfence.contract.routing import RoutingTable

    raw = _table()
    a = compile_table(RoutingTable.model_validate_json(raw))
    b = compile_table(RoutingTable.model_validate_json(raw))
    assert a.tenants == b.tenants


def test_reads_the_table_as_the_operator_renders_it() -> None:
    """The operator writes ``table_json(RoutingTable)`` into the Secret; the router must read it."""
    from kvfence.contract.routing import RoutingTable
    from kvfence.operator.bindings import table_json

    model = RoutingTable.model_validate(standard_table("http://gold:8000", "http://silver:8000"))
    compiled = parse_table(table_json(model).encode())
    assert set(compiled.tenants) == set(model.tenants)
    assert authenticate(compiled, f"Bearer {KEYS['carol']}").identity.namespace == "class/silver"


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["acquire", "release", "tick", "reload"]),
            st.integers(0, 700),  # tokens / used tokens / seconds*10 / new limit seed
        ),
        max_size=80,
    ),
    concurrent=st.integers(1, 4),
    rpm=st.integers(1, 10),
    tpm=st.integers(50, 800),
    replicas=st.integers(1, 3),
)
@settings(max_examples=300, deadline=None)
def test_quota_invariants(
    ops: list[tuple[str, int]], concurrent: int, rpm: int, tpm: int, replicas: int
) -> None:
    """Whatever the sequence: in-flight never exceeds the (per-replica) limit nor goes negative, a
    refusal changes nothing, buckets never exceed their capacity, and the number of admissions in any
    run without time passing is bounded by the request bucket."""
    clock = Clock()
    q = QuotaManager(replicas=replicas, clock=clock)
    quotas = Quotas(maxConcurrentRequests=concurrent, requestsPerMinute=rpm, tokensPerMinute=tpm)
    q.sync([("t", quotas)])
    held: list[Reservation] = []
    admitted_since_tick = 0
    for op, n in ops:
        st_ = q.state("t")
        assert st_ is not None
        if op == "acquire":
            before = (st_.inflight, st_.rpm.level if st_.rpm else None, st_.tpm.level if st_.tpm else None)
            got = q.acquire("t", quotas, n)
            if isinstance(got, Rejection):
                assert got.retry_after >= 1
                # nothing was taken (levels may only have risen: the refill for elapsed time)
                assert st_.inflight == before[0]
                assert st_.rpm is not None and before[1] is not None and st_.rpm.level >= before[1]
                assert st_.tpm is not None and before[2] is not None and st_.tpm.level >= before[2]
            else:
                held.append(got)
                admitted_since_tick += 1
        elif op == "release" and held:
            q.release(held.pop(n % len(held)), n if n % 3 else None)
        elif op == "tick":
            clock.t += n / 10
            admitted_since_tick = 0
        elif op == "reload":
            quotas = Quotas(
                maxConcurrentRequests=1 + n % 4, requestsPerMinute=1 + n % 10, tokensPerMinute=50 + n
            )
            q.sync([("t", quotas)])
        lim = st_.limits
        assert 0 <= st_.inflight == len(held)
        assert lim.concurrent is not None and lim.rpm is not None
        # in-flight may exceed a limit only if a reload lowered it below what was already running
        if op == "acquire":
            assert st_.inflight <= max(lim.concurrent, 1) or isinstance(got, Rejection)
        for bucket in (st_.rpm, st_.tpm):
            assert bucket is not None and bucket.level <= bucket.capacity + 1e-9
        assert admitted_since_tick <= max(lim.rpm, 1) + rpm  # a burst is bounded by the bucket(s)


def _proxy_with(cls: ClassPlan, config: ProxyConfig) -> tuple[Proxy, ClassEndpoints, Endpoint]:
    proxy = Proxy(RouterMetrics(), config)
    proxy.sync({cls.name: cls})
    ce = proxy.classes[cls.name]
    return proxy, ce, next(iter(ce.members.values()))


def test_probe_needs_two_failures_in_a_row() -> None:
    async def run() -> None:
        cls = parse_table(_table()).classes["gold"]
        cls = dataclasses.replace(cls, endpoint=f"http://127.0.0.1:{free_port()}")
        proxy, ce, ep = _proxy_with(cls, ProxyConfig(health_timeout=0.5))
        try:
            assert await proxy.probe(ce, ep) is True  # one failure: still healthy
            assert ce.serving == [ep]
            assert await proxy.probe(ce, ep) is False
            assert ce.serving == []  # off the ring
            with pytest.raises(RouterError) as e:
                proxy.check_available(cls)
            assert e.value.status == 503
        finally:
            await proxy.close()

    asyncio.run(run())


def test_probes_are_scheduled_faster_while_an_engine_is_suspect() -> None:
    """Healthy engines every health_interval; a new endpoint at once; one that failed its last probe,
    or is unhealthy, every RECOVERY_PROBE_INTERVAL, so that it serves again soon after it is back."""

    async def run() -> None:
        cls = parse_table(_table()).classes["gold"]
        cls = dataclasses.replace(cls, endpoint=f"http://127.0.0.1:{free_port()}")  # nobody listens
        proxy, _, st = _proxy_with(cls, ProxyConfig(health_interval=60.0, health_timeout=0.5))
        try:
            await proxy.probe_all()  # new: probed at once
            assert st.failures == 1 and st.healthy
            first = st.last_probe
            await proxy.probe_all()  # suspect, but probed less than RECOVERY_PROBE_INTERVAL ago
            assert st.last_probe == first
            st.last_probe -= RECOVERY_PROBE_INTERVAL
            await proxy.probe_all()  # suspect and due: probed again, long before health_interval
            assert st.failures == 2 and not st.healthy
            st.failures, st.healthy = 0, True  # healthy again: back to health_interval
            st.last_probe -= RECOVERY_PROBE_INTERVAL
            before = st.last_probe
            await proxy.probe_all()
            assert st.last_probe == before
        finally:
            await proxy.close()

    asyncio.run(run())


def test_large_tables_arrive_gzipped_as_the_operator_writes_them() -> None:
    """The operator gzips tables over COMPRESS_ABOVE_BYTES (a Secret holds 1 MiB); the router reads both."""
    raw = standard_table("http://gold:8000", "http://silver:8000")
    for i in range(6000):
        raw["tenants"][f"t{i:05d}"] = {"trustClass": "gold", "apiKeyHashes": [hash_api_key(f"key-{i}")]}
    stored = encode_table(RoutingTable.model_validate(raw))
    assert stored[:2] == b"\x1f\x8b"  # really compressed at this size
    t = parse_table(stored)
    assert "t05999" in t.tenants and "alice" in t.tenants
    assert authenticate(t, "Bearer key-17").name == "t00017"
    with pytest.raises(TableError):
        parse_table(stored[:-40])  # truncated gzip: refused, the old table stays in force


def test_cli_flags_reach_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "--routing-secret kvfence-system/kvfence-routing --keepalive-timeout 620 --request-timeout 5"
    args = parse_args([*argv.split(), "--access-log", "--kubeconfig", "/k"])
    cfg = config_from_args(args)
    assert cfg.routing_secret == "kvfence-system/kvfence-routing" and cfg.routing_table == ""
    assert cfg.keepalive_timeout == 620 and cfg.request_timeout == 5 and cfg.access_log
    assert cfg.kubeconfig == "/k" and cfg.routing_secret_key == "routing.json"
    for bad in ([], ["--routing-table", "f", "--routing-secret", "a/b"], ["--routing-secret", "no-slash"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert "--routing-secret" in capsys.readouterr().err


# --- the shared quota store of --workers (one process here; tests/router/test_router_workers.py
# runs real forked workers) -------------------------------------------------------------------------
def test_quota_managers_sharing_a_store_enforce_one_limit() -> None:
    from kvfence.router.quota_store import SharedQuotaStore

    clock = Clock()
    store = SharedQuotaStore(slots=8)
    w1, w2 = QuotaManager(clock=clock, store=store), QuotaManager(clock=clock, store=store)
    quotas = Quotas(maxConcurrentRequests=2, requestsPerMinute=3, tokensPerMinute=600)
    w1.sync([("t", quotas)])
    w2.sync([("t", quotas)])  # finds the counters w1 made: does not refill them
    a = w1.acquire("t", quotas, 250)
    b = w2.acquire("t", quotas, 250)
    assert isinstance(a, Reservation) and isinstance(b, Reservation)
    c = w1.acquire("t", quotas, 10)
    assert isinstance(c, Rejection) and c.quota == "concurrency"
    w2.release(b, 250)
    d = w1.acquire("t", quotas, 250)  # 500 of 600 tokens are out: 250 more do not fit
    assert isinstance(d, Rejection) and d.quota == "tokens"
    w1.release(a, 0)  # refunded on the shared bucket
    e = w2.acquire("t", quotas, 250)
    assert isinstance(e, Reservation)
    w2.release(e, None)
    f = w1.acquire("t", quotas, 1)  # the 4th request of the minute, across both
    assert isinstance(f, Rejection) and f.quota == "requests"
    state1, state2 = w1.state("t"), w2.state("t")
    assert state1 is not None and state2 is not None and state1.inflight == state2.inflight == 0


def test_a_manager_joining_a_shared_store_adopts_the_levels_clamped_to_its_limits() -> None:
    from kvfence.router.quota_store import SharedQuotaStore

    clock = Clock()
    store = SharedQuotaStore(slots=8)
    w1 = QuotaManager(clock=clock, store=store)
    w1.sync([("t", Quotas(requestsPerMinute=60))])
    for _ in range(50):
        assert isinstance(w1.acquire("t", Quotas(requestsPerMinute=60), 1), Reservation)
    w2 = QuotaManager(clock=clock, store=store)
    w2.sync([("t", Quotas(requestsPerMinute=6))])  # a newer table: smaller
    st = w2.state("t")
    assert st is not None and st.rpm is not None and st.rpm.level == 6.0  # min(10 left, 6)


def test_a_full_shared_store_refuses_a_new_tenant_by_name() -> None:
    from kvfence.router.quota_store import QuotaStoreFull, SharedQuotaStore

    store = SharedQuotaStore(slots=2)
    q = QuotaManager(store=store)
    q.sync([("a", Quotas()), ("b", Quotas())])
    q.sync([("a", Quotas()), ("b", Quotas())])  # the same tenants again: their slots
    with pytest.raises(QuotaStoreFull, match="holds 2 tenants"):
        q.sync([("a", Quotas()), ("b", Quotas()), ("c", Quotas())])


def test_signer_is_rfc2104_hmac_sha256_for_every_key_length() -> None:
    """The precomputed inner/outer states give exactly hmac.new's signature (keys shorter than, equal
    to and longer than SHA-256's 64-byte block), and the router's header lines verify."""
    import hmac
    import os

    from kvfence.contract import CONTRACT_VERSION, Identity, Signer, body_digest, canonical_string, sign

    identity = Identity("alice", "gold", "tenant/gold/alice")
    for size in (1, 32, 63, 64, 65, 200):
        key = os.urandom(size)
        got = sign(key, identity, "POST", "/v1/completions", b"{}", now=1000, nonce="n0")
        canonical = canonical_string(identity, "POST", "/v1/completions", "1000", "n0", body_digest(b"{}"))
        want = hmac.new(key, canonical, "sha256").hexdigest()
        assert got[HEADER_SIGNATURE] == f"{CONTRACT_VERSION}={want}"
        signer = Signer(key, identity)
        for _ in range(2):  # the path's canonical prefix computed, then taken from the signer's cache
            lines = signer.head("POST", "/v1/chat/completions", b'{"a":1}').decode().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[:-1])
            assert set(headers) == set(got)
            verified = Verifier("gold", [key]).verify(headers, "POST", "/v1/chat/completions", b'{"a":1}')
            assert verified.identity == identity
        with pytest.raises(Exception, match="signature"):  # bound to the path and the body
            Verifier("gold", [key]).verify(headers, "POST", "/v1/completions", b'{"a":1}')
    with pytest.raises(ValueError, match="line breaks"):
        Signer(b"k" * 32, Identity("alice\r\nX-Evil: 1", "gold", "tenant/gold/alice"))
    with pytest.raises(ValueError, match="newlines"):  # a caller's nonce cannot add a canonical line
        sign(b"k" * 32, identity, "POST", "/v1/completions", b"{}", now=1000, nonce="n0\n1000")


def test_verifier_refuses_a_line_break_in_timestamp_or_nonce_even_when_signed() -> None:
    """The canonical string has one field a line: a timestamp or nonce holding a line break would
    shift the fields after it, so the verifier refuses it even when the MAC over those bytes is right
    (signed here by hand, with the key); the verified identity's salt and tag are the derived ones."""
    import hashlib
    import hmac
    import time

    from kvfence.contract import (
        CONTRACT_VERSION,
        HEADER_NONCE,
        HEADER_TIMESTAMP,
        Identity,
        SignatureError,
        canonical_string,
        derive_cache_salt,
        sign,
        tenant_tag,
    )

    key, identity = b"k" * 32, Identity("alice", "gold", "tenant/gold/alice")
    now = int(time.time())
    good = sign(key, identity, "POST", "/v1/completions", b"{}", now=now, nonce="n0")
    got = Verifier("gold", [key]).verify(good, "POST", "/v1/completions", b"{}")
    salt = derive_cache_salt(key, "gold", identity.namespace)
    assert (got.cache_salt, got.tenant_tag) == (salt, tenant_tag(key, "gold", "alice", salt))
    head = canonical_string(identity, "POST", "/v1/completions", "", "", "")[:-2]
    for ts, nonce in ((f"{now}\n", "n1"), (str(now), "n2\nx")):
        canonical = head + f"{ts}\n{nonce}\n{hashlib.sha256(b'{}').hexdigest()}".encode()
        mac = hmac.new(key, canonical, "sha256").hexdigest()
        signature = f"{CONTRACT_VERSION}={mac}"
        forged = {**good, HEADER_TIMESTAMP: ts, HEADER_NONCE: nonce, HEADER_SIGNATURE: signature}
        with pytest.raises(SignatureError, match="newlines"):
            Verifier("gold", [key]).verify(forged, "POST", "/v1/completions", b"{}")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=12), _json_values, max_size=6))
def test_the_upstream_body_encoder_writes_what_json_dumps_writes(doc: dict[str, object]) -> None:
    """The router's encoder (the C encoder built once) gives json.dumps(separators=(",", ":"))'s
    bytes: what the signature is computed over must not depend on which encoder ran."""
    from kvfence.router.proxy import _encode

    assert _encode(doc) == json.dumps(doc, separators=(",", ":"))
    assert _encode(doc).isascii()


def test_nonces_are_unique_per_request_and_per_forked_worker() -> None:
    """Nonces come from a per-process random prefix and a counter: consecutive ones differ, and a
    forked worker (``--workers``) draws its own prefix, so two workers never send the same nonce."""
    import os

    from kvfence.contract import _nonces

    first, second = _nonces.next(), _nonces.next()
    assert first != second and len(first) == len(second) == 32
    int(first, 16)  # hex, as before
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next nonce and leave at once
        os.write(w, _nonces.next().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.close(r)
    os.waitpid(pid, 0)
    parent = _nonces.next()
    assert len(child) == 32 and child[:16] != parent[:16] and child != parent
