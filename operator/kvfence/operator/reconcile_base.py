"""What every reconcile shares: the reconciler's memory (:class:`State`), the keys it asks to be
reconciled later, and the locks that order a class's reconcile against the routing decision.

:class:`~kvfence.operator.reconciler.Reconciler` is this base with the class reconcile
(:mod:`kvfence.operator.class_reconcile`), the child bookkeeping (:mod:`kvfence.operator.bookkeeping`),
the routing decision (:mod:`kvfence.operator.routing_reconcile`) and its API-key cache
(:mod:`kvfence.operator.apikeys`) on top.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvfence.api.common import TenantQuotas
from kvfence.contract import new_signing_key
from kvfence.operator import builders
from kvfence.operator.apply import Kube
from kvfence.operator.bindings import KeyLookup
from kvfence.operator.events import Event
from kvfence.operator.keys import Key

Obj = dict[str, Any]


#: (kind, namespace or "", name) of an object the operator applies
ChildRef = tuple[str, str, str]


#: Requests the routing decision has in flight at once for its per-binding reads and writes.
ROUTING_CONCURRENCY = 8


class Requeue(Exception):
    """Try again later (a dependency is not there yet)."""

    def __init__(self, message: str, delay: float = 2.0) -> None:
        super().__init__(message)
        self.delay = delay


@dataclass
class State:
    """What the reconciler remembers between reconciles (all of it can be rebuilt from the cluster)."""

    signing: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    #: binding key -> ((secret name, secret key, binding resourceVersion), lookup, the Secret's
    #: resourceVersion when it was read)
    keys: dict[str, tuple[tuple[str, str | None, str], KeyLookup, str]] = field(default_factory=dict)
    #: (namespace, name) of an API-key Secret -> the latest resourceVersion its watch reported
    #: (``secretwatch.DELETED`` once deleted). A cached lookup of an older version is read again.
    secret_versions: dict[tuple[str, str], str] = field(default_factory=dict)
    tenant_quotas: dict[str, dict[str, TenantQuotas]] = field(default_factory=dict)
    bound_count: dict[str, int] = field(default_factory=dict)
    class_namespace: dict[str, str] = field(default_factory=dict)
    pending_follow: set[Key] = field(default_factory=set)
    routing_ready: threading.Event = field(default_factory=threading.Event)
    #: classes whose reconcile ran at least once in this process: until then a class without a
    #: signing key is about to get one, and the routing decision does not write "not ready yet" on
    #: its bindings (the class's reconcile queues the decision again, which can say Bound at once)
    class_tried: set[str] = field(default_factory=set)
    #: classes the last routing decision routed (they had a signing key)
    routed: set[str] = field(default_factory=set)
    #: classes waiting for a routing decision that routes them (their tenants' quotas go into the
    #: engine config): the decision wakes them, nobody polls
    awaiting_routing: set[str] = field(default_factory=set)
    #: what a class's reconcile applied while it waited for that decision (namespace, key): told in
    #: the one "Applied" Event of the reconcile that renders the rest
    applied_early: dict[str, list[str]] = field(default_factory=dict)
    #: objects the operator applied, or read and found as desired: their resourceVersion then and the
    #: spec hash of what was desired
    seen: dict[ChildRef, tuple[str, str]] = field(default_factory=dict)
    #: the latest resourceVersion the watches reported for those objects (``secretwatch.DELETED`` once gone)
    watched: dict[ChildRef, str] = field(default_factory=dict)
    #: the :func:`child_digest` of the latest watch event of each of those objects
    digests: dict[ChildRef, str] = field(default_factory=dict)


class ReconcilerBase:
    def __init__(
        self,
        kube: Kube,
        opts: builders.OperatorOptions,
        *,
        emit: Callable[[Event], None] | None = None,
        new_key: Callable[[], bytes] = new_signing_key,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.opts = opts
        self.state = State()
        self._emit = emit or (lambda e: None)
        self._new_key = new_key
        self._clock = clock
        self._routing_lock = threading.Lock()
        self._later_lock = threading.Lock()
        self._routed_lock = threading.Lock()
        self._later: dict[Key, float] = {}
        #: set by the work queue: called (from any thread) when :meth:`later` has keys to take
        self.notify: Callable[[], None] | None = None
        #: set by the work queue when it reconciles other keys while a decision runs (more than one
        #: worker): only then may a decision wait for the renders it queued
        self.renders_meanwhile = False
        #: classes a decision routed for the first time whose reconcile has not run since (guarded by
        #: ``_renders``): their engine configs get their tenants before the decision writes binding
        #: statuses
        self._rendering: set[str] = set()
        self._renders = threading.Condition()
        # The routing decision's per-binding requests (API-key Secret reads, status writes and their
        # Events) are independent of each other: sent ROUTING_CONCURRENCY at a time, not one by one.
        self._fanout = ThreadPoolExecutor(ROUTING_CONCURRENCY, thread_name_prefix="kvfence-routing")

    def later(self, key: Key, delay: float) -> None:
        """Ask for ``key`` to be reconciled again in ``delay`` seconds (the work queue takes these
        after each reconcile, see :meth:`take_later`, and at once when it set :attr:`notify`)."""
        with self._later_lock:
            self._later[key] = min(delay, self._later.get(key, delay))
        if self.notify is not None:
            self.notify()

    def take_later(self) -> dict[Key, float]:
        with self._later_lock:
            out, self._later = self._later, {}
        return out

    def reconcile_routing(self) -> set[Key]:
        """Decide every binding again and write the routing table
        (:mod:`kvfence.operator.routing_reconcile`)."""
        raise NotImplementedError
