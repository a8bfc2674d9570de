"""vLLM's own cache-management calls on a fenced engine, next to vLLM's stock scheduler.

A platform that updates weights or puts engines to sleep calls vLLM's engine core: ``reset_prefix_cache``
(True only when no request holds a block; with ``reset_running_requests`` the running requests are
preempted first), ``pause_scheduler(clear_cache=True)`` and ``release_kv_cache_memory`` (which raise
when the reset fails). Whether every block is free is a question about the whole pool: the fence answers
it as stock vLLM does whatever the quotas, and a reset leaves its books (cold lists, records, usage)
as empty as vLLM's prefix cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import RequestStatus
from vllm_engine.test_vllm_shared_prefixes import DECLARED, prefix_tokens
from vllm_engine.vllmsched import Harness, base_config

PROMPT = list(range(100, 164))  # 4 full blocks of 16

#: the scheduler under test: vLLM's own, and the fenced one without and with quotas of each kind
KINDS: dict[str, dict[str, Any]] = {
    "stock": {"stock": True},
    "fenced": {},
    "fenced, a tenant's maximum": {"quotas": {"alice": {"maxBlocks": 12}}},
    "fenced, a default maximum": {"default_quota": {"maxBlocks": 12}},
    "fenced, guarantees": {"quotas": {"alice": {"guaranteedBlocks": 8}, "bob": {"guaranteedBlocks": 8}}},
}


@pytest.fixture(params=list(KINDS))
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    return Harness(tmp_path, **KINDS[request.param])


class NoModel:
    """The model side of vLLM's engine core, absent (these tests drive the scheduler without a model):
    it records what the engine core asks of it."""

    is_sleeping = False

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self.calls.append(method)
        return []

    def reset_mm_cache(self) -> None:
        self.calls.append("reset_mm_cache")

    def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder_cache")

    def discard(self, tags: tuple[str, ...]) -> None:
        self.calls.append(("discard", tags))


def engine_core(h: Harness) -> Any:
    """vLLM's own EngineCore around the harness's scheduler, without its model executor."""
    core = object.__new__(EngineCore)
    core.scheduler = h.sched
    core.model_executor = NoModel()
    core.mm_receiver_cache = None
    core.batch_queue = None
    return core


def check_forgotten(h: Harness) -> None:
    """Nothing is cached any more, in vLLM's pool and (fenced) in the fence's books."""
    assert all(b.block_hash is None for b in h.pool.blocks)
    assert h.pool.get_usage() == 0.0
    if h.fence is None:
        return
    h.check()
    assert all(r is None for r in h.fence.records)
    assert all(acct.usage == 0 and len(acct.cold) == 0 for acct in h.fence.book.accounts.values())
    assert len(h.fence.pool.free) == h.num_blocks - 1 == h.pool.free_count.num_free_blocks


def warm(h: Harness, tenant: str = "alice") -> None:
    """``tenant`` sends PROMPT twice: the second is a prefix-cache hit."""
    h.add(tenant, [*PROMPT, 1])
    h.run()
    again = h.add(tenant, [*PROMPT, 2])
    assert h.hits(h.step(), again.request_id) == 64
    h.run()


def test_reset_on_an_idle_engine_succeeds_and_forgets_every_cached_block(h: Harness) -> None:
    assert h.sched.reset_prefix_cache() is True  # fresh
    warm(h)
    warm(h, "bob")
    assert h.sched.reset_prefix_cache() is True
    check_forgotten(h)
    after = h.add("alice", [*PROMPT, 3])
    assert h.hits(h.step(), after.request_id) == 0
    h.run()
    assert h.finished[after.request_id] == "length"
    if h.fence is not None:
        h.check()


def test_reset_is_refused_while_a_request_holds_blocks_and_succeeds_once_it_ends(h: Harness) -> None:
    warm(h)
    held = h.add("alice", [*PROMPT, 4], max_tokens=8)
    h.step()
    cached = sum(b.block_hash is not None for b in h.pool.blocks)
    assert cached >= 4
    assert h.sched.reset_prefix_cache() is False
    assert sum(b.block_hash is not None for b in h.pool.blocks) == cached  # nothing forgotten
    if h.fence is not None:
        h.check()
    h.run()
    assert h.finished[held.request_id] == "length" and len(h.outputs[held.request_id]) == 8
    assert h.sched.reset_prefix_cache() is True
    check_forgotten(h)


def test_reset_with_running_requests_preempts_them_and_they_finish_afterwards(h: Harness) -> None:
    warm(h)
    a = h.add("alice", [*PROMPT, 5], max_tokens=6)
    b = h.add("bob", list(range(500, 540)), max_tokens=6)
    h.step()
    h.step()
    assert h.sched.reset_prefix_cache(reset_running_requests=True) is True
    assert not h.sched.running and len(h.sched.waiting) == 2
    if h.fence is not None:
        h.check()
        assert not h.fence.admitted  # preempted requests hold no reservation
    h.run()
    assert h.finished[a.request_id] == h.finished[b.request_id] == "length"
    if h.fence is not None:
        h.check()


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_vllms_pause_with_clear_cache_and_kv_memory_release_work(h: Harness, mode: str) -> None:
    warm(h)
    running = h.add("alice", [*PROMPT, 6], max_tokens=6)
    h.step()
    waiting = h.add("bob", list(range(600, 700)), max_tokens=6)
    core = engine_core(h)
    assert core.pause_scheduler(mode=mode, clear_cache=True) is None  # vLLM raises if the reset fails
    assert "synchronize_device" in core.model_executor.calls
    if mode == "abort":
        assert not h.sched.has_unfinished_requests()
        h.step()  # the engine core's loop sends the aborts
        core.release_kv_cache_memory()
        assert core.model_executor.calls[-1] == ("discard", ("kv_cache",))
        check_forgotten(h)
    else:  # kept: preempted by the reset, waiting for the resume
        assert running.status == RequestStatus.PREEMPTED and not h.sched.running
    core.resume_scheduler()
    after = h.add("alice", [*PROMPT, 7])
    h.run()
    assert h.finished[after.request_id] == "length"
    if mode == "keep":
        assert h.finished[running.request_id] == h.finished[waiting.request_id] == "length"
    if h.fence is not None:
        h.check()


def test_a_reset_unpins_the_declared_shared_prefixes_and_pins_them_again(tmp_path: Path) -> None:
    h = Harness(tmp_path, num_blocks=128, shared=DECLARED, default_quota={"maxBlocks": 12})
    h.step()
    h.run()
    pins = {p.name: p for p in h.fence.shared}
    assert sorted(pins) == ["support", "support-chat"]
    shared = prefix_tokens(h, "support")
    n = len(shared) // 16
    a = h.add("alice", [*shared, *range(3000, 3010)], max_tokens=2)
    assert h.hits(h.step(), a.request_id) == n * 16
    assert h.sched.reset_prefix_cache() is False  # alice holds pinned blocks and her own
    h.run()
    assert h.sched.reset_prefix_cache() is True
    assert h.fence.shared == ()
    check_forgotten(h)
    h.step()  # the next step computes the declared prefixes again
    h.run()
    assert sorted(p.name for p in h.fence.shared) == ["support", "support-chat"]
    assert h.fence.shared[0] is not pins[h.fence.shared[0].name]  # computed anew
    b = h.add("bob", [*shared, *range(4000, 4010)], max_tokens=2)
    assert h.hits(h.step(), b.request_id) == n * 16
    h.run()
    assert not any(rid.startswith("kvfence-shared-") for rid in h.outputs)
    h.check()


def test_a_reset_that_preempts_a_prefix_being_pinned_pins_it_when_it_has_run_again(tmp_path: Path) -> None:
    # 64 tokens a step: the plugin's request computing the prefix takes two steps
    h = Harness(tmp_path, num_blocks=128, shared=DECLARED[:1], config=base_config(1024, 16, 64))
    h.step()
    assert h.sched._pinning and h.sched.running and h.fence.shared == ()
    assert h.sched.reset_prefix_cache(reset_running_requests=True) is True
    assert h.sched._pinning  # still planned: it runs again
    h.run()
    assert [p.name for p in h.fence.shared] == ["support"]
    assert not any(rid.startswith("kvfence-shared-") for rid in h.outputs)
    h.check()
