"""The operator, the router and a real engine together on the local control plane: what a tenant sees
while the operator acts on an edit.

Nothing runs pods in this cluster, so the parts a kubelet would play are played here, for real
processes on this machine: :class:`EngineMount` copies the class's engine ConfigMap and signing-key
Secret, as the operator wrote them, into the files a real ``kvfence-engine`` process reads (atomically,
as a Secret volume's symlink swap does; ``refresh`` seconds apart, as a kubelet's sync period), and an
EndpointSlice of the class's Service points at that engine. The router is ``kvfence-router
--routing-secret --endpoint-slices`` under a ServiceAccount that may read the routing Secret and the
slices only: it follows the table the operator writes through the API, as in a cluster.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.support import Proc, auth, request, router_account

from kvfence.contract.engine_config import SIGNING_KEY_CURRENT, SIGNING_KEY_PREVIOUS
from kvfence.contract.routing import ROUTING_SECRET_NAME
from kvfence.operator import builders as B
from kvfence.router.slices import ENGINE_PORT_NAME, ENGINE_SERVICE, SERVICE_NAME_LABEL
from kvfence.router.source import role
from support.ports import free_port
from support.waiting import wait_until

ROUTER_SA = "kvfence-router-live"


def host_ip() -> str:
    """This machine's first non-loopback IPv4 address (a slice may not point at 127.0.0.0/8)."""
    import subprocess

    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()
    ips = [a for a in out if a.count(".") == 3 and not a.startswith("127.")]
    assert ips, f"no non-loopback IPv4 address on this machine ({out})"
    return ips[0]


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class EngineMount:
    """A kubelet's part for one engine: the class's ConfigMap and signing Secret, copied to files."""

    def __init__(
        self, kv: Any, namespace: str, directory: Path, host: str, port: int, refresh: float
    ) -> None:
        self.kv, self.namespace, self.dir = kv, namespace, directory
        self.host, self.port, self.refresh = host, port, refresh
        (self.dir / "keys").mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "engine.json"
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync(self) -> bool:
        """Copy what is there now; False while the operator has not written both yet."""
        cm = self.kv.json("get", "configmap", B.CONFIG_NAME, "-n", self.namespace)
        secret = self.kv.json("get", "secret", B.SIGNING_SECRET_NAME, "-n", self.namespace)
        if cm is None or secret is None:
            return False
        cfg = json.loads(cm["data"][B.CONFIG_KEY])
        cfg["signingKeyDir"] = str(self.dir / "keys")
        cfg["listen"] = {"host": self.host, "port": self.port}
        text = json.dumps(cfg, indent=2, sort_keys=True).encode()
        if not self.config_path.exists() or self.config_path.read_bytes() != text:
            _write(self.config_path, text)
        data = secret.get("data") or {}
        for name in (SIGNING_KEY_PREVIOUS, SIGNING_KEY_CURRENT):
            path = self.dir / "keys" / name
            if name in data:
                raw = base64.b64decode(data[name])
                if not path.exists() or path.read_bytes() != raw:
                    _write(path, raw)
            elif path.exists():
                path.unlink()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.refresh):
            try:
                self.sync()
            except Exception as e:  # a kubelet retries at its next sync too
                self.errors.append(repr(e))

    def start(self) -> None:
        wait_until(self.sync, f"the operator's ConfigMap and signing Secret in {self.namespace}", 60, 0.2)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def engine_slice(namespace: str, host: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{ENGINE_SERVICE}-live",
            "namespace": namespace,
            "labels": {SERVICE_NAME_LABEL: ENGINE_SERVICE},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
        "ports": [{"name": ENGINE_PORT_NAME, "port": port, "protocol": "TCP"}],
    }


def router_kubeconfig(cluster: Any, router_ns: str, path: Path) -> Path:
    """A ServiceAccount that may read the routing Secret and the EndpointSlices, nothing else."""
    cluster.apply(
        [
            *router_account(router_ns, ROUTER_SA),  # its namespace, itself, the EndpointSlices' ClusterRole
            role(router_ns, ROUTING_SECRET_NAME, ROUTER_SA),
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": ROUTER_SA, "namespace": router_ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER_SA},
                "subjects": [{"kind": "ServiceAccount", "name": ROUTER_SA, "namespace": router_ns}],
            },
        ]
    )
    p: Path = cluster.serviceaccount_kubeconfig(router_ns, ROUTER_SA, path)
    return p


@dataclass
class Traffic:
    """Completions sent one after another through the router until stopped; every answer recorded."""

    router: Proc
    api_key: str
    model: str
    statuses: list[tuple[int, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            body = {"model": self.model, "prompt": f"request {i}: hello", "max_tokens": 2}
            status, _, data = request(
                "POST", self.router.url + "/v1/completions", body, headers=auth(self.api_key), timeout=30
            )
            self.statuses.append((status, data[:300].decode(errors="replace")))

    def failures(self) -> list[tuple[int, str]]:
        return [s for s in self.statuses if s[0] != 200]

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=60)


def start_engine(mount: EngineMount, logs: Path) -> Proc:
    exe = Path(sys.executable).parent / "kvfence-engine"
    args = [str(exe), "--config", str(mount.config_path), "--log-level", "INFO"]
    return Proc(args, mount.port, "/health", host=mount.host).start(logs, timeout=60)


def start_router(kubeconfig: Path, router_ns: str, logs: Path) -> Proc:
    port = free_port()
    args = [
        sys.executable, "-m", "kvfence.router.server",
        "--routing-secret", f"{router_ns}/{ROUTING_SECRET_NAME}", "--kubeconfig", str(kubeconfig),
        "--endpoint-slices", "--host", "127.0.0.1", "--port", str(port), "--health-interval", "0.2",
        "--log-level", "INFO",
    ]  # fmt: skip
    return Proc(args, port, "/healthz").start(logs)


def complete(router: Proc, api_key: str, model: str) -> int:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    return request("POST", router.url + "/v1/completions", body, headers=auth(api_key), timeout=30)[0]


@dataclass
class LiveStack:
    """A class's engine (fed by an :class:`EngineMount`) and a router, running."""

    mount: EngineMount
    engine: Proc
    router: Proc


@contextmanager
def live_stack(
    cluster: Any, kv: Any, class_ns: str, router_ns: str, logs: Path, refresh: float = 1.0
) -> Iterator[LiveStack]:
    """Start the kubelet's part (:class:`EngineMount`), a real engine behind an EndpointSlice of the
    class's Service and a real router following the operator's routing table; stop them on exit."""
    host = host_ip()
    mount = EngineMount(kv, class_ns, logs / "engine", host, free_port(), refresh=refresh)
    mount.start()
    procs: list[Proc] = []
    try:
        procs.append(start_engine(mount, logs))
        cluster.apply([engine_slice(class_ns, host, mount.port)])
        procs.append(
            start_router(router_kubeconfig(cluster, router_ns, logs / "router-kubeconfig"), router_ns, logs)
        )
        yield LiveStack(mount, procs[0], procs[1])
    finally:
        for p in reversed(procs):
            p.stop()
        mount.stop()


@dataclass(frozen=True)
class BoundTenant:
    """A class with one bound tenant ("acme") on the test control plane: where everything is, and
    the objects that make it (the TrustClass, the tenant namespace, its key Secret and binding)."""

    class_name: str
    class_ns: str
    tenant_ns: str
    router_ns: str
    api_key: str
    model: str
    objects: list[dict[str, Any]]
    tenant: str = "acme"


@contextmanager
def bound_tenant_stack(
    operator: Any, cluster: Any, kv: Any, wait: Any, logs: Path, t: BoundTenant
) -> Iterator[LiveStack]:
    """Apply ``t``'s objects, wait for its binding to be Bound, and run a :func:`live_stack` that
    answers a completion; delete the class and the tenant namespace on exit."""
    assert kv.apply(*t.objects).returncode == 0
    wait(
        lambda: any(
            c.get("type") == "Bound" and c.get("status") == "True"
            for c in ((kv.json("get", "tb", t.tenant, "-n", t.tenant_ns) or {}).get("status") or {}).get(
                "conditions", []
            )
        ),
        f"{t.tenant} Bound",
        120,
        dump=operator.tail,
    )
    try:
        with live_stack(cluster, kv, t.class_ns, t.router_ns, logs) as stack:
            wait(
                lambda: complete(stack.router, t.api_key, t.model) == 200,
                "a completion through the router",
                60,
            )
            yield stack
    finally:
        kv("delete", "trustclass", t.class_name, "--ignore-not-found", "--wait=false")
        kv("delete", "namespace", t.tenant_ns, "--ignore-not-found", "--wait=false")
