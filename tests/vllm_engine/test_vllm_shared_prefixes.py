"""Declared shared prefixes inside vLLM's real scheduler: computed by the plugin's own
requests at the first step, pinned outside every quota and eviction, a hit for every tenant whose prompt
begins with one token for token, and the tenant's own namespace from the next block on."""

from __future__ import annotations

from pathlib import Path

from vllm_engine.vllmsched import Harness, salt_of

from kvfence.isolation.blocks import BlockState
from kvfence.isolation.quotas import SHARED_OWNER
from kvfence.vllm.scheduler import render_prefix

SYSTEM = (
    "You are the support assistant of a company that sells garden tools. Answer in two sentences, "
    "never promise refunds, and point to the manual for anything about assembly. "
) * 2
DECLARED = [
    {"name": "support", "form": "completion", "text": SYSTEM},
    {"name": "support-chat", "form": "chat", "text": SYSTEM},
]


def pinned(tmp_path: Path, **kw: object) -> Harness:
    h = Harness(tmp_path, num_blocks=128, shared=DECLARED, **kw)  # type: ignore[arg-type]
    h.step()  # the first step computes the declared prefixes (the plugin's own requests)
    h.run()
    assert sorted(p.name for p in h.fence.shared) == ["support", "support-chat"]
    return h


def prefix_tokens(h: Harness, name: str) -> list[int]:
    return list(next(p for p in h.fence.shared if p.name == name).tokens)


def test_declared_prefixes_are_pinned_outside_every_tenant_and_never_reach_a_client(tmp_path: Path) -> None:
    h = pinned(tmp_path)
    for pin in h.fence.shared:
        assert pin.num_blocks == len(pin.tokens) // 16 >= 4
        for bid in pin.block_ids:
            assert h.fence.state(bid) is BlockState.ACTIVE and h.fence.owner(bid) == SHARED_OWNER
            assert h.pool.blocks[bid].ref_cnt == 1
    assert not any(rid.startswith("kvfence-shared-") for rid in h.outputs)  # nobody's output
    snap = h.fence.snapshot()
    assert snap["blocks"]["pinned"] == sum(p.num_blocks for p in h.fence.shared)
    assert SHARED_OWNER not in snap["tenants"]
    h.check()


def test_every_tenant_hits_the_declared_part_and_nothing_private(tmp_path: Path) -> None:
    h = pinned(tmp_path)
    shared = prefix_tokens(h, "support")
    n = len(shared) // 16
    secret = [*shared, *range(3000, 3040)]  # the declared prefix + 40 private tokens
    a = h.add("alice", [*secret, 1])
    assert h.hits(h.step(), a.request_id) == n * 16  # even alice's first request
    h.run()
    a2 = h.add("alice", [*secret, 2])
    assert h.hits(h.step(), a2.request_id) > n * 16  # her own private blocks after it
    h.run()
    b = h.add("bob", [*secret, 3])  # bob sends alice's private text: the declared part only
    assert h.hits(h.step(), b.request_id) == n * 16
    h.run()
    c = h.add("carol", [*shared, *range(5000, 5040), 4])  # a prompt nobody sent: the same
    assert h.hits(h.step(), c.request_id) == n * 16
    h.run()
    counters = h.fence.counters
    assert (counters.hash_collision, counters.cross_access_rejected) == (0, 0)
    assert counters.shared_hit_tokens == 4 * n * 16
    h.check()


def test_one_token_changed_or_a_partial_prefix_shares_nothing(tmp_path: Path) -> None:
    h = pinned(tmp_path)
    shared = prefix_tokens(h, "support")
    changed = [*shared[:20], shared[20] + 1, *shared[21:], *range(3000, 3020)]
    a = h.add("alice", changed)
    assert h.hits(h.step(), a.request_id) == 0
    partial = [*shared[: len(shared) // 2], *range(4000, 4020)]
    b = h.add("bob", partial)
    assert h.hits(h.step(), b.request_id) == 0
    h.run()
    assert h.fence.counters.shared_hit_tokens == 0
    h.check()


def test_the_chat_form_is_what_vllms_chat_template_renders(tmp_path: Path) -> None:
    h = pinned(tmp_path)
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    tok = cached_tokenizer_from_config(h.sched.vllm_config.model_config)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Can I return a rake?"}]
    chat = tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert prefix_tokens(h, "support-chat") == render_prefix(tok, "chat", SYSTEM)
    assert chat[: len(prefix_tokens(h, "support-chat"))] == prefix_tokens(h, "support-chat")
    r = h.add("alice", list(chat))
    assert h.hits(h.step(), r.request_id) == len(prefix_tokens(h, "support-chat")) // 16 * 16
    h.run()
    h.check()


def test_pinned_blocks_survive_pool_pressure_and_are_outside_quotas(tmp_path: Path) -> None:
    h = pinned(tmp_path, quotas={"alice": {"maxBlocks": 3}})
    shared = prefix_tokens(h, "support")
    n = len(shared) // 16
    assert n > 3  # alice's maximum is smaller than the shared part: it is not charged to her
    a = h.add("alice", [*shared, *range(3000, 3010)], max_tokens=2)
    assert h.hits(h.step(), a.request_id) == n * 16
    h.run()
    assert h.finished[a.request_id] == "length"
    ids = {b for p in h.fence.shared for b in p.block_ids}
    for i in range(30):  # fill the pool many times over with another tenant's prompts
        h.add("bob", [*range(10000 + 100 * i, 10000 + 100 * i + 90)], max_tokens=2)
        h.run()
    for bid in ids:
        assert h.fence.state(bid) is BlockState.ACTIVE and h.fence.owner(bid) == SHARED_OWNER
    c = h.add("carol", [*shared, *range(6000, 6010)])
    assert h.hits(h.step(), c.request_id) == n * 16
    h.run()
    h.check()


def test_a_salt_the_router_derives_never_names_the_shared_namespace(tmp_path: Path) -> None:
    from kvfence.vllm.scheduler import shared_salt

    assert "/" in shared_salt("gold") and "/" not in salt_of("alice")


def test_a_new_declaration_is_pinned_without_a_restart_and_the_old_one_released(tmp_path: Path) -> None:
    import time

    h = pinned(tmp_path)
    old = {p.name: p for p in h.fence.shared}
    tools = "Tools: search(query), order_status(id), refund(id). Call one with a JSON object per line. " * 3
    h.shared = [DECLARED[0], {"name": "tools", "form": "completion", "text": tools}]  # support-chat dropped
    h.write_quotas({})
    h.sched._next_reload = time.monotonic()  # the plugin checks the file once a second
    h.step()
    h.run()
    h.step()  # the step after the new pins are in: the retired one is released
    names = sorted(p.name for p in h.fence.shared)
    assert names == ["support", "tools"]
    assert next(p for p in h.fence.shared if p.name == "support") is old["support"]  # kept, not recomputed
    for bid in old["support-chat"].block_ids:  # released: a cached block of the shared namespace
        assert h.pool.blocks[bid].ref_cnt == 0 and h.fence.state(bid) is BlockState.COLD
    t = prefix_tokens(h, "tools")
    r = h.add("alice", [*t, *range(3000, 3020)])
    assert h.hits(h.step(), r.request_id) == len(t) // 16 * 16
    h.run()
    h.check()


def test_a_forced_collision_after_the_shared_part_is_refused_and_counted(tmp_path: Path) -> None:
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm_engine.vllmsched import weak_hash

    h = Harness(tmp_path, num_blocks=128, shared=DECLARED[:1], hash_fn=weak_hash)
    # The plugin hashes with the engine's algorithm; here with the weak one too, which ignores the salt:
    # bob's first block after the shared part then has alice's key.
    init_none_hash(weak_hash)
    h.sched._hash_fn = weak_hash
    h.sched._hasher = get_request_block_hasher(16, weak_hash)
    h.step()
    h.run()
    shared = prefix_tokens(h, "support")
    n = len(shared) // 16
    secret = [*shared, *range(3000, 3040)]
    h.add("alice", [*secret, 1])
    h.run()
    before = h.fence.counters.cross_access_rejected
    b = h.add("bob", [*secret, 2])
    assert h.hits(h.step(), b.request_id) == n * 16  # the declared part, not one block of alice's
    assert h.fence.counters.cross_access_rejected == before + 1
    h.run()
    h.check()
