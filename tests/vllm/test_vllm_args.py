"""The vLLM arguments the operator renders (``kvfence.operator.builders.vllm_args``), checked by vLLM's
own argument parser, and the middleware checked by vLLM's own middleware loader and request models.

Always runs, against the vLLM release pinned in engine-image/vllm.env (the CPU install of
tests/vllm/install-vllm.sh; see conftest.py, which fails these tests when there is none). It runs
that Python in a subprocess (tests/vllm/vllm_probe.py) because vLLM is not, and must not become, a
project dependency.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import manifests

from kvfence.api.policy import engine_args, engine_env
from kvfence.api.trustclass import TrustClass
from kvfence.contract import Identity, cache_namespace, derive_cache_salt, sign
from kvfence.operator.builders import vllm_args

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEY = bytes(range(32))


def trust_class(**engine: Any) -> TrustClass:
    prefix_cache = engine.pop("prefixCache", {"enabled": True})
    return TrustClass.model_validate(
        manifests.trust_class(
            "gold",
            engine={
                "runtime": "vllm",
                "image": "vllm/vllm-openai:v0.32.0",
                "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "main"},
                **engine,
            },
            prefixCache=prefix_cache,
        )
    )


CLASSES = {
    "default": trust_class(),
    "big": trust_class(
        model={"name": "meta-llama/Llama-3.1-70B-Instruct", "revision": "a1b2c3", "servedName": "llama-70b"},
        tensorParallelSize=4,
        blockSize=32,
        maxModelLen=8192,
        gpuMemoryUtilization=0.85,
        dtype="bfloat16",
        quantization="fp8",
        adapters=[
            {"name": "support-bot", "source": "/adapters/support-bot"},
            {"name": "sql", "source": "hf://org/sql-lora"},
        ],
        extraArgs=["--max-num-seqs", "64"],
        **manifests.ADAPTER_VOLUME,  # /adapters/support-bot is mounted where vLLM reads it
    ),
    "no-prefix-cache": trust_class(prefixCache={"enabled": False}, blockSize=16),
    # The GPU example of examples/ (what users copy).
    "example": TrustClass.model_validate(
        yaml.safe_load((ROOT / "examples" / "trustclass-vllm-gpu.yaml").read_text())
    ),
}


def pinned_vllm_version() -> str:
    for line in (ROOT / "engine-image" / "vllm.env").read_text().splitlines():
        if line.startswith("VLLM_VERSION="):
            return line.partition("=")[2].strip()
    raise AssertionError("engine-image/vllm.env has no VLLM_VERSION")


def probe(py: str, request: dict[str, Any]) -> dict[str, Any]:
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
        "PYTHONPATH": str(ROOT / "engine-image"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    res = subprocess.run(
        [py, str(HERE / "vllm_probe.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    answer: dict[str, Any] = json.loads(res.stdout)
    # The vLLM these tests ask is the release the GPU image is built on (engine-image/vllm.env).
    assert answer["vllm_version"].split("+")[0] == pinned_vllm_version(), (py, answer["vllm_version"])
    return answer


class Parsed:
    """vLLM's parse of every class's rendered args: one probe, run by the first test that asks (in its
    body, so that a missing vLLM fails the tests instead of erroring their setup)."""

    def __init__(self, vllm_python: Any) -> None:
        self.vllm_python = vllm_python
        self.answer: dict[str, dict[str, Any]] | None = None
        self.failed: str | None = None  # a probe that failed once is not run again for every test

    def __getitem__(self, name: str) -> dict[str, Any]:
        if self.failed is not None:
            pytest.fail(f"the probe failed (see the first test that asked): {self.failed}", pytrace=False)
        if self.answer is None:
            names = list(CLASSES)
            request = {"argv": [vllm_args(CLASSES[n]) for n in names]}
            try:
                argv = probe(self.vllm_python.require(), request)["argv"]
            except (AssertionError, subprocess.SubprocessError, json.JSONDecodeError) as e:
                self.failed = str(e).splitlines()[0][:500] if str(e) else type(e).__name__
                raise
            self.answer = dict(zip(names, argv, strict=True))
        return self.answer[name]


@pytest.fixture(scope="module")
def parsed(vllm_python: Any) -> Parsed:
    return Parsed(vllm_python)


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_model_is_the_positional_argument_and_the_kvfence_scheduler_is_on(
    parsed: Parsed, name: str
) -> None:
    args = vllm_args(CLASSES[name])
    assert "--model" not in args and not any(a.startswith("--model=") for a in args)
    p = parsed[name]
    assert p["ok"], p
    model = CLASSES[name].spec.engine.model.name
    assert args[0] == model and p["model_tag"] == model and p["model"] == model
    # vLLM 0.32 warns that --model will be removed; the rendered args draw no warning about it
    assert not [w for w in p["warnings"] if "--model" in w], p["warnings"]
    assert p["scheduler_cls"] == "kvfence.vllm.scheduler.FencedScheduler"
    assert p["middleware"] == ["kvfence.vllm.middleware.KvfenceMiddleware"]


def test_default_class_parses_with_sha256_prefix_caching_and_the_middleware(
    parsed: Parsed,
) -> None:
    p = parsed["default"]
    assert p["ok"], p
    assert p["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and p["revision"] == "main"
    assert p["enable_prefix_caching"] is True
    assert p["prefix_caching_hash_algo"] == "sha256"
    assert p["middleware"] == ["kvfence.vllm.middleware.KvfenceMiddleware"]
    assert p["scheduler_cls"] == "kvfence.vllm.scheduler.FencedScheduler"
    assert p["port"] == CLASSES["default"].spec.engine.port and p["host"] == "0.0.0.0"  # noqa: S104
    assert p["enable_lora"] in (None, False)
    # no blockSize in the class: no --block-size, vLLM's attention backend chooses (its CPU backend
    # refuses 16)
    assert CLASSES["default"].spec.engine.block_size is None
    assert p["block_size"] is None
    # no gpuMemoryUtilization in the class: no flag, and vLLM sizes its KV pool from its own default
    # (0.92 in the pinned vLLM 0.32)
    assert CLASSES["default"].spec.engine.gpu_memory_utilization is None
    assert "--gpu-memory-utilization" not in vllm_args(CLASSES["default"])
    assert p["gpu_memory_utilization"] == pytest.approx(0.92)


def test_big_class_parses_with_tp_block_size_lora_and_extra_args(parsed: Parsed) -> None:
    p = parsed["big"]
    assert p["ok"], p
    assert p["served_model_name"] == ["llama-70b"]
    assert p["revision"] == "a1b2c3"
    assert p["tensor_parallel_size"] == 4
    assert p["block_size"] == 32
    assert p["max_model_len"] == 8192
    assert p["gpu_memory_utilization"] == pytest.approx(0.85)
    assert p["dtype"] == "bfloat16" and p["quantization"] == "fp8"
    assert p["enable_lora"] is True and p["max_loras"] == 2
    assert p["lora_modules"] == [
        {"name": "support-bot", "path": "/adapters/support-bot"},
        {"name": "sql", "path": "hf://org/sql-lora"},
    ]
    assert p["max_num_seqs"] == 64
    assert p["prefix_caching_hash_algo"] == "sha256"


def test_the_gpu_example_parses(parsed: Parsed) -> None:
    p = parsed["example"]
    assert p["ok"], p
    assert p["served_model_name"] == ["qwen-7b"] and p["tensor_parallel_size"] == 2
    assert p["gpu_memory_utilization"] == pytest.approx(0.9)
    assert p["enable_prefix_caching"] is True and p["prefix_caching_hash_algo"] == "sha256"
    assert p["lora_modules"] == [{"name": "support-bot", "path": "/adapters/support-bot"}]
    assert p["middleware"] == ["kvfence.vllm.middleware.KvfenceMiddleware"]


def test_prefix_caching_off_parses(parsed: Parsed) -> None:
    p = parsed["no-prefix-cache"]
    assert p["ok"], p
    assert p["enable_prefix_caching"] is False
    # the fenced scheduler holds the tenants' KV quotas, with or without prefix caching
    assert p["scheduler_cls"] == "kvfence.vllm.scheduler.FencedScheduler"


def test_bodies_the_middleware_produces_are_valid_vllm_requests(vllm_python: Any) -> None:
    salt = derive_cache_salt(KEY, "gold", cache_namespace("gold", "alice", "Tenant"))
    bodies = {
        "/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 4, "cache_salt": salt},
        "/v1/chat/completions": {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "cache_salt": salt,
        },
        "/v1/responses": {"model": "m", "input": "hi", "cache_salt": salt},
    }
    answer = probe(vllm_python.require(), {"bodies": bodies})["bodies"]
    for path in bodies:
        assert answer[path]["ok"], answer[path]
        assert answer[path]["cache_salt"] == salt


def test_vllm_loads_the_middleware_and_it_guards_the_app(
    vllm_python: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "current").write_bytes(KEY)
    alice = Identity("alice", "gold", cache_namespace("gold", "alice", "Tenant"))
    body = json.dumps({"model": "m", "prompt": "x", "cache_salt": "chosen-by-client"}).encode()
    clean = json.dumps({"model": "m", "prompt": "x"}).encode()
    signed = sign(KEY, alice, "POST", "/v1/completions", clean, now=time.time())
    request = {
        "middleware": {
            "argv": ["m", "--middleware", "kvfence.vllm.middleware.KvfenceMiddleware"],
            "requests": [
                {"method": "POST", "path": "/v1/completions", "body": body.decode(), "headers": {}},
                {"method": "POST", "path": "/v1/completions", "body": clean.decode(), "headers": signed},
                {"method": "GET", "path": "/health", "headers": {}},
            ],
        }
    }
    monkeypatch.setenv("KVFENCE_TRUST_CLASS", "gold")
    monkeypatch.setenv("KVFENCE_SIGNING_KEY_DIR", str(tmp_path))
    answer = probe(vllm_python.require(), request)["middleware"]
    statuses = [r["status"] for r in answer["results"]]
    assert statuses == [401, 200, 200], answer
    assert answer["seen"] == [derive_cache_salt(KEY, "gold", alice.namespace)]


def _spellings(flag: str) -> list[str]:
    """``flag`` and the other ways to write it: ``_`` for ``-``, ``=value``, the dotted ``.key`` form,
    and its abbreviations (the flag cut short)."""
    if not flag.startswith("--"):
        return [flag, flag + "3", flag + "=3"]
    return [
        flag,
        "--" + flag[2:].replace("-", "_"),
        flag + "=1",
        flag + ".key",
        *(flag[:n] for n in range(4, len(flag), 3)),
    ]


def test_every_vllm_serve_flag_is_classified_and_the_allowlist_reads_arguments_as_vllm_does(
    vllm_python: Any,
) -> None:
    """The extraArgs table classifies every option of the pinned ``vllm serve`` and names no option it
    lacks (an upgrade fails here until its new flags are classified); and every spelling the
    allowlist admits is read by vLLM's own parser as the very flag the allowlist read (its rewriting of
    ``_``, ``=`` and ``.key`` included), while abbreviations and short forms, which vLLM reads as some
    flag, are refused."""
    table = engine_args.VLLM_SERVE_FLAGS
    spellings = sorted({s for f in table for s in _spellings(f)} | {"-O3", "-O.mode=3"})
    answer = probe(vllm_python.require(), {"policy": {"resolve": spellings}})["policy"]
    options = set(answer["option_strings"])
    assert len(options) > 300 and {"--max-num-seqs", "-tp", "--no-enable-prefix-caching"} <= options
    assert sorted(options - set(table)) == [], "unclassified: add them to kvfence.api.policy.engine_args"
    assert sorted(set(table) - options) == [], "not flags of the pinned vLLM: remove them"
    resolved: dict[str, list[str] | None] = answer["resolved"]
    admitted = [s for s in spellings if not engine_args.extra_args_refusals([s], "vllm")]
    assert len(admitted) > 4 * 150, len(admitted)
    for s in admitted:
        assert engine_args.flag_name(s) in (resolved[s] or []), (s, resolved[s])
    # vLLM does read abbreviations and short forms as flags: the allowlist refuses them
    assert resolved["--max-num-seq"] == ["--max-num-seqs"] and "--max-num-seq" not in admitted
    assert resolved["-O3"] == ["--optimization-level"] and "-O3" not in admitted
    shortened = [
        s
        for s in spellings
        if s.startswith("--") and resolved[s] and engine_args.flag_name(s) not in resolved[s]
    ]
    assert len(shortened) > 100 and not set(shortened) & set(admitted)


def test_the_vllm_variables_extra_env_allows_are_variables_of_the_pinned_vllm(vllm_python: Any) -> None:
    envs = set(probe(vllm_python.require(), {"policy": {}})["policy"]["envs"])
    assert "VLLM_PLUGINS" in envs and len(envs) > 200
    allowed = sorted(n for n in engine_env.ALLOWED_ENV if n.startswith("VLLM_"))
    assert allowed and [n for n in allowed if n not in envs] == []
