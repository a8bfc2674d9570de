"""Flow control and the upstream pool's shares, through the router process in front of a real upstream
process (fake_upstream.py) over real sockets: a tenant below its share passes while another tenant's
requests fill the engines or wait, a full queue answers 429 with Retry-After, and a client that stops
reading is cut off. Orderings and counts, never timings."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from router.support import (
    GOLD_KEY,
    GOLD_KEY_OLD,
    KEYS,
    Proc,
    auth,
    request,
    standard_table,
    start_fake,
    start_router,
    write_table,
)
from support import prom
from support.waiting import wait_until

QUEUE = 10
QUEUED = "kvfence_router_queued_requests"
REJECTED = "kvfence_router_flow_control_rejections_total"
SLOW = "kvfence_router_slow_clients_total"
HELD = "kvfence_router_held_requests_total"
INFLIGHT = "kvfence_router_inflight_sequences"
SHARE = "kvfence_router_share_sequences"


@dataclass
class Flow:
    router: Proc
    engine: Proc

    def post(self, tenant: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        return request("POST", self.router.url + "/v1/completions", body, auth(KEYS[tenant]), timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples that carry every one of ``labels``."""
        _, _, data = request("GET", self.router.url + "/metrics")
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            v
            for k, v in prom.samples(data.decode()).items()
            if k.partition("{")[0] == name and all(w in k for w in want)
        )

    def prompts(self) -> list[str]:
        _, _, data = request("GET", self.engine.url + "/control/requests")
        return [str(r["body"].get("prompt")) for r in json.loads(data)]

    def waiting(self) -> int:
        _, _, data = request("GET", self.engine.url + "/control/waiting")
        return int(json.loads(data)["waiting"])


@pytest.fixture(scope="module")
def flow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flow]:
    logs: Path = tmp_path_factory.mktemp("flow")
    engine = start_fake(logs, "gold", [GOLD_KEY, GOLD_KEY_OLD])
    table_path = logs / "routing.json"
    write_table(table_path, standard_table(engine.url, "http://127.0.0.1:9"))
    router = start_router(
        logs,
        table_path,
        "--sequences-per-engine", "2",
        "--queue-per-tenant", str(QUEUE),
        "--client-write-timeout", "0.5",
    )  # fmt: skip
    try:
        yield Flow(router, engine)
    finally:
        router.stop()
        engine.stop()


def test_a_flooding_tenant_cannot_make_another_wait_behind_its_backlog(flow: Flow) -> None:
    """Alice fills the engines (two gated streams: the bound is two sequences), then queues ten more
    requests and one past her queue (429 + Retry-After). Bob, below his share (one of the two), is
    answered while all of that waits. His gated stream then takes his share, so his next request is
    held; when the engines free up it is among the first two released, not after Alice's ten."""
    rejected = flow.metric(REJECTED, reason="queue_full", tenant="alice")
    held = flow.metric(HELD, tenant="bob")
    with ThreadPoolExecutor(16) as pool:
        gated = [
            pool.submit(flow.post, "alice", {"model": "tiny", "prompt": f"GATED {i}", "stream": True})
            for i in range(2)
        ]
        wait_until(lambda: flow.waiting() == 2, "both streams at the gate", 30, 0.02)
        backlog = [
            pool.submit(flow.post, "alice", {"model": "tiny", "prompt": f"alice {i}"}) for i in range(QUEUE)
        ]
        wait_until(lambda: flow.metric(QUEUED, tenant="alice") == QUEUE, "alice's backlog held", 30, 0.02)
        status, headers, data = flow.post("alice", {"model": "tiny", "prompt": "one too many"})
        assert status == 429 and headers["retry-after"] == "1", data
        assert json.loads(data)["error"]["code"] == "engine_saturated"
        assert flow.post("bob", {"model": "tiny", "prompt": "bob"})[0] == 200
        assert flow.metric(HELD, tenant="bob") == held and flow.waiting() == 2
        assert flow.metric(QUEUED, tenant="alice") == QUEUE  # answered ahead of all of it
        mine = pool.submit(flow.post, "bob", {"model": "tiny", "prompt": "GATED bob", "stream": True})
        wait_until(lambda: flow.waiting() == 3, "bob's stream at the gate", 30, 0.02)
        victim = pool.submit(flow.post, "bob", {"model": "tiny", "prompt": "bob 2"})
        wait_until(lambda: flow.metric(QUEUED, tenant="bob") == 1, "bob held at his share", 30, 0.02)
        assert "bob 2" not in flow.prompts()  # held at the router, not at the engine
        request("POST", flow.engine.url + "/control/release", {})
        assert all(f.result()[0] == 200 for f in [*gated, *backlog, mine, victim])
    after_gate = [p for p in flow.prompts() if p == "bob 2" or p.startswith("alice ")]
    assert after_gate.index("bob 2") <= 1, after_gate
    assert after_gate.count("bob 2") == 1 and len(after_gate) == QUEUE + 1
    assert flow.metric(REJECTED, reason="queue_full", tenant="alice") == rejected + 1
    assert flow.metric("kvfence_router_inflight_sequences") == 0 and flow.metric(SHARE) == 0


def test_one_request_of_many_prompts_cannot_make_another_tenant_wait(
    flow: Flow, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A router whose engines take four sequences: Alice's one request of sixteen prompts passes (the
    class is idle) and stays at the engine's gate, and her next three are held. Bob's share is two
    sequences (four x 1/2): with a gated stream of his in flight, a plain request passes at once and is
    answered while Alice's request is still at the gate, and so does a second gated stream; a request
    beyond his share is held."""
    logs = tmp_path_factory.mktemp("share")
    write_table(logs / "routing.json", standard_table(flow.engine.url, "http://127.0.0.1:9"))
    router = start_router(logs, logs / "routing.json", "--sequences-per-engine", "4")
    shared = Flow(router, flow.engine)
    prompts = [f"GATED alice {i}" for i in range(16)]
    try:
        with ThreadPoolExecutor(8) as pool:
            big = pool.submit(shared.post, "alice", {"model": "tiny", "prompt": prompts, "stream": True})
            wait_until(lambda: flow.waiting() == 1, "alice's request at the gate", 30, 0.02)
            assert shared.metric(INFLIGHT) == 16
            more = [pool.submit(shared.post, "alice", {"model": "tiny", "prompt": f"a{i}"}) for i in range(3)]
            wait_until(lambda: shared.metric(QUEUED, tenant="alice") == 3, "alice's backlog held", 30, 0.02)
            streams = [
                pool.submit(shared.post, "bob", {"model": "tiny", "prompt": "GATED b1", "stream": True})
            ]
            wait_until(lambda: flow.waiting() == 2, "bob's stream at the gate", 30, 0.02)
            assert shared.metric(SHARE) == 1 and shared.metric(INFLIGHT) == 17
            assert shared.post("bob", {"model": "tiny", "prompt": "b plain"})[0] == 200
            assert flow.waiting() == 2 and shared.metric(QUEUED, tenant="alice") == 3
            streams.append(
                pool.submit(shared.post, "bob", {"model": "tiny", "prompt": "GATED b2", "stream": True})
            )
            wait_until(lambda: flow.waiting() == 3, "bob's second stream at the gate", 30, 0.02)
            assert shared.metric(SHARE) == 2 and shared.metric(HELD, tenant="bob") == 0
            third = pool.submit(shared.post, "bob", {"model": "tiny", "prompt": "b third"})
            wait_until(lambda: shared.metric(QUEUED, tenant="bob") == 1, "bob held at his share", 30, 0.02)
            assert shared.metric(QUEUED, tenant="alice") == 3
            request("POST", flow.engine.url + "/control/release", {})
            assert all(f.result()[0] == 200 for f in [big, *more, *streams, third])
        wait_until(lambda: shared.metric(INFLIGHT) == 0, "every sequence ended", 30, 0.02)
        assert shared.metric(SHARE) == 0 and shared.metric(HELD, tenant="alice") == 3
    finally:
        router.stop()


def test_below_the_bound_nothing_is_held(flow: Flow) -> None:
    held = flow.metric("kvfence_router_held_requests_total")
    for i in range(5):
        status, _, _ = flow.post("bob", {"model": "tiny", "prompt": f"sequential {i}"})
        assert status == 200
    assert flow.metric("kvfence_router_held_requests_total") == held


def read_to_the_end(s: socket.socket) -> bool:
    try:
        while s.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_client_that_stops_reading_a_stream_is_cut_off(flow: Flow) -> None:
    """The client reads the answer's head, then nothing: the router cuts it off, and the stream's
    engine connection and flow-control sequences are freed (a later request passes unheld)."""
    cut = flow.metric(SLOW)
    body = json.dumps({"model": "tiny", "prompt": "FLOOD", "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: {auth(KEYS['bob'])['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", flow.router.port))
        s.sendall(head + body)
        assert s.recv(64).startswith(b"HTTP/1.1 200")
        wait_until(
            lambda: flow.metric("kvfence_router_slow_clients_total") == cut + 1,
            "the slow client cut off",
            60,
            0.1,
        )
        s.settimeout(30)
        assert read_to_the_end(s)  # what was buffered, then the end (a timeout here fails)
    wait_until(lambda: flow.metric("kvfence_router_inflight_sequences") == 0, "its sequences freed", 30, 0.05)
    held = flow.metric("kvfence_router_held_requests_total")
    status, _, _ = flow.post("bob", {"model": "tiny", "prompt": "after the slow one"})
    assert status == 200 and flow.metric("kvfence_router_held_requests_total") == held


def test_held_requests_are_released_by_the_weights_in_the_routing_table(
    flow: Flow, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A router whose engines take one sequence at a time, Bob at weight 2 (``quotas.weight`` in the
    table the operator renders), Alice at 1: with both backlogged, the engine receives their held
    requests in the order alice, bob, bob, alice, bob, bob, ..."""
    logs = tmp_path_factory.mktemp("weights")
    table = standard_table(flow.engine.url, "http://127.0.0.1:9")
    table["tenants"]["bob"]["quotas"] = {"weight": 2}
    write_table(logs / "routing.json", table)
    router = start_router(logs, logs / "routing.json", "--sequences-per-engine", "1")
    weighted = Flow(router, flow.engine)
    try:
        with ThreadPoolExecutor(24) as pool:
            gate = pool.submit(weighted.post, "alice", {"model": "tiny", "prompt": "GATED w", "stream": True})
            wait_until(lambda: flow.waiting() == 1, "the stream at the gate", 30, 0.02)
            futures = []
            for tenant in ("alice", "bob"):
                futures += [
                    pool.submit(weighted.post, tenant, {"model": "tiny", "prompt": f"w-{tenant} {i}"})
                    for i in range(9)
                ]
                wait_until(lambda t=tenant: weighted.metric(QUEUED, tenant=t) == 9, "held", 30, 0.02)
            request("POST", flow.engine.url + "/control/release", {})
            assert all(f.result()[0] == 200 for f in [gate, *futures])
    finally:
        router.stop()
    order = [p.split()[0][2:] for p in flow.prompts() if p.startswith("w-")]
    assert order[:9] == ["alice", "bob", "bob"] * 3, order
    assert sorted(order) == ["alice"] * 9 + ["bob"] * 9
