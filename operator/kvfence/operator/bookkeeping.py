"""What the reconciler remembers of the objects it applies, so that a reconcile reads and writes only
what changed: each object's spec hash and resourceVersion as last applied or read as desired, the
versions the watches reported since, and the digest of what the operator reads of each.
"""

from __future__ import annotations

import hashlib
import json
import logging

from kvfence.operator import builders, secretwatch
from kvfence.operator.apply import is_subset
from kvfence.operator.reconcile_base import ChildRef, Obj, ReconcilerBase
from kvfence.operator.status import deployment_status_read

log = logging.getLogger("kvfence.operator")


def spec_hash(obj: Obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def with_spec_hash(obj: Obj) -> Obj:
    """``obj`` annotated with the hash of itself: a change of the *desired* object (also a field
    removed) is seen without reading anything but the live annotation."""
    h = spec_hash(obj)
    out = dict(obj)
    meta = dict(out["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), builders.ANNOTATION_SPEC_HASH: h}
    out["metadata"] = meta
    return out


def needs_apply(desired: Obj, live: Obj | None) -> bool:
    if live is None:
        return True
    return not is_subset(desired, live)


#: Children whose status the operator never reads: a change of their status alone is no news.
STATUS_NOT_READ = frozenset({"ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service"})


def child_digest(body: Obj) -> str:
    """A digest of what the operator reads of a child it applies: the whole object but its
    resourceVersion and managed fields, and of its status only what it reads (a Deployment's
    :func:`~kvfence.operator.status.deployment_status_read`; nothing of the kinds in
    :data:`STATUS_NOT_READ`; all of any other's). Two versions with one digest differ only where the
    operator never looks (a PodDisruptionBudget's status, written by the disruption controller as pods
    come and go)."""
    meta = {
        k: v for k, v in (body.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")
    }
    kind = body.get("kind")
    rest = {k: v for k, v in body.items() if k not in ("metadata", "status")}
    if kind == "Deployment":
        rest["status"] = deployment_status_read(body)
    elif kind not in STATUS_NOT_READ:
        rest["status"] = body.get("status")
    return spec_hash({**rest, "metadata": meta})


class ChildBookkeeping(ReconcilerBase):
    def _ensure(self, desired: Obj, live: Obj | None, changed: list[str]) -> Obj | None:
        desired = with_spec_hash(desired)
        if not needs_apply(desired, live):
            self._saw(desired, live)
            return live
        applied = self.kube.apply(desired)
        self._saw(desired, applied)
        changed.append(f"{desired['kind']}/{desired['metadata']['name']}")
        log.info("applied %s %s", desired["kind"], desired["metadata"]["name"])
        return applied

    @staticmethod
    def _ref(obj: Obj) -> ChildRef:
        meta = obj["metadata"]
        return (obj["kind"], meta.get("namespace") or "", meta["name"])

    def _saw(self, desired: Obj, live: Obj | None) -> None:
        """``live`` (applied, or read) is as ``desired`` (annotated with its spec hash)."""
        version = ((live or {}).get("metadata") or {}).get("resourceVersion")
        if version:
            h = desired["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]
            self.state.seen[self._ref(desired)] = (str(version), h)

    def _unchanged(self, obj: Obj) -> bool:
        """Whether ``obj`` (not yet annotated) is what was desired when the live object was last seen
        as desired, and no watch event has reported another version since. An event that does is
        followed by a reconcile of the class (the handlers queue it), which then reads the object:
        every change is still seen, and the operator's own writes coming back cost no read."""
        ref = self._ref(obj)
        seen = self.state.seen.get(ref)
        return (
            seen is not None and seen[1] == spec_hash(obj) and self.state.watched.get(ref, seen[0]) == seen[0]
        )

    def child_event(
        self, kind: str, namespace: str, name: str, resource_version: str, digest: str | None = None
    ) -> bool:
        """A watch saw this version of an object the operator applies (``secretwatch.DELETED``: deleted),
        whose :func:`child_digest` is ``digest`` (None: not known). Returns whether it is news: not
        the version the operator last applied or read as desired (its own write coming back needs no
        reconcile), nor a later one that differs from it only where the operator never looks (same
        digest as that version's event): that one is then remembered as seen, so the class's next
        reconcile does not read it either."""
        ref = (kind, namespace, name)
        seen = self.state.seen.get(ref)
        previous = self.state.digests.pop(ref, None)
        if resource_version == secretwatch.DELETED:
            if seen is None:
                self.state.watched.pop(ref, None)  # nothing remembered of it: nothing to keep
                return True
        elif digest is not None:
            self.state.digests[ref] = digest
            if seen is not None and previous == digest and self.state.watched.get(ref) == seen[0]:
                # The last event was the seen version, with this digest: nothing read has changed.
                self.state.seen[ref] = (resource_version, seen[1])
                self.state.watched[ref] = resource_version
                return False
        self.state.watched[ref] = resource_version
        return seen is None or seen[0] != resource_version

    def forget_children(self) -> None:
        """Read every child again at its class's next reconcile (the resync: a change a watch missed
        while it was down is seen then), the TrustClass, engine and signing key included."""
        self.state.seen.clear()
        if self.kube.cache is not None:
            self.kube.cache.clear()
