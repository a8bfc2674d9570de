"""How the operator configures kopf (no cluster): only event handlers, so no diff base is built or kept."""

from __future__ import annotations

from typing import Any

import kopf
import pytest

from kvfence.operator import handlers


def test_the_operator_registers_only_event_handlers() -> None:
    registry = kopf.get_default_registry()
    handlers.ensure_only_event_handlers(registry)
    ids = {h.id for h in registry._watching.get_all_handlers()}
    assert {"trustclass_event", "tenantbinding_event", "child-deployments", "signing-key-secrets"} <= ids


def test_a_handler_that_needs_a_diff_base_is_refused_at_start() -> None:
    registry = kopf.OperatorRegistry()

    @kopf.on.create("kvfence.dev", "v1alpha1", "trustclasses", registry=registry, id="on-create")
    def created(**_: Any) -> None:
        pass

    with pytest.raises(RuntimeError, match=r"on-create.*diff base"):
        handlers.ensure_only_event_handlers(registry)


def test_no_diff_base_is_copied_or_stored() -> None:
    storage = handlers.NoDiffBase()
    body = kopf.Body({"metadata": {"name": "a", "annotations": {"x": "1"}}, "spec": {"replicas": 2}})
    assert storage.build(body=body) == {}
    assert storage.fetch(body=body) is None
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=kopf.BodyEssence(spec={"replicas": 2}))
    assert not patch  # nothing written onto the object
