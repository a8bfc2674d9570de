"""Fixtures shared by every test suite.

``cluster`` is the real local control plane (tests/cluster/localcluster.py), started once per pytest
session. When a test that used it fails, the tail of every component log and the recent events are
attached to the failure report.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent


def _bin_dir() -> Path:
    env = os.environ.get("KVFENCE_BIN_DIR")
    if env:
        return Path(env)
    out = subprocess.run(
        [str(ROOT / "tests/cluster/build-components.sh"), "--print"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), _bin_dir())
    # A missing binary or a component that will not start fails every test that needs the cluster:
    # it is never a skip.
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and "cluster" in getattr(item, "fixturenames", ()):
        c = item.funcargs.get("cluster")  # type: ignore[attr-defined]
        if isinstance(c, LocalCluster) and c.pids:
            report.sections.append(("local cluster: logs and events", c.dump()))
