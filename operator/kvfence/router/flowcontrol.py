"""Flow control: which held request a trust class's engines get next when they are saturated.

The router's own view of a class's load is the sequences (prompts x ``n``) it has in flight there,
against a capacity (a bound per engine replica, times the replicas serving). Below the capacity with
nobody held, a request passes at the cost of one comparison (:meth:`ClassFlow.try_admit`): flow
control is work-conserving and free when the engines keep up. Above it, requests are held in one
bounded queue per tenant, and each freed slot goes to the backlogged tenant that has received the
least service for its weight, in the manner of VTC (Sheng et al., "Fairness in Serving Large Language
Models", OSDI '24): a virtual counter per tenant grows by ``sequences / weight`` for each request
released to the engines; the tenant with the smallest counter goes next, ties to the one served least
recently, so that equal weights take turns. A tenant that becomes backlogged is lifted to the smallest
counter among the backlogged ones (it banks no credit while idle), and keeps its own counter when
that is higher: a tenant whose queue empties at every release still pays for what it was served. An
idle tenant's counter is forgotten once the backlogged ones pass it (it would be lifted anyway), so
memory follows the tenants that were served more than the others, not all that ever came. The head of
the chosen tenant's queue waits for room even when a smaller request behind another tenant would fit,
so that a large request is never starved by small ones; a request larger than the whole capacity
passes when nothing else is in flight.

Pure: no clock, no asyncio. The caller holds a ticket per held request (an asyncio future in the
router), enqueues it, and wakes what :meth:`ClassFlow.release` returns.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_NONE: list[Any] = []  # what release returns when nobody is held (never appended to)


@dataclass(slots=True)
class _Held(Generic[T]):
    ticket: T
    sequences: int


@dataclass(slots=True)
class _Tenant(Generic[T]):
    weight: int
    counter: float
    served_at: int = 0  # when this tenant last had a request released (a step number)
    queue: deque[_Held[T]] = field(default_factory=deque)


class ClassFlow(Generic[T]):
    """One trust class's in-flight sequences and held requests. ``capacity``: sequences the class's
    engines take at once (0: flow control off, nothing is ever held); ``queue_limit``: requests held
    per tenant at most."""

    __slots__ = (
        "_idle",
        "_level",
        "_step",
        "backlogged",
        "capacity",
        "held",
        "inflight",
        "queue_limit",
        "tenants",
    )

    def __init__(self, capacity: int, queue_limit: int) -> None:
        self.capacity = capacity
        self.queue_limit = queue_limit
        self.inflight = 0
        self.held = 0  # requests held, all tenants
        self.tenants: dict[str, _Tenant[T]] = {}  # every tenant with a counter: backlogged or idle
        self.backlogged: dict[str, _Tenant[T]] = {}  # the tenants with requests held
        self._idle: list[tuple[float, int, str]] = []  # (counter, step, tenant) of idle tenants, a heap
        self._level = 0.0  # the counter of the last tenant served: where newcomers start when none wait
        self._step = 0

    def try_admit(self, sequences: int) -> bool:
        """Admit at once when the engines have room and nobody is held (the hot path)."""
        inflight = self.inflight
        # Larger than the whole capacity passes too when nothing else is in flight.
        if not self.held and (inflight + sequences <= self.capacity or self.capacity <= 0 or not inflight):
            self.inflight = inflight + sequences
            return True
        return False

    def hold(self, tenant: str, weight: int, sequences: int, ticket: T) -> bool:
        """Hold a request :meth:`try_admit` refused; False when the tenant's queue is full."""
        t = self.backlogged.get(tenant)
        if t is None:
            floor = self._floor()
            t = self.tenants.get(tenant)
            if t is None:
                t = self.tenants[tenant] = _Tenant(weight, floor)
            else:
                t.counter = max(t.counter, floor)
            self.backlogged[tenant] = t
        elif len(t.queue) >= self.queue_limit:
            return False
        t.weight = weight
        t.queue.append(_Held(ticket, sequences))
        self.held += 1
        return True

    def queued(self, tenant: str) -> int:
        t = self.backlogged.get(tenant)
        return len(t.queue) if t is not None else 0

    def cancel(self, tenant: str, ticket: T) -> bool:
        """Withdraw a held request (its wait timed out, or its client left); False if it is not held
        (it was released meanwhile: the caller owns its sequences then)."""
        t = self.backlogged.get(tenant)
        if t is None:
            return False
        for held in t.queue:
            if held.ticket is ticket:
                t.queue.remove(held)
                self.held -= 1
                if not t.queue:
                    self._went_idle(tenant, t)
                return True
        return False

    def release(self, sequences: int) -> list[T]:
        """A request of ``sequences`` ended: the held requests that now go to the engines, in order."""
        self.inflight -= sequences
        return self.pump() if self.held else _NONE

    def set_capacity(self, capacity: int) -> list[T]:
        """The capacity changed (replicas came or went): what may go now."""
        self.capacity = capacity
        return self.pump()

    def pump(self) -> list[T]:
        out: list[T] = []
        while self.held:
            name, t = min(self.backlogged.items(), key=lambda kv: (kv[1].counter, kv[1].served_at))
            head = t.queue[0]
            room = self.capacity <= 0 or self.inflight + head.sequences <= self.capacity
            if not room and self.inflight > 0:
                break
            t.queue.popleft()
            self.held -= 1
            self.inflight += head.sequences
            self._step += 1
            t.served_at = self._step
            self._level = t.counter
            t.counter += head.sequences / t.weight
            if not t.queue:
                self._went_idle(name, t)
            out.append(head.ticket)
        self._forget_passed()
        return out

    def _floor(self) -> float:
        """The counter a tenant that starts waiting is lifted to."""
        if self.backlogged:
            return min(t.counter for t in self.backlogged.values())
        return self._level

    def _went_idle(self, name: str, t: _Tenant[T]) -> None:
        del self.backlogged[name]
        heapq.heappush(self._idle, (t.counter, t.served_at, name))

    def _forget_passed(self) -> None:
        """Drop the idle tenants whose counters the floor has reached (they would be lifted to it)."""
        idle, floor = self._idle, self._floor()
        while idle and idle[0][0] <= floor:
            counter, served_at, name = heapq.heappop(idle)
            t = self.tenants.get(name)
            # Skip stale entries: the tenant waits again, or went idle again since with another counter.
            if (
                t is not None
                and name not in self.backlogged
                and (t.counter, t.served_at) == (counter, served_at)
            ):
                del self.tenants[name]
