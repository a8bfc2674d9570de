"""Polling for what happens asynchronously (controllers, reloads, processes, kube-proxy, DNS). Tests
never assert a duration: a deadline only bounds how long a test waits before it fails with what it
last saw."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    fn: Callable[[], T],
    what: str,
    timeout: float = 120.0,
    interval: float = 0.5,
    *,
    ignore: tuple[type[BaseException], ...] = (),
    dump: Callable[[], str] | None = None,
) -> T:
    """Call ``fn`` until it returns something truthy, and return that; fail after ``timeout`` seconds
    with the last value (or the last exception of a type in ``ignore``, which only means "not yet")
    and, if given, what ``dump()`` says. Any other exception ends the wait at once."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
        except ignore as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() >= end:
            break
        time.sleep(interval)
    extra = f"\n{dump()}" if dump is not None else ""
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last: {last!r}{extra}")
