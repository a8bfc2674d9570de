"""The router picks the engine replica: three and more REAL ``kvfence-engine`` processes behind one
trust class, listed in EndpointSlices on the real apiserver, followed by ``kvfence-router
--endpoint-slices`` under a ServiceAccount that holds exactly :func:`kvfence.router.slices.cluster_role`.

Each engine is a replica with its own prefix cache: ``usage.prompt_tokens_details.cached_tokens`` is
the cache oracle, each engine's ``kvfence_engine_requests_total`` says what reached it. The slices
point at the engines' ports on this machine's own (non-loopback: the API refuses 127.0.0.0/8 in a
slice) address, one slice per engine as a slice carries one port list; nothing else in this cluster
reads them (no kube-proxy), so the router is the only consumer.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cluster.localcluster import LocalCluster
from router.support import (
    GOLD_KEY,
    Proc,
    auth,
    engine_metric,
    free_port,
    request,
    router_account,
    standard_table,
    start_engine,
    start_router,
    write_table,
)
from support import prom
from support.waiting import wait_until

from kvfence.contract import cache_namespace
from kvfence.contract.routing import hash_api_key
from kvfence.router.balance import Ring, hash64
from kvfence.router.slices import ENGINE_PORT_NAME, ENGINE_SERVICE, SERVICE_NAME_LABEL

pytestmark = pytest.mark.cluster

NS = "kvf-replicas"
SA = "kvfence-router"
REQUESTS = "kvfence_engine_requests_total"
TENANTS = [f"t{i:02d}" for i in range(40)]


def host_ip() -> str:
    """This machine's first non-loopback IPv4 address (the engines listen there, and only there)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()
    ips = [a for a in out if a.count(".") == 3 and not a.startswith("127.")]
    assert ips, f"no non-loopback IPv4 address on this machine ({out}): EndpointSlices cannot point here"
    return ips[0]


HOST = host_ip()


def key_of(tenant: str) -> str:
    return f"sk-{tenant}-0123456789"


def home_of(tenant: str, engines: list[Proc]) -> Proc:
    """The replica the router's ring gives ``tenant`` first (what the router computes, in the test)."""
    by_key = {f"{HOST}:{e.port}": e for e in engines}
    ring = Ring(sorted(by_key))
    return by_key[ring.members[ring.order(hash64(cache_namespace("gold", tenant, "Tenant")))[0]]]


def slice_of(engine: Proc, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{ENGINE_SERVICE}-{engine.port}",
            "namespace": NS,
            "labels": {SERVICE_NAME_LABEL: ENGINE_SERVICE},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [HOST], "conditions": {"ready": ready}}],
        "ports": [{"name": ENGINE_PORT_NAME, "port": engine.port, "protocol": "TCP"}],
    }


def router_metrics(router: Proc) -> dict[str, float]:
    _, _, data = request("GET", router.url + "/metrics")
    return prom.samples(data.decode())


def metric(router: Proc, prefix: str) -> float:
    return sum(v for k, v in router_metrics(router).items() if k.startswith(prefix))


def post(router: Proc, tenant: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, Any]]:
    status, _, data = request("POST", router.url + "/v1/completions", body, auth(key_of(tenant)), timeout)
    return status, json.loads(data) if data.startswith(b"{") else {"raw": data.decode(errors="replace")}


@dataclass
class Replicas:
    cluster: LocalCluster
    logs: Path
    kubeconfig: Path
    table_path: Path
    engines: list[Proc]
    router: Proc
    extra: list[Proc] = field(default_factory=list)

    def publish(self, *slices: dict[str, Any]) -> None:
        self.cluster.apply(list(slices))

    def withdraw(self, engine: Proc) -> None:
        self.cluster.kubectl(
            "delete", "endpointslice", "-n", NS, f"{ENGINE_SERVICE}-{engine.port}", "--ignore-not-found"
        )

    def start_router(self, *extra: str) -> Proc:
        r = start_router(
            self.logs, self.table_path, "--endpoint-slices", "--kubeconfig", str(self.kubeconfig), *extra
        )
        self.extra.append(r)
        return r

    def start_engine(self, name: str) -> Proc:
        e = start_engine(
            self.logs, name, "gold", "tiny", GOLD_KEY, adapters=("support-bot", "legal-bot"), host=HOST
        )
        self.extra.append(e)
        return e

    def serving(self, router: Proc) -> set[str]:
        return {
            k.split('engine="', 1)[1].split('"', 1)[0]
            for k, v in router_metrics(router).items()
            if k.startswith("kvfence_router_engine_endpoint_serving{")
            and 'trust_class="gold"' in k
            and v == 1
        }


@pytest.fixture(scope="module")
def replicas(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    logs = tmp_path_factory.mktemp("replicas")
    cluster.apply(
        [
            *router_account(NS, SA),
        ]
    )
    kubeconfig = cluster.serviceaccount_kubeconfig(NS, SA, logs / "kubeconfig")
    table = standard_table(
        f"http://{ENGINE_SERVICE}.{NS}.svc.cluster.local:8000", f"http://127.0.0.1:{free_port()}"
    )
    for t in TENANTS:
        table["tenants"][t] = {"trustClass": "gold", "apiKeyHashes": [hash_api_key(key_of(t))]}
    table_path = logs / "routing.json"
    write_table(table_path, table)
    procs: list[Proc] = []
    env: Replicas | None = None
    try:
        for i in range(3):
            procs.append(
                start_engine(
                    logs, f"r{i}", "gold", "tiny", GOLD_KEY, adapters=("support-bot", "legal-bot"), host=HOST
                )
            )
        cluster.apply([slice_of(e) for e in procs])
        router = start_router(logs, table_path, "--endpoint-slices", "--kubeconfig", str(kubeconfig))
        procs.append(router)
        env = Replicas(cluster, logs, kubeconfig, table_path, procs[:3], router)
        wait_until(lambda: len(env.serving(router)) == 3, "the router to serve three replicas", 30, 0.1)
        yield env
    finally:
        for p in reversed([*(env.extra if env else []), *procs]):
            p.stop()


def test_a_tenants_repeat_requests_hit_its_cache_far_more_often_than_with_random_choice(
    replicas: Replicas,
) -> None:
    """Twelve tenants send the same prompt three times each, through a router that keeps tenants on
    their home replica and through one that picks replicas at random; the engines report what hit."""
    random_router = replicas.start_router("--balance", "random")
    wait_until(lambda: len(replicas.serving(random_router)) == 3, "the random router to serve", 30, 0.1)
    rates = {}
    for name, router, tenants in (
        ("affinity", replicas.router, TENANTS[:12]),
        ("random", random_router, TENANTS[12:24]),
    ):
        repeats = hits = cached_tokens = prompt_tokens = 0
        for t in tenants:
            prompt = f"{uuid.uuid4().hex} {t}'s system prompt, long enough to fill a few KV blocks. " * 2
            for i in range(3):
                status, doc = post(router, t, {"model": "tiny", "prompt": prompt, "max_tokens": 1})
                assert status == 200, doc
                got = int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])
                if i:
                    repeats += 1
                    hits += got > 0
                    cached_tokens += got
                    prompt_tokens += int(doc["usage"]["prompt_tokens"])
        rates[name] = (hits / repeats, cached_tokens / prompt_tokens)
    print(  # the report: both hit rates (run with -s to see it)
        "repeat-request hit rate / cached share of prompt tokens: "
        + ", ".join(f"{k} {r:.0%} / {c:.0%}" for k, (r, c) in rates.items())
    )
    assert rates["affinity"][0] == 1.0, rates  # sequential requests never spill: always home, always warm
    # Random over three replicas: a repeat hits only where an earlier copy went (expected 44%).
    assert rates["random"][0] <= 0.75, rates
    assert rates["affinity"][1] >= rates["random"][1] + 0.25, rates


def test_one_tenants_burst_spills_to_other_replicas_instead_of_queueing_behind_its_home(
    replicas: Replicas,
) -> None:
    r, engines = replicas.router, replicas.engines
    tenant = TENANTS[30]
    home = home_of(tenant, engines)
    before = {e.port: engine_metric(e, REQUESTS) for e in engines}
    spills = metric(r, 'kvfence_router_affinity_total{trust_class="gold",result="spill"}')
    body = {"model": "tiny", "prompt": f"{uuid.uuid4().hex} burst", "max_tokens": 48}
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: post(r, tenant, body), range(12)))
    assert all(status == 200 for status, _ in results), results
    got = {e.port: engine_metric(e, REQUESTS) - before[e.port] for e in engines}
    assert sum(got.values()) == 12
    assert sum(1 for n in got.values() if n) >= 2, got  # spread over replicas...
    assert got[home.port] == max(got.values()), got  # ...while its home took the largest part
    assert metric(r, 'kvfence_router_affinity_total{trust_class="gold",result="spill"}') > spills


def test_a_replica_that_is_not_ready_gets_nothing_and_a_ready_one_takes_its_tenants_next_request(
    replicas: Replicas,
) -> None:
    r, engines = replicas.router, replicas.engines
    new = replicas.start_engine("new")
    everyone = [*engines, new]
    tenant = next(t for t in TENANTS if home_of(t, everyone) is new)
    try:
        replicas.publish(slice_of(new, ready=False))
        wait_until(
            lambda: (
                f'kvfence_router_engine_endpoint_serving{{trust_class="gold",engine="{HOST}:{new.port}"}}'
                in router_metrics(r)
            ),
            "the router to know the new (unready) endpoint",
            10,
            0.05,
        )
        for _ in range(5):
            status, doc = post(r, tenant, {"model": "tiny", "prompt": "not yet", "max_tokens": 1})
            assert status == 200, doc
        assert engine_metric(new, REQUESTS) == 0  # never sent to an endpoint that is not ready

        replicas.publish(slice_of(new, ready=True))
        became_ready = time.monotonic()
        serving = f'kvfence_router_engine_endpoint_serving{{trust_class="gold",engine="{HOST}:{new.port}"}}'
        # The router learns it from its EndpointSlice watch (no polling interval of its own): measured
        # and reported, not asserted (tests never assert wall-clock times; 5-30 ms on the dev machine).
        wait_until(
            lambda: router_metrics(r).get(serving) == 1, "the router to serve the new replica", 30, 0.01
        )
        print(
            f"the router served the new replica {time.monotonic() - became_ready:.3f}s after its slice "
            "turned ready"
        )
        # From then on its tenant's very next request goes to it (its home on the ring).
        status, doc = post(r, tenant, {"model": "tiny", "prompt": "now", "max_tokens": 1})
        assert status == 200, doc
        assert engine_metric(new, REQUESTS) == 1
    finally:
        replicas.withdraw(new)
    wait_until(lambda: f"{HOST}:{new.port}" not in replicas.serving(r), "the new replica to leave", 10, 0.05)


def _open_stream(router: Proc, tenant: str, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({**body, "stream": True}),
        {**auth(key_of(tenant)), "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _next_event(resp: Any) -> bytes:
    lines = []
    while True:
        line = resp.readline()
        if not line:
            return b"".join(lines)
        if line in (b"\r\n", b"\n") and lines:
            return b"".join(lines)
        lines.append(line)


def _rest(resp: Any) -> bytes:
    with contextlib.suppress(http.client.IncompleteRead, ConnectionError):
        return bytes(resp.read())
    return b""


def test_a_replica_that_leaves_is_drained_its_streams_finish_and_nothing_new_reaches_it(
    replicas: Replicas,
) -> None:
    r, engines = replicas.router, replicas.engines
    leaving = replicas.start_engine("leaving")
    everyone = [*engines, leaving]
    tenant = next(t for t in TENANTS if home_of(t, everyone) is leaving)
    replicas.publish(slice_of(leaving))
    try:
        wait_until(lambda: f"{HOST}:{leaving.port}" in replicas.serving(r), "the replica to serve", 10, 0.05)
        conn, resp = _open_stream(r, tenant, {"model": "tiny", "prompt": "a long answer", "max_tokens": 400})
        first = _next_event(resp)
        assert first.startswith(b"data: {"), first
        labels = f'{{trust_class="gold",engine="{HOST}:{leaving.port}"}}'
        inflight = router_metrics(r)["kvfence_router_engine_endpoint_inflight_requests" + labels]
        assert inflight == 1  # the stream is on the leaving replica
        replicas.withdraw(leaving)
        wait_until(lambda: f"{HOST}:{leaving.port}" not in replicas.serving(r), "it to leave", 10, 0.05)
        for _ in range(5):  # new requests of its tenant go elsewhere
            status, doc = post(r, tenant, {"model": "tiny", "prompt": "elsewhere", "max_tokens": 1})
            assert status == 200, doc
        rest = _rest(resp)
        conn.close()
        assert b"data: [DONE]" in rest and b'"error"' not in rest  # the in-flight stream finished intact
        assert engine_metric(leaving, REQUESTS) == 1  # the stream (counted when it ended), nothing else
    finally:
        replicas.withdraw(leaving)


def test_a_replica_killed_mid_traffic_costs_no_request_that_could_be_retried(replicas: Replicas) -> None:
    """SIGKILL one of four replicas under load. Requests that had not reached it are sent to another
    replica; one it had received (in flight at the kill) is not sent again, since a request that kills
    its engine must cost one replica only: a 502, at most one per client in flight. A stream that had
    started on it ends with an in-band error."""
    r, engines = replicas.router, replicas.engines
    victim = replicas.start_engine("victim")
    everyone = [*engines, victim]
    homed = [t for t in TENANTS if home_of(t, everyone) is victim][:4]
    others = [t for t in TENANTS if home_of(t, everyone) is not victim][:4]
    assert homed, "no tenant lives on the victim"
    replicas.publish(slice_of(victim))
    try:
        wait_until(lambda: f"{HOST}:{victim.port}" in replicas.serving(r), "the victim to serve", 10, 0.05)
        conn, resp = _open_stream(r, homed[0], {"model": "tiny", "prompt": "interrupted", "max_tokens": 600})
        assert _next_event(resp).startswith(b"data: {")
        retries = metric(r, "kvfence_router_engine_retries_total")
        stop = time.monotonic() + 60
        killed = False
        results: list[tuple[int, dict[str, Any]]] = []

        def traffic(tenant: str) -> None:
            n = 0
            while time.monotonic() < stop and (not killed or n < 15):
                results.append(post(r, tenant, {"model": "tiny", "prompt": f"{tenant} {n}", "max_tokens": 8}))
                n += 1

        with ThreadPoolExecutor(len(homed) + len(others)) as pool:
            futures = [pool.submit(traffic, t) for t in homed + others]
            wait_until(lambda: engine_metric(victim, REQUESTS) >= 5, "traffic on the victim", 30, 0.02)
            assert victim.popen is not None
            victim.popen.kill()  # mid-traffic, no goodbye
            killed = True
            for f in futures:
                f.result()
        bad = [(s, d) for s, d in results if s != 200]
        # Only what the victim had received when it died is lost...
        assert all(s == 502 and d["error"]["code"] == "bad_gateway" for s, d in bad), bad[:5]
        assert len(bad) <= len(homed) + len(others), bad
        assert metric(r, "kvfence_router_engine_retries_total") > retries  # ...because some were retried
        rest = _rest(resp)
        conn.close()
        # The started stream is not replayed elsewhere: its client gets the in-band error.
        assert b'"error"' in rest and b"data: [DONE]" not in rest, rest[-300:]
        assert f"{HOST}:{victim.port}" not in replicas.serving(r)  # unhealthy: off the ring
    finally:
        replicas.withdraw(victim)
