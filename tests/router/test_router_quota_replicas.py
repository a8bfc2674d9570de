"""Quotas follow the live router count: three ``kvfence-router --router-service NS/NAME`` processes in
front of the small contract-speaking upstream, their Service's EndpointSlice on the real apiserver
listing two, then three, then two of them as ready. Whatever the count, what all listed routers admit
together is the tenant's configured limit: exactly, for concurrent requests; for requests per minute,
the configured rate (each bucket refills at its share, so within one refill of the rate)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cluster.localcluster import LocalCluster
from router.support import Proc, auth, request, router_account, standard_table, start_router, write_table
from support.waiting import wait_until

from kvfence.contract.routing import hash_api_key
from kvfence.router.slices import SERVICE_NAME_LABEL

pytestmark = pytest.mark.cluster

NS = "kvf-router-count"
SA = "kvfence-router"
SERVICE = "kvfence-router"
CONCURRENT = 6
RPM = 600  # 10 per second
KEYS = {"pool": "sk-pool-0123456789", "rate": "sk-rate-0123456789"}


def router_slice(count: int) -> dict[str, Any]:
    # Addresses are only counted (the routers are reached by the test directly).
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": f"{SERVICE}-x", "namespace": NS, "labels": {SERVICE_NAME_LABEL: SERVICE}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [f"192.0.2.{100 + i}"], "conditions": {"ready": True}} for i in range(count)
        ]
        + [{"addresses": ["192.0.2.99"], "conditions": {"ready": False}}],  # not ready: not counted
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def divisor(router: Proc) -> float:
    _, _, data = request("GET", router.url + "/metrics")
    for line in data.decode().splitlines():
        if line.startswith("kvfence_router_replicas "):
            return float(line.split()[1])
    return -1.0


@pytest.fixture(scope="module")
def routers(
    cluster: LocalCluster, fake_gold: Proc, fake_silver: Proc, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Proc]]:
    logs = tmp_path_factory.mktemp("router-count")
    cluster.apply(
        [
            *router_account(NS, SA),
            router_slice(2),
        ]
    )
    kubeconfig = cluster.serviceaccount_kubeconfig(NS, SA, logs / "kubeconfig")
    table = standard_table(fake_gold.url, fake_silver.url)
    table["tenants"]["pool"] = {
        "trustClass": "gold",
        "apiKeyHashes": [hash_api_key(KEYS["pool"])],
        "quotas": {"maxConcurrentRequests": CONCURRENT},
    }
    table["tenants"]["rate"] = {
        "trustClass": "gold",
        "apiKeyHashes": [hash_api_key(KEYS["rate"])],
        "quotas": {"requestsPerMinute": RPM},
    }
    write_table(logs / "routing.json", table)
    procs: list[Proc] = []
    try:
        for _ in range(3):
            procs.append(
                start_router(
                    logs,
                    logs / "routing.json",
                    "--router-service",
                    f"{NS}/{SERVICE}",
                    "--kubeconfig",
                    str(kubeconfig),
                )
            )
        yield procs
    finally:
        for p in procs:
            p.stop()


def _hold(router: Proc) -> tuple[int, http.client.HTTPConnection]:
    """A streamed request the upstream holds open after its first chunk (prompt ``GATED``)."""
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    body = {"model": "tiny", "prompt": "GATED hold", "max_tokens": 4, "stream": True}
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {**auth(KEYS["pool"]), "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
    return resp.status, conn


def _concurrent_admitted(listed: list[Proc], gate: Proc) -> int:
    held = [_hold(listed[i % len(listed)]) for i in range(CONCURRENT + 4)]
    statuses = [s for s, _ in held]
    assert set(statuses) <= {200, 429}, statuses
    request("POST", gate.url + "/control/release", {})
    for _, conn in held:
        conn.close()
    return statuses.count(200)


def _rate_admitted(listed: list[Proc]) -> tuple[int, float]:
    """Drain every listed router's bucket, then hammer all of them for a while: (admitted, seconds)."""

    def one(router: Proc) -> int:
        status, _, _ = request(
            "POST",
            router.url + "/v1/completions",
            {"model": "tiny", "prompt": "r", "max_tokens": 1},
            auth(KEYS["rate"]),
        )
        assert status in (200, 429), status
        return status

    for r in listed:  # empty each bucket (a router that just joined starts empty anyway)
        wait_until(lambda r=r: one(r) == 429, "the router's bucket to be empty", 30, 0)
    start = time.monotonic()
    admitted = 0

    def hammer(router: Proc) -> int:
        n = 0
        while time.monotonic() - start < 2.0:
            n += one(router) == 200
            time.sleep(0.005)
        return n

    with ThreadPoolExecutor(len(listed)) as pool:
        admitted = sum(pool.map(hammer, listed))
    return admitted, time.monotonic() - start


def test_each_routers_share_follows_the_ready_router_count_and_the_total_stays_the_limit(
    cluster: LocalCluster, routers: list[Proc], fake_gold: Proc
) -> None:
    for count in (2, 3, 2):
        cluster.apply(router_slice(count))
        listed = routers[:count]
        for r in routers:
            wait_until(
                lambda r=r, n=count: divisor(r) == n, f"every router to count {count} replicas", 10, 0.05
            )
        assert _concurrent_admitted(listed, fake_gold) == CONCURRENT  # 3+3, then 2+2+2, then 3+3
        admitted, seconds = _rate_admitted(listed)
        expected = RPM / 60 * seconds
        print(
            f"{count} routers: admitted {admitted} in {seconds:.2f}s at {RPM}/min (expected {expected:.1f})"
        )
        # The buckets were empty; each refills at limit/count per minute: together, the limit's rate.
        # (A router left counting the old number would admit 3/2 or 2/3 of it.)
        assert expected - count - 2 <= admitted <= expected + count + 1, (count, admitted, expected)
