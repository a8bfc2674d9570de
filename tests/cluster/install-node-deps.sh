#!/usr/bin/env bash
# Installs the Debian packages the real node (realnode.py) needs, if any is missing:
# containerd and runc (the container runtime), the CNI plugins, ipset and iptables (NetworkPolicy
# enforcement by kube-router), and gcc (the pause binary is compiled from the Kubernetes sources).
set -euo pipefail
need=()
for pair in containerd:/usr/bin/containerd runc:/usr/sbin/runc containernetworking-plugins:/usr/lib/cni/bridge \
            ipset:/usr/sbin/ipset iptables:/usr/sbin/iptables gcc:/usr/bin/gcc iproute2:/usr/sbin/ip \
            kmod:/usr/sbin/modprobe; do
  [[ -e "${pair#*:}" ]] || need+=("${pair%%:*}")
done
[[ ${#need[@]} -eq 0 ]] && exit 0
echo "[install-node-deps] apt-get install ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "${need[@]}" >/dev/null
