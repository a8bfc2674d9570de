"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from kvfence.contract.errors import error_body
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


def error_response(
    status: int,
    message: str,
    code: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(status, error_body(message, code, type_, param), (headers or {}).items())
