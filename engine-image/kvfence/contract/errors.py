"""OpenAI-shaped error bodies, built in one place for every party: the router, the reference engine
and the vLLM middleware. The shape is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

#: The OpenAI error ``type`` that goes with an HTTP status (``server_error`` for any other 5xx,
#: ``invalid_request_error`` for any other 4xx).
TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}

#: The error ``code`` of a request that needs more KV blocks than its tenant's hard maximum
#: (``maxKVBlocks``) however long it waits (its prompt, or on the reference engine its prompt and
#: ``max_tokens``): HTTP 400, which OpenAI clients do not retry. What waiting cures is a 429 with
#: ``Retry-After``.
CODE_MAX_KV_BLOCKS_EXCEEDED = "max_kv_blocks_exceeded"
#: The error ``code`` of a request that needs more KV blocks than the engine's pool can ever give its
#: tenant (the pool less others' guarantees and the pinned shared prefixes), found when nothing else
#: runs: HTTP 400 as well, since no wait makes it fit.
CODE_KV_CACHE_TOO_SMALL = "kv_cache_too_small"


def error_type(status: int) -> str:
    return TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, code: str | None, type_: str, param: str | None = None) -> bytes:
    """The JSON bytes of one OpenAI error (also what an SSE ``data:`` line carries mid-stream)."""
    doc = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
