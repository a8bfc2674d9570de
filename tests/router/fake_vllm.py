"""A stand-in for vLLM's OpenAI server with the kvfence vLLM middleware in front, run as its own
process (uvicorn on a real socket), for router tests of the ``runtime: vllm`` path.

The app plays vLLM's part: it takes the prefix-cache namespace from the body's ``cache_salt`` (that is
all stock vLLM looks at) and answers with what it saw. ``KvfenceMiddleware`` is loaded exactly as
``vllm serve --middleware kvfence.vllm.middleware.KvfenceMiddleware`` loads it (configured from
``KVFENCE_TRUST_CLASS`` and ``KVFENCE_SIGNING_KEY_DIR``).
"""

from __future__ import annotations

import argparse
import json

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvfence.vllm.middleware import KvfenceMiddleware


async def infer(request: Request) -> Response:
    body = json.loads(await request.body())
    seen = {
        "cache_salt": body.get("cache_salt"),
        "fields": sorted(body),
        "headers": sorted(k.lower() for k in request.headers),
    }
    text = f"salted:{body.get('cache_salt', '')[:8]}"
    if body.get("stream"):

        async def events():  # type: ignore[no-untyped-def]
            for ch in text:
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": ch}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    usage = {"prompt_tokens": 3, "completion_tokens": len(text), "total_tokens": 3 + len(text)}
    return JSONResponse(
        {
            "object": "text_completion",
            "choices": [{"index": 0, "text": text}],
            "usage": usage,
            "vllm_saw": seen,
        }
    )


async def health(request: Request) -> Response:
    return PlainTextResponse("")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    app = Starlette(
        routes=[
            Route("/v1/completions", infer, methods=["POST"]),
            Route("/v1/chat/completions", infer, methods=["POST"]),
            Route("/health", health),
        ],
        middleware=[Middleware(KvfenceMiddleware)],
    )
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
