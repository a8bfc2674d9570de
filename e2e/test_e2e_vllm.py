"""The vLLM trust class on the real node (e2e/manifests/vllm-cpu.yaml): stock vLLM for CPU with the
kvfence middleware and fenced scheduler, in the image built from this project's files
(kvfence/engine-vllm-cpu), serving the built-in tiny model, reached through the router like every other
class. Its two tenants: hooli, and umbrella with ``maxKVBlocks: 4`` (blocks of 128 tokens, vLLM's CPU
block size).

* isolation: a prefix hooli warmed is never a hit for umbrella, by the usage's cached tokens and by
  vLLM's own prefix-cache counter, whatever umbrella sends to choose a cache namespace or an identity;
* quota: umbrella's requests are cut at 4 blocks or refused with an OpenAI error, its neighbour's are not;
* the fence's counters on the engine pod's /metrics (read through the API server's service proxy: the
  engine's NetworkPolicy admits only the router's pods, and nothing here is one).
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from e2esupport import Kube, Router, Tenant, cached_tokens
from support import prom
from support.waiting import wait_until as support_wait_until

from kvfence.contract import (
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_HASH_COLLISION,
    METRIC_STALE_REFERENCE,
    Identity,
    cache_namespace,
    sign,
)

BLOCK = 128  # tokens per KV block: vLLM's CPU backend (the class sets no blockSize)
UMBRELLA_MAX_BLOCKS = 4  # e2e/manifests/vllm-cpu.yaml
FORGED_KEY = bytes(range(32))
WORDS = [
    "kernel", "scheduler", "paging", "isolation", "tenant", "prefix", "cache", "block", "verify", "token",
    "router", "salt", "engine", "quota", "eviction", "fence", "generation", "signature", "replay",
    "namespace", "class", "binding", "operator", "cluster",
]  # fmt: skip


def text(n_words: int) -> str:
    """Fresh words (about two tokens each for the tiny model's tokenizer), led by a unique tag."""
    rng = random.Random(uuid.uuid4().int)
    return uuid.uuid4().hex + " " + " ".join(rng.choices(WORDS, k=n_words))


def engine_metrics(kube: Kube) -> dict[str, float]:
    raw = kube.run(
        "get", "--raw", "/api/v1/namespaces/kvf-vllm-cpu/services/kvfence-engine:http/proxy/metrics"
    )
    return prom.samples(raw)


def eventually(check: Any, what: str, timeout: float = 15.0) -> None:
    """The fence's counters reach /metrics through a file vLLM's engine core writes 4 times a second."""
    support_wait_until(check, what, timeout, 0.25)


def warm(router: Router, owner: Tenant, prompt: str) -> int:
    """The owner sends ``prompt`` twice; the cached tokens of the second (its own prefix-cache hit)."""
    first = router.complete(owner, prompt, max_tokens=2)
    assert first.status == 200, first.body
    again = router.complete(owner, prompt, max_tokens=2)
    assert again.status == 200, again.body
    return cached_tokens(again)


def test_the_vllm_class_serves_its_own_tenants_only(
    router: Router, vllm: dict[str, Tenant], tenants: dict[str, Tenant]
) -> None:
    hooli, acme = vllm["hooli"], tenants["acme"]
    for t in vllm.values():
        r = router.request("GET", "/v1/models", key=t.api_key)
        assert r.status == 200, r.body
        assert [m["id"] for m in r.json()["data"]] == ["tiny-vllm"], t.id
    r = router.complete(hooli, "Hello, kvfence", max_tokens=4)
    assert r.status == 200, r.body
    assert r.json()["model"] == "tiny-vllm" and r.json()["usage"]["completion_tokens"] == 4
    # a tenant of another class cannot name this class's model, nor hooli the gold class's
    r = router.request(
        "POST", "/v1/completions", key=acme.api_key, body={"model": "tiny-vllm", "prompt": "x"}
    )
    assert r.status == 403 and r.json()["error"]["code"] == "model_not_allowed", r.body
    r = router.request(
        "POST", "/v1/completions", key=hooli.api_key, body={"model": acme.model, "prompt": "x"}
    )
    assert r.status == 403 and r.json()["error"]["code"] == "model_not_allowed", r.body


def test_a_prefix_hooli_warmed_is_no_hit_for_umbrella(
    router: Router, vllm: dict[str, Tenant], kube: Kube
) -> None:
    hooli, umbrella = vllm["hooli"], vllm["umbrella"]
    prompt = text(170)  # about 3 blocks: fits umbrella's 4 with the answer
    cached = warm(router, hooli, prompt)
    assert cached >= 2 * BLOCK, "the prefix cache does not work for the tenant itself"
    hits = prom.total(engine_metrics(kube), "vllm:prefix_cache_hits_total")
    other = router.complete(umbrella, prompt, max_tokens=2)
    assert other.status == 200, other.body
    assert cached_tokens(other) == 0, f"umbrella hit hooli's cached prefix: {other.json()['usage']}"
    assert prom.total(engine_metrics(kube), "vllm:prefix_cache_hits_total") == hits
    # hooli's prefix is still there for hooli
    assert cached_tokens(router.complete(hooli, prompt, max_tokens=2)) == cached


SPOOFS: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("cache_salt hooli", {"cache_salt": "hooli"}, {}),
    ("cache_salt of hooli's namespace", {"cache_salt": cache_namespace("vllm-cpu", "hooli", "Tenant")}, {}),
    ("empty cache_salt", {"cache_salt": ""}, {}),
    ("vllm_xargs", {"vllm_xargs": {"kvfence_tenant": "hooli", "kvfence_tenant_tag": "forged"}}, {}),
    ("kv_transfer_params", {"kv_transfer_params": {"do_remote_prefill": True}}, {}),
    ("identity headers", {}, {"X-Tenant-ID": "hooli", "X-Kvfence-Tenant": "hooli", "X-Cache-Salt": "hooli"}),
    (
        "a forged signature",
        {},
        sign(
            FORGED_KEY,
            Identity("hooli", "vllm-cpu", cache_namespace("vllm-cpu", "hooli", "Tenant")),
            "POST",
            "/v1/completions",
            b"{}",
        ),
    ),
]


def test_spoofed_fields_and_headers_do_not_reach_another_tenants_prefix(
    router: Router, vllm: dict[str, Tenant]
) -> None:
    hooli, umbrella = vllm["hooli"], vllm["umbrella"]
    for name, extra, headers in SPOOFS:
        prompt = text(170)  # a fresh victim prefix each time: umbrella never sent it
        assert warm(router, hooli, prompt) >= 2 * BLOCK, name
        body = {"model": umbrella.model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
        r = router.request("POST", "/v1/completions", key=umbrella.api_key, body=body, headers=headers)
        assert r.status == 200, (name, r.body)
        assert cached_tokens(r) == 0, f"{name} let umbrella reach hooli's prefix: {r.json()['usage']}"


def test_umbrella_is_held_to_its_kv_blocks_and_hooli_is_not(
    router: Router, vllm: dict[str, Tenant], kube: Kube
) -> None:
    hooli, umbrella = vllm["hooli"], vllm["umbrella"]
    m = engine_metrics(kube)
    assert m['kvfence_engine_tenant_kv_blocks_limit{kind="max",tenant="umbrella"}'] == UMBRELLA_MAX_BLOCKS
    # A request that would grow past 4 blocks is cut there (finish_reason "length"). ignore_eos: the
    # prompt is random, and greedy decoding of the random tiny model may meet its EOS before the cut
    # (finish_reason "stop", seen in CI on 2026-12-02), which would say nothing about the cut.
    r = router.complete(umbrella, text(100), max_tokens=700, ignore_eos=True)
    assert r.status == 200, r.body
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == UMBRELLA_MAX_BLOCKS * BLOCK, usage
    # A prompt that cannot fit at all is refused with an OpenAI error that clients do not retry (400,
    # naming the limit), and counted.
    rejected = prom.total(engine_metrics(kube), "kvfence_engine_quota_rejected_total")
    long_prompt = text(330)
    r = router.complete(umbrella, long_prompt, max_tokens=4)
    assert r.status == 400 and set(r.json()["error"]) >= {"message", "type", "code"}, (r.status, r.body)
    assert r.json()["error"]["code"] == "max_kv_blocks_exceeded", r.body
    assert "(maxKVBlocks)" in r.json()["error"]["message"], r.body
    eventually(
        lambda: prom.total(engine_metrics(kube), "kvfence_engine_quota_rejected_total") == rejected + 1,
        "kvfence_engine_quota_rejected_total to count the refusal",
    )
    # The neighbour, without a maximum, is served the same prompt in full (within maxModelLen, 1024).
    r = router.complete(hooli, long_prompt, max_tokens=100, ignore_eos=True)  # all 100 (see above)
    assert r.status == 200, r.body
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > UMBRELLA_MAX_BLOCKS * BLOCK and usage["completion_tokens"] == 100, usage


def test_the_engine_pod_exports_the_isolation_counters(
    router: Router, vllm: dict[str, Tenant], kube: Kube
) -> None:
    cached = warm(router, vllm["hooli"], text(170))
    assert cached > 0
    m = engine_metrics(kube)
    for name in (METRIC_HASH_COLLISION, METRIC_CROSS_ACCESS_REJECTED, METRIC_STALE_REFERENCE):
        assert name in m, f"{name} is not on the engine's /metrics: {sorted(m)[:40]}"
        # nothing this suite sent was a collision, a cross-namespace hit or a stale reference
        assert m[name] == 0, (name, m[name])
    # vLLM's own metrics are there too, next to the fence's
    assert prom.total(m, "vllm:prefix_cache_hits_total") >= cached
