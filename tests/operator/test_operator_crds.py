"""The generated CRDs on the real API server: they install, `kubectl explain` reads them, and bad
manifests are rejected with messages that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster.cel_cases import (
    CASE_NAME,
    CASE_NAMESPACE,
    TENANT_BINDING_CASES,
    TRUST_CLASS_CASES,
    VLLM_CPU,
    Case,
)
from cluster.manifests import (
    ENGINE,
    EXTRA_ARGS_CASES,
    POD_EXTRAS_CASES,
    VLLM_ENGINE,
    tenant_binding,
    trust_class,
)
from support.waiting import wait_until

from kvfence.api.policy import engine_args, engine_env
from kvfence.operator.apply import is_subset

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("case", TRUST_CLASS_CASES, ids=Case.id)
def test_bad_trustclass_is_rejected_with_the_field_named(installed: Any, kv: Any, case: Case) -> None:
    """The cases the model is also checked against (tests/operator/test_cel_parity.py)."""
    res = kv.apply(case.manifest())
    assert res.returncode != 0, f"accepted: {case.spec}"
    assert case.field in res.stderr and case.words in res.stderr, res.stderr
    assert kv.json("get", "trustclass", CASE_NAME) is None


def test_trustclass_name_length_and_immutable_namespace(installed: Any, kv: Any) -> None:
    res = kv.apply(trust_class("x" * 60))
    assert res.returncode != 0 and "metadata.name must be at most 59 characters" in res.stderr
    try:
        ok = kv.apply(trust_class("crd-immutable", namespace="crd-immutable-engines", replicas=0))
        assert ok.returncode == 0, ok.stderr
        moved = kv.apply(trust_class("crd-immutable", namespace="elsewhere", replicas=0))
        assert moved.returncode != 0 and "namespace is immutable" in moved.stderr
        got = kv.json("get", "trustclass", "crd-immutable")
        # defaults are applied by the API server, from the schema
        assert got["spec"]["prefixCache"] == {"enabled": True, "scope": "Tenant", "hashAlgorithm": "sha256"}
        assert got["spec"]["resources"]["gpu"] == {"count": 1, "resourceName": "nvidia.com/gpu"}
        assert got["spec"]["engine"]["runtime"] == "reference"
    finally:
        kv("delete", "trustclass", "crd-immutable", "--ignore-not-found", "--wait=false")


def test_runtime_only_engine_fields_are_accepted_on_their_runtime_and_never_defaulted(
    installed: Any, kv: Any
) -> None:
    classes = {
        "crd-vllm": {
            "engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}, "gpuMemoryUtilization": 0.8}
        },
        "crd-vllm-bare": {"engine": {"runtime": "vllm", "image": "x", "model": {"name": "m"}}},
        "crd-ref": {
            "engine": {"image": "x", "model": {"name": "m"}, "numBlocks": 2048},
            "quotas": {"limits": {"maxKVBlocks": 2048}},
        },
        "crd-ref-bare": {"quotas": {"limits": {"maxKVBlocks": 1024}}},
        "crd-vllm-cpu": {
            "engine": {**VLLM_CPU, "kvCacheMemory": "1Gi"},
            "resources": {"gpu": {"count": 0}, "memory": "6Gi"},
        },
    }
    try:
        res = kv.apply(*(trust_class(name, replicas=0, **spec) for name, spec in classes.items()))
        assert res.returncode == 0, res.stderr
        engines = {name: kv.json("get", "trustclass", name)["spec"]["engine"] for name in classes}
        assert engines["crd-vllm"]["gpuMemoryUtilization"] == 0.8 and "numBlocks" not in engines["crd-vllm"]
        assert engines["crd-ref"]["numBlocks"] == 2048 and "gpuMemoryUtilization" not in engines["crd-ref"]
        for name in ("crd-vllm-bare", "crd-ref-bare"):
            assert not {"numBlocks", "gpuMemoryUtilization"} & set(engines[name]), engines[name]
        assert "device" not in engines["crd-vllm-bare"]  # unset stays unset (it means GPU)
        assert (
            engines["crd-vllm-cpu"]["device"] == "CPU" and engines["crd-vllm-cpu"]["kvCacheMemory"] == "1Gi"
        )
    finally:
        kv("delete", "trustclass", *classes, "--ignore-not-found", "--wait=false")


def _legacy_crd() -> dict[str, Any]:
    """The TrustClass CRD as kvfence 0.1.0 shipped it in these respects: both runtime-only fields
    defaulted onto every class, and no rule about which runtime they belong to."""
    crd = yaml.safe_load((ROOT / "crds" / "kvfence.dev_trustclasses.yaml").read_text())
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "engine"
    ]
    engine["properties"]["numBlocks"]["default"] = 1024
    engine["properties"]["gpuMemoryUtilization"]["default"] = 0.9
    del engine["x-kubernetes-validations"]
    return crd


def _install_crd(kv: Any, crd: dict[str, Any]) -> None:
    kv(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=kvfence-tests",
        "-f",
        "-",
        input=json.dumps(crd),
    )


def _dry_run(kv: Any, obj: dict[str, Any]) -> dict[str, Any] | str:
    """The object the API server would store, or its refusal."""
    res = kv(
        "apply", "--server-side", "--dry-run=server", "--field-manager=tests", "-o", "json", "-f", "-",
        input=json.dumps(obj),
        check=False,
    )  # fmt: skip
    return json.loads(res.stdout) if res.returncode == 0 else res.stderr


def test_classes_stored_by_the_old_crd_stay_updatable_until_their_engine_changes(
    installed: Any, kv: Any
) -> None:
    """Objects stored while the CRD defaulted numBlocks and gpuMemoryUtilization carry both, whatever
    their runtime. The rules sit on spec.engine, so CRD validation ratcheting admits every update that
    leaves the engine alone (the operator's status writes included); changing the engine means
    dropping the field that runtime ignores, and the API server says why."""
    vllm_engine = {"runtime": "vllm", "image": "x", "model": {"name": "m"}}
    legacy = {
        "crd-legacy-vllm": ("numBlocks", vllm_engine),
        "crd-legacy-ref": ("gpuMemoryUtilization", ENGINE),
    }
    current = yaml.safe_load((ROOT / "crds" / "kvfence.dev_trustclasses.yaml").read_text())

    def old_crd_in_force() -> bool:
        got = _dry_run(kv, trust_class("crd-legacy-probe", engine=vllm_engine))
        return isinstance(got, dict) and got["spec"]["engine"].get("numBlocks") == 1024

    def new_crd_in_force() -> bool:
        got = _dry_run(kv, trust_class("crd-legacy-probe", engine={**vllm_engine, "numBlocks": 8}))
        return isinstance(got, str) and "applies to the reference runtime only" in got

    try:
        _install_crd(kv, _legacy_crd())
        wait_until(old_crd_in_force, "the old CRD in force", timeout=60)
        res = kv.apply(*(trust_class(name, engine=eng, replicas=0) for name, (_, eng) in legacy.items()))
        assert res.returncode == 0, res.stderr
        for name in legacy:
            stored = kv.json("get", "trustclass", name)["spec"]["engine"]
            assert stored["numBlocks"] == 1024 and stored["gpuMemoryUtilization"] == 0.9, stored
        _install_crd(kv, current)
        wait_until(new_crd_in_force, "the new CRD in force", timeout=60)
        for name, (field, eng) in legacy.items():
            # the rest of the spec, and the status, stay writable
            res = kv.apply(trust_class(name, engine=eng, replicas=1))
            assert res.returncode == 0, res.stderr
            status = '{"status": {"replicas": 0}}'
            res = kv(
                "patch", "trustclass", name, "--subresource=status", "--type=merge", "-p", status, check=False
            )
            assert res.returncode == 0, res.stderr
            # an engine change must drop the stale field
            res = kv.apply(trust_class(name, engine={**eng, "image": "y"}, replicas=1))
            assert res.returncode != 0 and f"spec.engine.{field}: Forbidden" in res.stderr, res.stderr
            patch = [
                {"op": "remove", "path": f"/spec/engine/{field}"},
                {"op": "replace", "path": "/spec/engine/image", "value": "y"},
            ]
            res = kv("patch", "trustclass", name, "--type=json", "-p", json.dumps(patch), check=False)
            assert res.returncode == 0, res.stderr
            assert field not in kv.json("get", "trustclass", name)["spec"]["engine"]
    finally:
        _install_crd(kv, current)  # and in force before the next test
        wait_until(new_crd_in_force, "the new CRD in force", timeout=60)
        kv("delete", "trustclass", *legacy, "--ignore-not-found", "--wait=false")


def test_bad_tenantbinding_is_rejected_with_the_field_named(installed: Any, kv: Any) -> None:
    """The cases the model is also checked against (tests/operator/test_cel_parity.py), and the
    tenantId that no update may change."""
    kv("create", "namespace", CASE_NAMESPACE)
    try:
        for case in TENANT_BINDING_CASES:
            res = kv.apply(case.manifest())
            assert res.returncode != 0, f"accepted: {case.spec}"
            assert case.field in res.stderr and case.words in res.stderr, res.stderr
        ok = kv.apply(tenant_binding("e", CASE_NAMESPACE))
        assert ok.returncode == 0, ok.stderr
        renamed = kv.apply(tenant_binding("e", CASE_NAMESPACE, tenantId="other"))
        assert renamed.returncode != 0 and "tenantId is immutable" in renamed.stderr
    finally:
        kv("delete", "namespace", CASE_NAMESPACE, "--wait=false")


def test_kubectl_explain_and_columns(installed: Any, kv: Any) -> None:
    out = kv("explain", "trustclass.spec.placement.dedicatedNodes").stdout
    assert "anti-affinity" in out and "tolerateTaint" in out
    out = kv("explain", "tenantbinding.spec.apiKeySecretRef").stdout
    assert "SHA-256" in out
    names = kv("api-resources", "--api-group=kvfence.dev", "-o", "wide").stdout
    assert "tc" in names and "tb" in names and "kvfence" in names
    header = kv("get", "tc").stdout.splitlines()
    assert not header or header[0].split()[:3] == ["NAME", "RUNTIME", "MODEL"]


def _cel_refusals(got: str, args: list[str]) -> list[str]:
    """The API server's extraArgs refusals in ``got``, as :func:`engine_args.extra_args_refusals` writes
    them (its rule on each argument, then its rule on the engine)."""
    out = []
    for line in got.replace("\\n", "\n").split("spec.engine.extraArgs")[1:]:
        prefix, _, message = line.partition(": Forbidden: ")
        assert prefix == "" or (prefix.startswith("[") and prefix.endswith("]")), line
        out.append((prefix, message.split(", spec.")[0].rstrip()))
    return [m for p, m in out if p] + [m for p, m in out if not p]


def _expected_cel(args: list[str], runtime: engine_args.Runtime) -> list[str]:
    """What the CRD says: every argument its rule on one argument refuses, and the first one its rule on
    the engine refuses."""
    return engine_args.item_refusals(args) + engine_args.runtime_refusals(args, runtime)[:1]


def _check_extra_args(kv: Any, args: list[str], runtime: engine_args.Runtime) -> None:
    engine = {"runtime": runtime, "image": "x", "model": {"name": "m"}, "extraArgs": args}
    got = _dry_run(kv, trust_class("crd-extra-args", engine=engine))
    expected = _expected_cel(args, runtime)
    if not expected:
        assert isinstance(got, dict), f"{runtime} {args}: {got}"
        assert got["spec"]["engine"]["extraArgs"] == args
        return
    assert isinstance(got, str), f"{runtime} {args} accepted"
    for message in expected:
        assert message in got, (message, got)
    for arg in engine_args.item_refusals(args):
        i = args.index(arg.removeprefix("engine.extraArgs: ").split(" refused: ")[0])
        assert f"spec.engine.extraArgs[{i}]: Forbidden: {arg}" in got, got
    assert got.count("Forbidden: engine.extraArgs: ") == len(expected), got


def test_extra_args_off_the_allowlist_are_refused_naming_the_flag_and_the_reason(
    installed: Any, kv: Any
) -> None:
    """The CRD's CEL rules refuse exactly what the model refuses (the cases of
    tests/operator/test_api.py), on both runtimes, with the same messages: each refused argument, its
    index and the reason of the policy's table."""
    for runtime in ("vllm", "reference"):
        for args, _ in EXTRA_ARGS_CASES:
            _check_extra_args(kv, args, runtime)


def test_the_crd_and_the_model_agree_on_every_classified_flag(installed: Any, kv: Any) -> None:
    """Every flag of both runtimes' tables, and its other spellings (``_`` for ``-``, ``=value``, the
    dotted ``.key`` form, an abbreviation), goes to the API server: it admits exactly what the policy
    allows and refuses the rest with the policy's message."""
    flags = sorted(set(engine_args.VLLM_SERVE_FLAGS) | set(engine_args.REFERENCE_FLAGS))
    spellings: list[str] = []
    for f in flags:
        spellings.append(f)
        if f.startswith("--"):
            spellings += ["--" + f[2:].replace("-", "_") + "=1", f + ".key", f[:-1]]
    allowed = [s for s in spellings if not engine_args.extra_args_refusals([s], "vllm")]
    assert "--max-num-seqs" in allowed and "--max_num_seqs=1" in allowed and "--max-num-seq" not in allowed
    chunk = 100  # under extraArgs' maximum of 128 items
    for runtime in ("vllm", "reference"):
        for i in range(0, len(spellings), chunk):
            _check_extra_args(kv, spellings[i : i + chunk], runtime)


def test_extra_env_is_an_allowlist_on_the_api_server_too(installed: Any, kv: Any) -> None:
    """Every allowed name is admitted, and a name of each refused group (and one of none) is refused
    with the model's message."""
    names = sorted(engine_env.ALLOWED_ENV)
    for i in range(0, len(names), 32):
        env = [{"name": n, "value": "1"} for n in names[i : i + 32]]
        got = _dry_run(kv, trust_class("crd-env", engine={**VLLM_ENGINE, "extraEnv": env}))
        assert isinstance(got, dict), got
    refused = ["KVFENCE_X", "CUSTOM_PRE_PROCESS", "SUPERVISOR_X", "VLLM_PLUGINS", "PYTHONPATH", "LD_PRELOAD"]
    refused += ["NVIDIA_VISIBLE_DEVICES", "HF_TOKEN", "PATH", "OMP_TOOL_LIBRARIES", "NCCL_NET_PLUGIN"]
    env = [{"name": n, "value": "1"} for n in refused]
    got = _dry_run(kv, trust_class("crd-env", engine={**VLLM_ENGINE, "extraEnv": env}))
    assert isinstance(got, str), "accepted"
    for i, n in enumerate(refused):
        why = engine_env.env_refusal(n)
        assert why is not None and f"spec.engine.extraEnv[{i}].name: Forbidden: {why}" in got, (n, got)


def test_model_cache_token_env_volumes_and_adapter_sources_on_the_api_server(installed: Any, kv: Any) -> None:
    """The CRD refuses what the model refuses (the cases of tests/operator/test_api.py), naming the
    field, and stores what both accept as written."""
    for engine, field, words in POD_EXTRAS_CASES:
        got = _dry_run(kv, trust_class("crd-pod-extras", engine={**VLLM_ENGINE, **engine}))
        if field is None:
            assert isinstance(got, dict), f"{engine}: {got}"
            # stored as written, plus the defaults (model.revision, tokenSecretRef.key, retentionPolicy)
            assert is_subset(engine, got["spec"]["engine"]), got["spec"]["engine"]
            continue
        assert isinstance(got, str), f"{engine} accepted"
        assert field in got and words is not None and words in got, (field, words, got)
