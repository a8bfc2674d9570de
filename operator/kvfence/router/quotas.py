"""Per-tenant quotas: concurrent requests, requests per minute, tokens per minute.

* Rates are token buckets holding one minute's worth (capacity = the per-minute limit, refilled
  continuously at limit/60 per second), so a tenant can burst up to its minute's allowance and then
  proceeds at the steady rate.
* A request is charged by its sequences (prompts x ``n``; :func:`kvfence.router.surface.check_request`):
  it holds that many units of the concurrency limit and takes that many requests from the
  requests-per-minute bucket. A request with more sequences than a limit
  itself can never be admitted: its refusal names the limit (``Rejection.limit``) and is final.
* Tokens per minute: a request reserves ``prompt estimate + max_tokens`` per sequence up front; when
  the answer ends, the reservation is corrected to what the engine reports in ``usage`` (refund or
  extra charge). A single request larger than the whole allowance is admitted only when the bucket is
  full, and then drives it into debt, so it is neither refused forever nor free.
* A refusal names the quota and a ``Retry-After`` (whole seconds, at least 1): the time until the
  bucket holds enough, or 1 s for the concurrency limit.
* Several replicas: each replica enforces ``limit // replicas`` (at least 1) of every limit, so the sum
  over replicas never exceeds the tenant's quota (unless the limit is smaller than the replica count).
  ``replicas`` follows the number of ready router replicas (:meth:`QuotaManager.set_replicas`, fed by
  ``--router-service``), or is fixed by ``--replicas``; see docs/router.md. When it changes, every
  bucket is resized to the new share and keeps its level (clamped to a smaller bucket), so what the
  replicas hold together never grows. With ``join_empty`` a router's buckets for the tenants of its
  first table start empty and fill at its share of the rate: a replica that joins cannot know what the
  others admitted in the last minute, so it must not add a full share to what they still hold.
* State lives here, keyed by tenant name, outside the routing table: a reload updates the limits and
  keeps in-flight counts and bucket levels.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvfence.contract.routing import Quotas
from kvfence.router.quota_store import (
    CELLS,
    INFLIGHT,
    RPM_LEVEL,
    TPM_LEVEL,
    Cells,
    LocalQuotaStore,
    QuotaStore,
)


class TokenBucket:
    """A bucket whose level and last-refill time live in ``cells`` (see :mod:`.quota_store`); the
    capacity and rate are this worker's, from the routing table. ``fresh`` cells start full (or
    empty); cells another worker or an earlier limit left are adopted, clamped to the capacity."""

    __slots__ = ("_at", "_cells", "capacity", "rate")

    def __init__(
        self,
        per_minute: int,
        now: float,
        full: bool = True,
        cells: Cells | None = None,
        at: int = 0,
        fresh: bool = True,
    ) -> None:
        self._cells: Cells = cells if cells is not None else array("d", (0.0, 0.0))
        self._at = at
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        if fresh or self.updated == 0.0:
            self.level = self.capacity if full else 0.0
            self.updated = now
        else:
            self.refill(now)
            self.level = min(self.level, self.capacity)

    @property
    def level(self) -> float:
        return self._cells[self._at]

    @level.setter
    def level(self, v: float) -> None:
        self._cells[self._at] = v

    @property
    def updated(self) -> float:
        return self._cells[self._at + 1]

    @updated.setter
    def updated(self, v: float) -> None:
        self._cells[self._at + 1] = v

    def refill(self, now: float) -> None:
        cells, at = self._cells, self._at
        if now > cells[at + 1]:
            cells[at] = min(self.capacity, cells[at] + (now - cells[at + 1]) * self.rate)
            cells[at + 1] = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 if it is now). Call after :meth:`refill`."""
        level = self.level
        if level >= amount:
            return 0.0
        return (amount - level) / self.rate

    def resize(self, per_minute: int, now: float) -> None:
        self.refill(now)
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)


@dataclass(frozen=True, slots=True)
class Limits:
    concurrent: int | None
    rpm: int | None
    tpm: int | None


def per_replica(limit: int | None, replicas: int) -> int | None:
    if limit is None:
        return None
    return max(1, limit // replicas)


class TenantQuota:
    __slots__ = ("_base", "_cells", "limits", "rpm", "tpm")

    def __init__(
        self,
        limits: Limits,
        now: float,
        full: bool = True,
        cells: Cells | None = None,
        base: int = 0,
        fresh: bool = True,
    ) -> None:
        self._cells: Cells = cells if cells is not None else array("d", bytes(8 * CELLS))
        self._base = base
        self.limits = limits
        self.rpm = self._bucket(limits.rpm, RPM_LEVEL, now, full, fresh)
        self.tpm = self._bucket(limits.tpm, TPM_LEVEL, now, full, fresh)

    def _bucket(
        self, per_minute: int | None, at: int, now: float, full: bool, fresh: bool
    ) -> TokenBucket | None:
        if not per_minute:
            return None
        return TokenBucket(per_minute, now, full, self._cells, self._base + at, fresh)

    @property
    def inflight(self) -> int:
        """Requests in flight, over every worker sharing the cells."""
        return int(self._cells[self._base + INFLIGHT])

    @inflight.setter
    def inflight(self, v: int) -> None:
        self._cells[self._base + INFLIGHT] = v

    def update(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.rpm = self._resized(self.rpm, limits.rpm, RPM_LEVEL, now)
        self.tpm = self._resized(self.tpm, limits.tpm, TPM_LEVEL, now)

    def _resized(
        self, bucket: TokenBucket | None, per_minute: int | None, at: int, now: float
    ) -> TokenBucket | None:
        if not per_minute:
            return None
        if bucket is None:  # a limit that was off: the cells' level (if any) is adopted, else full
            return self._bucket(per_minute, at, now, True, False)
        bucket.resize(per_minute, now)
        return bucket


@dataclass(slots=True)
class Reservation:
    tenant: str
    quota: TenantQuota
    tokens: float  # reserved from the tokens-per-minute bucket
    released: bool = False
    sequences: int = 1  # units of the concurrency limit held


@dataclass(frozen=True, slots=True)
class Rejection:
    quota: str  # "concurrency" | "requests" | "tokens"
    retry_after: int  # whole seconds, >= 1
    message: str
    limit: str = ""  # the limit the request alone exceeds (never admitted); "": waiting cures it


class QuotaManager:
    def __init__(
        self,
        replicas: int = 1,
        clock: Callable[[], float] = time.monotonic,
        join_empty: bool = False,
        store: QuotaStore | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.replicas = replicas
        self.store: QuotaStore = store if store is not None else LocalQuotaStore()
        self.clock = clock
        self._state: dict[str, TenantQuota] = {}
        self._quotas: dict[str, Quotas] = {}
        self._join_empty = join_empty  # until the first sync

    def set_replicas(self, replicas: int) -> bool:
        """The number of router replicas sharing the quotas changed: every tenant's share follows
        (buckets resized, levels kept or clamped, counters kept). True if it changed."""
        replicas = max(1, replicas)
        if replicas == self.replicas:
            return False
        self.replicas = replicas
        self.sync(list(self._quotas.items()))
        return True

    def limits_for(self, q: Quotas) -> Limits:
        r = self.replicas
        return Limits(
            concurrent=per_replica(q.max_concurrent_requests, r),
            rpm=per_replica(q.requests_per_minute, r),
            tpm=per_replica(q.tokens_per_minute, r),
        )

    def _new_state(self, name: str, limits: Limits, now: float, full: bool) -> TenantQuota:
        cells, base, fresh = self.store.cells_for(name)
        st = self._state[name] = TenantQuota(limits, now, full, cells, base, fresh)
        return st

    def sync(self, tenants: Iterable[tuple[str, Quotas]]) -> None:
        """Apply a (re)loaded table: new limits, same counters. Tenants gone from the table are
        forgotten once nothing of theirs is in flight."""
        with self.store.lock:
            now = self.clock()
            full = not self._join_empty
            self._join_empty = False
            quotas: dict[str, Quotas] = {}
            for name, q in tenants:
                quotas[name] = q
                limits = self.limits_for(q)
                st = self._state.get(name)
                if st is None:
                    self._new_state(name, limits, now, full)
                elif st.limits != limits:
                    st.update(limits, now)
            self._quotas = quotas
            for name in [n for n, st in self._state.items() if n not in quotas and st.inflight == 0]:
                del self._state[name]

    def state(self, tenant: str) -> TenantQuota | None:
        return self._state.get(tenant)

    def acquire(
        self, tenant: str, quotas: Quotas, tokens: int, sequences: int = 1
    ) -> Reservation | Rejection:
        """Admit one request of ``sequences`` sequences that may use up to ``tokens`` tokens, or say
        why not. All or nothing. With a shared store, the check and the charge are one step under its
        lock: two workers cannot both take the last unit."""
        with self.store.lock:
            st = self._state.get(tenant)
            now = self.clock()
            if st is None:  # a table swap raced with this request: start the tenant's state now
                st = self._new_state(tenant, self.limits_for(quotas), now, True)
            if sequences > 1:
                never = _never(st.limits, sequences)
                if never is not None:
                    return never
            return self._admit(st, tenant, tokens, now, sequences)

    def _admit(
        self, st: TenantQuota, tenant: str, tokens: int, now: float, sequences: int = 1
    ) -> Reservation | Rejection:
        lim = st.limits
        if lim.concurrent is not None and st.inflight + sequences > lim.concurrent:
            return Rejection(
                "concurrency",
                1,
                f"Too many concurrent requests: this tenant may have {lim.concurrent} sequences at once "
                f"(prompts x n; this request has {sequences}).",
            )
        if st.rpm is not None:
            st.rpm.refill(now)
            wait = st.rpm.wait_for(float(sequences))
            if wait > 0:
                return Rejection(
                    "requests",
                    _ceil(wait),
                    f"Requests-per-minute quota exceeded ({lim.rpm}/min, counted in sequences; this "
                    f"request has {sequences}).",
                )
        need = 0.0
        if st.tpm is not None:
            st.tpm.refill(now)
            need = min(float(tokens), st.tpm.capacity)
            wait = st.tpm.wait_for(need)
            if wait > 0:
                return Rejection(
                    "tokens",
                    _ceil(wait),
                    f"Tokens-per-minute quota exceeded ({lim.tpm}/min; this request reserves {tokens} "
                    "tokens: prompt plus max_tokens).",
                )
            st.tpm.level -= need
        if st.rpm is not None:
            st.rpm.level -= float(sequences)
        st.inflight += sequences
        return Reservation(tenant, st, need, sequences=sequences)

    def release(self, r: Reservation, used_tokens: int | None) -> float:
        """End a request. ``used_tokens``: what the engine reported (None: keep the reservation).
        Returns the tokens finally charged."""
        if r.released:
            return 0.0
        r.released = True
        st = r.quota
        with self.store.lock:
            st.inflight -= r.sequences
            if used_tokens is None:
                return r.tokens
            bucket = st.tpm
            if bucket is not None:
                bucket.refill(self.clock())
                bucket.level = min(bucket.capacity, bucket.level + r.tokens - float(used_tokens))
        return float(used_tokens)


def _never(lim: Limits, sequences: int) -> Rejection | None:
    """The refusal of a request whose sequences alone exceed this router's share of a limit (it
    could wait forever), or None."""
    if lim.concurrent is not None and sequences > lim.concurrent:
        limit, value, quota = "maxConcurrentRequests", lim.concurrent, "concurrency"
    elif lim.rpm is not None and sequences > lim.rpm:
        limit, value, quota = "requestsPerMinute", lim.rpm, "requests"
    else:
        return None
    return Rejection(
        quota,
        0,
        f"This request has {sequences} sequences (prompts x n), more than this tenant's {limit} "
        f"({value} on this router) admits at once: it can never be served. Send fewer prompts or a "
        "smaller n.",
        limit=limit,
    )


def _ceil(seconds: float) -> int:
    return max(1, math.ceil(seconds))
