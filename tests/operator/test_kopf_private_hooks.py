"""The private kopf hooks the operator relies on (:mod:`kvfence.operator.kopf_settings`), checked
against the installed kopf: a kopf release that changes one of them fails here, naming the hook,
instead of at the operator's start or, worse, silently keeping what the operator means to drop.

kopf is pinned to one version in pyproject.toml; moving the pin means reading these hooks in the new
release and updating this file with what changed."""

from __future__ import annotations

import dataclasses
import inspect
import re
import tomllib
from importlib import metadata
from pathlib import Path

import kopf
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pinned_kopf() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.fullmatch(r"kopf==([\w.]+)", d.replace(" ", "")))]
    assert len(pins) == 1, f"pyproject.toml must pin kopf to one exact version (kopf==X.Y.Z), has {deps}"
    return pins[0]


def test_the_installed_kopf_is_the_pinned_one() -> None:
    pinned, installed = _pinned_kopf(), metadata.version("kopf")
    assert installed == pinned, (
        f"kopf {installed} is installed, pyproject.toml pins {pinned}: the private hooks of "
        "kvfence.operator.kopf_settings were checked against the pinned one only"
    )


def test_resource_memories_recall_still_takes_ephemeral() -> None:
    """EventOnlyMemories overrides ``ResourceMemories.recall`` to pass ``ephemeral=True``."""
    try:
        from kopf._core.reactor.inventory import ResourceMemories, ResourceMemory
    except ImportError as e:
        pytest.fail(f"private hook kopf._core.reactor.inventory.ResourceMemories/ResourceMemory is gone: {e}")
    params = inspect.signature(ResourceMemories.recall).parameters
    wanted = {"raw_body", "memobase", "noticed_by_listing", "ephemeral"}
    assert wanted <= set(params), (
        f"private hook ResourceMemories.recall changed: has {sorted(params)}, EventOnlyMemories.recall "
        f"passes {sorted(wanted)}"
    )
    assert inspect.iscoroutinefunction(ResourceMemories.recall), "ResourceMemories.recall is no longer async"
    fields = {f.name for f in dataclasses.fields(ResourceMemory)}
    assert {"memo", "noticed_by_listing"} <= fields, (
        f"private hook ResourceMemory changed: fields {sorted(fields)}; handlers read its memo"
    )


def test_kopf_run_still_takes_the_memories() -> None:
    from kopf._core.reactor.inventory import ResourceMemories

    params = inspect.signature(kopf.run).parameters
    assert "memories" in params, "kopf.run no longer takes memories=: EventOnlyMemories cannot be given"
    annotation = str(params["memories"].annotation)
    assert "ResourceMemories" in annotation, (
        f"kopf.run(memories=) now takes {annotation}, not ResourceMemories: EventOnlyMemories subclasses "
        f"{ResourceMemories.__module__}.ResourceMemories"
    )


def test_kopf_processing_still_recalls_each_event_through_memories_recall() -> None:
    """The per-event path calls ``memories.recall``: that is where EventOnlyMemories makes it ephemeral."""
    from kopf._core.reactor import processing

    source = inspect.getsource(processing.process_resource_event)
    assert "memories.recall(" in source, (
        "private hook: kopf._core.reactor.processing.process_resource_event no longer calls "
        "memories.recall(): EventOnlyMemories would not be consulted for each event"
    )


def test_the_operator_registry_still_holds_the_handler_registries_read() -> None:
    """``ensure_only_event_handlers`` reads ``_changing``, ``_spawning`` and ``_indexing``; a handler
    registry kopf adds is one it does not read, so the set of them is checked whole."""
    registry = kopf.OperatorRegistry()
    held = {name for name, v in vars(registry).items() if hasattr(v, "get_all_handlers")}
    known = {"_activities", "_indexing", "_watching", "_spawning", "_changing", "_webhooks"}
    assert held == known, (
        f"private hook kopf.OperatorRegistry's handler registries changed: {sorted(held)}, "
        f"kvfence.operator.kopf_settings.ensure_only_event_handlers knows {sorted(known)}"
    )
    for name in ("_changing", "_spawning", "_indexing", "_watching"):
        handlers = getattr(registry, name).get_all_handlers()
        assert list(handlers) == [], f"private hook OperatorRegistry.{name}.get_all_handlers() changed"


def test_each_handler_kind_lands_in_the_registry_read() -> None:
    """A create (change), a daemon (spawning) and an index handler each land where
    ``ensure_only_event_handlers`` looks for them; an event handler lands in none of those."""
    registry = kopf.OperatorRegistry()
    args = ("kvfence.dev", "v1alpha1", "trustclasses")

    @kopf.on.create(*args, registry=registry, id="c")
    def c(**_: object) -> None: ...

    @kopf.daemon(*args, registry=registry, id="d")
    def d(**_: object) -> None: ...

    @kopf.index(*args, registry=registry, id="i")
    def i(**_: object) -> None: ...

    @kopf.on.event(*args, registry=registry, id="e")
    def e(**_: object) -> None: ...

    def ids(name: str) -> set[str]:
        return {h.id for h in getattr(registry, name).get_all_handlers()}

    assert (ids("_changing"), ids("_spawning"), ids("_indexing"), ids("_watching")) == (
        {"c"},
        {"d"},
        {"i"},
        {"e"},
    ), "private hook: kopf files handler kinds in other registries than ensure_only_event_handlers reads"
