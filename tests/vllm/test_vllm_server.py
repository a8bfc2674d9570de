"""The router in front of a real ``vllm serve`` started exactly as the operator renders it for a
``runtime: vllm`` TrustClass (tiny model on CPU; the kvfence middleware and scheduler loaded by vLLM
from the rendered flags; see vllmserve.py).

* **context bleed** (the seeds' reproduction, with an oracle): two tenants send >= 100 concurrent
  mixed requests that share a system prompt longer than a block; every greedy answer must equal that
  request's answer computed alone on a server with prefix caching off, token ids and logprobs;
* **no cross-tenant hits**: a prefix one tenant warmed is never a hit for the other, whatever the other
  sends to choose a cache namespace (salt, identity headers, ``vllm_xargs``), by vLLM's own counters;
* **timing**: the other tenant's first request on a warmed prefix does the full prefill, like a cold
  one; the owner's repeat does not (the medians are reported, not asserted: tests never assert
  wall-clock times; what they assert is the cause, vLLM's cached-token count);
* **KV quotas**: a tenant over its ``maxKVBlocks`` is held back while the other is served; a request
  that cannot fit is cut or refused with an OpenAI error; a quota change applies without a restart.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from router.support import Proc, auth, b64, request, start_router, write_table
from support import prom
from support.ports import free_port
from support.waiting import wait_until

from kvfence.api.common import TenantQuotas
from kvfence.contract import (
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_HASH_COLLISION,
    METRIC_STALE_REFERENCE,
    Identity,
    cache_namespace,
    derive_cache_salt,
    sign,
)
from kvfence.contract.engine_config import READY_PATH, SIGNING_KEY_CURRENT, SIGNING_KEY_PREVIOUS
from kvfence.contract.routing import hash_api_key

from .vllmserve import VllmServer, start_vllm, tiny_model, trust_class

KEY = bytes(range(32))
KEYS = {"alice": "sk-vllm-alice-0001", "bob": "sk-vllm-bob-0001", "carol": "sk-vllm-carol-0001"}
#: carol's maxKVBlocks, in blocks of 128 tokens (vLLM's CPU block size); alice and bob have no maximum.
CAROL_MAX_BLOCKS = 2
WORDS = [
    "kernel",
    "scheduler",
    "paging",
    "isolation",
    "tenant",
    "prefix",
    "cache",
    "block",
    "verify",
    "token",
    "router",
    "salt",
    "engine",
    "quota",
    "eviction",
    "fence",
    "generation",
    "signature",
    "replay",
    "namespace",
    "class",
    "binding",
    "operator",
    "cluster",
]


def text(seed: int, n_words: int) -> str:
    """Words drawn from a seeded generator: one seed, one text; different seeds, different texts."""
    return " ".join(random.Random(seed).choices(WORDS, k=n_words))


#: About 300 tokens for the tiny model's tokenizer (about two tokens a word): over two blocks of 128.
SYSTEM = "You are a helpful assistant of the kvfence project. " + text(1, 140)


@dataclass
class Stack:
    server: VllmServer
    router: Proc
    #: the routing table file the router follows (the operator's Secret, as a file)
    table: Path

    def post(
        self, tenant: str, path: str, body: dict[str, Any], **headers: str
    ) -> tuple[int, dict[str, Any]]:
        status, _, data = request(
            "POST", self.router.url + path, body, headers={**auth(KEYS[tenant]), **headers}, timeout=300
        )
        return status, json.loads(data)


def routing_table(engine_url: str, keys: tuple[bytes, ...] = (KEY,)) -> dict[str, Any]:
    return {
        "version": 1,
        "trustClasses": {
            "gold": {
                "endpoint": engine_url,
                "runtime": "vllm",
                "servedModels": ["tiny"],
                "cacheScope": "Tenant",
                "signingKeys": [b64(k) for k in keys],
            }
        },
        "tenants": {t: {"trustClass": "gold", "apiKeyHashes": [hash_api_key(k)]} for t, k in KEYS.items()},
    }


def start_stack(python: str, tmp: Path, *, prefix_cache: bool, quotas: dict[str, TenantQuotas]) -> Stack:
    model = tiny_model(python)
    tc = trust_class(
        model,
        free_port(),
        prefix_cache=prefix_cache,
        extraArgs=["--max-num-seqs", "16", "--enable-prompt-tokens-details"],
    )
    tmp.mkdir(parents=True, exist_ok=True)
    server = start_vllm(python, tc, KEY, tmp, quotas)
    table = tmp / "routing.json"
    write_table(table, routing_table(server.url))
    try:
        router = start_router(tmp, table, "--request-timeout", "300")
    except Exception:
        server.stop()
        raise
    return Stack(server, router, table)


# --- the oracle's requests ------------------------------------------------------------------------
def oracle_requests() -> list[tuple[str, str, dict[str, Any]]]:
    """(tenant, path, body): both tenants, completions and chat, shared system prompt, repeated and
    cross-tenant-identical user parts, greedy, with token ids and logprobs."""
    out = []
    for i in range(120):
        tenant = "alice" if i % 2 == 0 else "bob"
        user = text(100 + i % 15, 12 + i % 9)  # 15 distinct user parts, each sent by both tenants
        max_tokens = 6 + i % 11
        if i % 3 == 2:
            body: dict[str, Any] = {
                "model": "tiny",
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 1,
                "return_token_ids": True,
            }
            out.append((tenant, "/v1/chat/completions", body))
        else:
            body = {
                "model": "tiny",
                "prompt": SYSTEM + "\n" + user,
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "return_token_ids": True,
            }
            out.append((tenant, "/v1/completions", body))
    return out


def answer(path: str, doc: dict[str, Any]) -> tuple[list[int], list[float]]:
    choice = doc["choices"][0]
    ids = list(choice["token_ids"])
    if path == "/v1/chat/completions":
        lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    else:
        lps = list(choice["logprobs"]["token_logprobs"])
    return ids, lps


@pytest.fixture(scope="module")
def solo_answers(
    vllm_python: Any, tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[list[int], list[float]]]:
    """Each oracle request alone, one at a time, on a server with prefix caching off."""
    stack = start_stack(vllm_python.require(), tmp_path_factory.mktemp("cold"), prefix_cache=False, quotas={})
    try:
        out = []
        for tenant, path, body in oracle_requests():
            status, doc = stack.post(tenant, path, body)
            assert status == 200, doc
            out.append(answer(path, doc))
        return out
    finally:
        stack.router.stop()
        stack.server.stop()


@pytest.fixture(scope="module")
def stack(vllm_python: Any, tmp_path_factory: pytest.TempPathFactory, solo_answers: Any) -> Iterator[Stack]:
    quotas = {"carol": TenantQuotas.model_validate({"maxKVBlocks": CAROL_MAX_BLOCKS})}
    s = start_stack(
        vllm_python.require(), tmp_path_factory.mktemp("fenced"), prefix_cache=True, quotas=quotas
    )
    try:
        yield s
    finally:
        s.router.stop()
        s.server.stop()


def counters(server: VllmServer) -> tuple[float, float, float]:
    return (
        server.metric(METRIC_HASH_COLLISION),
        server.metric(METRIC_CROSS_ACCESS_REJECTED),
        server.metric(METRIC_STALE_REFERENCE),
    )


def eventually(check: Any, what: str) -> None:
    """The fence's counters reach /metrics through a file the engine core writes 4 times a second."""
    wait_until(check, what, timeout=10.0, interval=0.1)


def cached_tokens(doc: dict[str, Any]) -> int:
    return int((doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# --- tests ----------------------------------------------------------------------------------------
def test_vllm_runs_the_rendered_flags_with_the_kvfence_scheduler_and_middleware(stack: Stack) -> None:
    log = stack.server.output()
    assert "kvfence: fenced scheduler for trust class 'gold'" in log
    assert "kvfence.vllm.scheduler.FencedScheduler" in log
    m = stack.server.metrics()
    for name in (METRIC_HASH_COLLISION, METRIC_CROSS_ACCESS_REJECTED, METRIC_STALE_REFERENCE):
        assert name in m
    assert m['kvfence_engine_tenant_kv_blocks_limit{kind="max",tenant="carol"}'] == CAROL_MAX_BLOCKS
    # Unsigned requests never reach vLLM, and the refusal is in vLLM's log.
    status, _, body = request("POST", stack.server.url + "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert status == 401, body
    wait_until(
        lambda: "kvfence: refused POST /v1/completions" in stack.server.output(),
        "the refusal in vLLM's log",
        timeout=10,
        interval=0.2,
        dump=lambda: stack.server.output()[-3000:],
    )


def test_concurrent_mixed_tenants_get_exactly_their_solo_answers(
    stack: Stack, solo_answers: list[tuple[list[int], list[float]]]
) -> None:
    reqs = oracle_requests()
    hits_before = stack.server.metric("vllm:prefix_cache_hits_total")
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        results = list(pool.map(lambda r: stack.post(r[0], r[1], r[2]), reqs))
    mismatches = []
    for i, ((status, doc), (tenant, path, _), (want_ids, want_lps)) in enumerate(
        zip(results, reqs, solo_answers, strict=True)
    ):
        assert status == 200, doc
        ids, lps = answer(path, doc)
        if ids != want_ids or any(abs(a - b) > 1e-3 for a, b in zip(lps, want_lps, strict=True)):
            mismatches.append((i, tenant, path, ids, want_ids, lps, want_lps))
    assert not mismatches, mismatches[:3]
    assert len({tuple(a[0]) for a in solo_answers}) > 20  # the oracle tells the answers apart
    # The shared prefix was reused within each tenant (the fence did not simply turn caching off) ...
    assert stack.server.metric("vllm:prefix_cache_hits_total") > hits_before
    # ... and nothing was refused as a collision, a cross-namespace hit or a stale reference.
    assert counters(stack.server) == (0, 0, 0)


SPOOFS: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("plain", {}, {}),
    (
        "alice's salt",
        {"cache_salt": derive_cache_salt(KEY, "gold", cache_namespace("gold", "alice", "Tenant"))},
        {},
    ),
    ("identity headers", {}, {"X-Kvfence-Tenant": "alice", "X-Tenant-ID": "alice", "X-Cache-Salt": "x"}),
    ("vllm_xargs", {"vllm_xargs": {"kvfence_tenant": "alice", "kvfence_tenant_tag": "forged"}}, {}),
    ("kv_transfer_params", {"kv_transfer_params": {"do_remote_prefill": True}}, {}),
]


def test_a_prefix_warmed_by_one_tenant_is_never_a_hit_for_the_other(stack: Stack) -> None:
    for i, (name, extra, headers) in enumerate(SPOOFS):
        # A prefix of ~4 blocks neither tenant has sent before, warmed by alice.
        body = {"model": "tiny", "prompt": f"{i} " + text(900 + i, 260), "max_tokens": 2, "temperature": 0}
        assert stack.post("alice", "/v1/completions", body)[0] == 200
        status, doc = stack.post("alice", "/v1/completions", body)
        warm = cached_tokens(doc)
        assert warm >= 3 * 128, doc["usage"]
        hits = stack.server.metric("vllm:prefix_cache_hits_total")
        status, doc = stack.post("bob", "/v1/completions", {**body, **extra}, **headers)
        assert status == 200, (name, doc)
        assert cached_tokens(doc) == 0, (name, doc["usage"])
        assert stack.server.metric("vllm:prefix_cache_hits_total") == hits, name
        status, doc = stack.post("alice", "/v1/completions", body)
        assert cached_tokens(doc) == warm, name


def test_timing_another_tenants_first_request_is_a_cold_prefill(stack: Stack, record_property: Any) -> None:
    times: dict[str, list[float]] = {"cold": [], "other tenant": [], "owner repeat": []}

    def timed(tenant: str, p: str, kind: str | None) -> int:
        t0 = time.perf_counter()
        status, doc = stack.post(tenant, "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 1})
        if kind is not None:
            times[kind].append(time.perf_counter() - t0)
        assert status == 200, doc
        return cached_tokens(doc)

    for i in range(7):
        # ~870 tokens (6+ blocks) that no tenant has sent before; the order of the measured requests
        # rotates so none of them always runs first after the warm-up.
        prompt, fresh = f"{i} " + text(2000 + i, 430), f"{i} " + text(2500 + i, 430)
        assert timed("alice", prompt, None) == 0  # alice warms the prefix
        steps = [("bob", prompt, "other tenant"), ("alice", prompt, "owner repeat"), ("alice", fresh, "cold")]
        for k in range(3):
            tenant, p, kind = steps[(i + k) % 3]
            cached = timed(tenant, p, kind)
            assert cached >= 6 * 128 if kind == "owner repeat" else cached == 0, (kind, cached)
    medians = {k: round(statistics.median(v) * 1000, 2) for k, v in times.items()}
    record_property("ttft_median_ms", medians)
    print(f"time to first token, medians over 7 prompts of ~6.8 blocks (ms): {medians}")


def test_a_tenant_over_its_kv_quota_waits_while_the_other_is_served(stack: Stack) -> None:
    # Each carol request reaches 2 blocks (prompt + max_tokens <= 256): carol runs one at a time.
    # alice has no maximum: her five run at once, each long enough (200 tokens) to span a few of the
    # engine's stats writes (4 a second), and still a seventh of carol's line (23 x 60 tokens).
    carol_body = {
        "model": "tiny",
        "prompt": text(3000, 90),
        "max_tokens": 60,
        "ignore_eos": True,
        "temperature": 0,
    }
    alice_body = {
        "model": "tiny",
        "prompt": text(4000, 90),
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
    }
    carol_held = 'kvfence_engine_quota_held_back_total{tenant="carol"}'
    held = stack.server.metrics().get(carol_held, 0.0)
    # The engine's own view, sampled while the requests run: (alice's active blocks, carol's active
    # blocks, carol's held-back count). Client-side finish times are not evidence: on a busy 2-core
    # machine the router or this process can be starved and see a burst of answers at once.
    samples: list[tuple[float, float, float]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            m = stack.server.metrics()
            samples.append(
                (
                    m.get('kvfence_engine_tenant_kv_blocks{state="active",tenant="alice"}', 0.0),
                    m.get('kvfence_engine_tenant_kv_blocks{state="active",tenant="carol"}', 0.0),
                    m.get(carol_held, 0.0),
                )
            )
            time.sleep(0.02)

    def send(tenant: str, body: dict[str, Any], i: int) -> tuple[int, dict[str, Any]]:
        return stack.post(tenant, "/v1/completions", {**body, "prompt": f"{i} " + body["prompt"]})

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(max_workers=29) as pool:
            futs = [pool.submit(send, "carol", carol_body, i) for i in range(24)]
            # alice starts once the engine holds carol's requests back (23 of them wait in line).
            wait_until(
                lambda: stack.server.metrics().get(carol_held, 0.0) > held,
                "carol held back",
                timeout=120,
                interval=0.05,
            )
            futs += [pool.submit(send, "alice", alice_body, i) for i in range(5)]
            results = [f.result() for f in futs]
    finally:
        done.set()
        watcher.join()
    for status, doc in results:
        assert status == 200, doc
        assert doc["choices"][0]["finish_reason"] == "length"
    assert max(carol for _, carol, _ in samples) <= CAROL_MAX_BLOCKS
    # alice was not stuck behind carol's waiting requests: the engine ran alice's requests while it
    # still held carol's back (carol's held-back count rose after a sample with alice running).
    last_held = samples[-1][2]
    assert any(alice > 0 and held_then < last_held for alice, _, held_then in samples), samples


def test_a_request_beyond_the_kv_quota_is_cut_or_refused_with_an_openai_error(stack: Stack) -> None:
    status, doc = stack.post(
        "carol", "/v1/completions", {"model": "tiny", "prompt": text(5000, 60), "max_tokens": 400}
    )
    assert status == 200, doc
    usage = doc["usage"]
    assert doc["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CAROL_MAX_BLOCKS * 128
    rejected = stack.server.metric("kvfence_engine_quota_rejected_total")
    # A prompt that alone exceeds carol's maximum: refused as the reference engine refuses it (400
    # max_kv_blocks_exceeded, which clients do not retry, in OpenAI's error shape, relayed by the
    # router), streamed or not.
    for i, stream in enumerate((False, True)):
        status, doc = stack.post(
            "carol",
            "/v1/completions",
            {"model": "tiny", "prompt": text(6000 + i, 150), "max_tokens": 4, "stream": stream},
        )
        assert status == 400, doc
        err = doc["error"]
        want = ("invalid_request_error", "max_kv_blocks_exceeded", None)
        assert (err["type"], err["code"], err["param"]) == want, doc
        assert err["message"].startswith("KV-block quota exceeded for tenant 'carol': the prompt needs ")
        assert f"more than the tenant's maximum of {CAROL_MAX_BLOCKS} (maxKVBlocks);" in err["message"]
    eventually(
        lambda: stack.server.metric("kvfence_engine_quota_rejected_total") == rejected + 2,
        "the refusals counted",
    )
    assert "exceed the tenant's KV quota" in stack.server.output()
    # The other tenants are served as before.
    status, doc = stack.post("alice", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert status == 200, doc


def test_a_quota_change_reaches_running_vllm_without_a_restart(stack: Stack) -> None:
    pid = stack.server.popen.pid if stack.server.popen else None
    stack.server.set_quotas({"carol": {"maxBlocks": 5, "guaranteedBlocks": 1}})
    key = 'kvfence_engine_tenant_kv_blocks_limit{kind="max",tenant="carol"}'

    def applied() -> bool:
        if stack.server.metrics().get(key) == 5:
            return True
        # The scheduler re-reads the file on its next step; keep it stepping.
        stack.post("alice", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
        return False

    wait_until(applied, "the quota change applied", timeout=15, interval=0.3)
    assert "KV quotas reloaded" in stack.server.output()
    assert (
        stack.server.popen is not None and stack.server.popen.pid == pid and stack.server.popen.poll() is None
    )
    stack.server.set_quotas({"carol": {"maxBlocks": CAROL_MAX_BLOCKS}})


def test_readiness_holds_while_the_config_waits_for_its_tenants(stack: Stack) -> None:
    """The readiness probe the operator renders (``/ready``, answered by the middleware inside vLLM):
    vLLM's own health once the config holds the tenants; 503 while it says ``tenantsPending`` (a new
    class's engine started before the routing decision), with ``/health`` (liveness) still 200; and
    back without a restart once the file comes without the mark."""
    pid = stack.server.popen.pid if stack.server.popen else None
    url = stack.server.url
    assert request("GET", url + READY_PATH)[0] == 200
    stack.server.set_tenants_pending(True)
    try:
        status, _, body = request("GET", url + READY_PATH)
        assert status == 503, body
        assert request("GET", url + "/health")[0] == 200
    finally:
        stack.server.set_tenants_pending(False)
    assert request("GET", url + READY_PATH)[0] == 200
    assert stack.post("alice", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})[0] == 200
    assert stack.server.popen is not None and stack.server.popen.pid == pid


def test_declared_shared_prefixes_reach_running_vllm_and_share_only_the_declared_part(
    stack: Stack, solo_answers: list[tuple[list[int], list[float]]]
) -> None:
    """Last in the module: it declares the oracle's system prompt (both forms) as shared."""
    pid = stack.server.popen.pid if stack.server.popen else None
    stack.server.set_shared_prefixes(
        [
            {"name": "system", "form": "completion", "text": SYSTEM},
            {"name": "system-chat", "form": "chat", "text": SYSTEM},
        ]
    )

    def pinned() -> bool:
        if stack.server.metrics().get("kvfence_engine_shared_prefixes_pinned") == 2:
            return True
        stack.post("alice", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
        return False

    wait_until(pinned, "both shared prefixes pinned", timeout=60, interval=0.3)
    assert stack.server.popen is not None and stack.server.popen.pid == pid  # no restart
    pinned_blocks = stack.server.metrics()["kvfence_engine_kv_blocks_pinned"]
    assert pinned_blocks >= 2
    # Every tenant's first request on a suffix nobody sent: exactly the declared part (whole blocks),
    # carol included, whose 2-block maximum could never hold this prompt: the shared part is not hers.
    first = {}
    for i, tenant in enumerate(("alice", "bob", "carol")):
        body = {
            "model": "tiny",
            "prompt": SYSTEM + "\n" + text(7000 + i, 12),
            "max_tokens": 2,
            "temperature": 0,
        }
        status, doc = stack.post(tenant, "/v1/completions", body)
        assert status == 200, (tenant, doc)
        first[tenant] = cached_tokens(doc)
    shared = first["alice"]
    assert shared >= 128 and shared % 128 == 0 and set(first.values()) == {shared}, first
    # alice's private suffix: hers on a repeat, never bob's (he gets the declared part, as cold)
    secret = {"model": "tiny", "prompt": SYSTEM + "\n" + text(7100, 140), "max_tokens": 2, "temperature": 0}
    assert stack.post("alice", "/v1/completions", secret)[0] == 200
    assert cached_tokens(stack.post("alice", "/v1/completions", secret)[1]) > shared
    assert cached_tokens(stack.post("bob", "/v1/completions", secret)[1]) == shared
    # one token changed inside the declared prefix: nothing shared
    changed = {**secret, "prompt": "W" + SYSTEM[1:] + "\n" + text(7200, 40)}
    assert cached_tokens(stack.post("bob", "/v1/completions", changed)[1]) == 0
    # The oracle again, now through the shared blocks: every answer still equals the cold server's.
    reqs = oracle_requests()
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        results = list(pool.map(lambda r: stack.post(r[0], r[1], r[2]), reqs))
    for (status, doc), (tenant, path, _), (want_ids, want_lps) in zip(
        results, reqs, solo_answers, strict=True
    ):
        assert status == 200, doc
        ids, lps = answer(path, doc)
        assert ids == want_ids and all(abs(a - b) <= 1e-3 for a, b in zip(lps, want_lps, strict=True)), (
            tenant,
            path,
        )
        assert cached_tokens(doc) >= 128, (tenant, path, doc["usage"])  # both forms hit the shared part
    assert counters(stack.server) == (0, 0, 0)
    assert stack.server.metric("kvfence_engine_shared_prefix_hits_total") > 0
    assert stack.server.metrics()["kvfence_engine_kv_blocks_pinned"] == pinned_blocks


# --- changes without restarts, under traffic --------------------------------------------------------
def _replace(path: Path, data: bytes) -> None:
    """Replace a mounted file atomically, as the kubelet swaps a Secret volume."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _direct(stack: Stack, key: bytes, tenant: str = "alice") -> int:
    """A completion sent to vLLM itself, signed as the router signs it but with ``key``: 200 once both
    vLLM processes (the API server's middleware and the engine core's scheduler) hold the key."""
    identity = Identity(tenant, "gold", cache_namespace("gold", tenant, "Tenant"))
    salt = derive_cache_salt(key, "gold", identity.namespace)
    raw = json.dumps({"model": "tiny", "prompt": "direct", "max_tokens": 1, "cache_salt": salt}).encode()
    headers = {**sign(key, identity, "POST", "/v1/completions", raw), "Content-Type": "application/json"}
    status, _, _ = request("POST", stack.server.url + "/v1/completions", headers=headers, timeout=60, raw=raw)
    return status


def test_a_key_rotation_and_a_quota_change_under_traffic_fail_no_request_and_restart_nothing(
    stack: Stack,
) -> None:
    """The operator's rotation, on real vLLM: the new key is mounted as ``current`` with the old one as
    ``previous`` (both verify), the router signs with the new one once the engines hold it, the old
    one is dropped; and a quota is changed. Two tenants send requests through the router all along:
    not one fails, and the vLLM processes are the ones that were started."""
    pid = stack.server.popen.pid if stack.server.popen else None
    key_dir = Path(json.loads(stack.server.config_path.read_text())["signingKeyDir"])
    generation = "kvfence_router_routing_table_generation"
    results: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def traffic(tenant: str) -> None:
        i = 0
        while not stop.is_set():
            body = {"model": "tiny", "prompt": f"{tenant} {i} {text(7000 + i, 20)}", "max_tokens": 2}
            status, doc = stack.post(tenant, "/v1/completions", body)
            results.append((tenant, status, "" if status == 200 else json.dumps(doc)[:300]))
            i += 1

    def router_switched(before: float) -> bool:
        status, _, data = request("GET", stack.router.url + "/metrics", timeout=10)
        return status == 200 and prom.total(data.decode(), generation) > before

    def rotate(old: bytes, new: bytes) -> None:
        _replace(key_dir / SIGNING_KEY_PREVIOUS, old)
        _replace(key_dir / SIGNING_KEY_CURRENT, new)
        wait_until(lambda: _direct(stack, new) == 200, "both vLLM processes verify the new key", 60, 0.3)
        _, _, data = request("GET", stack.router.url + "/metrics", timeout=10)
        before = prom.total(data.decode(), generation)
        write_table(stack.table, routing_table(stack.server.url, (new, old)))
        wait_until(lambda: router_switched(before), "the router signing with the new key", 30, 0.1)
        served = len(results)
        wait_until(lambda: len(results) >= served + 4, "requests signed with the new key served", 60, 0.1)
        (key_dir / SIGNING_KEY_PREVIOUS).unlink()
        wait_until(lambda: _direct(stack, old) == 401, "the old key no longer verifies", 60, 0.3)

    new_key = bytes(range(100, 132))
    workers = [threading.Thread(target=traffic, args=(t,)) for t in ("alice", "bob")]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: len(results) >= 6, "traffic flowing", 120, 0.1)
        rotate(KEY, new_key)
        limit = 'kvfence_engine_tenant_kv_blocks_limit{kind="max",tenant="alice"}'
        stack.server.set_quotas({"alice": {"maxBlocks": 40}, "carol": {"maxBlocks": CAROL_MAX_BLOCKS}})
        wait_until(lambda: stack.server.metrics().get(limit) == 40, "alice's new quota applied", 30, 0.2)
        rotate(new_key, KEY)  # and back: the module's other tests sign with KEY
        stack.server.set_quotas({"carol": {"maxBlocks": CAROL_MAX_BLOCKS}})
        wait_until(lambda: stack.server.metrics().get(limit) != 40, "alice's quota lifted again", 30, 0.2)
    finally:
        stop.set()
        for w in workers:
            w.join()
    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:5]
    assert {t for t, _, _ in results} == {"alice", "bob"} and len(results) > 20, len(results)
    out = stack.server.output()
    assert out.count("signing keys reloaded") >= 8, "each vLLM process reloads at each of the 4 changes"
    assert (
        stack.server.popen is not None and stack.server.popen.pid == pid and stack.server.popen.poll() is None
    )
