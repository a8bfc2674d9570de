"""The consistency oracle of the reference allocator: every invariant of the pool, checked from the
outside after the fact (tests and bench/bench_engine.py; not production code)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.isolation.allocator import FencedAllocator, InconsistentPool
from kvfence.isolation.blocks import BlockState
from kvfence.isolation.quotas import SHARED_OWNER
from kvfence.isolation.shared_prefixes import shared_namespace


@dataclass(frozen=True, slots=True)
class Accounting:
    """Where every block is, as :func:`check_consistency` counted it."""

    num_blocks: int
    free: int
    active: int
    fenced: int
    cold: int
    usage: dict[str, int] = field(default_factory=dict)
    sequences: int = 0
    cached_entries: int = 0


def check_consistency(a: FencedAllocator) -> Accounting:
    """Verify every invariant of the pool and return where every block is.

    Raises :class:`InconsistentPool` naming the first broken invariant.
    """

    def fail(msg: str) -> None:
        raise InconsistentPool(msg)

    with a._lock:
        counts = dict.fromkeys(BlockState, 0)
        usage: dict[str, int] = {}
        refs = [0] * a.num_blocks
        for seq in a._seqs.values():
            ids = [b.block_id for b in seq.blocks]
            if len(set(ids)) != len(ids):
                fail(f"sequence {seq.seq_id!r} references a block twice")
            if list(seq.table) != ids:
                fail(f"sequence {seq.seq_id!r} block table out of sync")
            for b, h in zip(seq.blocks, seq.handles, strict=True):
                refs[b.block_id] += 1
                if b.generation != h.generation:
                    fail(f"sequence {seq.seq_id!r} holds a stale handle for block {b.block_id}")
                if b.context is not None:
                    # a declared shared prefix's pinned block may be in any table of the class
                    pinned = b.owner == SHARED_OWNER and b.context.namespace == shared_namespace(
                        a.trust_class
                    )
                    if not pinned and (seq.ctx is None or b.context.namespace != seq.ctx.namespace):
                        fail(
                            f"block {b.block_id} of namespace {b.context.namespace!r} is in a table of "
                            f"another namespace"
                        )
                elif b.owner != seq.account.tenant:
                    fail(f"private block {b.block_id} of {b.owner!r} in a table of {seq.account.tenant!r}")
        cache = a.prefix_cache
        for b in a.pool.blocks:
            counts[b.state] += 1
            if b.ref_cnt != refs[b.block_id]:
                fail(f"block {b.block_id} ref count {b.ref_cnt}, referenced {refs[b.block_id]} times")
            if b.state is BlockState.FREE:
                if b.in_list is not a.pool.free or b.owner is not None or b.block_hash is not None:
                    fail(f"free block {b.block_id} is not clean")
                continue
            if b.owner is None:
                fail(f"block {b.block_id} in state {b.state.name} has no owner")
                continue
            usage[b.owner] = usage.get(b.owner, 0) + 1
            if b.state is BlockState.ACTIVE:
                if b.ref_cnt < 1 or b.in_list is not None:
                    fail(f"active block {b.block_id} unreferenced or listed")
            elif b.state is BlockState.FENCED:
                if b.ref_cnt != 0 or b.pending_writers < 1 or b.in_list is not None:
                    fail(f"fenced block {b.block_id} is inconsistent")
                if b.pending_writers + bin(b.signalled).count("1") != a.tensor_parallel_size:
                    fail(f"fenced block {b.block_id} writer count is off")
            else:
                acct = a.book.accounts.get(b.owner)
                if acct is None or b.in_list is not acct.cold or b.ref_cnt != 0:
                    fail(f"cold block {b.block_id} is not in its owner's cold list")
                if b.block_hash is None or cache is None or cache.index.get(b.block_hash) is not b:
                    fail(f"cold block {b.block_id} has no cache entry")
        if counts[BlockState.FREE] != len(a.pool.free):
            fail("free list length differs from the number of free blocks")
        if counts[BlockState.ACTIVE] != a._num_active or counts[BlockState.FENCED] != a._num_fenced:
            fail("active/fenced counters out of sync")
        total_res = 0
        for t, acct in a.book.accounts.items():
            if acct.usage != usage.get(t, 0):
                fail(f"tenant {t!r} usage {acct.usage}, but owns {usage.get(t, 0)} blocks")
            if acct.usage > acct.max_blocks:
                fail(f"tenant {t!r} holds {acct.usage} blocks, above its maximum {acct.max_blocks}")
            if len(acct.cold) != sum(1 for _ in acct.cold):
                fail(f"tenant {t!r} cold list length is off")
            total_res += acct.unused_reservation
        for t in usage:
            if t not in a.book.accounts:
                fail(f"blocks owned by unknown tenant {t!r}")
        if total_res != a.book.total_unused_reservation:
            fail("reservation total out of sync")
        if cache is not None:
            for key, b in cache.index.items():
                if b.block_hash != key or b.state is BlockState.FREE:
                    fail(f"cache entry for block {b.block_id} is stale")
                if b.cache_handle != (b.block_id, b.generation):
                    fail(f"cache entry for block {b.block_id} carries a handle of another generation")
        if counts[BlockState.FREE] + sum(usage.values()) != a.num_blocks:
            fail("blocks are unaccounted for")
        return Accounting(
            num_blocks=a.num_blocks,
            free=counts[BlockState.FREE],
            active=counts[BlockState.ACTIVE],
            fenced=counts[BlockState.FENCED],
            cold=counts[BlockState.COLD],
            usage=usage,
            sequences=len(a._seqs),
            cached_entries=0 if cache is None else len(cache),
        )
