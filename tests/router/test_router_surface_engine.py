"""The request surface and sequence charging, through a real router in front of a real reference engine.

Every refused shape is answered by the router with a 400 naming the field, and never reaches the
engine: its request and isolation counters stay where they were. Quotas count sequences (prompts x n):
a request of 300 prompts x n=4 is 1,200 of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from router.support import (
    GOLD_KEY,
    KEYS,
    SILVER_KEY,
    Proc,
    auth,
    b64,
    engine_metric,
    request,
    start_engine,
    start_router,
    write_table,
)

from kvfence.contract.routing import hash_api_key

ISOLATION = (
    "kvfence_engine_requests_total",
    "kvfence_engine_signature_rejected_total",
    "kv_cache_tenant_cross_access_rejected_total",
    "kv_cache_hash_collision_total",
    "kv_cache_stale_reference_error_total",
)
RAISED = {"maxPromptsPerRequest": 400, "maxN": 4, "maxSequencesPerRequest": 2000}
TENANTS = {
    "carol": ({}, "silver"),
    "erin": ({"maxConcurrentRequests": 1000}, "gold"),
    "dave": ({"requestsPerMinute": 1300}, "gold"),
}


@pytest.fixture(scope="module")
def surface_stack(logs: Path) -> Iterator[tuple[Proc, Proc]]:
    """The router; the engine of the silver class (default limits). The gold class raises its limits."""
    gold = start_engine(logs, "surface-gold", "gold", "tiny", GOLD_KEY)
    silver = start_engine(logs, "surface-silver", "silver", "small", SILVER_KEY)
    table: dict[str, Any] = {
        "version": 1,
        "trustClasses": {
            "gold": {
                "endpoint": gold.url,
                "servedModels": ["tiny"],
                "signingKeys": [b64(GOLD_KEY)],
                "requestLimits": RAISED,
            },
            "silver": {"endpoint": silver.url, "servedModels": ["small"], "signingKeys": [b64(SILVER_KEY)]},
        },
        "tenants": {
            name: {"trustClass": cls, "apiKeyHashes": [hash_api_key(KEYS[name])], "quotas": quotas}
            for name, (quotas, cls) in TENANTS.items()
        },
    }
    path = logs / "routing-surface.json"
    write_table(path, table)
    router = start_router(logs, path)
    try:
        yield router, silver
    finally:
        router.stop()
        gold.stop()
        silver.stop()


def post(
    router: Proc, tenant: str, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, headers, data = request("POST", router.url + path, body, headers=auth(KEYS[tenant]))
    return status, headers, json.loads(data)


def counters(engine: Proc) -> dict[str, float]:
    return {name: engine_metric(engine, name) for name in ISOLATION}


REFUSED_SHAPES = [
    ({"use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"priority": -100}, "priority"),
    ({"request_id": "someone-elses-id"}, "request_id"),
    ({"prompt": ["p"] * 33}, "prompt"),
    ({"n": 17}, "n"),
    ({"n": 2, "best_of": 4}, "best_of"),
    ({"stop": ["s"] * 100}, "stop"),
    ({"logit_bias": {str(i): 5 for i in range(1000)}}, "logit_bias"),
    ({"structured_outputs": {"regex": "(a|b)*" * 10000}}, "structured_outputs"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"session_id": "another-tenants-session"}, "session_id"),
    ({"frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize(("extra", "field"), REFUSED_SHAPES, ids=[f for _, f in REFUSED_SHAPES])
def test_refused_shapes_never_reach_the_engine(
    surface_stack: tuple[Proc, Proc], extra: dict[str, Any], field: str
) -> None:
    router, engine = surface_stack
    before = counters(engine)
    status, headers, doc = post(
        router, "carol", {"model": "small", "prompt": "hello", "max_tokens": 2, **extra}
    )
    assert status == 400, doc
    assert doc["error"]["param"] == field and doc["error"]["type"] == "invalid_request_error"
    assert "retry-after" not in headers and "x-kvfence-upstream-status" not in headers
    assert counters(engine) == before


def test_chat_refusals_and_a_served_request(surface_stack: tuple[Proc, Proc]) -> None:
    router, engine = surface_stack
    chat = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    before = counters(engine)
    for extra, field in (
        ({"chat_template": "{{ secrets }}"}, "chat_template"),
        ({"tools": [{"type": "function"}] * 129}, "tools"),
        ({"suffix": "x"}, "suffix"),
    ):
        status, _, doc = post(router, "carol", {**chat, **extra}, "/v1/chat/completions")
        assert status == 400 and doc["error"]["param"] == field, doc
    assert counters(engine) == before
    status, _, doc = post(router, "carol", {**chat, "user": "u-1", "stop": ["\n"]}, "/v1/chat/completions")
    assert status == 200, doc
    assert counters(engine)["kvfence_engine_requests_total"] == before["kvfence_engine_requests_total"] + 1
    _, _, metrics = request("GET", router.url + "/metrics")
    assert b'kvfence_router_client_fields_stripped_total{kind="dropped"} 1' in metrics


def test_a_request_beyond_a_concurrency_limit_is_final(surface_stack: tuple[Proc, Proc]) -> None:
    router, engine = surface_stack
    before = counters(engine)
    body = {"model": "tiny", "prompt": [[1, 2, 3]] * 300, "n": 4, "max_tokens": 16}
    status, headers, doc = post(router, "erin", body)  # 1,200 sequences, maxConcurrentRequests 1000
    assert status == 400 and "retry-after" not in headers, doc
    assert (
        doc["error"]["param"] == "maxConcurrentRequests" and doc["error"]["code"] == "request_exceeds_quota"
    )
    assert "1200 sequences" in doc["error"]["message"]
    assert counters(engine) == before
    status, _, doc = post(router, "erin", {"model": "tiny", "prompt": "fine", "max_tokens": 2})
    assert status == 200, doc


def test_requests_per_minute_count_sequences(surface_stack: tuple[Proc, Proc]) -> None:
    router, _ = surface_stack
    body = {"model": "tiny", "prompt": [[1, 2, 3]] * 300, "n": 4, "max_tokens": 16}
    status, _, doc = post(router, "dave", body)  # admitted: 1,200 of dave's 1,300 a minute
    assert doc.get("error", {}).get("code") != "requests_quota_exceeded", doc
    status, headers, doc = post(router, "dave", body)  # 100 left: waiting cures it
    assert status == 429 and doc["error"]["code"] == "requests_quota_exceeded", doc
    assert int(headers["retry-after"]) >= 1 and "1200" in doc["error"]["message"]
    status, _, doc = post(router, "dave", {"model": "tiny", "prompt": "one sequence", "max_tokens": 2})
    assert status == 200, doc
    status, headers, doc = post(router, "dave", {**body, "prompt": [[1]] * 350})
    assert status == 400 and "retry-after" not in headers, doc  # 1,400 > 1,300: never
    assert doc["error"]["param"] == "requestsPerMinute"
