"""Runs real ``vllm serve`` exactly as the operator renders it for a ``runtime: vllm`` TrustClass.

:func:`rendered` takes the engine Deployment the operator builds (``kvfence.operator.builders``) and
returns its container's arguments and environment, with only what a pod has and a test process does
not swapped in: the model is the tiny model built offline (``tinymodel.py``), the mounted files (engine
config, signing keys, ``/tmp``, the Hugging Face cache) are files in a test directory. The class runs
on vLLM's CPU backend as a user would declare it (``engine.device: CPU``, ``engine.kvCacheMemory``), so
the CPU environment and the KV cache's size are the operator's rendering too. The kvfence plugin is
imported from this source tree (``PYTHONPATH``), as the engine image installs it.

:class:`VllmServer` starts it with the pinned vLLM (``tests/vllm/install-vllm.sh``), waits for
``/health`` (30-90 s: vLLM compiles the model; the compile cache is kept under ``~/.cache/kvfence``),
and stops it with SIGTERM (vLLM's processes leave nothing behind).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster import manifests
from router.support import request
from support import prom
from support.process import ManagedProcess

from kvfence.api.common import TenantQuotas
from kvfence.api.trustclass import TrustClass
from kvfence.operator import builders

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = Path(os.environ.get("KVFENCE_CACHE", Path.home() / ".cache" / "kvfence"))

#: What the CPU image sets for itself (engine-image/Dockerfile.vllm-cpu) and a pod would not render:
#: no hub access. The CPU backend's own settings (VLLM_TARGET_DEVICE, thread binding, the KV cache's
#: size) come from the operator's rendering of ``engine.device: CPU`` and ``engine.kvCacheMemory``.
DEVICE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def tiny_model(python: str) -> Path:
    """The tiny model's directory (built once, cached)."""
    res = subprocess.run(
        [python, str(HERE / "tinymodel.py")], capture_output=True, text=True, timeout=600, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return Path(res.stdout.strip().splitlines()[-1])


def trust_class(model: Path, port: int, *, prefix_cache: bool = True, **engine: Any) -> TrustClass:
    """A ``runtime: vllm`` class serving the tiny model as ``tiny``, as a user would write it."""
    return TrustClass.model_validate(
        manifests.trust_class(
            "gold",
            engine={
                "runtime": "vllm",
                "image": "kvfence/engine-vllm:test",
                "model": {"name": str(model), "revision": "main", "servedName": "tiny"},
                "port": port,
                "dtype": "float32",
                "maxModelLen": 1024,
                "device": "CPU",
                "kvCacheMemory": "1Gi",
                **engine,
            },
            resources={"gpu": {"count": 0}},
            prefixCache={"enabled": prefix_cache, "scope": "Tenant", "hashAlgorithm": "sha256"},
        )
    )


def rendered(
    tc: TrustClass, key: bytes, workdir: Path, tenant_quotas: dict[str, TenantQuotas] | None = None
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """(``vllm serve`` arguments, environment, engine config) of the class's engine pod, with the
    pod's mounts swapped for files under ``workdir``."""
    cfg = builders.engine_config(tc, tenant_quotas)
    dep = builders.deployment(tc, builders.config_hash(cfg), builders.OperatorOptions())
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    args = list(container["args"])
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    mounts = {m["mountPath"]: workdir / m["name"] for m in container["volumeMounts"]}
    for d in mounts.values():
        d.mkdir(parents=True, exist_ok=True)
    key_dir = mounts[builders.KEY_DIR]
    (key_dir / builders.SIGNING_KEY_CURRENT).write_bytes(key)
    cfg["signingKeyDir"] = str(key_dir)

    def local(path: str) -> str:
        for mount, d in mounts.items():
            if path == mount or path.startswith(mount + "/"):
                return str(d / path[len(mount) :].lstrip("/"))
        return path

    env = {k: local(v) for k, v in env.items()}
    Path(env["KVFENCE_ENGINE_CONFIG"]).write_text(json.dumps(cfg))
    return args, env, cfg


@dataclass
class VllmServer:
    python: str
    args: list[str]
    env: dict[str, str]
    port: int
    log: Path
    config_path: Path
    process: ManagedProcess | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        return None if self.process is None else self.process.popen

    def start(self, timeout: float = 420.0) -> VllmServer:
        exe = str(Path(self.python).parent / "vllm")
        env = {
            **os.environ,
            **self.env,
            **DEVICE_ENV,
            "PYTHONPATH": str(ROOT / "engine-image"),
            "VLLM_CACHE_ROOT": str(CACHE / "vllm-compile"),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        # vLLM forks its engine core: a session of its own, so that stop() ends the whole group
        self.process = ManagedProcess(
            [exe, "serve", *self.args], self.log, env=env, new_session=True, grace=60
        ).start()
        self.process.wait_ready(
            lambda: request("GET", self.url + "/health", timeout=2)[0] == 200,
            "vllm serve answering /health",
            timeout,
            interval=0.5,
        )
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, keyed by its full name with labels."""
        status, _, data = request("GET", self.url + "/metrics", timeout=10)
        assert status == 200
        return prom.samples(data.decode())

    def metric(self, name: str) -> float:
        """Sum of every sample of ``name`` (all label sets)."""
        return prom.total(self.metrics(), name)

    def set_quotas(self, tenants: dict[str, dict[str, int]]) -> None:
        """Rewrite the mounted engine config's per-tenant quotas (what the operator does on a change)."""
        self._rewrite(lambda cfg: cfg["quotas"].__setitem__("tenants", tenants))

    def set_shared_prefixes(self, prefixes: list[dict[str, str]]) -> None:
        """Rewrite the mounted engine config's declared shared prefixes (the operator, on a change)."""
        self._rewrite(lambda cfg: cfg["prefixCache"].__setitem__("sharedPrefixes", prefixes))

    def set_tenants_pending(self, pending: bool) -> None:
        """Mark the mounted engine config as waiting for its tenants' quotas, or drop the mark (what
        the operator writes for a new class before, and after, its routing decision)."""
        self._rewrite(
            lambda cfg: cfg.update(tenantsPending=True) if pending else cfg.pop("tenantsPending", None)
        )

    def _rewrite(self, change: Any) -> None:
        cfg = json.loads(self.config_path.read_text())
        change(cfg)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cfg))
        os.replace(tmp, self.config_path)


def start_vllm(
    python: str,
    tc: TrustClass,
    key: bytes,
    workdir: Path,
    tenant_quotas: dict[str, TenantQuotas] | None = None,
) -> VllmServer:
    args, env, _ = rendered(tc, key, workdir, tenant_quotas)
    server = VllmServer(
        python,
        args,
        env,
        tc.spec.engine.port,
        workdir / "vllm.log",
        Path(env["KVFENCE_ENGINE_CONFIG"]),
    )
    return server.start()


__all__ = ["VllmServer", "rendered", "start_vllm", "tiny_model", "trust_class"]
