"""A small synchronous Kubernetes client for the operator: GET/LIST/DELETE, server-side apply with the
``kvfence-operator`` field manager, status and metadata patches, Events, Leases.

It speaks JSON over ``urllib3``'s connection pool, on a :class:`kvfence.kube.connection.Connection`
(kubeconfig or in-cluster credentials), and counts every request by verb, so the metrics and the tests
can prove that an operator with nothing to do writes nothing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import urllib3

from kvfence.kube.connection import Connection
from kvfence.operator.builders import FIELD_MANAGER
from kvfence.operator.watchcache import WatchCache

log = logging.getLogger("kvfence.operator.apply")

Obj = dict[str, Any]
T = TypeVar("T")
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class Resource:
    plural: str
    namespaced: bool


#: (apiVersion, kind) -> REST resource, for every kind the operator touches.
RESOURCES: dict[tuple[str, str], Resource] = {
    ("v1", "Namespace"): Resource("namespaces", False),
    ("v1", "ConfigMap"): Resource("configmaps", True),
    ("v1", "Secret"): Resource("secrets", True),
    ("v1", "Service"): Resource("services", True),
    ("v1", "PersistentVolumeClaim"): Resource("persistentvolumeclaims", True),
    ("v1", "Event"): Resource("events", True),
    ("apps/v1", "Deployment"): Resource("deployments", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): Resource("networkpolicies", True),
    ("policy/v1", "PodDisruptionBudget"): Resource("poddisruptionbudgets", True),
    ("coordination.k8s.io/v1", "Lease"): Resource("leases", True),
    ("kvfence.dev/v1alpha1", "TrustClass"): Resource("trustclasses", False),
    ("kvfence.dev/v1alpha1", "TenantBinding"): Resource("tenantbindings", True),
}


#: Keep-alive connections to the API server the operator's client keeps: one for every thread that
#: talks to it at once (the work queue's workers and the routing decision's fan-out).
API_CONNECTIONS = 32
#: Objects per page when the operator lists a kind (see :meth:`Kube.list`).
LIST_PAGE = 500


class KubeError(Exception):
    """A request the API server answered with an error status."""

    def __init__(self, status: int, reason: str, body: str) -> None:
        self.status, self.reason, self.body = status, reason, body
        message = reason
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(body).get("message", reason)
        super().__init__(f"{status}: {message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def forbidden(self) -> bool:
        return self.status == 403

    @property
    def conflict(self) -> bool:
        return self.status == 409


def path_for(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    res = RESOURCES[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if res.namespaced and namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{res.plural}"
    if name:
        base += f"/{name}"
    return base


class Kube:
    """With ``cache``, :meth:`get` reads what the cache holds (the objects whose watches carry their
    bodies, see :mod:`kvfence.operator.watchcache`) instead of sending a request, and every object a
    request answers with tells the cache which version the operator has seen."""

    def __init__(
        self,
        conn: Connection,
        on_request: Callable[[str, str], None] | None = None,
        *,
        cache: WatchCache | None = None,
        on_cache_read: Callable[[str], None] | None = None,
    ) -> None:
        self.conn = conn
        ctx = conn.ssl_context()
        # Connection errors are retried (and read errors of idempotent requests); no statuses.
        self._http = urllib3.PoolManager(
            maxsize=API_CONNECTIONS,
            ssl_context=ctx,
            cert_reqs="CERT_NONE" if conn.insecure else None,
            assert_hostname=False if conn.insecure else None,
            retries=urllib3.Retry(total=3, redirect=False),
            timeout=urllib3.Timeout(total=30),
        )
        self._on_request = on_request
        self.cache = cache
        self._on_cache_read = on_cache_read
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # verb -> count

    # --- transport ------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        url = self.conn.server + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        headers = self.conn.headers()
        headers["Content-Type"] = content_type
        with self._lock:
            self.requests[method] += 1
        if self._on_request is not None:
            self._on_request(method, path.split("/")[-1] if method == "POST" else _resource_of(path))
        payload = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            resp = self._http.request(method, url, headers=headers, body=payload)
        except urllib3.exceptions.HTTPError as e:
            raise KubeError(0, f"{type(e).__name__}: {e}", "") from None
        data = resp.data
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, str(resp.reason), data.decode(errors="replace"))
        out = json.loads(data) if data else None
        if self.cache is not None and isinstance(out, dict) and "kind" in out and method != "DELETE":
            self.cache.learnt(out)
        return out

    def writes(self) -> int:
        with self._lock:
            return sum(n for verb, n in self.requests.items() if verb in WRITE_VERBS)

    # --- reads ----------------------------------------------------------------------------------
    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None, *, cached: bool = True
    ) -> Obj | None:
        """The object, or None if it does not exist. From the watch cache when it holds it (and
        ``cached``): without ``metadata.managedFields`` then; ``cached=False`` reads the API server."""
        if self.cache is not None and cached:
            held = self.cache.read((kind, namespace or "", name))
            if held is not None:
                if self._on_cache_read is not None:
                    self._on_cache_read(RESOURCES[(api_version, kind)].plural)
                return held
        try:
            obj: Obj = self.request("GET", path_for(api_version, kind, namespace, name))
            return obj
        except KubeError as e:
            if e.not_found:
                return None
            raise

    @overload
    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        *,
        page: int = LIST_PAGE,
        each: None = None,
    ) -> list[Obj]: ...

    @overload
    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        *,
        page: int = LIST_PAGE,
        each: Callable[[Obj], T],
    ) -> list[T]: ...

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        *,
        page: int = LIST_PAGE,
        each: Callable[[Obj], Any] | None = None,
    ) -> list[Any]:
        """Every object, read ``page`` at a time (``limit``/``continue``: one consistent snapshot, as
        one LIST would be) and without ``metadata.managedFields``, which the operator never reads and
        which are the largest part of an object written by server-side apply: a list of 10,000
        bindings never holds the whole answer at once. ``each`` maps every object as its page
        arrives (to the part the caller keeps), so the whole objects are never all held either."""
        path = path_for(api_version, kind, namespace)
        items: list[Any] = []
        cont = ""
        while True:
            query = {"limit": str(page)}
            if label_selector:
                query["labelSelector"] = label_selector
            if cont:
                query["continue"] = cont
            try:
                out: Obj = self.request("GET", path, query=query)
            except KubeError as e:
                if e.status == 410 and cont:
                    # The continue token expired (etcd compacted the snapshot): read it all again.
                    items, cont = [], ""
                    continue
                raise
            for item in out.get("items", []):
                (item.get("metadata") or {}).pop("managedFields", None)
                items.append(item if each is None else each(item))
            cont = (out.get("metadata") or {}).get("continue") or ""
            del out  # this page's objects (what each() kept of them stays)
            if not cont:
                return items

    # --- writes ---------------------------------------------------------------------------------
    def apply(self, obj: Obj, *, field_manager: str = FIELD_MANAGER, subresource: str = "") -> Obj:
        """Server-side apply ``obj`` (force: the operator owns every field it sets)."""
        meta = obj["metadata"]
        path = path_for(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if subresource:
            path += f"/{subresource}"
        out: Obj = self.request(
            "PATCH",
            path,
            query={"fieldManager": field_manager, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        return out

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: Obj) -> Obj:
        out: Obj = self.request(
            "PATCH",
            path_for(api_version, kind, namespace, name) + "/status",
            query={"fieldManager": FIELD_MANAGER},
            body={"status": status},
            content_type="application/merge-patch+json",
        )
        return out

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        try:
            self.request(
                "DELETE",
                path_for(api_version, kind, namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
            return True
        except KubeError as e:
            if e.not_found:
                return False
            raise

    def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        out: Obj = self.request(
            "POST", path_for(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj
        )
        return out

    def replace(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        out: Obj = self.request(
            "PUT", path_for(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]), body=obj
        )
        return out


def _resource_of(path: str) -> str:
    parts = [p for p in path.split("/") if p]
    # /api/v1/namespaces/ns/secrets/name[/status] or /apis/g/v/...
    skip = 2 if parts and parts[0] == "api" else 3
    rest = parts[skip:]
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    return rest[0] if rest else "?"


# --- comparing desired with live ------------------------------------------------------------------
def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field of ``desired`` is present in ``live`` with the same value (lists element
    by element, same length). Server-side defaults in ``live`` are ignored; scalars compare as strings
    when their types differ (``2`` vs ``"2"`` for a quantity)."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        return all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return False
        return all(is_subset(d, x) for d, x in zip(desired, live, strict=True))
    if type(desired) is not type(live) and not isinstance(desired, bool) and not isinstance(live, bool):
        return str(desired) == str(live)
    return bool(desired == live)


def manages(obj: Obj | None, manager: str, *path: str) -> bool:
    """Whether ``manager`` owns the field at ``path`` of ``obj`` (server-side apply's managedFields)."""
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") != manager:
            continue
        node: Any = entry.get("fieldsV1") or {}
        for part in path:
            node = node.get(f"f:{part}") if isinstance(node, dict) else None
        if node is not None:
            return True
    return False


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
