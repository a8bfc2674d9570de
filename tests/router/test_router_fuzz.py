"""Malformed-input fuzzing: whatever a client sends, the router answers 2xx/4xx, and a 5xx only when
the engine failed (a relayed engine answer, marked by X-Kvfence-Upstream-Status, or the router's own
upstream-failure errors)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router.support import KEYS, Stack, request

UPSTREAM_FAILURE_CODES = {"engine_unavailable", "engine_timeout", "bad_gateway", "engine_refused_signature"}

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
known_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "small", "support-bot", "legal-bot", ""]) | json_values,
        "prompt": st.text(max_size=50) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]), "content": json_values}),
            max_size=3,
        )
        | json_values,
        "max_tokens": st.integers(-5, 40) | json_values,
        "max_completion_tokens": st.integers(-5, 40) | json_values,
        "n": st.integers(-1, 3) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "cache_salt": json_values,
        "extra_key": json_values,
        "kv_transfer_params": json_values,
        "temperature": json_values,
    },
)
bodies = st.one_of(
    st.builds(
        lambda k, extra: json.dumps({**extra, **k}).encode(),
        known_fields,
        st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    ),
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"", b"{", b'{"model": NaN}', b"[" * 5000, b'{"model":"tiny","prompt":"\\ud800"}']),
)
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
headers = st.dictionaries(
    st.sampled_from(
        [
            "X-Tenant-ID",
            "X-Kvfence-Tenant",
            "X-Kvfence-Signature",
            "X-Cache-Salt",
            "Content-Type",
            "Accept",
            "X-Request-Id",
            "Traceparent",
            "Accept-Encoding",
            "Expect-Not",
        ]
    ),
    header_values,
    max_size=4,
)
auths = st.sampled_from([KEYS["alice"], KEYS["bob"], KEYS["carol"], "wrong", ""]).map(
    lambda k: {"Authorization": f"Bearer {k}"} if k else {}
)
paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])


def check(status: int, resp_headers: dict[str, str], data: bytes) -> None:
    relayed = "x-kvfence-upstream-status" in resp_headers
    if relayed:
        assert resp_headers["x-kvfence-upstream-status"] == str(status)
        return
    if status >= 400:
        err: dict[str, Any] = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        if status >= 500:
            assert err["code"] in UPSTREAM_FAILURE_CODES, (status, err)


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
