"""Fixtures for the router tests: real processes over real sockets.

* ``fake_gold`` / ``fake_silver``: the small aiohttp upstream of ``fake_upstream.py`` (speaks the
  engine side of the contract), one per trust class.
* ``stack``: a ``kvfence-router`` process in front of them, with a routing table of several tenants.
* ``router.support.start_router``: for tests that need their own router (reload, shutdown, ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from router.support import (
    GOLD_KEY,
    GOLD_KEY_OLD,
    SILVER_KEY,
    Proc,
    Stack,
    standard_table,
    start_fake,
    start_router,
    write_table,
)


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="session")
def fake_gold(logs: Path) -> Iterator[Proc]:
    p = start_fake(logs, "gold", [GOLD_KEY, GOLD_KEY_OLD])
    yield p
    p.stop()


@pytest.fixture(scope="session")
def fake_silver(logs: Path) -> Iterator[Proc]:
    p = start_fake(logs, "silver", [SILVER_KEY])
    yield p
    p.stop()


@pytest.fixture(scope="session")
def stack(logs: Path, fake_gold: Proc, fake_silver: Proc) -> Iterator[Stack]:
    table_path = logs / "routing.json"
    write_table(table_path, standard_table(fake_gold.url, fake_silver.url))
    router = start_router(logs, table_path)
    yield Stack(router, fake_gold, fake_silver, table_path)
    router.stop()
