"""kvfence.isolation: the isolation core both engines import.

The reference engine (:mod:`kvfence.engine`) and the vLLM plugin (:mod:`kvfence.vllm`) enforce
the same per-tenant isolation with these modules, so neither imports the other:

* KV blocks, quotas and eviction: :mod:`~kvfence.isolation.blocks`,
  :mod:`~kvfence.isolation.quotas`, :mod:`~kvfence.isolation.eviction`;
* the per-tenant prefix cache (its SHA-256 walk also in C, ``_prefix_walk.c``):
  :mod:`~kvfence.isolation.prefix_cache`;
* the block allocator and operator-declared shared prefixes:
  :mod:`~kvfence.isolation.allocator`, :mod:`~kvfence.isolation.shared_prefixes`;
* the fair-share scheduling policy: :mod:`~kvfence.isolation.fairshare`;
* the contract check every engine runs on a request: :mod:`~kvfence.isolation.guard`;
* the isolation counters, under the names the wire contract fixes: :mod:`~kvfence.isolation.metrics`.

See ``docs/engine.md``.
"""
