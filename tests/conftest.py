"""Fixtures shared by every test suite.

``cluster`` is the real local control plane (tests/cluster/localcluster.py), started once per pytest
session. When a test that used it fails, the tail of every component log and the recent events are
attached to the failure report.

Lanes: every test that needs a control plane (the ``cluster`` or ``real_cluster`` fixture, directly or
through another fixture) is marked ``cluster``, and every test that needs the pinned vLLM (the
``vllm_python`` fixture) is marked ``vllm``, here, from what it uses (support/lanes.py), so no file has
to remember to. ``make unit`` runs the rest (``-m "not cluster and not vllm"``); ``make test`` runs
everything.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster.localcluster import LocalCluster, default_bin_dir
from support.lanes import mark_lanes
from support.process import ManagedProcess


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), default_bin_dir())
    # A missing binary or a component that will not start fails every test that needs the cluster:
    # it is never a skip.
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A second cluster with one real node (containerd, kubelet, kube-proxy, kube-router, CoreDNS) on
    which pods really run, and Kubernetes' agnhost test image imported into it."""
    from cluster.oci import Layer, write_archive

    bin_dir = default_bin_dir()
    c = LocalCluster(tmp_path_factory.mktemp("real-cluster"), bin_dir, real_node=True)
    c.start()
    try:
        from cluster.realnode import RealNode

        agnhost = write_archive(
            c.dir / "agnhost.oci.tar",
            "kvfence.local/agnhost:test",
            [Layer().add("agnhost", (bin_dir / "agnhost").read_bytes(), 0o755)],
            entrypoint=["/agnhost"],
        )
        RealNode(c).import_image(agnhost)
        yield c
    finally:
        c.stop()


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_lanes(items)  # type: ignore[arg-type]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name in ("cluster", "real_cluster"):
            c = getattr(item, "funcargs", {}).get(name)
            if isinstance(c, LocalCluster) and c.pids:
                report.sections.append((f"{name}: logs and events", c.dump()))
        for proc in list(ManagedProcess.live):
            if found := proc.tracebacks():
                report.sections.append((f"tracebacks in {proc.log} ({proc.args[0]})", found))
