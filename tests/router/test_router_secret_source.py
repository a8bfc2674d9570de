"""``kvfence-router --routing-secret NS/NAME`` on the real apiserver: the router follows the routing
table Secret through the API, under a ServiceAccount that may read that one Secret and nothing else."""

from __future__ import annotations

import base64
import gzip
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster.localcluster import LocalCluster
from router.support import KEYS, Proc, auth, request, standard_table
from support.ports import free_port
from support.waiting import wait_until

from kvfence.contract.routing import ROUTING_SECRET_KEY, ROUTING_SECRET_NAME
from kvfence.router.source import role

pytestmark = pytest.mark.cluster

NS = "kvf-router-source"
SA = "kvfence-router"


def _secret(table: bytes | None = None, **data: bytes) -> dict[str, Any]:
    if table is not None:
        data[ROUTING_SECRET_KEY] = table
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": ROUTING_SECRET_NAME, "namespace": NS},
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


@pytest.fixture(scope="module")
def router_kubeconfig(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig for the router's ServiceAccount, bound to :func:`role` only."""
    cluster.apply(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SA, "namespace": NS}},
            role(NS, ROUTING_SECRET_NAME, SA),
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": SA, "namespace": NS},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA},
                "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": NS}],
            },
        ]
    )
    return cluster.serviceaccount_kubeconfig(NS, SA, tmp_path_factory.mktemp("router-sa") / "kubeconfig")


@pytest.fixture
def secret_router(
    cluster: LocalCluster, router_kubeconfig: Path, logs: Path, fake_gold: Proc, fake_silver: Proc
) -> Iterator[Proc]:
    cluster.kubectl("delete", "secret", ROUTING_SECRET_NAME, "-n", NS, "--ignore-not-found")
    args = [
        sys.executable, "-m", "kvfence.router.server",
        "--routing-secret", f"{NS}/{ROUTING_SECRET_NAME}", "--kubeconfig", str(router_kubeconfig),
        "--host", "127.0.0.1", "--port", str(free_port()), "--health-interval", "0.2",
    ]  # fmt: skip
    proc = Proc(args, int(args[args.index("--port") + 1]), "/healthz").start(logs)  # live, not ready
    yield proc
    proc.stop()


def _status(router: Proc, key: str) -> int:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    return request("POST", router.url + "/v1/completions", body, headers=auth(key))[0]


def test_router_follows_the_secret_through_the_api(
    cluster: LocalCluster, secret_router: Proc, fake_gold: Proc, fake_silver: Proc
) -> None:
    router = secret_router

    # No Secret yet: alive, not ready, and it says why (once it has asked the apiserver).
    def settled() -> tuple[int, dict[str, str], bytes] | None:
        r = request("GET", router.url + "/readyz")
        return r if r[0] != 503 or b"not found" in r[2] else None

    status, _, data = wait_until(settled, "readyz to report the missing Secret")
    assert status == 503 and b"Secret kvf-router-source/kvfence-routing not found" in data

    table = standard_table(fake_gold.url, fake_silver.url)
    cluster.apply(_secret(json.dumps(table).encode()))
    wait_until(lambda: request("GET", router.url + "/readyz")[0] == 200, "router ready from the Secret")
    assert _status(router, KEYS["bob"]) == 200 and _status(router, KEYS["alice"]) == 200

    # Revocation: bob's binding is gone from the table the operator writes.
    del table["tenants"]["bob"]
    cluster.apply(_secret(json.dumps(table).encode()))
    wait_until(lambda: _status(router, KEYS["bob"]) == 401, "bob's key revoked")
    assert _status(router, KEYS["alice"]) == 200

    # The gzip form the operator writes for large tables is read as well.
    table["tenants"]["bob"] = standard_table("", "")["tenants"]["bob"]
    cluster.apply(_secret(gzip.compress(json.dumps(table).encode())))
    wait_until(lambda: _status(router, KEYS["bob"]) == 200, "bob back, from a gzipped table")

    # Invalid content, a missing key, a deleted Secret: the table in force stays.
    def invalid_reloads() -> float:
        metrics = request("GET", router.url + "/metrics")[2].decode()
        prefix = 'kvfence_router_routing_table_reloads_total{result="invalid"}'
        line = next((x for x in metrics.splitlines() if x.startswith(prefix)), None)
        return float(line.split()[-1]) if line else 0.0

    cluster.apply(_secret(b'{"version": 1, "trustClasses": 7}'))
    wait_until(lambda: invalid_reloads() >= 1, "the invalid table refused")
    cluster.apply(_secret(None, other=b"x"))
    wait_until(lambda: "has no key" in router.output(), "the missing key noticed")
    cluster.kubectl("delete", "secret", ROUTING_SECRET_NAME, "-n", NS)
    wait_until(lambda: "was deleted" in router.output(), "the deletion noticed")
    assert _status(router, KEYS["bob"]) == 200 and _status(router, KEYS["alice"]) == 200
    assert request("GET", router.url + "/readyz")[0] == 200

    # ... and a Secret created again is picked up (the watch survived all of the above).
    del table["tenants"]["alice"]
    cluster.apply(_secret(json.dumps(table).encode()))
    wait_until(lambda: _status(router, KEYS["alice"]) == 401, "alice revoked after re-creation")


def test_the_routers_role_reads_that_secret_only(cluster: LocalCluster, router_kubeconfig: Path) -> None:
    user = f"--as=system:serviceaccount:{NS}:{SA}"

    def can(*args: str) -> bool:
        return cluster.kubectl("auth", "can-i", *args, user, "-n", NS, check=False).stdout.strip() == "yes"

    assert can("get", f"secret/{ROUTING_SECRET_NAME}") and can("watch", f"secret/{ROUTING_SECRET_NAME}")
    assert not can("get", "secret/something-else")
    assert not can("list", "secrets")  # not without the name
    assert not can("update", f"secret/{ROUTING_SECRET_NAME}")
    assert not can("get", "pods")
