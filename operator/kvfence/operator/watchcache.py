"""The objects whose watches carry their whole body, kept as the last event carried them, so that a
reconcile reads them from memory instead of GETting them (an informer's cache, for three kinds).

Which objects: the TrustClasses, the engine Deployments (the children watch) and the classes'
signing-key Secrets (their own watch, which carries the keys). A class reconcile reads all three,
and most reconciles are caused by an engine Deployment's rollout reporting its status: each event
already carries what a GET would read again.

When a cached body may be read (:meth:`WatchCache.read`), it is never older than anything the
operator itself has seen of that object: every version the operator learns from a request (a GET,
its own apply or status patch: :meth:`WatchCache.learnt`) makes the object's cache wait until the
watch delivers that version (events arrive in order, so the cache is then at least that new), or
until a GET finds the cache at the version it holds. A reconcile therefore never acts on a view
older than one it acted on before (a status flipping back, an Event told twice), and what the
watch has not delivered yet is read from the API server. An object not in the cache is
read from the API server too: an absent entry never means an absent object.

The bodies are kept as compact JSON without ``metadata.managedFields`` (a few KB each) and parsed
on every read, so a caller may change what it gets. The periodic resync clears the cache
(:meth:`clear`): every object is then read from the API server once more, the safety net for a
change a watch missed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from kvfence.operator.builders import ENGINE_NAME, SIGNING_SECRET_NAME

Obj = dict[str, Any]
#: (kind, namespace, name); namespace "" for a cluster-scoped object
Ref = tuple[str, str, str]


def ref_of(obj: Obj) -> Ref:
    meta = obj.get("metadata") or {}
    return (str(obj.get("kind") or ""), str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def version_of(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def operator_objects(ref: Ref) -> bool:
    """The objects the operator's cache holds: TrustClasses, engine Deployments, signing-key Secrets."""
    kind, _, name = ref
    return (
        kind == "TrustClass"
        or (kind == "Deployment" and name == ENGINE_NAME)
        or (kind == "Secret" and name == SIGNING_SECRET_NAME)
    )


class WatchCache:
    """Latest watched body per object, read only once the watch has caught up with the operator."""

    def __init__(self, tracked: Callable[[Ref], bool] = operator_objects) -> None:
        #: which objects the cache holds (and records the learnt versions of)
        self.tracked = tracked
        self._lock = threading.Lock()
        self._bodies: dict[Ref, tuple[str, bytes]] = {}
        #: ref -> a version the operator learnt from a request that the watch has not delivered yet
        self._pending: dict[Ref, str] = {}

    def event(self, ref: Ref, body: Obj | None) -> None:
        """A watch delivered ``body`` (None: the object was deleted)."""
        if not self.tracked(ref):
            return
        if body is None:
            with self._lock:
                self._bodies.pop(ref, None)
            return
        version = version_of(body)
        meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
        data = json.dumps({**body, "metadata": meta}, separators=(",", ":")).encode()
        with self._lock:
            self._bodies[ref] = (version, data)
            if self._pending.get(ref) == version:
                del self._pending[ref]

    def learnt(self, obj: Obj) -> None:
        """A request answered with ``obj``: the cache waits until it is at least this new."""
        ref = ref_of(obj)
        if not self.tracked(ref):
            return
        version = version_of(obj)
        with self._lock:
            cached = self._bodies.get(ref)
            if cached is not None and cached[0] == version:
                self._pending.pop(ref, None)
            else:
                self._pending[ref] = version

    def read(self, ref: Ref) -> Obj | None:
        """The object as its watch last delivered it, or None where it must be read from the API
        server (not cached, or the watch has not delivered a version the operator has learnt)."""
        with self._lock:
            if ref in self._pending:
                return None
            cached = self._bodies.get(ref)
            if cached is None:
                return None
        body: Obj = json.loads(cached[1])
        return body

    def clear(self) -> None:
        """Forget every body (the resync): each object is read from the API server again. The versions
        still awaited stay awaited: an event older than one of them must not be read once cached."""
        with self._lock:
            self._bodies.clear()

    def __len__(self) -> int:
        return len(self._bodies)
