"""The routing table straight from its Secret, through the Kubernetes API.

The operator writes the routing table into the Secret ``kvfence-routing``. Mounted as a volume, a
change reaches the router only when the kubelet next refreshes the volume (its sync period plus its
cache TTL: a minute or more), so a revoked API key would keep working that long. With
``--routing-secret NAMESPACE/NAME`` the router follows the Secret itself (list, then watch, both
filtered to that one name), and a revocation is in force about as soon as the operator has written
it. The router's ServiceAccount needs ``get``/``list``/``watch`` on that one Secret only
(:func:`role`; the chart renders the same rules).

The Kubernetes client is synchronous: it runs in a daemon thread that hands each version of the
Secret to the event loop; validation and compilation then run as for the file
(:meth:`kvfence.router.table.TableWatcher.offer`). A deleted Secret, a missing key or an invalid table
keeps the table in force (the operator recreates and rewrites it); API errors are retried with
backoff and logged, naming RBAC when the answer is 401/403.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch

from kvfence.router.table import TableWatcher

log = logging.getLogger("kvfence.router.source")

#: Seconds a single watch lasts before it is renewed (the server ends it; the router then relists).
WATCH_SECONDS = 240


def follow(
    list_fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_list: Any,
    on_event: Any,
    stop: threading.Event,
    *,
    what: str,
    forbidden_hint: str,
) -> None:
    """List, then watch from the listed version, until ``stop``: ``on_list(items)`` after every list,
    ``on_event(type, object)`` for every watch event. A watch that ends lists again; an expired
    version (410) lists again at once; any other error is logged (with ``forbidden_hint`` on 401/403)
    and retried with a backoff up to 30 s. Runs in a thread of its own (the client is blocking)."""
    backoff = 1.0
    while not stop.is_set():
        try:
            listed = list_fn(*args, _request_timeout=30, **kwargs)
            on_list(listed.items)
            w = k8s_watch.Watch()  # type: ignore[no-untyped-call]
            for event in w.stream(  # type: ignore[no-untyped-call]
                list_fn,
                *args,
                resource_version=listed.metadata.resource_version if listed.metadata else None,
                timeout_seconds=WATCH_SECONDS,
                _request_timeout=WATCH_SECONDS + 30,
                **kwargs,
            ):
                if stop.is_set():
                    w.stop()  # type: ignore[no-untyped-call]
                    break
                on_event(event["type"], event["object"])
            backoff = 1.0
            continue  # the watch ended normally: list again, then watch again
        except k8s.ApiException as e:
            if e.status == 410:  # the resource version is too old: list again at once
                continue
            hint = f" ({forbidden_hint})" if e.status in (401, 403) else ""
            log.error("%s failed: %s %s%s", what, e.status, e.reason, hint)
        except Exception as e:  # connection errors and the like: retried
            log.error("%s failed: %s: %s", what, type(e).__name__, e)
        stop.wait(backoff)
        backoff = min(backoff * 2, 30.0)


def role(namespace: str, secret_name: str, name: str = "kvfence-router") -> dict[str, Any]:
    """The Role the router's ServiceAccount needs in ``--routing-secret`` mode: read one Secret.
    (A list or watch is allowed by ``resourceNames`` when it selects that name with a field selector.)"""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [secret_name],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }


def load_api_client(kubeconfig: str | None) -> k8s.ApiClient:
    """In-cluster config when running in a pod (and no kubeconfig is given), else the kubeconfig."""
    cfg = k8s.Configuration()
    if kubeconfig:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return k8s.ApiClient(cfg)


class SecretSource:
    """Follows ``namespace/name`` and offers the table under ``key`` to a :class:`TableWatcher`."""

    def __init__(self, namespace: str, name: str, key: str, kubeconfig: str | None = None) -> None:
        self.namespace, self.name, self.key = namespace, name, key
        self.kubeconfig = kubeconfig
        self._stop = threading.Event()

    @property
    def where(self) -> str:
        return f"Secret {self.namespace}/{self.name}"

    async def run(self, watcher: TableWatcher) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | str] = asyncio.Queue()

        def deliver(item: bytes | str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        thread = threading.Thread(target=self._follow, args=(deliver,), name="routing-secret", daemon=True)
        thread.start()
        try:
            while True:
                item = await queue.get()
                while not queue.empty():  # only the newest version matters
                    item = queue.get_nowait()
                if isinstance(item, str):
                    watcher.missing(item)
                else:
                    await watcher.offer(item)
        finally:
            self._stop.set()

    def _extract(self, secret: Any) -> bytes | str:
        data = (secret.data or {}).get(self.key) if secret is not None else None
        if data is None:
            return f"{self.where} has no key {self.key!r}"
        return base64.b64decode(data)

    def _follow(self, deliver: Any) -> None:
        api = k8s.CoreV1Api(load_api_client(self.kubeconfig))

        def on_list(items: list[Any]) -> None:
            deliver(self._extract(items[0]) if items else f"{self.where} not found")

        def on_event(kind: str, obj: Any) -> None:
            if kind in ("ADDED", "MODIFIED"):
                deliver(self._extract(obj))
            elif kind == "DELETED":
                deliver(f"{self.where} was deleted")

        follow(
            api.list_namespaced_secret,
            (self.namespace,),
            {"field_selector": f"metadata.name={self.name}"},
            on_list,
            on_event,
            self._stop,
            what=f"reading {self.where}",
            forbidden_hint="check the router's Role: get/list/watch on this Secret",
        )
