"""examples/ (what the README tour and the e2e suite apply) is valid: against the API models, and
against the real apiserver (server-side dry run: OpenAPI schema and CEL rules of the CRDs)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml
from chart.chartsupport import ROOT
from cluster.localcluster import LocalCluster

from kvfence.api.tenantbinding import TenantBinding
from kvfence.api.trustclass import TrustClass
from kvfence.contract.routing import hash_api_key
from kvfence.operator import builders
from kvfence.operator.bindings import ClassState, KeyLookup, api_keys_from_secret, decide
from kvfence.operator.builders import OperatorOptions

EXAMPLES = ROOT / "examples"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def test_examples_parse_with_the_api_models_and_bind_three_tenants_to_two_classes() -> None:
    classes = [TrustClass.model_validate(d) for d in docs("10-trustclasses.yaml")]
    assert sorted(tc.name for tc in classes) == ["gold", "silver"]
    for tc in classes:
        builders.engine_config(tc)  # the engine's own config model accepts what the operator renders
        assert tc.spec.engine.runtime == "reference"  # runs on clusters without GPUs (kind)
    tenants = docs("20-tenants.yaml")
    bindings = [TenantBinding.model_validate(d) for d in tenants if d["kind"] == "TenantBinding"]
    secrets = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d for d in tenants if d["kind"] == "Secret"
    }
    labels = {d["metadata"]["name"]: d["metadata"]["labels"] for d in docs("00-namespaces.yaml")}
    keys = {}
    for b in bindings:
        s = secrets[(b.namespace, b.spec.api_key_secret_ref.name)]
        data = {k: base64.b64encode(v.encode()).decode() for k, v in s["stringData"].items()}
        found = api_keys_from_secret({"data": data}, b.spec.api_key_secret_ref.key)
        keys[b.key] = KeyLookup(hashes=tuple(hash_api_key(k) for k in found))
    states = {tc.name: ClassState(tc, signing_keys=(bytes(32),)) for tc in classes}
    out = decide(states, bindings, labels, keys, OperatorOptions())
    assert {k: d.reason for k, d in out.decisions.items() if not d.bound} == {}
    assert {t: r.trust_class for t, r in out.table.tenants.items()} == {
        "acme": "gold",
        "globex": "gold",
        "initech": "silver",
    }
    assert out.table.tenants["initech"].quotas.requests_per_minute == 8


def test_helm_values_for_the_examples_grant_exactly_their_namespaces() -> None:
    values = yaml.safe_load((EXAMPLES / "helm-values.yaml").read_text())
    namespaces = sorted(d["metadata"]["name"] for d in docs("00-namespaces.yaml"))
    assert sorted(values["operator"]["tenantNamespaces"]) == namespaces


@pytest.mark.cluster
def test_examples_pass_the_apiservers_validation(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.wait_established("trustclasses.kvfence.dev", "tenantbindings.kvfence.dev")
    namespaces = docs("00-namespaces.yaml")
    # Dry-run the namespaces too, then create them for real: namespaced objects need them to exist.
    cluster.kubectl("apply", "--dry-run=server", "-f", str(EXAMPLES / "00-namespaces.yaml"))
    created = []
    for ns in namespaces:
        name = ns["metadata"]["name"]
        if cluster.kubectl("get", "namespace", name, check=False).returncode != 0:
            cluster.apply(ns)
            created.append(name)
    try:
        for f in ("10-trustclasses.yaml", "20-tenants.yaml", "trustclass-vllm-gpu.yaml"):
            res = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", str(EXAMPLES / f))
            items = json.loads(res.stdout)
            items = items.get("items", [items])
            assert len(items) == len(docs(f)), f
        # The apiserver's CEL rules are live: a vllm class without a GPU is refused with the field.
        bad = docs("trustclass-vllm-gpu.yaml")[0]
        bad["spec"]["resources"]["gpu"]["count"] = 0
        bad["spec"]["engine"]["tensorParallelSize"] = 1
        res = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False)
        assert res.returncode != 0 and "resources.gpu.count" in res.stderr, res.stderr
    finally:
        for name in created:
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_the_vllm_example_renders_the_args_the_issue_asks_for() -> None:
    (doc,) = docs("trustclass-vllm-gpu.yaml")
    args = builders.vllm_args(TrustClass.model_validate(doc))
    joined = " ".join(args)
    for want in (
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo sha256",
        "--block-size 16",
        "--tensor-parallel-size 2",
        "--enable-lora",
        "--lora-modules support-bot=/adapters/support-bot",
        "--middleware kvfence.vllm.middleware.KvfenceMiddleware",
        "--scheduler-cls kvfence.vllm.scheduler.FencedScheduler",
    ):
        assert want in joined, want
    assert args[0] == "Qwen/Qwen2.5-7B-Instruct" and "--model" not in args


def test_examples_directory_lists_what_it_holds() -> None:
    names = sorted(p.name for p in EXAMPLES.iterdir())
    assert names == sorted(
        [
            "00-namespaces.yaml",
            "10-trustclasses.yaml",
            "20-tenants.yaml",
            "README.md",
            "helm-values.yaml",
            "trustclass-vllm-gpu.yaml",
        ]
    )
