"""A real Kubernetes control plane on this machine, for tests and for `make up`.

etcd + kube-apiserver (TLS, RBAC and Node authorization, the default admission plugins) +
kube-controller-manager (its default controllers: garbage collection, Deployments -> ReplicaSets ->
Pods, service-account tokens, HorizontalPodAutoscalers) + kube-scheduler + kwok, which plays the
kubelet for a handful of fake nodes, some with ``nvidia.com/gpu`` capacity, so GPU pods are really
scheduled and reported Running.

The binaries come from ``build-components.sh`` (built from upstream sources, cached by version).
Every process is started in its own session, logs into ``<dir>/logs/``, and is recorded in
``<dir>/state.json`` so that ``down`` (or :meth:`LocalCluster.stop`) stops exactly what was started.

    python tests/cluster/localcluster.py up --dir .cluster --bin-dir DIR
    python tests/cluster/localcluster.py down --dir .cluster
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

HERE = Path(__file__).resolve().parent
# Services and (on the real node) pods use 198.18.0.0/15, reserved by RFC 2544 for network tests:
# nothing addressed there leaves this machine. See realnode.py.
SERVICE_CIDR = "198.19.0.0/16"
# Names the apiserver's serving certificate answers to.
API_SANS = [
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
]
API_IPS = ["127.0.0.1", "198.19.0.1", "198.18.255.1"]

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
FAKE_TAINT = {"key": KWOK_ANNOTATION, "value": "fake", "effect": "NoSchedule"}


@dataclass(frozen=True)
class FakeNode:
    """A node kwok pretends to run. ``extended`` is extra capacity, e.g. {"nvidia.com/gpu": "8"}."""

    name: str
    extended: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    tainted: bool = False
    cpu: str = "32"
    memory: str = "256Gi"
    pods: str = "110"

    def manifest(self, extra_taints: Sequence[dict[str, str]] = ()) -> dict[str, Any]:
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": self.pods, **self.extended}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "kubernetes.io/role": "agent",
                    "type": "kwok",
                    **self.labels,
                },
            },
            "spec": {"taints": ([GPU_TAINT] if self.tainted else []) + list(extra_taints)},
            "status": {"capacity": capacity, "allocatable": capacity},
        }


def _gpu(product: str, count: int = 8, resource: str = "nvidia.com/gpu") -> dict[str, Any]:
    return {
        "extended": {resource: str(count)},
        "labels": {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.count": str(count),
        },
    }


#: The default fleet: untainted and tainted full-GPU nodes, a MIG node, and a CPU-only node.
DEFAULT_NODES: tuple[FakeNode, ...] = (
    FakeNode("kvf-gpu-h100-0", **_gpu("NVIDIA-H100-80GB-HBM3")),
    FakeNode("kvf-gpu-h100-1", **_gpu("NVIDIA-H100-80GB-HBM3")),
    FakeNode("kvf-gpu-h100-2", **_gpu("NVIDIA-H100-80GB-HBM3")),
    FakeNode("kvf-gpu-a100-0", tainted=True, **_gpu("NVIDIA-A100-SXM4-80GB")),
    FakeNode("kvf-gpu-a100-1", tainted=True, **_gpu("NVIDIA-A100-SXM4-80GB")),
    FakeNode(
        "kvf-gpu-mig-0",
        tainted=True,
        **_gpu("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", count=7, resource="nvidia.com/mig-1g.5gb"),
    ),
    FakeNode("kvf-cpu-0"),
)

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
#: Users with a client certificate (CN, organisations).
CLIENT_CERTS = {
    "admin": ("kvfence-admin", ["system:masters"]),
    "controller-manager": ("system:kube-controller-manager", []),
    "scheduler": ("system:kube-scheduler", []),
    # kwok plays the kubelet of every fake node with one identity, so it cannot be a
    # system:node:<name> user restricted by the Node authorizer; it gets a cluster-admin binding.
    "kwok": ("kwok-controller", []),
    # The real node (realnode.py) and its helpers.
    "node": ("system:node:kvf-node-0", ["system:nodes"]),
    "kube-proxy": ("system:kube-proxy", []),
    "kube-router": ("kube-router", []),
    "coredns": ("coredns", []),
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", ["system:masters"]),
}


def default_bin_dir() -> Path:
    """Where the pinned components are: ``$KVFENCE_BIN_DIR``, else build-components.sh's cache dir."""
    env = os.environ.get("KVFENCE_BIN_DIR")
    if env:
        return Path(env)
    out = subprocess.run(
        [str(HERE / "build-components.sh"), "--print"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


# --- certificates -----------------------------------------------------------------------------------


def _pem_key(key: Any) -> bytes:
    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _cert(
    subject_cn: str,
    orgs: Sequence[str],
    key: Any,
    issuer: tuple[x509.Name, Any] | None,
    *,
    ca: bool = False,
    server: bool = False,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
) -> x509.Certificate:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    name = x509.Name(attrs)
    issuer_name, issuer_key = issuer if issuer else (name, key)
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usages = [x509.ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        usages.append(x509.ExtendedKeyUsageOID.CLIENT_AUTH)
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        b = b.add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
    if dns or ips:
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(pki: Path) -> None:
    """CA, apiserver serving cert, client certs per component, service-account signing key."""
    if (pki / "done").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)

    def write(name: str, cert: x509.Certificate, key: Any) -> None:
        (pki / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (pki / f"{name}.key").write_bytes(_pem_key(key))
        (pki / f"{name}.key").chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvfence-test-ca", [], ca_key, None, ca=True)
    write("ca", ca, ca_key)
    issuer = (ca.subject, ca_key)
    for name, (cn, orgs) in {"apiserver": ("kube-apiserver", []), **CLIENT_CERTS}.items():
        server = name in ("apiserver", "node")  # the kubelet serves too
        key = ec.generate_private_key(ec.SECP256R1())
        sans = {"dns": API_SANS, "ips": API_IPS} if server else {}
        write(name, _cert(cn, orgs, key, issuer, server=server, **sans), key)
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (pki / "sa.key").write_bytes(_pem_key(sa))
    (pki / "sa.pub").write_bytes(
        sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (pki / "done").write_text("ok")


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "kvfence", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(pki / f"{user}.crt"),
                    "client-key": str(pki / f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": "kvfence", "context": {"cluster": "kvfence", "user": user}}],
        "current-context": "kvfence",
    }
    path.write_text(json.dumps(cfg, indent=2))
    path.chmod(0o600)


# --- the cluster ------------------------------------------------------------------------------------


class ClusterError(RuntimeError):
    pass


class LocalCluster:
    def __init__(
        self,
        workdir: Path | str,
        bin_dir: Path | str,
        nodes: Sequence[FakeNode] = DEFAULT_NODES,
        *,
        real_node: bool = False,
    ):
        """``real_node``: also run one real node (realnode.py) on which pods really run; the fake
        nodes then carry the taint ``kwok.x-k8s.io/node=fake:NoSchedule`` so that only pods that
        ask for a fake node land there."""
        self.dir = Path(workdir).resolve()
        self.real_node = real_node
        self.host = "198.18.255.1" if real_node else "127.0.0.1"
        self.bin_dir = Path(bin_dir).resolve()
        self.nodes = tuple(nodes)
        self.pki = self.dir / "pki"
        self.logs = self.dir / "logs"
        self.kubeconfig = self.dir / "kubeconfig"
        self.state_file = self.dir / "state.json"
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- public API ---------------------------------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://{self.host}:{self.ports['apiserver']}"

    @property
    def gpu_nodes(self) -> list[str]:
        return [n.name for n in self.nodes if any(k.startswith("nvidia.com/") for k in n.extended)]

    def start(self, timeout: float = 120.0) -> None:
        needed = [*COMPONENTS, "kubectl"]
        if self.real_node:
            needed += ["kubelet", "kube-proxy", "kube-router", "coredns"]
        missing = [b for b in needed if not (self.bin_dir / b).is_file()]
        if self.real_node:
            from cluster.realnode import missing_host_tools

            missing += missing_host_tools()
        if missing:
            raise ClusterError(
                f"missing binaries in {self.bin_dir}: {', '.join(missing)}; run `make components`"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        make_pki(self.pki)
        from support.ports import free_port  # lazily: as a script, tests/ is on sys.path from main

        for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok"):
            self.ports[name] = free_port(self.ports.values())
        node = None
        if self.real_node:
            from cluster.realnode import RealNode

            node = RealNode(self)
            node.prepare()
        write_kubeconfig(self.kubeconfig, self.server, self.pki, "admin")
        for user in CLIENT_CERTS:
            if user != "admin":
                write_kubeconfig(self.dir / f"{user}.kubeconfig", self.server, self.pki, user)
        deadline = time.monotonic() + timeout
        try:
            self._spawn("etcd")
            self._wait_http(f"http://127.0.0.1:{self.ports['etcd']}/health", deadline, "etcd")
            self._spawn("kube-apiserver")
            self._wait_apiserver(deadline)
            self.apply(
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": "kwok-controller"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "cluster-admin",
                    },
                    "subjects": [
                        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "kwok-controller"}
                    ],
                }
            )
            self._spawn("kube-controller-manager")
            self._spawn("kube-scheduler")
            self._spawn("kwok")
            self._wait_https_health("controller-manager", deadline)
            self._wait_https_health("scheduler", deadline)
            fake_taints = [FAKE_TAINT] if self.real_node else []
            self.apply([n.manifest(fake_taints) for n in self.nodes])
            self._wait_nodes_ready(deadline)
            if node is not None:
                node.start(self._spawn, deadline)
            self._wait_for(
                lambda: (
                    self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode
                    == 0
                ),
                deadline,
                "the default ServiceAccount",
            )
        except BaseException:
            self._save_state()
            self.stop()
            raise
        self._save_state()

    def stop(self) -> None:
        """Stop every process this cluster started, in reverse start order, then clean the host."""
        pids = dict(self.pids)
        real_node = self.real_node
        if not pids and self.state_file.exists():
            state = json.loads(self.state_file.read_text())
            pids, real_node = state.get("pids", {}), state.get("realNode", False)
        for name in reversed(list(pids)):
            _terminate(pids[name], self._procs.get(name))
        if real_node:
            from cluster.realnode import RealNode

            RealNode(self).cleanup()
        self.pids.clear()
        self._procs.clear()
        if self.state_file.exists():
            self.state_file.unlink()

    def restart_apiserver(self, timeout: float = 90.0) -> None:
        pid = self.pids.pop("kube-apiserver", None)
        if pid:
            _terminate(pid, self._procs.pop("kube-apiserver", None))
        self._spawn("kube-apiserver")
        self._wait_apiserver(time.monotonic() + timeout)
        self._save_state()

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def wait_established(self, *crds: str, timeout: float = 60) -> None:
        """Until each CustomResourceDefinition is ``Established``. Polls the object rather than
        ``kubectl wait --for=condition=Established``, which fails at once ("accessor error") when it
        reads a CRD whose status has no conditions yet, right after the apply."""

        def established(crd: str) -> bool:
            res = self.kubectl("get", f"crd/{crd}", "-o", "json", check=False)
            if res.returncode != 0:
                return False
            conds = json.loads(res.stdout).get("status", {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conds)

        deadline = time.monotonic() + timeout
        for crd in crds:
            self._wait_for(lambda crd=crd: established(crd), deadline, f"CRD {crd} Established")

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]], *, server_side: bool = False) -> None:
        doc = obj if isinstance(obj, dict) else {"apiVersion": "v1", "kind": "List", "items": obj}
        args = ["apply", "-f", "-"] + (["--server-side"] if server_side else [])
        self.kubectl(*args, input=json.dumps(doc))

    def serviceaccount_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/name`` (a fresh token), for
        running a component under exactly the RBAC its account is bound to."""
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=6h").stdout.strip()
        entry = json.loads(Path(self.kubeconfig).read_text())["clusters"][0]
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [entry],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": entry["name"], "user": name}}],
            "current-context": name,
        }
        path.write_text(json.dumps(cfg))
        path.chmod(0o600)
        return path

    def env(self) -> dict[str, str]:
        """Environment for subprocesses that should talk to this cluster."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def dump(self, lines: int = 60) -> str:
        """The tail of every component log, plus recent events: for test failure reports."""
        parts = []
        for name in self.pids or COMPONENTS:
            log = self.logs / f"{name}.log"
            if log.exists():
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"===== {name} (last {len(tail)} lines) =====\n" + "\n".join(tail))
        try:
            ev = self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False, timeout=10)
            parts.append("===== events =====\n" + "\n".join(ev.stdout.splitlines()[-lines:]))
        except (subprocess.TimeoutExpired, OSError) as e:  # the apiserver may be what failed
            parts.append(f"===== events unavailable: {e} =====")
        return "\n".join(parts)

    # -- processes ----------------------------------------------------------------------------------

    def _args(self, name: str) -> list[str]:
        p, pki, d = self.ports, self.pki, self.dir
        if name == "etcd":
            return [
                "--name=kvfence",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{p['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{p['etcd']}",
                f"--listen-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
                f"--initial-cluster=kvfence=http://127.0.0.1:{p['etcd-peer']}",
                "--unsafe-no-fsync=true",  # a test cluster: durability across host crashes is not needed
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ]
        if name == "kube-apiserver":
            return [
                f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
                f"--bind-address={self.host}",
                f"--advertise-address={self.host}",
                f"--secure-port={p['apiserver']}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",  # on top of the default set
                "--allow-privileged=true",
                "--profiling=false",
                # Pods reach the apiserver through the `kubernetes` Service only on the real node.
                f"--endpoint-reconciler-type={'lease' if self.real_node else 'none'}",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",
                "--v=1",
            ]
        if name == "kube-controller-manager":
            kc = d / "controller-manager.kubeconfig"
            return [
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p['controller-manager']}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--leader-elect=false",
                "--concurrent-gc-syncs=5",
                "--v=1",
            ]
        if name == "kube-scheduler":
            kc = d / "scheduler.kubeconfig"
            return [
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p['scheduler']}",
                "--leader-elect=false",
                "--v=1",
            ]
        if name == "kwok":
            return [
                f"--kubeconfig={d / 'kwok.kubeconfig'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--cidr=10.244.0.1/16",
                "--node-ip=127.0.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{p['kwok']}",
            ]
        raise ValueError(name)

    def _spawn(self, name: str, argv: Sequence[str] | None = None) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            list(argv) if argv else [str(self.bin_dir / name), *self._args(name)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.dir,
        )
        log.close()
        self._procs[name] = proc
        self.pids[name] = proc.pid

    def _save_state(self) -> None:
        self.state_file.write_text(
            json.dumps(
                {
                    "pids": self.pids,
                    "ports": self.ports,
                    "kubeconfig": str(self.kubeconfig),
                    "realNode": self.real_node,
                },
                indent=2,
            )
        )

    # -- waiting ------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-30:]
                raise ClusterError(f"{name} exited with {proc.returncode}:\n" + "\n".join(tail))

    def _wait_for(self, ok: Any, deadline: float, what: str) -> None:
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if ok():
                    return
            except Exception as e:  # keep polling; report the last error on timeout
                last = e
            time.sleep(0.2)
        raise ClusterError(f"timed out waiting for {what}" + (f": {last}" if last else ""))

    def _wait_http(self, url: str, deadline: float, what: str, ctx: ssl.SSLContext | None = None) -> None:
        def ok() -> bool:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
                return bool(r.status == 200)

        self._wait_for(ok, deadline, what)

    def _admin_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def _wait_apiserver(self, deadline: float) -> None:
        self._wait_http(f"{self.server}/readyz", deadline, "kube-apiserver /readyz", self._admin_ssl())

    def _wait_https_health(self, component: str, deadline: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the component's self-signed serving cert, on loopback
        self._wait_http(f"https://127.0.0.1:{self.ports[component]}/healthz", deadline, component, ctx)

    def _wait_nodes_ready(self, deadline: float) -> None:
        def ok() -> bool:
            out = self.kubectl(
                "get",
                "nodes",
                "-o",
                "jsonpath={range .items[*]}{.metadata.name}="
                '{.status.conditions[?(@.type=="Ready")].status}{"\\n"}{end}',
            ).stdout
            ready = {line.split("=")[0] for line in out.splitlines() if line.endswith("=True")}
            return {n.name for n in self.nodes} <= ready

        self._wait_for(ok, deadline, "fake nodes Ready")


def _terminate(pid: int, proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if proc is not None:
            if proc.poll() is not None:
                return
        else:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if proc is not None:
        proc.wait()


def _alive(state_file: Path) -> bool:
    if not state_file.exists():
        return False
    pids = json.loads(state_file.read_text()).get("pids", {})
    for pid in pids.values():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    return bool(pids)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster and leave it running")
    up.add_argument("--dir", default=".cluster")
    up.add_argument("--bin-dir", required=True)
    up.add_argument("--real-node", action="store_true", help="add a real node on which pods run")
    down = sub.add_parser("down", help="stop a cluster started with `up`")
    down.add_argument("--dir", default=".cluster")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    if args.cmd == "up":
        if _alive(d / "state.json"):
            print(f"already running; export KUBECONFIG={(d / 'kubeconfig').resolve()}")
            return 0
        LocalCluster(d, "/nonexistent").stop()  # clean up a half-dead previous run
        t0 = time.monotonic()
        c = LocalCluster(d, args.bin_dir, real_node=args.real_node)
        c.start()
        print(
            f"cluster up in {time.monotonic() - t0:.1f} s "
            f"({len(c.nodes)} fake nodes, {len(c.gpu_nodes)} with GPUs)"
        )
        print(f"export KUBECONFIG={c.kubeconfig}")
        print(f"export PATH={c.bin_dir}:$PATH")
        return 0
    LocalCluster(d, "/nonexistent").stop()
    print("cluster stopped")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # so that `cluster.realnode` imports as it does under pytest
    sys.exit(main())
