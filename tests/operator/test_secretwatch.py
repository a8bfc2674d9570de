"""Pure pieces of the Secret watches (no cluster): which class a signing-key event concerns, which
bindings an API-key Secret event makes stale. The watches themselves run against the real API server
in test_operator_secrets.py."""

from __future__ import annotations

from kvfence.operator.builders import FIELD_MANAGER, LABEL_MANAGED_BY, LABEL_TRUST_CLASS
from kvfence.operator.secretwatch import DELETED, ApiKeyIndex, signing_secret_class, stale_readers

OURS = {LABEL_MANAGED_BY: FIELD_MANAGER, LABEL_TRUST_CLASS: "gold"}


def test_a_signing_key_event_maps_to_the_class_of_its_namespace() -> None:
    namespaces = {"kvf-gold": OURS, "team-a": {"kvfence.dev/tenants": "gold"}}
    assert signing_secret_class("kvf-gold", {}, namespaces, {"gold"}) == "gold"
    # a Secret of that name elsewhere is nobody's, whatever labels it carries
    assert signing_secret_class("team-a", OURS, namespaces, {"gold"}) is None
    # the class must exist
    assert signing_secret_class("kvf-gold", OURS, namespaces, {"silver"}) is None
    # the namespace not seen yet: the Secret's own labels, only if the operator set them
    assert signing_secret_class("kvf-new", OURS, namespaces, {"gold"}) == "gold"
    assert signing_secret_class("kvf-new", {LABEL_TRUST_CLASS: "gold"}, namespaces, {"gold"}) is None
    assert signing_secret_class(None, OURS, namespaces, {"gold"}) is None


def test_the_index_tracks_references_and_the_namespaces_to_watch() -> None:
    idx = ApiKeyIndex()
    assert idx.track("team-a/acme", "team-a", "acme-keys") is True  # a new namespace
    assert idx.track("team-a/beta", "team-a", "acme-keys") is False  # same namespace, shared Secret
    assert idx.readers("team-a", "acme-keys") == {"team-a/acme", "team-a/beta"}
    assert idx.track("team-a/beta", "team-a", "beta-keys") is False  # the binding points elsewhere now
    assert idx.readers("team-a", "acme-keys") == {"team-a/acme"}
    assert idx.secrets("team-a") == {"acme-keys", "beta-keys"}
    assert idx.track("team-b/c", "team-b", "c") is True
    assert idx.namespaces() == {"team-a", "team-b"}
    assert idx.track("team-b/c", "team-b", None) is True  # the binding is gone, and its namespace
    assert idx.namespaces() == {"team-a"} and ("team-b", "c") not in idx
    assert idx.track("team-a/acme", "team-a", "acme-keys") is False  # unchanged
    assert ("team-a", "acme-keys") in idx and idx.ref("team-a/acme") == ("team-a", "acme-keys")


def test_only_events_of_referenced_secrets_at_a_new_version_are_stale() -> None:
    idx = ApiKeyIndex()
    idx.track("team-a/acme", "team-a", "acme-keys")
    idx.track("team-a/beta", "team-a", "acme-keys")
    cache = {"team-a/acme": "100", "team-a/beta": "90"}
    # nobody reads this Secret: ignored, whatever happened to it
    assert stale_readers(idx, "team-a", "unrelated", "101", cache.get) is None
    assert stale_readers(idx, "team-b", "acme-keys", "101", cache.get) is None
    # a restarted watch lists the Secret again at the version already read: nothing to do for acme
    assert stale_readers(idx, "team-a", "acme-keys", "100", cache.get) == {"team-a/beta"}
    assert stale_readers(idx, "team-a", "acme-keys", "101", cache.get) == {"team-a/acme", "team-a/beta"}
    assert stale_readers(idx, "team-a", "acme-keys", DELETED, cache.get) == {"team-a/acme", "team-a/beta"}
    # nothing cached (not read yet, or the last read failed): any version is news, a deletion is not
    assert stale_readers(idx, "team-a", "acme-keys", "5", {}.get) == {"team-a/acme", "team-a/beta"}
    assert stale_readers(idx, "team-a", "acme-keys", DELETED, {}.get) == frozenset()
