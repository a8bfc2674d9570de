"""Pure builders: TrustClass spec in, Kubernetes objects out (no cluster)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from pydantic import ValidationError

from kvfence.api.common import TenantQuotas
from kvfence.contract import key_id
from kvfence.contract.engine_config import EngineConfig
from kvfence.operator import builders as B
from kvfence.vllm.stats import ENV_STATS_FILE

OPTS = B.OperatorOptions()
KEY1, KEY2, KEY3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
OWNER = {"apiVersion": "kvfence.dev/v1alpha1", "kind": "TrustClass", "name": "gold", "uid": "u"}


def _by_kind(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs}


def test_children_are_all_in_the_class_namespace_and_owned(make_tc: Any) -> None:
    tc = make_tc()
    objs = B.children(tc, signing=B.SigningKeys(KEY1), tenant_quotas=None, opts=OPTS, owner=OWNER)
    kinds = [o["kind"] for o in objs]
    assert kinds == ["ConfigMap", "Secret", "Service", "NetworkPolicy", "PodDisruptionBudget", "Deployment"]
    for o in objs:
        assert o["metadata"]["namespace"] == "kvf-gold"
        assert o["metadata"]["ownerReferences"] == [OWNER]
        lbl = o["metadata"]["labels"]
        for k in ("name", "instance", "component", "part-of", "managed-by"):
            assert f"app.kubernetes.io/{k}" in lbl
        assert lbl[B.LABEL_TRUST_CLASS] == "gold"
    ns = B.namespace(tc, OPTS, OWNER)
    assert ns["metadata"]["name"] == "kvf-gold" and "namespace" not in ns["metadata"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_deployment_requests_and_limits_gpus_with_the_configured_resource_name(make_tc: Any) -> None:
    tc = make_tc(resources={"gpu": {"count": 2, "resourceName": "nvidia.com/mig-1g.10gb"}, "memory": "8Gi"})
    dep = B.deployment(tc, "h", OPTS)
    res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"nvidia.com/mig-1g.10gb": 2, "memory": "8Gi"}
    assert res["limits"] == res["requests"]
    cpu_only = B.deployment(make_tc(resources={"gpu": {"count": 0}}), "h", OPTS)
    assert "resources" not in cpu_only["spec"]["template"]["spec"]["containers"][0]


def test_deployment_is_hardened(make_tc: Any) -> None:
    pod = B.deployment(make_tc(), "h", OPTS)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = pod["containers"][0]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/tmp"] == "tmp" and {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert mounts[B.KEY_DIR] == "signing-key"
    # Liveness and startup: the process; readiness also waits for a config that holds the tenants.
    assert [c[p]["httpGet"]["path"] for p in ("livenessProbe", "startupProbe", "readinessProbe")] == [
        "/health",
        "/health",
        "/ready",
    ]


def test_a_config_waiting_for_its_tenants_says_so_and_rolls_no_pod_when_they_come(make_tc: Any) -> None:
    tc = make_tc()
    waiting = B.engine_config(tc, tenants_pending=True)
    assert waiting["tenantsPending"] is True
    assert "tenantsPending" not in B.engine_config(tc)  # configs rendered before the field are unchanged
    full = B.engine_config(tc, {"acme": TenantQuotas.model_validate({"maxKVBlocks": 8})})
    assert B.config_hash(waiting) == B.config_hash(full)
    assert B.config_hash(waiting) != B.config_hash(B.engine_config(make_tc(engine={"maxModelLen": 1024})))


def test_placement_is_passed_through(make_tc: Any) -> None:
    tol = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    tc = make_tc(
        placement={
            "nodeSelector": {"nvidia.com/gpu.product": "H100"},
            "tolerations": [tol],
            "runtimeClassName": "nvidia",
            "priorityClassName": "inference",
            "affinity": {"nodeAffinity": {"x": 1}},
        }
    )
    pod = B.deployment(tc, "h", OPTS)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [tol]
    assert pod["runtimeClassName"] == "nvidia" and pod["priorityClassName"] == "inference"
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}}


def test_dedicated_nodes_add_anti_affinity_against_other_classes(make_tc: Any) -> None:
    tc = make_tc(
        placement={
            "dedicatedNodes": {"enabled": True, "tolerateTaint": True},
            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"a": 1}]}},
        }
    )
    pod = B.deployment(tc, "h", OPTS)["spec"]["template"]["spec"]
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == {"a": 1}
    term = terms[1]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["namespaceSelector"] == {}
    exprs = term["labelSelector"]["matchExpressions"]
    assert {"key": B.LABEL_TRUST_CLASS, "operator": "NotIn", "values": ["gold"]} in exprs
    assert {"key": B.LABEL_TRUST_CLASS, "operator": "Exists"} in exprs
    assert {"key": B.TAINT_KEY, "operator": "Equal", "value": "gold", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # the user's affinity in the spec is not mutated
    assert (
        len(tc.spec.placement.affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"])
        == 1
    )
    # the engine pods carry the label the other classes' anti-affinity selects on
    assert (
        B.deployment(tc, "h", OPTS)["spec"]["template"]["metadata"]["labels"][B.LABEL_TRUST_CLASS] == "gold"
    )


def test_reference_engine_config_is_a_valid_engine_config(make_tc: Any) -> None:
    tc = make_tc(
        engine={
            "adapters": [{"name": "support"}],
            "numBlocks": 512,
            "maxModelLen": 1024,
            "model": {"name": "kvfence/tiny", "revision": "1", "servedName": "tiny"},
        },
        prefixCache={"scope": "TrustClass", "hashAlgorithm": "blake2b"},
        quotas={"defaults": {"maxKVBlocks": 64, "guaranteedKVBlocks": 8}},
    )
    tq = {"acme": TenantQuotas.model_validate({"maxKVBlocks": 128, "guaranteedKVBlocks": 32})}
    cfg = B.engine_config(tc, tq)
    ec = EngineConfig.model_validate(cfg)
    assert ec.trust_class == "gold" and ec.model.served == "tiny" and ec.adapters == ["support"]
    assert ec.prefix_cache.hash_algorithm == "blake2b" and str(ec.prefix_cache.scope) == "TrustClass"
    assert ec.quotas.default.max_blocks == 64 and ec.quotas.default.guaranteed_blocks == 8
    assert ec.quotas.for_tenant("acme").max_blocks == 128
    assert ec.signing_key_dir == B.KEY_DIR and ec.require_signature
    cm = B.config_map(tc, cfg, OPTS)
    assert json.loads(cm["data"][B.CONFIG_KEY]) == cfg
    # tenant quotas do not restart the engine; everything else does
    assert B.config_hash(cfg) == B.config_hash(B.engine_config(tc, None))
    assert B.config_hash(cfg) != B.config_hash(B.engine_config(make_tc(engine={"numBlocks": 256}), None))
    c = B.deployment(tc, B.config_hash(cfg), OPTS)["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:3] == ["kvfence-engine", "--config", f"{B.CONFIG_DIR}/{B.CONFIG_KEY}"]
    assert B.VLLM_STATS_FILE_ENV not in {e["name"] for e in c["env"]}


def test_block_size_unset_is_16_on_the_reference_engine_and_vllms_choice_on_vllm(make_tc: Any) -> None:
    ref = make_tc()
    assert ref.spec.engine.block_size is None
    cfg = B.engine_config(ref)
    assert cfg["blockSize"] == 16 == EngineConfig.model_validate(cfg).block_size
    # the same config (and restart hash) as a class that spells out the old default
    assert cfg == B.engine_config(make_tc(engine={"blockSize": 16}))
    assert B.engine_config(make_tc(engine={"blockSize": 32}))["blockSize"] == 32
    vllm = make_tc(engine={"runtime": "vllm"})
    assert "blockSize" not in B.engine_config(vllm) and "--block-size" not in B.vllm_args(vllm)
    vllm32 = make_tc(engine={"runtime": "vllm", "blockSize": 32})
    assert B.engine_config(vllm32)["blockSize"] == 32
    args = B.vllm_args(vllm32)
    assert args[args.index("--block-size") + 1] == "32"


def test_num_blocks_unset_is_1024_on_the_reference_engine(make_tc: Any) -> None:
    ref = make_tc()
    cfg = B.engine_config(ref)
    assert cfg["numBlocks"] == 1024 == EngineConfig.model_validate(cfg).num_blocks
    # byte for byte the config (and restart hash) of a class that spells out the old CRD default, so
    # upgrading restarts no reference engine; the stale gpuMemoryUtilization the old CRD stored is unset
    legacy = make_tc(engine={"numBlocks": 1024, "gpuMemoryUtilization": 0.9})
    assert B.config_json(cfg) == B.config_json(B.engine_config(legacy))
    assert B.config_hash(cfg) == B.config_hash(B.engine_config(legacy))
    assert B.deployment(ref, "h", OPTS) == B.deployment(legacy, "h", OPTS)
    assert B.engine_config(make_tc(engine={"numBlocks": 4096}))["numBlocks"] == 4096


def test_gpu_memory_utilization_is_rendered_only_when_set(make_tc: Any) -> None:
    vllm = make_tc(engine={"runtime": "vllm"})
    # unset: vLLM's own default (vLLM sizes its KV pool from it)
    assert "--gpu-memory-utilization" not in B.vllm_args(vllm)
    args = B.vllm_args(make_tc(engine={"runtime": "vllm", "gpuMemoryUtilization": 0.85}))
    i = args.index("--gpu-memory-utilization")
    assert args[i + 1] == "0.85"
    # where it was rendered before it became optional: pods of classes that set it do not change
    assert args[i - 2] == "--tensor-parallel-size" and args[i + 2] == "--dtype"
    # a class stored by the old CRD carries its default 0.9: still rendered, so its pods do not change
    legacy = make_tc(engine={"runtime": "vllm", "numBlocks": 1024, "gpuMemoryUtilization": 0.9})
    assert B.vllm_args(legacy) == B.vllm_args(
        make_tc(engine={"runtime": "vllm", "gpuMemoryUtilization": 0.9})
    )
    assert "--gpu-memory-utilization 0.9" in " ".join(B.vllm_args(legacy))
    assert not any("num-blocks" in a or "num_gpu_blocks" in a for a in B.vllm_args(legacy))


def test_vllm_engine_config_carries_the_operators_guarantee_budget(make_tc: Any) -> None:
    # vLLM's scheduler plugin reads only the quotas (and keys) from the file and fences vLLM's own
    # pool; numBlocks there is the budget the operator admits guarantees against, checked by the model
    vllm = make_tc(engine={"runtime": "vllm"})
    cfg = B.engine_config(vllm)
    assert cfg["numBlocks"] == 1024 == vllm.spec.engine.kv_block_budget
    assert B.engine_config(make_tc(engine={"runtime": "vllm", "numBlocks": 1024})) == cfg
    tq = {"t": TenantQuotas.model_validate({"guaranteedKVBlocks": 1025})}
    with pytest.raises(ValueError, match="guaranteedBlocks add up to 1025"):
        B.engine_config(vllm, tq)


def test_vllm_args(make_tc: Any) -> None:
    tc = make_tc(
        engine={
            "runtime": "vllm",
            "blockSize": 32,
            "tensorParallelSize": 2,
            "maxModelLen": 8192,
            "quantization": "awq",
            "adapters": [{"name": "a1", "source": "org/a1"}],
            "extraArgs": ["--enforce-eager"],
            "model": {"name": "org/model", "servedName": "m"},
        },
        resources={"gpu": {"count": 2}},
    )
    args = B.vllm_args(tc)
    joined = " ".join(args)
    # the model is vLLM's positional argument, first (vLLM 0.32 warns that --model will be removed)
    assert args[0] == "org/model" and "--model" not in args
    for frag in (
        "--enable-prefix-caching --prefix-caching-hash-algo sha256",
        "--block-size 32",
        "--tensor-parallel-size 2",
        "--served-model-name m",
        "--enable-lora",
        "--lora-modules a1=org/a1",
        "--middleware kvfence.vllm.middleware.KvfenceMiddleware",
        "--scheduler-cls kvfence.vllm.scheduler.FencedScheduler",
        "--max-model-len 8192",
        "--quantization awq",
    ):
        assert frag in joined
    assert args[-1] == "--enforce-eager"
    c = B.deployment(tc, "h", OPTS)["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == args and "command" not in c
    # the scheduler (engine-core process) hands its counters to the middleware (API server) in /tmp
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["KVFENCE_VLLM_STATS_FILE"] == "/tmp/kvfence-vllm-stats.json"
    assert B.VLLM_STATS_FILE_ENV == ENV_STATS_FILE  # the name the plugin reads
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts[B.TMP_DIR] == "tmp" and env["KVFENCE_VLLM_STATS_FILE"].startswith(B.TMP_DIR + "/")
    # the fenced scheduler holds the quotas, so it is on with prefix caching off too
    off = B.vllm_args(make_tc(engine={"runtime": "vllm"}, prefixCache={"enabled": False}))
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    assert off[off.index("--scheduler-cls") + 1] == "kvfence.vllm.scheduler.FencedScheduler"
    assert off[off.index("--middleware") + 1] == "kvfence.vllm.middleware.KvfenceMiddleware"


NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def test_signing_key_is_kept_created_and_rotated() -> None:
    SK = B.SigningKeys
    assert B.plan_signing_keys(None, None, KEY1, NOW) == SK(KEY1)
    assert B.plan_signing_keys(SK(KEY1), None, KEY2, LATER) == SK(KEY1)
    # a rotation records its time: the router's switch to the new key counts from it
    assert B.plan_signing_keys(SK(KEY1), "r1", KEY2, NOW) == SK(KEY2, KEY1, "r1", NOW)
    assert B.plan_signing_keys(SK(KEY2, KEY1, "r1", NOW), "r1", KEY3, LATER) == SK(KEY2, KEY1, "r1", NOW)
    assert B.plan_signing_keys(SK(KEY2, KEY1, "r1", NOW), "r2", KEY3, LATER) == SK(KEY3, KEY2, "r2", LATER)
    # a previous key without a time (written before it was recorded) waits a whole delay once more
    assert B.plan_signing_keys(SK(KEY2, KEY1, "r1"), "r1", KEY3, LATER) == SK(KEY2, KEY1, "r1", LATER)


def test_signing_secret_round_trips(make_tc: Any) -> None:
    keys = B.SigningKeys(KEY2, KEY1, "r1", NOW)
    s = B.signing_secret(make_tc(), keys, OPTS)
    assert base64.b64decode(s["data"]["current"]) == KEY2
    assert s["metadata"]["annotations"][B.ANNOTATION_KEY_ID] == key_id(KEY2)
    assert s["metadata"]["annotations"][B.ANNOTATION_ROTATED_AT] == NOW
    assert B.read_signing_secret(s) == keys
    assert B.read_signing_secret(None) is None
    assert (
        B.ANNOTATION_ROTATED_AT
        not in B.signing_secret(make_tc(), B.SigningKeys(KEY1), OPTS)["metadata"]["annotations"]
    )


def test_the_router_signs_with_the_previous_key_until_the_new_one_has_propagated() -> None:
    t0 = B.rfc3339_seconds(NOW)
    keys = B.SigningKeys(KEY2, KEY1, "r1", NOW)
    assert B.key_propagation_left(keys, t0 + 10, 180) == 170
    assert B.key_propagation_left(keys, t0 + 180, 180) == 0
    assert B.key_propagation_left(B.SigningKeys(KEY1), t0, 180) == 0
    # a time that does not parse counts as a rotation now
    assert B.key_propagation_left(B.SigningKeys(KEY2, KEY1, "r1", "yesterday"), t0, 180) == 180
    assert B.router_signing_keys(keys, propagated=False) == (KEY1, KEY2)
    assert B.router_signing_keys(keys, propagated=True) == (KEY2, KEY1)
    assert B.router_signing_keys(B.SigningKeys(KEY1), propagated=False) == (KEY1,)


def test_what_reloads_never_changes_the_pod_template(make_tc: Any) -> None:
    """Signing keys, KV quotas (defaults and per tenant) and shared prefixes reach running engines from
    their mounted files: none of them is in the pod template."""
    base = make_tc(quotas={"defaults": {"maxKVBlocks": 64}})
    changed = make_tc(
        quotas={"defaults": {"maxKVBlocks": 32, "guaranteedKVBlocks": 4}},
        prefixCache={"sharedPrefixes": [{"name": "sys", "form": "chat", "text": "You are a bot."}]},
    )
    tq = {"acme": TenantQuotas.model_validate({"maxKVBlocks": 128})}

    def template(tc: Any, keys: B.SigningKeys, quotas: Any) -> Any:
        objs = B.children(tc, signing=keys, tenant_quotas=quotas, opts=OPTS, owner=OWNER)
        return next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]

    before = template(base, B.SigningKeys(KEY1), None)
    assert template(changed, B.SigningKeys(KEY2, KEY1, "r1", NOW), tq) == before
    assert B.ANNOTATION_KEY_ID not in before["metadata"]["annotations"]
    # what needs a new process still does
    assert template(make_tc(engine={"numBlocks": 256}), B.SigningKeys(KEY1), None) != before


def test_rollout_strategy_defaults_per_class_and_follows_engine_rollout(make_tc: Any) -> None:
    def strategy(**spec: Any) -> Any:
        return B.deployment(make_tc(**spec), "h", OPTS)["spec"]["strategy"]["rollingUpdate"]

    gpu, cpu = {"resources": {"gpu": {"count": 1}}}, {"resources": {"gpu": {"count": 0}}}
    assert strategy(**gpu) == {"maxSurge": 0, "maxUnavailable": 1}  # no surge accelerator by default
    assert strategy(**cpu) == {"maxSurge": 1, "maxUnavailable": 0}
    # a GPU class that keeps serving from the old pod while the new one loads: a surge asked for
    # means no replica unavailable unless that is set too
    assert strategy(**gpu, engine={"rollout": {"maxSurge": 1}}) == {"maxSurge": 1, "maxUnavailable": 0}
    half = {"rollout": {"maxSurge": "50%"}}
    assert strategy(**gpu, engine=half) == {"maxSurge": "50%", "maxUnavailable": 0}
    surge_and_down = {"rollout": {"maxSurge": 1, "maxUnavailable": 1}}
    assert strategy(**gpu, engine=surge_and_down) == {"maxSurge": 1, "maxUnavailable": 1}
    both = {"rollout": {"maxSurge": 1, "maxUnavailable": 0}}
    assert strategy(**gpu, engine=both) == {"maxSurge": 1, "maxUnavailable": 0}
    assert strategy(**cpu, engine={"rollout": {"maxSurge": "25%"}}) == {
        "maxSurge": "25%",
        "maxUnavailable": 0,
    }
    # a default that would leave both 0 is 1 instead (a rollout must be able to progress)
    assert strategy(**gpu, engine={"rollout": {"maxUnavailable": 0}}) == {"maxSurge": 1, "maxUnavailable": 0}
    assert strategy(**cpu, engine={"rollout": {"maxSurge": "0%"}}) == {"maxSurge": "0%", "maxUnavailable": 1}


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"maxSurge": 0, "maxUnavailable": "0%"}, "cannot both be 0"),
        ({"maxSurge": -1}, "is not a count"),
        ({"maxUnavailable": "101%"}, "is not a count"),
        ({"maxUnavailable": "one"}, "is not a count"),
    ],
)
def test_rollout_refuses_what_a_deployment_cannot_do(make_tc: Any, rollout: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make_tc(engine={"rollout": rollout})


def test_network_policy_admits_only_router_pods(make_tc: Any) -> None:
    opts = B.OperatorOptions(router_namespace="edge", router_pod_labels={"app": "router"})
    np = B.network_policy(make_tc(), opts)
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "edge"}},
        "podSelector": {"matchLabels": {"app": "router"}},
    }
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_network_policy_admits_a_configured_metrics_scraper_on_the_metrics_port_only(make_tc: Any) -> None:
    tc = make_tc(engine={"port": 8123})
    opts = B.OperatorOptions(
        router_namespace="edge",
        router_pod_labels={"app": "router"},
        metrics_scraper_namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
        metrics_scraper_pod_labels={"app.kubernetes.io/name": "prometheus"},
    )
    router_rule, scraper_rule = B.network_policy(tc, opts)["spec"]["ingress"]
    assert (
        router_rule
        == B.network_policy(tc, B.OperatorOptions("edge", {"app": "router"}))["spec"]["ingress"][0]
    )
    assert scraper_rule == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8123}],
    }
    # both runtimes serve /metrics on the engine port (the inference API there needs router signatures)
    assert B.metrics_port(tc) == 8123 == tc.spec.engine.port
    # without pod labels: every pod of the monitoring namespaces, still only that port
    (peer,) = B.network_policy(tc, B.OperatorOptions(metrics_scraper_namespace_labels={"team": "obs"}))[
        "spec"
    ]["ingress"][1]["from"]
    assert peer == {"namespaceSelector": {"matchLabels": {"team": "obs"}}}
    # off by default
    assert len(B.network_policy(tc, OPTS)["spec"]["ingress"]) == 1


def test_a_scraper_needs_a_namespace_selector() -> None:
    # a podSelector alone would mean the engine's own namespace; from every namespace, anyone's pod
    with pytest.raises(ValueError, match="namespace labels"):
        B.OperatorOptions(metrics_scraper_pod_labels={"app": "prometheus"})


@pytest.mark.parametrize(
    "bad", ["novalue", "=x", "k=has space", "-k=v", "k=-v", "Upper.case/k=v", "k=" + "v" * 64]
)
def test_label_flags_are_validated(bad: str) -> None:
    assert B.parse_labels(["kubernetes.io/metadata.name=monitoring", "app=", "a.b/c_d=x-y.z"]) == {
        "kubernetes.io/metadata.name": "monitoring",
        "app": "",
        "a.b/c_d": "x-y.z",
    }
    with pytest.raises(ValueError, match="not a label"):
        B.parse_labels([bad])


def test_scraper_flags_reach_the_operator_options() -> None:
    from kvfence.operator.main import parse_args

    args = parse_args(
        [
            "--metrics-scraper-namespace-label=kubernetes.io/metadata.name=monitoring",
            "--metrics-scraper-pod-label=app.kubernetes.io/name=prometheus",
        ]
    )
    assert args.scraper_namespace_labels == {"kubernetes.io/metadata.name": "monitoring"}
    assert args.scraper_pod_labels == {"app.kubernetes.io/name": "prometheus"}
    for bad in (["--metrics-scraper-pod-label=app=prometheus"], ["--metrics-scraper-namespace-label=x"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_service_and_pdb_select_engine_pods(make_tc: Any) -> None:
    tc = make_tc()
    sel = B.selector_labels("gold")
    assert B.service(tc, OPTS)["spec"]["selector"] == sel
    pdb = B.pod_disruption_budget(tc, OPTS)
    assert pdb["spec"]["selector"]["matchLabels"] == sel and pdb["spec"]["maxUnavailable"] == 1
    tmpl = B.deployment(tc, "h", OPTS)["spec"]["template"]["metadata"]["labels"]
    assert sel.items() <= tmpl.items()
    assert B.endpoint(tc, OPTS) == "http://kvfence-engine.kvf-gold.svc.cluster.local:8000"


def test_builders_are_deterministic(make_tc: Any) -> None:
    tc = make_tc(placement={"dedicatedNodes": {"enabled": True}})
    a = B.children(tc, signing=B.SigningKeys(KEY1), tenant_quotas=None, opts=OPTS, owner=OWNER)
    b = B.children(tc, signing=B.SigningKeys(KEY1), tenant_quotas=None, opts=OPTS, owner=OWNER)
    assert a == b


@pytest.mark.parametrize("bad", [{"numBlocks": 4}])
def test_invalid_engine_config_fails_in_the_builder(make_tc: Any, bad: dict[str, Any]) -> None:
    tc = make_tc(engine=bad)
    tq = {"t": TenantQuotas.model_validate({"guaranteedKVBlocks": 8})}
    with pytest.raises(ValueError):
        B.engine_config(tc, tq)


def test_shared_prefixes_reach_the_engine_config_outside_the_restart_hash(make_tc: Any) -> None:
    plain = B.engine_config(make_tc(), None)
    assert "sharedPrefixes" not in plain["prefixCache"]  # nothing declared: the rendered file is unchanged
    prefixes = [
        {"name": "support", "form": "chat", "text": "You are the support bot."},
        {"name": "tools", "form": "completion", "configMapKeyRef": {"name": "prompts", "key": "tools"}},
    ]
    tc = make_tc(prefixCache={"sharedPrefixes": prefixes})
    with pytest.raises(ValueError, match=r"sharedPrefixes\[tools\]"):
        B.engine_config(tc, None)  # the reconciler reads the ConfigMap first
    cfg = B.engine_config(tc, None, {"tools": "Tools: search(q)."})
    assert cfg["prefixCache"]["sharedPrefixes"] == [
        {"name": "support", "form": "chat", "text": "You are the support bot."},
        {"name": "tools", "form": "completion", "text": "Tools: search(q)."},
    ]
    parsed = EngineConfig.model_validate(cfg)
    assert [p.name for p in parsed.prefix_cache.shared_prefixes] == ["support", "tools"]
    # changing a shared prefix must not restart engines: the engine reloads it from the file
    assert B.config_hash(cfg) == B.config_hash(plain)


def test_shared_prefixes_reach_a_vllm_engine_config_too(make_tc: Any) -> None:
    tc = make_tc(
        engine={"runtime": "vllm", "image": "x", "model": {"name": "m"}},
        resources={"gpu": {"count": 1}},
        prefixCache={"sharedPrefixes": [{"name": "s", "form": "chat", "text": "You are a bot."}]},
    )
    cfg = B.engine_config(tc, None)
    assert cfg["prefixCache"]["sharedPrefixes"] == [{"name": "s", "form": "chat", "text": "You are a bot."}]
    # the plugin re-pins on a reload too: no restart
    assert B.config_hash(cfg) == B.config_hash(
        B.engine_config(
            make_tc(
                engine={"runtime": "vllm", "image": "x", "model": {"name": "m"}},
                resources={"gpu": {"count": 1}},
            ),
            None,
        )
    )


@pytest.mark.parametrize("runtime", ["vllm", "reference"])
def test_children_refuse_extra_args_that_undo_isolation(make_tc: Any, runtime: str) -> None:
    """A class the CRD would refuse today (stored before the rule) renders no object at all."""
    tc = make_tc(engine={"runtime": runtime, "extraArgs": ["--enforce-eager", "--kv_transfer_config={}"]})
    with pytest.raises(B.RefusedExtraArgs, match=r"engine.extraArgs: --kv_transfer_config=\{\} refused"):
        B.children(tc, signing=B.SigningKeys(KEY1), tenant_quotas=None, opts=OPTS, owner=OWNER)
    ok = make_tc(engine={"runtime": runtime, "extraArgs": ["--log-level", "DEBUG"]})
    objs = B.children(ok, signing=B.SigningKeys(KEY1), tenant_quotas=None, opts=OPTS, owner=OWNER)
    container = objs[-1]["spec"]["template"]["spec"]["containers"][0]
    assert (container.get("args") or container["command"])[-2:] == ["--log-level", "DEBUG"]
    # a vLLM flag on the reference engine, and the reverse: refused, naming the runtime
    other = ["--enforce-eager"] if runtime == "reference" else ["--port-file", "/tmp/p"]
    with pytest.raises(B.RefusedExtraArgs, match=f"engine.extraArgs: {other[0]} refused"):
        B.children(
            make_tc(engine={"runtime": runtime, "extraArgs": other}),
            signing=B.SigningKeys(KEY1),
            tenant_quotas=None,
            opts=OPTS,
            owner=OWNER,
        )


def test_a_cpu_vllm_class_renders_the_cpu_backend_and_its_kv_cache_size(make_tc: Any) -> None:
    cpu = make_tc(
        engine={"runtime": "vllm", "device": "CPU", "kvCacheMemory": "1Gi"},
        resources={"gpu": {"count": 0}, "memory": "6Gi"},
    )
    args = B.vllm_args(cpu)
    i = args.index("--kv-cache-memory-bytes")
    assert args[i + 1] == str(2**30)
    assert "--gpu-memory-utilization" not in args
    (c,) = B.deployment(cpu, "h", OPTS)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert c["resources"] == {"requests": {"memory": "6Gi"}, "limits": {"memory": "6Gi"}}
    assert not any("nvidia" in k for k in c["resources"]["requests"])
    # a GPU class: neither the CPU environment nor a KV size unless it sets kvCacheMemory
    gpu = make_tc(engine={"runtime": "vllm"})
    (g,) = B.deployment(gpu, "h", OPTS)["spec"]["template"]["spec"]["containers"]
    assert not {"VLLM_TARGET_DEVICE", "VLLM_CPU_OMP_THREADS_BIND"} & {e["name"] for e in g["env"]}
    assert "--kv-cache-memory-bytes" not in B.vllm_args(gpu)
    sized = B.vllm_args(make_tc(engine={"runtime": "vllm", "kvCacheMemory": "40G"}))
    assert sized[sized.index("--kv-cache-memory-bytes") + 1] == str(40 * 10**9)


def test_replicas_managed_externally_leaves_the_count_to_the_autoscaler(make_tc: Any) -> None:
    ext = make_tc(replicasManagedExternally=True)
    assert "replicas" not in B.deployment(ext, "h", OPTS)["spec"]
    assert B.deployment(make_tc(), "h", OPTS)["spec"]["replicas"] == 1  # unset: 1
    assert B.deployment(make_tc(replicas=3), "h", OPTS)["spec"]["replicas"] == 3
    with pytest.raises(ValidationError, match=r"spec\.replicas must be unset with replicasManagedExternally"):
        make_tc(replicasManagedExternally=True, replicas=2)
