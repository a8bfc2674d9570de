"""The API models and the CRDs generated from them (pure: no cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster.manifests import EXTRA_ARGS_CASES, POD_EXTRAS_CASES, VLLM_ENGINE
from pydantic import ValidationError

from kvfence.api import crdgen
from kvfence.api import trustclass as T
from kvfence.api.common import LabelSelector, TenantQuotas
from kvfence.api.policy import engine_args, engine_env
from kvfence.api.trustclass import TrustClass

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", ["crds", "charts/kvfence/crds"])
def test_committed_crds_match_the_models(folder: str) -> None:
    """Both folders hold exactly what kvfence-crdgen renders from the models (it writes both)."""
    rendered = crdgen.render_all()
    assert sorted(rendered) == ["kvfence.dev_tenantbindings.yaml", "kvfence.dev_trustclasses.yaml"]
    assert (ROOT / folder).resolve() in [d.resolve() for d in crdgen.OUT_DIRS]
    assert sorted(p.name for p in (ROOT / folder).glob("*.yaml")) == sorted(rendered)
    for name, text in rendered.items():
        committed = (ROOT / folder / name).read_text()
        assert committed == text, f"{folder}/{name} drifted from the models: run `make crds`"
    assert crdgen.main(["--check", "--out", str(ROOT / folder)]) == 0


def test_check_mode_reports_drift(tmp_path: Path) -> None:
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 1
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--out", str(tmp_path)]) == 0


def test_one_run_writes_every_folder_and_check_names_the_one_that_drifted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, chart = tmp_path / "crds", tmp_path / "chart-crds"
    assert crdgen.main(["--out", str(repo), "--out", str(chart)]) == 0
    for name, text in crdgen.render_all().items():
        assert (repo / name).read_text() == text and (chart / name).read_text() == text
    hand_edited = chart / "kvfence.dev_trustclasses.yaml"
    hand_edited.write_text(hand_edited.read_text().replace("Cluster", "Namespaced"))
    capsys.readouterr()
    assert crdgen.main(["--check", "--out", str(repo), "--out", str(chart)]) == 1
    err = capsys.readouterr().err
    assert str(hand_edited) in err and str(repo / "kvfence.dev_trustclasses.yaml") not in err
    # a generated file of a kind the models no longer have is drift, and removed on the next write
    gone = repo / "kvfence.dev_oldthings.yaml"
    gone.write_text(crdgen.HEADER + "kind: CustomResourceDefinition\n")
    (repo / "not-ours.yaml").write_text("kind: ConfigMap\n")
    assert crdgen.main(["--check", "--out", str(repo)]) == 1
    assert "kvfence.dev_oldthings.yaml (no such CRD any more)" in capsys.readouterr().err
    assert crdgen.main(["--out", str(repo), "--out", str(chart)]) == 0
    assert not gone.exists() and (repo / "not-ours.yaml").exists()
    assert crdgen.main(["--check", "--out", str(repo), "--out", str(chart)]) == 0


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
    scale = {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    want = {"status": {}, "scale": scale} if name == "kvfence.dev_trustclasses.yaml" else {"status": {}}
    assert version["name"] == "v1alpha1" and version["subresources"] == want
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


def test_runtime_only_engine_fields_have_no_default_and_are_refused_on_the_other_runtime() -> None:
    schema = crdgen.trustclass_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    engine = spec["properties"]["engine"]
    # unset means the runtime's own default; the API server writes nothing into stored objects
    assert "default" not in engine["properties"]["numBlocks"]
    assert "default" not in engine["properties"]["gpuMemoryUtilization"]
    rules = {r["fieldPath"]: r for r in engine["x-kubernetes-validations"]}
    assert rules[".numBlocks"] == {
        "rule": "self.runtime != 'vllm' || !has(self.numBlocks)",
        "message": T.NUM_BLOCKS_ON_VLLM,
        "fieldPath": ".numBlocks",
        "reason": "FieldValueForbidden",
    }
    assert rules[".gpuMemoryUtilization"] == {
        "rule": "self.runtime != 'reference' || !has(self.gpuMemoryUtilization)",
        "message": T.GPU_MEMORY_UTILIZATION_ON_REFERENCE,
        "fieldPath": ".gpuMemoryUtilization",
        "reason": "FieldValueForbidden",
    }
    # the class's KV limit is checked against the reference pool, its default when numBlocks is unset
    (pool_rule,) = [
        r for r in spec["x-kubernetes-validations"] if r["fieldPath"] == ".quotas.limits.maxKVBlocks"
    ]
    assert "has(self.engine.numBlocks) ? self.engine.numBlocks : 1024" in pool_rule["rule"]
    assert T.DEFAULT_NUM_BLOCKS == 1024


def test_the_models_refuse_runtime_only_engine_fields_on_the_other_runtime(make_tc: Any) -> None:
    ref, vllm = make_tc(), make_tc(engine={"runtime": "vllm"})
    for tc in (ref, vllm):
        assert tc.spec.engine.num_blocks is None and tc.spec.engine.gpu_memory_utilization is None
        assert tc.spec.engine.kv_block_budget == 1024
        assert not {"numBlocks", "gpuMemoryUtilization"} & set(tc.wire()["spec"]["engine"])
    assert make_tc(engine={"numBlocks": 2048}).spec.engine.kv_block_budget == 2048
    assert (
        make_tc(engine={"runtime": "vllm", "gpuMemoryUtilization": 0.8}).spec.engine.gpu_memory_utilization
        == 0.8
    )
    with pytest.raises(ValidationError, match="numBlocks applies to the reference runtime only"):
        make_tc(engine={"runtime": "vllm", "numBlocks": 2048})
    with pytest.raises(ValidationError, match="gpuMemoryUtilization applies to the vllm runtime only"):
        make_tc(engine={"gpuMemoryUtilization": 0.5})
    with pytest.raises(ValidationError, match="gpuMemoryUtilization applies to the vllm runtime only"):
        make_tc(engine={"runtime": "reference", "gpuMemoryUtilization": 1.0})


def test_defaults_stored_by_the_old_crd_read_as_unset_on_the_runtime_that_ignores_them(make_tc: Any) -> None:
    # The 0.1.0 CRD defaulted numBlocks: 1024 and gpuMemoryUtilization: 0.9 onto every class; the
    # operator must keep reading those objects (the API server refuses both values on every new write).
    legacy = {"numBlocks": 1024, "gpuMemoryUtilization": 0.9}
    ref = make_tc(engine=legacy)
    assert ref.spec.engine.num_blocks == 1024 and ref.spec.engine.gpu_memory_utilization is None
    vllm = make_tc(engine={"runtime": "vllm", **legacy})
    assert vllm.spec.engine.num_blocks is None and vllm.spec.engine.gpu_memory_utilization == 0.9
    assert "numBlocks" not in vllm.wire()["spec"]["engine"]
    # any other value was set by someone, and is refused
    with pytest.raises(ValidationError, match="numBlocks applies to the reference runtime only"):
        make_tc(engine={"runtime": "vllm", "numBlocks": 1023})
    with pytest.raises(ValidationError, match="gpuMemoryUtilization applies to the vllm runtime only"):
        make_tc(engine={"gpuMemoryUtilization": 0.95})


@pytest.mark.parametrize(("args", "refused"), EXTRA_ARGS_CASES)
def test_extra_args_off_the_allowlist_are_refused_with_the_reason(
    args: list[str], refused: list[str]
) -> None:
    got = engine_args.extra_args_refusals(args, "vllm")
    assert [m.removeprefix("engine.extraArgs: ").split(" refused: ")[0] for m in got] == refused
    for arg, message in zip(refused, got, strict=True):
        name = engine_args.flag_name(arg)
        assert name is not None and message.endswith(f" refused: {engine_args.reason(name)}")
    assert (engine_args.extra_args_refusal(args, "vllm") is None) == (not refused)


def test_a_flag_of_the_other_runtime_is_refused_naming_the_runtime() -> None:
    args = ["--max-num-seqs", "8", "--log-level", "DEBUG"]
    assert engine_args.extra_args_refusals(args, "vllm") == []
    assert engine_args.extra_args_refusals(args, "reference") == [
        "engine.extraArgs: --max-num-seqs refused: a flag of the vllm runtime only (vllm serve), which "
        "kvfence-engine does not take"
    ]


@pytest.mark.parametrize(("engine", "field", "words"), POD_EXTRAS_CASES)
def test_model_cache_token_env_volumes_and_adapter_sources_are_validated(
    engine: dict[str, Any], field: str | None, words: str | None
) -> None:
    """The model refuses what the CRD refuses (the same cases go to the API server in
    tests/operator/test_operator_crds.py), with the same words where the CRD's rule writes them."""
    body = {"metadata": {"name": "gold"}, "spec": {"engine": {**VLLM_ENGINE, **engine}}}
    if field is None:
        T.TrustClass.model_validate(body)
        return
    with pytest.raises(ValidationError) as e:
        T.TrustClass.model_validate(body)
    assert words is not None
    expected = "Field required" if words == "Required value" else words
    assert expected in str(e.value), str(e.value)


def test_an_adapter_source_stored_on_the_reference_runtime_reads_as_unset() -> None:
    """Earlier CRDs required adapters[].source on every runtime and the reference engine never read
    it; the API server now refuses it there (tests/operator/test_operator_crds.py), and a class stored
    before keeps working, its source read as unset."""
    engine = {**VLLM_ENGINE, "runtime": "reference", "adapters": [{"name": "a", "source": "/adapters/a"}]}
    tc = T.TrustClass.model_validate({"metadata": {"name": "gold"}, "spec": {"engine": engine}})
    assert [(a.name, a.source) for a in tc.spec.engine.adapters] == [("a", None)]


def test_extra_env_refuses_what_the_builders_set_and_allows_only_its_list(make_tc: Any) -> None:
    """Every variable the operator renders into an engine container is one extraEnv cannot set."""
    from kvfence.operator import builders as B

    tc = make_tc(
        engine={
            "runtime": "vllm",
            "device": "CPU",
            "kvCacheMemory": "1Gi",
            "model": {"name": "org/m", "tokenSecretRef": {"name": "hf"}},
        },
        resources={"gpu": {"count": 0}},
    )
    rendered = [
        e["name"]
        for e in B.deployment(tc, "h", B.OperatorOptions())["spec"]["template"]["spec"]["containers"][0][
            "env"
        ]
    ]
    assert {"HF_HOME", "HF_TOKEN", "HOME", "VLLM_TARGET_DEVICE"} <= set(rendered)
    for name in rendered:
        assert engine_env.env_refusal(name) is not None, name
    for name in (
        "VLLM_PLUGINS",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_LOGGING_CONFIG_PATH",
        "CUSTOM_PRE_PROCESS",
        "CUSTOM_FASTAPI_MIDDLEWARE_THROTTLE",
        "SAGEMAKER_ENABLE_STATEFUL_SESSIONS",
        "PYTHONSTARTUP",
        "LD_AUDIT",
        "PATH",
        "OMP_TOOL_LIBRARIES",
        "NCCL_NET_PLUGIN",
        "HOMEDIR",
    ):
        assert engine_env.env_refusal(name) is not None, name
    for name in (
        "HF_HUB_OFFLINE",
        "OMP_NUM_THREADS",
        "NCCL_DEBUG",
        "CUDA_LAUNCH_BLOCKING",
        "VLLM_LOGGING_LEVEL",
    ):
        assert engine_env.env_refusal(name) is None, name


def test_every_flag_kvfence_renders_is_refused_in_extra_args(make_tc: Any) -> None:
    """The flags the builders set (the model, the port, the middleware, the scheduler, the prefix cache,
    the adapters, ...) cannot be given a second time (vLLM's parser keeps the last one), on either
    runtime."""
    from kvfence.operator import builders as B

    tc = make_tc(
        engine={
            "runtime": "vllm",
            "blockSize": 32,
            "maxModelLen": 4096,
            "quantization": "fp8",
            "gpuMemoryUtilization": 0.8,
            "adapters": [{"name": "a", "source": "org/a"}],
        },
        resources={"gpu": {"count": 1}},
    )
    rendered = [a for a in B.vllm_args(tc) if a.startswith("--")]
    for flag in ("--middleware", "--scheduler-cls", "--prefix-caching-hash-algo", "--enable-lora", "--port"):
        assert flag in rendered
    for flag in rendered:
        assert engine_args.extra_args_refusals([flag], "vllm") == [
            f"engine.extraArgs: {flag} refused: {engine_args.reason(flag)}"
        ]
    ref = [a for a in B.reference_command(make_tc()) if a.startswith("--")]
    assert ref == ["--config"]
    assert engine_args.extra_args_refusal(ref, "reference") is not None


def test_byte_quantities_are_exact_bytes() -> None:
    from kvfence.api.common import quantity_bytes

    assert quantity_bytes("1Gi") == 2**30 and quantity_bytes("512Mi") == 2**29
    assert quantity_bytes("2G") == 2 * 10**9 and quantity_bytes("1073741824") == 2**30
    for bad in ("0", "1.5Gi", "-1Gi", "1gi", "1e9", ""):
        with pytest.raises(ValueError, match="not a quantity of bytes"):
            quantity_bytes(bad)


def test_a_cpu_vllm_engine_needs_a_kv_cache_size_and_no_gpu(make_tc: Any) -> None:
    cpu = {"runtime": "vllm", "device": "CPU", "kvCacheMemory": "1Gi"}
    tc = make_tc(engine=cpu, resources={"gpu": {"count": 0}})
    assert tc.spec.engine.on_vllm_cpu and tc.spec.engine.kv_cache_memory == "1Gi"
    assert tc.wire()["spec"]["engine"]["device"] == "CPU"
    # unset means GPU on vllm, and CPU on the reference engine (which may say so)
    assert not make_tc(engine={"runtime": "vllm"}).spec.engine.on_vllm_cpu
    assert make_tc(engine={"device": "CPU"}, resources={"gpu": {"count": 0}}).spec.engine.device == "CPU"
    # on GPU, kvCacheMemory is the alternative to gpuMemoryUtilization
    assert make_tc(engine={"runtime": "vllm", "kvCacheMemory": "40Gi"}).spec.engine.kv_cache_memory == "40Gi"
    with pytest.raises(ValidationError, match=r"kvCacheMemory is required with engine\.device CPU"):
        make_tc(engine={"runtime": "vllm", "device": "CPU"}, resources={"gpu": {"count": 0}})
    with pytest.raises(ValidationError, match=r"device CPU requests no GPU: resources\.gpu\.count must be 0"):
        make_tc(engine=cpu)  # gpu.count defaults to 1
    with pytest.raises(ValidationError, match="not both"):
        make_tc(engine={**cpu, "gpuMemoryUtilization": 0.5}, resources={"gpu": {"count": 0}})
    with pytest.raises(ValidationError, match="device GPU applies to the vllm runtime only"):
        make_tc(engine={"device": "GPU"})
    with pytest.raises(ValidationError, match="kvCacheMemory applies to the vllm runtime only"):
        make_tc(engine={"kvCacheMemory": "1Gi"})
    with pytest.raises(ValidationError, match="kvCacheMemory"):
        make_tc(engine={**cpu, "kvCacheMemory": "1.5Gi"}, resources={"gpu": {"count": 0}})
    with pytest.raises(ValidationError, match="device"):
        make_tc(engine={"runtime": "vllm", "device": "TPU"})


def test_the_crd_carries_the_cpu_vllm_rules() -> None:
    schema = crdgen.trustclass_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]
    engine = spec["properties"]["engine"]
    assert engine["properties"]["device"]["enum"] == ["GPU", "CPU"]
    assert "default" not in engine["properties"]["device"]
    kv = engine["properties"]["kvCacheMemory"]
    assert kv["type"] == "string" and kv["pattern"] == "^[1-9][0-9]*(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
    messages = {r.get("message") for r in engine["x-kubernetes-validations"]}
    assert {
        T.GPU_DEVICE_ON_REFERENCE,
        T.KV_CACHE_MEMORY_ON_REFERENCE,
        T.KV_CACHE_MEMORY_REQUIRED_ON_CPU,
        T.KV_CACHE_MEMORY_AND_GPU_MEMORY_UTILIZATION,
    } <= messages
    gpu_rules = [r for r in spec["x-kubernetes-validations"] if r["fieldPath"] == ".resources.gpu.count"]
    assert {r["message"] for r in gpu_rules} == {
        "the vllm runtime needs at least one GPU (resources.gpu.count), unless engine.device is CPU",
        T.GPU_COUNT_ON_CPU,
    }


def test_the_reference_engines_flags_are_all_classified() -> None:
    """The extraArgs table of the reference runtime names exactly the options of kvfence-engine's parser,
    and allows only long flags."""
    from kvfence.engine.cli import build_parser

    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert set(engine_args.REFERENCE_FLAGS) == options
    assert all(f.startswith("--") for f in engine_args.allowed_flags("reference"))
    assert all(f.startswith("--") for f in engine_args.allowed_flags("vllm"))


def test_every_spelling_of_an_allowed_flag_is_allowed_and_no_abbreviation_is() -> None:
    for runtime in ("vllm", "reference"):
        allowed = engine_args.allowed_flags(runtime)
        for f in allowed:
            for s in (f, "--" + f[2:].replace("-", "_"), f + "=x", f + ".key"):
                assert engine_args.extra_args_refusals([s], runtime) == [], s
            for n in range(3, len(f)):
                if f[:n] not in allowed:
                    assert engine_args.extra_args_refusals([f[:n]], runtime) != [], f[:n]
