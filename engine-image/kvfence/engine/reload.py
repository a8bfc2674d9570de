"""The engine's config file, followed without a restart: what the operator changes without rolling
the engine's pods (per-tenant quotas, declared shared prefixes) is applied to the running engine."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvfence.contract.engine_config import ConfigError, file_stamp, load_config

if TYPE_CHECKING:
    from kvfence.engine.server import EngineServer

log = logging.getLogger("kvfence.engine.server")


class ConfigReloader:
    """Applies the per-tenant KV quotas and fair-share weights, declared shared prefixes and
    ``tenantsPending`` of a rewritten config file without a restart.

    The operator changes ``quotas`` in the engine's ConfigMap when a tenant is bound or its quota
    changes, and ``prefixCache.sharedPrefixes`` when the class's declared prefixes change, and
    deliberately does not roll the pods for either; every other field change does roll them, so only
    those two are taken from a new file (a change elsewhere is logged and otherwise ignored), with
    ``tenantsPending``, which the operator drops once a new class's tenants are in the file.
    """

    def __init__(self, path: str, server: EngineServer) -> None:
        self._path = Path(path)
        self._server = server
        self._stamp = file_stamp(self._path)
        self._file = load_config(path)  # as written, before any command-line override
        self._checked = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now - self._checked <= 1.0:
            return
        self._checked = now
        stamp = file_stamp(self._path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            new = load_config(str(self._path))
        except ConfigError as e:
            log.warning("config file changed but does not load; keeping the current quotas: %s", e)
            return
        old, self._file = self._file, new
        reloadable = {
            "tenants_pending": old.tenants_pending,
            "quotas": old.quotas,
            "prefix_cache": new.prefix_cache.model_copy(
                update={"shared_prefixes": old.prefix_cache.shared_prefixes}
            ),
        }
        if new.model_copy(update=reloadable) != old:
            log.warning(
                "config changed beyond quotas and sharedPrefixes: only those apply; restart for the rest"
            )
        if new.tenants_pending != old.tenants_pending:
            self._server.config = self._server.config.model_copy(
                update={"tenants_pending": new.tenants_pending}
            )
            log.info("config %s its tenants' quotas", "waits for" if new.tenants_pending else "now holds")
        if new.quotas != old.quotas:
            self._server.engine.allocator.set_quotas(new.quotas)
            self._server.engine.set_weights(new.quotas.default.weight, new.quotas.weights())
            self._server.config = self._server.config.model_copy(update={"quotas": new.quotas})
            log.info("applied new tenant quotas and weights (%d tenants listed)", len(new.quotas.tenants))
        shared = new.prefix_cache.shared_prefixes
        if shared != old.prefix_cache.shared_prefixes:
            self._server.engine.set_shared_prefixes(shared)
            pc = self._server.config.prefix_cache.model_copy(update={"shared_prefixes": shared})
            self._server.config = self._server.config.model_copy(update={"prefix_cache": pc})
            log.info("declared shared prefixes changed (%d listed): pinning them", len(shared))
