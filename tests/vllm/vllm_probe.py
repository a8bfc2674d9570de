"""Runs under a Python that has vLLM installed (never the project's venv): asks vLLM's own code about
what kvfence renders. Reads a JSON request on stdin, writes a JSON answer on stdout.

* ``argv``: lists of ``vllm serve`` arguments (as the operator renders them). Each is parsed with the
  OpenAI server's parser (``make_arg_parser``), checked with ``validate_parsed_serve_args`` and turned
  into ``AsyncEngineArgs``; the answer holds the parsed values or the parser's error.
* ``bodies``: request bodies as the middleware hands them to vLLM, validated with vLLM's own request
  models for the three salted endpoints.
* ``middleware``: vLLM's own middleware registration (``init_entrypoints_middleware``) applied to a
  FastAPI app with ``--middleware kvfence.vllm.middleware.KvfenceMiddleware``, exercised with
  signed and unsigned requests.

CPU-only machines: vLLM cannot infer a device without an accelerator, so the caller sets
``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch); argument parsing does not depend on the device.
"""

import contextlib
import io
import json
import sys
from typing import Any


def parse_all(argvs: list[list[str]]) -> list[dict[str, Any]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = []
    for argv in argvs:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
            validate_parsed_serve_args(args)
            eng = AsyncEngineArgs.from_cli_args(args)
        except SystemExit:
            out.append({"ok": False, "error": err.getvalue().strip().splitlines()[-1:]})
            continue
        except Exception as e:
            out.append({"ok": False, "error": [f"{type(e).__name__}: {e}"]})
            continue
        lora = [{"name": m.name, "path": m.path} for m in (args.lora_modules or [])]
        out.append(
            {
                "ok": True,
                "model": eng.model,
                "revision": eng.revision,
                "served_model_name": eng.served_model_name,
                "host": args.host,
                "port": args.port,
                "tensor_parallel_size": eng.tensor_parallel_size,
                "block_size": eng.block_size,
                "gpu_memory_utilization": eng.gpu_memory_utilization,
                "dtype": eng.dtype,
                "max_model_len": eng.max_model_len,
                "quantization": eng.quantization,
                "enable_prefix_caching": eng.enable_prefix_caching,
                "prefix_caching_hash_algo": eng.prefix_caching_hash_algo,
                "enable_lora": eng.enable_lora,
                "max_loras": eng.max_loras,
                "lora_modules": lora,
                "middleware": list(args.middleware),
                "max_num_seqs": eng.max_num_seqs,
            }
        )
    return out


def validate_bodies(bodies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    models = {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/responses": ResponsesRequest,
    }
    out: dict[str, Any] = {}
    for path, body in bodies.items():
        try:
            req = models[path].model_validate(body)
            out[path] = {"ok": True, "cache_salt": req.cache_salt}
        except Exception as e:
            out[path] = {"ok": False, "error": str(e)[:2000]}
    return out


def run_middleware(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's middleware loader around a FastAPI app, driven with Starlette's TestClient."""
    from fastapi import FastAPI, Request
    from starlette.testclient import TestClient
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(spec["argv"])
    app = FastAPI()
    seen: list[Any] = []

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body.get("cache_salt"))
        return {"cache_salt": body.get("cache_salt")}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    init_entrypoints_middleware(args, app, ("generate",))
    results = []
    with TestClient(app) as client:
        for r in spec["requests"]:
            resp = client.request(
                r["method"], r["path"], content=r.get("body", "").encode(), headers=r["headers"]
            )
            results.append({"status": resp.status_code, "body": resp.text[:500]})
    return {"results": results, "seen": seen}


def main() -> int:
    req = json.load(sys.stdin)
    answer: dict[str, Any] = {}
    # vLLM logs to stdout; keep stdout for the answer alone.
    with contextlib.redirect_stdout(sys.stderr):
        import vllm

        answer["vllm_version"] = vllm.__version__
        if "argv" in req:
            answer["argv"] = parse_all(req["argv"])
        if "bodies" in req:
            answer["bodies"] = validate_bodies(req["bodies"])
        if "middleware" in req:
            answer["middleware"] = run_middleware(req["middleware"])
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
