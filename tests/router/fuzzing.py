"""Hypothesis strategies for malformed client input, and the check every answer must pass."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st
from router.support import KEYS

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
