"""Unit tests of the request surface (kvfence.router.surface): which fields the router forwards, strips,
drops or refuses, and the per-request limits."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.contract import CLIENT_FORBIDDEN_BODY_FIELDS
from kvfence.contract.routing import RequestLimits
from kvfence.router.errors import RouterError
from kvfence.router.surface import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    DROPPED,
    FORWARDED,
    REFUSED,
    check_request,
    count_prompts,
)

LIMITS = RequestLimits()
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PLAIN = {"model": "m", "prompt": "hi"}


def refused(body: dict[str, Any], path: str = COMPLETIONS, limits: RequestLimits = LIMITS) -> RouterError:
    with pytest.raises(RouterError) as e:
        check_request(body, path, limits, 16)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def test_the_classes_do_not_overlap() -> None:
    stripped = set(CLIENT_FORBIDDEN_BODY_FIELDS)
    for path, checks in FORWARDED.items():
        forwarded = set(checks)
        assert not forwarded & stripped and not forwarded & DROPPED and not forwarded & set(REFUSED), path
    assert not stripped & DROPPED and not stripped & set(REFUSED) and not DROPPED & set(REFUSED)


def test_common_requests_pass_with_their_sequences() -> None:
    body = {**PLAIN, "max_tokens": 5, "temperature": 0.5}
    assert check_request(body, COMPLETIONS, LIMITS, 16) == (1, 5, [], [])
    assert check_request({**CHAT, "n": 3, "stream": True}, CHAT_COMPLETIONS, LIMITS, 16)[:2] == (3, 16)
    assert check_request({"model": "m", "prompt": [1, 2, 3]}, COMPLETIONS, LIMITS, 16)[0] == 1
    assert check_request({"model": "m", "prompt": [[1], [2, 3]], "n": 4}, COMPLETIONS, LIMITS, 8)[:2] == (
        8,
        8,
    )
    assert count_prompts([1, 2, 3], LIMITS) == 1  # a list of token ids is one prompt
    assert count_prompts(["a", "b"], LIMITS) == 2 and count_prompts([[1], [2]], LIMITS) == 2


def test_stripped_and_dropped_fields_are_reported_not_refused() -> None:
    body = {**PLAIN, "cache_salt": "x", "vllm_xargs": {}, "user": "u", "metadata": {"a": "b"}}
    _, _, stripped, dropped = check_request(body, COMPLETIONS, LIMITS, 16)
    assert stripped == ["cache_salt", "vllm_xargs"] and dropped == ["metadata", "user"]


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_fields_name_the_field_and_say_why(field: str) -> None:
    for path, base in ((COMPLETIONS, PLAIN), (CHAT_COMPLETIONS, CHAT)):
        e = refused({**base, field: 1}, path)
        assert e.param == field and e.code == "field_not_allowed" and REFUSED[field] in e.message


def test_beam_search_and_router_fields_say_why() -> None:
    assert "sub-requests" in refused({**PLAIN, "use_beam_search": True, "n": 2}).message
    assert "router" in refused({**PLAIN, "priority": -10}).message
    assert "router" in refused({**PLAIN, "request_id": "mine"}).message


def test_unknown_fields_are_refused_by_name() -> None:
    e = refused({**PLAIN, "frobnicate": True})
    assert e.param == "frobnicate" and e.code == "unknown_field"
    # a chat-only field on the completions path, and a completions-only field on the chat path
    assert refused({**PLAIN, "tools": []}).param == "tools"
    assert refused({**CHAT, "suffix": "x"}, CHAT_COMPLETIONS).param == "suffix"


@pytest.mark.parametrize(
    ("body", "field", "setting"),
    [
        ({"prompt": ["p"] * 33}, "prompt", "maxPromptsPerRequest"),
        ({"prompt": [[1, 2, 3]] * 300, "n": 4}, "prompt", "maxPromptsPerRequest"),
        ({"prompt": "p", "n": 17}, "n", "maxN"),
        ({"prompt": ["p"] * 8, "n": 16}, "n", "maxSequencesPerRequest"),
        ({"prompt": ["p"] * 32, "n": 3}, "n", "maxSequencesPerRequest"),
        ({"prompt": "p", "stop": ["s"] * 17}, "stop", "maxStopSequences"),
        ({"prompt": "p", "stop": "s" * 257}, "stop", "maxStopSequenceLength"),
        ({"prompt": "p", "stop_token_ids": list(range(17))}, "stop_token_ids", "maxStopSequences"),
        ({"prompt": "p", "bad_words": ["w"] * 17}, "bad_words", "maxStopSequences"),
        ({"prompt": "p", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "maxLogitBiasEntries"),
        ({"prompt": "p", "allowed_token_ids": list(range(301))}, "allowed_token_ids", "maxLogitBiasEntries"),
        ({"prompt": "p", "logprobs": 21}, "logprobs", "maxLogprobs"),
        ({"prompt": "p", "prompt_logprobs": 21}, "prompt_logprobs", "maxLogprobs"),
        (
            {"prompt": "p", "structured_outputs": {"regex": "a" * 40000}},
            "structured_outputs",
            "maxGrammarBytes",
        ),
        (
            {"prompt": "p", "structured_outputs": {"choice": ["c" * 100] * 400}},
            "structured_outputs",
            "maxGrammarBytes",
        ),
        (
            {"prompt": "p", "response_format": {"type": "json_schema", "json_schema": {"d": "x" * 40000}}},
            "response_format",
            "maxGrammarBytes",
        ),
    ],
)
def test_limits_name_the_field_and_the_setting(body: dict[str, Any], field: str, setting: str) -> None:
    e = refused({"model": "m", **body})
    assert e.param == field and e.code == "request_limit_exceeded" and f"requestLimits.{setting}" in e.message


def test_chat_limits() -> None:
    many = [{"role": "user", "content": "x"}] * 1025
    assert refused({"model": "m", "messages": many}, CHAT_COMPLETIONS).param == "messages"
    tools = [{"type": "function"}] * 129
    assert refused({**CHAT, "tools": tools}, CHAT_COMPLETIONS).param == "tools"
    assert refused({**CHAT, "top_logprobs": 21}, CHAT_COMPLETIONS).param == "top_logprobs"
    assert refused({"model": "m"}, CHAT_COMPLETIONS).param == "messages"
    nested = {"k": {"nested": 1}}
    assert refused({**CHAT, "chat_template_kwargs": nested}, CHAT_COMPLETIONS).param == "chat_template_kwargs"
    check_request({**CHAT, "logprobs": True, "top_logprobs": 5}, CHAT_COMPLETIONS, LIMITS, 16)


def test_a_class_can_raise_a_limit() -> None:
    raised = RequestLimits(maxPromptsPerRequest=300, maxN=4, maxSequencesPerRequest=1200)
    sequences, _, _, _ = check_request(
        {"model": "m", "prompt": [[1, 2, 3]] * 300, "n": 4}, COMPLETIONS, raised, 16
    )
    assert sequences == 1200
    assert refused({"model": "m", "prompt": "p", "n": 5}, limits=raised).param == "n"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": [{"x": 1}]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "p", "n": "2"}, "n"),
        ({"prompt": "p", "n": True}, "n"),
        ({"prompt": "p", "n": 1.0}, "n"),
        ({"prompt": "p", "stream": "yes"}, "stream"),
        ({"prompt": "p", "stop": [1]}, "stop"),
        ({"prompt": "p", "logit_bias": {"1": "high"}}, "logit_bias"),
        ({"prompt": "p", "logit_bias": [1]}, "logit_bias"),
        ({"prompt": "p", "temperature": "hot"}, "temperature"),
        ({"prompt": "p", "seed": 1.5}, "seed"),
        ({"prompt": "p", "echo": 1}, "echo"),
        ({"prompt": "p", "logprobs": -1}, "logprobs"),
        ({"prompt": "p", "structured_outputs": "json"}, "structured_outputs"),
        ({"prompt": "p", "max_tokens": -1}, "max_tokens"),
    ],
)
def test_types_are_checked(body: dict[str, Any], field: str) -> None:
    e = refused({"model": "m", **body})
    assert e.param == field


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
_FIELDS = sorted({f for checks in FORWARDED.values() for f in checks} | set(REFUSED) | DROPPED)


@settings(max_examples=400, deadline=None)
@given(
    path=st.sampled_from([COMPLETIONS, CHAT_COMPLETIONS]),
    body=st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=6), _JSON, max_size=6),
)
def test_any_body_is_checked_or_refused_with_a_named_field(path: str, body: dict[str, Any]) -> None:
    try:
        sequences, max_tokens, _, _ = check_request(body, path, LIMITS, 16)
    except RouterError as e:
        # the field at fault, or the required one that is missing
        assert e.status == 400 and (e.param in body or e.param in ("prompt", "messages")), e.message
    else:
        assert 1 <= sequences <= LIMITS.max_sequences_per_request and max_tokens >= 0
