"""The operator's work-queue keys: what one reconcile is about.

The work queue (:class:`kvfence.operator.workqueue.Controller`) de-duplicates and serialises by key;
:meth:`kvfence.operator.reconciler.Reconciler.reconcile` dispatches on the key's type. ``kind`` labels
the operator's reconcile metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ClassKey:
    """Reconcile a TrustClass: its namespace, engine and children, its status."""

    name: str
    kind: ClassVar[str] = "class"


@dataclass(frozen=True, slots=True)
class ClassSecretKey:
    """The resync's cheap check of a class's signing-key Secret (one GET)."""

    name: str
    kind: ClassVar[str] = "secrets"


@dataclass(frozen=True, slots=True)
class BindingSecretKey:
    """A binding's API-key Secret changed: read it again and decide the routing again."""

    namespace: str
    name: str
    kind: ClassVar[str] = "binding"


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """Decide every binding and render the routing table."""

    kind: ClassVar[str] = "routing"


ROUTING = RoutingKey()

Key = ClassKey | ClassSecretKey | BindingSecretKey | RoutingKey

__all__ = ["ROUTING", "BindingSecretKey", "ClassKey", "ClassSecretKey", "Key", "RoutingKey"]
