"""The fence's prefix-cache records (kvfence.vllm.records): the compiled implementation (_records.c)
and the pure-Python one give the same answers (the fence's verification tests in test_vllm_fence.py run
with each, through the `record_impl` fixture of conftest.py)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_engine.vllmsched import Harness

from kvfence.vllm import records
from kvfence.vllm.fence import root_namespace, same_chain

PROMPT = list(range(100, 164))  # 4 full blocks of 16
#: vLLM's token id type (its input batch holds token ids in int32 arrays): what compiled records store
TOKEN = st.integers(min_value=-(2**31), max_value=2**31 - 1)


def test_the_compiled_records_are_built() -> None:
    # `make venv` builds kvfence.vllm._records (setup.py); a silently missing module would make every
    # vLLM-lane test run the pure-Python records only.
    assert records.COMPILED, "kvfence.vllm._records is not built: run `make venv`"


@settings(max_examples=400, deadline=None)
@given(
    st.lists(TOKEN, max_size=40),
    st.lists(TOKEN, max_size=40),
    st.integers(0, 45),
    st.integers(0, 45),
    st.integers(0, 45),
)
def test_compiled_and_pure_python_records_agree(
    recorded: list[int], asked: list[int], start: int, stop: int, at: int
) -> None:
    from kvfence.vllm import _records

    c = _records.Record(None, recorded, start, stop, ("ns",))
    py = records.PyRecord(None, recorded, start, stop, ("ns",))
    assert py.tokens == recorded[start:stop]
    assert records.TOKEN_BYTES == 4
    assert len(c.tokens) == 4 * len(py.tokens)  # the same tokens, packed as int32
    # A record equals a list exactly where the list slice does, for any list and offset.
    for probe in (asked, recorded, [*asked, *recorded], recorded[start:stop] + asked):
        want = py.tokens == probe[at : at + len(py.tokens)] and at <= len(probe)
        assert _records.equal(c.tokens, probe, at) is want
        assert records.py_equal(py.tokens, probe, at) is want
    # Its own tokens, where they were taken from, always match.
    assert _records.equal(c.tokens, recorded, min(start, len(recorded)))
    assert records.py_equal(py.tokens, recorded, min(start, len(recorded)))
    # Two records of the same tokens compare equal, in either implementation.
    assert _records.Record(c, recorded, start, stop, None).tokens == c.tokens


@settings(max_examples=300, deadline=None)
@given(st.lists(TOKEN, max_size=40), st.integers(0, 45), st.integers(0, 45))
def test_records_copied_from_a_packed_prompt_are_the_records_of_the_list(
    tokens: list[int], start: int, stop: int
) -> None:
    from kvfence.vllm import _records

    packed = _records.pack(tokens)
    assert packed == b"".join(t.to_bytes(4, sys.byteorder, signed=True) for t in tokens)  # native int32
    from_list = _records.Record(None, tokens, start, stop, None)
    from_packed = _records.Record(None, packed, start, stop, None)
    assert from_packed.tokens == from_list.tokens  # slicing clamps alike
    assert _records.equal(from_packed.tokens, tokens, min(start, len(tokens)))


BS = 4  # block size of the verify_chain property test


@st.composite
def hit_chains(draw: st.DrawFn) -> tuple[list[int], int, list[tuple[str, int]], str]:
    """A request's tokens, the prefix of it packed on arrival, and how each of a hit's blocks was
    recorded: ("same", i) the request's own block i, ("tokens", i) block i with one token changed,
    ("dup", i) a copy of block i whose parent is a duplicate of the previous record (the very record
    only at block 0), ("ns", i) at block 0 a root in the other namespace (elsewhere the same as "same"),
    ("none", i) no record, ("short", i) a record of fewer tokens; and the namespace the request asks
    for."""
    n = draw(st.integers(0, 6))
    tokens = draw(st.lists(st.integers(0, 50), min_size=n * BS, max_size=n * BS + 6))
    kinds = st.sampled_from(["same", "same", "same", "tokens", "dup", "ns", "none", "short"])
    plan = [(draw(kinds), i) for i in range(n)]
    packed_upto = draw(st.integers(0, len(tokens)))
    asked = draw(st.sampled_from(["ns-a", "ns-b"]))
    return tokens, packed_upto, plan, asked


@settings(max_examples=500, deadline=None)
@given(hit_chains())
def test_the_compiled_verification_walk_gives_the_pure_python_answer(
    case: tuple[list[int], int, list[tuple[str, int]], str],
) -> None:
    # verify_chain is TenantFence.verify's fast path: the same answer from either implementation, for
    # chains that break anywhere in any way, whether the request's packed prompt covers a block or not.
    from kvfence.vllm import _records

    tokens, packed_upto, plan, asked = case
    answers = []
    for make, walk, packed in (
        (_records.Record, _records.verify_chain, _records.pack(tokens[:packed_upto])),
        (records.PyRecord, records.py_verify_chain, None),
    ):
        store: list[Any] = [None]  # block 0 is vLLM's null block
        ids: list[int] = []
        parent: Any = None
        for kind, i in plan:
            lo = i * BS
            ns = (("ns-a", None) if kind != "ns" else ("ns-b", None)) if i == 0 else None
            if kind == "none":
                rec = None
            elif kind == "tokens":
                changed = [*tokens[:lo], tokens[lo] + 1, *tokens[lo + 1 :]]
                rec = make(parent, changed, lo, lo + BS, ns)
            elif kind == "short":
                rec = make(parent, tokens, lo, lo + BS - 1, ns)
            elif kind == "dup" and parent is not None:
                copy = make(parent.parent, tokens, lo - BS, lo, parent.namespace, parent.root)
                rec = make(copy, tokens, lo, lo + BS, ns)
            else:
                rec = make(parent, tokens, lo, lo + BS, ns)
            store.append(rec)
            ids.append(len(store) - 1)
            parent = rec
        answers.append(walk(store, ids, tokens, packed, (asked, None), BS))
    assert answers[0] == answers[1]
    # And the answer is what the plan says: the blocks before the first one recorded otherwise.
    want = 0
    for kind, i in plan:
        if kind in ("none", "tokens", "short") or (kind == "dup" and i > 0):
            break
        if i == 0 and (kind == "ns") != (asked == "ns-b"):
            break
        want += 1
    assert answers[0] == want


class FakeBlock:
    """What record_chain reads of vLLM's KVCacheBlock."""

    def __init__(self, block_id: int, is_null: bool = False, block_hash: Any = b"h") -> None:
        self.block_id, self.is_null, self.block_hash = block_id, is_null, block_hash


def per_block_records(
    make: Any,
    blocks: list[FakeBlock],
    start: int,
    stop: int,
    parent: Any,
    tokens: list[int],
    root: int,
    ns: Any,
) -> dict[int, Any]:
    """The loop record_chain replaces (the scheduler's cache_full_blocks before it), one Record call per
    block: what each block id ends up holding."""
    out: dict[int, Any] = {}
    for i in range(start, stop):
        block = blocks[i]
        if block.is_null or block.block_hash is None:
            parent = None
            continue
        if i < root or (i > 0 and parent is None):
            out[block.block_id] = parent = None
            continue
        rec = make(parent, tokens, i * BS, (i + 1) * BS, ns if i == root else None, i == root)
        out[block.block_id] = parent = rec
    return out


def chain_view(rec: Any, depth: int = 8) -> Any:
    """A record and its ancestors as plain values (tokens as a list of ints)."""
    out = []
    while rec is not None and depth:
        toks = rec.tokens
        if isinstance(toks, bytes):
            w = records.TOKEN_BYTES
            toks = [
                int.from_bytes(toks[k : k + w], sys.byteorder, signed=True) for k in range(0, len(toks), w)
            ]
        out.append((toks, rec.namespace, rec.root))
        rec, depth = rec.parent, depth - 1
    return out


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, 6),
    st.data(),
)
def test_the_recording_call_builds_the_records_the_per_block_loop_built(n: int, data: st.DataObject) -> None:
    # record_chain (compiled) and py_record_chain (the GPU image's pure Python) build, for any run of
    # blocks (null ones, unhashed ones, a root after declared shared blocks, packed prompts covering any
    # prefix), the records one Record call per block built, under the same block ids, chained alike.
    from kvfence.vllm import _records

    tokens = data.draw(st.lists(TOKEN, min_size=n * BS, max_size=n * BS + 5))
    kinds = data.draw(
        st.lists(st.sampled_from(["ok", "ok", "ok", "null", "unhashed"]), min_size=n, max_size=n)
    )
    start = data.draw(st.integers(0, n))
    root = data.draw(st.integers(0, n))
    packed_upto = data.draw(st.integers(0, len(tokens)))
    ids = data.draw(st.permutations(range(1, n + 1)))
    with_parent = start > 0 and data.draw(st.booleans())  # blocks[start - 1] has a record
    blocks = [
        FakeBlock(bid, is_null=kind == "null", block_hash=None if kind == "unhashed" else b"h")
        for bid, kind in zip(ids, kinds, strict=True)
    ]
    ns = (("salt", None), None)
    want_by_impl = {}
    for make, chain, packed in (
        (_records.Record, _records.record_chain, _records.pack(tokens[:packed_upto])),
        (records.PyRecord, records.py_record_chain, None),
    ):
        parent = make(None, [7] * BS, 0, BS, ns, True) if with_parent else None
        store: list[Any] = ["old"] * (n + 1)
        chain(store, blocks, start, n, parent, tokens, packed, BS, root, ns)
        want = per_block_records(make, blocks, start, n, parent, tokens, root, ns)
        for bid in range(n + 1):
            if bid in want:
                assert chain_view(store[bid]) == chain_view(want[bid]), bid
                assert type(store[bid]) is type(want[bid])
            else:  # a block the call did not record keeps what it held
                assert store[bid] == "old"
        want_by_impl[make] = {bid: chain_view(r) for bid, r in want.items()}
    # Both implementations record the same tokens, namespaces and roots.
    assert want_by_impl[_records.Record] == want_by_impl[records.PyRecord]


def test_the_recording_call_refuses_what_it_cannot_read() -> None:
    from kvfence.vllm import _records

    store: list[Any] = [None, None]
    ok = [FakeBlock(1)]
    _records.record_chain(store, ok, 0, 1, None, [1, 2], None, 2, 0, ("n", None))
    assert store[1] is not None and store[1].namespace == ("n", None) and store[1].root
    with pytest.raises(TypeError):
        _records.record_chain(store, ok, 0, 1, object(), [1, 2], None, 2, 0, None)  # parent not a record
    with pytest.raises(TypeError):
        _records.record_chain(store, tuple(ok), 0, 1, None, [1, 2], None, 2, 0, None)  # blocks a list
    with pytest.raises(ValueError):
        _records.record_chain(store, ok, 0, 2, None, [1, 2], None, 2, 0, None)  # past the blocks
    with pytest.raises(ValueError):
        _records.record_chain(store, ok, 0, 1, None, [1, 2], b"\x00" * 3, 2, 0, None)  # not packed ids
    with pytest.raises(IndexError):
        _records.record_chain(store, [FakeBlock(5)], 0, 1, None, [1, 2], None, 2, 0, None)  # no slot
    with pytest.raises(AttributeError):
        _records.record_chain(store, [object()], 0, 1, None, [1, 2], None, 2, 0, None)  # not a block


def test_verify_chain_refuses_what_it_cannot_read() -> None:
    from kvfence.vllm import _records

    rec = _records.Record(None, [1, 2], 0, 2, ("n", None))
    with pytest.raises(TypeError):
        _records.verify_chain([None, rec], (1,), [1, 2], None, ("n", None), 2)  # ids are a list
    with pytest.raises(TypeError):
        _records.verify_chain([None, rec], [1], [1, 2], b"\x00" * 3, ("n", None), 2)  # not packed ids
    with pytest.raises(IndexError):
        _records.verify_chain([None, rec], [5], [1, 2], None, ("n", None), 2)
    with pytest.raises(ValueError):
        _records.verify_chain([None, rec], [1], [1, 2], None, ("n", None), 0)
    with pytest.raises(TypeError):
        _records.pack((1, 2))
    assert _records.verify_chain([None, rec], [1], [1, 2], None, ("n", None), 2) == 1
    assert _records.verify_chain([None, rec], [1], [1, 2], _records.pack([1, 2]), ("n", None), 2) == 1


@pytest.mark.parametrize("impl", ["compiled", "pure Python"])
def test_a_record_keeps_its_parent_namespace_and_root(impl: str) -> None:
    from kvfence.vllm import _records

    make = _records.Record if impl == "compiled" else records.PyRecord
    ns = (("salt", None), None)
    root = make(None, PROMPT, 0, 16, ns)
    child = make(root, PROMPT, 16, 32, None)
    entry = make(child, PROMPT, 32, 48, ("other",), True)  # where a request's namespace enters
    assert (root.root, child.root, entry.root) == (True, False, True)
    assert child.parent is root and root.parent is None and entry.parent is child
    assert root.namespace == ns and child.namespace is None
    assert root_namespace(child) == ns and root_namespace(entry) == ("other",)
    # A copy of the same content after the same prefix is the same chain; other tokens are not.
    assert same_chain(make(root, PROMPT, 16, 32, None), child)
    assert not same_chain(make(root, PROMPT, 17, 33, None), child)


def test_compiled_records_refuse_what_is_not_a_token_list() -> None:
    from kvfence.vllm import _records

    with pytest.raises(TypeError):
        _records.Record(None, [1, "2", 3], 0, 3, None)
    with pytest.raises(TypeError):
        _records.equal(_records.Record(None, [1, 2], 0, 2, None).tokens, [1, 2.0], 0)
    for outside in (2**31, -(2**31) - 1, 2**63):  # beyond int32: an error, never a truncated token
        with pytest.raises(OverflowError, match="outside int32"):
            _records.Record(None, [1, outside], 0, 2, None)
        with pytest.raises(OverflowError, match="outside int32"):
            _records.pack([outside])
        with pytest.raises(OverflowError, match="outside int32"):
            _records.equal(_records.Record(None, [1, 2], 0, 2, None).tokens, [1, outside], 0)
    with pytest.raises(TypeError):
        _records.Record(None, (1, 2), 0, 2, None)  # vLLM's token ids are lists
    with pytest.raises(TypeError):
        _records.Record(object(), [1, 2], 0, 2, None)  # a parent is a record
    with pytest.raises(ValueError):
        _records.equal(b"\x00" * 3, [0], 0)  # not whole int32 ids: never a silent mismatch
    for make, equal in ((_records.Record, _records.equal), (records.PyRecord, records.py_equal)):
        with pytest.raises(ValueError):
            make(None, [1, 2], -1, 2, None)
        with pytest.raises(ValueError):
            equal(make(None, [1, 2], 0, 2, None).tokens, [1, 2], -1)
    with pytest.raises(AttributeError):
        _records.Record(None, [1], 0, 1, None).parent = None  # type: ignore[misc]  # read-only


def test_compiled_records_are_no_work_for_the_garbage_collector_and_free_long_chains() -> None:
    from kvfence.vllm import _records

    tokens = list(range(16 * 1000))
    ns = ("salt", None)
    gc.collect()
    before = gc.get_count()[0]
    chain = None
    for i in range(1000):
        chain = _records.Record(chain, tokens, 16 * i, 16 * (i + 1), ns if i == 0 else None)
    # No container allocation counted (what triggers young collections), none tracked.
    assert gc.get_count()[0] - before < 10
    assert not gc.is_tracked(chain)
    # The namespace a record holds stays alive through it, and is freed with the last record.
    held = sys.getrefcount(ns)
    # A chain far longer than the C stack could free recursively (one record per block of a 2M-token
    # context) is freed iteratively, without crashing, when its last record goes.
    long = None
    for _ in range(200_000):
        long = _records.Record(long, tokens, 0, 16, None)
    del long
    first = _records.Record(None, tokens, 0, 16, ns)
    second = _records.Record(first, tokens, 16, 32, None)
    assert sys.getrefcount(ns) == held + 1
    del first
    assert second.parent is not None and second.parent.namespace is ns  # still held by its child
    del second
    assert sys.getrefcount(ns) == held
    assert chain is not None and root_namespace(chain) == ns


def test_full_block_records_start_on_a_cache_line_and_freed_slots_are_taken_again() -> None:
    # Records of the slots' size (the block size of this process's first record_chain call) start on a
    # cache line; freed, their slots are the next records' ones, and those hold their own tokens.
    from kvfence.vllm import _records

    ns = (("salt", None), None)
    _records.record_chain([None, None], [FakeBlock(1)], 0, 1, None, list(range(BS)), None, BS, 0, ns)
    n = _records.slot_tokens()
    assert n > 0
    blocks = [FakeBlock(i + 1) for i in range(64)]
    store: list[Any] = [None] * 65
    _records.record_chain(store, blocks, 0, 64, None, list(range(64 * n)), None, n, 0, ns)
    taken = {id(r) for r in store[1:]}
    assert len(taken) == 64 and all(address % 64 == 0 for address in taken)
    store[1:] = [None] * 64  # the whole chain freed
    again = [7 + t for t in range(64 * n)]
    _records.record_chain(store, blocks, 0, 64, None, again, _records.pack(again), n, 0, ns)
    assert {id(r) for r in store[1:]} == taken
    view = chain_view(store[64], depth=64)
    assert [tok for block in reversed(view) for tok in block[0]] == again


def test_each_implementation_stores_its_own_records(tmp_path: Path, record_impl: str) -> None:
    # The fence's verification tests run with both (test_vllm_fence.py takes `record_impl` too); this
    # checks the fixture really switches what the scheduler records.
    h = Harness(tmp_path)
    h.add("alice", [*PROMPT, 1])
    h.run()
    want = bytes if record_impl == "compiled" else list
    stored = [r for r in h.fence.records if r is not None]
    assert len(stored) == 4 and all(isinstance(r.tokens, want) for r in stored)
    h.check()
