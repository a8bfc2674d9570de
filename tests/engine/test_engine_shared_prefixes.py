"""Declared shared prefixes on the reference engine: pinned, exact, block-aligned, outside every quota,
and nothing private shared."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from engine.enginelib import TOKENIZER, Oracle, make_config
from engine.oracle import check_consistency
from pydantic import ValidationError

from kvfence.contract.engine_config import EngineConfig
from kvfence.engine.engine import Engine, Failed, Finished
from kvfence.isolation.quotas import SHARED_OWNER
from kvfence.isolation.shared_prefixes import render

BS = 16
SYSTEM = (
    "You are the support assistant of a company that sells garden tools. Answer in two sentences, "
    "never promise refunds, and point to the manual for anything about assembly. "
)  # ~190 bytes: 12 full blocks of 16 once rendered
TOOLS = "Tools: search(query), order_status(id). Call a tool with a JSON object on one line. " * 2


def shared_config(**over: Any) -> EngineConfig:
    prefixes = [
        {"name": "support", "form": "completion", "text": SYSTEM},
        {"name": "support-chat", "form": "chat", "text": SYSTEM},
        {"name": "tools", "form": "completion", "text": TOOLS},
    ]
    base: dict[str, Any] = {"numBlocks": 256, "prefixCache": {"scope": "Tenant", "sharedPrefixes": prefixes}}
    return make_config(**{**base, **over})


def prompt(text: str) -> np.ndarray[Any, Any]:
    return TOKENIZER.encode(text)


def gen(
    engine: Engine, tenant: str, text: str, max_tokens: int = 4, adapter: str = ""
) -> tuple[list[int], int]:
    out, end = engine.generate(tenant, prompt(text), max_tokens, adapter=adapter)
    assert isinstance(end, Finished), end
    return out, end.cached_tokens


def shared_blocks(text: str) -> int:
    return len(prompt(text)) // BS


def test_every_tenant_hits_the_declared_prefix_on_its_first_request_and_outputs_match_cold() -> None:
    cfg = shared_config()
    engine, oracle = Engine(cfg), Oracle(cfg)
    n = shared_blocks(SYSTEM)
    assert n >= 10
    for tenant, suffix in [("acme", "How do I sharpen shears?"), ("beta", "Where is my order 12?")]:
        text = SYSTEM + suffix
        out, cached = gen(engine, tenant, text)
        assert cached == n * BS, tenant  # the very first request of each tenant: a hit
        assert out == oracle.tokens(prompt(text), 4)  # bit-identical to a cold computation
    # with an adapter: the adapter's own pinned copy (an adapter changes the KV of the prefix)
    out, cached = gen(engine, "acme", SYSTEM + "Hi", adapter="bot")
    assert cached == n * BS
    assert out == oracle.tokens(prompt(SYSTEM + "Hi"), 4, adapter="bot")
    m = engine.metrics
    assert m.value("kvfence_engine_shared_prefix_hits_total") == 3 * n * BS
    assert m.value("kvfence_engine_shared_prefixes_pinned") == 3 * 2  # three prefixes x two models
    assert m.value("kvfence_engine_kv_blocks_pinned") == engine.shared.num_blocks
    check_consistency(engine.allocator)


def test_chat_form_is_shared_by_chat_requests_that_start_with_that_system_message() -> None:
    engine = Engine(shared_config())
    chat = TOKENIZER.chat_prompt([("system", SYSTEM), ("user", "Can I return a rake?")])
    decl = engine.config.prefix_cache.shared_prefixes[1]
    rendered = render(decl, TOKENIZER)
    assert TOKENIZER.decode(rendered) == TOKENIZER.decode(prompt(chat))[: len(rendered) - 1]
    _, cached = gen(engine, "acme", chat)
    assert cached == len(rendered) // BS * BS
    # the same text as a completion prompt is the other declaration, not the chat one
    _, cached = gen(engine, "acme", SYSTEM + "Can I return a rake?")
    assert cached == shared_blocks(SYSTEM) * BS


def test_private_suffixes_are_never_shared_and_the_owner_keeps_its_own() -> None:
    engine = Engine(shared_config())
    n = shared_blocks(SYSTEM)
    secret = SYSTEM + "My account number is 4242-1111-2222 and my address is 9 Elm Street, Springfield."
    _, cached = gen(engine, "acme", secret)
    assert cached == n * BS
    _, again = gen(engine, "acme", secret)
    assert again > n * BS  # acme's own private blocks after the shared part are acme's hits
    # beta sends acme's whole prompt: only the declared part is a hit (as for a cold tenant)
    _, cached_b = gen(engine, "beta", secret)
    _, cached_cold = gen(engine, "gamma", SYSTEM + "x" * (len(secret) - len(SYSTEM)))
    assert cached_b == cached_cold == n * BS
    # ownership: every block after the shared part is charged to the tenant that computed it
    a = engine.allocator
    owners = {b.owner for b in a.pool.blocks if b.block_hash is not None}
    assert owners <= {"acme", "beta", "gamma", SHARED_OWNER}
    for b in a.pool.blocks:
        if b.context is not None and b.context.namespace.startswith("shared/"):
            assert b.owner == SHARED_OWNER
        elif b.context is not None:
            assert b.owner != SHARED_OWNER and b.context.namespace.endswith("/" + str(b.owner))
    assert engine.metrics.value("kv_cache_tenant_cross_access_rejected_total") == 0
    check_consistency(a)


def test_a_prefix_with_one_token_changed_or_cut_short_shares_nothing() -> None:
    engine = Engine(shared_config())
    before = engine.metrics.value("kvfence_engine_shared_prefix_hits_total")
    changed = SYSTEM.replace("garden", "Garden", 1) + "Hello there, what are your hours?"
    _, cached = gen(engine, "acme", changed)
    assert cached == 0
    partial = SYSTEM[: len(SYSTEM) // 2] + "... and hello"
    _, cached = gen(engine, "beta", partial)
    assert cached == 0
    assert engine.metrics.value("kvfence_engine_shared_prefix_hits_total") == before


def test_pinned_blocks_are_outside_quotas_and_eviction() -> None:
    n = shared_blocks(SYSTEM)
    # acme may hold only 4 blocks of its own: the 12 shared ones are not charged to it
    cfg = shared_config(numBlocks=96, quotas={"tenants": {"acme": {"maxBlocks": 4}}})
    engine = Engine(cfg)
    pinned = engine.allocator.num_pinned
    assert pinned == engine.shared.num_blocks > n
    _, cached = gen(engine, "acme", SYSTEM + "Short question?")
    assert cached == n * BS
    assert engine.allocator.book.accounts["acme"].usage <= 4
    # fill the pool with another tenant's traffic many times over: pinned blocks never go cold
    for i in range(40):
        gen(engine, "beta", f"{i} " + hashlib.sha256(str(i).encode()).hexdigest() * 3)
    assert engine.allocator.num_pinned == pinned
    _, cached = gen(engine, "gamma", SYSTEM + "Still there?")
    assert cached == n * BS
    check_consistency(engine.allocator)


def test_a_forced_collision_with_a_private_block_is_refused_and_counted() -> None:
    def blind(parent: bytes, payload: bytes | memoryview) -> bytes:  # keys ignore the chain (namespace)
        return hashlib.sha256(bytes(payload)).digest()

    one = {"sharedPrefixes": [{"name": "support", "form": "completion", "text": SYSTEM}]}
    engine = Engine(shared_config(adapters=[], prefixCache=one), hash_fn=blind)
    secret = SYSTEM + "The launch code is 0000 and the vault is behind the painting."
    gen(engine, "acme", secret)
    _, cached = gen(engine, "beta", secret)
    assert cached == shared_blocks(SYSTEM) * BS
    m = engine.metrics
    refused = m.value("kv_cache_tenant_cross_access_rejected_total") + m.value(
        "kv_cache_hash_collision_total"
    )
    assert refused >= 1
    check_consistency(engine.allocator)


def test_changing_the_declared_list_repins_without_a_restart() -> None:
    engine = Engine(shared_config())
    old_blocks = engine.allocator.num_pinned
    new = [{"name": "tools", "form": "completion", "text": TOOLS}]
    decls = EngineConfig.model_validate(
        {**engine.config.model_dump(by_alias=True), "prefixCache": {"sharedPrefixes": new}}
    ).prefix_cache.shared_prefixes
    engine.set_shared_prefixes(decls)
    engine.run_until_idle()  # the scheduler applies it before its next step
    assert [p.name for p in engine.shared.pinned] == ["tools", "tools"]
    assert engine.allocator.num_pinned == engine.shared.num_blocks < old_blocks
    _, cached = gen(engine, "acme", SYSTEM + "Hi")
    assert cached == 0  # no longer declared: nothing shared
    _, cached = gen(engine, "acme", TOOLS + "search(rake)")
    assert cached == shared_blocks(TOOLS) * BS
    check_consistency(engine.allocator)


def test_validation_names_the_bad_entry_and_an_unpinnable_list_fails_the_engine() -> None:
    with pytest.raises(ValidationError, match="support"):
        shared_config(
            prefixCache={
                "sharedPrefixes": [
                    {"name": "support", "form": "chat", "text": "a"},
                    {"name": "support", "form": "completion", "text": "b"},
                ]
            }
        )
    with pytest.raises(ValidationError, match="form"):
        make_config(prefixCache={"sharedPrefixes": [{"name": "x", "form": "system", "text": "a"}]})
    with pytest.raises(ValidationError, match="name"):
        make_config(prefixCache={"sharedPrefixes": [{"name": "Bad Name", "form": "chat", "text": "a"}]})
    with pytest.raises(
        ValueError, match=r"cannot pin shared prefix 'support-chat' \(model 'tiny'\): KV cache exhausted"
    ):
        Engine(shared_config(numBlocks=30))  # 'support' (12 blocks) twice fits, 'support-chat' does not
    with pytest.raises(ValueError, match="prefix cache"):
        Engine(
            make_config(
                prefixCache={"enabled": False, "sharedPrefixes": [{"name": "a", "form": "chat", "text": "x"}]}
            )
        )


def test_a_tenant_request_that_fails_keeps_pinned_blocks_intact() -> None:
    engine = Engine(shared_config(quotas={"tenants": {"acme": {"maxBlocks": 1}}}))
    pinned = engine.allocator.num_pinned
    _, end = engine.generate("acme", prompt(SYSTEM + "x" * 100), 8)
    assert isinstance(end, Failed) and (end.status, end.code) == (400, "max_kv_blocks_exceeded")
    assert engine.allocator.num_pinned == pinned
    check_consistency(engine.allocator)


def test_the_oracle_accepts_pinned_blocks_in_a_running_tenants_table_and_nothing_else_shared() -> None:
    engine = Engine(shared_config())
    a = engine.allocator
    p = prompt(SYSTEM + "What about hoses?")
    pin = engine.shared.match("", p)
    assert pin is not None
    got = a.allocate_sequence(
        "live",
        "acme",
        len(p) + 4,
        ctx=engine.context(engine.expected_namespace("acme"), ""),
        prompt=p,
        shared=pin,
    )
    assert got.num_cached_tokens == pin.num_blocks * BS
    acc = check_consistency(a)  # a running sequence holding pinned blocks of the shared namespace
    assert acc.sequences == 1 + len(engine.shared)
    a.release("live")
    check_consistency(a)
