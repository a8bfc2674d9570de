"""The fenced allocator: quotas, all-or-nothing allocation, fencing, generations, eviction order,
and a hypothesis state machine over all of it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from engine.oracle import check_consistency
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvfence.contract.engine_config import QuotasConfig
from kvfence.isolation.allocator import (
    AllocationError,
    FencedAllocator,
    PoolExhausted,
    QuotaExceeded,
    StaleReference,
)
from kvfence.isolation.blocks import BlockHandle, BlockList, BlockState, KVBlock
from kvfence.isolation.metrics import EngineMetrics
from kvfence.isolation.prefix_cache import CacheContext, PrefixCache

BS = 4


def ctx(tenant: str) -> CacheContext:
    return CacheContext("m", "r", "", "none", "gold", f"tenant/gold/{tenant}")


def toks(*vals: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.array(vals, dtype=np.int32)


def make(
    num_blocks: int = 16, tp: int = 1, quotas: dict[str, Any] | None = None, cache: bool = True
) -> FencedAllocator:
    m = EngineMetrics()
    pc = PrefixCache(BS, m) if cache else None
    q = QuotasConfig.model_validate(quotas or {})
    return FencedAllocator(
        "gold", num_blocks, BS, tensor_parallel_size=tp, quotas=q, metrics=m, prefix_cache=pc
    )


def run_seq(a: FencedAllocator, sid: str, tenant: str, prompt: np.ndarray[Any, Any], extra: int = 0) -> int:
    """Allocate, 'compute' the prompt, release (fence signalled); returns the cached tokens it got."""
    got = a.allocate_sequence(sid, tenant, len(prompt) + extra, ctx=ctx(tenant), prompt=prompt)
    a.commit(sid, prompt, len(prompt))
    a.release(sid)
    return got.num_cached_tokens


def test_block_list_is_intrusive_and_o1() -> None:
    lst = BlockList("x")
    blocks = [KVBlock(i) for i in range(5)]
    for b in blocks:
        lst.append(b)
    lst.remove(blocks[2])
    assert [b.block_id for b in lst] == [0, 1, 3, 4]
    assert lst.popleft() is blocks[0]
    assert len(lst) == 3
    with pytest.raises(RuntimeError):
        lst.append(blocks[1])  # already in a list
    with pytest.raises(RuntimeError):
        BlockList("y").remove(blocks[1])
    for _ in range(3):
        lst.popleft()
    with pytest.raises(IndexError):
        lst.popleft()


def test_block_list_extend_and_popleft_n_are_appends_and_poplefts_in_one() -> None:
    lst = BlockList("x")
    blocks = [KVBlock(i) for i in range(6)]
    lst.append(blocks[0])
    lst.extend(blocks[1:4])
    lst.extend([])
    assert [b.block_id for b in lst] == [0, 1, 2, 3] and len(lst) == 4
    assert all(b.in_list is lst for b in blocks[:4])
    with pytest.raises(RuntimeError):
        lst.extend([blocks[4], blocks[2]])  # the second is already in the list: nothing is linked
    assert blocks[4].in_list is None and [b.block_id for b in lst] == [0, 1, 2, 3] and len(lst) == 4
    assert lst.popleft_n(2) == blocks[:2]
    assert all(b.in_list is None and b.prev is None and b.next is None for b in blocks[:2])
    assert [b.block_id for b in lst] == [2, 3] and len(lst) == 2
    assert lst.popleft_n(0) == []
    with pytest.raises(IndexError):
        lst.popleft_n(3)
    lst.append(blocks[5])
    assert lst.popleft_n(3) == [blocks[2], blocks[3], blocks[5]]
    assert len(lst) == 0 and list(lst) == []
    lst.append(blocks[0])  # the sentinels are linked again
    assert list(lst) == [blocks[0]]
    # state=: each block's state set as it is linked; without it, states are left alone.
    assert all(b.state is BlockState.FREE for b in blocks[1:5])
    lst.extend(blocks[1:3], state=BlockState.COLD)
    lst.extend(blocks[3:5])
    assert [b.state for b in lst] == [
        BlockState.FREE,
        BlockState.COLD,
        BlockState.COLD,
        BlockState.FREE,
        BlockState.FREE,
    ]


def test_allocation_is_all_or_nothing() -> None:
    a = make(num_blocks=8)
    a.allocate_sequence("s1", "t", 6 * BS)
    before = check_consistency(a)
    with pytest.raises(PoolExhausted, match="needs 3 blocks"):
        a.allocate_sequence("s2", "t", 3 * BS)
    assert check_consistency(a) == before
    assert not a.is_open("s2")


def test_quota_hard_maximum_is_refused_with_a_clear_error_and_counted() -> None:
    a = make(quotas={"tenants": {"small": {"maxBlocks": 3}}})
    a.allocate_sequence("s1", "small", 2 * BS)
    with pytest.raises(QuotaExceeded, match=r"tenant 'small'.*needs 2 blocks.*holds 2 active.*maximum is 3"):
        a.allocate_sequence("s2", "small", 2 * BS)
    assert a.metrics.value("kvfence_engine_quota_rejected_total", {"tenant": "small"}) == 1
    a.allocate_sequence("s3", "other", 10 * BS)  # other tenants are not limited by it
    acc = check_consistency(a)
    assert acc.usage == {"small": 2, "other": 10}


def test_tenant_at_its_maximum_evicts_its_own_cold_blocks_first() -> None:
    a = make(quotas={"tenants": {"t": {"maxBlocks": 4}}})
    p1 = toks(*range(1, 12))  # 2 full blocks (cached) and a partial one
    run_seq(a, "s1", "t", p1)
    acc = check_consistency(a)
    assert acc.usage["t"] == 2 and acc.cold == 2  # the partial block went back to the free list
    a.allocate_sequence("s2", "t", 4 * BS)  # needs its whole quota: must evict its own cold blocks
    acc = check_consistency(a)
    assert acc.cold == 0 and acc.usage["t"] == 4
    assert a.metrics.value("kvfence_engine_kv_evictions_total", {"kind": "own"}) == 2


def test_a_tenant_above_a_lowered_maximum_sheds_its_surplus_and_gets_exactly_what_it_asks() -> None:
    # Its maximum lowered below what it holds cold (a quota change without a restart): its next
    # allocation evicts its own cold blocks down to the maximum, returns the surplus to the free list
    # and is handed only the blocks it asked for (it was handed every evicted block).
    a = make(num_blocks=16, quotas={"tenants": {"t": {"maxBlocks": 12}}})
    run_seq(a, "s1", "t", toks(*range(1, 42)))  # 10 full blocks cached (cold) and a partial one
    acc = check_consistency(a)
    assert acc.usage["t"] == 10 and acc.cold == 10
    a.set_quotas(QuotasConfig.model_validate({"tenants": {"t": {"maxBlocks": 4}}}))
    free_before = len(a.pool.free)
    got = a.allocate_sequence("s2", "t", BS)
    assert len(got.handles) == 1 and len(got.table) == 1
    acc = check_consistency(a)
    assert acc.usage["t"] == 4 and acc.cold == 3  # at its maximum: 3 cold + 1 active
    assert len(a.pool.free) == free_before + 6  # 7 evicted: 6 back to the free list, 1 handed out
    assert a.metrics.value("kvfence_engine_kv_evictions_total", {"kind": "own"}) == 7
    a.allocate_sequence("s3", "other", 12 * BS)  # the shed blocks serve anyone
    check_consistency(a)


def test_guaranteed_share_is_reserved_and_protected_from_other_tenants() -> None:
    a = make(num_blocks=10, quotas={"tenants": {"g": {"guaranteedBlocks": 4}}})
    # "g" has not allocated anything: 4 of the 10 free blocks are reserved for it.
    with pytest.raises(PoolExhausted):
        a.allocate_sequence("x1", "noisy", 7 * BS)
    a.allocate_sequence("x1", "noisy", 6 * BS)
    a.allocate_sequence("g1", "g", 4 * BS)  # the reservation is still there
    check_consistency(a)
    a.release("x1")
    a.release("g1")
    # Now "g" caches 3 full blocks (within its guarantee): "noisy" may not evict them.
    run_seq(a, "g2", "g", toks(*range(1, 14)))
    acc = check_consistency(a)
    assert acc.usage == {"g": 3}
    with pytest.raises(PoolExhausted):
        a.allocate_sequence("x2", "noisy", 8 * BS)
    a.allocate_sequence("x2", "noisy", 6 * BS)  # 7 free minus g's 1 unused reserved block
    assert check_consistency(a).usage["g"] == 3


def test_cross_tenant_reclaim_only_beyond_the_guarantee() -> None:
    a = make(num_blocks=8, quotas={"tenants": {"g": {"guaranteedBlocks": 2}}})
    run_seq(a, "g1", "g", toks(*range(1, 22)))  # 5 full cached blocks, 1 partial freed
    assert check_consistency(a).usage == {"g": 5}
    a.allocate_sequence("n1", "noisy", 6 * BS)  # 3 free + 3 of g's 5 cold (5 - guaranteed 2)
    acc = check_consistency(a)
    assert acc.usage == {"g": 2, "noisy": 6}
    assert a.metrics.value("kvfence_engine_kv_evictions_total", {"kind": "cross"}) == 3
    with pytest.raises(PoolExhausted):
        a.allocate_sequence("n2", "noisy", 1 * BS)
    # g's two remaining blocks are the head of its prompt (freed last first: tails evicted first)
    assert a.cached_prefix_tokens(ctx("g"), toks(*range(1, 22))) == 2 * BS


def test_fence_holds_a_block_until_every_writer_signalled() -> None:
    a = make(num_blocks=2, tp=3, cache=False)
    a.allocate_sequence("s", "t", 2 * BS)
    fenced = a.free_sequence("s")
    assert len(fenced) == 2
    with pytest.raises(PoolExhausted):
        a.allocate_sequence("s2", "t", 1)  # nothing reusable before the fence
    h = fenced[0]
    assert a.writer_done(h, 0) is False
    with pytest.raises(ValueError, match="already signalled"):
        a.writer_done(h, 0)
    assert a.writer_done(h, 2) is False
    with pytest.raises(PoolExhausted):
        a.allocate_sequence("s2", "t", 1)
    assert a.writer_done(h, 1) is True
    got = a.allocate_sequence("s2", "t", 1)
    assert got.handles[0].block_id == h.block_id
    assert got.handles[0].generation == h.generation + 1
    with pytest.raises(ValueError, match="out of range"):
        a.writer_done(fenced[1], 3)
    check_consistency(a)


def test_stale_handles_are_refused_and_counted() -> None:
    a = make(num_blocks=1, cache=False)
    old = a.allocate_sequence("s", "t", 1).handles[0]
    a.check_handle(old)
    a.release("s")
    with pytest.raises(StaleReference, match="stale handle"):
        a.check_handle(old)  # freed
    a.allocate_sequence("s2", "t", 1)
    with pytest.raises(StaleReference):
        a.check_handle(old)  # reallocated: same block, newer generation
    with pytest.raises(StaleReference):
        a.writer_done(old, 0)  # a fence signal for a past generation
    with pytest.raises(StaleReference):
        a.check_handle(BlockHandle(99, 0))
    with pytest.raises(StaleReference):
        a.block_table("gone")
    assert a.metrics.value("kv_cache_stale_reference_error_total") == 5


def test_prefix_hits_share_blocks_only_inside_a_namespace() -> None:
    a = make(num_blocks=32)
    p = toks(*range(100, 117))  # 17 tokens: 4 full blocks are cacheable
    assert run_seq(a, "a1", "a", p) == 0
    got = a.allocate_sequence("a2", "a", len(p), ctx=ctx("a"), prompt=p)
    assert got.num_cached_tokens == 16
    b = a.allocate_sequence("b1", "b", len(p), ctx=ctx("b"), prompt=p)
    assert b.num_cached_tokens == 0
    assert not set(got.table.tolist()) & set(b.table.tolist())
    assert all(a.owner_of(i) == "b" for i in b.table.tolist())
    assert a.metrics.value("kv_cache_tenant_cross_access_rejected_total") == 0
    check_consistency(a)


def test_a_prompt_is_never_entirely_served_from_cache() -> None:
    a = make(num_blocks=32)
    p = toks(*range(1, 9))  # exactly two blocks
    run_seq(a, "s1", "t", p)
    assert a.allocate_sequence("s2", "t", 8, ctx=ctx("t"), prompt=p).num_cached_tokens == 4


# --- the state machine ------------------------------------------------------------------------------
TENANTS = ("a", "b", "c")
PREFIXES = (tuple(range(1, 9)), tuple(range(50, 58)), (7,) * 8)


class AllocatorMachine(RuleBasedStateMachine):
    handles_ = Bundle("fenced")

    def __init__(self) -> None:
        super().__init__()
        self.a = make(
            num_blocks=24,
            tp=2,
            quotas={
                "default": {"maxBlocks": 12},
                "tenants": {
                    "a": {"maxBlocks": 8, "guaranteedBlocks": 3},
                    "b": {"maxBlocks": 10, "guaranteedBlocks": 4},
                },
            },
        )
        self.seqs: dict[str, tuple[str, np.ndarray[Any, Any]]] = {}
        self.pending: dict[BlockHandle, set[int]] = {}
        self.n = 0

    @rule(
        tenant=st.sampled_from(TENANTS),
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=9),
        extra=st.integers(0, 9),
    )
    def open(self, tenant: str, prefix: tuple[int, ...], tail: list[int], extra: int) -> None:
        prompt = np.array(prefix + tuple(tail), dtype=np.int32)
        sid = f"s{self.n}"
        self.n += 1
        before = check_consistency(self.a)
        gens = [b.generation for b in self.a.pool.blocks]
        try:
            got = self.a.allocate_sequence(sid, tenant, len(prompt) + extra, ctx=ctx(tenant), prompt=prompt)
        except AllocationError as e:
            event(f"open refused: {type(e).__name__}")
            assert check_consistency(self.a) == before  # all or nothing
            assert [b.generation for b in self.a.pool.blocks] == gens
            return
        event(f"open: prefix hit {got.num_cached_tokens > 0}")
        assert got.num_cached_tokens % BS == 0 and got.num_cached_tokens < len(prompt)
        for h in got.handles:  # nothing handed out may still be behind its fence
            assert h not in self.pending
        self.seqs[sid] = (tenant, prompt)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, prompt = self.seqs[sid]
        upto = data.draw(st.integers(0, len(prompt)))
        self.a.commit(sid, prompt, upto)

    @precondition(lambda self: bool(self.seqs))
    @rule(target=handles_, data=st.data())
    def free(self, data: st.DataObject) -> Any:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        del self.seqs[sid]
        fenced = self.a.free_sequence(sid)
        for h in fenced:
            self.pending[h] = {0, 1}
        from hypothesis.stateful import multiple

        return multiple(*fenced)

    @rule(h=consumes(handles_), first=st.integers(0, 1), both=st.booleans())
    def signal(self, h: BlockHandle, first: int, both: bool) -> None:
        ranks = self.pending.get(h)
        if ranks is None:
            return
        ranks.discard(first)
        done = self.a.writer_done(h, first)
        if both and ranks:
            (other,) = ranks
            ranks.discard(other)
            done = self.a.writer_done(h, other)
        assert done == (not ranks)
        if not ranks:
            del self.pending[h]
            assert self.a.pool.blocks[h.block_id].state in (BlockState.FREE, BlockState.COLD)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), more=st.integers(1, 8))
    def grow(self, data: st.DataObject, more: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        n = len(self.a.handles(sid)) * BS + more
        before = check_consistency(self.a)
        try:
            self.a.grow(sid, n)
        except AllocationError:
            assert check_consistency(self.a) == before

    @rule()
    def stale_use_is_refused(self) -> None:
        for h in list(self.pending)[:1]:
            stale = BlockHandle(h.block_id, h.generation - 1)
            n = self.a.metrics.value("kv_cache_stale_reference_error_total")
            with pytest.raises(StaleReference):
                self.a.writer_done(stale, 0)
            assert self.a.metrics.value("kv_cache_stale_reference_error_total") == n + 1

    @invariant()
    def consistent(self) -> None:
        acc = check_consistency(self.a)  # ref counts, lists, usage, quotas, accounting
        for t, used in acc.usage.items():
            assert used <= self.a.book.accounts[t].max_blocks

    @invariant()
    def no_block_in_two_tenants_tables(self) -> None:
        seen: dict[int, str] = {}
        for sid, (tenant, _) in self.seqs.items():
            for h in self.a.handles(sid):
                assert seen.setdefault(h.block_id, tenant) == tenant
                assert self.a.pool.blocks[h.block_id].ref_cnt >= 1

    @invariant()
    def nothing_reused_before_its_fence(self) -> None:
        for h in self.pending:
            b = self.a.pool.blocks[h.block_id]
            assert b.state is BlockState.FENCED and b.generation == h.generation

    def teardown(self) -> None:
        for sid in list(self.seqs):
            for h in self.a.free_sequence(sid):
                self.pending[h] = {0, 1}
        for h, ranks in self.pending.items():
            for r in sorted(ranks):
                self.a.writer_done(h, r)
        acc = check_consistency(self.a)
        assert acc.active == 0 and acc.fenced == 0  # every freed block came back
        assert acc.free + acc.cold == acc.num_blocks


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
