"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from kvfence.router.http import Response


class RouterError(Exception):
    """An error the router answers itself (as opposed to one relayed from an engine)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type_
        self.param = param
        self.headers = headers or {}

    def response(self) -> Response:
        return error_response(self.status, self.message, self.code, self.type, self.param, self.headers)


def error_body(message: str, code: str, type_: str, param: str | None = None) -> bytes:
    doc = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def error_response(
    status: int,
    message: str,
    code: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(status, error_body(message, code, type_, param), (headers or {}).items())
