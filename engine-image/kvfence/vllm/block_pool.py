"""vLLM's ``BlockPool`` with the fence's free lists, allocation order and prefix-cache records.

:class:`FencedBlockPool` is vLLM's own block pool (``vllm/v1/core/block_pool.py``) with the methods that
move blocks between free, active and cached overridden: the free blocks are the fence's (clean ones on
its free stack, cached ones on their owners' cold lists, :class:`kvfence.vllm.fence.TenantFence`), vLLM's
free block queue becomes a count (:class:`FenceFreeCount`, or :class:`TenantFreeCount` while some tenant
has a quota), new blocks are taken in the fence's order, and every block vLLM caches gets the record
(its tokens, chain and cache namespace) that lookups are verified against. Its blocks are
:class:`FencedKVCacheBlock`, vLLM's block object carrying the fence's state of the block.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import vllm.v1.core.block_pool as _pool_mod
from kvfence.isolation.blocks import BlockState
from kvfence.isolation.quotas import TenantAccount
from kvfence.vllm.fence import (
    UNATTRIBUTED,
    AllocationError,
    FenceError,
    Record,
    TenantFence,
)
from kvfence.vllm.records import TOKEN_BYTES, record_chain
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, generate_block_hash_extra_keys
from vllm.v1.request import Request

log = logging.getLogger("kvfence.vllm.block_pool")


class FenceFreeCount:
    """Stands in for vLLM's free block queue: the fence owns the free blocks (clean ones in its free
    stack, cached ones in their owners' cold lists), so vLLM's doubly linked list is not kept as well;
    this only counts them, for vLLM's own reader of ``num_free_blocks`` (``BlockPool.get_num_free_blocks``,
    asked for every scheduled request of every step). vLLM's queue methods fail, naming themselves: a
    vLLM path that would move blocks in the queue is one the fence does not cover, and must not run
    unfenced (any other attribute is plainly absent). No ``__getattr__`` catches the rest: a class with
    one cannot have its attribute reads specialised by CPython.

    While no tenant has a quota, the pool's ``free_block_queue`` is this count itself, and vLLM's own
    ``get_num_free_blocks`` answers, unchanged; while one has, it is a :class:`TenantFreeCount`."""

    __slots__ = ("num_free_blocks",)

    def __init__(self, num_free_blocks: int) -> None:
        self.num_free_blocks = num_free_blocks


class TenantFreeCount:
    """The pool's ``free_block_queue`` while some tenant has a quota: ``num_free_blocks`` is what the
    tenant of the request being allocated for can obtain (:meth:`TenantFence.obtainable`: its maximum,
    the others' guarantees), out of the pool's own count."""

    __slots__ = ("count", "pool")

    def __init__(self, count: FenceFreeCount, pool: FencedBlockPool) -> None:
        self.count = count
        self.pool = pool

    @property
    def num_free_blocks(self) -> int:
        pool = self.pool
        return pool.fence.obtainable(pool.tenant_of.get(pool.rid, UNATTRIBUTED), self.count.num_free_blocks)


#: vLLM 0.32's FreeKVCacheBlockQueue methods: on FenceFreeCount and TenantFreeCount each raises a
#: FenceError naming itself
#: (tests/vllm_engine/test_vllm_fence.py checks the list is vLLM's whole list)
VLLM_FREE_QUEUE_METHODS = (
    "append",
    "append_n",
    "get_all_free_blocks",
    "iter_blocks_after",
    "popleft",
    "popleft_n",
    "prepend_n",
    "remove",
)


def _unfenced(cls: type, name: str) -> Callable[..., NoReturn]:
    def refuse(self: Any, *args: Any) -> NoReturn:
        raise FenceError(f"vLLM's free block queue is kept by the kvfence fence; {name!r} is not fenced")

    refuse.__name__, refuse.__qualname__ = name, f"{cls.__name__}.{name}"
    return refuse


for _cls in (FenceFreeCount, TenantFreeCount):
    for _name in VLLM_FREE_QUEUE_METHODS:
        setattr(_cls, _name, _unfenced(_cls, _name))


class FencedKVCacheBlock(KVCacheBlock):  # type: ignore[misc]
    """vLLM's ``KVCacheBlock`` carrying the fence's state of the block as well: the fields of the
    reference engine's :class:`~kvfence.isolation.blocks.KVBlock` the fence uses (state, owner,
    generation, the cold lists' links). :class:`FencedBlockPool` builds its blocks as these, and the
    fence keeps them in its lists, so a block's two states live in one object that vLLM touches anyway
    (no second object per block, no id lookups between the two on every allocation and release). vLLM's
    own free-queue links (``prev_free_block``, ``next_free_block``) are left unused: the fence owns the
    free blocks."""

    __slots__ = ("generation", "in_list", "next", "owner", "prev", "state")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = BlockState.FREE
        self.owner: str | None = None
        self.generation = 0
        self.prev: Any = None
        self.next: Any = None
        self.in_list: Any = None


#: vLLM's own method, called directly (cheaper than super() on a path taken for every block filled)
_vllm_cache_full_blocks = BlockPool.cache_full_blocks


class FencedBlockPool(BlockPool):  # type: ignore[misc]
    """vLLM's ``BlockPool`` whose allocation, release and caching go through the fence.

    ``rid`` is the request :class:`FencedKVCacheManager` allocates for (set on every ``allocate_slots``,
    the only path to ``get_num_free_blocks`` and ``get_new_blocks`` besides the pool's own, which use
    the plain count); ``tenant_of`` maps it to its verified tenant. The free blocks are the fence's:
    ``free_count`` counts them, and vLLM's ``free_block_queue`` is that count (no tenant has a quota)
    or a :class:`TenantFreeCount` over it (:meth:`set_quota_mode`)."""

    fence: TenantFence
    free_count: FenceFreeCount
    free_block_queue: FenceFreeCount | TenantFreeCount
    rid: str
    tenant_of: dict[str, str]
    #: request id -> blocks of the declared shared prefix it begins with (requests that begin with one)
    shared_of: dict[str, int]
    #: request id -> its prompt packed when it arrived (kvfence.vllm.records.pack; compiled records only)
    packed_of: dict[str, bytes]

    # get_num_free_blocks is vLLM's own: free_block_queue.num_free_blocks, the count or, with quotas,
    # what the current request's tenant can obtain.

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's own constructor, building the pool's blocks as FencedKVCacheBlocks (the name it
        # constructs them by, for the duration of the call).
        with constructing_as(_pool_mod, "KVCacheBlock", FencedKVCacheBlock):
            super().__init__(*args, **kwargs)

    @property
    def unlimited(self) -> bool:
        """No tenant has a quota: vLLM's free-block count is every tenant's."""
        return self.free_block_queue is self.free_count

    def set_quota_mode(self, unlimited: bool) -> None:
        """What vLLM's ``get_num_free_blocks`` answers from here on: the pool's count (``unlimited``,
        the fence's own answer then, :meth:`TenantFence.obtainable`), or the count the request's tenant
        can obtain. Set by the scheduler whenever quotas change."""
        if unlimited != self.unlimited:
            self.free_block_queue = self.free_count if unlimited else TenantFreeCount(self.free_count, self)

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 1.0 - (self.free_count.num_free_blocks / total) if total else 0.0

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        queue = self.free_count
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        fence = self.fence
        # The request's account, as admitted (an admitted request's account stays open until it is
        # released: it counts as an open sequence).
        admitted = fence.admitted.get(self.rid)
        acct = admitted[0] if admitted is not None else self._unadmitted_account(num_blocks)
        try:
            # vLLM's own blocks (the fence's are this pool's: FencedKVCacheBlock)
            ret: list[Any] = fence.take_for(acct, num_blocks)
        except AllocationError as e:
            # vLLM asked get_num_free_blocks() first, which answers what take() grants: never expected.
            log.error("kvfence: %s; %d blocks handed out without the quota check", e, num_blocks)
            try:
                ret = fence.take_any(acct.tenant, num_blocks)
            except FenceError as e2:
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool: {e2}") from None
        queue.num_free_blocks -= num_blocks
        if fence.released_ids:  # cold blocks the fence made clean (still free): out of vLLM's cache too
            for bid in fence.released_ids:
                released = self.blocks[bid]
                if released.block_hash is not None:
                    self._maybe_evict_cached_block(released)
            fence.released_ids.clear()
        if self._reuse_watchers:
            self._notify_reuse(ret)
        collector = self.metrics_collector
        for block in ret:
            if block.block_hash is not None:  # a cached block the fence evicted: out of vLLM's cache
                self._maybe_evict_cached_block(block)
            elif collector:
                collector.on_block_evicted(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            if collector:
                collector.on_block_allocated(block)
        return ret

    def _unadmitted_account(self, num_blocks: int) -> TenantAccount:
        """The account an allocation for a request that was never admitted is charged to (never
        expected: vLLM allocates for a running request only after it left the waiting queue through
        _admit). A request with a tenant is admitted now, without a reservation, so that its books close
        when it finishes; anything else is charged to no tenant."""
        fence = self.fence
        tenant = self.tenant_of.get(self.rid, UNATTRIBUTED)
        if tenant == UNATTRIBUTED:
            log.error("kvfence: %d KV blocks allocated outside any request; charged to no tenant", num_blocks)
            return fence.account(UNATTRIBUTED)
        log.error("kvfence: request %s allocates without having been admitted; admitted now", self.rid)
        fence.admit(self.rid, tenant, 0)
        return fence.admitted[self.rid][0]

    def touch(self, blocks: Sequence[Any]) -> None:
        revived = []
        collector = self.metrics_collector
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                revived.append(block)
            block.ref_cnt += 1
            if collector:
                collector.on_block_accessed(block)
        if revived:
            self.fence.revive(revived)
            self.free_count.num_free_blocks -= len(revived)

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        # vLLM's own loop, with the fence's lists in place of vLLM's queue: cached blocks turn cold
        # (evicted in this order), the others clean.
        cold: list[Any] = []
        clean: list[Any] = []
        caching = self.enable_caching
        other_pools: dict[Any, list[Any]] = {}
        for block in ordered_blocks:
            pool = block.pool
            if pool is not None and pool is not self:
                other_pools.setdefault(pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if caching and block.block_hash is not None:
                    cold.append(block)
                else:
                    clean.append(block)
        if cold or clean:
            self.free_count.num_free_blocks += len(cold) + len(clean)
            self.fence.release_blocks(cold, clean)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        for bid in block_ids:
            if self.blocks[bid].block_hash is None:
                self.fence.uncached(bid)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset (its weights changed, or a benchmark starts clean): True, and every cached block
        forgotten, only if no request holds a block. That is a question about the whole pool, so it is
        answered from the pool's own count, never from what one tenant may obtain (vLLM's check reads
        ``get_num_free_blocks``, which with quotas answers for the request being allocated for). The
        declared shared prefixes' pinned blocks are the fence's, not a request's: when nothing else
        is held they are unpinned and forgotten with the rest (the scheduler pins them again)."""
        fence = self.fence
        pinned = Counter(bid for pin in fence.shared for bid in pin.block_ids)
        used = self.num_gpu_blocks - 1 - self.free_count.num_free_blocks
        if used != len(pinned) or any(self.blocks[bid].ref_cnt != n for bid, n in pinned.items()):
            log.warning("kvfence: prefix cache not reset: requests hold %d KV blocks", used - len(pinned))
            return False
        if pinned:
            held = [self.blocks[bid] for pin in fence.shared for bid in reversed(pin.block_ids)]
            fence.shared = ()
            fence.version += 1
            self.free_blocks(held)
        queue, self.free_block_queue = self.free_block_queue, self.free_count
        try:
            ok: bool = super().reset_prefix_cache()
        finally:
            self.free_block_queue = queue
        if ok:
            for block in self.blocks:
                if not block.is_null:
                    fence.uncached(block.block_id)
        return ok

    # 73 lines: vLLM's signature, then the text fast path and the multimodal loop over the same locals.
    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        _vllm_cache_full_blocks(
            self,
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        if num_cached_blocks >= num_full_blocks:
            return
        records = self.fence.records
        tokens = request._all_token_ids  # the list behind all_token_ids (its slices cost no Python call)
        # Prompt blocks are copied from the prompt packed on arrival (kvfence.vllm.records.pack), the
        # rest packed from the token list.
        packed = self.packed_of.get(request.request_id)
        # Where the request's namespace enters its chain: block 0, or the first block after the
        # declared shared prefix it begins with (its blocks before that are the pinned ones).
        shared_of = self.shared_of
        root = shared_of.get(request.request_id, 0) if shared_of else 0
        parent = records[blocks[num_cached_blocks - 1].block_id] if num_cached_blocks > 0 else None
        if not request.mm_features and getattr(request, "prompt_embeds", None) is None:
            # Plain text (the common case): the loop below in one call (kvfence.vllm.records), the
            # root's namespace as block_namespace(0, ns, None) makes it.
            root_ns = (namespace_of(request), None) if num_cached_blocks <= root < num_full_blocks else None
            record_chain(
                records,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                parent,
                tokens,
                packed,
                block_size,
                root,
                root_ns,
            )
            return
        # Multimodal inputs or prompt embeddings: the same loop, with vLLM's per-block extra keys.
        npacked = len(packed) // TOKEN_BYTES if packed is not None else 0
        extras = extra_keys_of(request, num_full_blocks, block_size)
        assert extras is not None  # (not plain text)
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is None:
                parent = None
                continue
            if i < root or (i > 0 and parent is None):
                # A shared block computed again instead of hit, or (never with one full-attention group)
                # a block without its parent's record: fail safe, an entry that never verifies.
                records[block.block_id] = parent = None
                continue
            lo = i * block_size  # the record takes tokens[lo:lo + block_size] (kvfence.vllm.records)
            src: Any = packed if lo + block_size <= npacked else tokens
            if i == root:
                namespace = TenantFence.block_namespace(0, namespace_of(request), extras[i:])
                rec = Record(parent, src, lo, lo + block_size, namespace, True)
                records[block.block_id] = parent = rec
                continue
            # (i > root >= 0 here: block_namespace ignores the request's namespace for such a block)
            namespace = TenantFence.block_namespace(i, (), extras)
            records[block.block_id] = parent = Record(parent, src, lo, lo + block_size, namespace)

    def move_block_hashes(self, src_block: Any, dst_block: Any) -> None:
        super().move_block_hashes(src_block, dst_block)
        self.fence.records[dst_block.block_id] = self.fence.records[src_block.block_id]
        self.fence.records[src_block.block_id] = None

    def cache_partial_block(self, request: Request, block: Any, *args: Any, **kwargs: Any) -> Any:
        # Partial entries are outside what the fence verifies (refused at start); an entry without a
        # record can never verify, so it is a miss, never an unverified hit.
        out = super().cache_partial_block(request, block, *args, **kwargs)
        self.fence.records[block.block_id] = None
        return out


def namespace_of(request: Request) -> tuple[Any, ...]:
    """The cache namespace of a request: its salt (the middleware derived it from the verified
    tenant and scope) and its adapter."""
    lora = request.lora_request.name if request.lora_request is not None else None
    return (request.cache_salt, lora)


def extra_keys_of(request: Request, num_blocks: int, block_size: int) -> list[Any] | None:
    """vLLM's per-block extra keys (multimodal inputs, prompt embeddings), None for plain text."""
    if not request.mm_features and getattr(request, "prompt_embeds", None) is None:
        return None
    out: list[Any] = []
    mm_idx = 0
    for i in range(num_blocks):
        keys, mm_idx = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
        out.append(keys)
    return out


@contextlib.contextmanager
def constructing_as(module: Any, name: str, cls: type) -> Iterator[None]:
    """``module.name`` is ``cls`` for the duration (vLLM's engine core builds its scheduler on one
    thread, before it serves)."""
    original = getattr(module, name)
    if not issubclass(cls, original):
        raise FenceError(f"{cls.__name__} does not extend vLLM's {module.__name__}.{name}")
    setattr(module, name, cls)
    try:
        yield
    finally:
        setattr(module, name, original)
