"""The kvfence scheduler inside vLLM's real scheduler, KV-cache manager and block pool (no model)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_engine.vllmsched import KEY, TRUST_CLASS, Harness, base_config, salt_of, weak_hash

from kvfence.contract import XARG_REQUEST_REF, XARG_TENANT, XARG_TENANT_TAG, tenant_tag
from kvfence.vllm import records
from kvfence.vllm.block_pool import FencedBlockPool
from kvfence.vllm.kv_cache_manager import FencedKVCacheManager
from kvfence.vllm.refusals import EngineRefusal, RefusalBox, new_ref

PROMPT = list(range(100, 164))  # 4 full blocks of 16


def test_vllm_builds_the_fenced_scheduler_from_its_flag(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    assert isinstance(h.sched, Scheduler)
    assert isinstance(h.sched.kv_cache_manager, FencedKVCacheManager)
    assert isinstance(h.pool, FencedBlockPool)
    assert h.fence.usable_blocks == 63
    h.check()


def test_a_tenant_hits_its_own_prefix_and_another_tenant_does_not(tmp_path: Path, record_impl: str) -> None:
    h = Harness(tmp_path)
    a = h.add("alice", [*PROMPT, 1])
    h.run()
    assert h.finished[a.request_id] == "length"
    a2 = h.add("alice", [*PROMPT, 2])
    assert h.hits(h.step(), a2.request_id) == 64
    b = h.add("bob", [*PROMPT, 3])
    assert h.hits(h.step(), b.request_id) == 0
    h.run()
    h.check()
    c = h.fence.counters
    assert (c.hash_collision, c.cross_access_rejected, c.stale_reference) == (0, 0, 0)


def test_forced_collisions_are_misses_and_counted(tmp_path: Path, record_impl: str) -> None:
    # record_impl: with the compiled records and with the pure-Python ones (the GPU image's)
    h = Harness(tmp_path, hash_fn=weak_hash)
    h.add("alice", [*PROMPT, 1])
    h.run()
    # Other tokens (in each block's second half), same tenant: the weak hash finds alice's first
    # block, verification refuses it.
    other = [t + 1000 if i % 16 >= 8 else t for i, t in enumerate(PROMPT)]
    a2 = h.add("alice", [*other, 1])
    assert h.hits(h.step(), a2.request_id) == 0
    assert h.fence.counters.hash_collision >= 1
    h.run()
    # Same tokens, another tenant: the weak hash ignores the salt's difference; refused as cross access.
    before = h.fence.counters.cross_access_rejected
    b = h.add("bob", [*PROMPT, 1])
    assert h.hits(h.step(), b.request_id) == 0
    assert h.fence.counters.cross_access_rejected == before + 1
    h.run()
    h.check()


def test_refused_hit_ends_the_hit_at_the_first_bad_block(tmp_path: Path, record_impl: str) -> None:
    h = Harness(tmp_path, hash_fn=weak_hash)
    h.add("alice", [*PROMPT, 1])
    h.run()
    # Same first two blocks, different third: the hit is exactly two blocks.
    changed = PROMPT[:40] + [t + 1000 for t in PROMPT[40:]]
    a2 = h.add("alice", [*changed, 1])
    hits = h.hits(h.step(), a2.request_id)
    assert hits == 32
    h.run()
    h.check()


def test_duplicate_copies_of_a_prefix_verify(tmp_path: Path) -> None:
    # vLLM never de-duplicates: a prompt that is exactly the cached prefix hits all but its last block
    # (the last token is always recomputed) and caches a second copy of that block.
    h = Harness(tmp_path)
    h.add("alice", [*PROMPT, 1])
    h.run()
    exact = h.add("alice", PROMPT)
    assert h.hits(h.step(), exact.request_id) == 48
    h.run()
    copies = [b for b in h.pool.blocks if h.fence.records[b.block_id] is not None]
    assert len(copies) == 5  # 4 blocks of the prefix plus the second copy of the fourth
    r3 = h.add("alice", [*PROMPT, 9])
    assert h.hits(h.step(), r3.request_id) == 64
    assert h.fence.counters.hash_collision == 0
    h.run()
    h.check()


def test_requests_without_a_verified_tenant_are_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    none = h.add(None, PROMPT, salt=salt_of("alice"), xargs={})
    forged = h.add("alice", PROMPT, tag="forged")
    # bob's tag on alice's salt: a tag binds tenant and salt.
    swapped = h.add(
        "alice", PROMPT, salt=salt_of("bob"), tag=tenant_tag(KEY, TRUST_CLASS, "bob", salt_of("bob"))
    )
    ok = h.add("alice", PROMPT)
    h.run()
    for r in (none, forged, swapped):
        assert h.finished[r.request_id] == "error"
        assert h.outputs[r.request_id] == []
    assert h.finished[ok.request_id] == "length"
    assert h.fence.counters.identity_rejected == {"MissingTenant": 1, "BadTenantTag": 2}
    h.check()


def test_every_request_of_a_tenant_carries_one_tenant_object(tmp_path: Path) -> None:
    """Each request's ``vllm_xargs`` arrive as string objects of their own (decoded from its message);
    the scheduler hands its books one object per tenant, so its per-step scans compare tenants by
    identity. A wrong tag on a known tenant is still refused."""
    h = Harness(tmp_path)
    a1, a2, b1 = h.add("alice", PROMPT), h.add("alice", PROMPT[::-1]), h.add("bob", PROMPT)
    sent = [r.sampling_params.extra_args[XARG_TENANT] for r in (a1, a2)]
    assert sent[0] == sent[1] and sent[0] is not sent[1]
    tenant_of = h.sched._tenant_of
    assert tenant_of[a1.request_id] is tenant_of[a2.request_id] == "alice"
    assert tenant_of[b1.request_id] == "bob"
    forged = h.add("alice", PROMPT, tag="forged")
    h.run()
    assert h.finished[forged.request_id] == "error"
    assert h.fence.counters.identity_rejected == {"BadTenantTag": 1}
    h.check()


def test_a_tenant_at_its_maximum_waits_while_others_are_served(tmp_path: Path) -> None:
    # alice may hold 6 blocks: one request of 64+16 tokens reaches 5 blocks, so only one runs at once.
    h = Harness(tmp_path, quotas={"alice": {"maxBlocks": 6}})
    a = [h.add("alice", [t + 200 * i for t in PROMPT], max_tokens=16) for i in range(3)]
    b = [h.add("bob", [t + 5000 + 200 * i for t in PROMPT], max_tokens=16) for i in range(3)]
    out = h.step()
    scheduled = set(out.num_scheduled_tokens)
    assert a[0].request_id in scheduled
    assert a[1].request_id not in scheduled and a[2].request_id not in scheduled
    assert {r.request_id for r in b} <= scheduled  # bob is not stuck behind alice's waiting requests
    assert h.fence.counters.quota_held_back["alice"] >= 1
    peak = 0
    for _ in range(300):
        if not h.sched.has_requests():
            break
        h.step()
        h.check()
        peak = max(peak, h.fence.book.accounts["alice"].active if "alice" in h.fence.book.accounts else 0)
    assert peak <= 6
    assert all(h.finished[r.request_id] == "length" for r in a + b)
    assert all(len(h.outputs[r.request_id]) == 16 for r in a + b)


def test_a_request_larger_than_the_maximum_is_cut_or_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path, quotas={"alice": {"maxBlocks": 5}})
    cut = h.add("alice", PROMPT, max_tokens=100)  # 64 + 100 tokens > 5 blocks of 16
    # 100 prompt tokens > 80, with the reference the middleware gives every request it forwards
    ref = new_ref()
    xargs = {
        XARG_TENANT: "alice",
        XARG_TENANT_TAG: tenant_tag(KEY, TRUST_CLASS, "alice", salt_of("alice")),
        XARG_REQUEST_REF: ref,
    }
    too_big = h.add("alice", list(range(100)), xargs=xargs)
    # The answer is left for the middleware before vLLM hears of the error (it is written at once).
    box = RefusalBox.from_env()
    assert (box.directory / ref).exists()
    h.run()
    assert h.finished[cut.request_id] == "length" and len(h.outputs[cut.request_id]) == 80 - 64
    assert h.finished[too_big.request_id] == "error"
    assert h.fence.counters.quota_rejected == {"alice": 1}
    # No wait makes it fit: a 400 that clients do not retry, naming the limit.
    assert box.take(ref) == EngineRefusal(
        400,
        "max_kv_blocks_exceeded",
        "KV-block quota exceeded for tenant 'alice': the prompt needs 7 KV blocks of 16 tokens, more than "
        "the tenant's maximum of 5 (maxKVBlocks); the request can never be served within it",
    )
    # A request without a reference (not through the middleware) is refused all the same.
    h.add("alice", list(range(100)))
    h.run()
    assert h.fence.counters.quota_rejected == {"alice": 2}
    assert list(box.directory.iterdir()) == []
    h.check()


def test_a_prompt_token_beyond_int32_is_refused_with_a_400(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The compiled records store token ids as int32, vLLM's own type; vLLM's input processor refuses
    # ids outside the vocabulary, so only an engine that skips it (--skip-tokenizer-init) can pass one.
    # Refused, with an answer for the middleware: never an engine crash, never a truncated token.
    assert records.COMPILED
    h = Harness(tmp_path)
    ref = new_ref()
    xargs = {
        XARG_TENANT: "alice",
        XARG_TENANT_TAG: tenant_tag(KEY, TRUST_CLASS, "alice", salt_of("alice")),
        XARG_REQUEST_REF: ref,
    }
    with caplog.at_level("WARNING", logger="kvfence.vllm.scheduler"):
        bad = h.add("alice", [*PROMPT[:20], 2**31, *PROMPT[21:]], xargs=xargs)
    assert f"request {bad.request_id} refused: token 20 is outside int32" in caplog.text
    ok = h.add("alice", PROMPT)
    box = RefusalBox.from_env()
    assert (box.directory / ref).exists()
    h.run()
    assert h.finished[bad.request_id] == "error" and h.outputs[bad.request_id] == []
    assert h.finished[ok.request_id] == "length"
    assert box.take(ref) == EngineRefusal(
        400, "invalid_request_error", "token 20 is outside int32 (vLLM's token id type)"
    )
    assert h.fence.counters.identity_rejected == {}
    h.check()


def test_guaranteed_blocks_are_never_reclaimed_by_others(tmp_path: Path) -> None:
    # 24 usable blocks; bob is guaranteed 8 and caches 5 (4 full prompt blocks + 1).
    h = Harness(tmp_path, num_blocks=25, quotas={"bob": {"guaranteedBlocks": 8}})
    h.add("bob", PROMPT + list(range(10)), max_tokens=2)
    h.run()
    bob = h.fence.book.accounts["bob"]
    cached = len(bob.cold)
    assert cached >= 4
    # alice wants everything that is obtainable: 24 - bob's 8 (his cached ones count toward them).
    assert h.pool.free_count.num_free_blocks == 24  # the pool counts every free and cached block
    assert h.fence.obtainable("alice", 24) == 24 - 8
    for i in range(4):
        h.add("alice", [7000 + 100 * i + t for t in range(60)], max_tokens=4)
        h.run()
        h.check()
    assert len(bob.cold) == cached  # none of bob's cached blocks was evicted
    assert h.fence.counters.evictions_cross == 0
    b2 = h.add("bob", PROMPT + list(range(10)), max_tokens=2)
    assert h.hits(h.step(), b2.request_id) == 64
    h.run()


def test_cold_blocks_beyond_a_guarantee_are_reclaimed_and_counted_cross(tmp_path: Path) -> None:
    h = Harness(tmp_path, num_blocks=17, quotas={"bob": {"guaranteedBlocks": 2}})
    h.add("bob", PROMPT + list(range(10)), max_tokens=2)
    h.run()
    bob = h.fence.book.accounts["bob"]
    assert len(bob.cold) >= 4
    h.add("alice", [7000 + t for t in range(200)], max_tokens=4)  # 13 blocks of 16 usable
    h.run()
    h.check()
    assert h.fence.counters.evictions_cross >= 1
    assert bob.usage >= 2  # never below the guarantee


def test_a_stale_lookup_is_refused_and_counted(tmp_path: Path) -> None:
    h = Harness(tmp_path, num_blocks=9)
    h.add("alice", [*PROMPT, 1], max_tokens=1)
    h.run()
    mgr = h.sched.kv_cache_manager
    req = h.make("alice", [*PROMPT, 2])
    blocks, n, _ = mgr.get_computed_blocks(req)
    assert n == 64
    # Between lookup and use, another allocation evicts and reuses the looked-up blocks.
    h.add("bob", [9000 + t for t in range(120)], max_tokens=1)
    h.run()
    assert h.fence.generation(blocks.blocks[0][0].block_id) > 0
    got = mgr.allocate_slots(req, req.num_tokens - n, n, blocks)
    assert got is None
    assert h.fence.counters.stale_reference == 1
    h.check()


def test_a_lookup_whose_blocks_were_freed_before_use_is_refused(tmp_path: Path) -> None:
    # Nothing handed out in between, but the looked-up blocks lost their cache entries and were freed.
    h = Harness(tmp_path)
    h.add("alice", [*PROMPT, 1], max_tokens=1)
    h.run()
    mgr = h.sched.kv_cache_manager
    req = h.make("alice", [*PROMPT, 2])
    blocks, n, _ = mgr.get_computed_blocks(req)
    assert n == 64
    ids = {b.block_id for b in blocks.blocks[0]}
    h.pool.evict_blocks(ids)
    assert all(h.fence.state(i).name == "FREE" for i in ids)
    assert mgr.allocate_slots(req, req.num_tokens - n, n, blocks) is None
    assert h.fence.counters.stale_reference == 1
    h.check()


def test_an_unmoved_lookup_is_taken_without_a_stale_count(tmp_path: Path) -> None:
    # The common case: vLLM takes the blocks right after the lookup; a copy of the hit list (not the
    # object the lookup returned) is checked block by block and passes too.
    h = Harness(tmp_path)
    h.add("alice", [*PROMPT, 1], max_tokens=1)
    h.run()
    mgr = h.sched.kv_cache_manager
    for copy_blocks in (False, True):
        req = h.make("alice", [*PROMPT, 2])
        blocks, n, _ = mgr.get_computed_blocks(req)
        if copy_blocks:
            blocks = mgr.create_kv_cache_blocks((list(blocks.blocks[0]),))
        assert mgr.allocate_slots(req, req.num_tokens - n, n, blocks) is not None
        mgr.free(req)
    assert h.fence.counters.stale_reference == 0
    h.check()


def test_the_fence_keeps_its_state_on_vllms_own_blocks(tmp_path: Path) -> None:
    # The pool builds vLLM's blocks with the fence's fields; the fence's blocks are those very
    # objects, so what vLLM hands out, holds and frees is what the fence accounts.
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvfence.isolation.blocks import BlockState
    from kvfence.vllm.block_pool import FencedKVCacheBlock

    h = Harness(tmp_path)
    assert all(type(b) is FencedKVCacheBlock for b in h.pool.blocks)
    assert all(isinstance(b, KVCacheBlock) for b in h.pool.blocks)
    assert h.fence.pool.blocks is h.pool.blocks
    assert h.pool.null_block is h.pool.blocks[0] and h.fence.state(0) is BlockState.ACTIVE
    r = h.add("alice", [*PROMPT, 1], max_tokens=8)
    h.step()
    held = h.sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[r.request_id]
    assert held and all(b.state is BlockState.ACTIVE and b.owner == "alice" for b in held)
    assert all(b.in_list is None for b in held)
    h.run()
    cached = [b for b in held if b.block_hash is not None]
    assert cached and all(b.state is BlockState.COLD for b in cached)
    assert all(b.in_list is h.fence.book.accounts["alice"].cold for b in cached)
    # in vLLM's eviction order: a finished request's blocks are freed tail first
    assert [b.block_id for b in h.fence.book.accounts["alice"].cold] == [b.block_id for b in reversed(cached)]
    h.check()


def test_vllms_free_queue_is_the_fences(tmp_path: Path) -> None:
    # vLLM's doubly linked free queue is replaced by a count; a vLLM path the fence does not cover
    # (one that would move blocks in that queue) fails, naming itself, instead of running unfenced.
    from kvfence.vllm.block_pool import FenceFreeCount, TenantFreeCount
    from kvfence.vllm.fence import FenceError

    h = Harness(tmp_path)
    assert isinstance(h.pool.free_block_queue, FenceFreeCount)
    assert h.pool.free_block_queue is h.pool.free_count  # no quotas: vLLM's own count answers
    assert h.pool.get_num_free_blocks() == 63
    r = h.add("alice", [*PROMPT, 1], max_tokens=8)
    h.step()
    held = h.sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[r.request_id]
    assert len(held) == 5
    assert h.pool.get_num_free_blocks() == 63 - len(held)
    with pytest.raises(FenceError, match="append_n"):
        h.pool.unpin_blocks([held[-1]], lambda block: None)
    held[-1].ref_cnt += 1  # undo what vLLM's unpin_blocks did before it failed
    h.pool._reuse_watchers.clear()
    h.run()
    assert h.pool.get_num_free_blocks() == 63
    # Every method of vLLM's queue is refused by name (a vLLM that grows one fails this test).
    import inspect

    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    methods = [
        n for n, _ in inspect.getmembers(FreeKVCacheBlockQueue, inspect.isfunction) if not n.startswith("_")
    ]
    assert methods
    for unlimited in (True, False):  # the count, and the per-tenant count quotas put in its place
        h.pool.set_quota_mode(unlimited)
        queue = h.pool.free_block_queue
        assert isinstance(queue, FenceFreeCount if unlimited else TenantFreeCount)
        for name in methods:
            with pytest.raises(FenceError, match=name):
                getattr(queue, name)()
        with pytest.raises(AttributeError):
            queue.fake_free_list_head  # noqa: B018 - anything else is plainly absent


def test_a_maximum_set_on_an_unlimited_engine_applies_at_once(tmp_path: Path) -> None:
    # Without quotas the pool answers vLLM's free count without asking the fence; the first maximum
    # written turns that off at the next reload.
    h = Harness(tmp_path)
    assert h.pool.unlimited and h.pool.get_num_free_blocks() == 63
    time.sleep(0.01)
    h.write_quotas({"alice": {"maxBlocks": 6}})
    h.sched._next_reload = 0
    h.step()
    assert not h.pool.unlimited
    # vLLM's own get_num_free_blocks now answers for the tenant being allocated for.
    h.pool.tenant_of["probe"], h.pool.rid = "alice", "probe"
    assert h.pool.get_num_free_blocks() == 6 and h.pool.free_count.num_free_blocks == 63
    del h.pool.tenant_of["probe"]
    h.add("alice", [*PROMPT, *PROMPT, 1])  # 9 blocks: more than alice may now hold
    h.add("bob", [*PROMPT, *PROMPT, 1])  # no maximum
    h.run()
    assert h.fence.counters.quota_rejected == {"alice": 1}
    h.write_quotas({})
    time.sleep(0.01)
    h.sched._next_reload = 0
    h.step()
    assert h.pool.unlimited
    assert h.pool.free_block_queue is h.pool.free_count


def test_quota_changes_apply_without_a_restart(tmp_path: Path) -> None:
    h = Harness(tmp_path, quotas={"alice": {"maxBlocks": 6}})
    assert h.fence.book.accounts["alice"].max_blocks == 6
    time.sleep(0.01)
    h.write_quotas({"alice": {"maxBlocks": 9, "guaranteedBlocks": 2}})
    h.sched._next_reload = 0
    h.step()
    acct = h.fence.book.accounts["alice"]
    assert (acct.max_blocks, acct.guaranteed) == (9, 2)
    # An impossible config (guarantees beyond the pool) is refused; the last one stays.
    h.write_quotas({"alice": {"maxBlocks": 9, "guaranteedBlocks": 200}})
    h.sched._next_reload = 0
    h.step()
    assert h.fence.book.accounts["alice"].guaranteed == 2


def test_the_stats_file_carries_the_counters(tmp_path: Path) -> None:
    h = Harness(tmp_path, hash_fn=weak_hash)
    h.add("alice", [*PROMPT, 1])
    h.run()
    h.add("alice", [t + 1000 if i % 16 >= 8 else t for i, t in enumerate(PROMPT)])
    h.run()
    h.sched.stats.write()
    data = json.loads(h.stats_path.read_text())
    assert data["hash_collision"] >= 1
    assert data["tenants"]["alice"]["cached"] >= 4
    assert data["blocks"]["total"] == 63
    assert data["blocks"]["active"] + data["blocks"]["cached"] + data["blocks"]["free"] == 63


@pytest.mark.parametrize("scope", ["TrustClass"])
def test_a_class_wide_scope_shares_between_tenants(tmp_path: Path, scope: str) -> None:
    h = Harness(tmp_path)
    salt = salt_of("ignored", scope)
    h.add("alice", [*PROMPT, 1], salt=salt)
    h.run()
    b = h.add("bob", [*PROMPT, 2], salt=salt)
    assert h.hits(h.step(), b.request_id) == 64
    h.run()
    h.check()
    assert h.fence.counters.cross_access_rejected == 0


def test_a_fence_refusal_vllm_did_not_expect_never_crashes_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # get_num_free_blocks() and take() agree by construction; if they ever did not, vLLM would raise in
    # the middle of a step and its engine core would die. The pool hands blocks out anyway and says so.
    from kvfence.isolation.quotas import PoolExhausted

    h = Harness(tmp_path)

    def refuse(acct: Any, n: int) -> Any:
        raise PoolExhausted(acct.tenant, n, 0)

    monkeypatch.setattr(h.fence, "take_for", refuse)
    r = h.add("alice", [*PROMPT, 1])
    h.run()
    assert h.finished[r.request_id] == "length"
    assert "handed out without the quota check" in caplog.text
    h.check()


def async_config() -> Any:
    """vLLM's default on GPUs: the async scheduler (CPU engines run the synchronous one)."""
    cfg = copy.copy(base_config())
    cfg.scheduler_config = copy.copy(cfg.scheduler_config)
    cfg.scheduler_config.async_scheduling = True
    return cfg


def test_vllms_async_scheduler_is_fenced_the_same_way(tmp_path: Path) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    h = Harness(tmp_path, config=async_config(), quotas={"alice": {"maxBlocks": 6}})
    assert isinstance(h.sched, AsyncScheduler)
    assert isinstance(h.sched.kv_cache_manager, FencedKVCacheManager)
    h.add("alice", [*PROMPT, 1])
    h.run()
    again = h.add("alice", [*PROMPT, 2])
    other = h.add("bob", [*PROMPT, 3])
    out = h.step()
    assert h.hits(out, again.request_id) == 64 and h.hits(out, other.request_id) == 0
    h.run()
    a = [h.add("alice", [t + 200 * i for t in PROMPT], max_tokens=16) for i in range(3)]
    b = h.add("bob", [t + 5000 for t in PROMPT], max_tokens=16)
    scheduled = set(h.step().num_scheduled_tokens)
    assert a[0].request_id in scheduled and b.request_id in scheduled
    assert a[1].request_id not in scheduled
    for _ in range(300):
        if not h.sched.has_requests():
            break
        h.step()
        h.check()
    assert all(h.finished[r.request_id] == "length" for r in [*a, b])


def test_a_tenant_above_a_lowered_maximum_is_handed_only_the_blocks_its_request_needs(tmp_path: Path) -> None:
    # Its maximum lowered below what it holds cold (a quota change without a restart): the next
    # allocation evicts its own cold blocks down to the maximum, the surplus becomes clean free blocks
    # (out of vLLM's prefix cache too), and the request gets what it needs. Real vLLM crashed its
    # worker here when the fence handed a 1-block request every evicted block.
    h = Harness(tmp_path)
    for base in (100, 300):
        h.add("alice", [*range(base, base + 64), 1])  # 4 full blocks each, cached when finished
        h.run()
    h.check()
    alice = h.fence.book.accounts["alice"]
    assert len(alice.cold) == 8 and alice.usage == 8
    time.sleep(0.01)
    h.write_quotas({"alice": {"maxBlocks": 3}})
    h.sched._next_reload = 0
    free_before = h.pool.free_count.num_free_blocks  # the pool's count (clean and cached)
    r = h.add("alice", list(range(500, 520)), max_tokens=4)  # 24 tokens at most: 2 blocks
    h.step()
    blocks = h.sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[r.request_id]
    assert len(blocks) == 2, [b.block_id for b in blocks]
    assert alice.max_blocks == 3 and alice.usage == 3 and len(alice.cold) == 1
    assert h.fence.counters.evictions_own == 7  # 5 shed to the free list, 2 handed out
    assert h.pool.free_count.num_free_blocks == free_before - 2
    h.check()  # the shed blocks are free in vLLM's pool and out of its prefix cache, as in the shadow
    h.run()
    h.check()
    assert h.finished[r.request_id] == "length"


def test_requests_a_lowered_maximum_can_never_fit_are_cut_or_refused_never_left_waiting(
    tmp_path: Path,
) -> None:
    # carol's maximum lowered (8 -> 3 blocks) while one of her requests runs and another waits for
    # room, both reaching 7 blocks: without a cut the waiting one would be held back forever, and the
    # running one, preempted at the new maximum, too. Both finish.
    h = Harness(tmp_path, quotas={"carol": {"maxBlocks": 8}})
    first = h.add("carol", list(range(2000, 2020)), max_tokens=80)  # reaches 100 tokens: 7 blocks
    second = h.add("carol", list(range(3000, 3020)), max_tokens=80)
    h.step()
    assert first.request_id in h.fence.admitted and second.request_id not in h.fence.admitted
    time.sleep(0.01)
    h.write_quotas({"carol": {"maxBlocks": 3}})
    h.sched._next_reload = 0
    h.run()
    h.check()
    # The waiting one is cut to fit the new maximum (3 blocks of 16: 28 tokens after its 20).
    assert h.finished[second.request_id] == "length"
    assert len(h.outputs[second.request_id]) == 3 * 16 - 20
    # The running one either finished within it or, preempted holding more than fits, was refused.
    assert h.finished[first.request_id] in ("length", "error"), h.finished[first.request_id]
    carol = h.fence.book.accounts.get("carol")
    assert carol is None or carol.active == 0


def test_vllm_passes_computed_blocks_only_for_waiting_requests(tmp_path: Path) -> None:
    # The fence admits a request on the allocate_slots call that takes it out of vLLM's waiting queue
    # and tells that call from a running request's by new_computed_blocks (kvfence.vllm.kv_cache_manager's
    # prologue): vLLM passes it for every waiting request (its prefix hit, empty or not) and for no
    # running one. A pool too small for everyone makes vLLM preempt, so preempted requests come back
    # through the waiting queue too.
    from vllm.v1.request import RequestStatus

    h = Harness(tmp_path, num_blocks=24)
    mgr: Any = h.sched.kv_cache_manager
    fenced = mgr.allocate_slots
    calls: list[tuple[RequestStatus, bool]] = []

    def recording(request: Any, *args: Any, **kwargs: Any) -> Any:
        computed = kwargs.get("new_computed_blocks", args[2] if len(args) > 2 else None)
        calls.append((request.status, computed is not None))
        return fenced(request, *args, **kwargs)

    mgr.allocate_slots = recording
    reqs = [h.add(t, [*PROMPT, i], max_tokens=48) for i, t in enumerate(["alice", "bob"] * 3)]
    preempted = 0
    for _ in range(500):
        if not h.sched.has_requests():
            break
        preempted += len(h.step().preempted_req_ids or ())
        h.check()
    assert all(h.finished[r.request_id] == "length" for r in reqs)
    assert preempted > 0  # the waiting queue saw preempted requests come back
    running = {c for s, c in calls if s == RequestStatus.RUNNING}
    waiting = {c for s, c in calls if s in (RequestStatus.WAITING, RequestStatus.PREEMPTED)}
    assert running == {False} and waiting == {True}
    assert {s for s, _ in calls} <= {RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED}


def test_an_allocation_for_a_request_never_admitted_is_charged_and_admitted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Never expected (vLLM allocates for a running request only after it left the waiting queue): the
    # pool charges the request's tenant all the same and admits it, so its books close at its end.
    h = Harness(tmp_path)
    a = h.add("alice", [*PROMPT, 1])
    h.step()
    rid = a.request_id
    assert rid in h.fence.admitted
    h.fence.release(rid)  # as if vLLM had never taken it through the waiting queue
    h.pool.rid = rid
    before = h.fence.account("alice").usage
    with caplog.at_level("ERROR", logger="kvfence.vllm.block_pool"):
        blocks = h.pool.get_new_blocks(2)
    assert "allocates without having been admitted" in caplog.text
    assert rid in h.fence.admitted
    assert h.fence.account("alice").usage == before + 2
    assert all(h.fence.owner(b.block_id) == "alice" for b in blocks)
    h.pool.free_blocks(blocks)
    h.run()
    h.check()
    assert rid not in h.fence.admitted


def test_a_block_released_twice_is_refused_before_anything_moves(tmp_path: Path) -> None:
    # release_blocks checks every block (ACTIVE and owned) before it changes any: a release naming a
    # cold block fails, naming it, and leaves the request's active blocks as they were.
    from kvfence.isolation.blocks import BlockState
    from kvfence.vllm.fence import FenceError

    h = Harness(tmp_path)
    h.add("alice", [*PROMPT, 1])
    h.run()
    cold = [b.block_id for b in h.pool.blocks[1:] if h.fence.state(b.block_id) is BlockState.COLD]
    assert len(cold) >= 4
    r = h.add("bob", [t + 3000 for t in PROMPT], max_tokens=8)
    h.step()
    held = [
        b.block_id
        for b in h.sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[r.request_id]
    ]
    with pytest.raises(FenceError, match=f"block {cold[0]} released from state COLD"):
        h.fence.release_blocks([h.pool.blocks[b] for b in [*held, cold[0]]], [])
    assert all(h.fence.state(b) is BlockState.ACTIVE for b in held)
    h.check()
    h.run()
    h.check()
