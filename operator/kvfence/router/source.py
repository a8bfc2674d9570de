"""The routing table straight from its Secret, through the Kubernetes API.

The operator writes the routing table into the Secret ``kvfence-routing``. Mounted as a volume, a
change reaches the router only when the kubelet next refreshes the volume (its sync period plus its
cache TTL: a minute or more), so a revoked API key would keep working that long. With
``--routing-secret NAMESPACE/NAME`` the router follows the Secret itself (list, then watch, both
filtered to that one name: :func:`kvfence.kube.watch.follow`, on the event loop), and a revocation is
in force about as soon as the operator has written it. The router's ServiceAccount needs
``get``/``list``/``watch`` on that one Secret only (:func:`role`; the chart renders the same rules).

Only the newest version of the Secret is offered to the table (validation and compilation then run as
for the file: :meth:`kvfence.router.table.TableWatcher.offer`). A deleted Secret, a missing key or an
invalid table keeps the table in force (the operator recreates and rewrites it); API errors are
retried with backoff and logged, naming RBAC when the answer is 401/403.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from typing import Any

from kvfence.kube.connection import Connection
from kvfence.kube.watch import AsyncApi, follow
from kvfence.router.table import TableWatcher

log = logging.getLogger("kvfence.router.source")


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


class SecretSource:
    """Follows ``namespace/name`` and offers the table under ``key`` to a :class:`TableWatcher`."""

    def __init__(self, namespace: str, name: str, key: str, kube: Connection) -> None:
        self.namespace, self.name, self.key = namespace, name, key
        self.kube = kube

    @property
    def where(self) -> str:
        return f"Secret {self.namespace}/{self.name}"

    def extract(self, secret: dict[str, Any] | None) -> bytes | str:
        """The table's bytes, or why there are none."""
        data = (secret.get("data") or {}).get(self.key) if secret is not None else None
        if data is None:
            return f"{self.where} has no key {self.key!r}"
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return f"{self.where}: key {self.key!r} is not base64"

    async def run(self, watcher: TableWatcher) -> None:
        queue: asyncio.Queue[bytes | str] = asyncio.Queue()

        def on_list(items: list[dict[str, Any]]) -> None:
            queue.put_nowait(self.extract(items[0]) if items else f"{self.where} not found")

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            queue.put_nowait(self.extract(obj) if kind != "DELETED" else f"{self.where} was deleted")

        api = AsyncApi(self.kube)
        task = asyncio.create_task(
            follow(
                api,
                f"/api/v1/namespaces/{self.namespace}/secrets",
                {"fieldSelector": f"metadata.name={self.name}"},
                on_list,
                on_event,
                what=f"reading {self.where}",
                forbidden_hint="check the router's Role: get/list/watch on this Secret",
            ),
            name="routing-secret",
        )
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
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await api.close()
