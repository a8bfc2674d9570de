"""Template tests of charts/kvfence: lint, render several values files, assert on the rendered objects.

They use the helm binary built from source by `make components` (no cluster needed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from chart.chartsupport import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    Obj,
    container,
    find,
    flag,
    helm,
    normalize_rules,
    one,
    render,
    render_raw,
)

from kvfence import contract
from kvfence.api import crdgen
from kvfence.contract.routing import ROUTING_SECRET_KEY, ROUTING_SECRET_NAME
from kvfence.operator import builders, rbac
from kvfence.router import source

CI = {p.name.removesuffix("-values.yaml"): p for p in CI_VALUES}
RECOMMENDED = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render([path]) for name, path in CI.items()}


def test_the_ci_values_files_exist() -> None:
    assert {"default", "ha", "monitoring", "minimal", "autoscaling"} <= set(CI)


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "no-values" if v is None else v.name)
def test_helm_lint_strict_is_clean(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    res = helm(*args, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[WARNING]" not in res.stdout and "[ERROR]" not in res.stdout, res.stdout


def test_chart_crds_are_the_generated_ones_byte_for_byte() -> None:
    """kvfence-crdgen writes charts/kvfence/crds/ itself; this is what Helm installs."""
    generated = {name: text.encode() for name, text in crdgen.render_all().items()}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert generated, "kvfence-crdgen renders no CRDs"
    assert shipped.keys() == generated.keys()
    for name, data in generated.items():
        assert shipped[name] == data, f"charts/kvfence/crds/{name} drifted from the models: run `make crds`"


def test_every_object_has_the_recommended_labels_and_one_resource_per_template(
    rendered: dict[str, list[Obj]],
) -> None:
    for name, objs in rendered.items():
        for o in objs:
            labels = o["metadata"].get("labels", {})
            missing = [k for k in RECOMMENDED if k not in labels]
            assert not missing, f"{name}: {o['kind']}/{o['metadata']['name']} lacks {missing}"
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
    for tpl in (CHART / "templates").glob("*.yaml"):
        text = tpl.read_text()
        # One resource per file; only the per-namespace RoleBindings loop over a list.
        assert text.count("\nkind: ") + text.startswith("kind: ") <= 1, tpl.name
        assert len(re.findall(r"^apiVersion:", text, re.M)) == 1, tpl.name


def test_values_have_a_comment_per_key() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    free_form_indent: int | None = None  # inside an example value (resources, hosts, ...): not keys
    checked = 0
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        if free_form_indent is not None:
            if indent > free_form_indent:
                continue
            free_form_indent = None
        assert key[0].islower() and "_" not in key, f"values key {key!r} is not camelCase"
        above = lines[i - 1].strip() if i else ""
        # A block key (operator:, router:) is documented by its children's comments.
        is_block = line.rstrip().endswith(":") and key not in FREE_FORM
        assert above.startswith("#") or is_block, f"values.yaml line {i + 1}: {key} has no comment"
        checked += 1
        if key in FREE_FORM:
            free_form_indent = indent
    assert checked > 80


FREE_FORM = {"resources", "hosts", "parentRefs"}


def test_default_objects(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted(
        [
            ("ServiceAccount", "kvfence-operator"),
            ("ServiceAccount", "kvfence-router"),
            ("ClusterRole", "kvfence-operator"),
            ("ClusterRole", "kvfence-operator-tenant-secrets"),
            ("ClusterRoleBinding", "kvfence-operator"),
            ("Role", "kvfence-operator-leader-election"),
            ("RoleBinding", "kvfence-operator-leader-election"),
            ("Role", "kvfence-router"),
            ("RoleBinding", "kvfence-router"),
            ("ClusterRole", "kvfence-router-endpointslices"),
            ("ClusterRoleBinding", "kvfence-router-endpointslices"),
            ("Deployment", "kvfence-operator"),
            ("Deployment", "kvfence-router"),
            ("Service", "kvfence-operator-metrics"),
            ("Service", "kvfence-router"),
            ("PodDisruptionBudget", "kvfence-operator"),
            ("PodDisruptionBudget", "kvfence-router"),
            ("ConfigMap", "kvfence-dashboard"),
            ("Pod", "kvfence-router-test"),
        ]
    )
    for o in objs:
        if o["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert o["metadata"]["namespace"] == NAMESPACE, o["metadata"]["name"]


def test_helm_test_hook_checks_the_router_service(rendered: dict[str, list[Obj]]) -> None:
    pod = one(rendered["default"], "Pod", "kvfence-router-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == container(one(rendered["default"], "Deployment", "kvfence-router"))["image"]
    assert f"http://kvfence-router.{NAMESPACE}.svc:8080/healthz" in c["command"][-1]
    compile(c["command"][-1], "helm-test", "exec")  # the probe script is valid Python
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_names_are_release_namespaced() -> None:
    objs = render(release="blue")
    names = {o["metadata"]["name"] for o in objs}
    assert "blue-kvfence-operator" in names and "blue-kvfence-router" in names
    assert all(n.startswith("blue-kvfence") for n in names), names
    op = one(objs, "Deployment", "blue-kvfence-operator")
    assert flag(container(op), "lease-name") == ["blue-kvfence-operator"]


def test_operator_deployment_is_ha_and_hardened(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    op = one(objs, "Deployment", "kvfence-operator")
    c = container(op)
    assert op["spec"]["replicas"] == 2
    assert c["command"] == ["kvfence-operator"]
    assert "--leader-elect" in c["args"]
    assert flag(c, "lease-namespace") == [NAMESPACE]
    assert flag(c, "router-namespace") == [NAMESPACE]
    assert flag(c, "identity") == ["$(POD_NAME)"]
    assert {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    # The flags it is given are flags the operator has.
    from kvfence.operator.main import parse_args

    args = parse_args([a.replace("$(POD_NAME)", "pod-0") for a in c["args"]])
    assert args.router_namespace == NAMESPACE and args.leader_elect is True
    assert args.lease_name == "kvfence-operator" and args.identity == "pod-0"
    _assert_hardened(op)
    assert op["spec"]["template"]["spec"]["serviceAccountName"] == "kvfence-operator"
    assert c["ports"][0]["containerPort"] == args.health_port
    # The grant its conditions ask namespaces for is the ClusterRole this release installs.
    other = render(release="acme")
    other_args = parse_args(
        [
            a.replace("$(POD_NAME)", "pod-0")
            for a in container(one(other, "Deployment", "acme-kvfence-operator"))["args"]
        ]
    )
    assert args.tenant_secrets_role == "kvfence-operator-tenant-secrets"
    assert one(other, "ClusterRole", other_args.tenant_secrets_role)["rules"]


def _assert_hardened(deploy: Obj) -> None:
    pod = deploy["spec"]["template"]["spec"]
    c = container(deploy)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["livenessProbe"] and c["readinessProbe"]
    assert c["resources"]["requests"]


def test_router_deployment_reads_the_routing_table_the_operator_renders(
    rendered: dict[str, list[Obj]],
) -> None:
    objs = rendered["default"]
    r = one(objs, "Deployment", "kvfence-router")
    c = container(r)
    pod = r["spec"]["template"]["spec"]
    assert c["command"] == ["kvfence-router"]
    # Default: the Secret through the API, with a token that may read that Secret and nothing else.
    assert flag(c, "routing-secret") == [f"{NAMESPACE}/{ROUTING_SECRET_NAME}"]
    assert flag(c, "routing-secret-key") == [ROUTING_SECRET_KEY] and not flag(c, "routing-table")
    assert not any("secret" in v for v in pod["volumes"])
    assert pod["automountServiceAccountToken"] is True
    role = one(objs, "Role", "kvfence-router")
    assert normalize_rules(role["rules"]) == normalize_rules(
        source.role(NAMESPACE, ROUTING_SECRET_NAME)["rules"]
    )
    binding = one(objs, "RoleBinding", "kvfence-router")
    assert binding["roleRef"]["name"] == "kvfence-router"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}
    ]
    _assert_hardened(r)
    # The flags are the router's own.
    from kvfence.router.server import parse_args

    args = parse_args(c["args"])
    assert args.replicas == 2 and args.port == c["ports"][0]["containerPort"]
    assert args.keepalive_timeout == 75 and not args.access_log
    assert (args.client_write_timeout, args.pool_per_tenant) == (60, 128)
    assert (args.sequences_per_engine, args.queue_per_tenant, args.hold_timeout) == (256, 64, 30)
    off = parse_args(
        container(
            one(render(sets=["router.flowControl.sequencesPerEngine=0"]), "Deployment", "kvfence-router")
        )["args"]
    )
    assert off.sequences_per_engine == 0
    logged = parse_args(
        container(one(render(sets=["router.accessLog=true"]), "Deployment", "kvfence-router"))["args"]
    )
    assert logged.access_log
    assert args.workers == 1
    several = parse_args(
        container(one(render(sets=["router.workers=4"]), "Deployment", "kvfence-router"))["args"]
    )
    assert several.workers == 4
    # The Service reaches those pods.
    svc = one(objs, "Service", "kvfence-router")
    assert svc["spec"]["selector"].items() <= r["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_router_can_read_the_routing_table_from_a_volume_without_api_access() -> None:
    objs = render(
        sets=[
            "router.routingTableSource=volume",
            "router.endpointSlices=false",  # these two need the API too
            "router.quotasFollowReplicas=false",
        ]
    )
    assert not find(objs, "Role", "kvfence-router") and not find(objs, "RoleBinding", "kvfence-router")
    r = one(objs, "Deployment", "kvfence-router")
    c = container(r)
    pod = r["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if "secret" in v)
    assert vol["secret"]["secretName"] == ROUTING_SECRET_NAME
    assert vol["secret"]["optional"] is True
    assert vol["secret"]["items"] == [{"key": ROUTING_SECRET_KEY, "path": ROUTING_SECRET_KEY}]
    mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
    assert flag(c, "routing-table") == [f"{mount['mountPath']}/{ROUTING_SECRET_KEY}"]
    assert not flag(c, "routing-secret")
    assert pod["automountServiceAccountToken"] is False
    res = helm("template", "x", str(CHART), "--set", "router.routingTableSource=mounted", check=False)
    assert res.returncode != 0 and "routingTableSource" in res.stderr


def test_engine_network_policy_admits_the_router_pods(rendered: dict[str, list[Obj]]) -> None:
    """The operator is told the router's labels; the NetworkPolicy it builds must select these pods."""
    objs = rendered["default"]
    op_args = container(one(objs, "Deployment", "kvfence-operator"))
    router_labels = one(objs, "Deployment", "kvfence-router")["spec"]["template"]["metadata"]["labels"]
    told = dict(kv.split("=", 1) for kv in flag(op_args, "router-pod-label"))
    assert told and told.items() <= router_labels.items()
    # What the operator would build with its defaults also matches (labels the chart always sets).
    assert builders.OperatorOptions().router_pod_labels.items() <= router_labels.items()
    opts = builders.OperatorOptions(router_namespace=NAMESPACE, router_pod_labels=told)
    tc = _trust_class()
    peer = builders.network_policy(tc, opts)["spec"]["ingress"][0]["from"][0]
    assert peer["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}


def _trust_class() -> Any:
    from kvfence.api.trustclass import TrustClass

    return TrustClass.model_validate(
        {
            "apiVersion": "kvfence.dev/v1alpha1",
            "kind": "TrustClass",
            "metadata": {"name": "gold"},
            "spec": {
                "engine": {"runtime": "reference", "image": "x", "model": {"name": "m", "revision": "1"}}
            },
        }
    )


def test_rbac_matches_the_operators_own_definition(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["default"]
    assert normalize_rules(one(objs, "ClusterRole", "kvfence-operator")["rules"]) == normalize_rules(
        rbac.cluster_role()["rules"]
    )
    assert normalize_rules(
        one(objs, "ClusterRole", "kvfence-operator-tenant-secrets")["rules"]
    ) == normalize_rules(rbac.tenant_secrets_role()["rules"])
    assert one(objs, "ClusterRole", "kvfence-operator-tenant-secrets")["metadata"]["name"] == (
        rbac.TENANT_SECRETS_ROLE
    )
    role = one(objs, "Role", "kvfence-operator-leader-election")
    assert normalize_rules(role["rules"]) == normalize_rules(
        rbac.lease_role(NAMESPACE, "kvfence-operator")["rules"]
    )
    crb = one(objs, "ClusterRoleBinding", "kvfence-operator")
    assert crb["roleRef"]["name"] == "kvfence-operator"
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "kvfence-operator", "namespace": NAMESPACE}]
    rb = one(objs, "RoleBinding", "kvfence-operator-leader-election")
    assert rb["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    # The router's only grants are its Role on the routing Secret and list/watch of EndpointSlices
    # (both checked in the router tests above).
    assert [
        b["roleRef"]["name"]
        for b in find(objs, "RoleBinding") + find(objs, "ClusterRoleBinding")
        if "router" in str(b["subjects"])
    ] == ["kvfence-router", "kvfence-router-endpointslices"]
    # The operator's names are the ones its code uses.
    assert builders.SIGNING_SECRET_NAME in str(rbac.cluster_role()["rules"])


def test_rbac_covers_a_renamed_release() -> None:
    objs = render(release="blue")
    role = one(objs, "Role", "blue-kvfence-operator-leader-election")
    assert normalize_rules(role["rules"]) == normalize_rules(
        rbac.lease_role(NAMESPACE, "blue-kvfence-operator")["rules"]
    )


def test_ha_values(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["ha"]
    op = one(objs, "Deployment", "kvfence-operator")
    assert op["spec"]["replicas"] == 3
    assert flag(container(op), "lease-seconds") == ["30"]
    assert container(op)["image"] == "registry.example.com/kvfence/control-plane@sha256:" + "0" * 64
    r = one(objs, "Deployment", "kvfence-router")
    assert "replicas" not in r["spec"]  # the HPA owns it
    assert flag(container(r), "replicas") == ["3"]  # quotas divided by minReplicas
    hpa = one(objs, "HorizontalPodAutoscaler", "kvfence-router")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "kvfence-router",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    ing = one(objs, "Ingress", "kvfence-router")
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-example-tls"}]
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend == {"service": {"name": "kvfence-router", "port": {"name": "http"}}}
    bindings = find(objs, "RoleBinding", "kvfence-operator-tenant-secrets")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"]["kind"] == "ClusterRole" and b["roleRef"]["name"] == rbac.TENANT_SECRETS_ROLE
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "kvfence-operator", "namespace": NAMESPACE}
        ]
    assert one(objs, "PodDisruptionBudget", "kvfence-router")["spec"]["maxUnavailable"] == 1


def test_minimal_values(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["minimal"]
    op = one(objs, "Deployment", "kvfence-operator")
    assert op["spec"]["replicas"] == 1
    assert "--no-leader-elect" in container(op)["args"]
    assert not find(objs, "Role", "kvfence-operator-leader-election") and not find(
        objs, "PodDisruptionBudget"
    )
    assert not find(objs, "ConfigMap")
    assert flag(container(one(objs, "Deployment", "kvfence-router")), "replicas") == ["1"]


def test_monitoring_values(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["monitoring"]
    monitors = {o["metadata"]["name"]: o for o in find(objs, "ServiceMonitor")}
    assert set(monitors) == {"kvfence-router", "kvfence-operator"}
    for m in monitors.values():
        assert m["metadata"]["labels"]["release"] == "prometheus"
    svc_port_names = {
        s["metadata"]["name"]: [p["name"] for p in s["spec"]["ports"]] for s in find(objs, "Service")
    }
    assert monitors["kvfence-router"]["spec"]["endpoints"][0]["port"] in svc_port_names["kvfence-router"]
    assert (
        monitors["kvfence-operator"]["spec"]["endpoints"][0]["port"]
        in svc_port_names["kvfence-operator-metrics"]
    )
    pm = one(objs, "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": builders.ENGINE_APP}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"  # the engine container's port name
    # ... and the engines' NetworkPolicy lets Prometheus in, to that port only
    from kvfence.operator.main import parse_args

    args = parse_args(
        [
            a.replace("$(POD_NAME)", "pod-0")
            for a in container(one(objs, "Deployment", "kvfence-operator"))["args"]
        ]
    )
    assert args.scraper_namespace_labels == {"kubernetes.io/metadata.name": "monitoring"}
    assert args.scraper_pod_labels == {"app.kubernetes.io/name": "prometheus"}
    opts = builders.OperatorOptions(
        router_namespace=args.router_namespace,
        router_pod_labels=args.router_labels,
        metrics_scraper_namespace_labels=args.scraper_namespace_labels,
        metrics_scraper_pod_labels=args.scraper_pod_labels,
    )
    tc = _trust_class()
    dep = builders.deployment(tc, "h", opts)
    (engine_port,) = dep["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert engine_port["name"] == pm["spec"]["podMetricsEndpoints"][0]["port"]
    _, scraper = builders.network_policy(tc, opts)["spec"]["ingress"]
    assert scraper["ports"] == [{"protocol": "TCP", "port": engine_port["containerPort"]}]
    # the other values files admit no scraper
    for name in ("default", "ha", "minimal"):
        op_args = container(one(rendered[name], "Deployment", "kvfence-operator"))
        assert not flag(op_args, "metrics-scraper-namespace-label") and not flag(
            op_args, "metrics-scraper-pod-label"
        )
    route = one(objs, "HTTPRoute", "kvfence-router")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {"name": "public", "namespace": "gateways", "sectionName": "https"}
    ]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "kvfence-router", "port": 8080}]


def _alerts(objs: list[Obj]) -> dict[str, Obj]:
    rule = one(objs, "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_prometheus_rule_has_the_isolation_and_capacity_alerts(rendered: dict[str, list[Obj]]) -> None:
    alerts = _alerts(rendered["monitoring"])
    required = {
        "KvfenceHashCollisionDetected": contract.METRIC_HASH_COLLISION,
        "KvfenceCrossTenantAccessRejected": contract.METRIC_CROSS_ACCESS_REJECTED,
        "KvfenceStaleReference": contract.METRIC_STALE_REFERENCE,
        "KvfenceTenantQuotaSaturated": "kvfence_router_quota_rejections_total",
        "KvfenceEngineUnavailable": "kvfence_router_engine_healthy",
        "KvfenceEngineSignatureRejected": contract.METRIC_SIGNATURE_REJECTED,
    }
    for alert, metric in required.items():
        assert alert in alerts, alert
        assert metric in alerts[alert]["expr"], (alert, alerts[alert]["expr"])
        assert alerts[alert]["labels"]["severity"] in ("warning", "critical")
        assert alerts[alert]["labels"]["team"] == "ml-platform"
        # Prometheus templates survived Helm's templating.
        assert "{{ $" in json.dumps(alerts[alert]["annotations"])
    assert alerts["KvfenceEngineUnavailable"]["for"] == "2m"


def _known_metric_names() -> set[str]:
    from kvfence.isolation.metrics import EngineMetrics
    from kvfence.operator import metrics as op_metrics
    from kvfence.router.metrics import RouterMetrics

    names = set()
    for m in RouterMetrics().all:
        names |= {m.name, m.name + "_bucket", m.name + "_sum", m.name + "_count"}
    for registry in (EngineMetrics().registry, op_metrics.REGISTRY):
        for fam in registry.collect():
            names |= {s.name for s in fam.samples}
            names.add(fam.name)
            if fam.type == "counter":
                names.add(fam.name + "_total")
            if fam.type == "histogram":
                names |= {fam.name + "_bucket", fam.name + "_sum", fam.name + "_count"}
    # What the kvfence scheduler exports on a vLLM engine's /metrics (kvfence.vllm.stats).
    from kvfence.vllm.stats import EdgeCounters, FenceCollector

    for fam in FenceCollector(EdgeCounters(), Path("/nonexistent/kvfence-stats.json")).collect():
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
    # Gauges the reference engine registers when it starts (kvfence.engine.engine), and vLLM's own.
    names |= {
        "kvfence_engine_kv_blocks_total",
        "kvfence_engine_kv_blocks_free",
        "kvfence_engine_kv_blocks_active",
        "kvfence_engine_kv_blocks_fenced",
        "kvfence_engine_kv_blocks_cached",
        "kvfence_engine_requests_waiting",
        "kvfence_engine_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits",
        "vllm:prefix_cache_queries",
    }
    return names


METRIC_RE = re.compile(r"\b((?:kvfence|kv_cache|vllm:)[a-z0-9_:]*)")


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_alerts_and_dashboard_only_use_metrics_that_exist(
    rendered: dict[str, list[Obj]], source: str
) -> None:
    known = _known_metric_names()
    if source == "alerts":
        exprs = [a["expr"] for a in _alerts(rendered["monitoring"]).values()]
    else:
        cm = one(rendered["default"], "ConfigMap", "kvfence-dashboard")
        dash = json.loads(cm["data"]["kvfence.json"])
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        assert dash["uid"] and len(exprs) >= 10
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    used = {m for e in exprs for m in METRIC_RE.findall(e)}
    assert used, "no metric names found"
    unknown = sorted(used - known)
    assert not unknown, f"{source} reference metrics nobody exports: {unknown}"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["router.replicaCount=0"], "minimum"),
        (["router.workers=0"], "minimum"),
        (["operator.logFormat=xml"], "logFormat"),
        (["router.typo=1"], "additional properties"),
        (["image.digest=latest"], "digest"),
        (["operator.replicaCount=2", "operator.leaderElection.enabled=false"], "leaderElection"),
        (["operator.engineMetricsScraper.podLabels.app=prometheus"], "needs namespaceLabels"),
        (["operator.engineMetricsScraper.namespaceLabels.team=1"], "string"),
    ],
)
def test_bad_values_are_refused(sets: list[str], message: str) -> None:
    res = render_raw(sets=sets, check=False)
    assert res.returncode != 0
    assert message.lower() in res.stderr.lower(), res.stderr


def test_values_schema_is_valid_json_and_covers_every_top_level_key() -> None:
    import yaml

    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    assert schema["additionalProperties"] is False


def test_router_follows_endpointslices_with_exactly_the_rbac_it_needs(rendered: dict[str, list[Obj]]) -> None:
    from kvfence.router import slices
    from kvfence.router.server import parse_args

    objs = rendered["default"]
    c = container(one(objs, "Deployment", "kvfence-router"))
    args = parse_args(c["args"])
    assert args.endpoint_slices and args.router_service == f"{NAMESPACE}/kvfence-router"
    # The Service whose ready endpoints are counted is the router's own.
    assert one(objs, "Service", "kvfence-router")["metadata"]["namespace"] == NAMESPACE
    role = one(objs, "ClusterRole", "kvfence-router-endpointslices")
    assert normalize_rules(role["rules"]) == normalize_rules(slices.cluster_role()["rules"])
    binding = one(objs, "ClusterRoleBinding", "kvfence-router-endpointslices")
    assert binding["roleRef"]["name"] == "kvfence-router-endpointslices"
    sa = one(objs, "Deployment", "kvfence-router")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    # Neither on, and the table from a volume: no token, no ClusterRole, the Service dialed by name.
    off = render(
        sets=[
            "router.routingTableSource=volume",
            "router.endpointSlices=false",
            "router.quotasFollowReplicas=false",
        ]
    )
    assert not find(off, "ClusterRole", "kvfence-router-endpointslices")
    assert not find(off, "ClusterRoleBinding", "kvfence-router-endpointslices")
    r = one(off, "Deployment", "kvfence-router")
    assert r["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    plain = parse_args(container(r)["args"])
    assert not plain.endpoint_slices and not plain.router_service


def test_engine_autoscaling_example_renders_keda_scaledobjects_in_the_class_namespaces(
    rendered: dict[str, list[Obj]],
) -> None:
    assert not find(rendered["default"], "ScaledObject")  # opt-in
    gold, silver = find(rendered["autoscaling"], "ScaledObject")
    assert (gold["metadata"]["namespace"], silver["metadata"]["namespace"]) == ("kvf-gold", "llm-silver")
    for so in (gold, silver):
        # an autoscaler's target is in its own namespace: the class's engine Deployment
        assert so["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": builders.ENGINE_NAME,
        }
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        ns = so["metadata"]["namespace"]
        assert trigger["metadata"]["query"] == f'sum(vllm:num_requests_waiting{{namespace="{ns}"}})'
    assert (gold["spec"]["minReplicaCount"], gold["spec"]["maxReplicaCount"]) == (1, 4)
    assert gold["spec"]["triggers"][0]["metadata"]["threshold"] == "4"
    assert gold["spec"]["triggers"][0]["metadata"]["serverAddress"].startswith("http://prometheus-operated.")
    assert (silver["spec"]["minReplicaCount"], silver["spec"]["maxReplicaCount"]) == (2, 8)
    assert silver["spec"]["triggers"][0]["metadata"]["threshold"] == "10"
    assert (
        silver["spec"]["triggers"][0]["metadata"]["serverAddress"]
        == "http://prometheus.observability.svc:9090"
    )


def test_engine_autoscaling_refuses_min_above_max() -> None:
    res = render_raw(
        sets=[
            "engineAutoscaling.keda[0].trustClass=gold",
            "engineAutoscaling.keda[0].maxReplicas=1",
            "engineAutoscaling.keda[0].minReplicas=3",
        ],
        check=False,
    )
    assert res.returncode != 0 and "minReplicas must not exceed maxReplicas" in res.stderr
    res = render_raw(sets=["engineAutoscaling.keda[0].trustClass=gold"], check=False)
    assert res.returncode != 0 and "maxReplicas" in res.stderr
