"""Prefix-cache keys, exact verification, and forced hash collisions."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from engine.oracle import check_consistency
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.contract import CacheScope, cache_namespace
from kvfence.isolation.allocator import FencedAllocator
from kvfence.isolation.metrics import EngineMetrics
from kvfence.isolation.prefix_cache import CacheContext, HashFn, PrefixCache, hash_function

BS = 4


def ctx(namespace: str = "tenant/gold/a", **over: str) -> CacheContext:
    fields = {"model": "m", "revision": "r", "adapter": "", "quantization": "none", "trust_class": "gold"}
    fields.update(over)
    return CacheContext(namespace=namespace, **fields)


#: the walks a lookup can take: SHA-256 in C (the default), SHA-256 in Python (an install without the
#: compiled module), BLAKE2b (Python)
WALKS = ["sha256", "sha256-python", "blake2b"]


def setup(hash_fn: HashFn | None = None, algo: str = "sha256") -> FencedAllocator:
    m = EngineMetrics()
    python = algo.endswith("-python")
    pc = PrefixCache(BS, m, hash_algorithm=algo.removesuffix("-python"), hash_fn=hash_fn, compiled=not python)
    assert pc.compiled == (algo == "sha256" and hash_fn is None)
    return FencedAllocator("gold", 64, BS, metrics=m, prefix_cache=pc)


def cache_prompt(
    a: FencedAllocator, sid: str, c: CacheContext, tenant: str, prompt: np.ndarray[Any, Any]
) -> int:
    got = a.allocate_sequence(sid, tenant, len(prompt), ctx=c, prompt=prompt)
    a.commit(sid, prompt, len(prompt))
    a.release(sid)
    return got.num_cached_tokens


def arr(*v: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.array(v, dtype=np.int32)


@pytest.mark.parametrize(("algo", "size"), [("sha256", 32), ("blake2b", 64)])
def test_keys_are_full_cryptographic_digests_chained_from_the_context(algo: str, size: int) -> None:
    pc = PrefixCache(BS, EngineMetrics(), hash_algorithm=algo)
    tokens = arr(*range(8)).tobytes()
    k = pc.keys(ctx(), tokens, 2)
    assert [len(x) for x in k] == [size, size]
    h = hash_function(algo)
    assert k[1] == h(k[0], tokens[16:32])
    assert k[0] == h(pc.root_key(ctx()), tokens[:16])
    with pytest.raises(ValueError, match="unknown prefix-cache hash"):
        hash_function("xxhash64")


@pytest.mark.parametrize(
    "field", ["model", "revision", "adapter", "quantization", "trust_class", "namespace"]
)
def test_every_context_field_changes_every_key(field: str) -> None:
    pc = PrefixCache(BS, EngineMetrics())
    tokens = arr(*range(12)).tobytes()
    base = ctx()
    other = ctx(**{field: "different"}) if field != "namespace" else ctx("tenant/gold/b")
    assert not set(pc.keys(base, tokens, 3)) & set(pc.keys(other, tokens, 3))


def test_context_encoding_is_unambiguous() -> None:
    assert ctx(model="ab", revision="c").encode() != ctx(model="a", revision="bc").encode()


def test_namespaces_follow_the_contract() -> None:
    assert cache_namespace("gold", "acme", CacheScope.TENANT) != cache_namespace(
        "gold", "beta", CacheScope.TENANT
    )
    assert cache_namespace("gold", "acme", CacheScope.TRUST_CLASS) == cache_namespace(
        "gold", "beta", CacheScope.TRUST_CLASS
    )


def weak_hash(parent: bytes, payload: bytes | memoryview) -> bytes:
    """Deliberately terrible: 8 bits, and it ignores the parent (so the namespace too)."""
    return bytes([sum(bytes(payload)) % 3])


def namespace_blind_hash(parent: bytes, payload: bytes | memoryview) -> bytes:
    """A strong hash that forgets the chain: the 'salt dropped from the key' bug (vLLM #44096)."""
    return hashlib.sha256(bytes(payload)).digest()


def test_forced_collisions_are_caught_by_exact_verification_and_counted() -> None:
    a = setup(hash_fn=weak_hash)
    c = ctx()
    p1 = arr(*range(1, 10))  # 2 full blocks cacheable
    assert cache_prompt(a, "s1", c, "a", p1) == 0
    # Different tokens, but with the weak hash every key collides with something stored.
    p2 = arr(*range(2, 11))
    assert weak_hash(b"", p2[:4].tobytes()) in a.prefix_cache.index  # type: ignore[union-attr]
    assert cache_prompt(a, "s2", c, "a", p2) == 0
    assert a.metrics.value("kv_cache_hash_collision_total") >= 1
    assert a.metrics.value("kv_cache_tenant_cross_access_rejected_total") == 0
    # The genuine prefix still hits.
    assert a.cached_prefix_tokens(c, p1) == 8
    check_consistency(a)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=5, max_size=20), min_size=2, max_size=8),
)
def test_with_a_weak_hash_every_hit_is_still_an_exact_prefix(prompts: list[list[int]]) -> None:
    a = setup(hash_fn=weak_hash)
    c = ctx()
    stored: list[np.ndarray[Any, Any]] = []
    for i, p in enumerate(prompts):
        prompt = arr(*p)
        got = cache_prompt(a, f"s{i}", c, "a", prompt)
        if got:
            # a hit of n tokens must be a prefix some earlier prompt really had
            assert any(len(s) >= got and np.array_equal(s[:got], prompt[:got]) for s in stored)
        stored.append(prompt)
    check_consistency(a)


def test_an_entry_of_another_namespace_is_refused_and_counted() -> None:
    a = setup(hash_fn=namespace_blind_hash)
    system = arr(*range(30, 39))  # the same system prompt for both tenants
    assert cache_prompt(a, "a1", ctx("tenant/gold/a"), "a", system) == 0
    assert cache_prompt(a, "a2", ctx("tenant/gold/a"), "a", system) == 8  # a hits its own blocks
    got = a.allocate_sequence("b1", "b", len(system), ctx=ctx("tenant/gold/b"), prompt=system)
    assert got.num_cached_tokens == 0  # the key matched a's entry; ownership refused it
    assert a.metrics.value("kv_cache_tenant_cross_access_rejected_total") == 1
    assert all(a.owner_of(i) == "b" for i in got.table.tolist())
    a.commit("b1", system, len(system))  # b's blocks cannot take a's keys
    a.release("b1")
    assert a.cached_prefix_tokens(ctx("tenant/gold/a"), system) == 8
    check_consistency(a)


def test_a_hit_requires_the_same_parent_block() -> None:
    a = setup(hash_fn=weak_hash)  # keys ignore the parent: only the stored parent link saves us
    c = ctx()
    A, B, C = (1, 1, 1, 1), (2, 2, 2, 2), (0, 0, 0, 0)
    cache_prompt(a, "y", c, "a", arr(*C, *B, 9))  # B is stored with parent C
    cache_prompt(a, "x", c, "a", arr(*A, 9))  # A is stored at the root
    before = a.metrics.value("kv_cache_hash_collision_total")
    # A hits; B's key then finds the stored B, whose tokens match but whose parent is C, not A: its
    # KV was computed after other tokens, so it must not be used.
    assert a.cached_prefix_tokens(c, arr(*A, *B, 9)) == 4
    assert a.metrics.value("kv_cache_hash_collision_total") == before + 1


# --- the built-in algorithms' fast path --------------------------------------------------------------
# sha256 and blake2b cannot be made to collide, so these plant an entry under the key another prompt's
# walk computes (what a collision would look like) and check that the fast path still refuses it.
def planted(algo: str) -> tuple[FencedAllocator, PrefixCache, CacheContext]:
    a = setup(algo=algo)
    assert a.prefix_cache is not None
    return a, a.prefix_cache, ctx()


def plant(
    pc: PrefixCache, c: CacheContext, tokens: np.ndarray[Any, Any], block_index: int, victim: Any
) -> None:
    """Index ``victim`` under the key of block ``block_index`` of ``tokens`` in ``c``."""
    pc.index[pc.keys(c, tokens.tobytes(), block_index + 1)[block_index]] = victim


@pytest.mark.parametrize("algo", ["sha256", "blake2b"])
def test_fast_path_keys_equal_the_hash_function_chain(algo: str) -> None:
    pc = PrefixCache(BS, EngineMetrics(), hash_algorithm=algo)
    slow = PrefixCache(BS, EngineMetrics(), hash_fn=hash_function(algo))  # the generic path
    tokens = arr(*range(40)).tobytes()
    assert pc._seed is not None and slow._seed is None
    assert pc.keys(ctx(), tokens, 10) == slow.keys(ctx(), tokens, 10)


@pytest.mark.parametrize("algo", WALKS)
def test_fast_path_refuses_a_planted_entry_with_other_tokens(algo: str) -> None:
    a, pc, c = planted(algo)
    p1, p2 = arr(*range(1, 10)), arr(*range(1, 5), 7, 7, 7, 7, 9)
    cache_prompt(a, "s1", c, "a", p1)
    victim = pc.index[pc.keys(c, p1.tobytes(), 2)[1]]  # p1's second block
    plant(pc, c, p2, 1, victim)  # found by p2's second key; same parent, other tokens
    assert a.cached_prefix_tokens(c, p2) == 4
    assert a.metrics.value("kv_cache_hash_collision_total") == 1
    assert a.cached_prefix_tokens(c, p1) == 8  # the genuine chain still hits


@pytest.mark.parametrize("algo", WALKS)
def test_fast_path_refuses_a_planted_entry_with_another_parent(algo: str) -> None:
    a, pc, c = planted(algo)
    B = (5, 6, 7, 8)
    cache_prompt(a, "y", c, "a", arr(0, 0, 0, 0, *B, 9))  # B stored after block (0,0,0,0)
    cache_prompt(a, "x", c, "a", arr(1, 1, 1, 1, 9))  # (1,1,1,1) stored at the root
    victim = pc.index[pc.keys(c, arr(0, 0, 0, 0, *B).tobytes(), 2)[1]]
    plant(pc, c, arr(1, 1, 1, 1, *B), 1, victim)  # same tokens, computed after other tokens
    assert a.cached_prefix_tokens(c, arr(1, 1, 1, 1, *B, 9)) == 4
    assert a.metrics.value("kv_cache_hash_collision_total") == 1


@pytest.mark.parametrize("algo", WALKS)
def test_fast_path_refuses_a_planted_entry_of_another_namespace(algo: str) -> None:
    a, pc, c = planted(algo)
    other = ctx("tenant/gold/b")
    prompt = arr(*range(30, 39))
    cache_prompt(a, "b1", other, "b", prompt)
    plant(pc, c, prompt, 0, pc.index[pc.keys(other, prompt.tobytes(), 1)[0]])
    assert a.cached_prefix_tokens(c, prompt) == 0
    assert a.metrics.value("kv_cache_tenant_cross_access_rejected_total") == 1


@pytest.mark.parametrize("algo", WALKS)
def test_fast_path_treats_a_fenced_entry_as_a_miss(algo: str) -> None:
    from kvfence.isolation.blocks import BlockState

    a, pc, c = planted(algo)
    prompt = arr(*range(1, 10))
    cache_prompt(a, "s1", c, "a", prompt)
    second = pc.index[pc.keys(c, prompt.tobytes(), 2)[1]]
    state = second.state
    second.state = BlockState.FENCED
    assert a.cached_prefix_tokens(c, prompt) == 4
    second.state = state
    assert a.cached_prefix_tokens(c, prompt) == 8
    assert a.metrics.value("kv_cache_hash_collision_total") == 0


@pytest.mark.parametrize("algo", WALKS)
def test_a_parent_handle_equal_but_not_identical_still_hits(algo: str) -> None:
    """The identity check is only a shortcut: an equal handle object goes through verify() and hits."""
    from kvfence.isolation.blocks import BlockHandle

    a, pc, c = planted(algo)
    prompt = arr(*range(1, 14))
    cache_prompt(a, "s1", c, "a", prompt)
    second = pc.index[pc.keys(c, prompt.tobytes(), 2)[1]]
    assert second.parent is not None
    second.parent = BlockHandle(*second.parent)  # a copy
    assert a.cached_prefix_tokens(c, prompt) == 12
    assert a.metrics.value("kv_cache_hash_collision_total") == 0


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=5, max_size=24), min_size=2, max_size=8),
)
def test_fast_path_and_generic_path_find_the_same_prefixes(prompts: list[list[int]]) -> None:
    """The compiled walk, the Python walk and the generic (injected hash_fn) walk agree."""
    walks = [setup(), setup(algo="sha256-python"), setup(hash_fn=hash_function("sha256"))]
    c = ctx()
    for i, p in enumerate(prompts):
        prompt = arr(*p)
        assert len({cache_prompt(a, f"s{i}", c, "a", prompt) for a in walks}) == 1
    for p in prompts:
        assert len({a.cached_prefix_tokens(c, arr(*p)) for a in walks}) == 1
    for a in walks:
        check_consistency(a)


def test_the_compiled_walk_is_built() -> None:
    """`make test` builds it (setup.py, a C compiler and OpenSSL's headers): without it every SHA-256
    lookup would silently take the slower Python walk."""
    from kvfence.isolation import prefix_cache

    assert prefix_cache.COMPILED_WALK, "kvfence.isolation._prefix_walk is not built: run `make venv`"
    assert setup().prefix_cache is not None and setup().prefix_cache.compiled


@pytest.mark.parametrize(
    ("kwargs", "walk"),
    [
        ({}, "compiled"),
        ({"compiled": False}, "python"),
        ({"hash_algorithm": "blake2b"}, "python"),
        ({"hash_fn": hash_function("sha256")}, "python"),
    ],
)
def test_metrics_name_the_walk_that_runs(kwargs: dict[str, Any], walk: str) -> None:
    m = EngineMetrics()
    assert m.value("kvfence_engine_info", {"prefix_walk": "none"}) == 1
    pc = PrefixCache(BS, m, **kwargs)
    assert pc.walk == walk
    assert m.value("kvfence_engine_info", {"prefix_walk": walk}) == 1
    samples = [s for f in m.registry.collect() if f.name == "kvfence_engine_info" for s in f.samples]
    assert [s.labels for s in samples] == [{"prefix_walk": walk}]


@pytest.mark.parametrize("algo", [*WALKS, "generic"])
def test_lookup_across_split_windows_stops_at_the_first_bad_block(algo: str) -> None:
    """The walk splits the prompt a window of blocks at a time: a prompt longer than several windows
    hits in full, a planted entry past the first window stops it exactly there (counted), the key it
    hands on is the last verified block's, and asking for more blocks than the prompt holds ends at
    its last full block."""
    from kvfence.isolation.prefix_cache import SPLIT_WINDOW

    n = SPLIT_WINDOW * 2 + 7  # blocks
    m = EngineMetrics()
    hash_fn = hash_function("sha256") if algo == "generic" else None
    pc = PrefixCache(
        BS,
        m,
        hash_algorithm="sha256" if algo == "generic" else algo.removesuffix("-python"),
        hash_fn=hash_fn,
        compiled=not algo.endswith("-python"),
    )
    a = FencedAllocator("gold", n + 8, BS, metrics=m, prefix_cache=pc)
    c = ctx()
    prompt = np.arange(1, n * BS + 2, dtype=np.int32)  # n full blocks and one token more
    cache_prompt(a, "s", c, "a", prompt)
    raw = prompt.tobytes()
    keys = pc.keys(c, raw, n)
    full = pc.lookup(c, raw, n)
    assert len(full.blocks) == n and full.next_parent_key == keys[-1]
    assert len(pc.lookup(c, raw, n + 50).blocks) == n  # no partial block is ever hashed or matched
    assert len(pc.lookup(c, raw[: 5 * BS * 4], n).blocks) == 5
    # from the middle (a shared prefix's end): the same chain from block 10 on
    tail = pc.lookup(c, raw, n, start=10, key=keys[9], parent=full.blocks[9].cache_handle)
    assert tail.blocks == full.blocks[10:]
    bad = SPLIT_WINDOW + 3
    other = prompt.copy()
    other[bad * BS] += 1  # block `bad` differs by one token
    plant(pc, c, other, bad, full.blocks[bad])  # found under other's key: same parent, other tokens
    got = pc.lookup(c, other.tobytes(), n)
    assert got.blocks == full.blocks[:bad] and got.next_parent_key == keys[bad - 1]
    assert m.value("kv_cache_hash_collision_total") == 1
