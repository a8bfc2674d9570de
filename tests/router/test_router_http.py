"""The router process in front of small real upstreams (fake_upstream.py, which verifies the contract):
HTTP API, auth, allowlists, stripping, salts, quotas, streaming, errors."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
from router.support import GOLD_KEY, KEYS, Stack, auth, request

from kvfence.contract import HEADER_NONCE, HEADER_SIGNATURE, HEADER_TENANT, derive_cache_salt


def _err(data: bytes) -> dict[str, object]:
    doc = json.loads(data)
    assert set(doc) == {"error"}
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


def test_health_ready_metrics(stack: Stack) -> None:
    assert request("GET", stack.router.url + "/healthz")[0] == 200
    status, _, data = request("GET", stack.router.url + "/readyz")
    assert status == 200 and json.loads(data)["tenants"] == 7
    status, headers, data = request("GET", stack.router.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"kvfence_router_routing_table_generation 1" in data


def test_auth_401(stack: Stack) -> None:
    body = {"model": "tiny", "prompt": "x"}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic YTpi"}):
        status, _, data = request("POST", stack.router.url + "/v1/completions", body, headers=headers)
        assert status == 401
        assert _err(data)["code"] == "invalid_api_key"
    status, _, _ = request("GET", stack.router.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401
    # Two Authorization headers (a valid key and another): ambiguous, refused rather than picking one.
    conn = http.client.HTTPConnection("127.0.0.1", stack.router.port, timeout=10)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", f"Bearer {KEYS['bob']}")
    conn.putheader("Authorization", "Bearer nope")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 401 and _err(resp.read())["code"] == "invalid_api_key"
    conn.close()


def test_models_lists_only_the_tenants_models(stack: Stack) -> None:
    def ids(key: str) -> list[str]:
        status, _, data = request("GET", stack.router.url + "/v1/models", headers=auth(key))
        assert status == 200
        doc = json.loads(data)
        assert doc["object"] == "list"
        return [m["id"] for m in doc["data"]]

    assert ids(KEYS["alice"]) == ["tiny", "support-bot"]
    assert ids(KEYS["bob"]) == ["tiny"]
    assert ids(KEYS["carol"]) == ["small"]


def test_model_and_adapter_allowlist_403(stack: Stack) -> None:
    # another class's model, an adapter not granted, an adapter granted to someone else, unknown
    for key, model in (
        (KEYS["alice"], "small"),
        (KEYS["alice"], "legal-bot"),
        (KEYS["bob"], "support-bot"),
        (KEYS["carol"], "tiny"),
        (KEYS["bob"], "gpt-4"),
    ):
        status, _, data = stack.post(key, "/v1/completions", {"model": model, "prompt": "x"})
        assert status == 403, (key, model)
        err = _err(data)
        assert err["code"] == "model_not_allowed" and err["param"] == "model"
    status, _, data = stack.post(KEYS["alice"], "/v1/completions", {"model": "support-bot", "prompt": "x"})
    assert status == 200, data


def test_completion_and_chat_forwarded_with_signed_identity(stack: Stack) -> None:
    status, headers, data = stack.post(KEYS["alice"], "/v1/completions", {"model": "tiny", "prompt": "hello"})
    assert status == 200, data
    assert headers["x-kvfence-upstream-status"] == "200"
    doc = json.loads(data)
    assert doc["kvfence_echo"] == {"tenant": "alice", "namespace": "tenant/gold/alice"}
    status, _, data = stack.post(
        KEYS["carol"],
        "/v1/chat/completions",
        {"model": "small", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200, data
    assert json.loads(data)["kvfence_echo"] == {"tenant": "carol", "namespace": "class/silver"}


def test_spoofed_salt_headers_and_identity_are_stripped(stack: Stack) -> None:
    """A client that copies bob's salt and forges identity headers still runs as alice."""
    bob_salt = derive_cache_salt(GOLD_KEY, "gold", "tenant/gold/bob")
    forged = {
        "X-Tenant-ID": "bob",
        "X-Kvfence-Tenant": "bob",
        "X-Kvfence-Cache-Namespace": "tenant/gold/bob",
        "X-Kvfence-Signature": "v1=00",
        "X-Cache-Salt": bob_salt,
        "X-Forwarded-User": "bob",
        "X-Request-Id": "spoof-1",
    }
    body = {
        "model": "tiny",
        "prompt": "spoof-probe",
        "cache_salt": bob_salt,
        "extra_key": "bob",
        "kv_transfer_params": {"x": 1},
    }
    status, _, data = stack.post(KEYS["alice"], "/v1/completions", body, headers=forged)
    assert status == 200, data
    assert json.loads(data)["kvfence_echo"]["tenant"] == "alice"
    seen = [r for r in stack.upstream_requests(stack.gold) if r["body"].get("prompt") == "spoof-probe"]
    assert len(seen) == 1
    sent = seen[0]
    assert sent["identity"] == ["alice", "tenant/gold/alice"]
    assert sent["body"]["cache_salt"] == derive_cache_salt(GOLD_KEY, "gold", "tenant/gold/alice")
    assert "extra_key" not in sent["body"] and "kv_transfer_params" not in sent["body"]
    lower = {k.lower(): v for k, v in sent["headers"].items()}
    assert "x-tenant-id" not in lower and "x-cache-salt" not in lower and "x-forwarded-user" not in lower
    assert "authorization" not in lower  # the tenant's API key never reaches the engine
    assert lower["x-kvfence-tenant"] == "alice" and lower["x-request-id"] == "spoof-1"
    _, _, metrics = request("GET", stack.router.url + "/metrics")
    assert b'kvfence_router_client_fields_stripped_total{kind="body"}' in metrics


def test_replayed_signed_request_is_refused_by_upstream(stack: Stack) -> None:
    """Someone who captured a signed router->engine request cannot replay it at the engine."""
    stack.post(KEYS["bob"], "/v1/completions", {"model": "tiny", "prompt": "replay-me"})
    captured = [r for r in stack.upstream_requests(stack.gold) if r["body"].get("prompt") == "replay-me"][-1]
    headers = {k: v for k, v in captured["headers"].items() if k.lower().startswith("x-kvfence-")}
    raw = json.dumps(captured["body"], separators=(",", ":")).encode()
    status, _, data = request("POST", stack.gold.url + "/v1/completions", raw=raw, headers=headers)
    assert status == 401 and b"Replayed" in data
    # and re-signing as bob with a fresh nonce is impossible without the key: a tampered body fails
    headers[HEADER_NONCE] = "f" * 32
    status, _, _ = request("POST", stack.gold.url + "/v1/completions", raw=raw, headers=headers)
    assert status == 401
    assert headers[HEADER_TENANT] == "bob" and headers[HEADER_SIGNATURE].startswith("v1=")


def test_bad_requests_400_413_404_405(stack: Stack) -> None:
    url = stack.router.url + "/v1/completions"
    h = auth(KEYS["bob"])
    for raw, param in (
        (b"{", None),
        (b"[1]", None),
        (b'{"prompt": "x"}', "model"),
        (b'{"model": 3}', "model"),
        (b'{"model": "tiny", "stream": "yes"}', "stream"),
        (b'{"model": "tiny", "max_tokens": -5}', "max_tokens"),
    ):
        status, _, data = request("POST", url, raw=raw, headers=h)
        assert status == 400, raw
        assert _err(data)["param"] == param
    status, _, data = request(
        "POST", url, raw=b'{"model":"tiny","prompt":"' + b"a" * (5 << 20) + b'"}', headers=h
    )
    assert status == 413 and _err(data)["code"] == "request_too_large"
    status, _, data = request("GET", stack.router.url + "/v1/nothing", headers=h)
    assert status == 404 and _err(data)["code"] == "not_found"
    status, _, data = request("GET", url, headers=h)
    assert status == 405 and _err(data)["code"] == "method_not_allowed"


def test_streaming_is_relayed_chunk_by_chunk(stack: Stack) -> None:
    """The upstream sends one event, then waits for a release that the test sends only after it has
    received that event through the router. A buffering router would deadlock here (and the test
    would time out); the concatenation must equal the non-streamed answer."""

    async def run() -> None:
        url = stack.router.url + "/v1/completions"
        body = {"model": "tiny", "prompt": "GATED stream", "max_tokens": 6}
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=body, headers=auth(KEYS["bob"])) as plain:
                assert plain.status == 200
                expected = (await plain.json())["choices"][0]["text"]
            async with s.post(url, json={**body, "stream": True}, headers=auth(KEYS["bob"])) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                buf = b""
                while b"\n\n" not in buf:
                    buf += await asyncio.wait_for(resp.content.readany(), 20)
                first = json.loads(buf.split(b"\n\n")[0][len(b"data: ") :])
                assert first["choices"][0]["text"] == expected[0]
                async with s.post(stack.gold.url + "/control/release") as r:
                    assert r.status == 200
                buf += await resp.content.read()
            texts = []
            for event in buf.split(b"\n\n"):
                if event.startswith(b"data: ") and event != b"data: [DONE]":
                    texts.append(json.loads(event[6:])["choices"][0]["text"])
            assert "".join(texts) == expected
            assert buf.rstrip().endswith(b"data: [DONE]")

    # the non-streamed GATED prompt is not gated (only streams wait)
    asyncio.run(asyncio.wait_for(run(), 60))


def test_quota_requests_per_minute_429(stack: Stack) -> None:
    codes = [
        stack.post(KEYS["dave"], "/v1/completions", {"model": "tiny", "prompt": "r"})[0] for _ in range(3)
    ]
    assert codes == [200, 200, 200]
    status, headers, data = stack.post(KEYS["dave"], "/v1/completions", {"model": "tiny", "prompt": "r"})
    assert status == 429
    assert int(headers["retry-after"]) >= 1
    err = _err(data)
    assert err["type"] == "rate_limit_error" and err["code"] == "requests_quota_exceeded"
    # another tenant is not affected
    assert stack.post(KEYS["bob"], "/v1/completions", {"model": "tiny", "prompt": "r"})[0] == 200


def test_quota_concurrency_429(stack: Stack) -> None:
    async def run() -> None:
        url = stack.router.url + "/v1/completions"
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": "GATED erin", "stream": True}
            async with s.post(url, json=body, headers=auth(KEYS["erin"])) as held:
                assert held.status == 200
                await held.content.readany()  # first event: the request is in flight
                async with s.post(
                    url, json={"model": "tiny", "prompt": "y"}, headers=auth(KEYS["erin"])
                ) as r:
                    assert r.status == 429
                    assert r.headers["Retry-After"] == "1"
                    assert (await r.json())["error"]["code"] == "concurrency_quota_exceeded"
                async with s.post(stack.gold.url + "/control/release"):
                    pass
                await held.read()
            async with s.post(url, json={"model": "tiny", "prompt": "y"}, headers=auth(KEYS["erin"])) as r:
                assert r.status == 200

    asyncio.run(asyncio.wait_for(run(), 60))


def test_quota_tokens_per_minute_reserved_then_corrected(stack: Stack) -> None:
    # frank: 600 tokens/min. A request reserves body bytes + max_tokens; the fake upstream reports
    # usage = prompt bytes + max_tokens, far less than the reservation of max_tokens=500.
    body = {"model": "tiny", "prompt": "t", "max_tokens": 500}
    status, _, data = stack.post(KEYS["frank"], "/v1/completions", body)
    assert status == 200, data
    used = json.loads(data)["usage"]["total_tokens"]
    assert used == 501
    # the correction leaves 600 - 501 = 99 tokens: a reservation above that is refused
    status, headers, data = stack.post(KEYS["frank"], "/v1/completions", {**body, "max_tokens": 150})
    assert status == 429 and _err(data)["code"] == "tokens_quota_exceeded"
    assert int(headers["retry-after"]) >= 1
    # a small one fits (proves the reservation of the first request was corrected, not kept: keeping
    # 500 + body bytes would have left nothing)
    status, _, data = stack.post(KEYS["frank"], "/v1/completions", {**body, "max_tokens": 10})
    assert status == 200, data


def test_console_script_help() -> None:
    exe = Path(sys.executable).parent / "kvfence-router"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True, timeout=60)
    assert "--routing-table" in out.stdout and "--replicas" in out.stdout


def test_client_disconnect_mid_stream_releases_quota(stack: Stack) -> None:
    """erin may have one request at a time. She opens a stream that the engine holds silent, then
    hangs up: the router must notice (without waiting for the engine), abort the engine request and
    free her slot."""

    async def run() -> None:
        url = stack.router.url + "/v1/completions"
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                url,
                json={"model": "tiny", "prompt": "GATED hangup", "stream": True},
                headers=auth(KEYS["erin"]),
            )
            assert resp.status == 200
            await resp.content.readany()
            resp.close()  # hang up while the engine is silent
            for _ in range(600):
                async with s.post(
                    url, json={"model": "tiny", "prompt": "y"}, headers=auth(KEYS["erin"])
                ) as r:
                    if r.status == 200:
                        break
                    assert r.status == 429
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("erin's slot was never released")
            async with s.post(stack.gold.url + "/control/release"):
                pass

    asyncio.run(asyncio.wait_for(run(), 60))
    _, _, metrics = request("GET", stack.router.url + "/metrics")
    assert (
        b'kvfence_router_requests_total{tenant="erin",trust_class="gold",'
        b'endpoint="/v1/completions",code="499"} 1' in metrics
    )


def test_chunked_body_over_the_limit_is_413(stack: Stack) -> None:
    """No Content-Length: the limit is enforced while reading."""

    async def run() -> None:
        async def body():  # type: ignore[no-untyped-def]
            yield b'{"model":"tiny","prompt":"'
            for _ in range(6):
                yield b"a" * (1 << 20)
            yield b'"}'

        async with (
            aiohttp.ClientSession() as s,
            s.post(stack.router.url + "/v1/completions", data=body(), headers=auth(KEYS["bob"])) as r,
        ):
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"

    asyncio.run(asyncio.wait_for(run(), 60))


def test_an_engines_429_reaches_the_client_with_its_retry_after(stack: Stack) -> None:
    """A 429 is for what waiting cures: the engine's own Retry-After travels to the client unchanged."""
    status, headers, data = stack.post(KEYS["alice"], "/v1/completions", {"model": "tiny", "prompt": "BUSY"})
    assert status == 429 and _err(data)["code"] == "quota_exceeded", data
    assert headers["retry-after"] == "7", headers


def test_a_request_the_engine_received_and_died_on_is_sent_once(stack: Stack) -> None:
    """The engine reads the request, then closes the connection unanswered, on a kept-alive connection
    (warmed by an ordinary request first) as on a new one: the client gets a 502, and the engine saw
    the request once; the router does not send it again."""
    for n in range(3):
        status, _, _ = stack.post(KEYS["alice"], "/v1/completions", {"model": "tiny", "prompt": f"warm {n}"})
        assert status == 200
        prompt = f"DROP {n}"
        status, _, data = stack.post(KEYS["alice"], "/v1/completions", {"model": "tiny", "prompt": prompt})
        assert status == 502 and _err(data)["code"] == "bad_gateway", data
        seen = [r for r in stack.upstream_requests(stack.gold) if r["body"].get("prompt") == prompt]
        assert len(seen) == 1, seen
