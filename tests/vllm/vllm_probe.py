"""Runs under a Python that has vLLM installed (never the project's venv): asks vLLM's own code about
what kvfence renders. Reads a JSON request on stdin, writes a JSON answer on stdout.

* ``argv``: lists of ``vllm serve`` arguments (as the operator renders them; the image's entrypoint is
  ``vllm serve``). Each is parsed the way ``vllm serve`` parses it: vLLM's top-level CLI parser with
  the ``serve`` subcommand (``ServeSubcommand``, whose parser is
  ``vllm.entrypoints.launchers.cli_args.make_arg_parser``), checked with the subcommand's ``validate``
  (``validate_parsed_serve_args``), the positional model applied as ``ServeSubcommand.cmd`` applies
  it, and turned into ``AsyncEngineArgs``; the answer holds the parsed values (the positional
  ``model_tag``, the ``scheduler_cls`` of the engine args, the warnings vLLM logged while parsing) or
  the parser's error.
* ``bodies``: request bodies as the middleware hands them to vLLM, validated with vLLM's own request
  models for the three salted endpoints.
* ``options``: every long option of ``vllm serve``'s parser (what ``engine.extraArgs`` could reach).
* ``fields``: the body fields of vLLM's request models for ``/v1/completions`` and
  ``/v1/chat/completions`` (what the router's request surface must classify).
* ``policy``: for the ``engine.extraArgs`` and ``engine.extraEnv`` allowlists: every option string of
  ``vllm serve``'s parser (short forms too), the variables of ``vllm.envs``, and for each argument of
  ``resolve`` the options vLLM's parser reads it as (``FlexibleArgumentParser``'s rewriting, then
  argparse's lookup, abbreviations included), or null.
* ``middleware``: vLLM's own middleware registration (``init_entrypoints_middleware``) applied to a
  FastAPI app with ``--middleware kvfence.vllm.middleware.KvfenceMiddleware``, exercised with
  signed and unsigned requests.

CPU-only machines: vLLM cannot infer a device without an accelerator, so the caller sets
``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch); argument parsing does not depend on the device.
Written for vLLM 0.32 (engine-image/vllm.env), where the server's argument parser lives in
``vllm.entrypoints.launchers.cli_args``.
"""

import contextlib
import io
import json
import logging
import sys
from typing import Any


class _Warnings(logging.Handler):
    """Collects what vLLM's loggers warn about (e.g. the deprecated ``--model`` option)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def parse_all(argvs: list[list[str]]) -> list[dict[str, Any]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # What vllm.entrypoints.cli.main.main builds for `vllm serve ...` (the other subcommands left out).
    cli = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(cli.add_subparsers(required=False, dest="subparser"))
    warned = _Warnings()
    logging.getLogger("vllm").addHandler(warned)

    out = []
    for argv in argvs:
        warned.messages.clear()
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = cli.parse_args(["serve", *argv])
            serve.validate(args)
            model_tag = args.model_tag
            if model_tag is not None:  # ServeSubcommand.cmd: the positional model takes precedence
                args.model = model_tag
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
                "model_tag": model_tag,
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
                "scheduler_cls": eng.scheduler_cls
                if isinstance(eng.scheduler_cls, str | None)
                else repr(eng.scheduler_cls),
                "max_num_seqs": eng.max_num_seqs,
                "warnings": list(warned.messages),
            }
        )
    logging.getLogger("vllm").removeHandler(warned)
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


def request_fields() -> dict[str, list[str]]:
    """The body fields of vLLM's own request models for the two paths the router forwards."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {
        "/v1/completions": sorted(CompletionRequest.model_fields),
        "/v1/chat/completions": sorted(ChatCompletionRequest.model_fields),
    }


def run_middleware(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's middleware loader around a FastAPI app, driven with Starlette's TestClient."""
    from fastapi import FastAPI, Request
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
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


def serve_options() -> list[str]:
    """Every long option ``vllm serve`` accepts (its parser, as :func:`parse_all` builds it)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand().subparser_init(cli.add_subparsers(required=False, dest="subparser"))
    return sorted({o for a in serve._actions for o in a.option_strings if o.startswith("--")})


def resolve(serve: Any, arg: str) -> list[str] | None:
    """The option strings of the action ``vllm serve`` reads ``arg`` (followed by a value) as."""
    import argparse
    from unittest import mock

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    seen: list[list[str]] = []

    def capture(self: Any, args: list[str], namespace: Any = None) -> Any:
        seen.append(list(args))
        raise SystemExit(0)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), contextlib.suppress(SystemExit):
        try:
            FlexibleArgumentParser.parse_args(serve, [arg, "1"])
        except Exception:  # e.g. --config: vLLM reads the file before argparse sees anything
            return None
    flag = next((a for a in seen[0] if a.startswith("-")), None) if seen else None
    if flag is None:
        return None
    try:
        found = serve._parse_optional(flag)
    except SystemExit:  # argparse: an ambiguous abbreviation
        return None
    if isinstance(found, list):  # Python >= 3.12: every match
        found = found[0] if len(found) == 1 else None
    if not found or found[0] is None:
        return None
    return list(found[0].option_strings)


def policy(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm.envs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand().subparser_init(cli.add_subparsers(required=False, dest="subparser"))
    with contextlib.redirect_stderr(io.StringIO()):
        resolved = {a: resolve(serve, a) for a in spec.get("resolve", [])}
    return {
        "option_strings": sorted({o for a in serve._actions for o in a.option_strings}),
        "envs": sorted(vllm.envs.environment_variables),
        "resolved": resolved,
    }


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
        if req.get("options"):
            answer["options"] = serve_options()
        if req.get("fields"):
            answer["fields"] = request_fields()
        if "policy" in req:
            answer["policy"] = policy(req["policy"])
        if "middleware" in req:
            answer["middleware"] = run_middleware(req["middleware"])
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
