"""The OpenAI API shapes of the reference engine: request fields parsed and checked (each failure an
:class:`ApiError` naming the parameter, answered as an OpenAI error body) and the usage block of an
answer. Pure functions: the HTTP handlers are in :mod:`kvfence.engine.server`."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvfence.contract.errors import error_body, error_type
from kvfence.engine.engine import Failed, Finished


class ApiError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def response(self) -> web.Response:
        body = error_body(self.message, self.code, self.type, self.param)
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.Response(body=body, status=self.status, content_type="application/json", headers=headers)


def failed_error(ev: Failed, param: str | None = None) -> ApiError:
    """The answer to a request the engine failed before its first token; ``param`` (the prompt's
    field) is named by a 400, the request's own fault."""
    return ApiError(
        ev.status,
        ev.message,
        type_=error_type(ev.status),
        code=ev.code,
        param=param if ev.status == 400 else None,
        retry_after=ev.retry_after,
    )


def int_field(data: dict[str, Any], name: str, default: int) -> int:
    v = data.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer", type_="invalid_request_error", param=name)
    return v


def stream_flag(data: dict[str, Any]) -> bool:
    n = data.get("n", 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", type_="invalid_request_error", param="n")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", type_="invalid_request_error", param="stream")
    return stream


def include_usage(data: dict[str, Any]) -> bool:
    opts = data.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise ApiError(
            400, "stream_options must be an object", type_="invalid_request_error", param="stream_options"
        )
    return bool(opts.get("include_usage", False))


def prompt_text(data: dict[str, Any]) -> str:
    p = data.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise ApiError(400, "prompt must be a string", type_="invalid_request_error", param="prompt")
    return p


def chat_messages(data: dict[str, Any]) -> list[tuple[str, str]]:
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(
            400, "messages must be a non-empty array", type_="invalid_request_error", param="messages"
        )
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                400, f"messages[{i}] needs a role", type_="invalid_request_error", param="messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(t, str) for t in parts):
                raise ApiError(
                    400,
                    f"messages[{i}].content: only text parts are supported",
                    type_="invalid_request_error",
                    param="messages",
                )
            content = "".join(str(t) for t in parts)
        if not isinstance(content, str):
            raise ApiError(
                400,
                f"messages[{i}].content must be a string",
                type_="invalid_request_error",
                param="messages",
            )
        out.append((m["role"], content))
    return out


def usage(ev: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
    }
