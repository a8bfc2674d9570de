"""The API models and the CRDs generated from them (pure: no cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfence.api import crdgen
from kvfence.api.common import LabelSelector, TenantQuotas
from kvfence.api.trustclass import TrustClass

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crds_match_the_models() -> None:
    rendered = crdgen.render_all()
    assert sorted(rendered) == ["kvfence.dev_tenantbindings.yaml", "kvfence.dev_trustclasses.yaml"]
    for name, text in rendered.items():
        committed = (ROOT / "crds" / name).read_text()
        assert committed == text, f"crds/{name} drifted from the models: run `make crds`"
    assert crdgen.main(["--check", "--out", str(ROOT / "crds")]) == 0


def test_check_mode_reports_drift(tmp_path: Path) -> None:
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 0


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


@pytest.mark.parametrize("name", ["kvfence.dev_trustclasses.yaml", "kvfence.dev_tenantbindings.yaml"])
def test_crd_is_structural_and_documented(name: str) -> None:
    doc = yaml.safe_load((ROOT / "crds" / name).read_text())
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert doc["spec"]["names"]["categories"] == ["kvfence"]
    assert doc["spec"]["names"]["shortNames"]
    schema = version["schema"]["openAPIV3Schema"]
    crdgen.check_structural(schema)
    text = yaml.safe_dump(schema)
    assert "$ref" not in text and "null" not in text and "title" not in text
    for path, node in _walk(schema):
        if path.startswith((".metadata", ".apiVersion", ".kind")) or path == "" or path.endswith(("[]", "}")):
            continue  # every *field* is documented; list items and map values are described by it
        assert node.get("description"), f"{name}: {path} has no description"
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "observedGeneration" in conditions["items"]["properties"]
    assert "observedGeneration" in schema["properties"]["status"]["properties"]


def test_trustclass_schema_has_enums_defaults_and_cel() -> None:
    schema = crdgen.trustclass_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    assert spec["properties"]["engine"]["properties"]["runtime"]["enum"] == ["vllm", "reference"]
    pc = spec["properties"]["prefixCache"]["properties"]
    assert pc["hashAlgorithm"]["enum"] == ["sha256", "blake2b"]
    assert pc["scope"]["enum"] == ["Tenant", "TrustClass"]
    gpu = spec["properties"]["resources"]["properties"]["gpu"]["properties"]
    assert gpu["resourceName"]["default"] == "nvidia.com/gpu"
    cpu = spec["properties"]["resources"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("tensorParallelSize" in r for r in rules)
    assert any("oldSelf" in r for r in rules)
    quota_rules = spec["properties"]["quotas"]["x-kubernetes-validations"]
    assert any("defaults.maxKVBlocks" in r["rule"] for r in quota_rules)
    gpu_util = spec["properties"]["engine"]["properties"]["gpuMemoryUtilization"]
    assert gpu_util["minimum"] == 0 and gpu_util["exclusiveMinimum"] is True
    assert spec["properties"]["placement"]["properties"]["tolerations"]["items"][
        "x-kubernetes-preserve-unknown-fields"
    ]


def test_models_validate_and_default(make_tc: Any) -> None:
    tc = make_tc()
    assert tc.target_namespace == "kvf-gold"
    assert tc.spec.prefix_cache.hash_algorithm == "sha256"
    assert tc.spec.resources.gpu.count == 1 and tc.spec.resources.gpu.resource_name == "nvidia.com/gpu"
    assert make_tc(namespace="engines-gold").target_namespace == "engines-gold"
    with pytest.raises(ValidationError):
        make_tc(prefixCache={"hashAlgorithm": "xxhash"})
    with pytest.raises(ValidationError):
        make_tc(engine={"runtime": "sglang"})
    with pytest.raises(ValidationError):
        TrustClass.model_validate({"metadata": {"name": "x"}, "spec": {}})


def test_label_selector_semantics() -> None:
    sel = LabelSelector.model_validate(
        {
            "matchLabels": {"team": "a"},
            "matchExpressions": [
                {"key": "env", "operator": "In", "values": ["prod", "stage"]},
                {"key": "quarantine", "operator": "DoesNotExist"},
            ],
        }
    )
    assert sel.matches({"team": "a", "env": "prod"})
    assert not sel.matches({"team": "a", "env": "dev"})
    assert not sel.matches({"team": "a", "env": "prod", "quarantine": "yes"})
    assert not sel.matches({"env": "prod"})
    assert LabelSelector().matches({})


def test_quota_merge_and_limits() -> None:
    defaults = TenantQuotas.model_validate({"requestsPerMinute": 60, "maxKVBlocks": 100})
    over = TenantQuotas.model_validate({"maxKVBlocks": 200})
    eff = over.merged_over(defaults)
    assert eff.requests_per_minute == 60 and eff.max_kv_blocks == 200
    limits = TenantQuotas.model_validate({"maxKVBlocks": 150})
    assert over.exceeds(limits) == ["maxKVBlocks"]
    assert defaults.exceeds(limits) == []
