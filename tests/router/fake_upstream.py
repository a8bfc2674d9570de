"""A small real upstream for router tests: an aiohttp app, run as its own process.

It speaks the engine side of the contract (``kvfence.contract.Verifier``: signature, skew, replay;
the body's ``cache_salt`` must equal the salt derived from the signed identity), answers
``/v1/completions`` and ``/v1/chat/completions`` deterministically (streamed or not), and records what
it received so that tests can check what the router sent. Test controls under ``/control/``.

A prompt that starts with ``SILENT`` is never answered (a hung engine). A prompt (or the first of a
list of prompts) that starts with ``GATED`` streams its first chunk, then waits until
``POST /control/release`` before sending the rest: a test can prove chunk-by-chunk relaying, or hold
a request in flight, without timing anything. A prompt that starts with ``DROP`` is recorded, then
its connection is closed unanswered (a query of death); one that starts with ``FLOOD`` is streamed a
64 MiB answer (for clients that stop reading); one that starts with ``BUSY`` is answered 429 with
``Retry-After: 7`` (an engine whose tenant quota is full).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
from typing import Any

from aiohttp import web

from kvfence.contract import SignatureError, Verifier


def answer_text(model: str, prompt: str, max_tokens: int) -> list[str]:
    digest = hashlib.sha256(f"{model}\x00{prompt}".encode()).hexdigest()
    return [digest[i % 64] for i in range(max_tokens)]


def make_app(trust_class: str, keys: list[bytes]) -> web.Application:
    verifier = Verifier(trust_class, keys)
    app = web.Application()
    state: dict[str, Any] = {"healthy": True, "requests": [], "gate": asyncio.Event(), "waiting": 0}

    async def health(request: web.Request) -> web.Response:
        return web.Response(
            status=200 if state["healthy"] else 503, text="ok" if state["healthy"] else "down"
        )

    async def control_health(request: web.Request) -> web.Response:
        state["healthy"] = bool((await request.json())["ok"])
        return web.json_response({"healthy": state["healthy"]})

    async def control_requests(request: web.Request) -> web.Response:
        return web.json_response(state["requests"])

    async def control_release(request: web.Request) -> web.Response:
        state["gate"].set()
        state["gate"] = asyncio.Event()
        return web.json_response({"released": True})

    async def control_waiting(request: web.Request) -> web.Response:
        return web.json_response({"waiting": state["waiting"]})

    async def infer(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            verified = verifier.verify(request.headers, request.method, request.path, raw)
        except SignatureError as e:
            return web.json_response(
                {"error": {"message": str(e), "type": e.reason, "param": None, "code": "bad_signature"}},
                status=401,
            )
        body = json.loads(raw)
        state["requests"].append(
            {
                "headers": dict(request.headers),
                "body": body,
                "path": request.path,
                "identity": [verified.identity.tenant, verified.identity.namespace],
            }
        )
        if body.get("cache_salt") != verified.cache_salt:
            return web.json_response(
                {
                    "error": {
                        "message": "cache_salt mismatch",
                        "type": "invalid_request_error",
                        "param": "cache_salt",
                        "code": "bad_salt",
                    }
                },
                status=400,
            )
        if request.path.endswith("/chat/completions"):
            prompt = json.dumps(body.get("messages"), sort_keys=True)
        else:
            prompt = str(body.get("prompt"))
        first = body.get("prompt")
        gated = str(first[0] if isinstance(first, list) and first else prompt).startswith("GATED")
        model = str(body.get("model"))
        max_tokens = body.get("max_tokens")
        max_tokens = min(max_tokens, 1000) if isinstance(max_tokens, int) and max_tokens > 0 else 8
        pieces = answer_text(model, prompt, max_tokens)
        usage = {
            "prompt_tokens": len(prompt.encode()),
            "completion_tokens": len(pieces),
            "total_tokens": len(prompt.encode()) + len(pieces),
        }
        echo = {"tenant": verified.identity.tenant, "namespace": verified.identity.namespace}
        if prompt.startswith("SILENT"):  # a hung engine: accepts the request, never answers
            await asyncio.sleep(3600)
        if prompt.startswith("DROP") and request.transport is not None:
            # An engine that dies of this request: the connection closes, nothing answered.
            request.transport.abort()
            return web.Response(status=500)
        if prompt.startswith("BUSY"):  # the engine's own 429: waiting cures it, and it says how long
            error = {"message": "busy", "type": "rate_limit_error", "param": None, "code": "quota_exceeded"}
            return web.json_response({"error": error}, status=429, headers={"Retry-After": "7"})
        if prompt.startswith("COOKIE"):  # an engine (or something in front of it) setting a cookie
            resp = web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": model,
                    "usage": usage,
                    "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                }
            )
            resp.set_cookie("session", f"secret-of-{verified.identity.tenant}")
            return resp
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": model,
                    "choices": [{"index": 0, "text": "".join(pieces), "finish_reason": "length"}],
                    "usage": usage,
                    "kvfence_echo": echo,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if prompt.startswith("FLOOD"):  # a long answer: 64 MiB of events, as fast as they are taken
            event = b"data: " + json.dumps({"choices": [{"text": "x" * 65000}]}).encode() + b"\n\n"
            for _ in range(1024):
                await resp.write(event)
            await resp.write_eof()
            return resp
        for i, piece in enumerate(pieces):
            chunk = {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": model,
                "choices": [{"index": 0, "text": piece, "finish_reason": None}],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i == 0 and gated:
                gate = state["gate"]
                state["waiting"] += 1
                await gate.wait()
                state["waiting"] -= 1
        if (body.get("stream_options") or {}).get("include_usage"):
            last = {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app.router.add_get("/health", health)
    app.router.add_post("/control/health", control_health)
    app.router.add_get("/control/requests", control_requests)
    app.router.add_post("/control/release", control_release)
    app.router.add_get("/control/waiting", control_waiting)
    app.router.add_post("/v1/completions", infer)
    app.router.add_post("/v1/chat/completions", infer)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--trust-class", required=True)
    p.add_argument("--key-b64", action="append", required=True)
    a = p.parse_args()
    keys = [base64.b64decode(k) for k in a.key_b64]
    web.run_app(
        make_app(a.trust_class, keys),
        host="127.0.0.1",
        port=a.port,
        print=None,
        access_log=None,
        shutdown_timeout=0.5,
    )


if __name__ == "__main__":
    main()
