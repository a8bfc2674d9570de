"""Flow control: which requests a trust class's engines get when they are saturated, and in what order.

The router's own view of a class's load is the sequences (prompts x ``n``) it has in flight there,
against a capacity ``C`` (a bound per engine replica, times the replicas serving). Two rules admit a
request:

* **The pool.** Below ``C`` with nobody held, a request passes at the cost of one comparison and one
  dict update (:meth:`ClassFlow.try_admit`'s hot path): flow control is work-conserving and nearly free
  when the engines keep up.
* **The guaranteed share.** A tenant may have ``C x its weight / W`` sequences in flight, ``W`` the sum
  of the weights of the tenants with sequences in flight or requests held (itself included), whatever
  the others have in flight or held: a request that stays within it passes at once, even at capacity
  and past other tenants' held requests, never past its own tenant's (FIFO within a tenant). The
  engines behind the router divide their running slots and token budget by the same weights, so the
  router need not keep a class under ``C`` to be fair; it only bounds the flood.

Sequences admitted on a share are *reserved*; the rest are the pool's. The pool admits only while its
own sequences stay within ``C`` (a request larger than ``C`` passes when the pool has none in flight), and
a share admits only while the reserved ones stay within ``C``, so **a class never has more than 2C
sequences in flight** (``C`` plus the largest request, when one is larger than ``C``). The second bound
matters when tenants arrive one after another: each newcomer's share is computed against more tenants
than the earlier ones' were, and the shares granted would otherwise add up like C x (1 + 1/2 + 1/3 ...).
A tenant within its share can therefore wait, but only for in-flight requests that other tenants sent
on their own shares when fewer tenants were active, never for a held backlog. An ending request frees
its tenant's pool sequences first and its reserved ones only when it has no others: a tenant cannot keep
pool sequences by cycling share admissions, so while a held head waits for the pool's room, the pool
only drains.

Above the pool's bound, requests are held in one bounded queue per tenant, and each freed slot of the
pool goes to the backlogged tenant that has received the least service for its weight, in the manner of
VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24): a virtual counter per tenant
grows by ``sequences / weight`` for each request released from the queues; the tenant with the smallest
counter goes next, ties to the one served least recently, so that equal weights take turns. A tenant
that becomes backlogged is lifted to the smallest counter among the backlogged ones (it banks no credit
while idle), and keeps its own counter when that is higher: a tenant whose queue empties at every
release still pays for what it was served. An idle tenant's counter is forgotten once the backlogged
ones pass it (it would be lifted anyway), so memory follows the tenants that were served more than the
others, not all that ever came. The head of the chosen tenant's queue waits for the pool's room even
when a smaller request behind another tenant would fit, so that a large request is never starved by
small ones; meanwhile every backlogged tenant whose head fits its share is released, in the same order.

A tenant's sequences in flight, reserved sequences and weight are kept while it has sequences in
flight or requests held, and forgotten when it has neither. Pure: no clock, no asyncio. The caller
holds a ticket per held request (an asyncio future in the router), enqueues it, and wakes what
:meth:`ClassFlow.release` returns.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping
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
    """A tenant's place in the release order (its VTC counter) and its held requests."""

    counter: float
    served_at: int = 0  # when this tenant last had a request released (a step number)
    queue: deque[_Held[T]] = field(default_factory=deque)


def _order(item: tuple[str, _Tenant[Any]]) -> tuple[float, int]:
    return item[1].counter, item[1].served_at


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
        "inflight_of",
        "queue_limit",
        "reserved",
        "reserved_of",
        "tenants",
        "weight_of",
        "weights",
    )

    def __init__(self, capacity: int, queue_limit: int) -> None:
        self.capacity = capacity
        self.queue_limit = queue_limit
        self.inflight = 0  # sequences, all tenants
        self.reserved = 0  # of those, admitted on their tenants' guaranteed shares
        self.held = 0  # requests held, all tenants
        # The active tenants (sequences in flight or requests held): their sequences in flight, and
        # their weights (set when a tenant becomes active, and by each of its requests that is held or
        # checked against its share).
        self.inflight_of: dict[str, int] = {}
        self.weight_of: dict[str, int] = {}
        self.weights = 0  # the sum of weight_of
        self.reserved_of: dict[str, int] = {}  # the tenants with reserved sequences: how many
        self.tenants: dict[str, _Tenant[T]] = {}  # every tenant with a counter: backlogged or idle
        self.backlogged: dict[str, _Tenant[T]] = {}  # the tenants with requests held
        self._idle: list[tuple[float, int, str]] = []  # (counter, step, tenant) of idle tenants, a heap
        self._level = 0.0  # the counter of the last tenant served: where newcomers start when none wait
        self._step = 0

    def try_admit(self, tenant: str, weight: int, sequences: int) -> bool:
        """Admit at once when the pool has room and nobody is held (the hot path), or when the request
        fits its tenant's guaranteed share; False: the caller holds it (:meth:`hold`)."""
        inflight = self.inflight
        # Larger than the whole capacity passes too when nothing else is in flight.
        if not self.held and (inflight + sequences <= self.capacity or self.capacity <= 0 or not inflight):
            self.inflight = inflight + sequences
            of = self.inflight_of
            mine = of.get(tenant, 0)
            of[tenant] = mine + sequences
            if not mine:  # nobody is held: a tenant with nothing in flight was not active
                self.weight_of[tenant] = weight
                self.weights += weight
            return True
        return self._admit_saturated(tenant, weight, sequences)

    def _admit_saturated(self, tenant: str, weight: int, sequences: int) -> bool:
        if tenant in self.backlogged:
            return False  # never ahead of its own held requests
        active = tenant in self.weight_of
        if active:
            self._reweigh(tenant, weight)
        mine, weights = self.inflight_of.get(tenant, 0), self.weights + (0 if active else weight)
        if not self.held and self._pool_room(sequences):
            reserved = 0
        elif self._within_share(mine + sequences, weight, weights, sequences):
            reserved = sequences
        else:
            return False
        if not active:
            self._activate(tenant, weight)
        self._add(tenant, sequences, reserved)
        return True

    def hold(self, tenant: str, weight: int, sequences: int, ticket: T) -> bool:
        """Hold a request :meth:`try_admit` refused; False when the tenant's queue is full."""
        t = self.backlogged.get(tenant)
        if t is None:
            floor = self._floor()
            t = self.tenants.get(tenant)
            if t is None:
                t = self.tenants[tenant] = _Tenant(floor)
            else:
                t.counter = max(t.counter, floor)
            self.backlogged[tenant] = t
        elif len(t.queue) >= self.queue_limit:
            return False
        if tenant in self.weight_of:
            self._reweigh(tenant, weight)
        else:
            self._activate(tenant, weight)
        t.queue.append(_Held(ticket, sequences))
        self.held += 1
        return True

    def queued(self, tenant: str) -> int:
        t = self.backlogged.get(tenant)
        return len(t.queue) if t is not None else 0

    def cancel(self, tenant: str, ticket: T) -> bool:
        """Withdraw a held request (its wait timed out, or its client left); False if it is not held
        (it was released meanwhile: the caller owns its sequences then). The shares and the order
        change: the caller wakes what :meth:`pump` releases."""
        t = self.backlogged.get(tenant)
        if t is None:
            return False
        for held in t.queue:
            if held.ticket is ticket:
                t.queue.remove(held)
                self.held -= 1
                if not t.queue:
                    self._went_idle(tenant, t)
                    if not self.inflight_of[tenant]:
                        self._deactivate(tenant)
                return True
        return False

    def release(self, tenant: str, sequences: int) -> list[T]:
        """``tenant``'s request of ``sequences`` ended: the held requests that now go to the engines,
        in order."""
        self.inflight -= sequences
        of = self.inflight_of
        mine = of[tenant] - sequences
        if self.reserved:
            self._unreserve(tenant, mine)
        if mine or tenant in self.backlogged:
            of[tenant] = mine
        else:
            del of[tenant]
            self.weights -= self.weight_of.pop(tenant)
        return self.pump() if self.held else _NONE

    def set_capacity(self, capacity: int) -> list[T]:
        """The capacity changed (replicas came or went): what may go now."""
        self.capacity = capacity
        return self.pump()

    def set_weights(self, weights: Mapping[str, int]) -> list[T]:
        """The routing table was reloaded: the active tenants' weights from ``weights`` (a tenant not
        in it keeps its own), and what may go now that the shares moved."""
        for tenant, old in list(self.weight_of.items()):
            new = weights.get(tenant, old)
            if new != old:
                self._reweigh(tenant, new)
        return self.pump()

    def pump(self) -> list[T]:
        """Release what may go now: the head of the first backlogged tenant in the VTC order when it
        fits the pool, else the first (in that order) whose head fits its share; until neither does."""
        out: list[T] = []
        while self.held:
            name, t = min(self.backlogged.items(), key=_order)
            reserve = not self._pool_room(t.queue[0].sequences)
            if reserve:
                fits = (kv for kv in self.backlogged.items() if self._head_within_share(*kv))
                first = min(fits, key=_order, default=None)
                if first is None:
                    break
                name, t = first
            out.append(self._release_head(name, t, reserve))
        self._forget_passed()
        return out

    def _pool_room(self, sequences: int) -> bool:
        pooled = self.inflight - self.reserved
        return self.capacity <= 0 or pooled + sequences <= self.capacity or not pooled

    def _within_share(self, after: int, weight: int, weights: int, sequences: int) -> bool:
        """``after`` sequences in flight stay within the share of a tenant of ``weight`` (of
        ``weights`` in all), and the reserved ones within the capacity."""
        capacity = self.capacity
        return after * weights <= capacity * weight and self.reserved + sequences <= capacity

    def _head_within_share(self, name: str, t: _Tenant[T]) -> bool:
        sequences = t.queue[0].sequences
        after = self.inflight_of[name] + sequences
        return self._within_share(after, self.weight_of[name], self.weights, sequences)

    def _release_head(self, name: str, t: _Tenant[T], reserve: bool) -> T:
        head = t.queue.popleft()
        self.held -= 1
        self._add(name, head.sequences, head.sequences if reserve else 0)
        self._step += 1
        t.served_at = self._step
        self._level = t.counter
        t.counter += head.sequences / self.weight_of[name]
        if not t.queue:
            self._went_idle(name, t)
        return head.ticket

    def _add(self, tenant: str, sequences: int, reserved: int) -> None:
        self.inflight_of[tenant] += sequences
        self.inflight += sequences
        if reserved:
            self.reserved_of[tenant] = self.reserved_of.get(tenant, 0) + reserved
            self.reserved += reserved

    def _unreserve(self, tenant: str, left: int) -> None:
        """``tenant`` has ``left`` sequences in flight: its pool's end first, so its reserved ones
        are cut to what is left."""
        reserved = self.reserved_of.get(tenant, 0)
        if reserved > left:
            self.reserved -= reserved - left
            if left:
                self.reserved_of[tenant] = left
            else:
                del self.reserved_of[tenant]

    def _activate(self, tenant: str, weight: int) -> None:
        self.inflight_of[tenant] = 0
        self.weight_of[tenant] = weight
        self.weights += weight

    def _deactivate(self, tenant: str) -> None:
        del self.inflight_of[tenant]
        self.weights -= self.weight_of.pop(tenant)

    def _reweigh(self, tenant: str, weight: int) -> None:
        self.weights += weight - self.weight_of[tenant]
        self.weight_of[tenant] = weight

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
