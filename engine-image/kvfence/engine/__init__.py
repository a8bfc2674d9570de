"""kvfence.engine: what runs inside a trust class's engine pod.

* the isolation core (blocks, quotas, eviction, prefix cache, allocator, shared prefixes, fair share,
  the request guard, the metrics) it shares with the vLLM plugin lives in :mod:`kvfence.isolation`;
* the CPU reference engine: :mod:`~kvfence.engine.model`, :mod:`~kvfence.engine.engine`, the
  OpenAI-compatible server :mod:`~kvfence.engine.server` with its request/response shapes
  (:mod:`~kvfence.engine.openai`) and config reloads (:mod:`~kvfence.engine.reload`), and the command
  line :mod:`~kvfence.engine.cli` (``kvfence-engine``).

The engine configuration the operator renders is part of the contract:
:mod:`~kvfence.contract.engine_config`.

See ``docs/engine.md``.
"""
