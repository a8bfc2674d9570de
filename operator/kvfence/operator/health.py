"""The operator's HTTP endpoints: ``/healthz`` (alive: the event loop ticks), ``/readyz`` (leading, and
the first routing decision is made) and ``/metrics`` (Prometheus), served also while a replica waits
for the lease."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfence.operator import metrics

#: /healthz fails when a leading replica's event loop has not ticked for this long.
HEARTBEAT_STALE_SECONDS = 60.0
#: How often the event loop's heartbeat ticks.
HEARTBEAT_SECONDS = 2.0


class Health:
    def __init__(self) -> None:
        self.heartbeat = time.monotonic()
        self.leading = threading.Event()
        self.ready = threading.Event()

    def alive(self) -> bool:
        return not self.leading.is_set() or time.monotonic() - self.heartbeat < HEARTBEAT_STALE_SECONDS

    async def beat(self, routing_ready: Callable[[], bool]) -> None:
        """Tick from the event loop; ready once ``routing_ready()`` (the first decision is made)."""
        while True:
            self.heartbeat = time.monotonic()
            if routing_ready():
                self.ready.set()
            await asyncio.sleep(HEARTBEAT_SECONDS)


def serve_health(port: int, host: str, health: Health) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/metrics"):
                body, ctype, code = generate_latest(metrics.REGISTRY), CONTENT_TYPE_LATEST, 200
            elif self.path.startswith("/healthz"):
                ok = health.alive()
                body, ctype, code = (b"ok\n" if ok else b"stale\n"), "text/plain", 200 if ok else 503
            elif self.path.startswith("/readyz"):
                ok = health.ready.is_set()
                body, ctype, code = (b"ok\n" if ok else b"not leading\n"), "text/plain", 200 if ok else 503
            else:
                body, ctype, code = b"not found\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
