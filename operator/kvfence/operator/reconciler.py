"""Level-based reconciliation: read what is, build what should be, apply only the difference.

Nothing here depends on kopf: :class:`Reconciler` is driven by typed keys (:mod:`kvfence.operator.keys`)
from the work queue in :mod:`kvfence.operator.workqueue`, and is safe to call again
at any time, for any reason (a watch event, a resync, a retry, a restart). A reconcile that finds the
cluster as it should be sends no write request at all.
"""

from __future__ import annotations

from kvfence.operator.class_reconcile import ClassReconcile
from kvfence.operator.keys import ROUTING, BindingSecretKey, ClassKey, ClassSecretKey, Key, RoutingKey
from kvfence.operator.routing_reconcile import RoutingReconcile


class Reconciler(ClassReconcile, RoutingReconcile):
    """The reconciler: the class reconcile (:mod:`kvfence.operator.class_reconcile`) and the routing
    decision (:mod:`kvfence.operator.routing_reconcile`) over one state
    (:mod:`kvfence.operator.reconcile_base`), driven by key."""

    def reconcile(self, key: Key) -> set[Key]:
        """Reconcile one key; return the keys that must be reconciled because of it."""
        match key:
            case RoutingKey():
                return self.reconcile_routing()
            case ClassKey(name):
                return self.reconcile_class(name)
            case ClassSecretKey(name):
                return self.check_class_secret(name)
            case BindingSecretKey():
                # The binding's API-key Secret changed: its watch recorded the new resourceVersion
                # (:meth:`secret_changed`), so the decision reads the Secret again unless its keys
                # were read at that very version (the watch's first list of Secrets already read).
                return {ROUTING}
        raise ValueError(f"unknown key {key!r}")
