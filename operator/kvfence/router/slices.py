"""Engine replicas and router replicas from EndpointSlices, through the Kubernetes API.

With ``--endpoint-slices`` the router does not dial a trust class's Service by name (where kube-proxy
would pick a replica per pooled connection): it follows the Service's EndpointSlices and picks the
replica itself, per request (:mod:`kvfence.router.endpoints`, :mod:`kvfence.router.balance`). With
``--router-service NAMESPACE/NAME`` it also counts the ready endpoints of its own Service, which is
the number of router replicas that share each tenant's quotas (:mod:`kvfence.router.quotas`).

One list-then-watch over all namespaces, filtered by the label every EndpointSlice carries,
``kubernetes.io/service-name``, to the engine Service name (``kvfence-engine``, the operator's) and
the router's own Service name. All namespaces, because trust class namespaces come and go with the
TrustClasses; EndpointSlices hold addresses and ports only. RBAC: list/watch of endpointslices
(:func:`cluster_role`; the chart renders the same rules).

The Kubernetes client is synchronous: it runs in a daemon thread that hands each change to the event
loop, where :class:`SliceSource` keeps the slices per Service and calls back with the merged members.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client as k8s

from kvfence.router.endpoints import Member
from kvfence.router.source import follow, load_api_client

log = logging.getLogger("kvfence.router.slices")

#: The engine Service's name in every trust class namespace (``kvfence.operator.builders.ENGINE_NAME``;
#: a test keeps them equal).
ENGINE_SERVICE = "kvfence-engine"
#: The engine Service's port name (the slices' port of that name is the engine's).
ENGINE_PORT_NAME = "http"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

ServiceKey = tuple[str, str]  # (namespace, name)
OnChange = Callable[[ServiceKey, list[Member]], None]


def cluster_role(name: str = "kvfence-router-endpointslices") -> dict[str, Any]:
    """What the router's ServiceAccount needs with ``--endpoint-slices``/``--router-service``."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
        ],
    }


def service_of(url: str) -> ServiceKey | None:
    """``(namespace, service)`` of an in-cluster Service URL (``http://NAME.NAMESPACE.svc[.DOMAIN]:PORT``),
    else None (an IP or an outside name: dialed as it is)."""
    host = urlsplit(url).hostname or ""
    parts = host.split(".")
    if len(parts) >= 3 and parts[2] == "svc" and parts[0] and parts[1]:
        return parts[1], parts[0]
    return None


def members_of(obj: Any, port_name: str = ENGINE_PORT_NAME) -> list[Member]:
    """The endpoints of one EndpointSlice (a ``V1EndpointSlice``). An endpoint serves when its
    ``ready`` condition is true or unset (the API's advice) and it is not terminating. The port is the
    one named ``port_name``, else the slice's only port; a slice without one lists nothing."""
    ports = obj.ports or []
    port = next((p.port for p in ports if p.name == port_name and p.port), None)
    if port is None and len(ports) == 1:
        port = ports[0].port
    if not port:
        return []
    out = []
    for ep in obj.endpoints or []:
        if not ep.addresses:
            continue
        cond = ep.conditions
        ready = cond is None or (cond.ready is not False and not cond.terminating)
        out.append(Member(ep.addresses[0], int(port), ready))
    return out


class SliceSource:
    """Follows the EndpointSlices of the Services named ``names`` in every namespace and calls
    ``on_change(service, members)`` on the event loop whenever a Service's members change."""

    def __init__(self, names: list[str], on_change: OnChange, kubeconfig: str | None = None) -> None:
        self.names = sorted(set(names))
        self.on_change = on_change
        self.kubeconfig = kubeconfig
        self.synced = False  # True once the first list arrived
        self._slices: dict[ServiceKey, dict[str, list[Member]]] = {}
        self._stop = threading.Event()

    def members(self, service: ServiceKey) -> list[Member]:
        merged: dict[tuple[str, int], Member] = {}
        for members in self._slices.get(service, {}).values():
            for m in members:
                old = merged.get((m.host, m.port))
                merged[(m.host, m.port)] = m if old is None or m.ready else old
        return list(merged.values())

    def apply(self, event: tuple[str, Any]) -> None:
        """One change, on the event loop: ``("snapshot", [slices])`` after a (re)list, else
        ``("ADDED"|"MODIFIED"|"DELETED", slice)``."""
        kind, obj = event
        touched: set[ServiceKey] = set()
        if kind == "snapshot":
            touched.update(self._slices)
            self._slices = {}
            for s in obj:
                touched.add(self._put(s))
            self.synced = True
        else:
            key = self._key(obj)
            touched.add(key)
            if kind == "DELETED":
                self._slices.get(key, {}).pop(obj.metadata.name, None)
            else:
                self._put(obj)
        for key in touched:
            self.on_change(key, self.members(key))

    @staticmethod
    def _key(obj: Any) -> ServiceKey:
        return obj.metadata.namespace, (obj.metadata.labels or {}).get(SERVICE_NAME_LABEL, "")

    def _put(self, obj: Any) -> ServiceKey:
        key = self._key(obj)
        self._slices.setdefault(key, {})[obj.metadata.name] = members_of(obj)
        return key

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def deliver(item: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        thread = threading.Thread(target=self._follow, args=(deliver,), name="endpointslices", daemon=True)
        thread.start()
        try:
            while True:
                item = await queue.get()
                try:
                    self.apply(item)
                except Exception:  # a malformed object must not stop the source
                    log.exception("EndpointSlice event not applied")
        finally:
            self._stop.set()

    def _follow(self, deliver: Callable[[tuple[str, Any]], None]) -> None:
        api = k8s.DiscoveryV1Api(load_api_client(self.kubeconfig))

        def on_event(kind: str, obj: Any) -> None:
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                deliver((kind, obj))

        follow(
            api.list_endpoint_slice_for_all_namespaces,
            (),
            {"label_selector": f"{SERVICE_NAME_LABEL} in ({','.join(self.names)})"},
            lambda items: deliver(("snapshot", items)),
            on_event,
            self._stop,
            what="following EndpointSlices",
            forbidden_hint="check the router's ClusterRole: list/watch endpointslices",
        )
