#!/usr/bin/env bash
# Installs the Debian packages the local cluster's real node and the image build need, if missing:
# containerd and runc (container runtime), the CNI plugins, ipset and iptables (NetworkPolicy
# enforcement by kube-router), gcc (the pause binary is compiled from the Kubernetes sources), OpenSSL's
# headers (gcc and libssl-dev build the prefix cache's compiled walk, setup.py), and podman with debootstrap (engine-image/build-images.sh). Also configures podman for this kind of host
# (cgroup v1 hybrid hierarchy: crun fails, runc with cgroupfs works; the default nproc ulimit is above
# the hard limit, so no default ulimits).
set -euo pipefail
need=()
for pair in containerd:/usr/bin/containerd runc:/usr/sbin/runc containernetworking-plugins:/usr/lib/cni/bridge \
            ipset:/usr/sbin/ipset iptables:/usr/sbin/iptables gcc:/usr/bin/gcc iproute2:/usr/sbin/ip \
            kmod:/usr/sbin/modprobe podman:/usr/bin/podman debootstrap:/usr/sbin/debootstrap \
            libssl-dev:/usr/include/openssl/sha.h; do
  [[ -e "${pair#*:}" ]] || need+=("${pair%%:*}")
done
if [[ ${#need[@]} -gt 0 ]]; then
  echo "[install-host-deps] apt-get install ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${need[@]}" >/dev/null
fi
conf=/etc/containers/containers.conf
if ! grep -q 'cgroup_manager = "cgroupfs"' "$conf" 2>/dev/null; then
  echo "[install-host-deps] writing $conf (runc, cgroupfs, no default ulimits)" >&2
  mkdir -p /etc/containers
  cat > "$conf" <<'CONF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
fi
