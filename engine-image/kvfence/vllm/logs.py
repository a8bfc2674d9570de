"""kvfence's log lines in vLLM's output.

vLLM configures only its own ``vllm`` logger; records of the ``kvfence`` loggers (refusal reasons, key
and quota reloads, refused prefix hits) would reach no handler and vanish. :func:`ensure_handler` gives
the ``kvfence`` logger a handler in vLLM's format, once per process (the API server and the engine core
each call it).
"""

from __future__ import annotations

import logging
import os
import sys

ENV_LOG_LEVEL = "KVFENCE_LOG_LEVEL"
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def ensure_handler() -> logging.Logger:
    logger = logging.getLogger("kvfence")
    if not any(getattr(h, "_kvfence", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        handler._kvfence = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(os.environ.get(ENV_LOG_LEVEL, "INFO").upper())
        logger.propagate = False
    return logger
