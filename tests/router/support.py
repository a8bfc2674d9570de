"""Helpers for the router tests: processes, ports, a tiny HTTP client, the standard routing table."""

from __future__ import annotations

import base64
import http.client
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import prom
from support.ports import free_port
from support.process import ManagedProcess

from kvfence.contract.routing import hash_api_key
from kvfence.router.slices import cluster_role

HERE = Path(__file__).parent
GOLD_KEY = bytes(range(32))
GOLD_KEY_OLD = bytes(range(1, 33))
SILVER_KEY = bytes(range(100, 132))


def b64(k: bytes) -> str:
    return base64.b64encode(k).decode()


@dataclass
class Proc:
    """A server process of the router tests, started and ready once ``ready_path`` answers 200."""

    args: list[str]
    port: int
    ready_path: str
    env: dict[str, str] | None = None
    process: ManagedProcess | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        return None if self.process is None else self.process.popen

    def start(self, log_dir: Path, timeout: float = 30.0) -> Proc:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        self.process = ManagedProcess(self.args, log_dir / f"proc-{self.port}.log", env=env).start()
        self.process.wait_ready(
            lambda: request("GET", self.url + self.ready_path, timeout=1)[0] == 200,
            f"{Path(self.args[0]).name} {self.args[1:3]} answering {self.ready_path}",
            timeout,
        )
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def output(self) -> str:
        return self.process.output() if self.process is not None else ""


def request(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; returns (status, headers lower-cased, body)."""
    assert url.startswith("http://")
    hostport, _, path = url[7:].partition("/")
    host, _, port = hostport.partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = dict(headers or {})
        if data is not None:
            h.setdefault("Content-Type", "application/json")
        conn.request(method, "/" + path, body=data, headers=h)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(base_url: str, tenant: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """``POST /v1/completions`` with the API key of ``tenant`` (a name in :data:`KEYS`)."""
    return request("POST", base_url + "/v1/completions", body, headers=auth(KEYS[tenant]))


# Tenants of the standard table: API key -> (tenant, trust class)
KEYS = {
    "alice": "sk-alice-0123456789",
    "alice2": "sk-alice-second-key",
    "bob": "sk-bob-0123456789",
    "carol": "sk-carol-0123456789",
    "dave": "sk-dave-rpm-limited",
    "erin": "sk-erin-one-at-a-time",
    "frank": "sk-frank-tpm-limited",
    "grace": "sk-grace-class-scope",
}


def standard_table(gold_url: str, silver_url: str, **overrides: Any) -> dict[str, Any]:
    table: dict[str, Any] = {
        "version": 1,
        "trustClasses": {
            "gold": {
                "endpoint": gold_url,
                "runtime": "reference",
                "servedModels": ["tiny"],
                "adapters": ["support-bot", "legal-bot"],
                "cacheScope": "Tenant",
                "signingKeys": [b64(GOLD_KEY), b64(GOLD_KEY_OLD)],
            },
            "silver": {
                "endpoint": silver_url,
                "servedModels": ["small"],
                "cacheScope": "TrustClass",
                "signingKeys": [b64(SILVER_KEY)],
            },
        },
        "tenants": {
            "alice": {
                "trustClass": "gold",
                "apiKeyHashes": [hash_api_key(KEYS["alice"]), hash_api_key(KEYS["alice2"])],
                "allowedAdapters": ["support-bot"],
            },
            "bob": {"trustClass": "gold", "apiKeyHashes": [hash_api_key(KEYS["bob"])]},
            "carol": {"trustClass": "silver", "apiKeyHashes": [hash_api_key(KEYS["carol"])]},
            "grace": {"trustClass": "silver", "apiKeyHashes": [hash_api_key(KEYS["grace"])]},
            "dave": {
                "trustClass": "gold",
                "apiKeyHashes": [hash_api_key(KEYS["dave"])],
                "quotas": {"requestsPerMinute": 3},
            },
            "erin": {
                "trustClass": "gold",
                "apiKeyHashes": [hash_api_key(KEYS["erin"])],
                "quotas": {"maxConcurrentRequests": 1},
            },
            "frank": {
                "trustClass": "gold",
                "apiKeyHashes": [hash_api_key(KEYS["frank"])],
                "quotas": {"tokensPerMinute": 600},
            },
        },
    }
    table.update(overrides)
    return table


def write_table(path: Path, table: dict[str, Any]) -> None:
    """Replace the file atomically (as a Secret mount's symlink swap does)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, path)


def start_fake(log_dir: Path, trust_class: str, keys: list[bytes]) -> Proc:
    port = free_port()
    args = [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(port), "--trust-class", trust_class]
    for k in keys:
        args += ["--key-b64", b64(k)]
    return Proc(args, port, "/health").start(log_dir)


def start_router(log_dir: Path, table_path: Path, *extra: str, env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    args = [
        sys.executable, "-m", "kvfence.router.server",
        "--routing-table", str(table_path), "--host", "127.0.0.1", "--port", str(port),
        "--reload-interval", "0.1", "--health-interval", "0.2", "--log-level", "INFO", *extra,
    ]  # fmt: skip
    return Proc(args, port, "/readyz", env=env).start(log_dir)


@dataclass
class Stack:
    router: Proc
    gold: Proc
    silver: Proc
    table_path: Path
    procs: list[Proc] = field(default_factory=list)

    def post(self, key: str, path: str, body: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return request(
            "POST", self.router.url + path, body, headers={**auth(key), **kw.pop("headers", {})}, **kw
        )

    def upstream_requests(self, proc: Proc) -> list[dict[str, Any]]:
        status, _, data = request("GET", proc.url + "/control/requests")
        assert status == 200
        result: list[dict[str, Any]] = json.loads(data)
        return result


def start_engine(
    log_dir: Path,
    name: str,
    trust_class: str,
    served: str,
    key: bytes,
    *,
    adapters: tuple[str, ...] = (),
    scope: str = "Tenant",
    prefix_cache: bool = True,
    num_blocks: int = 2048,
    host: str = "127.0.0.1",
) -> Proc:
    """A real reference engine process (``kvfence-engine --config FILE``), listening on ``host``."""
    d = log_dir / f"engine-{name}"
    (d / "keys").mkdir(parents=True, exist_ok=True)
    (d / "keys" / "current").write_bytes(key)
    port = free_port()
    config = {
        "trustClass": trust_class,
        "model": {"name": f"kvfence/{served}", "revision": "1", "servedName": served},
        "adapters": list(adapters),
        "blockSize": 16,
        "numBlocks": num_blocks,
        "maxModelLen": 1024,
        "prefixCache": {"enabled": prefix_cache, "scope": scope, "hashAlgorithm": "sha256"},
        "signingKeyDir": str(d / "keys"),
        "listen": {"host": host, "port": port},
    }
    (d / "engine.json").write_text(json.dumps(config))
    exe = Path(sys.executable).parent / "kvfence-engine"
    return Proc(
        [str(exe), "--config", str(d / "engine.json"), "--log-level", "WARNING"], port, "/health", host=host
    ).start(log_dir, timeout=60)


def engine_metric(engine: Proc, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) on an engine's /metrics."""
    _, _, data = request("GET", engine.url + "/metrics")
    return prom.total(data.decode(), name)


@dataclass
class EngineStack:
    """The router in front of real reference engines (gold: per-tenant cache scope; silver: the trust
    class shares), plus a second router in front of *cold* engines (prefix cache disabled) that
    computes the oracle answers."""

    router: Proc
    gold: Proc
    silver: Proc
    cold_router: Proc


def router_account(namespace: str, service_account: str) -> list[dict[str, Any]]:
    """A namespace and ServiceAccount for a router under test, bound to exactly the ClusterRole the
    chart gives the router (kvfence.router.slices.cluster_role: EndpointSlices, list and watch)."""
    role = cluster_role(f"{service_account}-{namespace}")
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": service_account, "namespace": namespace},
        },
        role,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role["metadata"]["name"]},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role["metadata"]["name"],
            },
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
        },
    ]
