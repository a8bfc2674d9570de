"""One real node for the local control plane: pods actually run.

kubelet and kube-proxy are built from the same pinned Kubernetes sources as the control plane;
containerd, runc and the CNI plugins (bridge, host-local, portmap, loopback) come from Debian;
kube-router (run as a network-policy controller only) enforces NetworkPolicies with iptables and
ipset; CoreDNS serves cluster DNS. Everything listens on, and every pod is addressed in, the
198.18.0.0/15 range that RFC 2544 reserves for network tests: the node's address 198.18.255.1 sits on
the loopback device, pods get 198.18.0.0/24 on the bridge ``kvf0``, Services get 198.19.0.0/16. No
packet leaves the machine.

What this host imposes (measured here, see docs/architecture.md): cgroup v1 with the cgroupfs driver
(kubelet 1.34 still starts on it with ``failCgroupV1: false``), no CAP_SYS_RESOURCE (so containerd
runs with ``restrict_oom_score_adj``), PID 1 is not systemd.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from support.ports import free_port

if TYPE_CHECKING:
    from cluster.localcluster import LocalCluster

NODE_NAME = "kvf-node-0"
HOST_IP = "198.18.255.1"
CLUSTER_CIDR = "198.18.0.0/16"
POD_CIDR = "198.18.0.0/24"
POD_GATEWAY = "198.18.0.1"
BRIDGE = "kvf0"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
LOCK = Path("/run/kvfence-realnode.lock")

#: Components of the real node, in start order (the cluster stops them in reverse).
COMPONENTS = ("containerd", "kubelet", "kube-proxy", "kube-router", "coredns")
#: Tools the real node needs from the host (Debian packages, see tests/cluster/install-node-deps.sh).
HOST_TOOLS = {
    "containerd": "/usr/bin/containerd",
    "ctr": "/usr/bin/ctr",
    "runc": "/usr/sbin/runc",
    "cni-bridge": "/usr/lib/cni/bridge",
    "ipset": "/usr/sbin/ipset",
    "iptables": "/usr/sbin/iptables",
    "gcc": "/usr/bin/gcc",
}


def missing_host_tools() -> list[str]:
    return [name for name, path in HOST_TOOLS.items() if not Path(path).exists()]


def _run(*cmd: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=60)


class RealNode:
    def __init__(self, cluster: LocalCluster):
        self.c = cluster
        self.dir = cluster.dir / "node"
        self.sock = self.dir / "containerd.sock"

    # -- configuration ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Host networking, PKI, config files and the pause image; before any process starts."""
        if LOCK.exists():
            other = LOCK.read_text().strip()
            if other != str(self.c.dir) and Path(other, "state.json").exists():
                raise RuntimeError(f"another local cluster with a real node is running in {other}")
        LOCK.write_text(str(self.c.dir))
        self.dir.mkdir(parents=True, exist_ok=True)
        for sub in ("containerd/root", "containerd/state", "cni/net.d", "cni/ipam", "kubelet"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        if HOST_IP not in _run("ip", "-4", "addr", "show", "dev", "lo").stdout:
            _run("ip", "addr", "add", f"{HOST_IP}/32", "dev", "lo", check=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        _run("modprobe", "br_netfilter")
        p = self.c.ports
        for name in (
            "kubelet",
            "kubelet-healthz",
            "kube-proxy-healthz",
            "kube-proxy-metrics",
            "kube-router-health",
        ):
            p.setdefault(name, free_port(p.values()))
        self._write_configs()
        self._pause_archive()

    def _write_configs(self) -> None:
        d, pki, p = self.dir, self.c.pki, self.c.ports
        (d / "containerd/config.toml").write_text(
            f"""version = 2
root = "{d / "containerd/root"}"
state = "{d / "containerd/state"}"
[grpc]
  address = "{self.sock}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # No CAP_SYS_RESOURCE here: never ask runc for an oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{HOST_TOOLS["runc"]}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d / "cni/net.d"}"
"""
        )
        conflist = {
            "cniVersion": "1.0.0",
            "name": "kvfence",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(d / "cni/ipam"),
                        "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (d / "cni/net.d/10-kvfence.conflist").write_text(json.dumps(conflist, indent=2))
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "address": HOST_IP,
            "port": p["kubelet"],
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": p["kubelet-healthz"],
            "tlsCertFile": str(pki / "node.crt"),
            "tlsPrivateKeyFile": str(pki / "node.key"),
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "clusterDomain": "cluster.local",
            "clusterDNS": [HOST_IP],
            "resolvConf": "/etc/resolv.conf",
            "protectKernelDefaults": False,
            "podCIDR": POD_CIDR,
            # The image filesystem is not measurable here (cadvisor finds no stats for the disk):
            # keep eviction and image GC out of the way instead of letting them act on bad numbers.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 60,
            "registerNode": True,
            "registerWithTaints": [],
            "localStorageCapacityIsolation": False,
        }
        (d / "kubelet.yaml").write_text(json.dumps(kubelet, indent=2))
        (d / "Corefile").write_text(
            f""".:53 {{
    bind {HOST_IP}
    errors
    health 127.0.0.1:{p.setdefault("coredns-health", free_port(p.values()))}
    ready 127.0.0.1:{p.setdefault("coredns-ready", free_port(p.values()))}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self.c.dir / "coredns.kubeconfig"} kvfence
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""
        )

    def _pause_archive(self) -> None:
        """The sandbox ("pause") image, built from the pinned Kubernetes sources' pause.c."""
        from cluster.oci import Layer, write_archive

        out = self.dir / "pause.oci.tar"
        if out.exists():
            return
        gomod = _run("go", "env", "GOMODCACHE", check=True).stdout.strip()
        src = Path(gomod) / f"k8s.io/kubernetes@v{_k8s_version()}/build/pause/linux/pause.c"
        if not src.exists():
            _run("go", "mod", "download", f"k8s.io/kubernetes@v{_k8s_version()}", check=True)
        binary = self.dir / "pause"
        _run("gcc", "-Os", "-static", "-DVERSION=v3.10-kvfence", "-o", str(binary), str(src), check=True)
        write_archive(
            out, PAUSE_IMAGE, [Layer().add("pause", binary.read_bytes(), 0o755)], entrypoint=["/pause"]
        )

    # -- processes ----------------------------------------------------------------------------------

    def command(self, name: str) -> list[str]:
        c, d, p = self.c, self.dir, self.c.ports
        if name == "containerd":
            return [HOST_TOOLS["containerd"], f"--config={d / 'containerd/config.toml'}"]
        if name == "kubelet":
            return [
                str(c.bin_dir / "kubelet"),
                f"--config={d / 'kubelet.yaml'}",
                f"--kubeconfig={c.dir / 'node.kubeconfig'}",
                f"--root-dir={d / 'kubelet'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={HOST_IP}",
                "--node-labels=kvfence.dev/real-node=true",
                "--v=1",
            ]
        if name == "kube-proxy":
            return [
                str(c.bin_dir / "kube-proxy"),
                f"--kubeconfig={c.dir / 'kube-proxy.kubeconfig'}",
                f"--hostname-override={NODE_NAME}",
                f"--cluster-cidr={CLUSTER_CIDR}",
                "--proxy-mode=iptables",
                "--conntrack-max-per-core=0",  # leave the host's conntrack sysctls alone
                f"--healthz-bind-address=127.0.0.1:{p['kube-proxy-healthz']}",
                f"--metrics-bind-address=127.0.0.1:{p['kube-proxy-metrics']}",
                "--v=1",
            ]
        if name == "kube-router":
            return [
                str(c.bin_dir / "kube-router"),
                f"--kubeconfig={c.dir / 'kube-router.kubeconfig'}",
                f"--hostname-override={NODE_NAME}",
                "--run-firewall=true",
                "--run-router=false",
                "--run-service-proxy=false",
                f"--health-port={p['kube-router-health']}",
                "--metrics-port=0",
                "--v=1",
            ]
        if name == "coredns":
            return [str(c.bin_dir / "coredns"), "-conf", str(d / "Corefile")]
        raise ValueError(name)

    def start(self, spawn: Callable[[str, list[str]], None], deadline: float) -> None:
        """Start the node's processes with the cluster's ``spawn``, each once what it needs is up:
        containerd, then the kubelet and kube-proxy, then (once the Node object exists and is Ready)
        kube-router and CoreDNS."""
        c, p = self.c, self.c.ports
        c.apply(rbac_manifests())
        spawn("containerd", self.command("containerd"))
        c._wait_for(lambda: self.sock.exists(), deadline, "containerd")
        self.import_image(self.dir / "pause.oci.tar")
        for name in ("kubelet", "kube-proxy"):
            spawn(name, self.command(name))

        def node_ready() -> bool:
            jsonpath = 'jsonpath={.status.conditions[?(@.type=="Ready")].status}'
            out = c.kubectl("get", "node", NODE_NAME, "-o", jsonpath, check=False)
            return out.stdout.strip() == "True"

        c._wait_for(node_ready, deadline, f"node {NODE_NAME} Ready")
        for name in ("kube-router", "coredns"):
            spawn(name, self.command(name))
        c._wait_http(f"http://127.0.0.1:{p['coredns-ready']}/ready", deadline, "CoreDNS ready")
        c._wait_http(f"http://127.0.0.1:{p['kube-router-health']}/healthz", deadline, "kube-router health")

    def import_image(self, archive: Path) -> None:
        """Make an OCI archive's image available to the node's pods (imagePullPolicy IfNotPresent/Never)."""
        _run(
            HOST_TOOLS["ctr"],
            f"--address={self.sock}",
            "--namespace=k8s.io",
            "images",
            "import",
            "--no-unpack=false",
            str(archive),
            check=True,
        )

    # -- teardown -----------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """After the node's processes are gone: containers, mounts, iptables chains, the bridge."""
        # containerd-shim processes outlive containerd; they belong to this node if their
        # command line names our socket.
        for line in _run("pgrep", "-af", "containerd-shim").stdout.splitlines():
            pid, _, cmdline = line.partition(" ")
            if str(self.sock) in cmdline or str(self.dir) in cmdline:
                _run("kill", "-9", pid)
        # Pod processes whose shim is gone are reparented; kill what still runs in our cgroups.
        for cg in (
            Path("/sys/fs/cgroup/pids/kubepods").rglob("cgroup.procs")
            if Path("/sys/fs/cgroup/pids/kubepods").exists()
            else []
        ):
            for pid in cg.read_text().split():
                _run("kill", "-9", pid)
        time.sleep(0.5)
        mounts = [m.split()[1] for m in Path("/proc/self/mounts").read_text().splitlines()]
        for m in sorted(
            (m for m in mounts if m.startswith(str(self.dir)) or m.startswith("/run/netns/cni-")),
            reverse=True,
        ):
            _run("umount", "-l", m)
        for ns in Path("/run/netns").glob("cni-*") if Path("/run/netns").exists() else []:
            ns.unlink(missing_ok=True)
        # kubelet, kube-proxy and kube-router program iptables chains named KUBE-*, and kube-router
        # ipsets named KUBE-*: drop them all (only one real node runs on a host, see LOCK).
        saved = _run("iptables-save").stdout
        kept = "\n".join(line for line in saved.splitlines() if "KUBE-" not in line) + "\n"
        if kept.strip() != saved.strip():
            subprocess.run(["iptables-restore"], input=kept, text=True, capture_output=True, timeout=60)
        for name in _run("ipset", "list", "-n").stdout.split():
            if name.startswith("KUBE-"):
                _run("ipset", "destroy", name)
        _run("ip", "link", "del", BRIDGE)
        _run("ip", "addr", "del", f"{HOST_IP}/32", "dev", "lo")
        shutil.rmtree(self.dir / "containerd" / "state", ignore_errors=True)
        if LOCK.exists() and LOCK.read_text().strip() == str(self.c.dir):
            LOCK.unlink()


def _k8s_version() -> str:
    for line in (Path(__file__).parent / "components.env").read_text().splitlines():
        if line.startswith("K8S_VERSION="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError("K8S_VERSION missing from components.env")


def rbac_manifests() -> list[dict[str, Any]]:
    """Roles for the node's helpers that the bootstrap policy does not already grant."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "kvfence:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        _binding("kvfence:coredns", "kvfence:coredns", "coredns"),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "kvfence:kube-router"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["networking.k8s.io"],
                    "resources": ["networkpolicies"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "verbs": ["get", "create", "update"],
                },
                {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
            ],
        },
        _binding("kvfence:kube-router", "kvfence:kube-router", "kube-router"),
    ]


def _binding(name: str, role: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }
