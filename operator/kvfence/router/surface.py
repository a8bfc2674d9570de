"""The request surface: which body fields of ``/v1/completions`` and ``/v1/chat/completions`` the router
forwards, and how much one request may ask for.

Every field of a body falls in one class:

* **forwarded** (:data:`FORWARDED`): checked for its type, and where it costs the engine work, against
  the trust class's :class:`~kvfence.contract.routing.RequestLimits` (prompts, ``n``, stop
  strings, ``logit_bias`` entries, logprobs, grammar and schema size, messages, tools);
* **stripped** (:data:`kvfence.contract.CLIENT_FORBIDDEN_BODY_FIELDS`): fields that choose a KV-cache
  namespace or carry KV state; removed, counted, and the request goes on;
* **dropped** (:data:`DROPPED`): OpenAI bookkeeping fields that change neither the answer nor its cost
  and that vLLM ignores; removed, and the request goes on;
* **refused** (:data:`REFUSED`): fields that are the router's to set, that make the engine run code or
  templates a tenant sends, or that make sub-requests without the tenant's tag (beam search); a 400
  that says why;
* anything else is unknown: a 400 naming it (vLLM would accept and ignore it).

:func:`check_request` is the whole check. A request with only the common fields costs two set
operations and one check per field that carries a limit. A sequence is one prompt times one choice
(``n``); quotas count sequences (:mod:`.quotas`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvfence.contract import CLIENT_FORBIDDEN_BODY_FIELDS
from kvfence.contract.routing import RequestLimits
from kvfence.router.errors import RouterError

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
MAX_TOKENS_LIMIT = 1 << 30
DEFAULT_LIMITS = RequestLimits()

#: Removed before forwarding: bookkeeping fields of the OpenAI API that change neither the answer nor
#: what it costs (vLLM ignores them).
DROPPED = frozenset({"user", "metadata", "store", "safety_identifier", "prompt_cache_key"})

_ROUTER_SETS = "is set by the router, never by a client"
#: Refused with a 400: field -> why.
REFUSED: dict[str, str] = {
    "use_beam_search": "beam search runs sub-requests that do not carry the tenant's identity through "
    "the engine's isolation checks; it is not served",
    "priority": "the scheduling priority " + _ROUTER_SETS,
    "request_id": "the engine's request id " + _ROUTER_SETS,
    "session_id": "the session identity " + _ROUTER_SETS,
    "prompt_embeds": "the engine would deserialise tensors a client sends; send prompt text or token ids",
    "chat_template": "the engine would render a Jinja template a client sends; the model's own template "
    "is used",
    "ec_transfer_params": "it carries encoder-cache state between engines",
    "mm_processor_kwargs": "it changes the engine's multimodal preprocessing",
    "media_io_kwargs": "it changes how the engine loads media",
    "return_token_offsets": "it is honoured only by the render endpoints, which are not served",
    "return_mm_kwargs": "it is honoured only by the render endpoints, which are not served",
    "mm_payload": "it is honoured only by the render endpoints, which are not served",
    "best_of": "the engine does not implement it (it would ignore it); send n",
    "routed_experts_prompt_start": "routed-expert data is not served",
}
#: OpenAI fields the engine lacks: refused with a reason (the engine would accept and ignore them).
UNIMPLEMENTED = frozenset({"best_of"})

Check = Callable[[Any, RequestLimits, str], None]


def _bad(field: str, message: str, code: str = "invalid_value") -> RouterError:
    return RouterError(400, message, code, param=field)


def _over(field: str, what: str, got: int, limit: int, setting: str) -> RouterError:
    return RouterError(
        400,
        f"'{field}': {got} {what}, more than the {limit} this trust class allows per request "
        f"(requestLimits.{setting}).",
        "request_limit_exceeded",
        param=field,
    )


def _int(v: Any, field: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(field, f"'{field}' must be an integer between {lo} and {hi}.")
    return v


def _of_type(*types: type) -> Check:
    names = " or ".join(_TYPE_NAMES[t] for t in types)

    def check(v: Any, _limits: RequestLimits, field: str) -> None:
        if type(v) not in types:
            raise _bad(field, f"'{field}' must be {names}.")

    return check


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null"}
_NUMBER = _of_type(int, float, type(None))
_INTEGER = _of_type(int, type(None))
_BOOL = _of_type(bool, type(None))
_STRING = _of_type(str, type(None))


def _json_bytes(v: Any) -> int:
    return len(json.dumps(v, separators=(",", ":")))


def _grammar(v: Any, limits: RequestLimits, field: str) -> None:
    """A structured-output constraint (schema, regex, grammar, choices): bounded by its JSON size."""
    if v is None:
        return
    size = _json_bytes(v)
    if size > limits.max_grammar_bytes:
        raise _over(
            field, "bytes of structured-output constraint", size, limits.max_grammar_bytes, "maxGrammarBytes"
        )


def _structured(v: Any, limits: RequestLimits, field: str) -> None:
    if v is not None and not isinstance(v, dict):
        raise _bad(field, f"'{field}' must be an object.")
    _grammar(v, limits, field)


def _stop(v: Any, limits: RequestLimits, field: str) -> None:
    items = [v] if isinstance(v, str) else v
    if v is None:
        return
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad(field, f"'{field}' must be a string or a list of strings.")
    if len(items) > limits.max_stop_sequences:
        raise _over(field, "strings", len(items), limits.max_stop_sequences, "maxStopSequences")
    longest = max(map(len, items), default=0)
    if longest > limits.max_stop_sequence_length:
        raise _over(
            field,
            "characters in one string",
            longest,
            limits.max_stop_sequence_length,
            "maxStopSequenceLength",
        )


def _int_list(setting: str, attr: str) -> Check:
    def check(v: Any, limits: RequestLimits, field: str) -> None:
        if v is None:
            return
        if not isinstance(v, list) or not all(type(i) is int for i in v):
            raise _bad(field, f"'{field}' must be a list of integers.")
        limit = getattr(limits, attr)
        if len(v) > limit:
            raise _over(field, "entries", len(v), limit, setting)

    return check


def _logit_bias(v: Any, limits: RequestLimits, field: str) -> None:
    if v is None:
        return
    if not isinstance(v, dict) or not all(type(b) in (int, float) for b in v.values()):
        raise _bad(field, f"'{field}' must be an object of token ids to numbers.")
    if len(v) > limits.max_logit_bias_entries:
        raise _over(field, "entries", len(v), limits.max_logit_bias_entries, "maxLogitBiasEntries")


def _logprobs(v: Any, limits: RequestLimits, field: str) -> None:
    if v is None or (type(v) is bool and field == "logprobs"):
        return  # chat: a boolean (top_logprobs says how many)
    if type(v) is not int or v < 0:
        raise _bad(field, f"'{field}' must be a non-negative integer.")
    if v > limits.max_logprobs:
        raise _over(field, "logprobs per token", v, limits.max_logprobs, "maxLogprobs")


def _messages(v: Any, limits: RequestLimits, field: str) -> None:
    """Counted; each message's shape is the engine's to check (it costs nothing by itself)."""
    if type(v) is not list or not v:
        raise _bad(field, f"'{field}' must be a non-empty list of message objects.")
    if len(v) > limits.max_messages:
        raise _over(field, "messages", len(v), limits.max_messages, "maxMessages")


def _documents(v: Any, limits: RequestLimits, field: str) -> None:
    if v is None:
        return
    if not isinstance(v, list) or not all(isinstance(d, dict) for d in v):
        raise _bad(field, f"'{field}' must be a list of objects.")
    if len(v) > limits.max_messages:
        raise _over(field, "documents", len(v), limits.max_messages, "maxMessages")


def _tools(v: Any, limits: RequestLimits, field: str) -> None:
    if v is None:
        return
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise _bad(field, f"'{field}' must be a list of tool objects.")
    if len(v) > limits.max_tools:
        raise _over(field, "tools", len(v), limits.max_tools, "maxTools")


def _tool_choice(v: Any, _limits: RequestLimits, field: str) -> None:
    if v is not None and not isinstance(v, str | dict):
        raise _bad(field, f"'{field}' must be a string or an object.")


def _small_object(v: Any, limits: RequestLimits, field: str) -> None:
    """An object of scalars (``chat_template_kwargs``, ``stream_options``), bounded like a grammar."""
    if v is None:
        return
    if not isinstance(v, dict) or not all(type(x) in _SCALARS for x in v.values()):
        raise _bad(field, f"'{field}' must be an object of strings, numbers or booleans.")
    _grammar(v, limits, field)


_SCALARS = (str, int, float, bool, type(None))


def _any(_v: Any, _limits: RequestLimits, _field: str) -> None:
    """Checked in :func:`check_request` itself (``model``, ``stream``, ``prompt``, ``n``, ...)."""


#: Fields forwarded on both paths, with their checks.
_COMMON: dict[str, Check] = {
    "model": _any,
    "stream": _any,
    "n": _any,
    "max_tokens": _any,
    "stream_options": _small_object,
    "frequency_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "length_penalty": _NUMBER,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INTEGER,
    "min_p": _NUMBER,
    "seed": _INTEGER,
    "min_tokens": _INTEGER,
    "truncate_prompt_tokens": _INTEGER,
    "thinking_token_budget": _INTEGER,
    "stream_interval": _INTEGER,
    "echo": _BOOL,
    "ignore_eos": _BOOL,
    "include_stop_str_in_output": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "add_special_tokens": _BOOL,
    "return_tokens_as_token_ids": _BOOL,
    "return_token_ids": _BOOL,
    "watermarking": _BOOL,
    "truncation_side": _STRING,
    "stop": _stop,
    "bad_words": _stop,
    "stop_token_ids": _int_list("maxStopSequences", "max_stop_sequences"),
    "allowed_token_ids": _int_list("maxLogitBiasEntries", "max_logit_bias_entries"),
    "logprob_token_ids": _int_list("maxLogprobs", "max_logprobs"),
    "logit_bias": _logit_bias,
    "logprobs": _logprobs,
    "prompt_logprobs": _logprobs,
    "response_format": _structured,
    "structured_outputs": _structured,
    "repetition_detection": _structured,
}

#: Forwarded fields and their checks, per path.
FORWARDED: dict[str, dict[str, Check]] = {
    COMPLETIONS: {**_COMMON, "prompt": _any, "suffix": _STRING},
    CHAT_COMPLETIONS: {
        **_COMMON,
        "messages": _messages,
        "max_completion_tokens": _any,
        "top_logprobs": _logprobs,
        "tools": _tools,
        "tool_choice": _tool_choice,
        "parallel_tool_calls": _BOOL,
        "reasoning_effort": _STRING,
        "include_reasoning": _BOOL,
        "add_generation_prompt": _BOOL,
        "continue_final_message": _BOOL,
        "documents": _documents,
        "chat_template_kwargs": _small_object,
        "return_prompt_text": _BOOL,
    },
}
_KNOWN = {p: frozenset(checks) for p, checks in FORWARDED.items()}
#: The forwarded fields whose check is more than :func:`check_request`'s own.
_CHECKED = {p: frozenset(f for f, c in checks.items() if c is not _any) for p, checks in FORWARDED.items()}
_STRIPPED = frozenset(CLIENT_FORBIDDEN_BODY_FIELDS)


def unknown_fields(body: dict[str, Any], path: str) -> tuple[list[str], list[str]]:
    """(stripped fields present, dropped fields present) of ``body``; raises the 400 for the first
    refused or unknown field."""
    extra = body.keys() - _KNOWN[path]
    stripped, dropped = [], []
    for f in sorted(extra):
        if f in _STRIPPED:
            stripped.append(f)
        elif f in DROPPED:
            dropped.append(f)
        elif f in REFUSED:
            raise _bad(f, f"'{f}' is not accepted: {REFUSED[f]}.", "field_not_allowed")
        else:
            where = "a chat completion" if path == CHAT_COMPLETIONS else "a completion"
            raise _bad(
                f[:200],
                f"'{f[:200]}' is not a field of {where} request this router forwards.",
                "unknown_field",
            )
    return stripped, dropped


def count_prompts(prompt: Any, limits: RequestLimits) -> int:
    """Prompts in a completion's ``prompt``: a string or a list of token ids is one; a list of
    strings or of token-id lists is one per element."""
    if isinstance(prompt, str):
        return 1
    if not isinstance(prompt, list) or not prompt:
        raise _bad(
            "prompt",
            "'prompt' must be a string, a list of strings, or token ids (a list, or a list of lists).",
        )
    first = prompt[0]
    if type(first) is int:
        return 1  # one prompt of token ids (vLLM checks every id)
    kind = str if isinstance(first, str) else list
    if kind is list and not isinstance(first, list):
        raise _bad(
            "prompt",
            "'prompt' must be a string, a list of strings, or token ids (a list, or a list of lists).",
        )
    if len(prompt) > limits.max_prompts_per_request:
        raise _over("prompt", "prompts", len(prompt), limits.max_prompts_per_request, "maxPromptsPerRequest")
    if not all(isinstance(p, kind) for p in prompt):
        raise _bad("prompt", "'prompt' must not mix strings and token-id lists.")
    return len(prompt)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    max_tokens = body.get("max_tokens")
    completion = body.get("max_completion_tokens")
    if max_tokens is not None:
        max_tokens = _int(max_tokens, "max_tokens", 0, MAX_TOKENS_LIMIT)
    if completion is not None:
        completion = _int(completion, "max_completion_tokens", 0, MAX_TOKENS_LIMIT)
        # Engines differ in which of the two wins when both are given: count the larger.
        return completion if max_tokens is None else max(max_tokens, completion)
    return default if max_tokens is None else max_tokens


def _choices(body: dict[str, Any], limits: RequestLimits) -> int:
    n = body.get("n")
    n = 1 if n is None else _int(n, "n", 1, 1 << 30)
    if n > limits.max_n:
        raise _over("n", "choices", n, limits.max_n, "maxN")
    return n


_NONE: list[str] = []  # never appended to


def check_request(
    body: dict[str, Any], path: str, limits: RequestLimits, default_max_tokens: int
) -> tuple[int, int, list[str], list[str]]:
    """Check ``body`` (a parsed JSON object) for ``path``: (its sequences, i.e. prompts x ``n``; the
    completion tokens each may take; the stripped fields present; the dropped fields present), or a
    400 :class:`RouterError` naming the first field at fault. Plain values, no object: this runs
    for every request."""
    stripped, dropped = _NONE, _NONE
    if not _KNOWN[path].issuperset(body):
        stripped, dropped = unknown_fields(body, path)
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise _bad("stream", "'stream' must be a boolean.")
    if not _CHECKED[path].isdisjoint(body):
        checks = FORWARDED[path]
        for f in _CHECKED[path].intersection(body):
            checks[f](body[f], limits, f)
    choices = _choices(body, limits) if "n" in body else 1
    max_tokens = body.get("max_tokens")
    if (
        type(max_tokens) is not int
        or not 0 <= max_tokens <= MAX_TOKENS_LIMIT
        or "max_completion_tokens" in body
    ):
        max_tokens = _max_tokens(body, default_max_tokens)
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        prompts = 1 if type(prompt) is str else count_prompts(prompt, limits)
    elif "messages" in body:
        prompts = 1
    else:
        raise _bad("messages", "'messages' is required.")
    sequences = prompts * choices
    if sequences > limits.max_sequences_per_request:
        raise _over(
            "n" if choices > 1 else "prompt",
            "sequences (prompts x n)",
            sequences,
            limits.max_sequences_per_request,
            "maxSequencesPerRequest",
        )
    return sequences, max_tokens, stripped, dropped
