"""``--workers N``: several router processes behind one port, per-tenant quotas exact across them.

Real processes over real sockets: a 2-worker ``kvfence-router`` in front of the fake upstream. Each
client connection is first asked ``/readyz`` (which names the worker that holds it), so the tests
place requests on both workers on purpose; the limits must then hold for the sum, not per worker.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from router.support import KEYS, Proc, auth, request, standard_table, start_router, write_table
from support import prom
from support.waiting import wait_until

from kvfence.contract.routing import hash_api_key

WORKERS = 2
CONCURRENT = 3


@pytest.fixture(scope="module")
def workers_router(logs: Path, fake_gold: Proc, fake_silver: Proc) -> Iterator[Proc]:
    table = standard_table(fake_gold.url, fake_silver.url)
    table["tenants"]["pool"] = {
        "trustClass": "gold",
        "apiKeyHashes": [hash_api_key(KEYS["pool"])],
        "quotas": {"maxConcurrentRequests": CONCURRENT},
    }
    table["tenants"]["meter"] = {"trustClass": "gold", "apiKeyHashes": [hash_api_key(KEYS["meter"])]}
    path = logs / "routing-workers.json"
    write_table(path, table)
    router = start_router(logs, path, "--workers", str(WORKERS))
    yield router
    router.stop()


KEYS.setdefault("pool", "sk-pool-shared-concurrency")
KEYS.setdefault("meter", "sk-meter-counted-by-every-worker")


def connect(router: Proc) -> tuple[int, http.client.HTTPConnection]:
    """A keep-alive connection and the worker that accepted it."""
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    conn.request("GET", "/readyz")
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 200, body
    return int(body["worker"]), conn


def on_each_worker(router: Proc, per_worker: int) -> list[tuple[int, http.client.HTTPConnection]]:
    """``per_worker`` open connections on every worker (the kernel picks; we keep what we need)."""
    kept: dict[int, list[tuple[int, http.client.HTTPConnection]]] = {w: [] for w in range(WORKERS)}

    def fill() -> bool:
        w, conn = connect(router)
        if len(kept[w]) < per_worker:
            kept[w].append((w, conn))
        else:
            conn.close()
        return all(len(v) == per_worker for v in kept.values())

    wait_until(fill, f"{per_worker} connections on each of {WORKERS} workers", 30, 0)
    return [c for v in kept.values() for c in v]


def send(conn: http.client.HTTPConnection, key: str, body: dict[str, object]) -> int:
    conn.request(
        "POST", "/v1/completions", json.dumps(body), {**auth(key), "Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    if resp.status != 200 or not body.get("stream"):
        resp.read()
    return resp.status


def test_both_workers_serve_the_one_port(workers_router: Proc) -> None:
    seen: set[int] = set()

    def both() -> bool:
        w, conn = connect(workers_router)
        conn.close()
        seen.add(w)
        return seen == set(range(WORKERS))

    wait_until(both, "every worker to accept a connection", 30, 0)


def test_concurrency_limit_is_exact_across_workers(workers_router: Proc, fake_gold: Proc) -> None:
    conns = on_each_worker(workers_router, CONCURRENT + 1)  # each worker alone could admit CONCURRENT
    body = {"model": "tiny", "prompt": "GATED hold", "max_tokens": 4, "stream": True}
    statuses = [(w, send(conn, KEYS["pool"], body)) for w, conn in conns]
    try:
        admitted = [w for w, s in statuses if s == 200]
        assert {s for _, s in statuses} <= {200, 429}, statuses
        assert len(admitted) == CONCURRENT, statuses  # the sum, not CONCURRENT per worker
    finally:
        request("POST", fake_gold.url + "/control/release", {})
        for _, conn in conns:
            conn.close()
    # Released everywhere: the shared in-flight count is back to zero, on both workers.
    conns = on_each_worker(workers_router, 1)
    quick = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    assert [send(conn, KEYS["pool"], quick) for _, conn in conns] == [200] * WORKERS
    for _, conn in conns:
        conn.close()


def test_requests_per_minute_is_exact_across_workers(workers_router: Proc) -> None:
    """dave may send 3 requests a minute: 3 on each worker, 3 admitted in all."""
    conns = on_each_worker(workers_router, 3)
    quick = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    statuses = [(w, send(conn, KEYS["dave"], quick)) for w, conn in conns]
    for _, conn in conns:
        conn.close()
    assert sorted(s for _, s in statuses) == [200] * 3 + [429] * 3, statuses


def test_tokens_per_minute_is_exact_across_workers(workers_router: Proc, fake_gold: Proc) -> None:
    """frank has 600 tokens a minute; a request reserves its body's bytes plus max_tokens, held
    until it ends: two 290-token requests fit, on whichever workers, a third does not."""
    body: dict[str, object] = {"model": "tiny", "prompt": "GATED t", "stream": True, "max_tokens": 0}
    body["max_tokens"] = 290 - len(json.dumps(body).encode())
    conns = on_each_worker(workers_router, 2)
    statuses = [send(conn, KEYS["frank"], body) for _, conn in conns]
    try:
        assert sorted(statuses) == [200, 200, 429, 429], statuses
    finally:
        request("POST", fake_gold.url + "/control/release", {})
        for _, conn in conns:
            conn.close()


def test_a_worker_that_dies_takes_the_router_down(logs: Path, fake_gold: Proc, fake_silver: Proc) -> None:
    path = logs / "routing-workers-crash.json"
    write_table(path, standard_table(fake_gold.url, fake_silver.url))
    router = start_router(logs, path, "--workers", str(WORKERS), "--shutdown-timeout", "1")
    try:
        found = re.search(r"(\d+) workers \(pids ([\d, ]+)\)", router.output())
        assert found, router.output()
        pids = [int(p) for p in found.group(2).split(", ")]
        assert len(pids) == WORKERS
        os.kill(pids[0], signal.SIGKILL)
        assert router.process is not None and router.popen is not None
        wait_until(lambda: router.popen.poll() is not None, "the supervisor to exit", 30)  # type: ignore[union-attr]
        assert router.popen.returncode == 1
        assert "exited with -9: stopping the others" in router.output()
        for pid in pids[1:]:  # the survivor is gone too
            wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), f"worker {pid} to exit", 30)
    finally:
        router.stop()


def test_sigterm_stops_every_worker_cleanly(logs: Path, fake_gold: Proc, fake_silver: Proc) -> None:
    path = logs / "routing-workers-stop.json"
    write_table(path, standard_table(fake_gold.url, fake_silver.url))
    router = start_router(logs, path, "--workers", str(WORKERS))
    found = wait_until(
        lambda: re.search(r"(\d+) workers \(pids ([\d, ]+)\)", router.output()),
        "the supervisor's line naming its workers",
        30,
    )
    pids = [int(p) for p in found.group(2).split(", ")]
    assert router.process is not None
    assert router.process.stop() == 0, router.output()
    for pid in pids:
        wait_until(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), f"worker {pid} to exit", 30)


def scrape(conn: http.client.HTTPConnection) -> str:
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    assert resp.status == 200, text
    return text


def test_metrics_add_up_over_every_worker(workers_router: Proc, logs: Path) -> None:
    """Worker i serves 2i+1 of meter's requests (1 and 3): whichever worker answers a scrape, the
    page counts all 4 (one worker's own registry would say 1 or 3), and a gauge of what each worker
    holds (requests in flight) is their sum."""
    tenants = len(json.loads((logs / "routing-workers.json").read_text())["tenants"])
    conns = on_each_worker(workers_router, 2)
    quick = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    served = {w: 0 for w in range(WORKERS)}
    try:
        for w, conn in conns:
            if served[w] == 0:
                for _ in range(2 * w + 1):
                    assert send(conn, KEYS["meter"], quick) == 200
                served[w] = 2 * w + 1
        pages = [(w, prom.samples(scrape(conn))) for w, conn in conns]
    finally:
        for _, conn in conns:
            conn.close()
    key = (
        'kvfence_router_requests_total{tenant="meter",trust_class="gold",endpoint="/v1/completions",'
        'code="200"}'
    )
    for w, page in pages:
        assert page.get(key) == 4, (w, {k: v for k, v in page.items() if "meter" in k})
        assert prom.total(page, "kvfence_router_inflight_requests") == 0, w
        # A state every worker observes on its own is shown once, not summed over the workers.
        assert page["kvfence_router_routing_table_tenants"] == tenants, w
        assert page['kvfence_router_engine_healthy{trust_class="gold"}'] == 1, w
