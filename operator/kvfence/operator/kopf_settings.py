"""How the operator runs kopf: its login, its settings, and the two kopf parts it replaces.

The kopf handlers (:mod:`kvfence.operator.handlers`) are event handlers only: each turns a watch event
into a key for the work queue (:mod:`kvfence.operator.workqueue`). kopf's diff base and its per-object
records serve only the handler kinds this operator does not register, so :class:`NoDiffBase` builds
and stores nothing and :class:`EventOnlyMemories` keeps nothing between events.

:class:`EventOnlyMemories` subclasses kopf's private ``kopf._core.reactor.inventory.ResourceMemories``
and :func:`ensure_only_event_handlers` reads the private handler registries of
``kopf.OperatorRegistry``: kopf has no public hook for either. kopf is therefore pinned to one version
in pyproject.toml, and tests/operator/test_kopf_private_hooks.py fails, naming the hook, when a kopf
release changes what these rely on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf
from kopf._core.reactor.inventory import ResourceMemories, ResourceMemory

from kvfence.kube.connection import Connection
from kvfence.kube.connection import load as load_connection
from kvfence.operator.apply import LIST_PAGE
from kvfence.operator.secretwatch import SIGNING_SECRET_FIELD_SELECTOR
from kvfence.operator.workqueue import Controller

#: Set by ``main``: the connection kopf's own watches use (the reconciler's: ``--kubeconfig`` or
#: in-cluster).
LOGIN: dict[str, Connection] = {}


def controller(memo: Any) -> Controller:
    """The work queue of this leadership term, which ``main`` hands to kopf in its memo."""
    c: Controller = memo.controller
    return c


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's watches use the same credentials as the reconciler (``--kubeconfig`` or in-cluster). A
    token from an exec plugin carries its expiry: kopf logs in again then (and on any 401)."""
    conn = LOGIN.get("connection") or load_connection()
    auth = conn.authorization()
    scheme, token = auth.split(" ", 1) if auth and auth.startswith("Bearer ") else (None, None)
    return kopf.ConnectionInfo(
        server=conn.server,
        ca_path=conn.ca_file,
        insecure=conn.insecure,
        scheme=scheme,
        token=token,
        username=conn.username,
        password=conn.password,
        certificate_path=conn.cert_file,
        private_key_path=conn.key_file,
        expiration=conn.token_expiration(),
        trust_env=settings.networking.trust_env,
    )


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base for an operator that has only event handlers (``@kopf.on.event``).

    kopf builds an object's "essence" on every watch event (a deep copy of its body without the
    status, then compared with the last handled one kept in an annotation) for its create, update,
    resume and daemon handlers. This operator registers none of those (each event only queues a key
    for :mod:`kvfence.operator.workqueue`), so the copy is never read; at 1,000 classes and 10,000
    bindings building it and reading the last one back cost 15% of the operator's CPU
    (bench/bench_operator.py --profile).
    Nothing is stored either: the operator writes no bookkeeping onto the objects.
    ``ensure_only_event_handlers`` refuses to start with a handler that would need a real diff base."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class EventOnlyMemories(ResourceMemories):
    """kopf's record of every object it has seen, not kept between events.

    kopf remembers each watched object (its memo, error throttler, daemons, index and resume state:
    ~1 KB) until the object is deleted: 19,000 records at 1,000 classes and 10,000 bindings. Every
    part of it serves a handler kind this operator does not register (daemons, indexes, resume and
    change handlers; :func:`ensure_only_event_handlers` refuses them), so each event gets a fresh
    record, as kopf's admission webhooks do for an object not created yet (``ephemeral``). The
    ``memo`` handlers receive is still a copy of the operator's (it carries the controller)."""

    async def recall(
        self,
        raw_body: Any,
        *,
        memobase: Any = None,
        noticed_by_listing: bool = False,
        ephemeral: bool = False,
    ) -> ResourceMemory:
        return await super().recall(
            raw_body, memobase=memobase, noticed_by_listing=noticed_by_listing, ephemeral=True
        )


def ensure_only_event_handlers(registry: kopf.OperatorRegistry) -> None:
    """Raise if ``registry`` holds a handler kind that reads kopf's diff base (:class:`NoDiffBase`) or
    its per-object records (:class:`EventOnlyMemories`)."""
    others = [
        h.id
        for h in (
            *registry._changing.get_all_handlers(),
            *registry._spawning.get_all_handlers(),
            *registry._indexing.get_all_handlers(),
        )
    ]
    if others:
        raise RuntimeError(
            f"handlers {others} need kopf's diff base or its per-object records, which this operator "
            "does not keep (NoDiffBase, EventOnlyMemories): use @kopf.on.event"
        )


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    ensure_only_event_handlers(kopf.get_default_registry())
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.enabled = False  # the reconciler posts its own, meaningful Events
    settings.scanning.disabled = True  # no CRD/namespace scanning: fewer permissions needed
    settings.watching.server_timeout = 300
    # Secrets are watched by name only: RBAC grants list/watch of this one name (resourceNames), so
    # the server-side field selector is what makes the watch allowed at all.
    settings.watching.field_selectors["", "v1", "secrets"] = SIGNING_SECRET_FIELD_SELECTOR
    settings.networking.request_timeout = 60
    # Memory: kopf's first list of each kind is read a page at a time (as Kube.list reads), not as one
    # answer holding every object, and the per-object worker that holds an object's last event exits
    # after one idle second instead of five (a start-up burst of thousands of objects is not all held).
    settings.watching.chunk_size = LIST_PAGE
    settings.queueing.idle_timeout = 1.0
    await controller(memo).start()


@kopf.on.cleanup()
async def shutdown(memo: Any, **_: Any) -> None:
    await controller(memo).stop()
