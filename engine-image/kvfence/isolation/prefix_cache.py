"""The tenant-aware prefix cache: chained block hashes, an index, and exact verification of every hit.

Keys
----
A full block's key is ``H(parent_key, token_bytes)`` where ``token_bytes`` are the block's token ids
as little-endian int32 and ``parent_key`` is the previous block's key; the first block's parent is
the *root key* ``H(ROOT_SEED, context)``. The context folds in everything that changes the KV a
prompt produces, plus the isolation boundary: model id and revision, adapter, quantization, trust
class and the cache namespace (:func:`kvfence.contract.cache_namespace`). Like vLLM's ``cache_salt``
the namespace enters the first block only and reaches every later block through the chain.

``H`` is SHA-256 or BLAKE2b with its full digest (32 or 64 bytes), never truncated. The hash function
is injectable so tests can force collisions with a deliberately weak one.

Verification
------------
The hash only *finds* a candidate. A candidate is a hit only if its stored context is the request's,
its stored parent is the very block (id and generation) the walk matched one step earlier, and its
stored tokens equal the request's tokens byte for byte. A candidate from another namespace is refused
and counted in ``kv_cache_tenant_cross_access_rejected_total``; any other mismatch is a hash
collision, counted in ``kv_cache_hash_collision_total``. Both are misses.

The cache holds no lock of its own: every method is called with the allocator's lock held.

The walk
--------
:meth:`PrefixCache.lookup` walks the prompt block by block: key, index, fast-path check (the interned
context, the very parent handle, the same tokens, usable); anything the fast path cannot take goes to
:meth:`PrefixCache.verify`. With SHA-256 (the default) the per-block loop runs in C
(``_prefix_walk.c``, built by ``setup.py`` against OpenSSL's libcrypto, the library hashlib itself
uses) and returns to Python at the first block it cannot take. The Python loop below is the same
walk for BLAKE2b, for an injected ``hash_fn``, and for an install without the compiled module
(``COMPILED_WALK``).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvfence.isolation.blocks import BlockHandle, BlockState, KVBlock
from kvfence.isolation.metrics import EngineMetrics

try:
    from kvfence.isolation import _prefix_walk
except ImportError:  # built by setup.py where a C compiler and OpenSSL's headers are installed
    _prefix_walk = None  # type: ignore[assignment]

#: whether this install has the compiled walk (``make test`` asserts it does)
COMPILED_WALK = _prefix_walk is not None

#: ``hash_fn(parent_key, payload) -> key``
HashFn = Callable[[bytes, bytes | memoryview], bytes]

ROOT_SEED = b"kvfence-prefix-root-v1"
#: Blocks of a prompt a lookup splits at a time.
SPLIT_WINDOW = 128


# Copying an empty hasher is cheaper than constructing one (OpenSSL 3 looks the digest up on every
# construction); the digests are the same.
_EMPTY_SHA256 = hashlib.sha256()
_EMPTY_BLAKE2B = hashlib.blake2b()  # full 64-byte digest


def sha256_chain(parent: bytes, payload: bytes | memoryview) -> bytes:
    h = _EMPTY_SHA256.copy()
    h.update(parent)
    h.update(payload)
    return h.digest()


def blake2b_chain(parent: bytes, payload: bytes | memoryview) -> bytes:
    h = _EMPTY_BLAKE2B.copy()
    h.update(parent)
    h.update(payload)
    return h.digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_chain, "blake2b": blake2b_chain}
_SEEDS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "blake2b": hashlib.blake2b}


def hash_function(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown prefix-cache hash algorithm {name!r} (sha256 or blake2b)") from None


@dataclass(frozen=True, slots=True)
class CacheContext:
    """Everything a prefix key folds in besides the tokens."""

    model: str
    revision: str
    adapter: str
    quantization: str
    trust_class: str
    namespace: str
    _encoded: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = (self.model, self.revision, self.adapter, self.quantization, self.trust_class, self.namespace)
        buf = bytearray(b"kvfence-context-v1")
        for p in parts:
            b = p.encode("utf-8")
            buf += struct.pack("<I", len(b)) + b  # length-prefixed: no two contexts encode alike
        object.__setattr__(self, "_encoded", bytes(buf))

    def encode(self) -> bytes:
        return self._encoded


class Verdict(Enum):
    HIT = "hit"
    MISS = "miss"  # no entry, or an entry that is not usable right now (fenced)
    COLLISION = "collision"
    CROSS_NAMESPACE = "cross_namespace"


@dataclass(slots=True)
class Match:
    """The verified cached prefix of a prompt."""

    blocks: list[KVBlock]
    #: the key the next block chains from (the root key if nothing matched)
    next_parent_key: bytes

    @property
    def keys(self) -> list[bytes]:
        """The matched blocks' keys (each block is indexed under its own key)."""
        return [b.block_hash for b in self.blocks if b.block_hash is not None]


class PrefixCache:
    """Index of full, computed blocks by chained key."""

    def __init__(
        self,
        block_size: int,
        metrics: EngineMetrics,
        *,
        hash_algorithm: str = "sha256",
        hash_fn: HashFn | None = None,
        compiled: bool = True,
    ) -> None:
        """``compiled``: walk in C when the module is installed and the algorithm is built-in (the
        tests turn it off to run the Python walk on the same cases)."""
        self.block_size = block_size
        self.block_bytes = 4 * block_size
        self.metrics = metrics
        self.hash_fn: HashFn = hash_fn if hash_fn is not None else hash_function(hash_algorithm)
        self.index: dict[bytes, KVBlock] = {}
        self._roots: dict[CacheContext, tuple[CacheContext, bytes]] = {}
        #: an empty hasher of the built-in algorithm (None with an injected hash_fn): copying it and
        #: hashing ``parent + payload`` gives hash_fn's digest with fewer calls than hash_fn itself
        self._seed: Any = None if hash_fn is not None else _SEEDS[hash_algorithm]()
        #: splits token bytes into whole blocks in one C call (``findall(raw, pos, endpos)``)
        self._split = re.compile(b".{%d}" % self.block_bytes, re.DOTALL)
        #: walk in C (sha256 only: BLAKE2b through OpenSSL is slower than hashlib's own)
        self.compiled = compiled and COMPILED_WALK and hash_fn is None and hash_algorithm == "sha256"
        metrics.prefix_walk(self.walk)

    @property
    def walk(self) -> str:
        """Which walk runs: "compiled" (``_prefix_walk.c``) or "python"."""
        return "compiled" if self.compiled else "python"

    def __len__(self) -> int:
        return len(self.index)

    def canonical(self, ctx: CacheContext) -> tuple[CacheContext, bytes]:
        """The interned equal context (so verification can compare by identity) and its root key."""
        hit = self._roots.get(ctx)
        if hit is None:
            if len(self._roots) > 4096:
                self._roots.clear()
            hit = self._roots[ctx] = (ctx, self.hash_fn(ROOT_SEED, ctx.encode()))
        return hit

    def root_key(self, ctx: CacheContext) -> bytes:
        return self.canonical(ctx)[1]

    def keys(self, ctx: CacheContext, token_bytes: bytes | memoryview, num_blocks: int) -> list[bytes]:
        """The chained keys of the first ``num_blocks`` full blocks (used by the benchmark and tests)."""
        raw = bytes(token_bytes)
        bb = self.block_bytes
        key = self.root_key(ctx)
        seed = self._seed
        if seed is not None:  # a built-in algorithm: the same digests as hash_fn, fewer calls
            new = seed.copy
            out = []
            for i in range(0, num_blocks * bb, bb):
                h = new()
                h.update(key + raw[i : i + bb])
                key = h.digest()
                out.append(key)
            return out
        hf = self.hash_fn
        return [(key := hf(key, raw[i : i + bb])) for i in range(0, num_blocks * bb, bb)]

    def verify(
        self,
        block: KVBlock,
        ctx: CacheContext,
        parent: BlockHandle | None,
        tokens: bytes | memoryview,
    ) -> Verdict:
        """Decide whether ``block`` (found under a key) really is the block the request asks for."""
        bctx = block.context
        if bctx is None:
            return Verdict.MISS
        if bctx.namespace != ctx.namespace or bctx.trust_class != ctx.trust_class:
            return Verdict.CROSS_NAMESPACE
        if bctx != ctx or block.parent != parent or block.tokens != tokens:
            return Verdict.COLLISION
        if block.state is BlockState.FENCED:
            return Verdict.MISS
        return Verdict.HIT

    def _count(self, verdict: Verdict) -> None:
        if verdict is Verdict.COLLISION:
            self.metrics.hash_collision.inc()
        elif verdict is Verdict.CROSS_NAMESPACE:
            self.metrics.cross_access_rejected.inc()

    def after_shared(self, ctx: CacheContext, shared_key: bytes) -> bytes:
        """The key a request's own chain continues from after a declared shared prefix whose last
        pinned block has ``shared_key``: the request's root key (its namespace) folded with it, so every
        block after the shared part is keyed by the tenant, as without shared prefixes."""
        return self.hash_fn(self.root_key(ctx), shared_key)

    def lookup(
        self,
        ctx: CacheContext,
        token_bytes: bytes | memoryview,
        max_blocks: int,
        *,
        start: int = 0,
        key: bytes | None = None,
        parent: BlockHandle | None = None,
    ) -> Match:
        """Walk the prompt's chain from the root and return the verified cached prefix.

        Stops at the first block that is not a verified hit. Does not take references: the allocator
        does that under the same lock. ``start``, ``key`` and ``parent``: begin at block ``start`` of
        the prompt, chaining from ``key`` after the block ``parent`` (the end of a shared prefix).
        """
        raw = token_bytes if type(token_bytes) is bytes else bytes(token_bytes)
        ctx, root = self.canonical(ctx)
        key = root if key is None else key
        bb = self.block_bytes
        span = (start * bb, min(max_blocks * bb, len(raw)))
        walk = self._walk_compiled if self.compiled else self._walk_python
        return walk(ctx, raw, span, key, parent)

    def _walk_compiled(
        self, ctx: CacheContext, raw: bytes, span: tuple[int, int], key: bytes, parent: BlockHandle | None
    ) -> Match:
        """:meth:`lookup` by the C walk, which takes what the Python walk's fast path takes and returns
        at the first block it cannot (``cand``: that block's entry, None at a miss or the end);
        :meth:`verify` decides then."""
        walk, index, bb, fenced = _prefix_walk.walk, self.index, self.block_bytes, BlockState.FENCED
        pos, end = span
        matched = key
        blocks: list[KVBlock] = []
        while True:
            pos, key, matched, parent, cand = walk(
                index, raw, pos, end, bb, key, matched, ctx, parent, fenced, blocks
            )
            if cand is None or not self._verified(cand, ctx, parent, raw[pos : pos + bb]):
                return Match(blocks, matched)
            blocks.append(cand)
            matched = key
            parent = cand.cache_handle
            pos += bb

    def _walk_python(
        self, ctx: CacheContext, raw: bytes, span: tuple[int, int], key: bytes, parent: BlockHandle | None
    ) -> Match:
        """:meth:`lookup` in Python (BLAKE2b, an injected hash_fn, or no compiled module). The prompt's
        full blocks come from one C call per window of blocks (no slicing per block, and at most a
        window split in vain when the walk stops early). Each block is checked on a fast path first:
        the interned context, the very parent handle object the previous block carries (or the
        caller's), the same tokens byte for byte, usable. Anything else goes through :meth:`verify`,
        which compares by value and counts what it refuses."""
        get, split, hf = self.index.get, self._split.findall, self.hash_fn
        fenced = BlockState.FENCED
        matched = key
        blocks: list[KVBlock] = []
        append = blocks.append
        pos, end = span
        step = SPLIT_WINDOW * self.block_bytes
        while pos < end:
            stop = min(end, pos + step)
            for chunk in split(raw, pos, stop):
                key = hf(key, chunk)
                cand = get(key)
                if cand is None or (
                    (
                        cand.context is not ctx
                        or cand.parent is not parent
                        or cand.tokens != chunk
                        or cand.state is fenced
                    )
                    and not self._verified(cand, ctx, parent, chunk)
                ):
                    return Match(blocks, matched)
                append(cand)
                matched = key
                parent = cand.cache_handle
            pos = stop
        return Match(blocks, matched)

    def _verified(self, cand: KVBlock, ctx: CacheContext, parent: BlockHandle | None, chunk: bytes) -> bool:
        verdict = self.verify(cand, ctx, parent, chunk)
        if verdict is Verdict.HIT:
            return True
        self._count(verdict)
        return False

    def insert(
        self,
        block: KVBlock,
        key: bytes,
        ctx: CacheContext,
        parent: BlockHandle | None,
        tokens: bytes | memoryview,
    ) -> KVBlock | None:
        """Register ``block`` (full and computed) under ``key``.

        Returns the block now canonical for ``key``: ``block`` itself, or an equal block already
        registered (``block`` then stays private). Returns None if another, *different* block holds
        the key (a collision, counted): the caller stops registering this chain.
        """
        existing = self.index.get(key)
        if existing is not None:
            verdict = self.verify(existing, ctx, parent, tokens)
            if verdict in (Verdict.HIT, Verdict.MISS) and existing.context is not None:
                return existing
            self._count(verdict)
            return None
        block.block_hash = key
        block.context = self.canonical(ctx)[0]
        block.parent = parent
        block.tokens = bytes(tokens)
        block.cache_handle = BlockHandle(block.block_id, block.generation)
        self.index[key] = block
        return block

    def remove(self, block: KVBlock) -> None:
        """Drop ``block``'s entry (on eviction)."""
        key = block.block_hash
        if key is not None and self.index.get(key) is block:
            del self.index[key]
        block.clear_cache_entry()
