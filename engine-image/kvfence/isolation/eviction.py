"""Eviction partitioned by tenant.

When a tenant needs blocks, they come, in this order, from

1. the clean free list, minus the blocks reserved for other tenants' guaranteed shares;
2. the tenant's *own* cold cached blocks, least recently used first (a tenant at its hard maximum
   must take these first: that is the only way it can make room);
3. other tenants' cold cached blocks, but only those beyond each owner's guaranteed share, taken
   from the tenant furthest above its guarantee.

So a tenant that stays within its guaranteed share never loses a cached block to another tenant, and
what a tenant can observe about eviction (its own hit rate) is driven by its own traffic first. See
``docs/engine.md`` for what it can still learn.

The plan is computed before anything is changed, so an allocation either gets every block it asked
for or nothing (:class:`~kvfence.isolation.quotas.AllocationError`).
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Protocol

from kvfence.isolation.blocks import KVBlock
from kvfence.isolation.quotas import PoolExhausted, QuotaBook, QuotaExceeded, TenantAccount


class HasFree(Protocol):
    """A pool whose clean free blocks are counted by ``len(pool.free)``: the reference engine's
    :class:`~kvfence.isolation.blocks.BlockPool`, or the vLLM fence's shadow pool."""

    @property
    def free(self) -> Sized: ...


@dataclass(slots=True)
class EvictionPlan:
    from_free: int
    own_evictions: int
    #: (owner account, number of its cold blocks to reclaim), in order
    cross_evictions: list[tuple[TenantAccount, int]]
    #: the tenant's own cold blocks evicted and returned to the clean free list, not handed out: its
    #: usage was above its maximum (lowered since) by more than the blocks it asks for. Evicted first
    #: (least recently used), before the ``own_evictions`` it is handed.
    released: int = 0


def plan_allocation(
    pool: HasFree,
    book: QuotaBook,
    acct: TenantAccount,
    needed: int,
    *,
    revived_own: int = 0,
    revived_by_owner: dict[str, int] | None = None,
) -> EvictionPlan:
    """Where ``needed`` new blocks for ``acct`` come from, or raise.

    ``revived_own`` / ``revived_by_owner``: cold blocks the same request is about to revive through
    prefix-cache hits (they leave the cold lists, so they are neither evictable nor quota-free).
    """
    revived_by_owner = revived_by_owner or {}
    active_after = acct.active + revived_own
    if active_after + needed > acct.max_blocks:
        if not acct.limited:  # no maxBlocks: the limit is the pool itself
            raise PoolExhausted(acct.tenant, needed, acct.max_blocks - active_after)
        raise QuotaExceeded(acct.tenant, needed, active_after, acct.max_blocks)
    own_cold = len(acct.cold) - revived_own
    # Evictions the hard maximum forces on the tenant's own cold blocks. More than it needs when its
    # usage is above its maximum (the maximum was lowered): the surplus goes back to the free list.
    forced = max(0, acct.usage + needed - acct.max_blocks)
    assert forced <= own_cold
    released = max(0, forced - needed)
    handed = forced - released
    rest = needed - handed
    usable_free = max(0, len(pool.free) - book.reserved_for_others(acct))
    from_free = min(rest, usable_free)
    rest -= from_free
    own = handed + min(rest, own_cold - forced)
    rest -= own - handed
    cross: list[tuple[TenantAccount, int]] = []
    if rest > 0:
        # Reclaim from others, furthest above their guarantee first. O(tenants), only on this path.
        budget: dict[str, int] = {}
        for other in book.accounts.values():
            if other is acct:
                continue
            revived = revived_by_owner.get(other.tenant, 0)
            cold = len(other.cold) - revived
            budget[other.tenant] = min(cold, max(0, other.usage - other.guaranteed))
        order = sorted(
            (o for o in book.accounts.values() if budget.get(o.tenant, 0) > 0),
            key=lambda o: o.usage - o.guaranteed,
            reverse=True,
        )
        for other in order:
            take = min(rest, budget[other.tenant])
            cross.append((other, take))
            rest -= take
            if rest == 0:
                break
    if rest > 0:
        raise PoolExhausted(acct.tenant, needed, needed - rest)
    return EvictionPlan(from_free, own, cross, released)


def take_cold(acct: TenantAccount) -> KVBlock:
    """The least recently used cold block of ``acct`` (still registered; the caller evicts it)."""
    return acct.cold.popleft()
