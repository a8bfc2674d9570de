"""The asynchronous side of kvfence's Kubernetes client: paged lists, watches, and the list-then-watch
loop that keeps a view of some objects current.

:class:`AsyncApi` is one aiohttp session on a :class:`~kvfence.kube.connection.Connection`;
:func:`follow` is the loop the router's routing Secret and EndpointSlice sources run: list, hand over
the items, watch from the list's version and hand over every event, and list again when the watch ends
or its version has expired; other errors are logged and retried with a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from kvfence.kube.connection import Connection

log = logging.getLogger("kvfence.kube.watch")

Obj = dict[str, Any]
#: Seconds a single watch lasts before the server ends it (the follower then lists again).
WATCH_SECONDS = 240
#: Objects per page of a list.
LIST_PAGE = 500


class ApiError(Exception):
    """An error status from the API server (on a request, or as a watch's ERROR event)."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        message = body
        with contextlib.suppress(ValueError, AttributeError):
            message = str(json.loads(body).get("message", body))
        super().__init__(f"{status}: {message[:300]}")


class AsyncApi:
    """GET, paged LIST and WATCH on one API server (a session opened on first use)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            ctx = self.conn.ssl_context()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ctx if ctx is not None else False, limit=0)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, path: str, params: Mapping[str, str], *, accept: str = "application/json") -> Obj:
        async with self.session().get(
            self.conn.server + path,
            params=dict(params),
            headers=self.conn.headers(accept),
            timeout=aiohttp.ClientTimeout(total=60),
        ) as resp:
            if resp.status >= 300:
                raise ApiError(resp.status, await resp.text())
            out: Obj = await resp.json()
            return out

    async def pages(
        self, path: str, params: Mapping[str, str], *, accept: str = "application/json"
    ) -> AsyncIterator[Obj]:
        """Every page of a list (``limit``/``continue``), each a whole ``...List`` object."""
        query = {**params, "limit": str(LIST_PAGE)}
        while True:
            page = await self.get(path, query, accept=accept)
            yield page
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                return
            query = {**params, "limit": str(LIST_PAGE), "continue": cont}

    async def list(self, path: str, params: Mapping[str, str]) -> tuple[list[Obj], str]:
        """Every item, and the list's resourceVersion (to watch from)."""
        items: list[Obj] = []
        version = ""
        async for page in self.pages(path, params):
            items.extend(page.get("items") or ())
            version = str((page.get("metadata") or {}).get("resourceVersion", ""))
        return items, version

    async def watch(
        self,
        path: str,
        params: Mapping[str, str],
        resource_version: str,
        *,
        accept: str = "application/json",
        seconds: int = WATCH_SECONDS,
        bookmarks: bool = False,
    ) -> AsyncIterator[tuple[str, Obj]]:
        """``(type, object)`` for every event from ``resource_version`` on, until the server ends the
        watch after ``seconds``. An ERROR event raises :class:`ApiError` (410: the version expired)."""
        query = {
            **params,
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(seconds),
        }
        if bookmarks:
            query["allowWatchBookmarks"] = "true"
        async with self.session().get(
            self.conn.server + path,
            params=query,
            headers=self.conn.headers(accept),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=seconds + 60),
        ) as resp:
            if resp.status >= 300:
                raise ApiError(resp.status, await resp.text())
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event: Obj = json.loads(line)
                    kind, obj = str(event.get("type")), event.get("object") or {}
                    if kind == "ERROR":
                        raise ApiError(int(obj.get("code") or 500), json.dumps(obj))
                    yield kind, obj


async def follow(
    api: AsyncApi,
    path: str,
    params: Mapping[str, str],
    on_list: Callable[[list[Obj]], None],
    on_event: Callable[[str, Obj], None],
    *,
    what: str,
    forbidden_hint: str,
) -> None:
    """List, then watch from the listed version, forever (until cancelled): ``on_list(items)`` after
    every list, ``on_event(type, object)`` for every ADDED/MODIFIED/DELETED. A watch that ends lists
    again; an expired version (410) lists again at once; any other error is logged (with
    ``forbidden_hint`` on 401/403) and retried with a backoff up to 30 s."""
    backoff = 1.0
    while True:
        try:
            items, version = await api.list(path, params)
            on_list(items)
            del items
            async for kind, obj in api.watch(path, params, version):
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    on_event(kind, obj)
            backoff = 1.0
            continue  # the watch ended normally: list again, then watch again
        except ApiError as e:
            if e.status == 410:  # the resource version is too old: list again at once
                continue
            hint = f" ({forbidden_hint})" if e.status in (401, 403) else ""
            log.error("%s failed: %s%s", what, e, hint)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.error("%s failed: %s: %s", what, type(e).__name__, e)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 30.0)
