"""Declared shared prefixes: what every tenant of a trust class may share, and nothing else.

A trust class may declare prefixes its applications send on every request (system prompts, tool
preambles): text that is not secret. The engine renders each one as its requests render it (the
completion prompt, or the chat template's leading system message), computes it once at start (and when
the declaration changes), and *pins* the full blocks inside it:

* **declared, not guessed**: only a declared prefix is shared; nothing is inferred from traffic.
* **exact**: a request shares the pinned blocks only if its tokens begin with the *whole* rendered
  prefix, compared token for token (:meth:`Pinned.starts` and again in the allocator); a prompt that
  matches part of a prefix shares nothing.
* **block-aligned**: the shared part ends at the last full block inside the prefix. From the next block
  on, every key is the tenant's own (its chain starts at the tenant's root key and the last shared
  block's key), exactly as without shared prefixes.
* **no timing channel**: pinned blocks are held by a sequence that never ends, charged to
  :data:`~kvfence.isolation.quotas.SHARED_OWNER` (outside every tenant's quota) and never cold, so never
  evicted: a declared prefix is a hit for every tenant on every request, and its latency says nothing
  about what other tenants sent.

Pinned blocks live in their own cache namespace, ``shared/<trust class>``, which no tenant's requests
use; each served model (the base model and every adapter) gets its own pinned copy, since an adapter
changes the KV a prefix produces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvfence.contract.engine_config import SharedPrefixConfig
from kvfence.isolation.blocks import BlockHandle, KVBlock

IntArray = npt.NDArray[np.int32]


class Tokenizer(Protocol):
    """What :func:`render` needs of a tokenizer (the reference engine's ``ByteTokenizer``)."""

    def encode(self, text: str) -> IntArray: ...

    def chat_messages(self, messages: Sequence[tuple[str, str]]) -> str: ...


def shared_namespace(trust_class: str) -> str:
    """The cache namespace of pinned shared-prefix blocks (tenant namespaces are ``tenant/...`` and
    ``class/...``: see :func:`kvfence.contract.cache_namespace`)."""
    return f"shared/{trust_class}"


def render(decl: SharedPrefixConfig, tokenizer: Tokenizer) -> IntArray:
    """The tokens every request carrying ``decl`` starts with."""
    if decl.form == "chat":
        return tokenizer.encode(tokenizer.chat_messages([("system", decl.text)]))
    return tokenizer.encode(decl.text)


@dataclass(frozen=True, slots=True, eq=False)
class Pinned:
    """One declared prefix, computed and pinned for one served model (adapter ``""``: the base)."""

    name: str
    adapter: str
    #: the whole rendered prefix (a request must start with all of it)
    tokens: IntArray
    #: the prefix's full blocks, held by the pinned sequence ``seq_id``
    blocks: tuple[KVBlock, ...]
    handles: tuple[BlockHandle, ...]
    #: each block's chained prefix-cache key (in the shared namespace)
    keys: tuple[bytes, ...]
    seq_id: tuple[str, str, str, int]
    #: ``tokens`` as little-endian int32, as the allocator compares prompts (computed once)
    token_bytes: bytes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_bytes", np.ascontiguousarray(self.tokens, dtype="<i4").tobytes())

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def starts(self, prompt: IntArray) -> bool:
        """Whether ``prompt`` begins with the whole prefix, token for token."""
        n = len(self.tokens)
        return len(prompt) >= n and bool(np.array_equal(prompt[:n], self.tokens))


class SharedPrefixes:
    """The pinned prefixes of one engine, by served model; read and replaced on the scheduler thread."""

    def __init__(self, pinned: Sequence[Pinned] = ()) -> None:
        self.pinned: tuple[Pinned, ...] = tuple(pinned)
        by_adapter: dict[str, list[Pinned]] = {}
        for p in self.pinned:
            by_adapter.setdefault(p.adapter, []).append(p)
        # Longest first: a prompt carrying two declared prefixes (one extending the other) shares the
        # longer one.
        self._by_adapter = {a: sorted(ps, key=lambda p: -len(p.tokens)) for a, ps in by_adapter.items()}

    def __len__(self) -> int:
        return len(self.pinned)

    @property
    def num_blocks(self) -> int:
        """Distinct pinned blocks (two prefixes that begin alike hold their common blocks once)."""
        return len({b.block_id for p in self.pinned for b in p.blocks})

    def match(self, adapter: str, prompt: IntArray) -> Pinned | None:
        """The longest pinned prefix of ``adapter`` that ``prompt`` begins with, token for token."""
        for p in self._by_adapter.get(adapter, ()):
            if p.starts(prompt):
                return p
        return None


__all__ = ["Pinned", "SharedPrefixes", "render", "shared_namespace"]
