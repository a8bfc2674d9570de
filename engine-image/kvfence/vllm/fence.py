"""The tenant fence around vLLM's KV-block pool, in plain Python (no vLLM import).

:mod:`kvfence.vllm.scheduler` plugs this into vLLM's own ``BlockPool`` and ``KVCacheManager``; this
module holds the decisions, so they read (and are tested) apart from vLLM's classes. It keeps the
fence's state of each block of vLLM's pool (a *shadow* of vLLM's: state, owner, generation, list
links, the fields of the reference engine's :class:`~kvfence.isolation.blocks.KVBlock`) on vLLM's own
block objects, which carry those fields as well (:class:`kvfence.vllm.block_pool.FencedKVCacheBlock`;
alone, in tests, on KVBlocks), and applies the reference engine's own quota book and eviction planner
to them:

* **states**: a vLLM block with ``ref_cnt > 0`` is ``ACTIVE`` here, charged to the tenant that
  allocated it; a free block with a prefix-cache hash is ``COLD``, in its owner's cold list (least
  recently freed first); a free block without one is ``FREE``, in the clean free list. The null block
  (id 0) is in no list.
* **quotas** (:class:`~kvfence.isolation.quotas.QuotaBook`): usage, hard maximum and guaranteed share per
  tenant, exactly as on the reference engine; changes apply in place (:meth:`TenantFence.set_quotas`).
* **eviction** (:func:`~kvfence.isolation.eviction.plan_allocation`): clean free blocks minus others'
  reservations, then the tenant's own cold blocks, then others' cold blocks beyond their guarantee;
  counted ``own``/``cross``.
* **admission**: a request of a tenant with a ``maxBlocks`` is admitted only if the blocks its
  prompt and ``max_tokens`` can reach fit next to what the tenant's admitted requests may reach, so an
  admitted request never runs into its tenant's maximum while decoding (which would make vLLM preempt
  an unrelated request). Requests that do not fit wait.
* **generations**: every time a block is handed out for new content its generation moves: it is set
  to :attr:`TenantFence.moves`, a counter of the fence's hand-outs and frees, so a generation above the
  counter's value at a prefix lookup means the block moved since; a prefix hit is refused as *stale* if
  a block it looked up moved (or was freed) before the request took it. While the counter has not
  moved since the lookup, no block did (one comparison instead of one per block).
* **verified hits**: each cached block has a :class:`~kvfence.vllm.records.Record`: its token ids,
  the record of the block before it, and at the root the cache namespace (salt and adapter). A hit
  chain verifies when each block's tokens are the request's and its parent record is the previous
  block's (the same object, or failing that the same content: vLLM keeps duplicate copies of a
  block); a candidate that fails is a miss, counted as a collision, or as a cross-namespace access
  when its chain starts in another namespace.
* **the free blocks**: the fence owns them. vLLM's own free queue (a doubly linked list in Python) is
  replaced by a count (:class:`~kvfence.vllm.block_pool.FenceFreeCount`); clean blocks are a stack
  here (the block freed last is handed out first, as vLLM reuses uncached blocks), cold ones are in
  their owners' cold lists, so each block moves once per event, not once in each structure.

Cost: vLLM asks the pool for its free-block count for every scheduled request of every step, so that
answer is O(1) (:meth:`TenantFence.obtainable`): without any quota it is vLLM's own count; with
guarantees, the blocks other tenants may lose are kept as a running total.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from kvfence.contract.engine_config import QuotasConfig
from kvfence.isolation.blocks import BlockState, KVBlock
from kvfence.isolation.eviction import plan_allocation, take_cold
from kvfence.isolation.quotas import SHARED_OWNER, AllocationError, QuotaBook, TenantAccount
from kvfence.vllm.records import Record, equal, verify_chain

#: The account of blocks allocated outside any request's context (vLLM internals); never expected.
UNATTRIBUTED = ""

Namespace = tuple[Any, ...]

FREE, ACTIVE, COLD = BlockState.FREE, BlockState.ACTIVE, BlockState.COLD


_block_id_of = attrgetter("block_id")
_owner_of = attrgetter("owner")
_state_of = attrgetter("state")


class FenceError(Exception):
    """The fence was asked to do something its bookkeeping says is impossible (a bug, never input)."""


class ShadowPool:
    """One block object per vLLM block id, and the clean free blocks: a stack (the block freed last is
    handed out first; at the start block 1 first, as vLLM). Block 0, vLLM's null block, is never
    free.

    ``blocks``: the block objects, each with :class:`~kvfence.isolation.blocks.KVBlock`'s fields (state,
    owner, generation, the list links), ``blocks[i].block_id == i``. Inside vLLM they are vLLM's own
    blocks (:class:`kvfence.vllm.block_pool.FencedKVCacheBlock`), so the fence's state of a block lives
    in the object vLLM touches anyway; without them (the fence alone, in tests) plain KVBlocks."""

    __slots__ = ("blocks", "free")

    def __init__(self, num_blocks: int, blocks: list[KVBlock] | None = None) -> None:
        if blocks is None:
            blocks = [KVBlock(i) for i in range(num_blocks)]
        elif len(blocks) != num_blocks or any(b.block_id != i for i, b in enumerate(blocks)):
            raise FenceError(f"the fence needs {num_blocks} blocks, block i at index i")
        self.blocks = blocks
        self.free: list[KVBlock] = blocks[:0:-1]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def root_namespace(rec: Record) -> Namespace | None:
    """The cache namespace of the chain ``rec`` belongs to: at its root (the first block, or the first
    block after a declared shared prefix, where the request's own namespace enters the chain)."""
    r: Record | None = rec
    while r is not None and not r.root and r.parent is not None:
        r = r.parent
    return r.namespace if r is not None else None


@dataclass(frozen=True, eq=False)
class SharedPin:
    """A declared shared prefix, computed and pinned: its full blocks (held forever, charged to
    :data:`~kvfence.isolation.quotas.SHARED_OWNER`), their vLLM block hashes and records."""

    name: str
    #: the rendered prefix's tokens (a request must begin with all of them); a list, as prompts are,
    #: so that a prompt's slice compares with it directly (never modified)
    tokens: list[int]
    block_ids: tuple[int, ...]
    hashes: tuple[Any, ...]
    records: tuple[Record, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


def same_chain(a: Record | None, b: Record | None) -> bool:
    """Whether two records hold the same content after the same prefix (identity first, then content:
    the walk stops where the chains meet)."""
    while a is not b:
        if a is None or b is None or a.tokens != b.tokens or a.namespace != b.namespace:
            return False
        a, b = a.parent, b.parent
    return True


@dataclass(slots=True)
class FenceCounters:
    """Everything the fence counts; exported by :mod:`kvfence.vllm.stats` under the contract's names."""

    hash_collision: int = 0
    cross_access_rejected: int = 0
    stale_reference: int = 0
    evictions_own: int = 0
    evictions_cross: int = 0
    #: prompt tokens served from pinned shared prefixes
    shared_hit_tokens: int = 0
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

    def __init__(
        self, num_blocks: int, block_size: int, quotas: QuotasConfig, blocks: list[KVBlock] | None = None
    ) -> None:
        if num_blocks < 2:
            raise FenceError("a vLLM block pool has the null block and at least one more")
        self.block_size = block_size
        self.pool = ShadowPool(num_blocks, blocks)
        # vLLM's null block (id 0) is never handed out.
        self.pool.blocks[0].state = ACTIVE
        #: hand-outs and frees so far; a block handed out gets the new value as its generation
        self.moves = 0
        self.usable_blocks = num_blocks - 1
        self._check_guarantees(quotas)
        self.book = QuotaBook(quotas, self.usable_blocks)
        self.counters = FenceCounters()
        self.records: list[Record | None] = [None] * num_blocks
        #: cold blocks :meth:`take` returned to the free list instead of handing them out (a tenant
        #: above a lowered maximum); the pool drops them from vLLM's prefix cache and clears this
        self.released_ids: list[int] = []
        #: request id -> (tenant account, blocks reserved) for admitted requests
        self.admitted: dict[str, tuple[TenantAccount, int]] = {}
        self._reserved: dict[str, int] = {}
        #: per account, the cold blocks other tenants may take (``reclaimable_by_others``) as last
        #: counted, and their total: kept current by :meth:`_recount` wherever usage or cold changes
        self._reclaimable: dict[str, int] = {}
        self.total_reclaimable = 0
        self._set_flags(quotas)
        #: the declared shared prefixes, pinned (set by the scheduler once their requests computed them)
        self.shared: tuple[SharedPin, ...] = ()
        #: bumped on every change the stats export shows
        self.version = 0

    # --- quotas -------------------------------------------------------------------------------------
    def _check_guarantees(self, quotas: QuotasConfig) -> None:
        total = sum(q.guaranteed_blocks for q in quotas.tenants.values())
        if total > self.usable_blocks:
            raise FenceError(
                f"the tenants' guaranteedKVBlocks add up to {total}, more than the {self.usable_blocks} "
                "KV blocks this vLLM engine has"
            )

    def _set_flags(self, quotas: QuotasConfig) -> None:
        qs = [quotas.default, *quotas.tenants.values()]
        #: some tenant has a maxBlocks (admission and the per-tenant cap matter)
        self.has_limits = any(q.max_blocks is not None for q in qs)
        #: some tenant has a guaranteedBlocks (reservations and protected cold blocks matter)
        self.has_guarantees = any(q.guaranteed_blocks > 0 for q in qs)
        #: neither: every tenant may have every free block (vLLM's own count answers)
        self.unlimited = not self.has_limits and not self.has_guarantees

    def set_quotas(self, quotas: QuotasConfig) -> None:
        """Apply new limits in place (blocks and usage are kept; see QuotaBook.set_quotas)."""
        self._check_guarantees(quotas)
        self.book.set_quotas(quotas)
        self._set_flags(quotas)
        self._reclaimable.clear()
        self.total_reclaimable = 0
        for acct in self.book.accounts.values():
            self._recount(acct)
        self.version += 1

    def account(self, tenant: str) -> TenantAccount:
        acct = self.book.accounts.get(tenant)
        return acct if acct is not None else self.book.account(tenant)

    def _recount(self, acct: TenantAccount) -> None:
        new = acct.reclaimable_by_others
        old = self._reclaimable.get(acct.tenant, 0)
        if new != old:
            self.total_reclaimable += new - old
            self._reclaimable[acct.tenant] = new

    def _forget_if_idle(self, acct: TenantAccount) -> None:
        self.book.forget_if_idle(acct)
        if acct.tenant not in self.book.accounts:
            self.total_reclaimable -= self._reclaimable.pop(acct.tenant, 0)

    # --- admission ----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_alone(self, tenant: str, num_tokens: int) -> bool:
        acct = self.account(tenant)
        ok = not acct.limited or self.blocks_for(num_tokens) <= acct.max_blocks
        self._forget_if_idle(acct)
        return ok

    def maximum(self, tenant: str) -> int | None:
        """The tenant's hard maximum in blocks, None if it has none."""
        acct = self.account(tenant)
        out = acct.max_blocks if acct.limited else None
        self._forget_if_idle(acct)
        return out

    def room(self, tenant: str) -> int | None:
        """Blocks a new request of ``tenant`` may still reserve (:meth:`can_admit`'s bound: its maximum
        less what its admitted requests reserve); None for a tenant without a maximum."""
        acct = self.account(tenant)
        out = acct.max_blocks - self._reserved.get(tenant, 0) if acct.limited else None
        self._forget_if_idle(acct)
        return out

    def can_admit(self, tenant: str, num_tokens: int, pending: int = 0) -> int | None:
        """The blocks a new request of ``tenant`` reaching ``num_tokens`` tokens would reserve, if it
        fits next to the tenant's admitted requests (and ``pending`` blocks of requests admitted ahead
        of it in this step); None if it must wait. Unlimited tenants reserve nothing."""
        acct = self.account(tenant)
        if not acct.limited:
            return 0
        need = self.blocks_for(num_tokens)
        if self._reserved.get(tenant, 0) + pending + need > acct.max_blocks:
            return None
        return need

    def is_admitted(self, request_id: str) -> bool:
        return request_id in self.admitted

    def admit(self, request_id: str, tenant: str, blocks: int) -> None:
        if request_id in self.admitted:
            return
        acct = self.account(tenant)
        acct.open_sequences += 1
        self.admitted[request_id] = (acct, blocks)
        if blocks:
            self._reserved[tenant] = self._reserved.get(tenant, 0) + blocks

    def release(self, request_id: str) -> None:
        entry = self.admitted.pop(request_id, None)
        if entry is None:
            return
        acct, blocks = entry
        if blocks:
            left = self._reserved.get(acct.tenant, 0) - blocks
            if left > 0:
                self._reserved[acct.tenant] = left
            else:
                self._reserved.pop(acct.tenant, None)
        acct.open_sequences -= 1
        self._forget_if_idle(acct)

    # --- the pool -----------------------------------------------------------------------------------
    def obtainable(self, tenant: str, vllm_free: int) -> int:
        """How many new blocks ``tenant`` can get right now (its maximum, others' guarantees), given
        ``vllm_free``, vLLM's own count of free blocks (clean and cold). O(1)."""
        if self.unlimited:
            return vllm_free  # nothing is reserved, every cold block may go, no tenant is capped
        # Called for every scheduled request of every step: TenantAccount's properties (active,
        # unused_reservation) and QuotaBook.reserved_for_others, inlined.
        acct = self.book.accounts.get(tenant)
        if acct is None:
            acct = self.account(tenant)
        cold = len(acct.cold)
        usage = acct.usage
        cap = acct.max_blocks - (usage - cold)
        if not self.has_guarantees:
            have = vllm_free
        else:
            reserved = self.book.total_unused_reservation - max(0, acct.guaranteed - usage)
            others = self.total_reclaimable - self._reclaimable.get(tenant, 0)
            have = max(0, len(self.pool.free) - reserved) + cold + others
        if usage == 0 and acct.open_sequences == 0:
            self._forget_if_idle(acct)
        return max(0, min(cap, have, vllm_free))

    def _uncharge(self, b: KVBlock) -> TenantAccount:
        """A cold block, out of its owner's cold list, about to get new content: no longer charged to
        its owner (returned), no record."""
        assert b.owner is not None
        owner = self.book.accounts[b.owner]
        self.book.add_usage(owner, -1)
        b.owner = None
        self.records[b.block_id] = None
        return owner

    def _pop_free(self, k: int) -> list[KVBlock]:
        """The ``k`` clean blocks freed last, out of the free stack."""
        if k <= 0:
            return []
        free = self.pool.free
        out = free[-k:]
        del free[-k:]
        return out

    def _hand_out(self, acct: TenantAccount, blocks: list[KVBlock]) -> list[KVBlock]:
        """Charge ``blocks`` (taken from the free and cold lists) to ``acct`` under a new generation."""
        self.moves += 1
        gen = self.moves
        tenant = acct.tenant
        for b in blocks:
            b.generation = gen
            b.state = ACTIVE
            b.owner = tenant
        if self.has_guarantees:
            self.book.add_usage(acct, len(blocks))
            self._recount(acct)
        else:  # no reservations to keep current (QuotaBook.add_usage's only other work)
            acct.usage += len(blocks)
        self.version += 1
        return blocks

    def take(self, tenant: str, n: int) -> list[int]:
        """Hand ``n`` blocks to ``tenant`` (all or nothing, :class:`AllocationError` otherwise): clean
        free blocks, then its own cold ones, then others' beyond their guarantee. Cold blocks handed
        out lose their record (the caller takes them out of vLLM's prefix cache). Every block's
        generation moves. Returns the block ids."""
        acct = self.book.accounts.get(tenant)
        blocks = self.take_for(acct if acct is not None else self.book.account(tenant), n)
        return list(map(_block_id_of, blocks))

    def take_for(self, acct: TenantAccount, n: int) -> list[KVBlock]:
        """:meth:`take` for the tenant of ``acct``, an open account (an admitted request's: the pool
        allocates with the account it admitted the request under), returning the block objects (inside
        vLLM, vLLM's own blocks: what its pool hands out)."""
        # What plan_allocation decides too, in the common cases, without its helpers (_pop_free,
        # _uncharge and _hand_out inlined: every allocation comes here; equal decisions:
        # tests/vllm_engine/test_vllm_fence_plan.py): the clean blocks freed last, as many as others'
        # reservations leave, then the tenant's own least recently used cold ones. Anything else
        # (others' cold blocks, a tenant above a lowered maximum, too few blocks) goes to the planner.
        free = self.pool.free
        if self.unlimited:  # no maximum, no reservation: every clean block may go
            k = len(free)
        elif acct.usage + n > acct.max_blocks:
            return self._take_planned(acct, n)
        elif self.has_guarantees:
            k = max(0, len(free) - self.book.reserved_for_others(acct))
        else:
            k = len(free)
        if k >= n:  # clean blocks only
            cut = len(free) - n  # (not free[-n:]: vLLM asks for 0 blocks too)
            out = free[cut:]
            del free[cut:]
            k = n
        else:
            cold = acct.cold
            own = n - k
            if own > len(cold):
                return self._take_planned(acct, n)
            # The tenant's own cold blocks: they lose their record and stay charged to it (planned,
            # they would be uncharged and charged again), so its usage grows by the clean blocks only.
            out = cold.popleft_n(own)
            records = self.records
            for b in out:
                records[b.block_id] = None
            self.counters.evictions_own += own
            if k:
                out += free[-k:]
                del free[-k:]
        self.moves = gen = self.moves + 1
        tenant = acct.tenant
        for b in out:
            b.generation = gen
            b.state = ACTIVE
            b.owner = tenant
        if self.has_guarantees:
            if k:
                self.book.add_usage(acct, k)
            self._recount(acct)
        else:  # no reservations to keep current (QuotaBook.add_usage's only other work)
            acct.usage += k
        self.version += 1
        return out

    def _take_planned(self, acct: TenantAccount, n: int) -> list[KVBlock]:
        """:meth:`take` by the reference engine's planner: others' cold blocks beyond their guarantee,
        a tenant above a lowered maximum, or :class:`AllocationError`."""
        plan = plan_allocation(self.pool, self.book, acct, n)
        if plan.released:
            # Above its maximum (lowered since): the surplus cold blocks become clean free blocks, and
            # the caller drops them from vLLM's prefix cache (released_ids).
            for _ in range(plan.released):
                b = take_cold(acct)
                self._to_free(b, acct)  # its usage stays above 0: it is at its maximum after this
                self.released_ids.append(b.block_id)
            self.counters.evictions_own += plan.released
        out = [take_cold(acct) for _ in range(plan.own_evictions)]
        self.counters.evictions_own += plan.own_evictions
        for other, k in plan.cross_evictions:
            out.extend(take_cold(other) for _ in range(k))
            self.counters.evictions_cross += k
        for b in out:
            self._uncharge(b)
        self._recount(acct)
        for other, _ in plan.cross_evictions:
            self._recount(other)
            self._forget_if_idle(other)
        out.extend(self._pop_free(plan.from_free))
        return self._hand_out(acct, out)

    def release_blocks(self, cold: list[KVBlock], clean: list[KVBlock]) -> None:
        """vLLM dropped the last reference to these blocks: ``cold`` ones hold a cache entry and join
        their owner's cold list (in this order: the first is evicted first), ``clean`` ones join the
        free stack. Usage is given back once per owner, not once per block. Nothing changes if a cold
        block is not ``ACTIVE`` and owned."""
        accounts = self.book.accounts
        if cold:
            # The checks in C (map, set): every block ACTIVE (so in no list) and owned.
            owners = set(map(_owner_of, cold))
            if None in owners or set(map(_state_of, cold)) != {ACTIVE}:
                bad = next(b for b in cold if b.state is not ACTIVE or b.owner is None)
                raise FenceError(f"block {bad.block_id} released from state {bad.state.name}")
            by_owner: dict[str, list[KVBlock]] = {}
            if len(owners) == 1:  # a request's blocks, its tenant's (the common case)
                by_owner[cold[0].owner] = cold  # type: ignore[index]  # (owned: checked above)
            else:
                for b in cold:
                    by_owner.setdefault(b.owner, []).append(b)  # type: ignore[arg-type]
            for tenant, bs in by_owner.items():
                accounts[tenant].cold.extend(bs, unlisted=True, state=COLD)
        if clean:
            self.moves += 1
            records = self.records
            free = self.pool.free
            freed: dict[str, int] = {}
            for b in clean:
                owner = b.owner
                if b.state is not ACTIVE or owner is None:
                    raise FenceError(f"block {b.block_id} released from state {b.state.name}")
                b.state = FREE
                b.owner = None
                records[b.block_id] = None
                free.append(b)
                freed[owner] = freed.get(owner, 0) + 1
            for owner, k in freed.items():
                acct = accounts[owner]
                if self.has_guarantees:
                    self.book.add_usage(acct, -k)
                    self._recount(acct)
                elif acct.usage >= k:
                    acct.usage -= k
                else:
                    raise FenceError(f"usage of tenant {owner!r} would go negative")
                if acct.usage == 0:
                    self._forget_if_idle(acct)
        if cold and self.has_guarantees:
            for owner in by_owner:
                acct_ = accounts.get(owner)
                if acct_ is not None:
                    self._recount(acct_)
        self.version += 1

    def take_any(self, tenant: str, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks ignoring quotas and guarantees: clean ones first, then any tenant's
        cold ones. Only for the case :meth:`take` refuses although vLLM already counted the blocks as
        obtainable (a bug): keeping vLLM's engine alive beats enforcing a quota by crashing it."""
        picked = self._pop_free(min(n, len(self.pool.free)))
        for other in list(self.book.accounts.values()):
            while len(picked) < n and len(other.cold):
                b = take_cold(other)
                self._uncharge(b)
                picked.append(b)
            self._recount(other)
        if len(picked) < n:
            raise FenceError(f"{n} blocks asked, {len(picked)} free or cached")
        return self._hand_out(self.account(tenant), picked)

    def revive(self, blocks: Sequence[KVBlock]) -> None:
        """Cold blocks were taken by a prefix hit: they leave their owners' cold lists, still charged."""
        for b in blocks:
            cold = b.in_list
            if b.state is not COLD or cold is None or b.owner is None:
                raise FenceError(f"block {b.block_id} revived from state {b.state.name}")
            cold.remove(b)
            b.state = ACTIVE
            if self.has_guarantees:
                self._recount(self.book.accounts[b.owner])
        self.version += 1

    def uncached(self, block_id: int) -> None:
        """A block lost its prefix-cache entry (vLLM's evict_blocks): a cold one becomes clean."""
        b = self.pool.blocks[block_id]
        if b.state is COLD and b.owner is not None:
            acct = self.book.accounts[b.owner]
            assert b.in_list is acct.cold
            acct.cold.remove(b)
            self._to_free(b, acct)
            self.version += 1
        elif b.state is ACTIVE:
            self.records[block_id] = None

    def _to_free(self, b: KVBlock, acct: TenantAccount) -> None:
        self.moves += 1
        b.state = FREE
        b.owner = None
        self.records[b.block_id] = None
        self.pool.free.append(b)
        self.book.add_usage(acct, -1)
        self._recount(acct)
        self._forget_if_idle(acct)

    def generation(self, block_id: int) -> int:
        return self.pool.blocks[block_id].generation

    def state(self, block_id: int) -> BlockState:
        return self.pool.blocks[block_id].state

    def owner(self, block_id: int) -> str | None:
        return self.pool.blocks[block_id].owner

    # --- prefix-cache records -----------------------------------------------------------------------
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
        tokens: list[int],
        tenant_ns: Namespace,
        extras: Sequence[Any] | None = None,
        shared: Sequence[Record] = (),
        packed: bytes | None = None,
    ) -> tuple[int, str]:
        """How many leading blocks of a hit chain hold exactly ``tokens`` (a list, as records hold
        them) under ``tenant_ns``.

        ``extras``: per-block extra keys (multimodal requests), None for text. ``shared``: the records
        of the declared shared prefix the request begins with (its first blocks must be exactly those
        pinned blocks; the request's own namespace enters after them). ``packed``: the request's first
        tokens packed by :data:`kvfence.vllm.records.pack` (compared from there where they reach). The
        first failing block ends the hit and is counted: as a cross-namespace access if its chain starts
        in another namespace, otherwise as a hash collision.
        """
        bs = self.block_size
        records = self.records
        if not shared and extras is None:
            # Plain text, no shared prefix (the common case): verify_chain, the walk below specialised
            # (in C where compiled). When every block verifies, that is the answer; at the first block
            # that does not (or a parent that is a duplicate copy, not the very record), the walk
            # below decides.
            ids = block_ids if isinstance(block_ids, list) else list(block_ids)
            if verify_chain(records, ids, tokens, packed, (tenant_ns, None), bs) == len(ids):
                return len(ids), Verdict.OK
        parent: Record | None = None
        for i, bid in enumerate(block_ids):
            rec = records[bid]
            if not self._continues(rec, i, parent, tokens, tenant_ns, extras, shared):
                return i, self._refused(rec, tenant_ns)
            parent = rec
        return len(block_ids), Verdict.OK

    def _continues(
        self,
        rec: Record | None,
        i: int,
        parent: Record | None,
        tokens: list[int],
        tenant_ns: Namespace,
        extras: Sequence[Any] | None,
        shared: Sequence[Record],
    ) -> bool:
        """Whether ``rec``, the record of block ``i`` of a hit, continues the chain verified up to
        ``parent`` (see :meth:`verify`): within the declared shared prefix, the pinned block itself (its
        tokens were compared when it was pinned); after it, the request's own tokens, under its
        namespace where the namespace enters the chain and the chain's own extra keys after that."""
        start = len(shared)
        if i < start:
            return rec is shared[i]
        if rec is None or not equal(rec.tokens, tokens, i * self.block_size):
            return False
        if i == start:  # where the request's namespace enters the chain
            extra = extras[i] if extras is not None else None
            return bool(rec.root and rec.parent is parent and rec.namespace == (tenant_ns, extra))
        own = None if extras is None or extras[i] is None else (extras[i],)
        return rec.namespace == own and (rec.parent is parent or same_chain(rec.parent, parent))

    def _refused(self, rec: Record | None, tenant_ns: Namespace) -> str:
        """Count a hit block that did not verify: a cross-namespace access if its chain starts in
        another namespace, otherwise a hash collision."""
        root = root_namespace(rec) if rec is not None else None
        if root is not None and root[0] != tenant_ns:
            self.counters.cross_access_rejected += 1
            verdict = Verdict.CROSS_ACCESS
        else:
            self.counters.hash_collision += 1
            verdict = Verdict.COLLISION
        self.version += 1
        return verdict

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
            if acct.tenant == SHARED_OWNER:
                continue  # pinned shared prefixes: reported apart from every tenant's blocks
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
                "pinned": len({b for p in self.shared for b in p.block_ids}),
            },
            "shared_prefixes": len(self.shared),
            "shared_prefix_hit_tokens": c.shared_hit_tokens,
            "tenants": tenants,
        }


__all__ = [
    "UNATTRIBUTED",
    "AllocationError",
    "FenceCounters",
    "FenceError",
    "Record",
    "SharedPin",
    "TenantFence",
    "Verdict",
    "same_chain",
]
