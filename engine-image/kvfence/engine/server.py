"""The reference engine's OpenAI-compatible HTTP server (aiohttp).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /metrics``, ``GET /health``.

Every ``/v1/`` request must carry a valid router signature, checked by :class:`kvfence.isolation.guard.Guard`
(the same check, and the same refusals, as the vLLM middleware's). The
tenant, trust class and cache namespace come from the signed identity only; a body ``cache_salt`` must
equal the salt derived from that identity, and the namespace must be the one this engine's
prefix-cache scope gives the tenant.

The OpenAI request and response shapes are in :mod:`kvfence.engine.openai`, the config file's reloads
in :mod:`kvfence.engine.reload`, the command line in :mod:`kvfence.engine.cli`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from kvfence.contract import HEADER_SIGNATURE, Identity, Verified, derive_cache_salt
from kvfence.contract.engine_config import READY_PATH, ConfigError, EngineConfig
from kvfence.contract.errors import error_body, error_type
from kvfence.engine import openai
from kvfence.engine.engine import (
    Admitted,
    Engine,
    Event,
    Failed,
    Finished,
    Request,
    RequestError,
    Token,
)
from kvfence.engine.model import ByteTokenizer
from kvfence.engine.openai import ApiError
from kvfence.engine.reload import ConfigReloader
from kvfence.isolation.guard import Guard, KeySource, KeySourceError, Refusal, parse_body

log = logging.getLogger("kvfence.engine.server")

ENGINE_KEY: web.AppKey[EngineServer] = web.AppKey("kvfence_engine_server")


def _refused(r: Refusal) -> web.Response:
    headers = {k: v for k, v in r.headers() if k != "Content-Type"}
    return web.Response(body=r.body(), status=r.status, content_type="application/json", headers=headers)


def _guard(config: EngineConfig) -> Guard:
    """The contract check of this engine: its trust class, its keys, its prefix-cache scope."""
    keys = KeySource(config.trust_class, Path(config.signing_key_dir))
    try:
        return Guard(keys, scope=config.prefix_cache.scope, required=config.require_signature)
    except KeySourceError as e:
        raise ConfigError(str(e)) from None


class EngineServer:
    def __init__(
        self, config: EngineConfig, engine: Engine | None = None, *, config_path: str | None = None
    ) -> None:
        self.config = config
        self.engine = engine or Engine(config)
        self.metrics = self.engine.metrics
        self.guard = _guard(config)
        self.quotas = ConfigReloader(config_path, self) if config_path else None
        self.tokenizer = ByteTokenizer()
        self.created = int(time.time())

    # --- the contract (kvfence.isolation.guard) ---------------------------------------------------
    def authenticate(self, request: web.Request, body: bytes) -> Verified:
        if self.quotas is not None:
            self.quotas.check()
        signed = any(k.lower() == HEADER_SIGNATURE.lower() for k in request.headers)
        if not signed and not self.config.require_signature:
            tenant = "anonymous"
            ns = self.engine.expected_namespace(tenant)
            key = self.guard.current_key or b""
            return Verified(
                Identity(tenant, self.config.trust_class, ns),
                derive_cache_salt(key, self.config.trust_class, ns),
            )
        path, _, query = request.raw_path.partition("?")
        return self.guard.verify(request.method, path, query, request.headers.items(), body)

    # --- helpers ------------------------------------------------------------------------------------

    def resolve_model(self, data: dict[str, Any]) -> tuple[str, str]:
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(
                400, "you must provide a model parameter", type_="invalid_request_error", param="model"
            )
        adapter = self.engine.adapter_for(model)
        if adapter is None:
            raise ApiError(
                404,
                f"The model `{model}` does not exist.",
                type_="invalid_request_error",
                code="model_not_found",
                param="model",
            )
        return model, adapter

    # --- handlers -----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        body = await request.read()
        verified = self.authenticate(request, body)
        data = parse_body(body)
        self.guard.check_body(data, verified)
        model, adapter = self.resolve_model(data)
        stream = openai.stream_flag(data)
        include_usage = openai.include_usage(data) if stream else False
        max_tokens = openai.int_field(
            data, "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens", 16
        )
        if chat:
            text = self.tokenizer.chat_prompt(openai.chat_messages(data))
            param = "messages"
        else:
            text = openai.prompt_text(data)
            param = "prompt"
        prompt = self.tokenizer.encode(text)
        try:
            self.engine.check_lengths(len(prompt), max_tokens, param)
        except RequestError as e:
            raise ApiError(400, str(e), type_="invalid_request_error", code=e.code, param=e.param) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ident = verified.identity
        req = Request(
            rid, ident.tenant, self.engine.context(ident.namespace, adapter), prompt, max_tokens, sink
        )
        self.engine.submit(req)
        try:
            first = await events.get()
            if isinstance(first, Failed):
                raise openai.failed_error(first, param)
            assert isinstance(first, Admitted)
            if stream:
                return await self._stream(request, events, rid, model, chat, endpoint, include_usage)
            return await self._collect(events, rid, model, chat, endpoint)
        finally:
            self.engine.cancel(rid)  # no-op once finished; frees the blocks of an abandoned request

    async def _collect(
        self, events: asyncio.Queue[Event], rid: str, model: str, chat: bool, endpoint: str
    ) -> web.Response:
        ids: list[int] = []
        while True:
            ev = await events.get()
            if isinstance(ev, Token):
                ids.append(ev.token_id)
            elif isinstance(ev, Failed):
                raise ApiError(ev.status, ev.message, type_=error_type(ev.status), code=ev.code)
            elif isinstance(ev, Finished):
                break
        text = self.tokenizer.decode(ids)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": ev.reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.reason}
        self.metrics.requests.labels(endpoint, "200").inc()
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": openai.usage(ev),
            }
        )

    async def _stream(
        self,
        request: web.Request,
        events: asyncio.Queue[Event],
        rid: str,
        model: str,
        chat: bool,
        endpoint: str,
        include_usage: bool = False,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        decoder = self.tokenizer.incremental_decoder()

        def chunk(delta: str | None, finish: str | None, *, role: bool = False) -> bytes:
            c: dict[str, Any]
            if chat:
                d: dict[str, str] = {}
                if role:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            payload = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            await resp.write(chunk("", None, role=True))
        while True:
            ev = await events.get()
            if isinstance(ev, Token):
                text = decoder.decode(bytes([ev.token_id]) if ev.token_id < 256 else b"")
                if text:
                    await resp.write(chunk(text, None))
            elif isinstance(ev, Failed):
                err = error_body(ev.message, ev.code, error_type(ev.status))
                await resp.write(b"data: " + err + b"\n\n")
                break
            elif isinstance(ev, Finished):
                tail = decoder.decode(b"", final=True)
                await resp.write(chunk(tail if tail else (None if chat else ""), ev.reason))
                if include_usage:  # OpenAI's stream_options.include_usage: a last chunk, no choices
                    u = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
                    u["usage"] = openai.usage(ev)
                    await resp.write(b"data: " + json.dumps(u, separators=(",", ":")).encode() + b"\n\n")
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.metrics.requests.labels(endpoint, "200").inc()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        self.authenticate(request, await request.read())
        served = self.config.model.served
        data = [
            {
                "id": served,
                "object": "model",
                "created": self.created,
                "owned_by": "kvfence",
                "root": self.config.model.name,
                "parent": None,
            }
        ]
        data += [
            {
                "id": a,
                "object": "model",
                "created": self.created,
                "owned_by": "kvfence",
                "root": self.config.model.name,
                "parent": served,
            }
            for a in self.config.adapters
        ]
        return web.json_response({"object": "list", "data": data})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """The readiness probe: not ready while the config says its tenants' quotas are still to come
        (a new class's engine, started before the operator's routing decision; see
        ``EngineConfig.tenants_pending``): the Service sends it nothing until the kubelet has brought
        the file that holds them."""
        if self.quotas is not None:
            self.quotas.check()
        if self.config.tenants_pending:
            return web.json_response({"status": "waiting for the tenants' quotas"}, status=503)
        return web.json_response({"status": "ok"})

    # --- app ------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=8 * 1024 * 1024)
        app[ENGINE_KEY] = self
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/health", self.health)
        app.router.add_get(READY_PATH, self.ready)
        return app


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    server = request.app[ENGINE_KEY]
    endpoint = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(request.path, "other")
    try:
        return await handler(request)
    except ApiError as e:
        server.metrics.requests.labels(endpoint, str(e.status)).inc()
        return e.response()
    except Refusal as r:
        if r.counted:
            server.metrics.signature_rejected.labels(r.reason).inc()
        if r.cross_access:
            server.metrics.cross_access_rejected.inc()
        server.metrics.requests.labels(endpoint, str(r.status)).inc()
        return _refused(r)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        server.metrics.requests.labels(endpoint, str(e.status)).inc()
        return ApiError(e.status, e.reason, type_=error_type(e.status)).response()


async def serve(
    config: EngineConfig,
    *,
    server: EngineServer | None = None,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the server until ``stop`` is set (or SIGTERM/SIGINT); then drain and shut down."""
    server = server or EngineServer(config)
    server.engine.start()
    runner = web.AppRunner(server.app(), shutdown_timeout=30.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.listen.host, config.listen.port)
    await site.start()
    port = int(runner.addresses[0][1]) if runner.addresses else config.listen.port
    pc = server.engine.prefix_cache
    log.info(
        "kvfence engine for trust class %s listening on %s:%d (prefix-cache walk: %s)",
        config.trust_class,
        config.listen.host,
        port,
        pc.walk if pc is not None else "none",
    )
    if ready is not None:
        ready(port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not on the main thread
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining in-flight requests")
    await runner.cleanup()  # stops accepting, waits for in-flight handlers (shutdown_timeout)
    await asyncio.to_thread(server.engine.stop, 10.0)
    log.info("stopped")
