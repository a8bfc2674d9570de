"""What the e2e suite needs besides the tests: the tenants of examples/, an HTTP client for the router,
and the three ways to get a router to talk to:

* ``cluster``: any kubeconfig (``KVFENCE_E2E_KUBECONFIG``), or a kind cluster this suite creates when
  ``kind`` and ``docker`` work. The chart is helm-installed, examples/ applied, TrustClasses waited
  for, and the router's Service reached through ``kubectl port-forward``.
* ``local`` (``KVFENCE_E2E_LOCAL=1``, opt-in): no Kubernetes at all. The operator's own pure functions
  turn examples/ into engine configs and a routing table, and real ``kvfence-engine`` and
  ``kvfence-router`` processes serve them. It checks the data path (router, engines, examples); it
  proves nothing about the chart, the operator's reconciliation or Services.

Nothing here ever turns "no cluster" into a pass: without a target the suite errors (see conftest.py).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from support import waiting
from support.ports import free_port
from support.process import ManagedProcess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
#: The e2e suite's vLLM trust class and its two tenants (not in examples/: `make up` runs without the
#: 6 GB CPU vLLM image).
VLLM_MANIFEST = ROOT / "e2e" / "manifests" / "vllm-cpu.yaml"
CHART = ROOT / "charts" / "kvfence"
T = TypeVar("T")


# --- the tenants of examples/ ----------------------------------------------------------------------
@dataclass(frozen=True)
class Tenant:
    id: str
    trust_class: str
    api_key: str
    model: str
    namespace: str
    binding: str
    requests_per_minute: int | None


def load_docs(name: str | Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def example_tenants() -> dict[str, Tenant]:
    return tenants_of(load_docs("10-trustclasses.yaml"), load_docs("20-tenants.yaml"))


def vllm_tenants() -> dict[str, Tenant]:
    docs = load_docs(VLLM_MANIFEST)
    return tenants_of([d for d in docs if d["kind"] == "TrustClass"], docs)


def tenants_of(class_docs: list[dict[str, Any]], docs: list[dict[str, Any]]) -> dict[str, Tenant]:
    """The tenants the TenantBindings (and their key Secrets) in ``docs`` make, of ``class_docs``."""
    classes = {d["metadata"]["name"]: d for d in class_docs}
    secrets = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Secret"}
    out = {}
    for b in (d for d in docs if d["kind"] == "TenantBinding"):
        ns, spec = b["metadata"]["namespace"], b["spec"]
        ref = spec["apiKeySecretRef"]
        data = secrets[(ns, ref["name"])]["stringData"]
        raw = data[ref["key"]] if ref.get("key") else next(iter(data.values()))
        tc = classes[spec["trustClassName"]]
        model = tc["spec"]["engine"]["model"]
        rpm = spec.get("quotas", {}).get("requestsPerMinute") or tc["spec"].get("quotas", {}).get(
            "defaults", {}
        ).get("requestsPerMinute")
        out[spec["tenantId"]] = Tenant(
            id=spec["tenantId"],
            trust_class=spec["trustClassName"],
            api_key=raw.strip().splitlines()[0].strip(),
            model=model.get("servedName") or model["name"],
            namespace=ns,
            binding=b["metadata"]["name"],
            requests_per_minute=rpm,
        )
    return out


# --- HTTP --------------------------------------------------------------------------------------------
@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Router:
    url: str
    quota_divisor: int = 1  # router replicas sharing each quota (each enforces limit // replicas)

    def request(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Response:
        u = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
        h = dict(headers or {})
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        try:
            conn.request(method, path, body=data, headers=h)
            r = conn.getresponse()
            return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def complete(self, tenant: Tenant, prompt: str, max_tokens: int = 4, **extra: Any) -> Response:
        body = {"model": tenant.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self.request("POST", "/v1/completions", key=tenant.api_key, body=body)


def cached_tokens(resp: Response) -> int:
    usage = resp.json().get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def wait_until(fn: Callable[[], T], what: str, timeout: float = 300.0, interval: float = 1.0) -> T:
    """:func:`support.waiting.wait_until` with the e2e suite's patience: a connection error or a
    broken HTTP answer (a port-forward or a Service still settling) only means "not yet"."""
    return waiting.wait_until(fn, what, timeout, interval, ignore=(OSError, http.client.HTTPException))


# --- targets -----------------------------------------------------------------------------------------
def tool(name: str) -> str:
    """kubectl/helm: the pinned builds of `make components` if there, else PATH."""
    bin_dir = os.environ.get("KVFENCE_BIN_DIR")
    if bin_dir and (Path(bin_dir) / name).exists():
        return str(Path(bin_dir) / name)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found (PATH, or KVFENCE_BIN_DIR from `make components`)")
    return found


def kind_available() -> str | None:
    """None if kind and a working docker are there, else why not."""
    if not shutil.which("kind"):
        return "kind is not installed"
    if not shutil.which("docker"):
        return "docker is not installed"
    res = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if res.returncode != 0:
        return f"docker does not answer: {res.stderr.strip()[:200]}"
    return None


def choose_target() -> tuple[str, str]:
    """(mode, detail) or ("none", why): the caller must fail the run on "none"."""
    if os.environ.get("KVFENCE_E2E_KUBECONFIG"):
        return "cluster", os.environ["KVFENCE_E2E_KUBECONFIG"]
    if os.environ.get("KVFENCE_E2E_LOCAL") == "1":
        return "local", "processes"
    why = kind_available()
    if why is None:
        return "kind", os.environ.get("KVFENCE_E2E_KIND_CLUSTER", "kvfence-e2e")
    return "none", (
        "NOT RUN: no target for the e2e suite. Set KVFENCE_E2E_KUBECONFIG to a cluster's kubeconfig, "
        f"or install kind and docker ({why}), or set KVFENCE_E2E_LOCAL=1 for the process-level stack "
        "(router and reference engines, no Kubernetes)."
    )


@dataclass
class Kube:
    kubeconfig: str
    logs: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 600) -> str:
        cmd = [tool("kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout, env=self.env)
        if check and res.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout + (res.stderr if not check else "")

    def helm(self, *args: str, timeout: float = 900) -> str:
        cmd = [tool("helm"), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env)
        if res.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def dump(self) -> str:
        """Everything worth reading when an e2e test fails (kubebuilder's e2e habit)."""
        parts = []
        for args in (
            ["get", "trustclasses,tenantbindings", "-A", "-o", "wide"],
            ["get", "pods,deploy,svc", "-A", "-o", "wide"],
            ["get", "events", "-A", "--sort-by=.lastTimestamp"],
            ["logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator", "--tail=200", "--prefix"],
            ["logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=router", "--tail=200", "--prefix"],
            ["get", "trustclasses,tenantbindings", "-A", "-o", "yaml"],
        ):
            out = self.run(*args, check=False, timeout=60)
            parts.append(f"===== kubectl {' '.join(args)} =====\n{out[-20000:]}")
        # Engine logs, from every trust class namespace (kubectl logs has no --all-namespaces).
        sel = "app.kubernetes.io/name=kvfence-engine"
        pods = self.run("get", "pods", "-A", "-l", sel, "-o", "json", check=False, timeout=60)
        with contextlib.suppress(ValueError):
            for p in json.loads(pods[: pods.rfind("}") + 1] or "{}").get("items", []):
                ns, name = p["metadata"]["namespace"], p["metadata"]["name"]
                out = self.run("logs", "-n", ns, name, "--tail=100", check=False, timeout=60)
                parts.append(f"===== kubectl logs -n {ns} {name} =====\n{out[-10000:]}")
        return "\n".join(parts)


NAMESPACE = os.environ.get("KVFENCE_E2E_NAMESPACE", "kvfence-system")
RELEASE = "kvfence"


def deploy(kube: Kube, extra_values: list[str], restart: bool = False) -> None:
    """helm install the chart and apply examples/, then wait until every class is Ready and every
    binding Bound. ``restart``: the images were rebuilt under the same tags, so pods that were already
    running (on a cluster deployed before) are restarted onto them; a fresh install is left alone."""
    deployed_before = bool(
        kube.run("get", "deployment", "-n", NAMESPACE, "-o", "name", check=False).count("deployment.apps/")
    )
    # A namespace still terminating from an earlier run would swallow what is applied into it. (Only
    # then: `kubectl wait --for=delete` on a live namespace would wait out its whole timeout, as when
    # `make up` runs again on a cluster that already has the examples.)
    for ns in (d["metadata"]["name"] for d in load_docs("00-namespaces.yaml")):
        phase = kube.run("get", "namespace", ns, "-o", "jsonpath={.status.phase}", check=False).strip()
        if phase == "Terminating":
            kube.run("wait", "--for=delete", f"namespace/{ns}", "--timeout=300s", check=False, timeout=330)
    kube.run("apply", "-f", str(EXAMPLES / "00-namespaces.yaml"))
    # CRDs first and server-side, as docs/helm.md says for upgrades (Helm never upgrades them).
    kube.run("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    args = ["upgrade", "--install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace"]
    args += ["-f", str(EXAMPLES / "helm-values.yaml")]
    for v in extra_values:
        args += ["-f", v]
    kube.helm(*args, "--wait", "--timeout", "5m")
    kube.helm("test", RELEASE, "-n", NAMESPACE, "--timeout", "3m")  # the chart's own check (router /healthz)
    kube.run("apply", "-f", str(EXAMPLES / "10-trustclasses.yaml"), "-f", str(EXAMPLES / "20-tenants.yaml"))
    for tc in ("gold", "silver"):
        kube.run("wait", "--for=condition=Ready", f"trustclass/{tc}", "--timeout=600s", timeout=660)
    for t in example_tenants().values():
        kube.run(
            "wait", "--for=condition=Bound", f"tenantbinding/{t.binding}", "-n", t.namespace, "--timeout=300s"
        )
    if restart and deployed_before:
        namespaces = [NAMESPACE] + [f"kvf-{d['metadata']['name']}" for d in load_docs("10-trustclasses.yaml")]
        for ns in namespaces:
            kube.run("rollout", "restart", "deployment", "-n", ns)
        for ns in namespaces:
            kube.run("rollout", "status", "deployment", "-n", ns, "--timeout=300s", timeout=330)


def undeploy(kube: Kube) -> None:
    for f in ("20-tenants.yaml", "10-trustclasses.yaml"):
        kube.run("delete", "--ignore-not-found", "--wait=true", "-f", str(EXAMPLES / f), check=False)
    with contextlib.suppress(RuntimeError):
        kube.helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait")
    kube.run(
        "delete",
        "--ignore-not-found",
        "--wait=false",
        "-f",
        str(EXAMPLES / "00-namespaces.yaml"),
        check=False,
    )


@contextlib.contextmanager
def port_forward(kube: Kube) -> Iterator[Router]:
    port = free_port()
    cmd = [tool("kubectl"), f"--kubeconfig={kube.kubeconfig}", "-n", NAMESPACE, "port-forward"]
    cmd += [f"svc/{RELEASE}-router", f"{port}:8080", "--address", "127.0.0.1"]
    proc = ManagedProcess(cmd, kube.logs / "port-forward.log", env=kube.env).start()
    try:
        router = Router(f"http://127.0.0.1:{port}", quota_divisor=router_replicas(kube))
        wait_until(lambda: router.request("GET", "/readyz").status == 200, "the router's /readyz", 120)
        wait_router_serves(router)
        yield router
    finally:
        proc.stop()


def wait_router_serves(
    router: Router, tenants: dict[str, Tenant] | None = None, timeout: float = 300
) -> None:
    """Until the router knows every tenant (the example tenants by default) and has seen each one's
    class's engine healthy. The operator writes the routing table as soon as the engines exist, and the
    router follows that Secret through the API (or, with routingTableSource=volume, the kubelet's
    refresh); an engine that was still starting when the router first probed it is re-probed every
    half second."""
    ts = (tenants or example_tenants()).values()
    for t in ts:
        wait_until(
            lambda t=t: router.request("GET", "/v1/models", key=t.api_key).status == 200,
            f"the router to know tenant {t.id}",
            timeout,
            2,
        )
    for cls in sorted({t.trust_class for t in ts}):
        line = f'kvfence_router_engine_healthy{{trust_class="{cls}"}} 1'.encode()
        wait_until(
            lambda line=line: line in router.request("GET", "/metrics").body.split(b"\n"),
            f"the router to see the {cls} engine healthy",
            timeout,
        )


def router_replicas(kube: Kube) -> int:
    d = json.loads(kube.run("get", "deploy", f"{RELEASE}-router", "-n", NAMESPACE, "-o", "json"))
    args = d["spec"]["template"]["spec"]["containers"][0].get("args", [])
    return next((int(a.split("=", 1)[1]) for a in args if a.startswith("--replicas=")), 1)


def _sources_newer_than(archives: list[Path]) -> bool:
    """Whether any file the images are built from changed after the oldest archive was written (so
    `make up` after an edit runs the edited code, not the image of an earlier build)."""
    built = min(a.stat().st_mtime for a in archives)
    sources = [ROOT / "pyproject.toml", ROOT / "setup.py"]
    for top in ("operator", "engine-image"):
        sources += [p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return any(p.exists() and p.stat().st_mtime > built for p in sources)


def _version() -> str:
    return next(
        line.split('"')[1]
        for line in (ROOT / "pyproject.toml").read_text().splitlines()
        if line.startswith("version = ")
    )


def vllm_cpu_sources_key() -> str:
    """What the CPU vLLM image is built from, hashed: the vLLM pins, the Dockerfiles and build scripts,
    the kvfence sources (its plugin is in the image) and the tiny model's script. Its archive is reused
    while this is unchanged (a 6 GB image is not rebuilt and re-saved for nothing)."""
    files = [ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / "tests" / "vllm" / "tinymodel.py"]
    for top in ("operator", "engine-image"):
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    h = hashlib.sha256()
    for p in sorted(f for f in files if f.exists()):
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def vllm_cpu_archive(out: Path) -> Path:
    """The CPU vLLM image's archive, rebuilt (engine-image/build-images.sh vllm-cpu) unless the one in
    ``out`` was built from these very sources."""
    archive = out / f"kvfence-engine-vllm-cpu-{_version()}.oci.tar"
    stamp = archive.with_name(archive.name + ".sources")
    key = vllm_cpu_sources_key()
    if archive.exists() and stamp.exists() and stamp.read_text().strip() == key:
        return archive
    stamp.unlink(missing_ok=True)
    subprocess.run([str(ROOT / "engine-image" / "build-images.sh"), "vllm-cpu"], check=True)
    stamp.write_text(key + "\n")
    return archive


def ctr_import(socket_path: str, archive: Path) -> None:
    """Import an image archive into the node's containerd; a failure names ctr's own message and the
    free space where the archive and the node's containerd keep their data (an image is stored twice
    there: its blobs and the unpacked snapshot)."""
    res = subprocess.run(
        [
            "ctr",
            f"--address={socket_path}",
            "--namespace=k8s.io",
            "images",
            "import",
            "--no-unpack=false",
            str(archive),
        ],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        dirs = {archive.parent, Path(socket_path).parent}
        free = {str(d): shutil.disk_usage(d).free // 2**20 for d in dirs}
        raise RuntimeError(
            f"ctr images import {archive.name} ({archive.stat().st_size // 2**20} MiB) failed "
            f"(exit {res.returncode}); free MiB {free}: {(res.stderr or res.stdout).strip()[-2000:]}"
        )


def import_images_into_containerd(socket_path: str, with_vllm: bool = False) -> bool:
    """For clusters whose node runs containerd on this machine (the project's own cluster with a real
    node, `make up`): build the images if needed and import them (no registry involved). True if they
    were rebuilt (pods already running keep the old image of the same tag). ``with_vllm`` (the e2e
    suite) adds the CPU vLLM engine image, rebuilt only when its sources changed."""
    out = Path(os.environ.get("OUT", ROOT / "build" / "images"))
    version = _version()
    archives = [out / f"kvfence-{n}-{version}.oci.tar" for n in ("control-plane", "engine-reference")]
    missing = not all(a.exists() for a in archives)
    rebuild = missing or _sources_newer_than(archives) or os.environ.get("KVFENCE_E2E_REBUILD") == "1"
    if rebuild:
        subprocess.run(
            [str(ROOT / "engine-image" / "build-images.sh"), "control-plane", "reference"], check=True
        )
    if with_vllm:
        t0 = time.monotonic()
        archives.append(vllm_cpu_archive(out))
        print(f"e2e: CPU vLLM image archive ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    for a in archives:
        t0 = time.monotonic()
        ctr_import(socket_path, a)
        print(f"e2e: imported {a.name} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return rebuild


def kind_cluster(name: str, logs: Path) -> str:
    """Create (or reuse) a kind cluster, build the images with docker and load them; the kubeconfig."""
    kubeconfig = str(logs / "kind.kubeconfig")
    clusters = subprocess.run(
        ["kind", "get", "clusters"], capture_output=True, text=True, check=True
    ).stdout.split()
    if name not in clusters:
        subprocess.run(["kind", "create", "cluster", "--name", name, "--wait", "180s"], check=True)
    subprocess.run(["kind", "export", "kubeconfig", "--name", name, "--kubeconfig", kubeconfig], check=True)
    env = {**os.environ, "CONTAINER_TOOL": "docker"}
    if not env.get("BASE_IMAGE"):
        # With docker a registry is usually reachable: the official Python base instead of debootstrap.
        subprocess.run(["docker", "pull", "python:3.11-slim-bookworm"], check=True)
        env["BASE_IMAGE"] = "python:3.11-slim-bookworm"
    subprocess.run(
        [str(ROOT / "engine-image" / "build-images.sh"), "control-plane", "reference"], check=True, env=env
    )
    out = Path(env.get("OUT", ROOT / "build" / "images"))
    for archive in sorted(out.glob("kvfence-*.oci.tar")):
        if "vllm" in archive.name:
            continue
        subprocess.run(["kind", "load", "image-archive", str(archive), "--name", name], check=True)
    return kubeconfig


# --- local: the data path as processes ---------------------------------------------------------------
def _script(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else tool(name)


@contextlib.contextmanager
def local_stack(workdir: Path) -> Iterator[Router]:
    """Reference engines and the router as processes, configured from examples/ by the operator's own
    pure functions (engine config builder, binding decisions, routing table)."""
    from kvfence.api.tenantbinding import TenantBinding
    from kvfence.api.trustclass import TrustClass
    from kvfence.contract import new_signing_key
    from kvfence.contract.routing import hash_api_key
    from kvfence.operator import builders
    from kvfence.operator.bindings import ClassState, KeyLookup, api_keys_from_secret, decide, table_json
    from kvfence.operator.builders import OperatorOptions

    classes = {
        tc.name: tc for tc in (TrustClass.model_validate(d) for d in load_docs("10-trustclasses.yaml"))
    }
    docs = load_docs("20-tenants.yaml")
    bindings = [TenantBinding.model_validate(d) for d in docs if d["kind"] == "TenantBinding"]
    secrets = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Secret"}
    labels = {d["metadata"]["name"]: d["metadata"].get("labels", {}) for d in load_docs("00-namespaces.yaml")}
    lookups = {}
    for b in bindings:
        s = secrets[(b.namespace, b.spec.api_key_secret_ref.name)]
        data = {k: base64.b64encode(v.encode()).decode() for k, v in s.get("stringData", {}).items()}
        keys = api_keys_from_secret({"data": data}, b.spec.api_key_secret_ref.key)
        lookups[b.key] = KeyLookup(hashes=tuple(hash_api_key(k) for k in keys))
    signing = {name: new_signing_key() for name in classes}
    opts = OperatorOptions()
    states = {n: ClassState(tc, signing_keys=(signing[n],)) for n, tc in classes.items()}
    outcome = decide(states, bindings, labels, lookups, opts)
    denied = {k: d.message for k, d in outcome.decisions.items() if not d.bound}
    if denied:
        raise RuntimeError(f"examples/ bindings not bound: {denied}")

    procs: list[ManagedProcess] = []

    def spawn(name: str, args: list[str]) -> ManagedProcess:
        p = ManagedProcess(args, workdir / f"{name}.log", grace=15).start()
        procs.append(p)
        return p

    try:
        endpoints = {}
        for name, tc in classes.items():
            d = workdir / name
            (d / "keys").mkdir(parents=True, exist_ok=True)
            (d / "keys" / "current").write_bytes(signing[name])
            cfg = builders.engine_config(tc, outcome.tenant_quotas.get(name))
            cfg["signingKeyDir"] = str(d / "keys")
            port = free_port()
            cfg["listen"] = {"host": "127.0.0.1", "port": port}
            (d / "engine.json").write_text(builders.config_json(cfg))
            spawn(f"engine-{name}", [_script("kvfence-engine"), "--config", str(d / "engine.json")])
            endpoints[name] = f"http://127.0.0.1:{port}"
        for name, url in endpoints.items():
            wait_until(
                lambda url=url: Router(url).request("GET", "/health").status == 200, f"engine {name}", 60, 0.2
            )
        table = outcome.table.model_copy(
            update={
                "trust_classes": {
                    n: r.model_copy(update={"endpoint": endpoints[n]})
                    for n, r in outcome.table.trust_classes.items()
                }
            }
        )
        (workdir / "routing.json").write_text(table_json(table))
        port = free_port()
        table_path = str(workdir / "routing.json")
        router_cmd = [_script("kvfence-router"), "--routing-table", table_path, "--host", "127.0.0.1"]
        spawn("router", [*router_cmd, "--port", str(port)])
        router = Router(f"http://127.0.0.1:{port}", quota_divisor=1)
        wait_until(lambda: router.request("GET", "/readyz").status == 200, "the router's /readyz", 60, 0.2)
        yield router
    finally:
        for p in procs:
            p.stop()
