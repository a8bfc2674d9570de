"""Refusals the kvfence scheduler decides in vLLM's engine core, answered by the middleware.

vLLM has no path from its engine core to a client-facing 4xx: a request the scheduler finishes with an
error reaches the client as vLLM's generic ``500 Internal server error`` (or, streamed, a ``data:``
error event). So the two kvfence halves pass the reason beside vLLM:

* the middleware gives every request it forwards a reference (:func:`new_ref`, 32 random hex digits,
  in ``vllm_xargs``: :data:`~kvfence.contract.XARG_REQUEST_REF`; the router refuses any client
  ``vllm_xargs``, so the reference is always the middleware's);
* the scheduler, refusing a request, writes the answer (status, OpenAI error code, message) under that
  reference into a directory next to the stats file (:meth:`RefusalBox.put`, an atomic rename) *before*
  it finishes the request, so the file exists by the time vLLM's error reaches the middleware;
* the middleware, seeing vLLM's error answer for a request, takes the file (:meth:`RefusalBox.take`)
  and answers with it instead, as the reference engine would (for a prompt beyond the tenant's KV
  maximum: ``400 max_kv_blocks_exceeded``).

Refusals are rare; a file whose request went away (the client disconnected) is removed by the next
:meth:`RefusalBox.put` once older than :data:`MAX_AGE`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from kvfence.contract.errors import error_body, error_type
from kvfence.vllm.stats import stats_path

log = logging.getLogger("kvfence.vllm.refusals")

#: seconds a refusal waits for its middleware before the next refusal removes it
MAX_AGE = 300.0
_REF = re.compile(r"[0-9a-f]{32}")


def new_ref() -> str:
    return secrets.token_hex(16)


def valid_ref(ref: object) -> bool:
    return isinstance(ref, str) and _REF.fullmatch(ref) is not None


@dataclass(frozen=True)
class EngineRefusal:
    """An OpenAI error answer: HTTP status, ``error.code`` and ``error.message``."""

    status: int
    code: str
    message: str

    def body(self) -> bytes:
        """The answer's JSON, as a whole body or as a stream's error event."""
        return error_body(self.message, self.code, error_type(self.status))


class RefusalBox:
    """One file per refused request, named by its reference, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def from_env(cls) -> RefusalBox:
        """Next to the stats file (``KVFENCE_VLLM_STATS_FILE``): both vLLM processes see the same one."""
        stats = stats_path()
        return cls(stats.with_name(stats.name + ".refusals"))

    def put(self, ref: str, refusal: EngineRefusal) -> bool:
        """Leave ``refusal`` for the middleware (engine core). False (logged) if it cannot be written:
        the client then gets vLLM's generic error, the refusal itself stands."""
        if not valid_ref(ref):
            return False
        doc = {"status": refusal.status, "code": refusal.code, "message": refusal.message}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._prune()
            tmp = self.directory / f".{ref}.tmp"
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.directory / ref)
        except OSError as e:
            log.warning("kvfence: refusal of request %s not passed to the middleware: %s", ref, e)
            return False
        return True

    def take(self, ref: str) -> EngineRefusal | None:
        """The refusal left for ``ref``, removed (middleware); None if there is none."""
        if not valid_ref(ref):
            return None
        path = self.directory / ref
        try:
            doc = json.loads(path.read_text())
            path.unlink()
            return EngineRefusal(int(doc["status"]), str(doc["code"]), str(doc["message"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("kvfence: refusal of request %s unreadable: %s", ref, e)
            return None

    def _prune(self) -> None:
        cutoff = time.time() - MAX_AGE
        for p in self.directory.iterdir():
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
            except OSError:
                pass  # taken meanwhile


__all__ = ["MAX_AGE", "EngineRefusal", "RefusalBox", "new_ref", "valid_ref"]
