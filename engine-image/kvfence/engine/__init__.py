"""kvfence.engine: what runs inside a trust class's engine pod.

* the isolation core, pure Python: :mod:`~kvfence.engine.blocks`, :mod:`~kvfence.engine.quotas`,
  :mod:`~kvfence.engine.eviction`, :mod:`~kvfence.engine.prefix_cache`,
  :mod:`~kvfence.engine.allocator`, :mod:`~kvfence.engine.metrics`;
* the engine configuration the operator renders: :mod:`~kvfence.contract.engine_config`;
* the CPU reference engine: :mod:`~kvfence.engine.model`, :mod:`~kvfence.engine.engine` and the
  OpenAI-compatible server :mod:`~kvfence.engine.server` (``kvfence-engine``).

See ``docs/engine.md``.
"""
