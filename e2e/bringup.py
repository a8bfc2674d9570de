"""`make up`: the whole system on the project's own cluster, with real pods.

Run after `localcluster.py up --real-node` (the Makefile does both): builds the images if needed and
imports them into the real node's containerd, helm-installs the chart, applies examples/ (two trust
classes, three tenants), waits until everything is Ready, and prints how to send a request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2esupport import (
    NAMESPACE,
    RELEASE,
    Kube,
    Router,
    deploy,
    example_tenants,
    import_images_into_containerd,
    wait_router_serves,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".cluster", help="the cluster's directory (localcluster.py --dir)")
    args = ap.parse_args()
    d = Path(args.dir).resolve()
    kubeconfig, sock = d / "kubeconfig", d / "node" / "containerd.sock"
    if not sock.exists():
        print(f"bringup: no real node at {d} (start it with localcluster.py up --real-node)", file=sys.stderr)
        return 2
    print("bringup: images (engine-image/build-images.sh) -> the node's containerd", flush=True)
    rebuilt = import_images_into_containerd(str(sock))
    print("bringup: helm install, examples/, waiting for Ready (a few minutes)", flush=True)
    logs = d / "logs"
    kube = Kube(str(kubeconfig), logs, env=dict(os.environ))
    deploy(kube, [], restart=rebuilt)
    svc = json.loads(kube.run("get", "svc", f"{RELEASE}-router", "-n", NAMESPACE, "-o", "json"))
    ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
    acme = example_tenants()["acme"]
    router = Router(f"http://{ip}:{port}")
    wait_router_serves(router)
    print(
        f"""
kvfence is up. The router's Service is reachable from this machine at http://{ip}:{port}
(kube-proxy routes ClusterIPs from the host). Tenant `acme` (trust class gold):

  export KUBECONFIG={kubeconfig}
  curl -s http://{ip}:{port}/v1/completions \\
    -H 'Authorization: Bearer {acme.api_key}' -H 'Content-Type: application/json' \\
    -d '{{"model": "{acme.model}", "prompt": "Hello, kvfence", "max_tokens": 16}}'

  kubectl get trustclasses,tenantbindings -A
  curl -s http://{ip}:{port}/metrics | grep kvfence_router_requests

Bindings you add (or API keys you revoke) reach the router within seconds. `make down` stops
everything.
"""
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
