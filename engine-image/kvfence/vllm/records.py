"""What a cached block holds, for the fence to verify a prefix hit against: its tokens, the record of
the block before it, and at the root the cache namespace (salt and adapter).

Two implementations of the same interface, chosen at import (:data:`COMPILED` and
:data:`IMPLEMENTATION` say which; the scheduler names it in its start-up log line, and ``/metrics`` as
``kvfence_engine_info{records="compiled"|"python"} 1``, see kvfence.vllm.stats):

* compiled (``_records.c``, built by ``setup.py`` against CPython's stable ABI, so the one abi3 wheel
  that every image installs, the GPU vLLM image included, carries it): the tokens packed as native int32 bytes
  (:data:`TOKEN_BYTES` each: vLLM's own token id type, and half the memory of int64, which matters as
  a verification reads the records of every block a hit reuses), and a record that is no container
  for Python's garbage collector (records form a tree, so no cycle can pass through one). vLLM's
  scheduler thread collects garbage every 700 net allocations of container objects, each young
  collection walking the token lists of the requests that arrived meanwhile; a Python object per
  cached block made the fenced scheduler collect about twice as often as vLLM alone.
  :func:`equal` reads each of the request's tokens once and copies nothing.
* pure Python, the fallback where the compiled module does not load (a source tree nobody built, a
  platform the wheel was not built for): :class:`PyRecord`, whose tokens are the list slice itself,
  compared with the request's slice. Slower (``bench/bench_records.py`` times both), so the fallback
  is logged as a warning with the reason the compiled module did not load.

``Record(parent, tokens, start, stop, namespace, root=False)`` records ``tokens[start:stop]``; the fence
never looks inside ``record.tokens`` except through :func:`equal` and :func:`verify_chain` (and compares
two records' tokens with ``==``, which both implementations support).
``tests/vllm_engine/test_vllm_records.py`` checks that both give the same answers and runs the fence's
verification with each.

:data:`pack` (compiled only; None in pure Python) packs a request's whole token list once, when it
arrives: vLLM's block hasher has just read those int objects, and a prefix hit verified later (the
request may wait many steps in a saturated engine, its int objects long out of the CPU's caches) then
compares packed bytes with ``memcmp``; records of prompt blocks are copied from it too. The packed copy
is the request's own prompt, which never changes, so a comparison with it is a comparison with the
request's tokens. :func:`verify_chain` is the fence's plain-text verification walk (see its docstring),
:func:`record_chain` the scheduler's plain-text recording loop (one call for the blocks a request
filled, instead of one ``Record`` call per block).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

log = logging.getLogger("kvfence.vllm.records")


class PyRecord:
    """The pure-Python record (see the module docstring)."""

    __slots__ = ("namespace", "parent", "root", "tokens")

    def __init__(
        self,
        parent: PyRecord | None,
        tokens: list[int],
        start: int,
        stop: int,
        namespace: Any,
        root: bool = False,
    ) -> None:
        if start < 0 or stop < 0:
            raise ValueError("Record: start and stop must not be negative")
        self.parent = parent
        self.tokens = tokens[start:stop]
        self.namespace = namespace
        self.root = root or parent is None


def py_equal(packed: Any, tokens: list[int], start: int) -> bool:
    """Whether a :class:`PyRecord`'s tokens are exactly ``tokens[start:start + len(packed)]``."""
    if start < 0:
        raise ValueError("equal: start must not be negative")
    if not isinstance(packed, list):
        raise TypeError("equal: a pure-Python record's tokens are a list")
    return start <= len(tokens) and packed == tokens[start : start + len(packed)]


def py_verify_chain(
    records: list[Any], block_ids: list[int], tokens: list[int], packed: Any, namespace: Any, block_size: int
) -> int:
    """How many leading blocks of a prefix hit verify by the plain-text rule: block ``i``'s record holds
    ``tokens[i * block_size:(i + 1) * block_size]``; block 0's is a root without parent whose namespace
    is ``namespace``; every later one has no namespace and the previous block's record (the very
    object) as parent. ``packed`` is ignored (pure-Python records compare list slices). The compiled
    ``verify_chain`` gives the same answer, comparing from ``packed`` where it reaches."""
    parent = None
    lo = 0
    for i, bid in enumerate(block_ids):
        rec = records[bid]
        if rec is None or rec.parent is not parent or len(rec.tokens) != block_size:
            return i
        in_namespace = (rec.root and rec.namespace == namespace) if i == 0 else rec.namespace is None
        if not in_namespace or not py_equal(rec.tokens, tokens, lo):
            return i
        parent = rec
        lo += block_size
    return len(block_ids)


def py_record_chain(
    records: list[Any],
    blocks: list[Any],
    start: int,
    stop: int,
    parent: Any,
    tokens: list[int],
    packed: Any,
    block_size: int,
    root: int,
    namespace: Any,
) -> None:
    """The records of vLLM's ``blocks[start:stop]``, which a request of plain text just filled and vLLM
    just cached (the scheduler's ``cache_full_blocks``): block ``i`` gets ``Record(parent, tokens,
    i * block_size, (i + 1) * block_size, namespace if i == root else None, root=i == root)`` under its
    block id, chained to the record before it (``parent``: blocks[start - 1]'s, None at 0). A null block
    or one without a hash records nothing and ends the chain; a block before ``root`` (a declared shared
    block computed again instead of hit) or after a block without a record gets None (an entry that
    never verifies). ``packed`` is ignored here (the compiled ``record_chain`` copies a block's tokens
    from it where it holds the whole block)."""
    for i in range(start, stop):
        block = blocks[i]
        if block.is_null or block.block_hash is None:
            parent = None
            continue
        if i < root or (i > 0 and parent is None):
            records[block.block_id] = parent = None
            continue
        lo = i * block_size
        records[block.block_id] = parent = PyRecord(
            parent, tokens, lo, lo + block_size, namespace if i == root else None, i == root
        )


if TYPE_CHECKING:
    from collections.abc import Callable

    from kvfence.vllm._records import Record, equal, record_chain, verify_chain

    COMPILED: bool
    pack: Callable[[list[int]], bytes] | None
    TOKEN_BYTES: int
else:
    try:
        from kvfence.vllm._records import TOKEN_BYTES, Record, equal, pack, record_chain, verify_chain

        COMPILED = True
    except ImportError as e:  # the fallback: see the module docstring
        log.warning("kvfence: the compiled prefix-cache records did not load (%s): pure-Python records", e)
        Record, equal, verify_chain, pack = PyRecord, py_equal, py_verify_chain, None
        record_chain = py_record_chain
        COMPILED = False
        TOKEN_BYTES = 0  # nothing is packed

#: which records run: the label value of ``kvfence_engine_info{records=...}`` on /metrics
IMPLEMENTATION: Literal["compiled", "python"] = "compiled" if COMPILED else "python"

__all__ = [
    "COMPILED",
    "IMPLEMENTATION",
    "TOKEN_BYTES",
    "PyRecord",
    "Record",
    "equal",
    "pack",
    "py_equal",
    "py_record_chain",
    "py_verify_chain",
    "record_chain",
    "verify_chain",
]
