"""Per-tenant KV quotas are per engine replica (docs/router.md, "Replica choice"): every replica of a
trust class gets the same per-tenant limits, whatever the replica count, and the router keeps each
tenant on one replica, so a tenant's maxKVBlocks means the same with one replica or five."""

from __future__ import annotations

from typing import Any

from kvfence.api.common import TenantQuotas
from kvfence.contract.engine_config import EngineConfig
from kvfence.operator import builders as B


def test_kv_quotas_render_the_same_for_one_replica_or_five(make_tc: Any) -> None:
    quotas = {"defaults": {"maxKVBlocks": 64, "guaranteedKVBlocks": 8}}
    tenants = {"acme": TenantQuotas.model_validate({"maxKVBlocks": 128, "guaranteedKVBlocks": 32})}
    one, five = (B.engine_config(make_tc(replicas=n, quotas=quotas), tenants) for n in (1, 5))
    assert one == five  # not divided by the replica count, not multiplied
    ec = EngineConfig.model_validate(five)
    assert ec.quotas.default.max_blocks == 64 and ec.quotas.default.guaranteed_blocks == 8
    assert ec.quotas.for_tenant("acme").max_blocks == 128
    assert ec.quotas.for_tenant("acme").guaranteed_blocks == 32
    # Every replica runs this one config (one ConfigMap per class, mounted by every pod).
    dep = B.deployment(make_tc(replicas=5), B.config_hash(five), B.OperatorOptions())
    assert dep["spec"]["replicas"] == 5
