"""Operations: hot reload under load, revocation, unhealthy engines, graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from router.support import (
    GOLD_KEY,
    KEYS,
    SILVER_KEY,
    Proc,
    auth,
    complete,
    request,
    standard_table,
    start_fake,
    start_router,
    write_table,
)
from support import prom
from support.ports import free_port
from support.waiting import wait_until

from kvfence.contract import derive_cache_salt


def wait_for(cond: Callable[[], Any], what: str) -> None:
    wait_until(cond, what, timeout=30.0, interval=0.05)


def metric(router: Proc, sample: str) -> float | None:
    _, _, data = request("GET", router.url + "/metrics")
    return prom.value(data.decode(), sample)


@pytest.fixture
def own_gold(logs: Path) -> Iterator[Proc]:
    p = start_fake(logs, "gold", [GOLD_KEY])
    yield p
    p.stop()


def test_hot_reload_keeps_inflight_requests_and_revokes_keys(
    tmp_path: Path, logs: Path, own_gold: Proc, fake_silver: Proc
) -> None:
    table_path = tmp_path / "routing.json"
    table = standard_table(own_gold.url, fake_silver.url)
    write_table(table_path, table)
    router = start_router(logs, table_path)
    try:

        async def run() -> None:
            url = router.url + "/v1/completions"
            body = {"model": "tiny", "prompt": "GATED reload", "max_tokens": 5, "stream": True}
            async with aiohttp.ClientSession() as s:
                async with s.post(url, json=body, headers=auth(KEYS["alice"])) as held:
                    assert held.status == 200
                    first = await held.content.readany()
                    # revoke alice entirely, rotate gold's signing key order, add a tenant
                    new = json.loads(json.dumps(table))
                    del new["tenants"]["alice"]
                    new["tenants"]["bob"]["quotas"] = {"requestsPerMinute": 1000}
                    write_table(table_path, new)
                    await asyncio.to_thread(
                        wait_for,
                        lambda: metric(router, "kvfence_router_routing_table_generation") == 2,
                        "reload",
                    )
                    async with s.post(
                        url, json={"model": "tiny", "prompt": "x"}, headers=auth(KEYS["alice"])
                    ) as r:
                        assert r.status == 401  # revoked at once
                    async with s.post(
                        url, json={"model": "tiny", "prompt": "x"}, headers=auth(KEYS["bob"])
                    ) as r:
                        assert r.status == 200
                    async with s.post(own_gold.url + "/control/release"):
                        pass
                    rest = await held.content.read()
                events = [e for e in (first + rest).split(b"\n\n") if e.startswith(b"data: {")]
                assert len(events) == 5  # the in-flight stream finished intact
                assert (first + rest).rstrip().endswith(b"[DONE]")

        asyncio.run(asyncio.wait_for(run(), 60))
        # quota state survives a reload: dave (3 requests/minute) uses them up, the table changes,
        # and the fourth is still refused
        for _ in range(3):
            assert complete(router.url, "dave", {"model": "tiny", "prompt": "q"})[0] == 200
        newer = json.loads(table_path.read_text())
        newer["tenants"]["bob"]["quotas"] = {"requestsPerMinute": 999}
        write_table(table_path, newer)
        wait_for(lambda: metric(router, "kvfence_router_routing_table_generation") == 3, "second reload")
        status, headers, _ = complete(router.url, "dave", {"model": "tiny", "prompt": "q"})
        assert status == 429 and int(headers["retry-after"]) >= 1
        # an invalid table is refused; the last good one stays in force
        table_path.write_text("{ not json")
        wait_for(
            lambda: (
                (metric(router, 'kvfence_router_routing_table_reloads_total{result="invalid"}') or 0) >= 1
            ),
            "invalid table noticed",
        )
        assert request("GET", router.url + "/readyz")[0] == 200
        status, _, _ = complete(router.url, "bob", {"model": "tiny", "prompt": "x"})
        assert status == 200
    finally:
        router.stop()


def test_unhealthy_engine_fast_503_and_recovery(tmp_path: Path, logs: Path, own_gold: Proc) -> None:
    """Silver points at a socket that accepts connections but never answers (a hung engine). With
    read timeouts of 10 minutes, only the health probe can make the router answer quickly: the client
    gives up after 30 s, so a router that waits on the engine fails this test."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(1024)
    hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    table_path = tmp_path / "routing.json"
    write_table(table_path, standard_table(own_gold.url, hung_url))
    router = start_router(logs, table_path, "--read-timeout", "600", "--connect-timeout", "600")
    try:
        wait_for(lambda: metric(router, 'kvfence_router_engine_healthy{trust_class="silver"}') == 0, "probe")
        status, headers, data = complete(router.url, "carol", {"model": "small", "prompt": "x"})
        assert status == 503 and headers["retry-after"] == "1"
        err = json.loads(data)["error"]
        assert err["code"] == "engine_unavailable" and "silver" in err["message"]
        # gold is unaffected
        ok = complete(router.url, "bob", {"model": "tiny", "prompt": "x"})
        assert ok[0] == 200
        # gold's engine reports unhealthy -> 503; healthy again -> 200
        assert request("POST", own_gold.url + "/control/health", {"ok": False})[0] == 200
        wait_for(
            lambda: metric(router, 'kvfence_router_engine_healthy{trust_class="gold"}') == 0, "gold down"
        )
        status, _, data = complete(router.url, "bob", {"model": "tiny", "prompt": "x"})
        assert status == 503 and json.loads(data)["error"]["type"] == "service_unavailable"
        assert request("POST", own_gold.url + "/control/health", {"ok": True})[0] == 200
        wait_for(lambda: metric(router, 'kvfence_router_engine_healthy{trust_class="gold"}') == 1, "gold up")
        assert complete(router.url, "bob", {"model": "tiny", "prompt": "x"})[0] == 200
        # the engine process dies: connection refused -> 503 at once (no probe needed)
        own_gold.stop()
        status, _, data = complete(router.url, "bob", {"model": "tiny", "prompt": "x"})
        assert status == 503 and json.loads(data)["error"]["code"] == "engine_unavailable"
    finally:
        router.stop()
        hung.close()


def test_signature_key_mismatch_is_502_not_401(tmp_path: Path, logs: Path, own_gold: Proc) -> None:
    table = standard_table(own_gold.url, own_gold.url)
    table["trustClasses"]["gold"]["signingKeys"] = table["trustClasses"]["silver"]["signingKeys"]
    table_path = tmp_path / "routing.json"
    write_table(table_path, table)
    router = start_router(logs, table_path)
    try:
        status, _, data = complete(router.url, "bob", {"model": "tiny", "prompt": "x"})
        assert status == 502 and json.loads(data)["error"]["code"] == "engine_refused_signature"
        assert SILVER_KEY != GOLD_KEY
    finally:
        router.stop()


def test_graceful_shutdown_finishes_inflight_stream(
    tmp_path: Path, logs: Path, own_gold: Proc, fake_silver: Proc
) -> None:
    table_path = tmp_path / "routing.json"
    write_table(table_path, standard_table(own_gold.url, fake_silver.url))
    router = start_router(logs, table_path, "--drain-delay", "1", "--shutdown-timeout", "60")
    assert router.popen is not None

    async def run() -> bytes:
        url = router.url + "/v1/completions"
        body = {"model": "tiny", "prompt": "GATED shutdown", "max_tokens": 4, "stream": True}
        async with (
            aiohttp.ClientSession() as s,
            s.post(url, json=body, headers=auth(KEYS["bob"])) as held,
        ):
            assert held.status == 200
            first = await held.content.readany()
            assert router.popen is not None
            router.popen.send_signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_for, lambda: request("GET", router.url + "/readyz")[0] == 503, "readyz 503"
            )
            async with s.post(own_gold.url + "/control/release"):
                pass
            return first + await held.content.read()

    try:
        data = asyncio.run(asyncio.wait_for(run(), 60))
        assert len([e for e in data.split(b"\n\n") if e.startswith(b"data: {")]) == 4
        assert router.popen.wait(30) == 0
    finally:
        router.stop()


def test_starts_unready_without_a_table_and_becomes_ready(tmp_path: Path, logs: Path, own_gold: Proc) -> None:
    """The Secret volume is optional: the router must start before the operator wrote any table."""
    table_path = tmp_path / "routing.json"
    router = Proc(
        [
            sys.executable,
            "-m",
            "kvfence.router.server",
            "--routing-table",
            str(table_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--reload-interval",
            "0.1",
        ],
        0,
        "/healthz",
    )
    router.port = int(router.args[router.args.index("--port") + 1])
    router.start(logs)
    try:
        status, _, data = request("GET", router.url + "/readyz")
        assert status == 503 and json.loads(data)["error"]["code"] == "not_ready"
        status, _, data = complete(router.url, "bob", {"model": "tiny", "prompt": "x"})
        assert status == 503 and json.loads(data)["error"]["code"] == "not_ready"
        write_table(table_path, standard_table(own_gold.url, own_gold.url))
        wait_for(lambda: request("GET", router.url + "/readyz")[0] == 200, "ready")
        status, _, _ = complete(router.url, "bob", {"model": "tiny", "prompt": "x"})
        assert status == 200
    finally:
        router.stop()


def test_engine_silent_past_read_timeout_is_504(tmp_path: Path, logs: Path, own_gold: Proc) -> None:
    table_path = tmp_path / "routing.json"
    write_table(table_path, standard_table(own_gold.url, own_gold.url))
    router = start_router(logs, table_path, "--read-timeout", "1")
    try:
        status, headers, data = complete(router.url, "bob", {"model": "tiny", "prompt": "SILENT please"})
        assert status == 504 and "x-kvfence-upstream-status" not in headers
        assert json.loads(data)["error"]["code"] == "engine_timeout"
        # a tokens-per-minute tenant is not charged for a request the engine never answered
        status, _, _ = complete(router.url, "frank", {"model": "tiny", "prompt": "SILENT", "max_tokens": 500})
        assert status == 504
        assert metric(router, 'kvfence_router_tokens_total{tenant="frank"}') is None
        # a slow answer is not an unhealthy engine: the next request goes through
        assert complete(router.url, "bob", {"model": "tiny", "prompt": "fine"})[0] == 200
    finally:
        router.stop()


def test_engine_cookies_never_cross_tenants(tmp_path: Path, logs: Path, own_gold: Proc) -> None:
    """The router's upstream session is shared by all tenants: a cookie an engine sets must neither
    reach the client nor ride along on another tenant's request. (The engine is addressed by a host
    name, as Services are: aiohttp's default jar ignores cookies from bare IP addresses.)"""
    table_path = tmp_path / "routing.json"
    by_name = own_gold.url.replace("127.0.0.1", "localhost")
    write_table(table_path, standard_table(by_name, by_name))
    router = start_router(logs, table_path)
    try:
        status, headers, _ = complete(router.url, "alice", {"model": "tiny", "prompt": "COOKIE"})
        assert status == 200 and "set-cookie" not in headers
        status, _, _ = complete(router.url, "bob", {"model": "tiny", "prompt": "after-cookie"})
        assert status == 200
        _, _, data = request("GET", own_gold.url + "/control/requests")
        seen = [r for r in json.loads(data) if r["body"].get("prompt") == "after-cookie"]
        assert seen and all("cookie" not in {k.lower() for k in r["headers"]} for r in seen)
    finally:
        router.stop()


def test_metrics_port_keeps_metrics_off_the_tenant_port(tmp_path: Path, logs: Path, own_gold: Proc) -> None:
    table_path = tmp_path / "routing.json"
    write_table(table_path, standard_table(own_gold.url, own_gold.url))
    ops_port = free_port()
    router = start_router(logs, table_path, "--metrics-port", str(ops_port))
    try:
        assert complete(router.url, "bob", {"model": "tiny", "prompt": "m"})[0] == 200
        assert request("GET", router.url + "/metrics")[0] == 404
        status, _, data = request("GET", f"http://127.0.0.1:{ops_port}/metrics")
        assert status == 200 and b'kvfence_router_requests_total{tenant="bob"' in data
        assert request("GET", f"http://127.0.0.1:{ops_port}/readyz")[0] == 200
        assert complete(f"http://127.0.0.1:{ops_port}", "bob", {"model": "tiny"})[0] == 404
    finally:
        router.stop()


def test_access_log_names_the_tenant_and_never_the_key_or_the_body(
    tmp_path: Path, logs: Path, own_gold: Proc
) -> None:
    table_path = tmp_path / "routing.json"
    write_table(table_path, standard_table(own_gold.url, own_gold.url))
    router = start_router(logs, table_path, "--access-log")
    secret_prompt = "the-secret-prompt-words"
    try:
        body = {"model": "tiny", "prompt": secret_prompt}
        headers = {**auth(KEYS["bob"]), "X-Request-Id": "req-7"}
        assert request("POST", router.url + "/v1/completions", body, headers=headers)[0] == 200
        assert request("POST", router.url + "/v1/completions", body, headers=auth("sk-wrong-key"))[0] == 401
        assert request("GET", router.url + '/v1/x"}{"forged":1}?q=' + secret_prompt)[0] == 404

        def entries() -> list[dict[str, Any]]:
            marker = "kvfence.router.access: "
            return [json.loads(x.split(marker, 1)[1]) for x in router.output().splitlines() if marker in x]

        wait_for(lambda: len(entries()) >= 3, "three access log lines")
        first, refused, missing = entries()[:3]
        assert first["tenant"] == "bob" and first["status"] == 200 and first["path"] == "/v1/completions"
        assert first["method"] == "POST" and first["request_id"] == "req-7" and first["duration_ms"] >= 0
        assert first["remote"].startswith("127.0.0.1:")
        assert refused["tenant"] is None and refused["status"] == 401
        assert missing["status"] == 404 and missing["path"].startswith("/v1/x")  # one line, escaped
        assert all("forged" not in e for e in entries())
        log = router.output()
        assert KEYS["bob"] not in log and "sk-wrong-key" not in log and secret_prompt not in log
    finally:
        router.stop()


def test_same_request_works_against_vllm_with_the_kvfence_middleware(
    tmp_path: Path, logs: Path, own_gold: Proc
) -> None:
    """``runtime: vllm``: the router's request passes the vLLM middleware, and what vLLM sees is the
    tenant's derived salt in the body (no identity headers, no client-chosen salt)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "current").write_bytes(SILVER_KEY)
    port = free_port()
    vllm = Proc(
        [sys.executable, str(Path(__file__).parent / "fake_vllm.py"), "--port", str(port)],
        port,
        "/health",
        env={"KVFENCE_TRUST_CLASS": "silver", "KVFENCE_SIGNING_KEY_DIR": str(keys)},
    ).start(logs)
    table = standard_table(own_gold.url, vllm.url)
    table["trustClasses"]["silver"]["runtime"] = "vllm"
    table_path = tmp_path / "routing.json"
    write_table(table_path, table)
    router = start_router(logs, table_path)
    try:
        alice_salt = derive_cache_salt(GOLD_KEY, "gold", "tenant/gold/alice")
        status, headers, data = request(
            "POST",
            router.url + "/v1/completions",
            {"model": "small", "prompt": "hi", "cache_salt": alice_salt, "extra_key": "x"},
            headers={**auth(KEYS["carol"]), "X-Tenant-ID": "alice"},
        )
        assert status == 200, data
        saw = json.loads(data)["vllm_saw"]
        assert saw["cache_salt"] == derive_cache_salt(SILVER_KEY, "silver", "class/silver")
        assert "extra_key" not in saw["fields"]
        assert not [h for h in saw["headers"] if h.startswith("x-kvfence-") or h == "x-tenant-id"]
        # streamed, through the middleware, relayed event by event
        status, headers, data = complete(
            router.url, "grace", {"model": "small", "prompt": "hi", "stream": True}
        )
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert data.rstrip().endswith(b"data: [DONE]") and data.count(b"data: {") == len("salted:") + 8
        # straight to the middleware without the router: refused
        assert request("POST", vllm.url + "/v1/completions", {"model": "small", "prompt": "hi"})[0] == 401
    finally:
        router.stop()
        vllm.stop()
