"""The fenced KV-block allocator of one trust class.

One :class:`FencedAllocator` per engine (an engine serves exactly one trust class, so no block, block
table or cache entry is ever shared across classes). Inside it:

* **block tables**: each sequence holds a list of blocks (and their handles); the numpy array of
  block ids is what attention gathers through;
* **quotas**: per-tenant hard maximum and guaranteed share (:mod:`kvfence.isolation.quotas`);
* **all-or-nothing allocation**: the plan (:func:`kvfence.isolation.eviction.plan_allocation`) is made
  before anything changes, so a refused request leaves the pool exactly as it was;
* **fencing**: a block whose last reference is dropped enters ``FENCED`` and becomes reusable (or
  revivable from the prefix cache) only after each of the ``tensor_parallel_size`` writers has called
  :meth:`FencedAllocator.writer_done` for it;
* **generations**: a handle names a block *at a generation*; using a handle whose block has been
  freed or reallocated since raises :class:`StaleReference` and counts
  ``kv_cache_stale_reference_error_total``.

Every public method takes the allocator's lock; allocation and free are O(1) per block (plus O(tenants)
only when blocks must be reclaimed from other tenants).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvfence.contract.engine_config import QuotasConfig
from kvfence.isolation.blocks import BlockHandle, BlockPool, BlockState, KVBlock
from kvfence.isolation.eviction import EvictionPlan, plan_allocation, take_cold
from kvfence.isolation.metrics import EngineMetrics
from kvfence.isolation.prefix_cache import CacheContext, PrefixCache
from kvfence.isolation.quotas import (
    SHARED_OWNER,
    AllocationError,
    BeyondMaximum,
    PoolExhausted,
    QuotaBook,
    QuotaExceeded,
    TenantAccount,
)
from kvfence.isolation.shared_prefixes import Pinned

__all__ = [
    "AllocationError",
    "BeyondMaximum",
    "FencedAllocator",
    "InconsistentPool",
    "PoolExhausted",
    "QuotaExceeded",
    "SequenceAllocation",
    "StaleReference",
]

TokenArray = npt.NDArray[np.int32]


class StaleReference(Exception):
    """A block handle (or sequence) that is no longer valid was used; the use was refused."""


class InconsistentPool(AssertionError):
    """A broken invariant of the pool (a bug, never input); the tests' consistency oracle
    (tests/engine/oracle.py) raises it too."""


@dataclass(slots=True, eq=False)
class _Sequence:
    seq_id: Hashable
    account: TenantAccount
    ctx: CacheContext | None
    blocks: list[KVBlock]
    handles: list[BlockHandle]
    table: npt.NDArray[np.int32]
    #: blocks whose chain key has been processed (hits, or registered after compute)
    num_hashed: int = 0
    parent_key: bytes = b""
    parent_handle: BlockHandle | None = None
    chain_broken: bool = False


@dataclass(frozen=True, slots=True)
class SequenceAllocation:
    """What :meth:`FencedAllocator.allocate_sequence` granted."""

    num_cached_tokens: int
    handles: tuple[BlockHandle, ...]
    table: npt.NDArray[np.int32]


class FencedAllocator:
    def __init__(
        self,
        trust_class: str,
        num_blocks: int,
        block_size: int,
        *,
        tensor_parallel_size: int = 1,
        quotas: QuotasConfig | None = None,
        metrics: EngineMetrics | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if not 1 <= tensor_parallel_size <= 64:
            raise ValueError("tensor_parallel_size must be between 1 and 64")
        self.trust_class = trust_class
        self.block_size = block_size
        self.tensor_parallel_size = tensor_parallel_size
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.pool = BlockPool(num_blocks, block_size)
        self.book = QuotaBook(quotas or QuotasConfig(), num_blocks)
        self.prefix_cache = prefix_cache
        self._seqs: dict[Hashable, _Sequence] = {}
        self._lock = threading.RLock()
        self._num_active = 0
        self._num_fenced = 0
        self._all_ranks = (1 << tensor_parallel_size) - 1

    def set_quotas(self, quotas: QuotasConfig) -> None:
        """Replace the per-tenant limits; see :meth:`QuotaBook.set_quotas`."""
        with self._lock:
            self.book.set_quotas(quotas)

    # --- counters (read without the lock: ints, good enough for gauges) ---------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return len(self.pool.free)

    @property
    def num_active(self) -> int:
        return self._num_active

    @property
    def num_fenced(self) -> int:
        return self._num_fenced

    @property
    def num_pinned(self) -> int:
        """Blocks held by pinned shared prefixes (active, outside every tenant's quota)."""
        acct = self.book.accounts.get(SHARED_OWNER)
        return 0 if acct is None else acct.active

    @property
    def num_cold(self) -> int:
        return self.num_blocks - self.num_free - self._num_active - self._num_fenced

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------------
    def allocate_sequence(
        self,
        seq_id: Hashable,
        tenant: str,
        num_tokens: int,
        *,
        ctx: CacheContext | None = None,
        prompt: TokenArray | None = None,
        shared: Pinned | None = None,
    ) -> SequenceAllocation:
        """Open a sequence with room for ``num_tokens`` tokens, reusing cached blocks of ``prompt``.

        With a cache context and a prompt, the longest verified cached prefix of the prompt's full
        blocks (never the whole prompt: at least one token is always computed) is attached by
        reference; the rest is allocated. All or nothing: on :class:`AllocationError` nothing changed.

        ``shared``: a pinned declared prefix (:mod:`kvfence.isolation.shared_prefixes`) the prompt may
        begin with. Its blocks are attached first, not charged to the tenant, if and only if the prompt
        begins with the whole prefix token for token; the tenant's own chain continues after them.
        """
        if num_tokens < 1:
            raise ValueError("a sequence needs at least one token")
        if prompt is not None and len(prompt) > num_tokens:
            raise ValueError("num_tokens must cover the prompt")
        with self._lock:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} is already open")
            if tenant == SHARED_OWNER:
                raise ValueError(f"{SHARED_OWNER!r} is not a tenant")
            acct = self.book.account(tenant)
            try:
                return self._allocate_sequence(seq_id, acct, num_tokens, ctx, prompt, shared)
            except AllocationError:
                self.book.forget_if_idle(acct)
                raise

    def pin(self, seq_id: Hashable, ctx: CacheContext, tokens: TokenArray) -> SequenceAllocation:
        """Open the never-ending sequence that holds a declared shared prefix's full blocks (``tokens``
        is a whole number of blocks), charged to :data:`SHARED_OWNER`, outside every tenant's quota.
        Blocks of the prefix already cached in the shared namespace are reused (all of them may be);
        the caller computes the rest, commits it (:meth:`commit`), then reads :meth:`pinned_chain`."""
        if len(tokens) == 0 or len(tokens) % self.block_size:
            raise ValueError("a pinned prefix is a whole, non-zero number of blocks")
        if self.prefix_cache is None:
            raise ValueError("shared prefixes need the prefix cache")
        with self._lock:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} is already open")
            acct = self.book.account(SHARED_OWNER)
            return self._allocate_sequence(
                seq_id, acct, len(tokens), ctx, tokens, None, max_hits=len(tokens) // self.block_size
            )

    def pinned_chain(self, seq_id: Hashable) -> tuple[list[KVBlock], list[BlockHandle], list[bytes]]:
        """The blocks, handles and keys of a committed pinned sequence; ValueError if any block is not
        the registered (canonical) entry of its key (a collision broke the chain)."""
        with self._lock:
            seq = self._get(seq_id)
            cache = self.prefix_cache
            keys: list[bytes] = []
            for b in seq.blocks:
                key = b.block_hash
                if cache is None or key is None or cache.index.get(key) is not b:
                    raise ValueError(f"block {b.block_id} of pinned sequence {seq_id!r} is not in the cache")
                keys.append(key)
            return list(seq.blocks), list(seq.handles), keys

    def _shared_start(self, shared: Pinned, token_bytes: bytes, limit: int) -> int:
        """How many blocks of ``shared`` a prompt (``token_bytes``, at most ``limit`` hit blocks) may
        attach: all its full blocks (up to ``limit``) if the prompt begins with the whole prefix, token
        for token, and the pinned blocks are intact; otherwise none."""
        prefix = shared.token_bytes
        if len(token_bytes) < len(prefix) or token_bytes[: len(prefix)] != prefix:
            return 0
        n = min(shared.num_blocks, limit)
        for b, h in zip(shared.blocks[:n], shared.handles[:n], strict=True):
            if b.generation != h.generation or b.state is not BlockState.ACTIVE or b.owner != SHARED_OWNER:
                self.metrics.stale_reference.inc()  # pinned blocks never move: a bug, refused
                return 0
        return n

    # 74 lines: the prompt's hits and fresh blocks in one pass and one frame, on every allocation.
    def _allocate_sequence(
        self,
        seq_id: Hashable,
        acct: TenantAccount,
        num_tokens: int,
        ctx: CacheContext | None,
        prompt: TokenArray | None,
        shared: Pinned | None,
        max_hits: int | None = None,
    ) -> SequenceAllocation:
        hits, parent_key, num_shared = self._prefix_hits(ctx, prompt, shared, max_hits)
        plan = self._plan(acct, hits, self.blocks_for(num_tokens), num_shared)
        # --- commit: nothing below may fail ---
        for b in hits:
            if b.state is BlockState.COLD:
                owner = self.book.accounts[b.owner]  # type: ignore[index]
                owner.cold.remove(b)
                b.state = BlockState.ACTIVE
                self._num_active += 1
            b.ref_cnt += 1
        new = self._take(acct, plan)
        acct.open_sequences += 1
        blocks = hits + new
        handles = [BlockHandle(b.block_id, b.generation) for b in blocks]
        table = np.fromiter((b.block_id for b in blocks), dtype=np.int32, count=len(blocks))
        seq = _Sequence(seq_id, acct, ctx, blocks, handles, table)
        seq.num_hashed = len(hits)
        seq.parent_key = parent_key
        # the last hit's own handle object: children registered under it pass lookup's identity check
        seq.parent_handle = (hits[-1].cache_handle or handles[len(hits) - 1]) if hits else None
        self._seqs[seq_id] = seq
        cached_tokens = len(hits) * self.block_size
        if prompt is not None and ctx is not None and self.prefix_cache is not None and max_hits is None:
            self.metrics.prefix_queries.inc(len(prompt))
            self.metrics.prefix_hits.inc(cached_tokens)
            if num_shared:
                self.metrics.shared_prefix_hits.inc(num_shared * self.block_size)
        return SequenceAllocation(cached_tokens, tuple(handles), table)

    def _prefix_hits(
        self, ctx: CacheContext | None, prompt: TokenArray | None, shared: Pinned | None, max_hits: int | None
    ) -> tuple[list[KVBlock], bytes, int]:
        """The verified prefix-cache hit of ``prompt`` in ``ctx``'s namespace (the declared shared
        prefix it begins with, then its own blocks; at most ``max_hits`` blocks, and never its last
        token's block), the chain key a block after the hit hangs under, and how many hit blocks are
        the shared prefix's."""
        cache = self.prefix_cache
        if ctx is None or cache is None:
            return [], b"", 0
        parent_key = cache.root_key(ctx)
        if prompt is None or len(prompt) == 0:
            return [], parent_key, 0
        token_bytes = np.ascontiguousarray(prompt, dtype="<i4").tobytes()
        limit = (len(prompt) - 1) // self.block_size if max_hits is None else max_hits
        start: list[KVBlock] = []
        parent: BlockHandle | None = None
        num_shared = 0
        if shared is not None:
            num_shared = self._shared_start(shared, token_bytes, limit)
            if num_shared:
                start = list(shared.blocks[:num_shared])
                parent = shared.handles[num_shared - 1]
                parent_key = cache.after_shared(ctx, shared.keys[num_shared - 1])
        m = cache.lookup(ctx, token_bytes, limit, start=num_shared, key=parent_key, parent=parent)
        return start + m.blocks, m.next_parent_key, num_shared

    def _plan(
        self, acct: TenantAccount, hits: list[KVBlock], num_blocks: int, num_shared: int
    ) -> EvictionPlan:
        """Where the ``num_blocks`` blocks of a sequence beyond its ``hits`` come from (the cold hits it
        revives count against their owners), or QuotaExceeded (:class:`BeyondMaximum` when what the
        sequence holds alone, the declared shared prefix aside, exceeds its tenant's maximum)."""
        revived_by_owner: dict[str, int] = {}
        for b in hits:
            if b.state is BlockState.COLD:
                assert b.owner is not None
                revived_by_owner[b.owner] = revived_by_owner.get(b.owner, 0) + 1
        try:
            return plan_allocation(
                self.pool,
                self.book,
                acct,
                num_blocks - len(hits),
                revived_own=revived_by_owner.get(acct.tenant, 0),
                revived_by_owner=revived_by_owner,
            )
        except QuotaExceeded as e:
            self.metrics.quota_rejected.labels(acct.tenant).inc()
            own = num_blocks - num_shared
            if own > acct.max_blocks:
                raise BeyondMaximum(acct.tenant, own, acct.max_blocks, self.block_size) from e
            raise

    def _take(self, acct: TenantAccount, plan: EvictionPlan) -> list[KVBlock]:
        """Commit ``plan``: evict what it says (own cold blocks, then others' beyond their guarantee),
        pop the rest from the free list, and hand every block to ``acct`` under a new generation.
        Called with the lock held, after planning succeeded: nothing here may fail."""
        free = self.pool.free
        # A tenant above its maximum (lowered since) sheds its surplus cold blocks to the free list.
        if plan.released:
            free.extend([self._evict(take_cold(acct)) for _ in range(plan.released)])
        new = [self._evict(take_cold(acct)) for _ in range(plan.own_evictions)]
        if plan.own_evictions or plan.released:
            self.metrics.evictions.labels("own").inc(plan.own_evictions + plan.released)
        for other, n in plan.cross_evictions:
            new.extend(self._evict(take_cold(other)) for _ in range(n))
            self.metrics.evictions.labels("cross").inc(n)
            self.book.forget_if_idle(other)
        new.extend(free.popleft() for _ in range(plan.from_free))
        for b in new:
            b.generation += 1
            b.state = BlockState.ACTIVE
            b.ref_cnt = 1
            b.owner = acct.tenant
        self._num_active += len(new)
        self.book.add_usage(acct, len(new))
        return new

    def grow(self, seq_id: Hashable, num_tokens: int) -> tuple[BlockHandle, ...]:
        """Extend a sequence to room for ``num_tokens`` tokens (all or nothing); the new handles."""
        with self._lock:
            seq = self._get(seq_id)
            needed = self.blocks_for(num_tokens) - len(seq.blocks)
            if needed <= 0:
                return ()
            acct = seq.account
            try:
                plan = plan_allocation(self.pool, self.book, acct, needed)
            except QuotaExceeded:
                self.metrics.quota_rejected.labels(acct.tenant).inc()
                raise
            new = self._take(acct, plan)
            hs = [BlockHandle(b.block_id, b.generation) for b in new]
            seq.blocks.extend(new)
            seq.handles.extend(hs)
            seq.table = np.fromiter((b.block_id for b in seq.blocks), dtype=np.int32, count=len(seq.blocks))
            return tuple(hs)

    def _evict(self, block: KVBlock) -> KVBlock:
        """Take a cold block out of the cache and its owner's account (the caller re-charges it)."""
        assert block.state is BlockState.COLD and block.owner is not None
        if self.prefix_cache is not None:
            self.prefix_cache.remove(block)
        else:
            block.clear_cache_entry()
        self.book.add_usage(self.book.accounts[block.owner], -1)
        block.owner = None
        block.state = BlockState.FREE
        return block

    # --- prefix-cache registration --------------------------------------------------------------
    def commit(self, seq_id: Hashable, tokens: TokenArray, num_computed: int) -> int:
        """Register the sequence's full blocks among its first ``num_computed`` tokens (whose KV is
        written) in the prefix cache. Returns how many blocks were newly registered."""
        cache = self.prefix_cache
        with self._lock:
            seq = self._get(seq_id)
            if cache is None or seq.ctx is None or seq.chain_broken:
                return 0
            full = min(num_computed // self.block_size, len(seq.blocks))
            if full <= seq.num_hashed:
                return 0
            bb = cache.block_bytes
            start = seq.num_hashed
            mv = memoryview(
                np.ascontiguousarray(
                    tokens[start * self.block_size : full * self.block_size], dtype="<i4"
                ).tobytes()
            )
            registered = 0
            key, parent = seq.parent_key, seq.parent_handle
            for i in range(start, full):
                chunk = mv[(i - start) * bb : (i - start + 1) * bb]
                key = cache.hash_fn(key, chunk)
                block = seq.blocks[i]
                canon = cache.insert(block, key, seq.ctx, parent, chunk)
                if canon is None:
                    seq.chain_broken = True
                    break
                if canon is block:
                    registered += 1
                parent = canon.cache_handle  # what verify() compares a child's parent with
                seq.num_hashed = i + 1
            seq.parent_key, seq.parent_handle = key, parent
            return registered

    # --- reading ----------------------------------------------------------------------------------
    def block_table(self, seq_id: Hashable) -> npt.NDArray[np.int32]:
        """The block ids of an open sequence (what attention gathers through)."""
        with self._lock:
            return self._get(seq_id).table

    def readable_table(self, seq_id: Hashable) -> npt.NDArray[np.int32]:
        """The block table of an open sequence after checking every handle in it (what the engine
        calls before a step reads or writes the sequence's blocks)."""
        with self._lock:
            seq = self._get(seq_id)
            for h in seq.handles:
                self.check_handle(h)
            return seq.table

    def handles(self, seq_id: Hashable) -> tuple[BlockHandle, ...]:
        with self._lock:
            return tuple(self._get(seq_id).handles)

    def check_handle(self, handle: BlockHandle) -> None:
        """Refuse (and count) a handle whose block is no longer the referenced block it named."""
        with self._lock:
            self._live(handle, BlockState.ACTIVE, "stale handle")

    def check_handles(self, handles: Sequence[BlockHandle]) -> None:
        with self._lock:
            for h in handles:
                self.check_handle(h)

    def owner_of(self, block_id: int) -> str | None:
        with self._lock:
            return self.pool.blocks[block_id].owner

    def _block(self, handle: BlockHandle) -> KVBlock:
        if not 0 <= handle.block_id < self.num_blocks:
            self.metrics.stale_reference.inc()
            raise StaleReference(f"no block {handle.block_id}")
        return self.pool.blocks[handle.block_id]

    def _live(self, handle: BlockHandle, state: BlockState, what: str) -> KVBlock:
        """The block ``handle`` names, still at its generation and in ``state``; else refused and
        counted as a stale reference (``what``: the use refused)."""
        b = self._block(handle)
        if b.generation != handle.generation or b.state is not state:
            self.metrics.stale_reference.inc()
            raise StaleReference(
                f"{what} for block {handle.block_id} generation {handle.generation}, "
                f"but the block is at generation {b.generation} ({b.state.name})"
            )
        return b

    def _get(self, seq_id: Hashable) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            self.metrics.stale_reference.inc()
            raise StaleReference(f"sequence {seq_id!r} is not open")
        return seq

    def is_open(self, seq_id: Hashable) -> bool:
        with self._lock:
            return seq_id in self._seqs

    # --- freeing and fencing ----------------------------------------------------------------------
    def free_sequence(self, seq_id: Hashable) -> list[BlockHandle]:
        """Close a sequence; return the handles of the blocks that entered the fence.

        Blocks are released last first, so the tail of a prompt becomes evictable before its head.
        Blocks still referenced by other sequences stay active.
        """
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                self.metrics.stale_reference.inc()
                raise StaleReference(f"sequence {seq_id!r} is not open")
            fenced: list[BlockHandle] = []
            for b in reversed(seq.blocks):
                b.ref_cnt -= 1
                if b.ref_cnt < 0:
                    raise InconsistentPool(f"block {b.block_id} ref count went negative")
                if b.ref_cnt == 0:
                    b.state = BlockState.FENCED
                    b.pending_writers = self.tensor_parallel_size
                    b.signalled = 0
                    self._num_active -= 1
                    self._num_fenced += 1
                    fenced.append(BlockHandle(b.block_id, b.generation))
            seq.account.open_sequences -= 1
            return fenced

    def writer_done(self, handle: BlockHandle, rank: int) -> bool:
        """Writer ``rank`` has completed every write to the fenced block ``handle``.

        Returns True when this was the last writer and the block left the fence (to the free list, or
        to its owner's cold list if it holds a cache entry).
        """
        if not 0 <= rank < self.tensor_parallel_size:
            raise ValueError(f"rank {rank} out of range (tensorParallelSize {self.tensor_parallel_size})")
        with self._lock:
            b = self._live(handle, BlockState.FENCED, "fence signal")
            bit = 1 << rank
            if b.signalled & bit:
                raise ValueError(f"rank {rank} already signalled block {handle.block_id}")
            b.signalled |= bit
            b.pending_writers -= 1
            if b.pending_writers > 0:
                return False
            self._num_fenced -= 1
            assert b.owner is not None
            acct = self.book.accounts[b.owner]
            cache = self.prefix_cache
            if b.block_hash is not None and cache is not None and cache.index.get(b.block_hash) is b:
                b.state = BlockState.COLD
                acct.cold.append(b)
            else:
                b.clear_cache_entry()
                b.state = BlockState.FREE
                b.owner = None
                self.book.add_usage(acct, -1)
                self.pool.free.append(b)
                self.book.forget_if_idle(acct)
            return True

    def release(self, seq_id: Hashable) -> None:
        """Free a sequence and signal the fence for every rank at once (a synchronous engine, whose
        writes are complete when its step returns)."""
        with self._lock:
            for h in self.free_sequence(seq_id):
                for rank in range(self.tensor_parallel_size):
                    self.writer_done(h, rank)

    # --- lookups without references (benchmark, tests) ---------------------------------------------
    def cached_prefix_tokens(self, ctx: CacheContext, prompt: TokenArray) -> int:
        """How many prompt tokens a request would get from the cache now (no references taken)."""
        if self.prefix_cache is None:
            return 0
        with self._lock:
            tb = np.ascontiguousarray(prompt, dtype="<i4").tobytes()
            m = self.prefix_cache.lookup(ctx, tb, (len(prompt) - 1) // self.block_size)
            return len(m.blocks) * self.block_size
