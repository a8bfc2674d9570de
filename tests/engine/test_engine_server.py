"""The engine over HTTP: a real subprocess on a free port (and, where a test must inject a weak hash or
look inside the allocator, the same server in-process on a real socket)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from engine.enginelib import (
    TOKENIZER,
    Client,
    EngineProcess,
    InProcessServer,
    Oracle,
    Reply,
    Signer,
    config_dict,
    make_config,
    sse_events,
)
from engine.oracle import check_consistency
from support import prom
from support.waiting import wait_until

from kvfence.contract import (
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_HASH_COLLISION,
    METRIC_SIGNATURE_REJECTED,
    METRIC_STALE_REFERENCE,
    Identity,
    sign,
)
from kvfence.contract.engine_config import READY_PATH, EngineConfig
from kvfence.engine.engine import Engine
from kvfence.engine.server import EngineServer
from kvfence.isolation.guard import Guard, KeySource

SYSTEM = (
    "You are the shared support assistant. Follow the house style guide; never disclose other users' data. "
)
Start = Callable[[dict[str, Any]], EngineProcess]


def completion(prompt: str, max_tokens: int = 6, model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}


def chat(user: str, max_tokens: int = 6, model: str = "tiny", **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": model, "messages": msgs, "max_tokens": max_tokens, **extra}


def text_of(reply: Reply, *, chat_api: bool, stream: bool) -> str:
    assert reply.status == 200, reply.text
    if not stream:
        c = reply.json()["choices"][0]
        return str(c["message"]["content"] if chat_api else c["text"])
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    if chat_api:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    return "".join(c["choices"][0]["text"] for c in chunks)


def expected(oracle: Oracle, body: dict[str, Any]) -> str:
    adapter = "" if body["model"] == "tiny" else body["model"]
    if "messages" in body:
        msgs = [(m["role"], m["content"]) for m in body["messages"]]
        return oracle.chat_text(msgs, body["max_tokens"], adapter)
    return oracle.text(body["prompt"], body["max_tokens"], adapter)


def metrics_of(client: Client) -> tuple[dict[str, float], str]:
    async def get(s: aiohttp.ClientSession) -> str:
        async with s.get(client.base + "/metrics") as r:
            assert r.status == 200
            return await r.text()

    text = client.run(get)
    return prom.samples(text), text


def assert_pool_settled(m: dict[str, float]) -> None:
    """Every block is free or cached: nothing active, nothing stuck behind a fence, none lost."""
    assert m["kvfence_engine_kv_blocks_active"] == 0
    assert m["kvfence_engine_kv_blocks_fenced"] == 0
    assert (
        m["kvfence_engine_kv_blocks_free"] + m["kvfence_engine_kv_blocks_cached"]
        == m["kvfence_engine_kv_blocks_total"]
    )


def test_an_engine_whose_config_waits_for_its_tenants_is_not_ready_until_it_holds_them(
    start_engine: Start, key_dir: Path, tmp_path: Path
) -> None:
    """A new class's first config (``tenantsPending``: written before the routing decision) keeps the
    engine out of its Service (readiness 503) while it stays alive (health 200); the file rewritten
    with the tenants' quotas, as the kubelet brings it, makes it ready without a restart."""
    proc = start_engine(config_dict(key_dir, tenantsPending=True))
    client = Client(proc.base, Signer((key_dir / "current").read_bytes()))
    ready = client.one(READY_PATH, method="GET", signed=False)
    assert ready.status == 503 and "tenants" in ready.json()["status"]
    assert client.one("/health", method="GET", signed=False).status == 200
    time.sleep(1.1)  # a new mtime, past the reloader's once-a-second check
    quotas = {"default": {"maxBlocks": 64}, "tenants": {"acme": {"maxBlocks": 8}}}
    (tmp_path / "engine-0.yaml").write_text(json.dumps(config_dict(key_dir, quotas=quotas)))
    wait_until(lambda: client.one(READY_PATH, method="GET", signed=False).status == 200, "ready", 10, 0.2)
    assert client.one(READY_PATH, method="GET", signed=False).json() == {"status": "ok"}
    assert proc.proc.poll() is None


def test_openai_endpoints(start_engine: Start, key_dir: Path) -> None:
    proc = start_engine(config_dict(key_dir))
    client = Client(proc.base, Signer((key_dir / "current").read_bytes()))
    oracle = Oracle(make_config(key_dir))

    health = client.one("/health", method="GET", signed=False)
    assert health.status == 200 and health.json() == {"status": "ok"}
    models = client.one("/v1/models", method="GET")
    assert models.status == 200
    assert [(m["id"], m["parent"]) for m in models.json()["data"]] == [("tiny", None), ("bot", "tiny")]

    body = completion("Hello, engine!", 8)
    r = client.one("/v1/completions", body)
    data = r.json()
    assert data["object"] == "text_completion" and data["model"] == "tiny"
    assert data["usage"]["prompt_tokens"] == len(TOKENIZER.encode("Hello, engine!"))
    assert data["usage"]["completion_tokens"] == len(data["choices"][0]["text"])
    assert text_of(r, chat_api=False, stream=False) == expected(oracle, body)
    r = client.one("/v1/completions", {**body, "stream": True})
    assert r.status == 200 and text_of(r, chat_api=False, stream=True) == expected(oracle, body)
    r = client.one("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    usage = events[-2]["usage"]
    assert usage["total_tokens"] == data["usage"]["total_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # 15 prompt tokens: no full block
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == expected(oracle, body)
    bad = client.one("/v1/completions", {**body, "stream": True, "stream_options": "yes"})
    assert bad.status == 400 and bad.error["param"] == "stream_options"

    body = chat("What is the refund policy?", 7, model="bot")
    r = client.one("/v1/chat/completions", body)
    assert r.json()["object"] == "chat.completion"
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert text_of(r, chat_api=True, stream=False) == expected(oracle, body)
    r = client.one("/v1/chat/completions", {**body, "stream": True})
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert text_of(r, chat_api=True, stream=True) == expected(oracle, body)

    m, text = metrics_of(client)
    for name in (METRIC_HASH_COLLISION, METRIC_CROSS_ACCESS_REJECTED, METRIC_STALE_REFERENCE):
        assert m[name] == 0
    assert f"# HELP {METRIC_SIGNATURE_REJECTED}" in text
    assert_pool_settled(m)
    assert proc.stop() == 0


def test_bad_requests_get_precise_errors_and_leave_the_pool_consistent(
    start_engine: Start, key_dir: Path
) -> None:
    cfg = config_dict(key_dir, quotas={"tenants": {"small": {"maxBlocks": 2}}})
    proc = start_engine(cfg)
    key = (key_dir / "current").read_bytes()
    signer = Signer(key)
    client = Client(proc.base, signer)
    path = "/v1/completions"
    ok_body = json.dumps(completion("fine")).encode()

    async def scenario(s: aiohttp.ClientSession) -> dict[str, Reply]:
        out: dict[str, Reply] = {}
        out["unsigned"] = await client.send(s, path, completion("x"), signed=False)
        out["stale"] = await client.send(
            s, path, raw=ok_body, headers=signer.headers("acme", "POST", path, ok_body, now=time.time() - 600)
        )
        h = signer.headers("acme", "POST", path, ok_body)
        out["first"] = await client.send(s, path, raw=ok_body, headers=h)
        out["replayed"] = await client.send(s, path, raw=ok_body, headers=h)
        forged = json.dumps(completion("tampered")).encode()
        out["forged"] = await client.send(
            s, path, raw=forged, headers=signer.headers("acme", "POST", path, ok_body)
        )
        other = sign(os.urandom(32), signer.identity("acme"), "POST", path, ok_body)
        out["wrong_key"] = await client.send(s, path, raw=ok_body, headers=other)
        wrong_class = sign(key, Identity("acme", "silver", "tenant/silver/acme"), "POST", path, ok_body)
        out["wrong_class"] = await client.send(s, path, raw=ok_body, headers=wrong_class)
        out["malformed"] = await client.send(s, path, raw=b'{"model": "tiny", "prompt": ')
        out["not_object"] = await client.send(s, path, raw=b"[1, 2]")
        out["too_long"] = await client.send(s, path, completion("y" * 400))
        out["too_many_tokens"] = await client.send(s, path, completion("y", max_tokens=400))
        out["unknown_model"] = await client.send(s, path, completion("x", model="gpt-9"))
        out["over_quota"] = await client.send(s, path, completion("z" * 60, 8), tenant="small")
        out["salt_mismatch"] = await client.send(s, path, completion("x", cache_salt="chosen-by-client"))
        out["salt_ok"] = await client.send(s, path, completion("x", cache_salt=signer.salt("acme")))
        shared = Identity("acme", "gold", "class/gold")  # a namespace this engine's scope does not give
        body = json.dumps(completion("x")).encode()
        out["namespace"] = await client.send(s, path, raw=body, headers=sign(key, shared, "POST", path, body))
        out["extra_key"] = await client.send(s, path, completion("x", extra_key="victim"))
        out["bad_n"] = await client.send(s, path, completion("x", n=2))
        out["bad_messages"] = await client.send(
            s, "/v1/chat/completions", {"model": "tiny", "messages": "hi"}
        )
        out["unsigned_models"] = await client.send(s, "/v1/models", method="GET", signed=False)
        out["no_route"] = await client.send(s, "/v1/embeddings", completion("x"))
        return out

    r = client.run(scenario)
    expect = {
        "unsigned": (401, "authentication_error", "missing_signature"),
        "stale": (401, "authentication_error", "stale_signature"),
        "replayed": (401, "authentication_error", "replayed_signature"),
        "forged": (401, "authentication_error", "invalid_signature"),
        "wrong_key": (401, "authentication_error", "unknown_signing_key"),
        "wrong_class": (401, "authentication_error", "wrong_trust_class"),
        "malformed": (400, "invalid_request_error", "invalid_json"),
        "not_object": (400, "invalid_request_error", "invalid_json"),
        "too_long": (400, "invalid_request_error", "context_length_exceeded"),
        "too_many_tokens": (400, "invalid_request_error", "context_length_exceeded"),
        "unknown_model": (404, "invalid_request_error", "model_not_found"),
        "over_quota": (400, "invalid_request_error", "max_kv_blocks_exceeded"),
        "salt_mismatch": (403, "permission_error", "cache_salt_mismatch"),
        "namespace": (403, "permission_error", "cache_namespace_mismatch"),
        "extra_key": (403, "permission_error", "forbidden_field"),
        "unsigned_models": (401, "authentication_error", "missing_signature"),
        "no_route": (404, "invalid_request_error", None),
    }
    for name, (status, type_, code) in expect.items():
        assert r[name].status == status, (name, r[name].text)
        err = r[name].error
        assert (err["type"], err["code"]) == (type_, code), (name, err)
        assert err["message"]
    assert r["first"].status == 200 and r["salt_ok"].status == 200
    assert r["unknown_model"].error["param"] == "model"
    assert "maximum context length is 320 tokens" in r["too_long"].error["message"]
    assert "tenant 'small'" in r["over_quota"].error["message"]
    assert "maximum of 2 (maxKVBlocks)" in r["over_quota"].error["message"]
    assert r["over_quota"].error["param"] == "prompt"
    assert r["bad_n"].status == 400 and r["bad_n"].error["param"] == "n"
    assert r["bad_messages"].status == 400 and r["bad_messages"].error["param"] == "messages"

    m, text = metrics_of(client)
    for reason in ("MissingSignature", "StaleSignature", "ReplayedSignature", "BadSignature", "UnknownKey"):
        assert f'{METRIC_SIGNATURE_REJECTED}{{reason="{reason}"}} 1.0' in text or (
            reason == "MissingSignature" and f'{METRIC_SIGNATURE_REJECTED}{{reason="{reason}"}} 2.0' in text
        ), reason
    assert 'kvfence_engine_quota_rejected_total{tenant="small"} 1.0' in text
    assert m[METRIC_CROSS_ACCESS_REJECTED] == 1  # the client-chosen salt was an attempt at another namespace
    assert_pool_settled(m)
    # the engine still serves normally afterwards
    assert client.one(path, completion("after")).status == 200
    assert proc.stop() == 0


def test_isolation_under_100_concurrent_mixed_requests(start_engine: Start, key_dir: Path) -> None:
    proc = start_engine(config_dict(key_dir, numBlocks=1024))
    client = Client(proc.base, Signer((key_dir / "current").read_bytes()))
    oracle = Oracle(make_config(key_dir))
    jobs: list[tuple[str, str, dict[str, Any], bool, bool]] = []
    tenants = ("acme", "beta", "gamma")
    for i in range(120):
        tenant = tenants[i % 3]
        model = "bot" if i % 5 == 0 else "tiny"
        stream = i % 4 == 0
        q = f"[{tenant}] ticket {i % 17}: my order is late"
        if i % 2:
            jobs.append(
                (tenant, "/v1/chat/completions", chat(q, 4 + i % 5, model=model, stream=stream), True, stream)
            )
        else:
            body = completion(SYSTEM + q, 4 + i % 5, model=model, stream=stream)
            jobs.append((tenant, "/v1/completions", body, False, stream))

    async def fire(s: aiohttp.ClientSession) -> list[Reply]:
        return await asyncio.gather(*(client.send(s, p, b, tenant=t) for t, p, b, _, _ in jobs))

    replies = client.run(fire)
    for (_, _, body, chat_api, stream), reply in zip(jobs, replies, strict=True):
        assert text_of(reply, chat_api=chat_api, stream=stream) == expected(oracle, body), body

    # The same system prompt, sequentially: acme's second request hits acme's blocks; a tenant that
    # never sent it gets nothing from anyone else's cache.
    probe = completion(SYSTEM + "probe", 3)
    first = client.one("/v1/completions", probe, tenant="acme").json()["usage"]["prompt_tokens_details"]
    again = client.one("/v1/completions", probe, tenant="acme").json()["usage"]["prompt_tokens_details"]
    fresh = client.one("/v1/completions", probe, tenant="delta").json()["usage"]["prompt_tokens_details"]
    assert again["cached_tokens"] >= first["cached_tokens"] and again["cached_tokens"] > 0
    assert fresh["cached_tokens"] == 0

    m, _ = metrics_of(client)
    assert m["kvfence_engine_prefix_cache_hits_total"] > 0
    assert m[METRIC_CROSS_ACCESS_REJECTED] == 0 and m[METRIC_HASH_COLLISION] == 0
    assert m[METRIC_STALE_REFERENCE] == 0
    assert_pool_settled(m)
    assert proc.stop() == 0


def _namespace_blind(parent: bytes, payload: bytes | memoryview) -> bytes:
    """Keys that forget the chain, and with it the namespace: every tenant's identical system prompt
    maps to the same key. Only the ownership check and exact verification stand between tenants."""
    import hashlib

    return hashlib.sha256(bytes(payload)).digest()


def test_isolation_holds_even_when_keys_ignore_the_namespace(key_dir: Path) -> None:
    cfg = make_config(key_dir, numBlocks=1024)
    engine = Engine(cfg, hash_fn=_namespace_blind)
    srv = InProcessServer(EngineServer(cfg, engine))
    try:
        client = Client(srv.base, Signer((key_dir / "current").read_bytes()))
        oracle = Oracle(cfg)
        # acme warms the cache with the shared system prompt first.
        warm = completion(SYSTEM + "warm-up", 3)
        assert client.one("/v1/completions", warm, tenant="acme").status == 200
        jobs = []
        for i in range(104):
            tenant = ("acme", "beta")[i % 2]
            jobs.append((tenant, completion(SYSTEM + f"question {i % 13}", 3 + i % 4, stream=i % 3 == 0)))

        async def fire(s: aiohttp.ClientSession) -> list[Reply]:
            return await asyncio.gather(*(client.send(s, "/v1/completions", b, tenant=t) for t, b in jobs))

        replies = client.run(fire)
        for (tenant, body), reply in zip(jobs, replies, strict=True):
            assert text_of(reply, chat_api=False, stream=body["stream"]) == expected(oracle, body)
            if tenant == "beta" and not body["stream"]:
                # beta never attaches to acme's blocks (and cannot register its own under taken keys)
                assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # beta reached acme's entries through the colliding keys and was refused every time
        assert engine.metrics.value("kv_cache_tenant_cross_access_rejected_total") > 0
        acc = check_consistency(engine.allocator)  # includes: no block in a table of another namespace
        assert acc.active == acc.fenced == 0
        pc = engine.prefix_cache
        assert pc is not None
        for block in pc.index.values():
            assert block.context is not None
            assert block.context.namespace == f"tenant/gold/{block.owner}"  # every entry is its owner's
        assert {b.owner for b in pc.index.values()} == {"acme"}  # the keys collided: first owner kept them
    finally:
        srv.stop()


def test_bad_requests_leave_the_allocator_consistent_in_process(key_dir: Path) -> None:
    cfg = make_config(key_dir, numBlocks=64, quotas={"tenants": {"small": {"maxBlocks": 3}}})
    server = EngineServer(cfg)
    srv = InProcessServer(server)
    try:
        client = Client(srv.base, Signer((key_dir / "current").read_bytes()))

        async def mixed(s: aiohttp.ClientSession) -> list[Reply]:
            reqs = []
            for i in range(40):
                kind = i % 5
                if kind == 0:
                    reqs.append(
                        client.send(s, "/v1/completions", completion("q" * (i + 10), 30), tenant="small")
                    )
                elif kind == 1:
                    reqs.append(client.send(s, "/v1/completions", raw=b"{nope"))
                elif kind == 2:
                    reqs.append(client.send(s, "/v1/completions", completion("x" * 500)))
                elif kind == 3:
                    reqs.append(client.send(s, "/v1/completions", completion("x"), signed=False))
                else:
                    reqs.append(client.send(s, "/v1/completions", completion(f"ok {i}", 5, stream=True)))
            return await asyncio.gather(*reqs)

        replies = client.run(mixed)
        statuses = {r.status for r in replies}
        # small's longer prompts are beyond its maximum (400); its two that fit alone may meet (429)
        assert statuses - {429} == {200, 400, 401}, statuses
        beyond = [r for r in replies if r.status == 400 and "maxKVBlocks" in r.text]
        assert len(beyond) == 6 and all(r.error["code"] == "max_kv_blocks_exceeded" for r in beyond)
        for r in replies:
            if r.status == 429:
                assert r.error["code"] == "quota_exceeded" and r.headers["retry-after"] == "1", r.text
        acc = check_consistency(server.engine.allocator)
        assert acc.active == 0 and acc.fenced == 0 and acc.sequences == 0
        assert acc.free + acc.cold == 64
        assert all(used <= 3 for t, used in acc.usage.items() if t == "small")
    finally:
        srv.stop()


def test_key_rotation_keeps_both_keys_valid(key_dir: Path) -> None:
    cfg: EngineConfig = make_config(key_dir)
    guard = Guard(KeySource(cfg.trust_class, Path(cfg.signing_key_dir)), scope=cfg.prefix_cache.scope)
    old = (key_dir / "current").read_bytes()
    new = os.urandom(32)
    body = b"{}"
    signed_old = sign(old, Identity("acme", "gold", "tenant/gold/acme"), "GET", "/v1/models", body)
    (key_dir / "previous").write_bytes(old)
    (key_dir / "current").write_bytes(new)
    os.utime(key_dir / "current", (time.time() + 5, time.time() + 5))  # a visibly newer file
    guard.reload(now=float("inf"))  # do not wait for the once-a-second check
    v = guard.verifier
    assert v is not None and guard.current_key == new
    v.verify(signed_old, "GET", "/v1/models", body)
    signed_new = sign(new, Identity("acme", "gold", "tenant/gold/acme"), "GET", "/v1/models", body)
    assert v.verify(signed_new, "GET", "/v1/models", body).identity.tenant == "acme"


def test_sigterm_drains_an_inflight_stream_and_exits_cleanly(start_engine: Start, key_dir: Path) -> None:
    proc = start_engine(config_dict(key_dir))
    client = Client(proc.base, Signer((key_dir / "current").read_bytes()))
    body = json.dumps(completion("Tell me everything.", 200, stream=True)).encode()

    async def run(s: aiohttp.ClientSession) -> tuple[str, int]:
        h = client.signer.headers("acme", "POST", "/v1/completions", body)
        async with s.post(proc.base + "/v1/completions", data=body, headers=h) as r:
            first = await r.content.readuntil(b"\n\n")
            proc.proc.send_signal(signal.SIGTERM)  # mid-stream
            rest = await r.read()
            return (first + rest).decode(), r.status

    text, status = client.run(run)
    assert status == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(events) > 3  # it kept streaming after the signal
    assert proc.proc.wait(30) == 0
    assert "shutting down" in proc.log_path.read_text()


def test_cli_rejects_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvfence.engine.cli import main

    p = tmp_path / "bad.yaml"
    p.write_text("trustClass: gold\n")
    assert main(["--config", str(p)]) == 2
    p.write_text(json.dumps(config_dict(tmp_path / "no-keys")))
    assert main(["--config", str(p)]) == 2
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "current").write_bytes(os.urandom(32))
    p.write_text(json.dumps(config_dict(keys, quantization="fp4")))
    assert main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "signing key" in err and "is missing" in err
    assert "quantization 'none' or 'int8', not 'fp4'" in err


def test_a_client_that_hangs_up_frees_its_blocks(key_dir: Path) -> None:
    cfg = make_config(key_dir, numBlocks=64)
    server = EngineServer(cfg)
    srv = InProcessServer(server)
    try:
        client = Client(srv.base, Signer((key_dir / "current").read_bytes()))
        body = json.dumps(completion("Talk for a long time.", 250, stream=True)).encode()

        async def hang_up(s: aiohttp.ClientSession) -> bytes:
            h = client.signer.headers("acme", "POST", "/v1/completions", body)
            async with s.post(srv.base + "/v1/completions", data=body, headers=h) as r:
                first = await r.content.readuntil(b"\n\n")
                r.close()  # drop the connection mid-stream
                return first

        assert client.run(hang_up).startswith(b"data: ")
        alloc = server.engine.allocator
        deadline = time.monotonic() + 60
        while alloc.num_active and time.monotonic() < deadline:
            time.sleep(0.05)
        acc = check_consistency(alloc)
        assert acc.active == 0 and acc.sequences == 0
        assert server.metrics.value("kvfence_engine_generated_tokens_total") < 250  # it stopped early
    finally:
        srv.stop()


def test_unsigned_requests_are_served_only_when_signatures_are_not_required(key_dir: Path) -> None:
    cfg = make_config(key_dir, requireSignature=False)
    srv = InProcessServer(EngineServer(cfg))
    try:
        client = Client(srv.base, Signer((key_dir / "current").read_bytes()))
        r = client.one("/v1/completions", completion("dev mode", 3), signed=False)
        assert r.status == 200
        assert r.json()["choices"][0]["text"] == Oracle(cfg).text("dev mode", 3)
        forged = client.one(
            "/v1/completions",
            completion("x"),
            headers={"X-Kvfence-Signature": "v1=00", "X-Kvfence-Tenant": "acme"},
        )
        assert forged.status == 401  # a signed request is still verified
    finally:
        srv.stop()
