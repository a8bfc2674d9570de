"""Malformed-input fuzzing: whatever a client sends, the router answers 2xx/4xx, and a 5xx only when
the engine failed (a relayed engine answer, marked by X-Kvfence-Upstream-Status, or the router's own
upstream-failure errors)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router.fuzzing import auths, bodies, check, headers, paths
from router.support import Stack, request


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=paths, body=bodies, extra_headers=headers, authorization=auths)
def test_fuzz_inference_endpoints(
    stack: Stack, path: str, body: bytes, extra_headers: dict[str, str], authorization: dict[str, str]
) -> None:
    status, resp_headers, data = request(
        "POST", stack.router.url + path, raw=body, headers={**extra_headers, **authorization}
    )
    assert status < 500 or "x-kvfence-upstream-status" in resp_headers or status in (502, 503, 504)
    check(status, resp_headers, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=st.sampled_from(
        ["/v1/models", "/metrics", "/healthz", "/readyz", "/", "/v1/completions/x", "/v1/../v1/models"]
    )
    | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=20).map(
        lambda p: "/" + p.lstrip("/")
    ),
    authorization=auths,
)
def test_fuzz_other_routes(stack: Stack, method: str, path: str, authorization: dict[str, str]) -> None:
    status, resp_headers, data = request(method, stack.router.url + path, headers=authorization, raw=b"")
    assert status < 500
    check(status, resp_headers, data)
