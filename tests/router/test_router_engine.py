"""The router in front of REAL reference engines (``kvfence-engine`` processes) over real sockets.

The prefix-cache oracle is the engine's own report: ``usage.prompt_tokens_details.cached_tokens`` (and
its ``kvfence_engine_prefix_cache_hits_total``). A request of tenant B that reuses anything tenant A
warmed shows up there. The answer oracle is a *cold* engine (prefix cache disabled) behind a second
router: every answer must equal the cold computation of the same prompt.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from router.fuzzing import auths, bodies, check, headers, paths
from router.support import GOLD_KEY, KEYS, EngineStack, auth, engine_metric, request
from support import prom

from kvfence.contract import Identity, cache_namespace, derive_cache_salt, sign

HITS = "kvfence_engine_prefix_cache_hits_total"
CROSS = "kv_cache_tenant_cross_access_rejected_total"
COLLISIONS = "kv_cache_hash_collision_total"
STALE = "kv_cache_stale_reference_error_total"


def alice_salt() -> str:
    return derive_cache_salt(GOLD_KEY, "gold", cache_namespace("gold", "alice", "Tenant"))


def complete(
    router_url: str,
    key: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    status, _, data = request("POST", router_url + path, body, headers={**auth(key), **(headers or {})})
    assert status == 200, data
    doc: dict[str, Any] = json.loads(data)
    return doc


def text_of(doc: dict[str, Any]) -> str:
    choice = doc["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def cached(doc: dict[str, Any]) -> int:
    return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_engine_roundtrip_models_and_adapters(engine_stack: EngineStack) -> None:
    r = engine_stack.router.url
    doc = complete(r, KEYS["alice"], {"model": "support-bot", "prompt": "adapter check", "max_tokens": 6})
    base = complete(r, KEYS["alice"], {"model": "tiny", "prompt": "adapter check", "max_tokens": 6})
    assert text_of(doc) != text_of(base)  # the adapter really is a different model
    status, _, _ = request(
        "POST", r + "/v1/completions", {"model": "legal-bot", "prompt": "x"}, headers=auth(KEYS["alice"])
    )
    assert status == 403
    chat = complete(
        r,
        KEYS["carol"],
        {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        "/v1/chat/completions",
    )
    assert chat["object"] == "chat.completion" and len(text_of(chat)) > 0


def test_spoofing_through_the_router_never_hits_another_tenants_cache(engine_stack: EngineStack) -> None:
    r, gold = engine_stack.router.url, engine_stack.gold
    prompt = f"{uuid.uuid4().hex} alice's confidential system prompt: never reveal the merger plans."
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6}
    first = complete(r, KEYS["alice"], body)
    again = complete(r, KEYS["alice"], body)
    assert cached(first) == 0 and cached(again) > 0  # the cache works: a hit would be visible

    hits_before = engine_metric(gold, HITS)
    cross_before, collisions_before = engine_metric(gold, CROSS), engine_metric(gold, COLLISIONS)
    forged = {
        "X-Tenant-ID": "alice",
        "X-Kvfence-Tenant": "alice",
        "X-Kvfence-Trust-Class": "gold",
        "X-Kvfence-Cache-Namespace": cache_namespace("gold", "alice", "Tenant"),
        "X-Kvfence-Signature": "v1=" + "0" * 64,
        "X-Cache-Salt": alice_salt(),
        "X-Cache-Namespace": "tenant/gold/alice",
    }
    spoof = {
        **body,
        "cache_salt": alice_salt(),
        "extra_key": "alice",
        "kv_transfer_params": {"do_remote_prefill": True},
    }
    stolen = complete(r, KEYS["bob"], spoof, headers=forged)
    assert cached(stolen) == 0, "bob reused alice's KV blocks"
    assert engine_metric(gold, HITS) == hits_before
    assert text_of(stolen) == text_of(first)  # same model, same prompt, computed from scratch
    # bob's own second request hits bob's own namespace
    assert cached(complete(r, KEYS["bob"], spoof, headers=forged)) > 0
    # chat: the same with a spoofed salt
    chat = {"model": "tiny", "messages": [{"role": "system", "content": prompt}], "max_tokens": 4}
    complete(r, KEYS["alice"], chat, "/v1/chat/completions")
    assert cached(complete(r, KEYS["alice"], chat, "/v1/chat/completions")) > 0
    assert (
        cached(
            complete(
                r, KEYS["bob"], {**chat, "cache_salt": alice_salt()}, "/v1/chat/completions", headers=forged
            )
        )
        == 0
    )
    # the engine never even saw a foreign salt: the router replaced it
    assert engine_metric(gold, CROSS) == cross_before
    assert engine_metric(gold, COLLISIONS) == collisions_before


def test_direct_engine_attacks_are_refused(engine_stack: EngineStack) -> None:
    """What a tenant (or anyone on the network) could try against the engine itself."""
    gold = engine_stack.gold
    prompt = f"{uuid.uuid4().hex} direct attack target prompt, long enough for two blocks."
    complete(engine_stack.router.url, KEYS["alice"], {"model": "tiny", "prompt": prompt, "max_tokens": 4})
    hits_before = engine_metric(gold, HITS)
    path = "/v1/completions"
    alice = Identity("alice", "gold", cache_namespace("gold", "alice", "Tenant"))
    bob = Identity("bob", "gold", cache_namespace("gold", "bob", "Tenant"))

    def raw(salt: str) -> bytes:
        return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "cache_salt": salt}).encode()

    # unsigned, and unsigned with a copied salt
    assert request("POST", gold.url + path, raw=raw(alice_salt()))[0] == 401
    # a genuine signed request (as the router would send it) ... then replayed verbatim
    body = raw(alice_salt())
    signed = sign(GOLD_KEY, alice, "POST", path, body)
    assert request("POST", gold.url + path, raw=body, headers=signed)[0] == 200
    status, _, data = request("POST", gold.url + path, raw=body, headers=signed)
    assert status == 401 and json.loads(data)["error"]["code"] == "replayed_signature"
    # the captured headers on another body (bob's prompt)
    other = json.dumps({"model": "tiny", "prompt": "bob " + prompt, "cache_salt": alice_salt()}).encode()
    assert request("POST", gold.url + path, raw=other, headers=signed)[0] == 401
    # signed as bob, but with alice's salt in the body or alice's namespace in the identity
    body = raw(alice_salt())
    status, _, data = request(
        "POST", gold.url + path, raw=body, headers=sign(GOLD_KEY, bob, "POST", path, body)
    )
    assert status == 403 and json.loads(data)["error"]["code"] == "cache_salt_mismatch"
    bob_as_alice_ns = Identity("bob", "gold", alice.namespace)
    status, _, _ = request(
        "POST", gold.url + path, raw=body, headers=sign(GOLD_KEY, bob_as_alice_ns, "POST", path, body)
    )
    assert status == 403
    # the only request that ran was alice's own (one hit, on her own entry)
    assert engine_metric(gold, HITS) > hits_before
    hits_mid = engine_metric(gold, HITS)
    bob_body = raw(derive_cache_salt(GOLD_KEY, "gold", bob.namespace))
    status, _, data = request(
        "POST", gold.url + path, raw=bob_body, headers=sign(GOLD_KEY, bob, "POST", path, bob_body)
    )
    assert status == 200 and cached(json.loads(data)) == 0
    assert engine_metric(gold, HITS) == hits_mid


async def _post(s: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post(url, json=body, headers=auth(key)) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            doc: dict[str, Any] = await resp.json()
            return {"text": text_of(doc), "cached": cached(doc), "tokens": doc["usage"]["completion_tokens"]}
        raw = await resp.read()
    parts = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            choice = json.loads(event[6:])["choices"][0]
            parts.append(choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
    assert raw.rstrip().endswith(b"data: [DONE]")
    return {"text": "".join(parts), "cached": None}


def test_concurrent_mixed_tenants_zero_bleed(engine_stack: EngineStack) -> None:
    """120 concurrent requests from four tenants on two engines, streamed and not, completions and chat.

    alice (gold) and carol (silver) warm k prompts first. Then, all at once: alice and carol send them
    again (own hits expected), bob (gold, own namespace) sends alice's prompts (no hit allowed, ever),
    grace (silver, whose class shares its cache) sends carol's (hits allowed). Every answer must equal
    the cold engine's answer for the same prompt."""
    k = 30
    run = uuid.uuid4().hex[:8]
    kinds = ("completion", "completion-stream", "chat", "chat-stream")

    def req(i: int, model: str, who: str, stream_ok: bool = True) -> tuple[str, dict[str, Any]]:
        kind = kinds[i % 4] if stream_ok else kinds[(i % 2) * 2]
        secret = f"{i:03d} {run} shared system prompt of team {who}; account {i * 7919} balance {i * 104729}."
        body: dict[str, Any] = {"model": model, "max_tokens": 6 + i % 5, "stream": kind.endswith("stream")}
        if kind.startswith("chat"):
            body["messages"] = [
                {"role": "system", "content": secret},
                {"role": "user", "content": "Summarise."},
            ]
            return "/v1/chat/completions", body
        body["prompt"] = secret
        return "/v1/completions", body

    r, cold = engine_stack.router.url, engine_stack.cold_router.url
    gold_prompts = [req(i, "tiny", "gold") for i in range(k)]
    silver_prompts = [req(i, "small", "silver") for i in range(k)]
    # bob's copies are not streamed, so that each answer reports its cached tokens
    bob_prompts = [(p, {**b, "stream": False}) for p, b in gold_prompts]

    async def run_all() -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
            # oracle: cold engines, one request at a time
            oracle = {}
            for (p, b), key in [
                *((x, KEYS["alice"]) for x in bob_prompts),
                *((x, KEYS["carol"]) for x in silver_prompts),
            ]:
                oracle[json.dumps([p, {**b, "stream": False}], sort_keys=True)] = (
                    await _post(s, cold + p, key, {**b, "stream": False})
                )["text"]

            def expect(p: str, b: dict[str, Any]) -> str:
                return oracle[json.dumps([p, {**b, "stream": False}], sort_keys=True)]

            hits0 = engine_metric(engine_stack.gold, HITS)
            warm = await asyncio.gather(
                *(_post(s, r + p, KEYS["alice"], b) for p, b in gold_prompts),
                *(_post(s, r + p, KEYS["carol"], b) for p, b in silver_prompts),
            )
            for (p, b), got in zip([*gold_prompts, *silver_prompts], warm, strict=True):
                assert got["text"] == expect(p, b)
            assert engine_metric(engine_stack.gold, HITS) == hits0  # first sight of every prompt

            jobs = [
                *(("alice", p, b) for p, b in gold_prompts),
                *(("bob", p, b) for p, b in bob_prompts),
                *(("carol", p, b) for p, b in silver_prompts),
                *(("grace", p, {**b, "stream": False}) for p, b in silver_prompts),
            ]
            assert len(jobs) >= 120
            results = await asyncio.gather(*(_post(s, r + p, KEYS[who], b) for who, p, b in jobs))
        for (who, p, b), got in zip(jobs, results, strict=True):
            assert got["text"] == expect(p, b), (who, p, b)
            if got["cached"] is None:
                continue
            if who == "bob":
                assert got["cached"] == 0, f"bob reused alice's blocks: {b}"
            else:
                assert got["cached"] > 0, (who, b)  # own namespace (alice) or shared class (grace)

    engines = (engine_stack.gold, engine_stack.silver)
    # (the engines count a refused salt as a cross-access attempt, which other tests provoke on
    # purpose: compare before and after)
    before = [[engine_metric(e, m) for m in (CROSS, COLLISIONS, STALE)] for e in engines]
    asyncio.run(asyncio.wait_for(run_all(), 600))
    after = [[engine_metric(e, m) for m in (CROSS, COLLISIONS, STALE)] for e in engines]
    assert after == before


def test_streaming_concatenates_to_the_non_streamed_answer(engine_stack: EngineStack) -> None:
    async def run() -> None:
        r = engine_stack.router.url
        async with aiohttp.ClientSession() as s:
            for path, body in (
                (
                    "/v1/completions",
                    {"model": "tiny", "prompt": "stream me a long answer", "max_tokens": 24},
                ),
                (
                    "/v1/chat/completions",
                    {
                        "model": "support-bot",
                        "max_tokens": 24,
                        "messages": [{"role": "user", "content": "stream a long answer"}],
                    },
                ),
            ):
                plain = await _post(s, r + path, KEYS["alice"], body)
                async with s.post(
                    r + path, json={**body, "stream": True}, headers=auth(KEYS["alice"])
                ) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    reads = []
                    async for chunk in resp.content.iter_any():
                        reads.append(chunk)
                raw = b"".join(reads)
                parts = []
                for event in raw.split(b"\n\n"):
                    if event.startswith(b"data: {"):
                        choice = json.loads(event[6:])["choices"][0]
                        parts.append(
                            (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
                        )
                assert len(parts) >= plain["tokens"] > 1  # one event per token, not one blob
                assert "".join(parts) == plain["text"]
                assert raw.rstrip().endswith(b"data: [DONE]")

    asyncio.run(asyncio.wait_for(run(), 120))


def test_tokens_quota_is_corrected_with_the_engines_usage(engine_stack: EngineStack) -> None:
    r = engine_stack.router.url
    doc = complete(r, KEYS["frank"], {"model": "tiny", "prompt": "count my tokens", "max_tokens": 7})
    used = doc["usage"]["total_tokens"]
    _, _, metrics = request("GET", r + "/metrics")
    # charged what the engine reported, not the reservation
    assert prom.value(metrics.decode(), 'kvfence_router_tokens_total{tenant="frank"}') == used
    # frank has 600 tokens/min: a request reserving more than what is left is refused with Retry-After
    status, headers, _ = request(
        "POST",
        r + "/v1/completions",
        {"model": "tiny", "prompt": "x", "max_tokens": 590},
        headers=auth(KEYS["frank"]),
    )
    assert status == 429 and int(headers["retry-after"]) >= 1


def test_streamed_usage_corrects_the_reservation(engine_stack: EngineStack) -> None:
    """With ``stream_options.include_usage`` the engine ends the stream with a usage event; the router
    finds it in the relayed bytes and charges exactly that."""

    def charged() -> float:
        _, _, metrics = request("GET", engine_stack.router.url + "/metrics")
        return prom.value(metrics.decode(), 'kvfence_router_tokens_total{tenant="frank"}') or 0.0

    before = charged()
    body = {
        "model": "tiny",
        "prompt": "usage in a stream",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, _, data = request(
        "POST", engine_stack.router.url + "/v1/completions", body, headers=auth(KEYS["frank"])
    )
    assert status == 200
    events = [json.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(usage) == 1
    assert charged() - before == usage[0]["total_tokens"]


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=paths, body=bodies, extra_headers=headers, authorization=auths)
def test_fuzz_against_the_real_engine(
    engine_stack: EngineStack,
    path: str,
    body: bytes,
    extra_headers: dict[str, str],
    authorization: dict[str, str],
) -> None:
    status, resp_headers, data = request(
        "POST", engine_stack.router.url + path, raw=body, headers={**extra_headers, **authorization}
    )
    if status >= 500:
        # only an engine failure may be a 5xx, and it is marked as relayed
        assert "x-kvfence-upstream-status" in resp_headers or status in (502, 503, 504), (status, data)
    check(status, resp_headers, data)
