"""Polling for what a cluster does asynchronously (controllers, kube-proxy, DNS). Tests never assert a
duration: a deadline only bounds how long a test waits before it fails with what it last saw."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(fn: Callable[[], T], what: str, timeout: float = 120.0, interval: float = 0.5) -> T:
    """Call ``fn`` until it returns something truthy, and return that; fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")
