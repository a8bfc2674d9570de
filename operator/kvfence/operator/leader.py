"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that several operator replicas are safe:
only the holder reconciles; the others wait, and take over when it stops renewing."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import Any

from kvfence.operator.apply import Kube, KubeError

log = logging.getLogger("kvfence.operator.leader")

MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _fmt(t: dt.datetime) -> str:
    return t.strftime(MICROTIME)


def _parse(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    for fmt in (MICROTIME, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return dt.datetime.strptime(s, fmt).replace(tzinfo=dt.UTC)
        except ValueError:
            continue
    return None


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_seconds: int = 15,
        renew_seconds: float = 5.0,
        retry_seconds: float = 2.0,
    ) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_seconds, self.renew_seconds, self.retry_seconds = (
            lease_seconds,
            renew_seconds,
            retry_seconds,
        )
        self.is_leader = threading.Event()

    def _lease(self, spec: dict[str, Any], rv: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if rv:
            meta["resourceVersion"] = rv
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def try_acquire_or_renew(self) -> bool:
        now = _now()
        live = self.kube.get("coordination.k8s.io/v1", "Lease", self.name, self.namespace)
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": _fmt(now),
            "renewTime": _fmt(now),
            "leaseTransitions": 0,
        }
        try:
            if live is None:
                self.kube.create(self._lease(spec))
                return True
            old = live.get("spec") or {}
            holder = old.get("holderIdentity") or ""
            renewed = _parse(old.get("renewTime"))
            duration = int(old.get("leaseDurationSeconds") or self.lease_seconds)
            if (
                holder
                and holder != self.identity
                and renewed is not None
                and renewed + dt.timedelta(seconds=duration) > now
            ):
                return False
            if holder == self.identity:
                spec["acquireTime"] = old.get("acquireTime") or spec["acquireTime"]
                spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0)
            else:
                spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + 1
            self.kube.replace(self._lease(spec, live["metadata"]["resourceVersion"]))
            return True
        except KubeError as e:
            if e.conflict:
                return False
            raise

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this replica leads (True) or ``stop`` is set (False)."""
        logged = False
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    self.is_leader.set()
                    log.info("became leader (lease %s/%s)", self.namespace, self.name)
                    return True
            except Exception as e:
                log.warning("leader election: %s", e)
            if not logged:
                log.info("waiting for the leader lease %s/%s", self.namespace, self.name)
                logged = True
            stop.wait(self.retry_seconds)
        return False

    def keep_renewing(self, stop: threading.Event, on_lost: Callable[[], None]) -> threading.Thread:
        def loop() -> None:
            last_ok = _now()
            while not stop.wait(self.renew_seconds):
                try:
                    if self.try_acquire_or_renew():
                        last_ok = _now()
                        continue
                    reason = "another replica holds the lease"
                except Exception as e:
                    reason = str(e)
                    if _now() - last_ok < dt.timedelta(seconds=self.lease_seconds - self.renew_seconds):
                        log.warning("lease renewal failed, retrying: %s", reason)
                        continue
                log.error("lost the leader lease: %s", reason)
                self.is_leader.clear()
                on_lost()
                return

        t = threading.Thread(target=loop, name="lease-renewal", daemon=True)
        t.start()
        return t

    def release(self) -> None:
        """Give the lease up at shutdown so that a standby takes over at once."""
        if not self.is_leader.is_set():
            return
        try:
            live = self.kube.get("coordination.k8s.io/v1", "Lease", self.name, self.namespace)
            if live and (live.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = dict(live["spec"])
                spec["holderIdentity"] = ""
                spec["leaseDurationSeconds"] = 1
                self.kube.replace(self._lease(spec, live["metadata"]["resourceVersion"]))
        except Exception as e:
            log.warning("could not release the lease: %s", e)
        self.is_leader.clear()
