"""The oracle: whatever the prefix cache reuses, output is bit-identical to a cold computation."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from engine.enginelib import TOKENIZER, Oracle, make_config
from engine.oracle import check_consistency
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfence.engine.engine import Admitted, Engine, Event, Failed, Finished, Request, Token
from kvfence.engine.model import EOS, ByteTokenizer, Chunk, TinyTransformer

SYSTEMS = (
    "You are the ACME support assistant. Be brief and polite; never reveal internal tickets. ",
    "You are a legal research helper for Beta LLP. Cite nothing you cannot verify. ",
    "",
)


@functools.cache
def engines() -> tuple[Engine, Oracle]:
    cfg = make_config(numBlocks=384)
    return Engine(cfg), Oracle(cfg)


def counting(engine: Engine) -> list[int]:
    """Count the tokens the model computes (wraps forward)."""
    seen = [0]
    inner = engine.model.forward

    def forward(kv: Any, chunks: list[Chunk], adapter: str = "") -> Any:
        seen[0] += sum(len(c.tokens) for c in chunks)
        return inner(kv, chunks, adapter)

    engine.model.forward = forward  # type: ignore[method-assign]
    return seen


def collect(results: dict[str, list[Event]], rid: str) -> Any:
    def sink(ev: Event) -> None:
        results.setdefault(rid, []).append(ev)

    return sink


def tokens_of(evs: list[Event]) -> list[int]:
    return [e.token_id for e in evs if isinstance(e, Token)]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    system=st.sampled_from(SYSTEMS),
    questions=st.lists(st.text(st.characters(codec="utf-8"), max_size=40), min_size=1, max_size=4),
    tenant=st.sampled_from(["acme", "beta"]),
    adapter=st.sampled_from(["", "bot"]),
    max_tokens=st.integers(1, 12),
)
def test_warm_output_is_bit_identical_to_cold(
    system: str, questions: list[str], tenant: str, adapter: str, max_tokens: int
) -> None:
    warm, oracle = engines()
    results: dict[str, list[Event]] = {}
    prompts = {}
    for i, q in enumerate(questions):
        rid = f"{tenant}-{len(results)}-{i}-{id(questions)}"
        p = TOKENIZER.encode(system + q)
        prompts[rid] = p
        warm.submit(
            Request(
                rid,
                tenant,
                warm.context(warm.expected_namespace(tenant), adapter),
                p,
                max_tokens,
                collect(results, rid),
            )
        )
    warm.run_until_idle()  # all of them batched together
    for rid, p in prompts.items():
        evs = results[rid]
        assert isinstance(evs[0], Admitted) and isinstance(evs[-1], Finished), evs
        assert tokens_of(evs) == oracle.tokens(p, max_tokens, adapter)
    # sequentially again: now the cache is warm for every prompt
    for p in prompts.values():
        out, end = warm.generate(tenant, p, max_tokens, adapter=adapter)
        assert isinstance(end, Finished)
        if len(p) > 16:
            assert end.cached_tokens > 0
        assert out == oracle.tokens(p, max_tokens, adapter)
    check_consistency(warm.allocator)


def test_cache_hits_skip_recomputation_and_share_blocks() -> None:
    e = Engine(make_config(numBlocks=128))
    oracle = engines()[1]
    computed = counting(e)
    p = TOKENIZER.encode(SYSTEMS[0] + "How do I reset my password?")
    first, end1 = e.generate("acme", p, 8)
    assert isinstance(end1, Finished) and end1.cached_tokens == 0
    assert computed[0] == len(p) + 7  # the prompt, then each generated token but the last
    computed[0] = 0
    second, end2 = e.generate("acme", p, 8)
    assert isinstance(end2, Finished)
    assert end2.cached_tokens == (len(p) - 1) // 16 * 16
    assert computed[0] == len(p) - end2.cached_tokens + 7
    assert first == second == oracle.tokens(p, 8)
    assert e.metrics.value("kvfence_engine_prefix_cache_hits_total") == end2.cached_tokens

    # While a request runs, its cached blocks are the very blocks of the earlier request.
    seen: dict[str, list[Event]] = {}
    e.submit(Request("r", "acme", e.context(e.expected_namespace("acme"), ""), p, 4, collect(seen, "r")))
    e.step()
    table = e.allocator.block_table("r")
    cached_blocks = table[: end2.cached_tokens // 16].tolist()
    owners = {e.allocator.owner_of(b) for b in cached_blocks}
    assert owners == {"acme"}
    assert all(e.allocator.pool.blocks[b].ref_cnt == 1 for b in cached_blocks)
    e.run_until_idle()
    check_consistency(e.allocator)


def test_adapters_change_outputs_and_never_share_cache_entries() -> None:
    e = Engine(make_config(numBlocks=128))
    p = TOKENIZER.encode(SYSTEMS[1] + "Summarise the case.")
    base, _ = e.generate("acme", p, 10)
    tuned, end = e.generate("acme", p, 10, adapter="bot")
    assert base != tuned
    assert isinstance(end, Finished) and end.cached_tokens == 0  # the adapter is in the key


def test_weights_are_deterministic_and_depend_on_name_revision_and_quantization() -> None:
    p = ByteTokenizer().encode("determinism")

    def run(**kw: Any) -> tuple[list[int], bytes]:
        m = TinyTransformer("kvfence/tiny", kw.pop("revision", "1"), max_len=64, **kw)
        kv = m.new_kv_pool(8, 16)
        table = np.arange(8, dtype=np.int32)
        out = []
        logits = m.forward(kv, [Chunk(table, 0, p)])
        first = logits.tobytes()
        pos = len(p)
        for _ in range(6):
            t = int(m.greedy(logits)[0])
            out.append(t)
            logits = m.forward(kv, [Chunk(table, pos, np.array([t], dtype=np.int32))])
            pos += 1
        return out, first

    assert run() == run()
    assert run()[0] != run(revision="2")[0]
    assert run()[1] != run(quantization="int8")[1]  # int8 weights: other logits
    assert all(t == EOS or 10 <= t < 127 for t in run(dtype="float64")[0])
    with pytest.raises(ValueError, match="quantization"):
        TinyTransformer("m", "1", max_len=8, quantization="fp4")


def test_chunked_prefill_and_any_block_placement_give_the_same_tokens() -> None:
    m = TinyTransformer("kvfence/tiny", "1", max_len=128)
    p = TOKENIZER.encode(SYSTEMS[0])

    def last_logits(chunk: int, seed: int) -> Any:
        kv = m.new_kv_pool(16, 16)
        table = np.random.default_rng(seed).permutation(16).astype(np.int32)
        pos, logits = 0, None
        while pos < len(p):
            logits = m.forward(kv, [Chunk(table, pos, p[pos : pos + chunk])])
            pos += chunk
        return logits

    ref = last_logits(len(p), 0)
    for chunk, seed in ((1, 1), (7, 2), (16, 3), (33, 4)):
        assert np.array_equal(last_logits(chunk, seed), ref)


def test_requests_that_cannot_fit_fail_cleanly() -> None:
    e = Engine(make_config(numBlocks=8, quotas={"tenants": {"small": {"maxBlocks": 2}}}))
    p = TOKENIZER.encode("x" * 40)  # 41 tokens + 8 = 4 blocks
    out, end = e.generate("small", p, 8)
    # beyond the maximum however long it waits: a 400 that clients do not retry, naming the limit
    assert out == [] and isinstance(end, Failed) and (end.status, end.code) == (400, "max_kv_blocks_exceeded")
    assert "4 KV blocks" in end.message and "maximum of 2 (maxKVBlocks)" in end.message
    assert end.retry_after is None
    out, end = e.generate("big", TOKENIZER.encode("y" * 150), 8)  # 10 blocks > the pool: never fits either
    assert isinstance(end, Failed) and (end.status, end.code) == (400, "kv_cache_too_small")
    assert "needs 10 blocks" in end.message and "can never fit" in end.message and end.retry_after is None
    acc = check_consistency(e.allocator)
    assert acc.active == acc.fenced == 0 and acc.free == 8


def test_a_request_its_tenants_other_requests_keep_out_is_a_429_with_retry_after() -> None:
    e = Engine(make_config(numBlocks=16, quotas={"tenants": {"small": {"maxBlocks": 3}}}))
    ends: dict[str, list[Event]] = {"first": [], "second": []}
    for rid in ends:  # 21 tokens + 8 = 2 blocks each: each fits alone, both do not
        ctx = e.context(e.expected_namespace("small"), "")
        e.submit(Request(rid, "small", ctx, TOKENIZER.encode(rid + "y" * 14), 8, ends[rid].append))
    e.run_until_idle()
    assert isinstance(ends["first"][-1], Finished)
    refused = ends["second"][-1]
    assert isinstance(refused, Failed) and (refused.status, refused.code) == (429, "quota_exceeded")
    assert refused.retry_after == 1
    _, end = e.generate("small", TOKENIZER.encode("second" + "y" * 14), 8)  # the retry fits
    assert isinstance(end, Finished)
    check_consistency(e.allocator)


@pytest.mark.parametrize("length", [15, 16, 17, 18, 31, 32, 33, 49])
def test_warm_suffixes_of_every_length_near_a_block_boundary(length: int) -> None:
    warm, oracle = engines()
    text = ("Boundary probe: " + "abcdefghij" * 5)[: length - 1]
    p = TOKENIZER.encode(text)
    assert len(p) == length
    for _ in range(2):  # cold, then warm (a suffix of 1 token when length % 16 == 1)
        out, end = warm.generate("acme", p, 5)
        assert out == oracle.tokens(p, 5)
    assert isinstance(end, Finished) and end.cached_tokens == (length - 1) // 16 * 16


def test_a_tenant_waiting_for_blocks_does_not_hold_back_another_tenant() -> None:
    cfg = make_config(numBlocks=12, quotas={"tenants": {"b": {"guaranteedBlocks": 2}}})
    e = Engine(cfg)
    seen: dict[str, list[Event]] = {}

    def submit(rid: str, tenant: str, text: str, max_tokens: int) -> None:
        ctx = e.context(e.expected_namespace(tenant), "")
        e.submit(Request(rid, tenant, ctx, TOKENIZER.encode(text), max_tokens, collect(seen, rid)))

    submit("a1", "a", "x" * 100, 40)  # 9 blocks: all of the pool but b's reservation and one block
    e.step()
    assert isinstance(seen["a1"][0], Admitted)
    submit("a2", "a", "y" * 100, 40)  # does not fit until a1 is done
    submit("b1", "b", "short", 8)  # fits in b's guaranteed share
    e.step()
    assert "a2" not in seen  # still waiting, in order
    assert isinstance(seen["b1"][0], Admitted)  # not queued behind a2
    assert not any(isinstance(ev, Finished) for ev in seen["a1"])
    e.run_until_idle()
    for rid in ("a1", "a2", "b1"):
        assert isinstance(seen[rid][-1], Finished), seen[rid][-1]
    acc = check_consistency(e.allocator)
    assert acc.active == acc.fenced == acc.sequences == 0
