"""kvfence.engine: what runs inside a trust class's engine pod.

* the isolation core, Python (the prefix cache's SHA-256 walk also in C, ``_prefix_walk.c``):
  :mod:`~kvfence.engine.blocks`, :mod:`~kvfence.engine.quotas`,
  :mod:`~kvfence.engine.eviction`, :mod:`~kvfence.engine.prefix_cache`,
  :mod:`~kvfence.engine.allocator`, :mod:`~kvfence.engine.shared_prefixes`,
  :mod:`~kvfence.engine.metrics`;
* the contract check every engine runs (the reference engine and the vLLM middleware):
  :mod:`~kvfence.engine.guard`;
* the CPU reference engine: :mod:`~kvfence.engine.model`, :mod:`~kvfence.engine.engine`, the
  OpenAI-compatible server :mod:`~kvfence.engine.server` with its request/response shapes
  (:mod:`~kvfence.engine.openai`) and config reloads (:mod:`~kvfence.engine.reload`), and the command
  line :mod:`~kvfence.engine.cli` (``kvfence-engine``).

The engine configuration the operator renders is part of the contract:
:mod:`~kvfence.contract.engine_config`.

See ``docs/engine.md``.
"""
