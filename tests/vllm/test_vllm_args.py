"""The vLLM arguments the operator renders (``kvfence.operator.builders.vllm_args``), checked by vLLM's
own argument parser, and the middleware checked by vLLM's own middleware loader and request models.

Collected only where a Python with vLLM exists (see conftest.py); it runs that Python in a subprocess
(tests/vllm/vllm_probe.py) because vLLM is not, and must not become, a project dependency.
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

from kvfence.api.trustclass import TrustClass
from kvfence.contract import Identity, cache_namespace, derive_cache_salt, sign
from kvfence.operator.builders import vllm_args

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEY = bytes(range(32))


def trust_class(**engine: Any) -> TrustClass:
    prefix_cache = engine.pop("prefixCache", {"enabled": True})
    return TrustClass.model_validate(
        {
            "apiVersion": "kvfence.dev/v1alpha1",
            "kind": "TrustClass",
            "metadata": {"name": "gold"},
            "spec": {
                "engine": {
                    "runtime": "vllm",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "main"},
                    **engine,
                },
                "prefixCache": prefix_cache,
            },
        }
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
    ),
    "no-prefix-cache": trust_class(prefixCache={"enabled": False}, blockSize=16),
    # The GPU example of examples/ (what users copy).
    "example": TrustClass.model_validate(
        yaml.safe_load((ROOT / "examples" / "trustclass-vllm-gpu.yaml").read_text())
    ),
}


def vllm_python() -> str:
    """Same rule as conftest.py (which collected this file only if there is one)."""
    import importlib.util
    import sys

    env = os.environ.get("KVFENCE_VLLM_PYTHON")
    if env:
        return env
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return sys.executable


def probe(request: dict[str, Any]) -> dict[str, Any]:
    py = vllm_python()
    assert py, "collected without a vLLM python"
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
    return answer


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict[str, Any]]:
    names = list(CLASSES)
    answer = probe({"argv": [vllm_args(CLASSES[n]) for n in names]})
    return dict(zip(names, answer["argv"], strict=True))


def test_default_class_parses_with_sha256_prefix_caching_and_the_middleware(
    parsed: dict[str, dict[str, Any]],
) -> None:
    p = parsed["default"]
    assert p["ok"], p
    assert p["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and p["revision"] == "main"
    assert p["enable_prefix_caching"] is True
    assert p["prefix_caching_hash_algo"] == "sha256"
    assert p["middleware"] == ["kvfence.vllm.middleware.KvfenceMiddleware"]
    assert p["port"] == CLASSES["default"].spec.engine.port and p["host"] == "0.0.0.0"  # noqa: S104
    assert p["enable_lora"] in (None, False)


def test_big_class_parses_with_tp_block_size_lora_and_extra_args(parsed: dict[str, dict[str, Any]]) -> None:
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


def test_the_gpu_example_parses(parsed: dict[str, dict[str, Any]]) -> None:
    p = parsed["example"]
    assert p["ok"], p
    assert p["served_model_name"] == ["qwen-7b"] and p["tensor_parallel_size"] == 2
    assert p["enable_prefix_caching"] is True and p["prefix_caching_hash_algo"] == "sha256"
    assert p["lora_modules"] == [{"name": "support-bot", "path": "/adapters/support-bot"}]
    assert p["middleware"] == ["kvfence.vllm.middleware.KvfenceMiddleware"]


def test_prefix_caching_off_parses(parsed: dict[str, dict[str, Any]]) -> None:
    p = parsed["no-prefix-cache"]
    assert p["ok"], p
    assert p["enable_prefix_caching"] is False


def test_bodies_the_middleware_produces_are_valid_vllm_requests() -> None:
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
    answer = probe({"bodies": bodies})["bodies"]
    for path in bodies:
        assert answer[path]["ok"], answer[path]
        assert answer[path]["cache_salt"] == salt


def test_vllm_loads_the_middleware_and_it_guards_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "current").write_bytes(KEY)
    alice = Identity("alice", "gold", cache_namespace("gold", "alice", "Tenant"))
    body = json.dumps({"model": "m", "prompt": "x", "cache_salt": "chosen-by-client"}).encode()
    clean = json.dumps({"model": "m", "prompt": "x"}).encode()
    signed = sign(KEY, alice, "POST", "/v1/completions", clean, now=time.time())
    request = {
        "middleware": {
            "argv": ["--model", "m", "--middleware", "kvfence.vllm.middleware.KvfenceMiddleware"],
            "requests": [
                {"method": "POST", "path": "/v1/completions", "body": body.decode(), "headers": {}},
                {"method": "POST", "path": "/v1/completions", "body": clean.decode(), "headers": signed},
                {"method": "GET", "path": "/health", "headers": {}},
            ],
        }
    }
    monkeypatch.setenv("KVFENCE_TRUST_CLASS", "gold")
    monkeypatch.setenv("KVFENCE_SIGNING_KEY_DIR", str(tmp_path))
    answer = probe(request)["middleware"]
    statuses = [r["status"] for r in answer["results"]]
    assert statuses == [401, 200, 200], answer
    assert answer["seen"] == [derive_cache_salt(KEY, "gold", alice.namespace)]
