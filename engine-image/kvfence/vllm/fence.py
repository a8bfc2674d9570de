"""The tenant fence around vLLM's KV-block pool, in plain Python (no vLLM import).

:mod:`kvfence.vllm.scheduler` plugs this into vLLM's own ``BlockPool`` and ``KVCacheManager``; this
module holds the decisions, so they read (and are tested) apart from vLLM's classes. It keeps a
*shadow* of vLLM's pool, one reference-engine :class:`~kvfence.engine.blocks.KVBlock` per vLLM block
id, and applies the reference engine's own quota book and eviction planner to it:

* **states**: a vLLM block with ``ref_cnt > 0`` is ``ACTIVE`` here, charged to the tenant that
  allocated it; a free block with a prefix-cache hash is ``COLD``, in its owner's cold list (least
  recently freed first); a free block without one is ``FREE``, in the clean free list. The null block
  (id 0) is in no list.
* **quotas** (:class:`~kvfence.engine.quotas.QuotaBook`): usage, hard maximum and guaranteed share per
  tenant, exactly as on the reference engine; changes apply in place (:meth:`TenantFence.set_quotas`).
* **eviction** (:func:`~kvfence.engine.eviction.plan_allocation`): clean free blocks minus others'
  reservations, then the tenant's own cold blocks, then others' cold blocks beyond their guarantee;
  counted ``own``/``cross``.
* **admission**: a request of a tenant with a ``maxBlocks`` is admitted only if the blocks its
  prompt and ``max_tokens`` can reach fit next to what the tenant's admitted requests may reach, so an
  admitted request never runs into its tenant's maximum while decoding (which would make vLLM preempt
  an unrelated request). Requests that do not fit wait.
* **generations**: every time a block is handed out for new content its generation moves; a prefix
  hit is remembered as (block id, generation) at lookup and refused as *stale* if the generation moved
  before the request took the block.
* **verified hits**: each cached block has an interned :class:`Record` (its token ids, the record of
  the block before it, and at the root the cache namespace: salt and adapter). Interning makes two
  blocks with the same content and the same prefix share one record, so a hit chain is verified by
  one tuple comparison and one identity check per block; a candidate that fails is a miss, counted as
  a collision, or as a cross-namespace access when its chain starts in another namespace.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfence.engine.blocks import BlockPool, BlockState, KVBlock
from kvfence.engine.config import QuotasConfig
from kvfence.engine.eviction import EvictionPlan, plan_allocation, take_cold
from kvfence.engine.quotas import AllocationError, QuotaBook, TenantAccount

#: The account of blocks allocated outside any request's context (vLLM internals); never expected.
UNATTRIBUTED = ""

Namespace = tuple[Any, ...]


class FenceError(Exception):
    """The fence was asked to do something its bookkeeping says is impossible (a bug, never input)."""


class Record:
    """What a cached block holds: its tokens, after which block, in which namespace (root only).

    Records are interned (:meth:`TenantFence.intern`): equal content after an equal prefix is the
    same object, so ``a is b`` compares whole chains.
    """

    __slots__ = ("__weakref__", "namespace", "parent", "tokens")

    def __init__(self, parent: Record | None, tokens: tuple[int, ...], namespace: Namespace | None) -> None:
        self.parent = parent
        self.tokens = tokens
        self.namespace = namespace

    def root_namespace(self) -> Namespace | None:
        r = self
        while r.parent is not None:
            r = r.parent
        return r.namespace


@dataclass(slots=True)
class FenceCounters:
    """Everything the fence counts; exported by :mod:`kvfence.vllm.stats` under the contract's names."""

    hash_collision: int = 0
    cross_access_rejected: int = 0
    stale_reference: int = 0
    evictions_own: int = 0
    evictions_cross: int = 0
    #: requests refused because they can never fit the tenant's maximum, by tenant
    quota_rejected: dict[str, int] = field(default_factory=dict)
    #: scheduling steps in which a request was held back for its tenant's maximum, by tenant
    quota_held_back: dict[str, int] = field(default_factory=dict)
    #: requests refused because their tenant identity did not verify, by reason
    identity_rejected: dict[str, int] = field(default_factory=dict)


class Verdict:
    OK = "ok"
    COLLISION = "collision"
    CROSS_ACCESS = "cross_access"


class TenantFence:
    """Shadow bookkeeping of one vLLM block pool. Called from vLLM's scheduler thread only, except
    :meth:`snapshot`, which the stats writer calls from its own thread."""

    def __init__(self, num_blocks: int, block_size: int, quotas: QuotasConfig) -> None:
        if num_blocks < 2:
            raise FenceError("a vLLM block pool has the null block and at least one more")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        # vLLM's null block (id 0) is never handed out.
        null = self.pool.blocks[0]
        self.pool.free.remove(null)
        null.state = BlockState.ACTIVE
        self.usable_blocks = num_blocks - 1
        self._check_guarantees(quotas)
        self.book = QuotaBook(quotas, self.usable_blocks)
        self.counters = FenceCounters()
        self.records: list[Record | None] = [None] * num_blocks
        self._interned: weakref.WeakValueDictionary[tuple[int, tuple[int, ...], Any], Record] = (
            weakref.WeakValueDictionary()
        )
        #: request id -> (tenant account, blocks reserved) for admitted requests of limited tenants
        self._admitted: dict[str, tuple[TenantAccount, int]] = {}
        self._reserved: dict[str, int] = {}
        #: bumped on every change the stats export shows
        self.version = 0
        self.lock = threading.Lock()

    # --- quotas -------------------------------------------------------------------------------------
    def _check_guarantees(self, quotas: QuotasConfig) -> None:
        total = sum(q.guaranteed_blocks for q in quotas.tenants.values())
        if total > self.usable_blocks:
            raise FenceError(
                f"the tenants' guaranteedKVBlocks add up to {total}, more than the {self.usable_blocks} "
                "KV blocks this vLLM engine has"
            )

    def set_quotas(self, quotas: QuotasConfig) -> None:
        """Apply new limits in place (blocks and usage are kept; see QuotaBook.set_quotas)."""
        self._check_guarantees(quotas)
        self.book.set_quotas(quotas)
        self.version += 1

    def account(self, tenant: str) -> TenantAccount:
        return self.book.account(tenant)

    # --- admission ----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_alone(self, tenant: str, num_tokens: int) -> bool:
        acct = self.book.account(tenant)
        ok = not acct.limited or self.blocks_for(num_tokens) <= acct.max_blocks
        self.book.forget_if_idle(acct)
        return ok

    def can_admit(self, tenant: str, num_tokens: int, pending: int = 0) -> int | None:
        """The blocks a new request of ``tenant`` reaching ``num_tokens`` tokens would reserve, if it
        fits next to the tenant's admitted requests (and ``pending`` blocks of requests admitted ahead
        of it in this step); None if it must wait. Unlimited tenants reserve nothing."""
        acct = self.book.account(tenant)
        if not acct.limited:
            return 0
        need = self.blocks_for(num_tokens)
        if self._reserved.get(tenant, 0) + pending + need > acct.max_blocks:
            return None
        return need

    def is_admitted(self, request_id: str) -> bool:
        return request_id in self._admitted

    def admit(self, request_id: str, tenant: str, blocks: int) -> None:
        if request_id in self._admitted:
            return
        acct = self.book.account(tenant)
        acct.open_sequences += 1
        self._admitted[request_id] = (acct, blocks)
        if blocks:
            self._reserved[tenant] = self._reserved.get(tenant, 0) + blocks

    def release(self, request_id: str) -> None:
        entry = self._admitted.pop(request_id, None)
        if entry is None:
            return
        acct, blocks = entry
        left = self._reserved.get(acct.tenant, 0) - blocks
        if left > 0:
            self._reserved[acct.tenant] = left
        else:
            self._reserved.pop(acct.tenant, None)
        acct.open_sequences -= 1
        self.book.forget_if_idle(acct)

    # --- the pool -----------------------------------------------------------------------------------
    def obtainable(self, tenant: str) -> int:
        """How many new blocks ``tenant`` can get right now (quota and other tenants' shares)."""
        acct = self.book.account(tenant)
        cap = acct.max_blocks - acct.active
        usable_free = max(0, len(self.pool.free) - self.book.reserved_for_others(acct))
        have = usable_free + len(acct.cold)
        if have < cap:
            for other in self.book.accounts.values():
                if other is not acct:
                    have += other.reclaimable_by_others
                    if have >= cap:
                        break
        self.book.forget_if_idle(acct)
        return max(0, min(cap, have))

    def take(self, tenant: str, n: int) -> tuple[list[int], list[int]]:
        """Hand ``n`` blocks to ``tenant`` (all or nothing, :class:`AllocationError` otherwise).

        Returns (block ids in order, those among them that were cold cached blocks, which the caller
        must take out of vLLM's prefix cache). Every block's generation moves.
        """
        acct = self.book.account(tenant)
        plan: EvictionPlan = plan_allocation(self.pool, self.book, acct, n)
        evicted: list[KVBlock] = [take_cold(acct) for _ in range(plan.own_evictions)]
        self.counters.evictions_own += plan.own_evictions
        for other, k in plan.cross_evictions:
            evicted.extend(take_cold(other) for _ in range(k))
            self.counters.evictions_cross += k
        for b in evicted:
            assert b.owner is not None
            self.book.add_usage(self.book.accounts[b.owner], -1)
            b.owner = None
            self.records[b.block_id] = None
        for other, _ in plan.cross_evictions:
            self.book.forget_if_idle(other)
        fresh = [self.pool.free.popleft() for _ in range(plan.from_free)]
        out = evicted + fresh
        for b in out:
            b.generation += 1
            b.state = BlockState.ACTIVE
            b.owner = tenant
        self.book.add_usage(acct, len(out))
        self.version += 1
        return [b.block_id for b in out], [b.block_id for b in evicted]

    def take_any(self, tenant: str, n: int) -> tuple[list[int], list[int]]:
        """Hand out ``n`` blocks ignoring quotas and guarantees: clean ones first, then any tenant's
        cold ones. Only for the case :meth:`take` refuses although vLLM already counted the blocks as
        obtainable (a bug): keeping vLLM's engine alive beats enforcing a quota by crashing it."""
        acct = self.book.account(tenant)
        picked: list[KVBlock] = []
        evicted: list[KVBlock] = []
        while len(picked) < n and len(self.pool.free):
            picked.append(self.pool.free.popleft())
        for other in list(self.book.accounts.values()):
            while len(picked) < n and len(other.cold):
                b = take_cold(other)
                self.book.add_usage(other, -1)
                b.owner = None
                self.records[b.block_id] = None
                evicted.append(b)
                picked.append(b)
        if len(picked) < n:
            raise FenceError(f"{n} blocks asked, {len(picked)} free or cached")
        for b in picked:
            b.generation += 1
            b.state = BlockState.ACTIVE
            b.owner = tenant
        self.book.add_usage(acct, len(picked))
        self.version += 1
        return [b.block_id for b in picked], [b.block_id for b in evicted]

    def revive(self, block_id: int) -> None:
        """A cold block was taken by a prefix hit: it leaves its owner's cold list, still charged."""
        b = self.pool.blocks[block_id]
        if b.state is not BlockState.COLD or b.in_list is None:
            raise FenceError(f"block {block_id} revived from state {b.state.name}")
        b.in_list.remove(b)
        b.state = BlockState.ACTIVE
        self.version += 1

    def released(self, block_id: int, cached: bool) -> None:
        """vLLM dropped the last reference: a cached block turns cold, any other one clean."""
        b = self.pool.blocks[block_id]
        if b.state is not BlockState.ACTIVE or b.owner is None:
            raise FenceError(f"block {block_id} released from state {b.state.name}")
        acct = self.book.accounts[b.owner]
        if cached:
            b.state = BlockState.COLD
            acct.cold.append(b)
        else:
            self._to_free(b, acct)
        self.version += 1

    def uncached(self, block_id: int) -> None:
        """A cold block lost its prefix-cache entry (vLLM's evict_blocks): it becomes clean."""
        b = self.pool.blocks[block_id]
        if b.state is BlockState.COLD and b.owner is not None:
            acct = self.book.accounts[b.owner]
            assert b.in_list is acct.cold
            acct.cold.remove(b)
            self._to_free(b, acct)
            self.version += 1
        elif b.state is BlockState.ACTIVE:
            self.records[block_id] = None

    def _to_free(self, b: KVBlock, acct: TenantAccount) -> None:
        b.state = BlockState.FREE
        b.owner = None
        self.records[b.block_id] = None
        self.pool.free.append(b)
        self.book.add_usage(acct, -1)
        self.book.forget_if_idle(acct)

    def generation(self, block_id: int) -> int:
        return self.pool.blocks[block_id].generation

    def state(self, block_id: int) -> BlockState:
        return self.pool.blocks[block_id].state

    def owner(self, block_id: int) -> str | None:
        return self.pool.blocks[block_id].owner

    # --- prefix-cache records -----------------------------------------------------------------------
    def intern(self, parent: Record | None, tokens: tuple[int, ...], namespace: Namespace | None) -> Record:
        key = (0 if parent is None else id(parent), tokens, namespace)
        rec = self._interned.get(key)
        if rec is None:
            rec = Record(parent, tokens, namespace)
            self._interned[key] = rec
        return rec

    def record(self, block_id: int, rec: Record) -> None:
        self.records[block_id] = rec

    @staticmethod
    def block_namespace(i: int, tenant_ns: Namespace, extras: Sequence[Any] | None) -> Namespace | None:
        """What block ``i`` of a chain stores besides its tokens: the root holds the request's cache
        namespace (salt and adapter) and its extra keys; later blocks only their extra keys
        (multimodal inputs), None for text. Used for recording and verifying alike."""
        extra = extras[i] if extras is not None else None
        if i == 0:
            return (tenant_ns, extra)
        return None if extra is None else (extra,)

    def verify(
        self,
        block_ids: Sequence[int],
        tokens: Sequence[int],
        tenant_ns: Namespace,
        extras: Sequence[Any] | None = None,
    ) -> tuple[int, str]:
        """How many leading blocks of a hit chain hold exactly ``tokens`` under ``tenant_ns``.

        ``extras``: per-block extra keys (multimodal requests), None for text. The first failing block
        ends the hit and is counted: as a cross-namespace access if its chain starts in another
        namespace, otherwise as a hash collision.
        """
        bs = self.block_size
        parent: Record | None = None
        for i, bid in enumerate(block_ids):
            rec = self.records[bid]
            if (
                rec is not None
                and rec.parent is parent
                and rec.namespace == self.block_namespace(i, tenant_ns, extras)
                and rec.tokens == tuple(tokens[i * bs : (i + 1) * bs])
            ):
                parent = rec
                continue
            root = rec.root_namespace() if rec is not None else None
            if root is not None and root[0] != tenant_ns:
                self.counters.cross_access_rejected += 1
                verdict = Verdict.CROSS_ACCESS
            else:
                self.counters.hash_collision += 1
                verdict = Verdict.COLLISION
            self.version += 1
            return i, verdict
        return len(block_ids), Verdict.OK

    # --- counters -------------------------------------------------------------------------------------
    def count(self, name: str, key: str) -> None:
        d: dict[str, int] = getattr(self.counters, name)
        d[key] = d.get(key, 0) + 1
        self.version += 1

    def snapshot(self) -> dict[str, Any]:
        """The counters and per-tenant usage, as the stats file carries them."""
        c = self.counters
        tenants = {}
        for acct in list(self.book.accounts.values()):
            tenants[acct.tenant] = {
                "active": acct.active,
                "cached": len(acct.cold),
                "max": acct.max_blocks if acct.limited else None,
                "guaranteed": acct.guaranteed,
                "reserved": self._reserved.get(acct.tenant, 0),
            }
        return {
            "hash_collision": c.hash_collision,
            "cross_access_rejected": c.cross_access_rejected,
            "stale_reference": c.stale_reference,
            "evictions": {"own": c.evictions_own, "cross": c.evictions_cross},
            "quota_rejected": dict(c.quota_rejected),
            "quota_held_back": dict(c.quota_held_back),
            "identity_rejected": dict(c.identity_rejected),
            "blocks": {
                "total": self.usable_blocks,
                "free": len(self.pool.free),
                "active": sum(t["active"] for t in tenants.values()),
                "cached": sum(t["cached"] for t in tenants.values()),
            },
            "tenants": tenants,
        }


__all__ = [
    "UNATTRIBUTED",
    "AllocationError",
    "FenceCounters",
    "FenceError",
    "Record",
    "TenantFence",
    "Verdict",
]
