"""Fixtures of the operator suites: factories for the pure unit tests, and the operator run as a real
process against the local control plane (``cluster`` from tests/conftest.py) for the integration tests."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster.manifests import keys_secret, tenant_namespace
from support import prom
from support.livestack import BoundTenant, LiveStack, bound_tenant_stack
from support.ports import free_port
from support.process import ManagedProcess
from support.waiting import wait_until

from kvfence.api.tenantbinding import TenantBinding
from kvfence.api.trustclass import TrustClass
from kvfence.contract.routing import decode_table_bytes
from kvfence.operator import rbac


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and v and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


TC_BASE: dict[str, Any] = {
    "apiVersion": "kvfence.dev/v1alpha1",
    "kind": "TrustClass",
    "metadata": {"name": "gold", "uid": "11111111-2222-3333-4444-555555555555", "generation": 1},
    "spec": {
        "engine": {"runtime": "reference", "image": "kvfence/engine:dev", "model": {"name": "kvfence/tiny"}},
        "namespaceSelector": {"matchLabels": {"kvfence.dev/tenants": "gold"}},
    },
}


@pytest.fixture
def make_tc() -> Callable[..., TrustClass]:
    def make(name: str = "gold", **spec: Any) -> TrustClass:
        body = copy.deepcopy(TC_BASE)
        body["metadata"]["name"] = name
        body["spec"] = _merge(body["spec"], spec)
        return TrustClass.model_validate(body)

    return make


@pytest.fixture
def make_tb() -> Callable[..., TenantBinding]:
    def make(
        name: str,
        tenant: str,
        trust_class: str = "gold",
        namespace: str = "team-a",
        created: str = "2026-01-01T00:00:00Z",
        **spec: Any,
    ) -> TenantBinding:
        body = {
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created, "generation": 1},
            "spec": {
                "tenantId": tenant,
                "trustClassName": trust_class,
                "apiKeySecretRef": {"name": f"{name}-keys"},
                **spec,
            },
        }
        return TenantBinding.model_validate(body)

    return make


# --- the operator as a process on the real control plane ------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NS = "kvfence-system"
SA_USER = f"system:serviceaccount:{OPERATOR_NS}:{rbac.NAME}"


def wait_for(
    pred: Callable[[], Any], what: str, timeout: float = 120.0, interval: float = 0.5, dump: Any = None
) -> Any:
    """:func:`support.waiting.wait_until` that also waits out errors (the apiserver may be restarting)."""
    return wait_until(pred, what, timeout, interval, ignore=(Exception,), dump=dump)


class Kubectl:
    """Admin access for the tests (the operator itself never uses it)."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def __call__(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        res: subprocess.CompletedProcess[str] = self.cluster.kubectl(*args, check=check, input=input)
        return res

    def json(self, *args: str) -> Any:
        res = self.cluster.kubectl(*args, "-o", "json", check=False)
        if res.returncode != 0:
            if "NotFound" in res.stderr or "not found" in res.stderr:
                return None
            raise AssertionError(f"kubectl {' '.join(args)}: {res.stderr}")
        return json.loads(res.stdout)

    def apply(self, *objs: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        doc = {"apiVersion": "v1", "kind": "List", "items": list(objs)}
        return self.cluster.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=tests",
            "--validate=false",
            "-f",
            "-",
            input=json.dumps(doc),
            check=False,
        )

    def routing_table(self) -> dict[str, Any]:
        s = self.json("get", "secret", "kvfence-routing", "-n", OPERATOR_NS)
        assert s is not None, "no routing table"
        data: dict[str, Any] = json.loads(decode_table_bytes(base64.b64decode(s["data"]["routing.json"])))
        return data


class OperatorProcess:
    """``python -m kvfence.operator`` under its own ServiceAccount token (never the admin kubeconfig)."""

    def __init__(
        self,
        cluster: Any,
        kubeconfig: Path,
        workdir: Path,
        identity: str = "op-0",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.cluster, self.kubeconfig, self.workdir, self.identity = cluster, kubeconfig, workdir, identity
        self.extra_args = extra_args  # after the defaults: a repeated flag overrides them
        self.port = free_port()
        self.log = workdir / f"operator-{identity}.log"
        self.process: ManagedProcess | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return None if self.process is None else self.process.popen

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env["KUBECONFIG"] = str(self.kubeconfig)
        cmd = [
            sys.executable, "-m", "kvfence.operator",
            "--kubeconfig", str(self.kubeconfig),
            "--health-host", "127.0.0.1", "--health-port", str(self.port),
            "--lease-namespace", OPERATOR_NS, "--lease-seconds", "6",
            "--resync-seconds", "5", "--identity", self.identity, "--log-format", "json",
            *self.extra_args,
        ]  # fmt: skip
        self.process = ManagedProcess(cmd, self.log, env=env, cwd=ROOT, grace=30).start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.process = None

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process = None

    def _get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""
        except OSError:
            return 0, ""

    def ready(self) -> bool:
        return self._get("/readyz")[0] == 200

    def wait_ready(self, timeout: float = 120) -> None:
        wait_for(self.ready, f"operator {self.identity} ready", timeout, dump=self.tail)

    def metrics(self) -> dict[str, float]:
        code, text = self._get("/metrics")
        assert code == 200
        return prom.samples(text)

    def writes(self) -> float:
        return sum(
            v
            for k, v in self.metrics().items()
            if k.startswith("kvfence_operator_api_requests_total")
            and any(f'verb="{verb}"' in k for verb in ("POST", "PUT", "PATCH", "DELETE"))
        )

    def counter(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        return sum(
            v
            for k, v in self.metrics().items()
            if (k == name or k.startswith(name + "{"))
            and all(f'{lk}="{lv}"' in k for lk, lv in labels.items())
        )

    def reconciles(self, kind: str) -> float:
        return sum(
            v
            for k, v in self.metrics().items()
            if k.startswith("kvfence_operator_reconciles_total") and f'kind="{kind}"' in k
        )

    def tail(self, lines: int = 80) -> str:
        if not self.log.exists():
            return ""
        return f"===== operator {self.identity} log =====\n" + "\n".join(
            self.log.read_text().splitlines()[-lines:]
        )


@pytest.fixture(scope="session")
def wait() -> Callable[..., Any]:
    return wait_for


@pytest.fixture(scope="session")
def kv(cluster: Any) -> Kubectl:
    return Kubectl(cluster)


@pytest.fixture(scope="session")
def installed(cluster: Any, kv: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CRDs, the operator's namespace, ServiceAccount and least-privilege RBAC; returns the SA kubeconfig."""
    kv(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=kvfence-tests",
        "-f",
        str(ROOT / "crds"),
    )
    cluster.wait_established("trustclasses.kvfence.dev", "tenantbindings.kvfence.dev")
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NS}}
    res = kv.apply(ns, *rbac.manifests(OPERATOR_NS))
    assert res.returncode == 0, res.stderr
    path: Path = cluster.serviceaccount_kubeconfig(
        OPERATOR_NS, rbac.NAME, tmp_path_factory.mktemp("operator") / "kubeconfig"
    )
    return path


@pytest.fixture(scope="module")
def operator(
    cluster: Any, installed: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[OperatorProcess]:
    """The operator of a test module, with the module's ``OPERATOR_ARGS`` after the defaults."""
    extra = tuple(getattr(request.module, "OPERATOR_ARGS", ()))
    op = OperatorProcess(cluster, installed, tmp_path_factory.mktemp("oplog"), extra_args=extra)
    op.start()
    try:
        op.wait_ready()
        yield op
    finally:
        op.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        op = getattr(item, "funcargs", {}).get("operator")
        if isinstance(op, OperatorProcess):
            report.sections.append(("kvfence operator log", op.tail(200)))


@pytest.fixture(scope="module")
def bound_tenant(
    operator: Any,
    cluster: Any,
    kv: Any,
    wait: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LiveStack]:
    """A class with the tenant acme bound, and a real engine and router following the operator: the
    test module says which (``CLASS``, ``CLASS_NS``, ``TENANT_NS``, ``ROUTER_NS``, ``KEY``, ``MODEL``,
    ``tc_body()``, ``binding()``)."""
    m = request.module
    tenant = BoundTenant(
        m.CLASS,
        m.CLASS_NS,
        m.TENANT_NS,
        m.ROUTER_NS,
        m.KEY,
        m.MODEL,
        [
            m.tc_body(),
            *tenant_namespace(m.TENANT_NS, label=m.CLASS, grant=True),
            keys_secret("acme", m.TENANT_NS, m.KEY),
            m.binding(),
        ],
    )
    logs = tmp_path_factory.mktemp(m.__name__.rsplit(".", 1)[-1])
    with bound_tenant_stack(operator, cluster, kv, wait, logs, tenant) as stack:
        yield stack
