"""The shared test support itself: ports, polling, managed processes, the Prometheus reader and the
lane markers."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from support import prom
from support.lanes import LANE_FIXTURES, mark_lanes
from support.ports import free_port
from support.process import ManagedProcess, ProcessExited
from support.waiting import wait_until


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def test_free_port_never_hands_out_a_port_twice_nor_one_to_avoid() -> None:
    """Ports picked before they are bound are free to the kernel, which may hand them out again: a
    cluster that picks a dozen before starting anything must still get a dozen different ones."""
    first = free_port()
    ports = [free_port(avoid=[first + 1]) for _ in range(300)]
    assert len(set(ports)) == len(ports) and first not in ports and first + 1 not in ports


def test_wait_until_returns_the_first_truthy_value_and_fails_with_the_last_one() -> None:
    seen = iter([0, None, "", 7, 8])
    assert wait_until(lambda: next(seen), "a value", timeout=5, interval=0) == 7
    with pytest.raises(AssertionError, match=r"waiting for nothing; last: 0\nthe dump"):
        wait_until(lambda: 0, "nothing", timeout=0.05, interval=0.01, dump=lambda: "the dump")


def test_wait_until_waits_out_only_the_errors_it_is_told_to() -> None:
    calls = iter([OSError("not yet"), OSError("still not"), "up"])

    def flaky() -> str:
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    assert wait_until(flaky, "up", timeout=5, interval=0, ignore=(OSError,)) == "up"
    with pytest.raises(AssertionError, match="last: OSError"):
        wait_until(lambda: (_ for _ in ()).throw(OSError("down")), "x", 0.05, 0.01, ignore=(OSError,))
    with pytest.raises(KeyError):  # anything else ends the wait at once
        wait_until(lambda: {}["k"], "x", timeout=60, ignore=(OSError,))


def test_managed_process_stops_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)"
    )
    p = ManagedProcess([sys.executable, "-c", code], tmp_path / "p.log", grace=0.5).start()
    p.wait_ready(lambda: "up" in p.output(), "the child printing up", timeout=30)
    assert p.running
    assert p.stop() == -signal.SIGKILL and not p.running


def test_managed_process_that_exits_fails_the_wait_with_its_log(tmp_path: Path) -> None:
    code = "import sys; print('bad config: port'); sys.exit(3)"
    p = ManagedProcess([sys.executable, "-c", code], tmp_path / "p.log").start()
    with pytest.raises(ProcessExited, match=r"exited \(3\):\nbad config: port"):
        p.wait_ready(lambda: False, "never ready", timeout=30)
    assert not p.running and p.stop() == 3


def test_managed_process_not_ready_by_the_deadline_is_stopped(tmp_path: Path) -> None:
    p = ManagedProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "p.log").start()
    with pytest.raises(AssertionError, match=r"timed out after 0\.2 s waiting for ready"):
        p.wait_ready(lambda: False, "ready", timeout=0.2)
    assert not p.running


def test_prom_reads_what_prometheus_client_writes() -> None:
    reg = CollectorRegistry()
    c = Counter("kv_things", "Things.", ["tenant", "reason"], registry=reg)
    c.labels("a", "x y").inc(2)
    c.labels("b", "z").inc()
    Gauge("kv_level", "Level.", registry=reg).set(1.5)
    text = generate_latest(reg).decode()
    found = prom.samples(text)
    assert found['kv_things_total{reason="x y",tenant="a"}'] == 2.0
    assert prom.value(text, "kv_level") == 1.5 and prom.value(found, "kv_missing") is None
    assert prom.total(text, "kv_things_total") == 3.0 and prom.total(found, "kv_things") == 0
    assert prom.unlabelled(text)["kv_level"] == 1.5
    assert not any("{" in k for k in prom.unlabelled(text))


class _Item:
    def __init__(self, fixtures: list[str], marks: list[str]) -> None:
        self.fixturenames = fixtures
        self.marks = [getattr(pytest.mark, m).mark for m in marks]

    def iter_markers(self) -> Any:
        return iter(self.marks)

    def add_marker(self, name: str) -> None:
        self.marks.append(getattr(pytest.mark, name).mark)


def test_lanes_follow_the_fixtures_a_test_uses(request: pytest.FixtureRequest) -> None:
    items = [
        _Item(["tmp_path"], []),
        _Item(["kv", "installed", "cluster"], []),
        _Item(["real_cluster"], ["cluster"]),
        _Item(["stack", "vllm_python"], []),
    ]
    mark_lanes(items)
    assert [sorted(m.name for m in i.marks) for i in items] == [[], ["cluster"], ["cluster"], ["vllm"]]
    # and in this very session: a test needing neither carries neither, so `make unit` runs it
    assert not {m.name for m in request.node.iter_markers()} & {"cluster", "vllm"}


def test_the_conftest_marks_this_session_from_the_fixtures(request: pytest.FixtureRequest) -> None:
    """Every collected test that uses a lane fixture carries its marker (what -m selects on)."""
    for item in request.session.items:
        for fixture, marker in LANE_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                assert item.get_closest_marker(marker) is not None, item.nodeid
