"""Helpers of the engine suites: configurations, the cold-computation oracle, signed HTTP clients,
SSE and Prometheus parsing, and the engine started as a real subprocess on a free port."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from support.process import ManagedProcess

from kvfence.contract import Identity, cache_namespace, derive_cache_salt, sign
from kvfence.contract.engine_config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.engine.model import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
TRUST_CLASS = "gold"
TOKENIZER = ByteTokenizer()


def config_dict(key_dir: Path | str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "trustClass": TRUST_CLASS,
        "model": {"name": "kvfence/tiny", "revision": "1", "servedName": "tiny"},
        "adapters": ["bot"],
        "blockSize": 16,
        "numBlocks": 512,
        "maxModelLen": 320,
        "signingKeyDir": str(key_dir),
        "listen": {"host": "127.0.0.1", "port": 0},
    }
    base.update(over)
    return base


def make_config(key_dir: Path | str = "/nonexistent", **over: Any) -> EngineConfig:
    return EngineConfig.model_validate(config_dict(key_dir, **over))


def cold_config(cfg: EngineConfig) -> EngineConfig:
    """The same engine with the prefix cache off: the oracle every warm output is compared with."""
    data = cfg.model_dump(by_alias=True, mode="json")
    data["prefixCache"]["enabled"] = False
    data["prefixCache"]["sharedPrefixes"] = []
    data["quotas"] = {}
    data["numBlocks"] = max(64, data["maxModelLen"] // data["blockSize"] + 2)
    return EngineConfig.model_validate(data)


class Oracle:
    """Cold computations (no cache), memoised by (adapter, prompt, max_tokens)."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.engine = Engine(cold_config(cfg))
        self._memo: dict[tuple[str, bytes, int], list[int]] = {}

    def tokens(self, prompt: np.ndarray[Any, Any], max_tokens: int, adapter: str = "") -> list[int]:
        k = (adapter, prompt.tobytes(), max_tokens)
        if k not in self._memo:
            out, end = self.engine.generate("oracle", prompt, max_tokens, adapter=adapter)
            assert type(end).__name__ == "Finished", end
            self._memo[k] = out
        return self._memo[k]

    def text(self, prompt_text: str, max_tokens: int, adapter: str = "") -> str:
        return TOKENIZER.decode(self.tokens(TOKENIZER.encode(prompt_text), max_tokens, adapter))

    def chat_text(self, messages: list[tuple[str, str]], max_tokens: int, adapter: str = "") -> str:
        return self.text(TOKENIZER.chat_prompt(messages), max_tokens, adapter)


@dataclass
class Signer:
    key: bytes
    trust_class: str = TRUST_CLASS
    scope: str = "Tenant"

    def identity(self, tenant: str) -> Identity:
        return Identity(tenant, self.trust_class, cache_namespace(self.trust_class, tenant, self.scope))

    def headers(
        self,
        tenant: str,
        method: str,
        path: str,
        body: bytes,
        *,
        now: float | None = None,
        nonce: str | None = None,
    ) -> dict[str, str]:
        return sign(self.key, self.identity(tenant), method, path, body, now=now, nonce=nonce)

    def salt(self, tenant: str) -> str:
        ident = self.identity(tenant)
        return derive_cache_salt(self.key, ident.trust_class, ident.namespace)


@dataclass
class Reply:
    status: int
    text: str
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.text)

    @property
    def error(self) -> dict[str, Any]:
        err: dict[str, Any] = self.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err


class Client:
    """Signs and sends requests to an engine at ``base`` (one aiohttp session per call batch)."""

    def __init__(self, base: str, signer: Signer) -> None:
        self.base = base
        self.signer = signer

    async def send(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: Any = None,
        *,
        tenant: str = "acme",
        method: str = "POST",
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        signed: bool = True,
    ) -> Reply:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        h = dict(headers or {})
        if signed and headers is None:
            h.update(self.signer.headers(tenant, method, path, data))
        h.setdefault("Content-Type", "application/json")
        async with session.request(method, self.base + path, data=data or None, headers=h) as r:
            return Reply(r.status, await r.text(), {k.lower(): v for k, v in r.headers.items()})

    def run(self, coro_fn: Callable[[aiohttp.ClientSession], Any]) -> Any:
        async def main() -> Any:
            conn = aiohttp.TCPConnector(limit=256)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
                return await coro_fn(s)

        return asyncio.run(main())

    def one(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return self.run(lambda s: self.send(s, path, body, **kw))  # type: ignore[no-any-return]


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded ("[DONE]" kept as the string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


class EngineProcess:
    """``python -m kvfence.engine --config FILE`` on a port of its choosing (``--port-file``)."""

    def __init__(self, config_path: Path, port_file: Path, log_path: Path) -> None:
        self.log_path = log_path
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "engine-image"), str(ROOT / "operator")]),
        }
        args = [sys.executable, "-m", "kvfence.engine", "--config", str(config_path)]
        self.process = ManagedProcess(
            [*args, "--port-file", str(port_file)], log_path, env=env, cwd=ROOT, grace=30
        ).start()
        self.process.wait_ready(port_file.exists, "the engine's port file", timeout=60)
        self.port = int(port_file.read_text())
        self.base = f"http://127.0.0.1:{self.port}"

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.process.popen is not None
        return self.process.popen

    def stop(self) -> int:
        code = self.process.stop()
        assert code is not None
        return code


class InProcessServer:
    """The HTTP server in this process (its own event loop thread) on a real socket, so a test can
    inject a hash function and inspect the allocator directly."""

    def __init__(self, server: Any) -> None:
        import threading

        from aiohttp import web

        self.server = server
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.port = 0

        async def main() -> None:
            runner = web.AppRunner(server.app(), shutdown_timeout=5.0)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        server.engine.start()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(main(),), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("in-process server did not start")
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self.server.engine.stop(10)
