"""Where the quota counters live: in the process (one worker), or in memory shared by the router's
worker processes (``--workers N``), so that a tenant's limits hold across all of them exactly.

Each tenant has five numbers: requests in flight, and the level and last-refill time of its
requests-per-minute and tokens-per-minute buckets (:class:`kvfence.router.quotas.TokenBucket`).
The limits themselves (capacity, rate) are not stored: every worker computes them from the same
routing table.

:class:`SharedQuotaStore` is an anonymous shared mapping created before the workers are forked, so
every worker sees the same bytes: an open-addressing table of tenants (keyed by a 16-byte BLAKE2b
digest of the name) and their counters, guarded by one process-shared lock that each admission and
each release holds for a few microseconds. A tenant's slot is claimed on first use and then kept for
the life of the router (tenants removed from the table keep theirs): ``slots`` bounds how many
distinct tenants one router process tree can ever serve; past it, the tenant is refused with a
:class:`QuotaStoreFull` that names the bound.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import multiprocessing
from array import array
from collections.abc import MutableSequence
from typing import Any, Protocol

#: the counters of one tenant, in this order, at ``base + i``
INFLIGHT, RPM_LEVEL, RPM_UPDATED, TPM_LEVEL, TPM_UPDATED = range(5)
CELLS = 5
KEY_BYTES = 16
DEFAULT_SLOTS = 1 << 16

Cells = MutableSequence[float]


class QuotaStoreFull(RuntimeError):
    pass


class QuotaStore(Protocol):
    #: held around every read-modify-write of the counters
    lock: contextlib.AbstractContextManager[Any]

    def cells_for(self, tenant: str) -> tuple[Cells, int, bool]:
        """The tenant's counters: ``(cells, base, fresh)``; ``fresh`` when they were just created
        (all zero) rather than found (another worker, or an earlier table, made them). Called with
        ``lock`` held."""
        ...


class LocalQuotaStore:
    """One worker: every tenant's counters in its own small array, no lock needed (one event loop)."""

    def __init__(self) -> None:
        self.lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    def cells_for(self, tenant: str) -> tuple[Cells, int, bool]:
        return array("d", bytes(8 * CELLS)), 0, True


class SharedQuotaStore:
    """Counters in an anonymous ``MAP_SHARED`` mapping, inherited by forked workers."""

    def __init__(self, slots: int = DEFAULT_SLOTS) -> None:
        if slots < 1:
            raise ValueError("a shared quota store needs at least one slot")
        self.slots = slots
        self._keys_size = slots * KEY_BYTES
        self._map = mmap.mmap(-1, self._keys_size + slots * CELLS * 8)
        self._cells: Cells = memoryview(self._map)[self._keys_size :].cast("d")  # type: ignore[assignment]
        self.lock: contextlib.AbstractContextManager[Any] = multiprocessing.get_context("fork").Lock()
        self._mine: dict[str, int] = {}  # this process's cache of name -> slot (slots never move)

    def cells_for(self, tenant: str) -> tuple[Cells, int, bool]:
        slot = self._mine.get(tenant)
        if slot is not None:
            return self._cells, slot * CELLS, False
        digest = hashlib.blake2b(tenant.encode(), digest_size=KEY_BYTES).digest()
        empty = bytes(KEY_BYTES)
        m = self._map
        start = int.from_bytes(digest[:8], "little") % self.slots
        for probe in range(self.slots):
            slot = (start + probe) % self.slots
            off = slot * KEY_BYTES
            held = m[off : off + KEY_BYTES]
            if held in (digest, empty):
                fresh = held == empty
                if fresh:
                    m[off : off + KEY_BYTES] = digest
                self._mine[tenant] = slot
                return self._cells, slot * CELLS, fresh
        raise QuotaStoreFull(
            f"the shared quota store holds {self.slots} tenants and all are taken: restart the router "
            "(slots are kept for the life of the process tree)"
        )
