"""The kvfence vLLM middleware, tested as ASGI middleware around a real Starlette app on a real socket.

The app stands in for vLLM's OpenAI server: it records every request that reaches it (headers and the
parsed JSON body) and answers with what it saw, so a test can prove what crossed the middleware and,
just as important, what never did. A prompt of :data:`REFUSED_PROMPT` plays the kvfence scheduler's
quota refusal: the app leaves a refusal under the request's reference and answers vLLM's generic error
(the whole path, with the real scheduler, is tests/vllm/test_vllm_server.py's).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvfence.contract import (
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_SIGNATURE_REJECTED,
    XARG_REQUEST_REF,
    XARG_TENANT,
    XARG_TENANT_TAG,
    Identity,
    cache_namespace,
    derive_cache_salt,
    sign,
    tenant_tag,
)
from kvfence.contract.engine_config import READY_PATH
from kvfence.vllm.middleware import KeySource, KeySourceError, KvfenceMiddleware
from kvfence.vllm.refusals import EngineRefusal, RefusalBox, valid_ref

TC = "gold"
KEY = bytes(range(32))
OLD_KEY = bytes(range(1, 33))
OTHER_KEY = bytes(range(64, 96))
ALICE = Identity("alice", TC, cache_namespace(TC, "alice", "Tenant"))
BOB = Identity("bob", TC, cache_namespace(TC, "bob", "Tenant"))
COMPLETIONS = "/v1/completions"
MIDDLEWARE_FLAG = "kvfence.vllm.middleware.KvfenceMiddleware"  # what the operator passes to --middleware
#: A prompt the stand-in app refuses as the kvfence scheduler refuses one over the tenant's maxKVBlocks.
REFUSED_PROMPT = "refused by the scheduler"
#: A prompt the stand-in app fails with vLLM's generic error, with no refusal left (a real engine error).
FAILED_PROMPT = "failed in the engine"
#: A prompt whose stream the stand-in app starts at once and whose first event waits for :data:`GATE`.
GATED_PROMPT = "first token when the gate opens"
GATE = threading.Event()
QUOTA = EngineRefusal(400, "max_kv_blocks_exceeded", "KV-block quota exceeded for tenant 'alice': ...")
#: vLLM's answers for a request finished with an error (vllm/entrypoints: GenerationError)
VLLM_500 = {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}


@dataclass
class Seen:
    """What reached the app behind the middleware."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, item: dict[str, Any]) -> None:
        with self.lock:
            self.requests.append(item)

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()


def make_app(seen: Seen, middleware: list[Middleware], box: RefusalBox | None = None) -> Starlette:
    async def infer(request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        if body.get("prompt") in (REFUSED_PROMPT, FAILED_PROMPT):
            if body["prompt"] == REFUSED_PROMPT:
                assert box is not None
                assert box.put(body["vllm_xargs"][XARG_REQUEST_REF], QUOTA)
            if body.get("stream"):

                async def error_events() -> Any:
                    yield f"data: {json.dumps(VLLM_500)}\n\n".encode()
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(error_events(), media_type="text/event-stream")
            return JSONResponse(VLLM_500, status_code=500)
        if body.get("prompt") == GATED_PROMPT:

            async def gated() -> Any:
                await asyncio.to_thread(GATE.wait, 10)
                yield b"data: {}\n\n"

            return StreamingResponse(gated(), media_type="text/event-stream")
        identity = request.scope.get("state", {}).get("kvfence_identity")
        item = {
            "path": request.url.path,
            "body": body,
            "raw_len": len(raw),
            "content_length": request.headers.get("content-length"),
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "tenant": identity.tenant if identity else None,
        }
        seen.add(item)
        if body.get("stream"):

            async def chunks() -> Any:
                for i in range(3):
                    yield f"data: {json.dumps({'i': i})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        return JSONResponse(
            {"cache_salt": body.get("cache_salt"), "disconnected": await request.is_disconnected()}
        )

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny"}]})

    async def anything(request: Request) -> Response:
        seen.add({"path": request.url.path, "body": await request.body()})
        return JSONResponse({"reached": True})

    routes = [
        Route(COMPLETIONS, infer, methods=["POST"]),
        Route("/v1/chat/completions", infer, methods=["POST"]),
        Route("/v1/responses", infer, methods=["POST"]),
        Route("/health", health, methods=["GET", "POST"]),
        Route("/metrics", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/embeddings", anything, methods=["POST"]),
        Route("/tokenize", anything, methods=["POST"]),
        Route("/v1/load_lora_adapter", anything, methods=["POST"]),
    ]
    return Starlette(routes=routes, middleware=middleware)


class Server:
    """uvicorn serving an ASGI app on a real socket, in a thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        cfg = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


@dataclass
class Env:
    server: Server
    seen: Seen
    registry: CollectorRegistry
    key_dir: Path
    box: RefusalBox

    def post(
        self,
        body: dict[str, Any] | bytes,
        *,
        identity: Identity | None = ALICE,
        key: bytes = KEY,
        path: str = COMPLETIONS,
        sign_path: str | None = None,
        now: float | None = None,
        extra: dict[str, str] | None = None,
        send_body: bytes | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if identity is not None:
            headers.update(sign(key, identity, "POST", sign_path or path, raw, now=now))
        headers.update(extra or {})
        return self.server.request("POST", path, send_body if send_body is not None else raw, headers)

    def rejected(self, reason: str) -> float:
        v = self.registry.get_sample_value(METRIC_SIGNATURE_REJECTED, {"reason": reason})
        return 0.0 if v is None else v


def write_keys(d: Path, current: bytes, previous: bytes | None = None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "current").write_bytes(current)
    if previous is None:
        with contextlib.suppress(FileNotFoundError):
            (d / "previous").unlink()
    else:
        (d / "previous").write_bytes(previous)


def engine_config(key_dir: Path, **fields: Any) -> dict[str, Any]:
    """An engine config as the operator mounts it (the middleware reads readiness and quotas from it)."""
    base = {
        "trustClass": TC,
        "model": {"name": "tiny", "revision": "1"},
        "numBlocks": 64,
        "maxModelLen": 256,
        "signingKeyDir": str(key_dir),
    }
    return {**base, **fields}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    key_dir = tmp_path_factory.mktemp("keys")
    write_keys(key_dir, KEY, OLD_KEY)
    seen = Seen()
    registry = CollectorRegistry()
    box = RefusalBox(tmp_path_factory.mktemp("refusals"))
    mw = Middleware(
        KvfenceMiddleware,
        keys=KeySource(TC, key_dir),
        registry=registry,
        max_body_bytes=64 * 1024,
        refusals=box,
    )
    with Server(make_app(seen, [mw], box)) as server:
        yield Env(server, seen, registry, key_dir, box)


@pytest.fixture(autouse=True)
def _clear(request: pytest.FixtureRequest) -> None:
    if "env" in request.fixturenames:
        request.getfixturevalue("env").seen.clear()


def salt(identity: Identity, key: bytes = KEY) -> str:
    return derive_cache_salt(key, identity.trust_class, identity.namespace)


# --- signed requests reach the app with the derived salt ----------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions", "/v1/responses"])
def test_signed_request_reaches_app_with_derived_salt(env: Env, path: str) -> None:
    status, _, body = env.post({"model": "tiny", "prompt": "héllo ✓", "max_tokens": 4}, path=path)
    assert status == 200, body
    assert json.loads(body)["cache_salt"] == salt(ALICE)
    (got,) = env.seen.requests
    assert got["path"] == path
    assert got["body"]["cache_salt"] == salt(ALICE)
    assert got["body"]["prompt"] == "héllo ✓"
    assert got["body"]["max_tokens"] == 4
    # Content-Length was fixed for the rewritten body, and the identity headers did not travel on.
    assert int(got["content_length"]) == got["raw_len"]
    assert not [h for h in got["headers"] if h.startswith("x-kvfence-")]
    assert got["tenant"] == "alice"
    # The verified tenant travels on to vLLM's engine core, bound to the salt by a tag its scheduler
    # checks with the same key (kvfence.vllm.scheduler), with the middleware's reference for refusals.
    xargs = dict(got["body"]["vllm_xargs"])
    assert valid_ref(xargs.pop(XARG_REQUEST_REF))
    assert xargs == {
        XARG_TENANT: "alice",
        XARG_TENANT_TAG: tenant_tag(KEY, TC, "alice", salt(ALICE)),
    }


def test_previous_key_tags_the_tenant_with_that_key(env: Env) -> None:
    assert env.post({"prompt": "x"}, key=OLD_KEY, identity=BOB)[0] == 200
    xargs = dict(env.seen.requests[0]["body"]["vllm_xargs"])
    assert valid_ref(xargs.pop(XARG_REQUEST_REF))
    assert xargs == {XARG_TENANT: "bob", XARG_TENANT_TAG: tenant_tag(OLD_KEY, TC, "bob", salt(BOB, OLD_KEY))}


def test_router_style_body_with_matching_salt_is_accepted(env: Env) -> None:
    # The router puts the derived salt in the body before it signs: that must pass unchanged.
    status, _, body = env.post({"model": "tiny", "prompt": "x", "cache_salt": salt(ALICE)})
    assert status == 200, body
    assert env.seen.requests[0]["body"]["cache_salt"] == salt(ALICE)


def test_two_tenants_get_different_salts(env: Env) -> None:
    assert env.post({"prompt": "same"}, identity=ALICE)[0] == 200
    assert env.post({"prompt": "same"}, identity=BOB)[0] == 200
    salts = [r["body"]["cache_salt"] for r in env.seen.requests]
    assert salts == [salt(ALICE), salt(BOB)]
    assert salts[0] != salts[1]


def test_previous_key_still_verifies_and_salts_with_that_key(env: Env) -> None:
    status, _, body = env.post({"prompt": "x"}, key=OLD_KEY)
    assert status == 200, body
    assert env.seen.requests[0]["body"]["cache_salt"] == salt(ALICE, OLD_KEY)


def test_chunked_body_without_content_length(env: Env) -> None:
    raw = json.dumps({"prompt": "chunked " * 100}).encode()
    headers = {"Content-Type": "application/json", **sign(KEY, ALICE, "POST", COMPLETIONS, raw)}
    conn = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=10)
    try:
        conn.putrequest("POST", COMPLETIONS)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for i in range(0, len(raw), 97):
            part = raw[i : i + 97]
            conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        conn.send(b"0\r\n\r\n")
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        resp.read()
    finally:
        conn.close()
    (got,) = env.seen.requests
    assert got["body"]["cache_salt"] == salt(ALICE)
    assert "transfer-encoding" not in got["headers"]
    assert int(got["content_length"]) == got["raw_len"]


def test_streaming_answer_passes_through(env: Env) -> None:
    status, headers, body = env.post({"prompt": "x", "stream": True})
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")


def test_every_request_gets_its_own_reference(env: Env) -> None:
    for _ in range(3):
        assert env.post({"prompt": "x"})[0] == 200
    refs = [r["body"]["vllm_xargs"][XARG_REQUEST_REF] for r in env.seen.requests]
    assert len(set(refs)) == 3 and all(valid_ref(r) for r in refs)


# --- the scheduler's refusals answered in OpenAI's shape ------------------------------------------
QUOTA_ANSWER = {
    "error": {"message": QUOTA.message, "type": "invalid_request_error", "param": None, "code": QUOTA.code}
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_scheduler_refusal_replaces_vllms_generic_error(env: Env, stream: bool) -> None:
    status, headers, body = env.post({"prompt": REFUSED_PROMPT, "stream": stream})
    assert status == 400, body
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == QUOTA_ANSWER
    assert list(env.box.directory.iterdir()) == []  # taken


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_without_a_refusal_passes_through(env: Env, stream: bool) -> None:
    status, _, body = env.post({"prompt": FAILED_PROMPT, "stream": stream})
    if stream:
        assert status == 200
        assert body == f"data: {json.dumps(VLLM_500)}\n\n".encode() + b"data: [DONE]\n\n"
    else:
        assert (status, json.loads(body)) == (500, VLLM_500)


@pytest.fixture
def quota_env(tmp_path: Path) -> Iterator[Env]:
    """The middleware with the engine config the operator mounts: alice has a KV maximum, bob none."""
    write_keys(tmp_path / "keys", KEY)
    cfg = engine_config(tmp_path / "keys", quotas={"tenants": {"alice": {"maxBlocks": 4}}})
    (tmp_path / "engine.json").write_text(json.dumps(cfg))
    seen, registry, box = Seen(), CollectorRegistry(), RefusalBox(tmp_path / "refusals")
    mw = Middleware(
        KvfenceMiddleware,
        keys=KeySource(TC, tmp_path / "keys"),
        registry=registry,
        refusals=box,
        config_path=str(tmp_path / "engine.json"),
    )
    with Server(make_app(seen, [mw], box)) as server:
        yield Env(server, seen, registry, tmp_path / "keys", box)


def _gated_stream(env: Env, identity: Identity) -> tuple[bool, bytes]:
    """Whether the answer's headers reached the client while the first event was still held back by
    the app (the gate closed), and the answer's body."""
    GATE.clear()
    raw = json.dumps({"prompt": GATED_PROMPT, "stream": True}).encode()
    headers = {"Content-Type": "application/json", **sign(KEY, identity, "POST", COMPLETIONS, raw)}
    conn = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=10)
    opener = threading.Timer(0.5, GATE.set)  # opens the gate if the headers wait for the first event
    try:
        conn.request("POST", COMPLETIONS, body=raw, headers=headers)
        opener.start()
        resp = conn.getresponse()
        before_first_event = not GATE.is_set()
        GATE.set()
        assert resp.status == 200
        return before_first_event, resp.read()
    finally:
        opener.cancel()
        GATE.set()
        conn.close()


def test_a_stream_starts_before_its_first_token_when_no_refusal_can_replace_it(quota_env: Env) -> None:
    # bob has no KV maximum: nothing the scheduler can refuse him for, and vLLM's start goes at once
    # (holding it costs the client a context switch on the first token; docs/contract.md,
    # "The tenant inside vLLM's engine core").
    assert _gated_stream(quota_env, BOB) == (True, b"data: {}\n\n")
    # alice has one: her stream's start waits for its first event, which could be her refusal.
    assert _gated_stream(quota_env, ALICE) == (False, b"data: {}\n\n")


def test_a_refusal_of_a_tenant_without_a_maximum_comes_as_the_streams_error_event(quota_env: Env) -> None:
    # A refusal for a tenant the middleware found without a maximum (one set since, or a token the
    # records cannot hold): the stream had started, so the refusal replaces vLLM's error event.
    status, _, body = quota_env.post({"prompt": REFUSED_PROMPT, "stream": True}, identity=BOB)
    assert status == 200
    assert (
        body == b"data: " + json.dumps(QUOTA_ANSWER, separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"
    )
    assert list(quota_env.box.directory.iterdir()) == []  # taken
    # alice's is held: the whole answer is the refusal, as without a config.
    status, headers, body = quota_env.post({"prompt": REFUSED_PROMPT, "stream": True}, identity=ALICE)
    assert (status, headers["content-type"], json.loads(body)) == (400, "application/json", QUOTA_ANSWER)


@pytest.mark.parametrize("identity", [ALICE, BOB])
def test_a_refused_answer_that_is_not_a_stream_is_replaced_whoever_sends_it(
    quota_env: Env, identity: Identity
) -> None:
    status, _, body = quota_env.post({"prompt": REFUSED_PROMPT}, identity=identity)
    assert (status, json.loads(body)) == (400, QUOTA_ANSWER)


def test_a_refusal_left_for_another_request_is_not_taken(env: Env) -> None:
    other = "0" * 32
    assert env.box.put(other, QUOTA)
    try:
        status, _, body = env.post({"prompt": FAILED_PROMPT})
        assert (status, json.loads(body)) == (500, VLLM_500)
        assert env.box.take(other) == QUOTA
    finally:
        env.box.take(other)


def test_refusal_box_refuses_references_that_are_not_its_own(tmp_path: Path) -> None:
    box = RefusalBox(tmp_path / "box")
    for ref in ("../escape", "A" * 32, "0" * 31, "", None):
        assert not box.put(ref, QUOTA)  # type: ignore[arg-type]
        assert box.take(ref) is None  # type: ignore[arg-type]
    assert not (tmp_path / "escape").exists() and not (tmp_path / "box").exists()


def test_refusal_box_removes_refusals_nobody_took(tmp_path: Path) -> None:
    box = RefusalBox(tmp_path)
    old, new = "1" * 32, "2" * 32
    assert box.put(old, QUOTA)
    os.utime(tmp_path / old, (time.time() - 3600, time.time() - 3600))
    assert box.put(new, QUOTA)
    assert box.take(old) is None
    assert box.take(new) == QUOTA


def test_app_sees_a_live_connection_after_the_replayed_body(env: Env) -> None:
    # vLLM polls request.is_disconnected() while it generates; after the buffered body the app must
    # get the real receive channel (not a fake disconnect, not a hang).
    status, _, body = env.post({"prompt": "x"})
    assert status == 200
    assert json.loads(body)["disconnected"] is False


# --- client-chosen salts never reach the app ----------------------------------------------------
def test_unsigned_request_with_client_salt_is_refused(env: Env) -> None:
    before = env.rejected("MissingSignature")
    status, headers, body = env.post({"prompt": "x", "cache_salt": salt(BOB)}, identity=None)
    assert status == 401
    err = json.loads(body)["error"]
    assert err["type"] == "authentication_error" and err["code"] == "missing_signature"
    assert set(err) == {"message", "type", "param", "code"}
    assert headers["content-type"] == "application/json"
    assert "www-authenticate" in headers
    assert env.seen.requests == []
    assert env.rejected("MissingSignature") == before + 1


def test_signed_body_carrying_another_tenants_salt_is_refused(env: Env) -> None:
    before = env.registry.get_sample_value(METRIC_CROSS_ACCESS_REJECTED) or 0.0
    status, _, body = env.post({"prompt": "x", "cache_salt": salt(BOB)}, identity=ALICE)
    assert status == 403
    assert json.loads(body)["error"]["type"] == "permission_error"
    assert env.seen.requests == []
    assert env.registry.get_sample_value(METRIC_CROSS_ACCESS_REJECTED) == before + 1


@pytest.mark.parametrize("field_name", ["extra_key", "kv_transfer_params", "vllm_xargs"])
def test_other_namespace_fields_are_refused(env: Env, field_name: str) -> None:
    status, _, _ = env.post({"prompt": "x", field_name: {"x": 1}})
    assert status == 403
    assert env.seen.requests == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(client_salt=st.one_of(st.none(), st.text(max_size=40)), tenant=st.sampled_from([ALICE, BOB]))
def test_property_app_only_ever_sees_the_signed_identity_salt(
    env: Env, client_salt: str | None, tenant: Identity
) -> None:
    env.seen.clear()
    body: dict[str, Any] = {"prompt": "p"}
    if client_salt is not None:
        body["cache_salt"] = client_salt
    # Signed as the tenant: accepted only when the salt is absent or already the right one.
    env.post(body, identity=tenant)
    # Unsigned: never accepted.
    env.post(body, identity=None)
    for got in env.seen.requests:
        assert got["body"]["cache_salt"] == salt(tenant)
    assert len(env.seen.requests) <= 1


# --- forged, stale, replayed ----------------------------------------------------------------------
def test_forged_signature_with_unknown_key_is_refused(env: Env) -> None:
    status, _, body = env.post({"prompt": "x"}, key=OTHER_KEY)
    assert status == 401, body
    assert env.seen.requests == []


def test_tampered_body_is_refused(env: Env) -> None:
    raw = json.dumps({"prompt": "x"}).encode()
    status, _, _ = env.post(raw, send_body=json.dumps({"prompt": "y"}).encode())
    assert status == 401
    assert env.seen.requests == []


def test_signature_for_another_path_is_refused(env: Env) -> None:
    status, _, _ = env.post({"prompt": "x"}, path="/v1/chat/completions", sign_path=COMPLETIONS)
    assert status == 401
    assert env.seen.requests == []


def test_bad_signature_header_is_refused(env: Env) -> None:
    raw = json.dumps({"prompt": "x"}).encode()
    headers = sign(KEY, ALICE, "POST", COMPLETIONS, raw)
    headers[HEADER_SIGNATURE] = "v1=" + "0" * 64
    status, _, _ = env.server.request("POST", COMPLETIONS, raw, headers)
    assert status == 401
    assert env.seen.requests == []


def test_wrong_trust_class_is_refused_as_in_the_contract(env: Env) -> None:
    silver = Identity("carol", "silver", cache_namespace("silver", "carol", "Tenant"))
    status, _, body = env.post({"prompt": "x"}, identity=silver)
    assert status == 401  # docs/contract.md: WrongTrustClass is 401 wrong_trust_class, on every engine
    err = json.loads(body)["error"]
    assert (err["type"], err["code"]) == ("authentication_error", "wrong_trust_class")
    assert env.seen.requests == []


def test_stale_signature_is_refused(env: Env) -> None:
    before = env.rejected("StaleSignature")
    status, _, _ = env.post({"prompt": "x"}, now=time.time() - 600)
    assert status == 401
    assert env.seen.requests == []
    assert env.rejected("StaleSignature") == before + 1


def test_future_signature_is_refused(env: Env) -> None:
    status, _, _ = env.post({"prompt": "x"}, now=time.time() + 600)
    assert status == 401
    assert env.seen.requests == []


def test_replayed_request_is_refused(env: Env) -> None:
    raw = json.dumps({"prompt": "x"}).encode()
    headers = {"Content-Type": "application/json", **sign(KEY, ALICE, "POST", COMPLETIONS, raw)}
    assert env.server.request("POST", COMPLETIONS, raw, headers)[0] == 200
    before = env.rejected("ReplayedSignature")
    status, _, _ = env.server.request("POST", COMPLETIONS, raw, headers)
    assert status == 401
    assert len(env.seen.requests) == 1
    assert env.rejected("ReplayedSignature") == before + 1


def test_duplicate_identity_header_is_refused(env: Env) -> None:
    raw = json.dumps({"prompt": "x"}).encode()
    headers = sign(KEY, ALICE, "POST", COMPLETIONS, raw)
    conn = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=10)
    try:
        conn.putrequest("POST", COMPLETIONS)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.putheader(HEADER_NONCE, "another-nonce")
        conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders(raw)
        assert conn.getresponse().status == 401
    finally:
        conn.close()
    assert env.seen.requests == []


def test_timestamp_is_covered_by_the_signature(env: Env) -> None:
    raw = json.dumps({"prompt": "x"}).encode()
    headers = sign(KEY, ALICE, "POST", COMPLETIONS, raw, now=time.time() - 600)
    headers[HEADER_TIMESTAMP] = str(int(time.time()))
    assert env.server.request("POST", COMPLETIONS, raw, headers)[0] == 401
    assert env.seen.requests == []


# --- refuse by default ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize", "/v1/load_lora_adapter", "/nope"])
def test_other_post_paths_are_refused_even_when_signed(env: Env, path: str) -> None:
    status, _, body = env.post({"prompt": "x"}, path=path)
    assert status == 404
    assert json.loads(body)["error"]["code"] == "not_found"
    assert env.seen.requests == []


def test_post_to_an_open_path_is_refused(env: Env) -> None:
    status, _, _ = env.server.request("POST", "/health", b"{}", {"Content-Type": "application/json"})
    assert status == 404


def test_get_on_an_inference_path_is_refused(env: Env) -> None:
    assert env.server.request("GET", COMPLETIONS)[0] == 405


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_open_paths_pass_unsigned(env: Env, path: str) -> None:
    status, _, _ = env.server.request("GET", path)
    assert status == 200


def test_readiness_waits_while_the_engine_config_waits_for_its_tenants(tmp_path: Path) -> None:
    """``/ready`` (the readiness probe the operator renders): 503 while the mounted config says
    ``tenantsPending`` (a new class's engine, started before the routing decision), vLLM's ``/health``
    once the file is rewritten without it; ``/health`` itself (liveness) is never held back."""
    cfg = engine_config(tmp_path, tenantsPending=True)
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(cfg))
    write_keys(tmp_path / "keys", KEY)
    mw = Middleware(
        KvfenceMiddleware,
        keys=KeySource(TC, tmp_path / "keys"),
        registry=CollectorRegistry(),
        refusals=RefusalBox(tmp_path / "refusals"),
        config_path=str(path),
    )
    seen = Seen()
    with Server(make_app(seen, [mw])) as server:
        for method in ("GET", "HEAD"):
            assert server.request(method, READY_PATH)[0] == 503
        assert json.loads(server.request("GET", READY_PATH)[2]) == {
            "status": "waiting for the tenants' quotas"
        }
        assert server.request("GET", "/health")[0] == 200
        del cfg["tenantsPending"]
        path.write_text(json.dumps({**cfg, "quotas": {"tenants": {"alice": {"maxBlocks": 4}}}}))
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime, whatever the clock's grain
        status, _, body = server.request("GET", READY_PATH)
        assert (status, body) == (200, b"ok")  # the stand-in app's /health


def test_query_string_is_refused(env: Env) -> None:
    raw = json.dumps({"prompt": "x"}).encode()
    headers = sign(KEY, ALICE, "POST", COMPLETIONS, raw)
    assert env.server.request("POST", COMPLETIONS + "?cache_salt=x", raw, headers)[0] == 403
    assert env.seen.requests == []


def test_non_json_body_is_a_400(env: Env) -> None:
    for raw in (b"not json", b"[1, 2]", b'"s"'):
        status, _, body = env.post(raw)
        assert status == 400, raw
        assert json.loads(body)["error"]["code"] == "invalid_json"
    assert env.seen.requests == []


def test_body_over_the_limit_is_a_413(env: Env) -> None:
    status, _, _ = env.post({"prompt": "x" * (65 * 1024)})
    assert status == 413
    assert env.seen.requests == []


# --- keys and configuration --------------------------------------------------------------------------
def test_rotated_key_files_are_picked_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfence.isolation import guard

    monkeypatch.setattr(guard, "KEY_RELOAD_INTERVAL", 0.0)
    key_dir = tmp_path / "keys"
    write_keys(key_dir, OLD_KEY)
    seen = Seen()
    mw = Middleware(KvfenceMiddleware, keys=KeySource(TC, key_dir), registry=CollectorRegistry())
    with Server(make_app(seen, [mw])) as server:
        e = Env(server, seen, CollectorRegistry(), key_dir, RefusalBox(tmp_path / "refusals"))
        assert e.post({"prompt": "x"}, key=KEY)[0] == 401
        # Rotate as the kubelet does: a new file replaces the old (new inode).
        tmp = tmp_path / "new"
        write_keys(tmp, KEY, OLD_KEY)
        os.replace(tmp / "current", key_dir / "current")
        os.replace(tmp / "previous", key_dir / "previous")
        assert e.post({"prompt": "x"}, key=KEY)[0] == 200
        assert e.post({"prompt": "x"}, key=OLD_KEY)[0] == 200
        # A broken key file keeps the last good keys instead of locking everyone out.
        (key_dir / "current").write_bytes(b"short")
        assert e.post({"prompt": "x"}, key=KEY)[0] == 200
        # Retiring the previous key refuses it.
        write_keys(key_dir, KEY)
        assert e.post({"prompt": "x"}, key=OLD_KEY)[0] == 401


def test_keys_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_keys(tmp_path, KEY)
    monkeypatch.setenv("KVFENCE_TRUST_CLASS", TC)
    monkeypatch.setenv("KVFENCE_SIGNING_KEY_DIR", str(tmp_path))
    src = KeySource.from_env()
    assert src == KeySource(TC, tmp_path)
    assert src.load() == [KEY]


def test_keys_from_the_engine_config_the_operator_mounts(tmp_path: Path) -> None:
    write_keys(tmp_path / "keys", KEY)
    cfg = {
        "trustClass": "silver",
        "model": {"name": "m", "revision": "1"},
        "numBlocks": 16,
        "maxModelLen": 64,
        "signingKeyDir": str(tmp_path / "keys"),
    }
    (tmp_path / "engine.json").write_text(json.dumps(cfg))
    src = KeySource.from_env({"KVFENCE_ENGINE_CONFIG": str(tmp_path / "engine.json")})
    assert src == KeySource("silver", tmp_path / "keys")


def test_no_keys_means_no_start(tmp_path: Path) -> None:
    with pytest.raises(KeySourceError):
        KeySource.from_env({})
    with pytest.raises(KeySourceError):
        KvfenceMiddleware(_never, keys=KeySource(TC, tmp_path / "missing"), registry=CollectorRegistry())
    (tmp_path / "current").write_bytes(b"too short")
    with pytest.raises(KeySourceError):
        KvfenceMiddleware(_never, keys=KeySource(TC, tmp_path), registry=CollectorRegistry())


async def _never(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("reached the app")


def test_loads_the_way_vllm_loads_middleware(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM resolves ``--middleware a.b.Class`` with importlib and calls ``app.add_middleware(Class)``."""
    write_keys(tmp_path, KEY)
    monkeypatch.setenv("KVFENCE_TRUST_CLASS", TC)
    monkeypatch.setenv("KVFENCE_SIGNING_KEY_DIR", str(tmp_path))
    # The scheduler's refusals are found next to the stats file both vLLM processes are told about.
    monkeypatch.setenv("KVFENCE_VLLM_STATS_FILE", str(tmp_path / "stats.json"))
    box = RefusalBox.from_env()
    assert box.directory == tmp_path / "stats.json.refusals"
    module_path, name = MIDDLEWARE_FLAG.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_path), name)
    seen = Seen()
    app = make_app(seen, [], box)
    app.add_middleware(cls)
    with Server(app) as server:
        e = Env(server, seen, CollectorRegistry(), tmp_path, box)
        assert e.post({"prompt": "x"}, identity=None)[0] == 401
        assert e.post({"prompt": "x", "cache_salt": "mine"}, identity=None)[0] == 401
        assert e.post({"prompt": "x"})[0] == 200
        status, _, body = e.post({"prompt": REFUSED_PROMPT})
        assert (status, json.loads(body)) == (400, QUOTA_ANSWER)
        assert seen.requests[0]["body"]["cache_salt"] == salt(ALICE)
        # The default registry is the one vLLM's /metrics serves.
        from prometheus_client import REGISTRY

        assert (
            REGISTRY.get_sample_value(METRIC_SIGNATURE_REJECTED, {"reason": "MissingSignature"}) or 0
        ) >= 2
