"""The routing table: what the operator renders and the router reads.

It is the only interface between the two. The operator writes it, as JSON, into the Secret
``<router namespace>/kvfence-routing`` under the key ``routing.json`` (a Secret because it carries the
trust classes' signing keys); the router reads the mounted file and reloads it when it changes.

Size: a Secret holds at most 1 MiB. A table whose JSON is larger than :data:`COMPRESS_ABOVE_BYTES`
(many thousands of tenants) is written gzip-compressed under the same key; readers pass the file's
bytes through :func:`decode_table_bytes` (gzip is recognised by its magic number), or use
:func:`parse_table_bytes`.
"""

from __future__ import annotations

import gzip
import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field

from kvfence.contract import CacheScope

ROUTING_SECRET_NAME = "kvfence-routing"
ROUTING_SECRET_KEY = "routing.json"
ROUTING_TABLE_VERSION = 1
GZIP_MAGIC = b"\x1f\x8b"
#: JSON tables above this size are stored gzip-compressed (the Secret limit is 1 MiB).
COMPRESS_ABOVE_BYTES = 512 * 1024
#: What fits into the Secret (1 MiB, less room for the other fields).
MAX_STORED_BYTES = 1024 * 1024 - 16 * 1024
KEY_HASH_PREFIX = "sha256:"


def hash_api_key(api_key: str) -> str:
    """How the routing table stores an API key: ``sha256:<hex>`` (the operator writes it, the router
    hashes what a client presents and looks it up)."""
    return KEY_HASH_PREFIX + hashlib.sha256(api_key.encode("utf-8")).hexdigest()


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class Quotas(_Model):
    """Per-tenant limits the router enforces (None: unlimited)."""

    max_concurrent_requests: int | None = Field(None, alias="maxConcurrentRequests", ge=1)
    requests_per_minute: int | None = Field(None, alias="requestsPerMinute", ge=1)
    tokens_per_minute: int | None = Field(None, alias="tokensPerMinute", ge=1)
    max_kv_blocks: int | None = Field(None, alias="maxKVBlocks", ge=1)
    #: The tenant's share when its class's engines are saturated (the router releases held requests
    #: in proportion to it); None: 1, and the field is left out of the table.
    weight: int | None = Field(None, ge=1, le=1000)


class RequestLimits(_Model):
    """What one request may ask of a trust class's engine: the router refuses a request beyond any of
    these with a 400 naming the field (see :mod:`kvfence.router.surface`). A sequence is one prompt
    times one choice (``n``)."""

    max_prompts_per_request: int = Field(32, alias="maxPromptsPerRequest", ge=1, le=4096)
    max_n: int = Field(16, alias="maxN", ge=1, le=1024)
    max_sequences_per_request: int = Field(64, alias="maxSequencesPerRequest", ge=1, le=1 << 20)
    max_stop_sequences: int = Field(16, alias="maxStopSequences", ge=0, le=4096)
    max_stop_sequence_length: int = Field(256, alias="maxStopSequenceLength", ge=1, le=65536)
    max_logit_bias_entries: int = Field(300, alias="maxLogitBiasEntries", ge=0, le=1 << 20)
    max_logprobs: int = Field(20, alias="maxLogprobs", ge=0, le=1 << 20)
    max_grammar_bytes: int = Field(32768, alias="maxGrammarBytes", ge=0, le=16 << 20)
    max_messages: int = Field(1024, alias="maxMessages", ge=1, le=1 << 20)
    max_tools: int = Field(128, alias="maxTools", ge=0, le=4096)


class TrustClassRoute(_Model):
    """One trust class's engine, as the router addresses it."""

    endpoint: str = Field(description="Base URL of the engine Service, e.g. http://engine.kvf-gold.svc:8000")
    runtime: str = Field("reference", description="vllm or reference")
    served_models: list[str] = Field(alias="servedModels", min_length=1)
    adapters: list[str] = Field(default_factory=list, description="LoRA adapters the engine serves")
    cache_scope: CacheScope = Field(CacheScope.TENANT, alias="cacheScope")
    signing_keys: list[str] = Field(
        alias="signingKeys",
        min_length=1,
        description="base64 signing keys; the first signs, all verify (rotation)",
    )
    request_limits: RequestLimits | None = Field(
        None, alias="requestLimits", description="unset: RequestLimits' defaults"
    )


class TenantRoute(_Model):
    """One bound tenant."""

    trust_class: str = Field(alias="trustClass")
    api_key_hashes: list[str] = Field(
        alias="apiKeyHashes", description='"sha256:<hex>" of each API key the tenant may present'
    )
    allowed_adapters: list[str] = Field(default_factory=list, alias="allowedAdapters")
    quotas: Quotas = Field(default_factory=Quotas)
    binding: str = Field("", description="namespace/name of the TenantBinding this came from")


class RoutingTable(_Model):
    version: int = ROUTING_TABLE_VERSION
    trust_classes: dict[str, TrustClassRoute] = Field(default_factory=dict, alias="trustClasses")
    tenants: dict[str, TenantRoute] = Field(default_factory=dict)


class RoutingTableTooLarge(ValueError):
    """The table does not fit into one Secret even compressed."""


def encode_table(table: RoutingTable) -> bytes:
    """The bytes stored under ``routing.json``: compact JSON, gzip-compressed when large (deterministic:
    the same table always gives the same bytes, so an unchanged table is never rewritten)."""
    raw = json.dumps(
        table.model_dump(by_alias=True, mode="json", exclude_none=True), separators=(",", ":"), sort_keys=True
    ).encode()
    out = raw if len(raw) <= COMPRESS_ABOVE_BYTES else gzip.compress(raw, compresslevel=9, mtime=0)
    if len(out) > MAX_STORED_BYTES:
        raise RoutingTableTooLarge(
            f"routing table is {len(raw)} bytes ({len(out)} compressed), more than one Secret holds"
        )
    return out


def decode_table_bytes(raw: bytes) -> bytes:
    """The JSON of a stored table, whether or not it was compressed."""
    return gzip.decompress(raw) if raw[:2] == GZIP_MAGIC else raw


def parse_table_bytes(raw: bytes) -> RoutingTable:
    return RoutingTable.model_validate_json(decode_table_bytes(raw))
