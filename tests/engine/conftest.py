"""Fixtures of the engine suites (helpers live in enginelib.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from engine.enginelib import EngineProcess


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    d.mkdir()
    (d / "current").write_bytes(os.urandom(32))
    return d


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], EngineProcess]]:
    """Start ``kvfence-engine`` (as ``python -m kvfence.engine``) with a config dict; stopped at teardown."""
    procs: list[EngineProcess] = []

    def start(cfg: dict[str, Any]) -> EngineProcess:
        n = len(procs)
        path = tmp_path / f"engine-{n}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        p = EngineProcess(path, tmp_path / f"port-{n}", tmp_path / f"engine-{n}.log")
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()
