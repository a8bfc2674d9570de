"""Weighted fair share between tenants: the scheduling policy both engines implement.

The policy follows VTC ("Fairness in Serving Large Language Models", OSDI '24). Every tenant has a
*virtual counter*: the weighted service it has received divided by its weight. Service is counted in
units per token:

* a prompt token the engine computes costs :data:`PREFILL_COST`;
* a prompt token served from the prefix cache costs :data:`CACHED_COST`: the step computes neither
  its projections nor its MLP, it only reads its K/V in attention, so it is charged a quarter of a
  computed one (VTC counts it as a computed token);
* a generated token costs :data:`OUTPUT_COST` (VTC's output weight of twice the input's).

What the engines decide with it:

* :meth:`FairShare.order`: the waiting queue, first in first out within a tenant, interleaved so that
  the next request is the head of the tenant with the smallest counter (each admission advancing that
  tenant's projected counter by the request's prompt cost).
* :meth:`FairShare.divide`: a step's token budget or its running slots among the tenants with work,
  in proportion to their weights; what a tenant cannot use goes to the others (work-conserving), and
  the indivisible remainder goes to the smallest counters first.
* :meth:`FairShare.victim`: whom to preempt: the tenant furthest above its share (the larger counter
  on a tie), never one at or below it.

A tenant that gets work after having none is lifted to the smallest counter of the tenants that have
work (or to the counter of the last one that had work), so idle time is never banked as a burst; its
own counter is kept when it is higher, so leaving and coming back does not reset what it used.

Pure: no clock, no threads, no vLLM. The reference engine calls it from its scheduler thread, the vLLM
plugin from vLLM's scheduler.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate, repeat
from operator import truediv
from typing import Any, NamedTuple, TypeVar

from kvfence.contract import QUEUE_STEP_BUCKETS

T = TypeVar("T")

#: Service units of one computed prompt token, one cached prompt token and one generated token.
PREFILL_COST = 4
CACHED_COST = 1
OUTPUT_COST = 8
#: The weight of a tenant for which the configuration names none.
DEFAULT_WEIGHT = 1


def request_cost(prefill: int = 0, cached: int = 0, output: int = 0) -> int:
    """Service units of ``prefill`` computed prompt tokens, ``cached`` cached ones and ``output``
    generated tokens."""
    return prefill * PREFILL_COST + cached * CACHED_COST + output * OUTPUT_COST


class Division(NamedTuple):
    """A budget divided by :meth:`FairShare.fill`, before its remainder is handed out."""

    grant: dict[str, int]
    #: the tenants given less than their demand (in the order of demand per weight)
    short: list[str]
    #: units left over by the integer division (fewer than ``short`` has tenants)
    remainder: int


class FairShare:
    """Virtual counters of the tenants and the decisions taken from them (see the module)."""

    def __init__(
        self, default_weight: int = DEFAULT_WEIGHT, weights: Mapping[str, int] | None = None
    ) -> None:
        self._default = DEFAULT_WEIGHT
        self._weights: dict[str, int] = {}
        self.set_weights(default_weight, weights or {})
        self._counter: dict[str, float] = {}
        self._active: set[str] = set()
        #: the counter a tenant is lifted to when nobody has work
        self._floor = 0.0

    # --- weights ------------------------------------------------------------------------------
    def set_weights(self, default_weight: int, weights: Mapping[str, int]) -> None:
        """Replace the weights (a reloaded config). Counters are kept: what was served stays served."""
        bad = {t: w for t, w in weights.items() if w < 1}
        if default_weight < 1 or bad:
            raise ValueError(f"weights must be positive integers: default {default_weight}, {bad}")
        self._default = default_weight
        self._weights = dict(weights)

    def weight(self, tenant: str) -> int:
        return self._weights.get(tenant, self._default)

    # --- counters -------------------------------------------------------------------------------
    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (weighted service / weight)."""
        c = self._counter.get(tenant)
        return self._lift_to() if c is None else c

    def _lift_to(self) -> float:
        if self._active:
            return min(self._counter[t] for t in self._active)
        return self._floor

    @property
    def active(self) -> frozenset[str]:
        return frozenset(self._active)

    @property
    def busy(self) -> int:
        """How many tenants have work (:meth:`sync`)."""
        return len(self._active)

    def sync(self, with_work: Iterable[str]) -> None:
        """Declare the tenants that have work now (waiting or running). A tenant that had none is
        lifted to the smallest counter of those that had work; one that has none any more is kept
        only while its counter is above that floor (below it, it would be lifted anyway)."""
        now = set(with_work)
        gone = self._active - now
        for t in gone:
            self._active.discard(t)
            if not self._active:
                self._floor = max(self._floor, self._counter[t])
        floor = self._lift_to()
        for t in now - self._active:
            self._counter[t] = max(self._counter.get(t, floor), floor)
        self._active |= now
        floor = self._lift_to()
        for t in [t for t, c in self._counter.items() if t not in self._active and c <= floor]:
            del self._counter[t]

    def charge(self, tenant: str, units: int) -> None:
        """Count ``units`` of service (:func:`request_cost`) to ``tenant``."""
        if units:
            self._counter[tenant] = self.counter(tenant) + units / self.weight(tenant)

    def charge_all(self, units: Mapping[str, int]) -> None:
        """:meth:`charge` for each tenant of ``units`` (a step's service, once a step)."""
        counters, weights, default = self._counter, self._weights, self._default
        for tenant, u in units.items():
            if u:
                c = counters.get(tenant)
                counters[tenant] = (self._lift_to() if c is None else c) + u / weights.get(tenant, default)

    # --- decisions ------------------------------------------------------------------------------
    def order(
        self, queue: Sequence[T], tenant_of: Callable[[T], str], cost_of: Callable[[T], int]
    ) -> list[T]:
        """``queue`` in admission order: each tenant's items in their own order, the next one always
        the head of the tenant whose counter, advanced by the cost of what is already placed before
        it, is the smallest (ties: the tenant whose head came first in ``queue``)."""
        ranks = self.ranks([tenant_of(x) for x in queue], [cost_of(x) for x in queue])
        return [queue[i] for i in ranks]

    def ranks(self, tenants: Sequence[str], costs: Sequence[int]) -> list[int]:
        """:meth:`order` on positions: item ``i`` of a queue is ``tenants[i]``'s and costs
        ``costs[i]``; the positions in admission order. One sort on (projected counter, tenant's first
        position, position): the merge of the tenants' non-decreasing sequences."""
        n = len(tenants)
        first = {t: i for i, t in enumerate(dict.fromkeys(tenants))}  # by first appearance
        if len(first) == n:  # one item a tenant (a step letting one request of each through)
            counter = self.counter
            return sorted(range(n), key=lambda i: (counter(tenants[i]), i))
        ids = list(map(first.__getitem__, tenants))
        grouped = sorted(range(n), key=ids.__getitem__)  # stable: each tenant's positions in order
        levels: list[float] = []
        start = 0
        for t, i in first.items():
            end = start + ids.count(i)
            part = map(costs.__getitem__, grouped[start:end])
            # level before each item: the counter plus the earlier items' costs, added one by one
            levels += accumulate(map(truediv, part, repeat(self.weight(t))), initial=self.counter(t))
            levels.pop()
            start = end
        keyed = list(zip(levels, map(ids.__getitem__, grouped), grouped, strict=True))
        keyed.sort()  # the positions are distinct: no two keys are equal
        return [k[2] for k in keyed]

    def divide(self, budget: int, demands: Mapping[str, int]) -> dict[str, int]:
        """``budget`` units (tokens, slots) among the tenants of ``demands`` (what each could use) in
        proportion to their weights, no tenant above its demand; what one cannot use goes to the
        others, and the remainder of the integer division to the smallest counters first."""
        return self.hand_out(self.fill(budget, demands))

    def fill(self, budget: int, demands: Mapping[str, int]) -> Division:
        """:meth:`divide` up to its remainder, which depends on the counters only: a caller whose
        demands did not change keeps this and calls :meth:`hand_out` as the counters move."""
        want = {t: d for t, d in demands.items() if d > 0}
        if sum(want.values()) <= budget:  # all fits
            return Division({t: max(0, d) for t, d in demands.items()}, [], 0)
        grant = dict.fromkeys(demands, 0)
        weights, default = self._weights, self._default
        weight = {t: weights.get(t, default) for t in want}
        left, total = max(0, budget), sum(weight.values())
        # Water-filling: in order of demand per weight, a tenant whose demand is within its share of
        # what is left is given all of it (the level of the others then rises); the rest split by weight.
        order = sorted([(d / weight[t], t) for t, d in want.items()])
        i = 0
        for _, t in order:
            if want[t] * total > left * weight[t]:
                break
            grant[t] = want[t]
            left -= want[t]
            total -= weight[t]
            i += 1
        rest = [t for _, t in order[i:]]
        for t in rest:
            grant[t] = left * weight[t] // total
        return Division(grant, rest, left - sum([grant[t] for t in rest]))

    def hand_out(self, division: Division) -> dict[str, int]:
        """The division's remainder, one unit each to the tenants still short, smallest counter first
        (a new dict; the division's own when there is no remainder)."""
        if not division.remainder:
            return division.grant
        grant = dict(division.grant)
        counter = self.counter
        for _, t in sorted([(counter(t), t) for t in division.short])[: division.remainder]:
            grant[t] += 1
        return grant

    def victim(self, running: Mapping[str, int], shares: Mapping[str, int]) -> str | None:
        """The tenant to preempt: the one furthest above its share (``running`` units held against
        ``shares``), the larger counter on a tie; None when no tenant is above its share."""
        over = [
            (n - shares.get(t, 0), self.counter(t), t) for t, n in running.items() if n > shares.get(t, 0)
        ]
        return max(over)[2] if over else None


class QueueSteps:
    """What fair share is for, counted: per tenant, its requests by the engine steps that ran while
    each waited before the step that first scheduled it, in the buckets of
    :data:`~kvfence.contract.QUEUE_STEP_BUCKETS` (at most each bound; the last one: more), and those
    steps summed. Both engines export it as ``kvfence_engine_tenant_queue_steps{tenant}``."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, int] = {}

    def started(self, tenant: str, arrived: int, step: int) -> None:
        """A request of ``tenant`` that arrived when the engine had run ``arrived`` steps was first
        scheduled by step number ``step``: the steps between waited for it (none when it arrived while
        that step ran)."""
        waited = max(0, step - arrived - 1)
        counts = self.counts.get(tenant)
        if counts is None:
            counts = self.counts[tenant] = [0] * (len(QUEUE_STEP_BUCKETS) + 1)
        counts[bisect_left(QUEUE_STEP_BUCKETS, waited)] += 1
        self.sums[tenant] = self.sums.get(tenant, 0) + waited

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """tenant -> {"buckets": counts per bucket, "sum": steps}; safe to call from another thread."""
        return {t: {"buckets": list(c), "sum": self.sums.get(t, 0)} for t, c in list(self.counts.items())}
