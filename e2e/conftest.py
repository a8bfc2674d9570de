"""The e2e suite: helm-install kvfence, apply examples/, and test isolation, spoofing and quotas through
the router's Service. Run it with `make e2e` (not part of `make test`).

Targets, in this order (e2esupport.choose_target):

* ``KVFENCE_E2E_KUBECONFIG=<file>``: any cluster. Its nodes must be able to run the images the chart
  and examples name (kvfence/control-plane:0.1.0, kvfence/engine-reference:0.1.0; build them with
  engine-image/build-images.sh and load or push them; extra Helm values: ``KVFENCE_E2E_HELM_VALUES``,
  comma-separated files). With ``KVFENCE_E2E_CONTAINERD=<socket>`` (a node's containerd on this
  machine, e.g. the project's own cluster from `make up`: .cluster/node/containerd.sock) the suite
  builds the images if needed and imports them there first.
* ``KVFENCE_E2E_LOCAL=1``: no Kubernetes; the router and reference engines as processes, configured
  from examples/ by the operator's pure functions (checks the data path only).
* kind and docker on PATH: a kind cluster (``KVFENCE_E2E_KIND_CLUSTER``, default kvfence-e2e) is
  created, the images are built with docker and loaded.

With none of them every test errors with the reason: a run without a target is never a pass.
``KVFENCE_E2E_KEEP=1`` leaves what was installed (and the kind cluster) in place.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2esupport import (
    VLLM_MANIFEST,
    Kube,
    Router,
    Tenant,
    choose_target,
    deploy,
    example_tenants,
    import_images_into_containerd,
    kind_cluster,
    local_stack,
    port_forward,
    undeploy,
    vllm_tenants,
    wait_router_serves,
)

_KUBE: Kube | None = None
_MODE, _DETAIL = choose_target()

# The NetworkPolicy, revocation and vLLM tests need a cluster; in the process-level mode there is none
# (never a skip: they are not collected, and the report header says so).
collect_ignore = (
    ["test_e2e_networkpolicy.py", "test_e2e_revocation.py", "test_e2e_vllm.py"] if _MODE == "local" else []
)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"kvfence e2e target: {_MODE} ({_DETAIL})"]
    if collect_ignore:
        names = ", ".join(collect_ignore)
        lines.append(f"kvfence e2e: local mode, so {names} are not collected (no Kubernetes)")
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Said again at the end, where -q does not hide it: tests left out are not passes."""
    if collect_ignore:
        terminalreporter.write_line(
            f"kvfence e2e: NOT RUN in local mode (no Kubernetes): {', '.join(collect_ignore)}", yellow=True
        )


@pytest.fixture(scope="session")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    global _KUBE
    mode, detail = choose_target()
    if mode == "none":
        pytest.fail(detail, pytrace=False)
    logs = tmp_path_factory.mktemp("e2e")
    keep = os.environ.get("KVFENCE_E2E_KEEP") == "1"
    if mode == "local":
        with local_stack(logs) as r:
            yield r
        return
    kubeconfig = detail if mode == "cluster" else kind_cluster(detail, logs)
    rebuilt = False
    if os.environ.get("KVFENCE_E2E_CONTAINERD"):
        rebuilt = import_images_into_containerd(os.environ["KVFENCE_E2E_CONTAINERD"], with_vllm=True)
    kube = Kube(kubeconfig, logs, env=dict(os.environ))
    _KUBE = kube
    extra = [v for v in os.environ.get("KVFENCE_E2E_HELM_VALUES", "").split(",") if v]
    try:
        deploy(kube, extra, restart=rebuilt)
        with port_forward(kube) as r:
            yield r
    finally:
        if not keep:
            kube.run("delete", "--ignore-not-found", "--wait=true", "-f", str(VLLM_MANIFEST), check=False)
            undeploy(kube)
            if mode == "kind":
                import subprocess

                subprocess.run(["kind", "delete", "cluster", "--name", detail], check=False)


@pytest.fixture(scope="session")
def kube(router: Router) -> Kube:
    """The cluster under test (cluster and kind modes only)."""
    assert _KUBE is not None, "no cluster in this mode"
    return _KUBE


@pytest.fixture(scope="session")
def vllm(router: Router, kube: Kube) -> dict[str, Tenant]:
    """The tenants of the vLLM class (e2e/manifests/vllm-cpu.yaml), once its engine is Ready and the
    router serves them. Applied only now (test_e2e_vllm.py runs last): vLLM starting on CPU takes both
    of a small node's cores for a while, which the reference engines' health checks must not share."""
    t = vllm_tenants()
    assert set(t) == {"hooli", "umbrella"}, t
    kube.run("apply", "-f", str(VLLM_MANIFEST))
    kube.run("wait", "--for=condition=Ready", "trustclass/vllm-cpu", "--timeout=900s", timeout=960)
    for b in t.values():
        kube.run(
            "wait", "--for=condition=Bound", f"tenantbinding/{b.binding}", "-n", b.namespace, "--timeout=300s"
        )
    wait_router_serves(router, t, timeout=600)
    return t


@pytest.fixture(scope="session")
def tenants() -> dict[str, Tenant]:
    t = example_tenants()
    assert set(t) == {"acme", "globex", "initech"}, t
    return t


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _KUBE is not None:
        try:
            report.sections.append(("kvfence e2e: cluster state, events and logs", _KUBE.dump()))
        except Exception as e:  # the cluster may be what failed
            report.sections.append(("kvfence e2e: dump failed", repr(e)))
