"""The engine's configuration: one YAML or JSON file plus a few command-line overrides.

The operator renders this file into the ConfigMap of a trust class's engine and imports
:class:`EngineConfig` to do so; the engine loads it with :func:`load_config`. Keys are camelCase (the
Kubernetes convention); the Python attributes are snake_case. Unknown keys are errors, so a typo in a
rendered ConfigMap fails the engine at start instead of being silently ignored.

Example::

    trustClass: gold
    model: {name: kvfence/tiny, revision: "1", servedName: tiny}
    adapters: [support-bot]
    numBlocks: 4096
    maxModelLen: 2048
    prefixCache: {enabled: true, scope: Tenant, hashAlgorithm: sha256}
    quotas:
      default: {maxBlocks: 1024, guaranteedBlocks: 0}
      tenants:
        acme: {maxBlocks: 2048, guaranteedBlocks: 256}
    signingKeyDir: /etc/kvfence/keys
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvfence.contract import SIGNING_KEY_BYTES, CacheScope

#: The environment of an engine pod the operator renders (builders) and the vLLM plugin reads: the path
#: of this file, and the file the plugin's scheduler writes its counters to for its middleware.
ENV_ENGINE_CONFIG = "KVFENCE_ENGINE_CONFIG"
ENV_VLLM_STATS_FILE = "KVFENCE_VLLM_STATS_FILE"
#: Every engine's readiness path (both runtimes): 503 while its config says ``tenantsPending``, else
#: as ``/health``. The operator renders it as the pods' readiness probe.
READY_PATH = "/ready"

#: File names inside ``signingKeyDir`` (keys of the Secret the operator mounts there).
SIGNING_KEY_CURRENT = "current"
SIGNING_KEY_PREVIOUS = "previous"

HashAlgorithm = Literal["sha256", "blake2b"]


class ConfigError(Exception):
    """The engine configuration cannot be loaded; the message says which file and which field."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class ModelConfig(_Model):
    """The base model the engine serves."""

    name: str = Field(min_length=1, description="Model id, e.g. a Hugging Face repository name")
    revision: str = Field("main", min_length=1, description="Model revision (commit, tag or version)")
    served_name: str | None = Field(
        None, alias="servedName", description="Name clients use in `model`; defaults to `name`"
    )

    @property
    def served(self) -> str:
        return self.served_name or self.name


#: At most this many declared shared prefixes per trust class, each at most this many characters.
MAX_SHARED_PREFIXES = 32
MAX_SHARED_PREFIX_CHARS = 65536


class SharedPrefixConfig(_Model):
    """A prefix every tenant of the class may share: declared, never inferred from traffic.

    ``completion``: the prompt text a completion request starts with. ``chat``: the content of the
    system message a chat request starts with (the engine renders it as its chat template renders a
    leading system message). Only the full blocks inside the rendered prefix are shared; a request
    shares them only if its tokens begin with the whole prefix, token for token."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    form: Literal["chat", "completion"]
    text: str = Field(min_length=1, max_length=MAX_SHARED_PREFIX_CHARS)


class PrefixCacheConfig(_Model):
    """The tenant-aware prefix cache."""

    enabled: bool = True
    scope: CacheScope = Field(
        CacheScope.TENANT,
        description="Who may share cached blocks inside the trust class: Tenant (default) or TrustClass",
    )
    hash_algorithm: HashAlgorithm = Field(
        "sha256", alias="hashAlgorithm", description="Block hash: sha256 or blake2b (full digest)"
    )
    shared_prefixes: list[SharedPrefixConfig] = Field(
        default_factory=list,
        alias="sharedPrefixes",
        max_length=MAX_SHARED_PREFIXES,
        description="Declared prefixes shared by every tenant, computed at start and pinned",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> PrefixCacheConfig:
        names = [p.name for p in self.shared_prefixes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sharedPrefixes names must be unique: {', '.join(dup)} repeated")
        return self


#: The largest fair-share weight of a tenant (kvfence.isolation.fairshare).
MAX_WEIGHT = 1000


class TenantQuota(_Model):
    """KV-block limits of one tenant (blocks of `blockSize` tokens) and its fair-share weight."""

    max_blocks: int | None = Field(
        None, alias="maxBlocks", ge=1, description="Hard maximum of blocks the tenant holds; None: the pool"
    )
    guaranteed_blocks: int = Field(
        0,
        alias="guaranteedBlocks",
        ge=0,
        description="Blocks kept obtainable for the tenant and never reclaimed by other tenants",
    )
    weight: int = Field(
        1,
        ge=1,
        le=MAX_WEIGHT,
        description="The tenant's share of each scheduler step, relative to the other tenants with work",
    )

    @model_validator(mode="after")
    def _guaranteed_within_max(self) -> TenantQuota:
        if self.max_blocks is not None and self.guaranteed_blocks > self.max_blocks:
            raise ValueError(
                f"guaranteedBlocks ({self.guaranteed_blocks}) exceeds maxBlocks ({self.max_blocks})"
            )
        return self


class QuotasConfig(_Model):
    """Per-tenant block quotas: `default` applies to every tenant not listed in `tenants`."""

    default: TenantQuota = Field(default_factory=lambda: TenantQuota())
    tenants: dict[str, TenantQuota] = Field(default_factory=dict)

    def for_tenant(self, tenant: str) -> TenantQuota:
        return self.tenants.get(tenant, self.default)

    def weights(self) -> dict[str, int]:
        """The weight of every listed tenant (others have ``default.weight``)."""
        return {t: q.weight for t, q in self.tenants.items()}


class ListenConfig(_Model):
    host: str = "0.0.0.0"  # noqa: S104 - the engine listens on its pod IP; NetworkPolicy fences it
    port: int = Field(8000, ge=0, le=65535)


#: The version of this file's format. A file of another version is refused (``version`` absent: 1).
ENGINE_CONFIG_VERSION: Literal[1] = 1


class EngineConfig(_Model):
    """Everything one engine (one trust class) needs."""

    version: Literal[1] = Field(
        ENGINE_CONFIG_VERSION, description="The format's version (ENGINE_CONFIG_VERSION; absent: 1)"
    )
    trust_class: str = Field(alias="trustClass", min_length=1)
    model: ModelConfig
    adapters: list[str] = Field(default_factory=list, description="LoRA adapter names served")
    quantization: str = Field("none", description="Quantization config, folded into prefix-cache keys")
    dtype: str = "float32"
    block_size: int = Field(16, alias="blockSize", ge=1, le=4096)
    num_blocks: int = Field(alias="numBlocks", ge=1)
    tensor_parallel_size: int = Field(
        1,
        alias="tensorParallelSize",
        ge=1,
        le=64,
        description="Writers (tensor-parallel ranks) that must signal before a freed block is reusable",
    )
    max_model_len: int = Field(alias="maxModelLen", ge=2)
    prefix_cache: PrefixCacheConfig = Field(default_factory=lambda: PrefixCacheConfig(), alias="prefixCache")
    quotas: QuotasConfig = Field(default_factory=lambda: QuotasConfig())
    signing_key_dir: str = Field(alias="signingKeyDir", min_length=1)
    require_signature: bool = Field(True, alias="requireSignature")
    listen: ListenConfig = Field(default_factory=lambda: ListenConfig())
    tenants_pending: bool = Field(
        False,
        alias="tenantsPending",
        description=(
            "Written by the operator into a new class's first config, rendered before the routing "
            "decision that computes its tenants' quotas: the engine is not ready (GET /ready: 503) until "
            "a config without it arrives, so it never serves with quotas it has not been given"
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError("adapters must be unique")
        if self.model.served in self.adapters:
            raise ValueError(f"adapter name {self.model.served!r} collides with the served model name")
        guaranteed = sum(q.guaranteed_blocks for q in self.quotas.tenants.values())
        if guaranteed > self.num_blocks:
            raise ValueError(
                f"the tenants' guaranteedBlocks add up to {guaranteed}, "
                f"more than numBlocks ({self.num_blocks})"
            )
        if self.quotas.default.guaranteed_blocks > self.num_blocks:
            raise ValueError("quotas.default.guaranteedBlocks exceeds numBlocks")
        return self

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with command-line overrides applied (snake_case names; ``None`` means "not given").

        ``host`` and ``port`` go to ``listen``; every other name is a top-level field. The result is
        validated again.
        """
        data = self.model_dump(by_alias=False)
        for name, value in overrides.items():
            if value is None:
                continue
            if name in ("host", "port"):
                data["listen"][name] = value
            elif name in type(self).model_fields:
                data[name] = value
            else:
                raise ConfigError(f"unknown override {name!r}")
        try:
            return type(self).model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"invalid override: {_describe(e)}") from None

    def load_signing_keys(self) -> list[bytes]:
        """The trust class's signing keys, current first (see :func:`load_signing_keys`)."""
        return load_signing_keys(self.signing_key_dir)


def file_stamp(path: str | Path) -> tuple[int, int, int] | None:
    """(inode, mtime, size) of the mounted config file, None if it cannot be read: changes when the
    kubelet swaps a mounted ConfigMap (a new file behind the volume's symlink) or a test replaces it."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def load_config(path: str | Path) -> EngineConfig:
    """Load and validate an engine configuration file (YAML, of which JSON is a subset)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read engine config {p}: {e.strerror or e}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"engine config {p} is not valid YAML/JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"engine config {p} must be a mapping at the top level")
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"engine config {p} is invalid: {_describe(e)}") from None


def load_signing_keys(directory: str | Path) -> list[bytes]:
    """Read ``current`` (required) and ``previous`` (optional) from ``directory``: raw 32-byte keys.

    The first key is the current one; both verify, so a key rotation does not drop in-flight traffic.
    """
    d = Path(directory)
    keys: list[bytes] = []
    for name, required in ((SIGNING_KEY_CURRENT, True), (SIGNING_KEY_PREVIOUS, False)):
        f = d / name
        try:
            key = f.read_bytes()
        except FileNotFoundError:
            if required:
                raise ConfigError(f"signing key {f} is missing") from None
            continue
        except OSError as e:
            raise ConfigError(f"cannot read signing key {f}: {e.strerror or e}") from None
        if len(key) != SIGNING_KEY_BYTES:
            raise ConfigError(
                f"signing key {f} must hold exactly {SIGNING_KEY_BYTES} raw bytes, not {len(key)}"
            )
        keys.append(key)
    return keys


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
