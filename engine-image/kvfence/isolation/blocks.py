"""KV blocks, their handles, and the intrusive block lists the allocator keeps them in.

In the manner of vLLM's ``block_pool.py``: every block object is created once, up front; a block is
in at most one list at a time, and the lists are intrusive (the links live in the block), doubly
linked and closed by two sentinels, so taking a block out of the middle of a list is O(1) and no
list operation allocates.

A block's life (``state``):

``FREE``   in the pool's clean free list: no owner, no content anyone may read.
``ACTIVE`` referenced by one or more sequences (``ref_cnt`` > 0).
``FENCED`` no longer referenced, but not every tensor-parallel writer has signalled that its writes
           to the block are complete; the block may be neither handed out again nor revived from the
           prefix cache until they have.
``COLD``   unreferenced, fenced, and holding a verified prefix-cache entry: it sits in its owner's
           cold list and may be revived by a cache hit or evicted.

``generation`` is bumped every time the block is handed out for new content, so a
:class:`BlockHandle` taken before that (a *stale* handle) no longer matches and is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvfence.isolation.prefix_cache import CacheContext


class BlockState(IntEnum):
    FREE = 0
    ACTIVE = 1
    FENCED = 2
    COLD = 3


class BlockHandle(NamedTuple):
    """A reference to one block *at one generation*."""

    block_id: int
    generation: int


@dataclass(slots=True, eq=False)
class KVBlock:
    # The fields every allocation, release and eviction touches come first, next to each other: a block
    # object is 152 bytes with the collector's header, and these seven (56 bytes) then share one or two
    # cache lines instead of spanning three. (Inside vLLM the fence keeps these fields on vLLM's own
    # blocks instead: kvfence.vllm.block_pool.FencedKVCacheBlock.)
    block_id: int
    state: BlockState = BlockState.FREE
    #: the tenant whose quota the block counts against (None while FREE)
    owner: str | None = None
    generation: int = 0
    # --- intrusive list links ---
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)
    #: the list the block is in (identity), or None
    in_list: BlockList | None = field(default=None, repr=False)
    ref_cnt: int = 0
    #: writers that still have to signal before the block leaves FENCED
    pending_writers: int = 0
    #: bit i set: rank i has signalled for the current fence
    signalled: int = 0
    # --- prefix-cache entry (all None unless the block holds a registered, verified entry) ---
    block_hash: bytes | None = None
    context: CacheContext | None = None
    parent: BlockHandle | None = None
    tokens: bytes | None = None
    #: the block's handle while it holds the entry: the object its children store as ``parent``, so a
    #: lookup can check a child's parent by identity first (verify() compares by value)
    cache_handle: BlockHandle | None = None

    @property
    def handle(self) -> BlockHandle:
        return BlockHandle(self.block_id, self.generation)

    def clear_cache_entry(self) -> None:
        self.block_hash = None
        self.context = None
        self.parent = None
        self.tokens = None
        self.cache_handle = None


class BlockList:
    """An intrusive doubly linked list of :class:`KVBlock` with head and tail sentinels.

    ``popleft`` takes the oldest block, ``append`` adds at the tail, ``remove`` unlinks any member in
    O(1). Not thread-safe: the allocator's lock guards every list.
    """

    __slots__ = ("_head", "_len", "_tail", "name")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        if block.in_list is not None:
            raise RuntimeError(f"block {block.block_id} is already in list {block.in_list.name!r}")
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        block.in_list = self
        self._len += 1

    def extend(
        self, blocks: list[KVBlock], *, unlisted: bool = False, state: BlockState | None = None
    ) -> None:
        """:meth:`append` each of ``blocks``, in order (one call for many: the vLLM fence releases a
        request's blocks at once); all or nothing. ``unlisted``: the caller has checked that none of
        them is in a list (the vLLM fence: they were all ``ACTIVE``), so they are not checked again.
        ``state``: each block's new state, set as it is linked (one pass over the blocks, not two)."""
        if not unlisted:
            for block in blocks:
                if block.in_list is not None:
                    raise RuntimeError(f"block {block.block_id} is already in list {block.in_list.name!r}")
        last = self._tail.prev
        assert last is not None
        if state is None:
            for block in blocks:
                last.next = block
                block.prev = last
                block.in_list = self
                last = block
        else:
            for block in blocks:
                last.next = block
                block.prev = last
                block.in_list = self
                block.state = state
                last = block
        last.next = self._tail
        self._tail.prev = last
        self._len += len(blocks)

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise IndexError(f"pop from empty block list {self.name!r}")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVBlock]:
        """The ``n`` oldest blocks, unlinked (as ``n`` :meth:`popleft` calls, in one)."""
        if n > self._len:
            raise IndexError(f"pop of {n} from block list {self.name!r} of {self._len}")
        out: list[KVBlock] = []
        node = self._head.next
        for _ in range(n):
            assert node is not None
            nxt = node.next
            node.prev = node.next = None
            node.in_list = None
            out.append(node)
            node = nxt
        assert node is not None
        self._head.next = node
        node.prev = self._head
        self._len -= n
        return out

    def remove(self, block: KVBlock) -> None:
        if block.in_list is not self:
            raise RuntimeError(f"block {block.block_id} is not in list {self.name!r}")
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        block.in_list = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            nxt = node.next
            yield node
            node = nxt


class BlockPool:
    """All blocks of one engine, created up front, and the clean free list."""

    __slots__ = ("block_size", "blocks", "free")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free = BlockList("free")
        for b in self.blocks:
            self.free.append(b)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)
