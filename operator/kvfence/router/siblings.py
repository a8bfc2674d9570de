"""``--workers N``: one ``/metrics`` for the whole router, whichever worker answers the scrape.

Each worker keeps its own registry (the hot path stays lock-free). It also listens on an abstract
Unix socket (Linux: no file to create or clean up) named after a random token the supervisor draws
before forking, and answers every connection there with its metrics snapshot as JSON, then closes.
The worker that gets a scrape reads every sibling's snapshot at once and merges them into its own
(``RouterMetrics.merged``). A sibling that does not answer within ``SIBLING_TIMEOUT`` fails the
scrape (503, naming the worker) rather than export a partial sum that would look like a counter reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

from kvfence.router.metrics import RouterMetrics, Snapshot

log = logging.getLogger(__name__)

SIBLING_TIMEOUT = 2.0


class SiblingError(RuntimeError):
    """A sibling worker's metrics could not be read."""


def socket_name(token: str, worker: int) -> str:
    """The abstract socket (leading NUL) of ``worker`` among the workers forked with ``token``."""
    return f"\0kvfence-router-{token}-{worker}"


class Siblings:
    def __init__(self, token: str, worker: int, workers: int, metrics: RouterMetrics) -> None:
        self.token, self.worker, self.metrics = token, worker, metrics
        self.others = [i for i in range(workers) if i != worker]
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(socket_name(self.token, self.worker))
        self._server = await asyncio.start_unix_server(self._answer, sock=sock)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _answer(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(json.dumps(self.metrics.snapshot(), separators=(",", ":")).encode())
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the asking worker gave up (timeout) or is stopping
        finally:
            writer.close()

    async def _fetch(self, worker: int) -> Snapshot:
        # A socket of our own: uvloop's open_unix_connection(path) refuses abstract names (EINVAL).
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, socket_name(self.token, worker))
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except OSError as e:
            sock.close()
            raise SiblingError(f"router worker {worker} does not answer for its metrics: {e}") from e
        try:
            data = await reader.read()
        finally:
            writer.close()
        snapshot: Snapshot = json.loads(data)
        return snapshot

    async def render(self) -> bytes:
        """The merged exposition of every worker; raises SiblingError if one cannot be read."""
        try:
            snaps = await asyncio.wait_for(
                asyncio.gather(*(self._fetch(i) for i in self.others)), SIBLING_TIMEOUT
            )
        except TimeoutError as e:
            raise SiblingError(f"a router worker did not send its metrics within {SIBLING_TIMEOUT:g}s") from e
        except ValueError as e:  # bad JSON, or a metric this worker does not know
            raise SiblingError(f"a router worker sent unreadable metrics: {e}") from e
        try:
            return self.metrics.merged(snaps).render()
        except (ValueError, TypeError) as e:
            raise SiblingError(f"a router worker sent unreadable metrics: {e}") from e
