"""One engine-side guard (kvfence.isolation.guard): the reference engine and the vLLM middleware answer
every refusal of the contract identically, status, headers that matter and body byte for byte.

The same request bytes go to both: to the reference engine's HTTP server on a real socket, and to the
middleware as the ASGI application vLLM mounts it in (called directly, with a recording app behind it
that must never be reached)."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine.enginelib import InProcessServer, make_config
from prometheus_client import CollectorRegistry

from kvfence.contract import (
    HEADER_TENANT,
    Identity,
    cache_namespace,
    derive_cache_salt,
    sign,
)
from kvfence.engine.server import EngineServer
from kvfence.isolation.guard import REFUSALS, KeySource
from kvfence.vllm.middleware import KvfenceMiddleware

TC = "gold"
KEY = bytes(range(32))
OTHER_KEY = bytes(range(64, 96))
PATH = "/v1/completions"
ACME = Identity("acme", TC, cache_namespace(TC, "acme", "Tenant"))
Headers = list[tuple[str, str]]
Answer = tuple[int, bytes, bool]  # status, body, whether WWW-Authenticate was sent


def body(**extra: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}).encode()


def signed(raw: bytes, identity: Identity = ACME, key: bytes = KEY, **kw: Any) -> Headers:
    return [*sign(key, identity, "POST", PATH, raw, **kw).items(), ("Content-Type", "application/json")]


def cases() -> dict[str, tuple[str, Headers, bytes]]:
    """name -> (path and query, headers, body): each is refused for one reason."""
    ok = body()
    stale = signed(ok, now=1_000_000)
    tampered = signed(ok)
    dup = signed(ok)
    silver = Identity("carol", "silver", cache_namespace("silver", "carol", "Tenant"))
    return {
        "unsigned": (PATH, [("Content-Type", "application/json")], ok),
        "unknown_key": (PATH, signed(ok, key=OTHER_KEY), ok),
        "forged": (PATH, tampered, body(prompt="something else")),
        "stale": (PATH, stale, ok),
        "wrong_trust_class": (PATH, signed(ok, identity=silver), ok),
        "duplicate_header": (PATH, [*dup, (HEADER_TENANT, "mallory")], ok),
        "query_string": (PATH + "?cache_salt=x", signed(ok), ok),
        "malformed_json": (PATH, signed(b"{not json"), b"{not json"),
        "not_an_object": (PATH, signed(b"[1, 2]"), b"[1, 2]"),
        "forbidden_field": (PATH, signed(body(extra_key="k")), body(extra_key="k")),
        "salt_of_another_tenant": (
            PATH,
            signed(b := body(cache_salt=derive_cache_salt(KEY, TC, cache_namespace(TC, "bob", "Tenant")))),
            b,
        ),
        "null_salt": (PATH, signed(n := body(cache_salt=None)), n),
    }


EXPECTED = {
    "unsigned": "MissingSignature",
    "unknown_key": "UnknownKey",
    "forged": "BadSignature",
    "stale": "StaleSignature",
    "wrong_trust_class": "WrongTrustClass",
    "duplicate_header": "DuplicateHeader",
    "query_string": "QueryString",
    "malformed_json": "BadBody",
    "not_an_object": "BadBody",
    "forbidden_field": "ForbiddenBodyField",
    "salt_of_another_tenant": "CacheSaltMismatch",
    "null_salt": "CacheSaltMismatch",
}


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    d.mkdir()
    (d / "current").write_bytes(KEY)
    return d


@pytest.fixture
def reference(key_dir: Path) -> Iterator[InProcessServer]:
    srv = InProcessServer(EngineServer(make_config(key_dir)))
    yield srv
    srv.stop()


def ask_reference(srv: InProcessServer, target: str, headers: Headers, raw: bytes) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.putrequest("POST", target, skip_accept_encoding=True)
        for k, v in [*headers, ("Content-Length", str(len(raw)))]:
            conn.putheader(k, v)  # a duplicate is sent as it is
        conn.endheaders(raw)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("WWW-Authenticate") is not None
    finally:
        conn.close()


def ask_middleware(mw: KvfenceMiddleware, target: str, headers: Headers, raw: bytes) -> Answer:
    path, _, query = target.partition("?")
    pairs = [*headers, ("Content-Length", str(len(raw)))]
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in pairs],
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(mw(scope, receive, send))
    start, end = sent
    names = {k for k, _ in start["headers"]}
    return start["status"], end["body"], b"www-authenticate" in names


def error(answer: Answer) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(answer[1])["error"]
    return err


@pytest.fixture
def middleware(key_dir: Path) -> tuple[KvfenceMiddleware, list[Any]]:
    """The middleware in front of an app that records what reaches it and answers 200."""
    reached: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return KvfenceMiddleware(app, keys=KeySource(TC, key_dir), registry=CollectorRegistry()), reached


def test_both_engines_refuse_every_case_identically(
    reference: InProcessServer, middleware: tuple[KvfenceMiddleware, list[Any]]
) -> None:
    mw, reached = middleware
    for name, (target, headers, raw) in cases().items():
        ref = ask_reference(reference, target, headers, raw)
        edge = ask_middleware(mw, target, headers, raw)
        status, code = REFUSALS[EXPECTED[name]]
        assert (ref[0], error(ref)["code"]) == (status, code), (name, ref)
        assert ref == edge, (name, ref, edge)  # status, the body byte for byte, WWW-Authenticate
        assert ref[2] == (status == 401), name
        assert set(error(ref)) == {"message", "type", "param", "code"} and error(ref)["message"], name
    assert reached == []  # nothing refused ever got past the middleware


def test_a_replayed_request_is_refused_by_both_identically(
    reference: InProcessServer, middleware: tuple[KvfenceMiddleware, list[Any]]
) -> None:
    mw, reached = middleware
    raw = body()
    headers = signed(raw)
    assert ask_reference(reference, PATH, headers, raw)[0] == 200
    assert ask_middleware(mw, PATH, headers, raw)[0] == 200 and len(reached) == 1
    ref = ask_reference(reference, PATH, headers, raw)
    edge = ask_middleware(mw, PATH, headers, raw)
    assert (ref[0], error(ref)["code"]) == REFUSALS["ReplayedSignature"]
    assert ref == edge and len(reached) == 1


def test_every_reason_in_the_table_has_a_client_error_status_and_a_code() -> None:
    for reason, (status, code) in REFUSALS.items():
        assert 400 <= status < 500 and code and code == code.lower(), reason
    assert REFUSALS["WrongTrustClass"] == (401, "wrong_trust_class")  # docs/contract.md
