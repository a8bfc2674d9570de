"""The Secrets the operator depends on are watched, on the real control plane, under the operator's own
least-privilege ServiceAccount: a deleted or edited signing key and a rotated or deleted tenant API key
are acted on within seconds, and a Secret nothing depends on triggers no reconcile. The operator here
resyncs once an hour, so nothing below can be the resync's doing.

The same operator admits a metrics scraper to the engines (opt-in flags): the NetworkPolicy the API
server stores is checked rule by rule."""

from __future__ import annotations

import base64
import functools
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cluster.manifests import (
    CPU_ANY_NAMESPACE,
    condition,
    secret,
    sha,
    tenant_binding,
    tenant_namespace,
    trust_class,
)

from kvfence import contract
from kvfence.operator import rbac
from kvfence.operator.apikeys import API_KEYS_LIST_MIN

pytestmark = pytest.mark.cluster

#: The TrustClasses here run no engine pods: only the Secrets matter.
tc = functools.partial(trust_class, **CPU_ANY_NAMESPACE, replicas=0)

RESYNC_SECONDS = 3600
#: "Within seconds": far below the resync, with room for a loaded 2-core test machine.
PROMPT = 30.0
OPERATOR_ARGS = (
    "--resync-seconds",
    str(RESYNC_SECONDS),
    "--metrics-scraper-namespace-label=kubernetes.io/metadata.name=monitoring",
    "--metrics-scraper-pod-label=app.kubernetes.io/name=prometheus",
)
EVENTS = "kvfence_operator_secret_events_total"


def hashes(kv: Any, tenant: str) -> list[str] | None:
    t = kv.routing_table()["tenants"].get(tenant)
    return None if t is None else list(t["apiKeyHashes"])


def signing_key(kv: Any, ns: str) -> str | None:
    s = kv.json("get", "secret", "kvfence-signing-key", "-n", ns)
    return None if s is None else str(s["data"]["current"])


def prompt(kv: Any, wait: Any, operator: Any, pred: Any, what: str) -> float:
    """Wait at most PROMPT seconds for ``pred``; return how long it took."""
    started = time.monotonic()
    wait(pred, f"{what} (within {PROMPT:.0f}s, resync {RESYNC_SECONDS}s)", PROMPT, 0.2, dump=operator.tail)
    return time.monotonic() - started


def quiet(operator: Any, wait: Any, kinds: tuple[str, ...]) -> dict[str, float]:
    """Wait until the queue is empty and the reconcile counts of ``kinds`` hold still for 3 s."""
    last: dict[str, Any] = {}

    def settled() -> dict[str, float] | None:
        now = {k: operator.reconciles(k) for k in kinds}
        depth = operator.metrics().get("kvfence_operator_queue_depth", 1)
        if depth == 0 and last.get("counts") == now and time.monotonic() - last["since"] >= 3:
            return now
        if last.get("counts") != now or depth != 0:
            last.update(counts=now, since=time.monotonic())
        return None

    result: dict[str, float] = wait(settled, "the operator idle", 120, 0.5, dump=operator.tail)
    return result


@pytest.fixture
def cleanup(kv: Any, wait: Any) -> Iterator[list[str]]:
    """TrustClasses and namespaces a test created: deleted afterwards (classes waited for)."""
    made: list[str] = []
    yield made
    for name in made:
        kind = "trustclass" if not name.startswith("ns/") else "namespace"
        kv("delete", kind, name.removeprefix("ns/"), "--ignore-not-found", "--wait=false")
    for name in made:
        if not name.startswith("ns/"):
            wait(lambda n=name: kv.json("get", "trustclass", n) is None, f"TrustClass {name} deleted", 120)
            wait(lambda n=name: kv.json("get", "namespace", f"kvf-{n}") is None, f"kvf-{name} gone", 180)


def test_the_operator_may_watch_signing_keys_and_opted_in_tenant_secrets_only(
    installed: Any, kv: Any, cleanup: list[str]
) -> None:
    cleanup += ["ns/wr-open", "ns/wr-closed"]
    namespaces = [*tenant_namespace("wr-open", grant=True), *tenant_namespace("wr-closed", grant=False)]
    assert kv.apply(*namespaces).returncode == 0
    sa = f"--as=system:serviceaccount:kvfence-system:{rbac.NAME}"

    def can(*args: str) -> bool:
        return kv("auth", "can-i", *args, sa, check=False).stdout.strip() == "yes"

    # signing keys: listed and watched by name, in every namespace (a field selector names it)
    assert can("watch", "secrets/kvfence-signing-key", "--all-namespaces")
    assert can("list", "secrets/kvfence-signing-key", "--all-namespaces")
    assert not can("watch", "secrets/kvfence-routing", "--all-namespaces")
    assert not can("watch", "secrets", "--all-namespaces")
    assert not can("list", "secrets", "-n", "kube-system")
    assert not can("watch", "secrets/some-tenant-secret", "-n", "wr-closed")
    # tenant Secrets: only where the namespace opted in
    assert can("watch", "secrets", "-n", "wr-open") and can("list", "secrets", "-n", "wr-open")
    assert not can("watch", "secrets", "-n", "wr-closed") and not can("get", "secrets", "-n", "wr-closed")
    assert not can("update", "secrets", "-n", "wr-open") and not can("delete", "secrets", "-n", "wr-open")


def test_a_deleted_or_edited_signing_key_is_acted_on_within_seconds(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup.append("watch-sk")
    ns = "kvf-watch-sk"
    assert kv.apply(tc("watch-sk")).returncode == 0
    wait(lambda: signing_key(kv, ns), "a signing key", 120, dump=operator.tail)
    old = signing_key(kv, ns)
    wait(
        lambda: kv.routing_table()["trustClasses"].get("watch-sk", {}).get("signingKeys") == [old],
        "the class routed with its key",
        120,
        dump=operator.tail,
    )
    enqueued = operator.counter(EVENTS, kind="signing-key", result="enqueued")

    kv("delete", "secret", "kvfence-signing-key", "-n", ns)
    took = prompt(kv, wait, operator, lambda: signing_key(kv, ns) not in (None, old), "a new signing key")
    new = signing_key(kv, ns)
    prompt(
        kv,
        wait,
        operator,
        lambda: kv.routing_table()["trustClasses"]["watch-sk"]["signingKeys"] == [new],
        "the routing table signs with the new key",
    )
    assert operator.counter(EVENTS, kind="signing-key", result="enqueued") > enqueued
    print(f"deleted signing key recreated after {took:.1f}s")

    # Edited by hand: the operator keeps a live key (that is how it survives restarts), so the new
    # value is what the router must sign with at once (no previous key: nothing to wait for).
    edited = base64.b64encode(os.urandom(32)).decode()
    kv(
        "patch",
        "secret",
        "kvfence-signing-key",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"data": {"current": edited}}),
    )
    prompt(
        kv,
        wait,
        operator,
        lambda: kv.routing_table()["trustClasses"]["watch-sk"]["signingKeys"] == [edited],
        "the routing table follows the edited key",
    )
    wait(
        lambda: (
            kv.json("get", "trustclass", "watch-sk")["status"]["signingKeyId"]
            == contract.key_id(base64.b64decode(edited))
        ),
        "the status names the edited key",
        30,
    )
    # the engines reload the key from their mounted Secret: no new pods
    template = kv.json("get", "deployment", "kvfence-engine", "-n", ns)["spec"]["template"]["metadata"]
    assert "kvfence.dev/signing-key-id" not in template["annotations"]
    assert signing_key(kv, ns) == edited


def test_a_rotated_or_deleted_api_key_reaches_the_routing_table_within_seconds(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup += ["watch-keys", "ns/wk-a"]
    objs = [
        tc("watch-keys"),
        *tenant_namespace("wk-a", grant=True),
        secret("acme-keys", "wk-a", k0="sk-acme-1"),
        tenant_binding("acme", "wk-a", "t-acme", "watch-keys"),
    ]
    assert kv.apply(*objs).returncode == 0
    wait(lambda: hashes(kv, "t-acme") == [sha("sk-acme-1")], "t-acme routed", 120, dump=operator.tail)

    # rotation: a new key is added, then the old one removed
    assert kv.apply(secret("acme-keys", "wk-a", k0="sk-acme-1", k1="sk-acme-2")).returncode == 0
    took = prompt(
        kv,
        wait,
        operator,
        lambda: hashes(kv, "t-acme") == sorted([sha("sk-acme-1"), sha("sk-acme-2")]),
        "both keys",
    )
    kv(
        "patch",
        "secret",
        "acme-keys",
        "-n",
        "wk-a",
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/data/k0"}]',
    )
    prompt(kv, wait, operator, lambda: hashes(kv, "t-acme") == [sha("sk-acme-2")], "the old key revoked")
    print(f"rotated API key routed after {took:.1f}s")

    # deleted: the tenant leaves the routing table; created again: it is back
    kv("delete", "secret", "acme-keys", "-n", "wk-a")

    def denied() -> bool:
        b = kv.json("get", "tenantbinding", "acme", "-n", "wk-a")
        return condition(b, "Denied").get("reason") == "ApiKeySecretNotFound" and hashes(kv, "t-acme") is None

    prompt(kv, wait, operator, denied, "Denied: ApiKeySecretNotFound, out of the routing table")
    assert kv.apply(secret("acme-keys", "wk-a", k0="sk-acme-3")).returncode == 0
    prompt(kv, wait, operator, lambda: hashes(kv, "t-acme") == [sha("sk-acme-3")], "bound again")


def test_a_secret_nothing_depends_on_triggers_no_reconcile(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup += ["watch-quiet", "ns/wq-a", "ns/wq-other"]
    objs = [
        tc("watch-quiet"),
        *tenant_namespace("wq-a", grant=True),
        *tenant_namespace("wq-other", grant=True),
        secret("quiet-keys", "wq-a", k0="sk-quiet-1"),
        tenant_binding("quiet", "wq-a", "t-quiet", "watch-quiet"),
    ]
    assert kv.apply(*objs).returncode == 0
    wait(lambda: hashes(kv, "t-quiet") == [sha("sk-quiet-1")], "t-quiet routed", 120, dump=operator.tail)
    wait(lambda: signing_key(kv, "kvf-watch-quiet"), "a signing key", 60)
    # Reconciles a Secret event can cause: "binding" (an API key changed) and "secrets" (a signing key).
    before = quiet(operator, wait, ("binding", "secrets"))
    counts = {
        (k, r): operator.counter(EVENTS, kind=k, result=r)
        for k in ("api-key", "signing-key")
        for r in ("ignored", "enqueued")
    }

    # In the watched tenant namespace, a Secret no binding references: created, changed, deleted.
    assert kv.apply(secret("unrelated", "wq-a", token="a")).returncode == 0
    assert kv.apply(secret("unrelated", "wq-a", token="b")).returncode == 0
    kv("delete", "secret", "unrelated", "-n", "wq-a")
    # A Secret named like a signing key outside any class namespace (both watches see it).
    assert kv.apply(secret("kvfence-signing-key", "wq-a", current="x")).returncode == 0
    # Never delivered at all: another name in a class namespace, any Secret where no binding lives.
    assert kv.apply(secret("other", "kvf-watch-quiet", a="b"), secret("s", "wq-other", a="b")).returncode == 0

    # The events arrived and were dropped ...
    prompt(
        kv,
        wait,
        operator,
        lambda: (
            operator.counter(EVENTS, kind="api-key", result="ignored") >= counts["api-key", "ignored"] + 4
            and operator.counter(EVENTS, kind="signing-key", result="ignored")
            >= counts["signing-key", "ignored"] + 1
        ),
        "the unrelated Secrets' events seen and ignored",
    )
    time.sleep(2.0)  # longer than the queue's coalescing delay: anything enqueued would have run
    # ... and nothing was queued or reconciled because of them.
    assert {k: operator.reconciles(k) for k in before} == before
    for k in ("api-key", "signing-key"):
        assert operator.counter(EVENTS, kind=k, result="enqueued") == counts[k, "enqueued"]
    # The same counters do move for a Secret a binding reads (the check above could fail).
    assert kv.apply(secret("quiet-keys", "wq-a", k0="sk-quiet-2")).returncode == 0
    prompt(
        kv, wait, operator, lambda: hashes(kv, "t-quiet") == [sha("sk-quiet-2")], "the referenced key routed"
    )
    assert operator.reconciles("binding") > before["binding"]
    assert operator.counter(EVENTS, kind="api-key", result="enqueued") > counts["api-key", "enqueued"]


def test_a_namespace_that_did_not_opt_in_is_not_watched(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup += ["watch-closed", "ns/wc-closed"]
    objs = [
        tc("watch-closed"),
        *tenant_namespace("wc-closed", grant=False),
        secret("closed-keys", "wc-closed", k0="sk-closed"),
        tenant_binding("closed", "wc-closed", "t-closed", "watch-closed"),
    ]
    assert kv.apply(*objs).returncode == 0
    wait(
        lambda: (
            condition(kv.json("get", "tenantbinding", "closed", "-n", "wc-closed"), "Denied").get("reason")
            == "ApiKeySecretForbidden"
        ),
        "Denied: ApiKeySecretForbidden",
        120,
        dump=operator.tail,
    )
    wait(
        lambda: operator.counter("kvfence_operator_secret_watch_namespaces", state="forbidden") >= 1,
        "the namespace's watch refused and counted",
        60,
        dump=operator.tail,
    )
    assert "may not watch the Secrets of namespace wc-closed" in operator.log.read_text()


def test_engines_admit_the_configured_metrics_scraper_on_the_metrics_port_only(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    cleanup.append("scraped")
    engine = {"image": "kvfence/engine:dev", "model": {"name": "kvfence/tiny"}, "port": 8123}
    assert kv.apply(tc("scraped", engine=engine)).returncode == 0
    ns = "kvf-scraped"
    np = wait(
        lambda: kv.json("get", "networkpolicy", "kvfence-engine-ingress", "-n", ns),
        "the engine NetworkPolicy",
        120,
        dump=operator.tail,
    )
    engine_pods = {"app.kubernetes.io/name": "kvfence-engine", "app.kubernetes.io/instance": "scraped"}
    expected = {
        "podSelector": {"matchLabels": engine_pods},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "kvfence-system"}
                        },
                        "podSelector": {
                            "matchLabels": {
                                "app.kubernetes.io/name": "kvfence",
                                "app.kubernetes.io/component": "router",
                            }
                        },
                    }
                ],
                "ports": [{"protocol": "TCP", "port": 8123}],
            },
            {
                "from": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                    }
                ],
                "ports": [{"protocol": "TCP", "port": 8123}],
            },
        ],
    }
    assert np["spec"] == expected
    # the engine pods it selects serve /metrics on that port
    dep = kv.json("get", "deployment", "kvfence-engine", "-n", ns)
    assert engine_pods.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (port,) = dep["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert port["containerPort"] == 8123
    # the scraper's rule is the operator's like the rest: removed by hand, it comes back
    kv(
        "patch",
        "networkpolicy",
        "kvfence-engine-ingress",
        "-n",
        ns,
        "--type=json",
        "-p",
        '[{"op":"remove","path":"/spec/ingress/1"}]',
    )
    wait(
        lambda: kv.json("get", "networkpolicy", "kvfence-engine-ingress", "-n", ns)["spec"] == expected,
        "the scraper rule restored",
        60,
        dump=operator.tail,
    )


def test_a_class_reconcile_reads_its_class_engine_and_signing_key_from_the_watches(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    """The reconcile a drift repair causes reads the TrustClass, its engine Deployment and its
    signing-key Secret as their watches delivered them (no GET; the resync, which empties that
    cache, is an hour away here): only the deleted Service is read from the API server, and put
    back."""
    cleanup.append("cached")
    assert kv.apply(tc("cached")).returncode == 0
    ns = "kvf-cached"
    engine = ("get", "deployment", "kvfence-engine", "-n", ns)
    wait(lambda: kv.json(*engine), "the engine", 120, dump=operator.tail)
    quiet(operator, wait, ("class", "routing"))

    def gets(resource: str) -> float:
        return operator.counter("kvfence_operator_api_requests_total", verb="GET", resource=resource)

    def cached(resource: str) -> float:
        return operator.counter("kvfence_operator_watch_cache_reads_total", resource=resource)

    resources = ("trustclasses", "deployments", "secrets", "services")
    before = {r: (gets(r), cached(r)) for r in resources}
    reconciles = operator.reconciles("class")
    kv("delete", "service", "kvfence-engine", "-n", ns)
    prompt(kv, wait, operator, lambda: kv.json("get", "service", "kvfence-engine", "-n", ns), "service back")
    quiet(operator, wait, ("class", "routing"))
    assert operator.reconciles("class") > reconciles
    after = {r: (gets(r), cached(r)) for r in resources}
    for r in ("trustclasses", "deployments", "secrets"):
        assert after[r][0] == before[r][0], (r, before, after)
        assert after[r][1] > before[r][1], (r, before, after)
    assert after["services"][0] > before["services"][0]  # the deleted one: read, then applied


def test_a_namespace_granting_access_later_to_many_bindings_has_their_keys_read_by_one_list(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    """Many bindings whose Secrets the operator could not read: once their namespace grants access,
    the decision reads their API keys with one paged LIST of the namespace's Secrets (a few GETs of
    Secrets in all, not one per binding), and every tenant is routed with its own key."""
    n = 2 * API_KEYS_LIST_MIN
    cleanup += ["watch-many", "ns/wl-many"]
    objs: list[dict[str, Any]] = [tc("watch-many"), *tenant_namespace("wl-many", grant=False)]
    for i in range(n):
        objs += [
            secret(f"many-{i}-keys", "wl-many", k0=f"sk-many-{i}"),
            tenant_binding(f"many-{i}", "wl-many", f"t-many-{i}", "watch-many"),
        ]
    assert kv.apply(*objs).returncode == 0

    def denied() -> int:
        items = (kv.json("get", "tenantbindings", "-n", "wl-many") or {}).get("items", [])
        return sum(condition(b, "Denied").get("reason") == "ApiKeySecretForbidden" for b in items)

    wait(lambda: denied() == n, "every binding Denied: ApiKeySecretForbidden", 120, dump=operator.tail)
    quiet(operator, wait, ("routing", "binding"))
    gets = operator.counter("kvfence_operator_api_requests_total", verb="GET", resource="secrets")
    assert kv.apply(rbac.tenant_secrets_binding("wl-many", "kvfence-system")).returncode == 0
    prompt(
        kv,
        wait,
        operator,
        lambda: all(hashes(kv, f"t-many-{i}") == [sha(f"sk-many-{i}")] for i in range(n)),
        "every tenant routed",
    )
    quiet(operator, wait, ("routing", "binding"))
    # the LIST's pages and the routing Secret of each decision: far fewer than one GET per binding
    read = operator.counter("kvfence_operator_api_requests_total", verb="GET", resource="secrets") - gets
    assert read < n / 2, (read, operator.tail())


def test_a_namespace_granting_access_later_binds_its_tenant_within_seconds(
    operator: Any, kv: Any, wait: Any, cleanup: list[str]
) -> None:
    """A binding Denied for ApiKeySecretForbidden becomes Bound soon after its namespace grants the
    operator access, without anyone touching the binding (the resync here is an hour away)."""
    cleanup += ["watch-later", "ns/wl-later"]
    objs = [
        tc("watch-later"),
        *tenant_namespace("wl-later", grant=False),
        secret("later-keys", "wl-later", k0="sk-later"),
        tenant_binding("later", "wl-later", "t-later", "watch-later"),
    ]
    assert kv.apply(*objs).returncode == 0

    def binding() -> Any:
        return kv.json("get", "tenantbinding", "later", "-n", "wl-later")

    wait(
        lambda: condition(binding(), "Denied").get("reason") == "ApiKeySecretForbidden",
        "Denied: ApiKeySecretForbidden",
        120,
        dump=operator.tail,
    )
    denied = binding()
    assert "wl-later/later-keys" in condition(denied, "Denied")["message"]
    assert kv.apply(rbac.tenant_secrets_binding("wl-later", "kvfence-system")).returncode == 0
    prompt(kv, wait, operator, lambda: hashes(kv, "t-later") == [sha("sk-later")], "the tenant routed")
    prompt(
        kv,
        wait,
        operator,
        lambda: (
            condition(binding(), "Bound").get("status") == "True"
            and condition(binding(), "Denied").get("status") == "False"
        ),
        "Bound, not Denied",
    )
    after = binding()
    assert after["metadata"]["generation"] == denied["metadata"]["generation"]
    assert after["metadata"].get("annotations") == denied["metadata"].get("annotations")
    # and the namespace's Secrets are watched from now on: a rotated key arrives without a resync
    assert kv.apply(secret("later-keys", "wl-later", k0="sk-later-2")).returncode == 0
    prompt(kv, wait, operator, lambda: hashes(kv, "t-later") == [sha("sk-later-2")], "the new key routed")
