"""The operator's work queue (no cluster): de-duplication, per-key exclusivity, retries."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from kvfence.operator.keys import ROUTING, ClassKey, Key
from kvfence.operator.reconcile_base import Requeue
from kvfence.operator.workqueue import Controller


class FakeReconciler:
    def __init__(self, fail_times: int = 0, requeue_times: int = 0) -> None:
        self.calls: list[Key] = []
        self.active: set[Key] = set()
        self.overlap = False
        self.fail_times, self.requeue_times = fail_times, requeue_times
        self.lock = threading.Lock()
        self.state: Any = None
        self.later: dict[Key, float] = {}

    def take_later(self) -> dict[Key, float]:
        out, self.later = self.later, {}
        return out

    def reconcile(self, key: Key) -> set[Key]:
        with self.lock:
            if key in self.active:
                self.overlap = True
            self.active.add(key)
            self.calls.append(key)
        time.sleep(0.05)
        with self.lock:
            self.active.discard(key)
        if self.requeue_times > 0:
            self.requeue_times -= 1
            raise Requeue("not yet", delay=0.01)
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("boom")
        if key == ClassKey("timer"):
            self.later[ClassKey("timed")] = 0.5
        return {ClassKey("follow")} if key == ClassKey("a") else set()


async def _run(rec: FakeReconciler, keys: list[Key], settle: float, until: Any = None) -> None:
    c = Controller(rec, workers=4, resync_seconds=3600)  # type: ignore[arg-type]
    await c.start()
    for k in keys:
        c.enqueue(k)
    await asyncio.sleep(0.01)
    for k in keys:  # a burst while the first round is running
        c.enqueue(k)
    await asyncio.sleep(settle)
    deadline = time.monotonic() + 60
    while until is not None and not until() and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a thread
        await asyncio.sleep(0.1)
    await c.stop()


def test_bursts_collapse_and_a_key_never_runs_twice_at_once() -> None:
    rec = FakeReconciler()
    asyncio.run(_run(rec, [ClassKey("a")] * 20 + [ROUTING] * 20, 1.0))
    assert not rec.overlap
    assert 1 <= rec.calls.count(ClassKey("a")) <= 2
    assert 1 <= rec.calls.count(ROUTING) <= 3  # started once by the controller itself, plus the burst
    assert ClassKey("follow") in rec.calls  # follow-up keys are reconciled too


def test_errors_and_requeues_are_retried() -> None:
    rec = FakeReconciler(fail_times=2)
    asyncio.run(_run(rec, [ClassKey("x")], 0.1, until=lambda: rec.calls.count(ClassKey("x")) >= 3))
    assert rec.calls.count(ClassKey("x")) >= 3
    rec = FakeReconciler(requeue_times=3)
    asyncio.run(_run(rec, [ClassKey("y")], 0.1, until=lambda: rec.calls.count(ClassKey("y")) >= 2))
    assert rec.calls.count(ClassKey("y")) >= 2


def test_a_key_asked_for_later_is_reconciled_after_its_delay() -> None:
    rec = FakeReconciler()
    started = time.monotonic()
    seen: list[float] = []

    def timed() -> bool:
        if ClassKey("timed") in rec.calls and not seen:
            seen.append(time.monotonic() - started)
        return bool(seen)

    asyncio.run(_run(rec, [ClassKey("timer")], 0.0, until=timed))
    assert seen[0] >= 0.5  # not before its delay
