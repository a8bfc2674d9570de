"""The engine configuration file: the model the operator renders into a ConfigMap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvfence.contract import CacheScope
from kvfence.contract.engine_config import ConfigError, EngineConfig, load_config, load_signing_keys

MINIMAL = {
    "trustClass": "gold",
    "model": {"name": "kvfence/tiny", "revision": "1"},
    "numBlocks": 64,
    "maxModelLen": 256,
    "signingKeyDir": "/keys",
}


def test_minimal_yaml_gets_defaults(tmp_path: Path) -> None:
    p = tmp_path / "engine.yaml"
    p.write_text(
        "trustClass: gold\nmodel: {name: kvfence/tiny, revision: '1'}\nnumBlocks: 64\n"
        "maxModelLen: 256\nsigningKeyDir: /keys\n"
    )
    cfg = load_config(p)
    assert cfg.trust_class == "gold"
    assert cfg.model.served == "kvfence/tiny"
    assert cfg.block_size == 16
    assert cfg.tensor_parallel_size == 1
    assert cfg.prefix_cache.enabled is True
    assert cfg.prefix_cache.scope is CacheScope.TENANT
    assert cfg.prefix_cache.hash_algorithm == "sha256"
    assert cfg.require_signature is True
    assert (cfg.listen.host, cfg.listen.port) == ("0.0.0.0", 8000)  # noqa: S104
    assert cfg.quotas.for_tenant("anyone").max_blocks is None


def test_full_json_round_trips_by_alias(tmp_path: Path) -> None:
    data = {
        **MINIMAL,
        "model": {"name": "m", "revision": "r", "servedName": "tiny"},
        "adapters": ["a1", "a2"],
        "quantization": "int8",
        "tensorParallelSize": 2,
        "prefixCache": {"enabled": True, "scope": "TrustClass", "hashAlgorithm": "blake2b"},
        "quotas": {
            "default": {"maxBlocks": 10},
            "tenants": {"acme": {"maxBlocks": 20, "guaranteedBlocks": 5}},
        },
        "requireSignature": False,
        "listen": {"host": "127.0.0.1", "port": 9000},
    }
    p = tmp_path / "engine.json"
    p.write_text(json.dumps(data))
    cfg = load_config(p)
    assert cfg.quotas.for_tenant("acme").guaranteed_blocks == 5
    assert cfg.quotas.for_tenant("other").max_blocks == 10
    assert cfg.prefix_cache.scope is CacheScope.TRUST_CLASS
    again = EngineConfig.model_validate(cfg.model_dump(by_alias=True, mode="json"))
    assert again == cfg


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"numBlock": 3}, "numBlock"),  # typo: extra keys are forbidden
        ({"blockSize": 0}, "blockSize"),
        ({"prefixCache": {"hashAlgorithm": "xxhash"}}, "hashAlgorithm"),
        ({"prefixCache": {"scope": "Global"}}, "scope"),
        ({"quotas": {"tenants": {"a": {"maxBlocks": 2, "guaranteedBlocks": 3}}}}, "guaranteedBlocks"),
        (
            {"quotas": {"tenants": {"a": {"guaranteedBlocks": 40}, "b": {"guaranteedBlocks": 40}}}},
            "numBlocks",
        ),
        ({"adapters": ["x", "x"]}, "unique"),
    ],
)
def test_invalid_configs_name_the_field(tmp_path: Path, patch: dict[str, object], needle: str) -> None:
    p = tmp_path / "engine.json"
    p.write_text(json.dumps({**MINIMAL, **patch}))
    with pytest.raises(ConfigError, match=needle):
        load_config(p)


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)
    p.write_text("a: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_config(p)


def test_overrides_are_validated() -> None:
    cfg = EngineConfig.model_validate(MINIMAL)
    out = cfg.with_overrides(port=1234, host="127.0.0.1", num_blocks=None)
    assert (out.listen.host, out.listen.port, out.num_blocks) == ("127.0.0.1", 1234, 64)
    with pytest.raises(ConfigError, match=r"listen\.port"):
        cfg.with_overrides(port=70000)
    with pytest.raises(ConfigError, match="unknown override"):
        cfg.with_overrides(nonsense=1)


def test_signing_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing"):
        load_signing_keys(tmp_path)
    (tmp_path / "current").write_bytes(b"k" * 32)
    assert load_signing_keys(tmp_path) == [b"k" * 32]
    (tmp_path / "previous").write_bytes(b"p" * 32)
    assert load_signing_keys(tmp_path) == [b"k" * 32, b"p" * 32]
    (tmp_path / "previous").write_bytes(b"short")
    with pytest.raises(ConfigError, match="exactly 32 raw bytes"):
        load_signing_keys(tmp_path)


def test_the_config_carries_its_format_version_and_refuses_another() -> None:
    from kvfence.contract.engine_config import ENGINE_CONFIG_VERSION

    base = {
        "trustClass": "gold",
        "model": {"name": "m"},
        "numBlocks": 8,
        "maxModelLen": 64,
        "signingKeyDir": "/k",
    }
    assert EngineConfig.model_validate(base).version == ENGINE_CONFIG_VERSION == 1
    assert EngineConfig.model_validate({**base, "version": 1}).version == 1
    with pytest.raises(ValidationError, match="version"):
        EngineConfig.model_validate({**base, "version": 2})
