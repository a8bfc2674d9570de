"""Which lane a test runs in, from the fixtures it uses (directly or through other fixtures): a test
that needs a control plane is marked ``cluster``, one that needs the pinned vLLM ``vllm``. No file has
to remember to mark itself; ``make unit`` runs every test with neither mark (``-m "not cluster and not
vllm"``), ``make test`` runs them all."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import pytest

#: fixture -> the marker of every test that needs it
LANE_FIXTURES = {"cluster": "cluster", "real_cluster": "cluster", "vllm_python": "vllm"}


class _Item(Protocol):
    fixturenames: list[str]

    def iter_markers(self) -> Iterable[pytest.Mark]: ...

    def add_marker(self, marker: str) -> None: ...


def mark_lanes(items: Iterable[_Item]) -> None:
    for item in items:
        needs = {LANE_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in LANE_FIXTURES}
        for marker in sorted(needs - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)
