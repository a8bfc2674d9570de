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
    EngineStack,
    Proc,
    Stack,
    standard_table,
    start_engine,
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


@pytest.fixture(scope="session")
def engine_stack(logs: Path) -> Iterator[EngineStack]:
    procs: list[Proc] = []
    try:
        gold = start_engine(logs, "gold", "gold", "tiny", GOLD_KEY, adapters=("support-bot", "legal-bot"))
        procs.append(gold)
        silver = start_engine(logs, "silver", "silver", "small", SILVER_KEY, scope="TrustClass")
        procs.append(silver)
        cold_gold = start_engine(
            logs,
            "cold-gold",
            "gold",
            "tiny",
            GOLD_KEY,
            adapters=("support-bot", "legal-bot"),
            prefix_cache=False,
        )
        procs.append(cold_gold)
        cold_silver = start_engine(
            logs, "cold-silver", "silver", "small", SILVER_KEY, scope="TrustClass", prefix_cache=False
        )
        procs.append(cold_silver)
        table_path = logs / "routing-engines.json"
        write_table(table_path, standard_table(gold.url, silver.url))
        router = start_router(logs, table_path)
        procs.append(router)
        cold_path = logs / "routing-cold.json"
        write_table(cold_path, standard_table(cold_gold.url, cold_silver.url))
        cold_router = start_router(logs, cold_path)
        procs.append(cold_router)
        yield EngineStack(router, gold, silver, cold_router)
    finally:
        for p in reversed(procs):
            p.stop()
