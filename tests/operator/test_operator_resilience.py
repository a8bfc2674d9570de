"""Crash, restart and failover on the real control plane: a killed operator converges without
duplicates, a restarted one writes nothing when nothing changed, an API server restart is survived,
and of two replicas only the lease holder reconciles."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from cluster.manifests import (
    CPU_ANY_NAMESPACE,
    condition,
    keys_secret,
    ready,
    tenant_binding,
    tenant_namespace,
    trust_class,
)

pytestmark = pytest.mark.cluster

tc = functools.partial(trust_class, **CPU_ANY_NAMESPACE)

KINDS = ("deployments", "services", "configmaps", "secrets", "networkpolicies", "poddisruptionbudgets")


def snapshot(kv: Any) -> dict[tuple[str, str, str], str]:
    """resourceVersion of every object the operator owns or writes."""
    out: dict[tuple[str, str, str], str] = {}
    sel = "app.kubernetes.io/managed-by=kvfence-operator"
    for kind in (*KINDS, "namespaces"):
        for o in kv.json("get", kind, "-A", "-l", sel)["items"]:
            out[(kind, o["metadata"].get("namespace", ""), o["metadata"]["name"])] = o["metadata"][
                "resourceVersion"
            ]
    for kind in ("trustclasses", "tenantbindings"):
        for o in kv.json("get", kind, "-A")["items"]:
            out[(kind, o["metadata"].get("namespace", ""), o["metadata"]["name"])] = o["metadata"][
                "resourceVersion"
            ]
    return out


def ok_reconciles(op: Any, kind: str) -> float:
    return sum(
        v
        for k, v in op.metrics().items()
        if k.startswith("kvfence_operator_reconciles_total") and f'kind="{kind}"' in k and 'result="ok"' in k
    )


def cleanup_classes(kv: Any, wait: Any, names: list[str]) -> None:
    for n in names:
        kv("delete", "trustclass", n, "--ignore-not-found", "--wait=false")
    for n in names:
        wait(lambda n=n: kv.json("get", "trustclass", n) is None, f"{n} deleted", 120)
        wait(lambda n=n: kv.json("get", "namespace", f"kvf-{n}") is None, f"kvf-{n} gone", 180)


def test_killed_mid_reconcile_converges_without_duplicates_and_restart_writes_nothing(
    operator: Any, kv: Any, wait: Any
) -> None:
    names = [f"crash-{i}" for i in range(8)]
    try:
        assert kv.apply(*(tc(n, replicas=1 + i % 2) for i, n in enumerate(names))).returncode == 0
        # Kill -9 as soon as the operator has started writing children, long before it is done.
        wait(
            lambda: any(kv.json("get", "namespace", f"kvf-{n}") is not None for n in names),
            "the operator starts reconciling",
            120,
            interval=0.05,
            dump=operator.tail,
        )
        operator.kill()
        keys_at_kill = {}
        for n in names:
            s = kv.json("get", "secret", "kvfence-signing-key", "-n", f"kvf-{n}")
            if s is not None:
                keys_at_kill[n] = s["data"]["current"]
        unfinished = [n for n in names if not ready(kv, n)]
        assert unfinished, "the operator finished everything before it was killed; nothing was interrupted"

        operator.start()
        operator.wait_ready()
        for n in names:
            wait(lambda n=n: ready(kv, n), f"{n} Ready after restart", 180, dump=operator.tail)
        for i, n in enumerate(names):
            ns = f"kvf-{n}"
            for kind in KINDS:
                items = kv.json("get", kind, "-n", ns, "-l", "app.kubernetes.io/managed-by=kvfence-operator")[
                    "items"
                ]
                assert len(items) == 1, f"{ns}: {len(items)} {kind}"
            rs = kv.json("get", "replicasets", "-n", ns)["items"]
            assert len(rs) == 1, f"{ns}: {len(rs)} ReplicaSets (the template changed after the restart)"
            wait(
                lambda ns=ns, i=i: len(kv.json("get", "pods", "-n", ns)["items"]) == 1 + i % 2,
                f"{ns} pods",
                60,
            )
            if n in keys_at_kill:
                now = kv.json("get", "secret", "kvfence-signing-key", "-n", ns)["data"]["current"]
                assert now == keys_at_kill[n], f"{n}: the signing key was replaced after the crash"
        table = kv.routing_table()
        assert set(names) <= set(table["trustClasses"])

        # Quiet now: a restarted operator compares everything and writes nothing at all.
        wait(lambda: operator.metrics().get("kvfence_operator_queue_depth", 1) == 0, "queue drained", 60)
        before = snapshot(kv)
        operator.stop()
        operator.start()
        operator.wait_ready()
        # every class compared at start-up, then its signing key checked by a resync pass (--resync-seconds 5)
        wait(lambda: ok_reconciles(operator, "class") >= len(names), "every class compared", 120)
        wait(lambda: ok_reconciles(operator, "secrets") >= len(names), "a resync pass", 120)
        wait(lambda: ok_reconciles(operator, "routing") >= 2, "routing reconciled", 60)
        assert operator.writes() == 0, {
            k: v for k, v in operator.metrics().items() if "api_requests_total" in k
        }
        assert snapshot(kv) == before
    finally:
        cleanup_classes(kv, wait, names)


def test_an_operator_started_to_new_classes_binds_their_tenants_in_one_status_write_each(
    operator: Any, kv: Any, wait: Any
) -> None:
    """What the benchmark measures, in small: the inputs exist before the operator starts. A new
    class gets its signing key before a routing decision can route it and no decision says "not
    ready yet" first, so each binding is written once, straight to Bound, with no Event (a first
    bind is no news); no class polls for the routing decision."""
    names = ["early-0", "early-1"]
    bindings = [f"early-b{i}" for i in range(4)]
    try:
        operator.stop()
        objs = [
            *(tc(n) for n in names),
            *tenant_namespace("early-t", grant=True),
            *(keys_secret(b, "early-t", f"sk-{b}") for b in bindings),
            *(tenant_binding(b, "early-t", f"t-{b}", names[i % 2]) for i, b in enumerate(bindings)),
        ]
        assert kv.apply(*objs).returncode == 0
        operator.start()
        operator.wait_ready()
        for b in bindings:
            wait(
                lambda b=b: (
                    condition(kv.json("get", "tb", b, "-n", "early-t"), "Bound").get("status") == "True"
                ),
                f"{b} Bound",
                120,
                dump=operator.tail,
            )
        for n in names:
            wait(lambda n=n: ready(kv, n), f"{n} Ready", 180, dump=operator.tail)
        assert operator.counter(
            "kvfence_operator_api_requests_total", verb="PATCH", resource="tenantbindings"
        ) == len(bindings)
        assert operator.counter("kvfence_operator_reconciles_total", kind="class", result="requeue") == 0
        events = kv.json(
            "get", "events", "-n", "early-t", "--field-selector", "involvedObject.kind=TenantBinding"
        )
        assert events["items"] == [], [e["reason"] for e in events["items"]]
    finally:
        kv("delete", "namespace", "early-t", "--ignore-not-found", "--wait=false")
        cleanup_classes(kv, wait, names)


def test_apiserver_restart_is_survived(cluster: Any, operator: Any, kv: Any, wait: Any) -> None:
    names = ["survivor", "after-restart"]
    try:
        assert kv.apply(tc("survivor")).returncode == 0
        wait(lambda: ready(kv, "survivor"), "survivor Ready", 180, dump=operator.tail)
        cluster.restart_apiserver()
        # the watches come back: a drift is repaired, a new class is reconciled
        wait(lambda: kv("get", "--raw", "/readyz", check=False).returncode == 0, "apiserver ready", 120)
        kv("delete", "service", "kvfence-engine", "-n", "kvf-survivor")
        wait(
            lambda: kv.json("get", "service", "kvfence-engine", "-n", "kvf-survivor") is not None,
            "repair",
            120,
        )
        assert kv.apply(tc("after-restart")).returncode == 0
        wait(lambda: ready(kv, "after-restart"), "after-restart Ready", 180, dump=operator.tail)
        assert operator.proc is not None and operator.proc.poll() is None  # the same process, never restarted
        wait(operator.ready, "operator ready", 60)
    finally:
        cleanup_classes(kv, wait, names)


def test_only_the_lease_holder_reconciles_and_a_standby_takes_over(
    cluster: Any, installed: Any, operator: Any, kv: Any, wait: Any, tmp_path: Any
) -> None:

    standby = operator.__class__(cluster, installed, tmp_path, identity="op-standby")
    names = ["ha-1", "ha-2"]
    standby.start()
    try:
        wait(
            lambda: "waiting for the leader lease" in standby.log.read_text(),
            "standby waits for the lease",
            60,
        )
        assert not standby.ready()
        assert kv.apply(tc("ha-1")).returncode == 0
        wait(lambda: ready(kv, "ha-1"), "ha-1 Ready (by the leader)", 180, dump=operator.tail)
        assert ok_reconciles(standby, "class") == 0 and standby.writes() == 0
        lease = kv.json("get", "lease", "kvfence-operator", "-n", "kvfence-system")
        assert lease["spec"]["holderIdentity"] == operator.identity
        # the leader dies without releasing the lease: the standby waits for it to expire, then leads
        operator.kill()
        standby.wait_ready(timeout=120)
        lease = kv.json("get", "lease", "kvfence-operator", "-n", "kvfence-system")
        assert lease["spec"]["holderIdentity"] == "op-standby"
        assert kv.apply(tc("ha-2")).returncode == 0
        wait(lambda: ready(kv, "ha-2"), "ha-2 Ready (by the new leader)", 180, dump=standby.tail)
    finally:
        standby.stop()  # releases the lease
        operator.start()
        operator.wait_ready()
        cleanup_classes(kv, wait, names)
