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

:class:`SliceSource` follows them on the event loop (:func:`kvfence.kube.watch.follow`), keeps the
slices per Service and calls back with the merged members.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from kvfence.kube.connection import Connection
from kvfence.kube.watch import AsyncApi, follow
from kvfence.router.endpoints import Member

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


def members_of(obj: dict[str, Any], port_name: str = ENGINE_PORT_NAME) -> list[Member]:
    """The endpoints of one EndpointSlice (``discovery.k8s.io/v1``, as JSON). An endpoint serves when
    its ``ready`` condition is true or unset (the API's advice) and it is not terminating. The port is
    the one named ``port_name``, else the slice's only port; a slice without one lists nothing."""
    ports = obj.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name and p.get("port")), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if not port:
        return []
    out = []
    for ep in obj.get("endpoints") or []:
        addresses = ep.get("addresses")
        if not addresses:
            continue
        cond = ep.get("conditions") or {}
        ready = cond.get("ready") is not False and not cond.get("terminating")
        out.append(Member(addresses[0], int(port), ready))
    return out


class SliceSource:
    """Follows the EndpointSlices of the Services named ``names`` in every namespace and calls
    ``on_change(service, members)`` on the event loop whenever a Service's members change."""

    def __init__(self, names: list[str], on_change: OnChange, kube: Connection) -> None:
        self.names = sorted(set(names))
        self.on_change = on_change
        self.kube = kube
        self.synced = False  # True once the first list arrived
        self._slices: dict[ServiceKey, dict[str, list[Member]]] = {}

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
                self._slices.get(key, {}).pop(obj["metadata"]["name"], None)
            else:
                self._put(obj)
        for key in touched:
            self.on_change(key, self.members(key))

    @staticmethod
    def _key(obj: dict[str, Any]) -> ServiceKey:
        meta = obj["metadata"]
        return meta.get("namespace", ""), (meta.get("labels") or {}).get(SERVICE_NAME_LABEL, "")

    def _put(self, obj: dict[str, Any]) -> ServiceKey:
        key = self._key(obj)
        self._slices.setdefault(key, {})[obj["metadata"]["name"]] = members_of(obj)
        return key

    def _apply(self, event: tuple[str, Any]) -> None:
        try:
            self.apply(event)
        except Exception:  # a malformed object must not stop the source
            log.exception("EndpointSlice event not applied")

    async def run(self) -> None:
        api = AsyncApi(self.kube)
        try:
            await follow(
                api,
                "/apis/discovery.k8s.io/v1/endpointslices",
                {"labelSelector": f"{SERVICE_NAME_LABEL} in ({','.join(self.names)})"},
                lambda items: self._apply(("snapshot", items)),
                lambda kind, obj: self._apply((kind, obj)),
                what="following EndpointSlices",
                forbidden_hint="check the router's ClusterRole: list/watch endpointslices",
            )
        finally:
            await api.close()
