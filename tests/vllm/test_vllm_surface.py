"""The router's request surface against the pinned vLLM.

* Every body field of vLLM's own request models for ``/v1/completions`` and ``/v1/chat/completions``
  is classified by :mod:`kvfence.router.surface` (forwarded, stripped, dropped or refused), and the
  router forwards no field vLLM lacks (vLLM accepts and ignores unknown fields): an upgrade that adds
  a field fails here until it is classified.
* Through the router in front of a real ``vllm serve`` (the operator's rendered flags), every refused
  shape is a 4xx naming the field, and none of them moves the engine's isolation counters (beam
  search, sent straight to vLLM, makes sub-requests without the tenant's tag and fires the signature
  alarm: the router never lets it through).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvfence.contract import (
    CLIENT_FORBIDDEN_BODY_FIELDS,
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_HASH_COLLISION,
    METRIC_SIGNATURE_REJECTED,
    METRIC_STALE_REFERENCE,
)
from kvfence.router.surface import DROPPED, FORWARDED, REFUSED, UNIMPLEMENTED

from .test_vllm_args import probe
from .test_vllm_server import Stack, start_stack

ISOLATION = (
    METRIC_SIGNATURE_REJECTED,
    METRIC_HASH_COLLISION,
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_STALE_REFERENCE,
)
#: vLLM's own count of prompt tokens: moves with every request vLLM serves.
PROMPT_TOKENS = "vllm:prompt_tokens_total"


def test_every_vllm_request_field_is_classified(vllm_python: Any) -> None:
    fields = probe(vllm_python.require(), {"fields": True})["fields"]
    classified = set(CLIENT_FORBIDDEN_BODY_FIELDS) | DROPPED | set(REFUSED)
    # every refusal's reason is about a field this vLLM has (on one path at least), but for the
    # OpenAI fields it lacks
    known = {f for names in fields.values() for f in names}
    assert not set(REFUSED) - UNIMPLEMENTED - known and not UNIMPLEMENTED & known
    for path, forwarded in FORWARDED.items():
        theirs = set(fields[path])
        assert theirs, path
        assert not theirs - set(forwarded) - classified, (path, sorted(theirs - set(forwarded) - classified))
        assert not set(forwarded) - theirs, (
            path,
            "forwarded but unknown to vLLM",
            sorted(set(forwarded) - theirs),
        )


@pytest.fixture(scope="module")
def stack(vllm_python: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(vllm_python.require(), tmp_path_factory.mktemp("surface"), prefix_cache=True, quotas={})
    try:
        yield s
    finally:
        s.router.stop()
        s.server.stop()


PROMPT = {"model": "tiny", "prompt": "the router checks every field", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
REFUSED_SHAPES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {**PROMPT, "use_beam_search": True, "n": 2}, "use_beam_search"),
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "n": 2}, "use_beam_search"),
    ("/v1/completions", {**PROMPT, "priority": -100}, "priority"),
    ("/v1/completions", {**PROMPT, "request_id": "another-tenants-request"}, "request_id"),
    ("/v1/chat/completions", {**CHAT, "request_id": "x"}, "request_id"),
    ("/v1/completions", {**PROMPT, "prompt": [[1, 2, 3]] * 300, "n": 4, "max_tokens": 16}, "prompt"),
    ("/v1/completions", {**PROMPT, "n": 128}, "n"),
    ("/v1/completions", {**PROMPT, "frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/completions", {**PROMPT, "prompt_embeds": "AAAA"}, "prompt_embeds"),
]


def isolation(stack: Stack) -> dict[str, float]:
    return {name: stack.server.metric(name) for name in ISOLATION}


def test_every_refused_shape_is_a_4xx_and_moves_no_isolation_counter(stack: Stack) -> None:
    before, prompt_tokens = isolation(stack), stack.server.metric(PROMPT_TOKENS)
    for path, body, field in REFUSED_SHAPES:
        status, doc = stack.post("alice", path, body)
        assert 400 <= status < 500, (field, status, doc)
        assert doc["error"]["param"] == field, (field, doc)
    assert stack.server.metric(PROMPT_TOKENS) == prompt_tokens  # none of them reached vLLM
    status, doc = stack.post("alice", "/v1/completions", {**PROMPT, "n": 2, "user": "u-1"})
    assert status == 200 and len(doc["choices"]) == 2, doc
    assert stack.server.metric(PROMPT_TOKENS) > prompt_tokens
    # The fence's counters reach /metrics through a file the engine core writes 4 times a second.
    time.sleep(0.6)
    assert isolation(stack) == before
