"""Per-tenant KV quotas and fair-share weights follow the engine's config file without a restart.

The operator rewrites `quotas` in the engine ConfigMap when a tenant is bound or its quota changes,
and does not roll the engine pods for that; the engine must apply the new limits itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from engine.enginelib import TOKENIZER, Client, EngineProcess, Signer, config_dict
from engine.oracle import check_consistency
from support import prom

from kvfence.contract.engine_config import QuotasConfig, load_config
from kvfence.engine.server import EngineServer
from kvfence.isolation.allocator import FencedAllocator
from kvfence.isolation.quotas import QuotaExceeded


def quotas(**tenants: dict[str, int]) -> QuotasConfig:
    return QuotasConfig.model_validate({"tenants": tenants})


def test_new_limits_apply_to_live_accounts_and_keep_their_blocks() -> None:
    a = FencedAllocator("gold", num_blocks=64, block_size=4, quotas=quotas(small={"maxBlocks": 2}))
    a.allocate_sequence("s1", "small", 8)  # 2 blocks: at the maximum
    try:
        a.allocate_sequence("s2", "small", 4)
        raise AssertionError("over quota must be refused")
    except QuotaExceeded:
        pass
    a.set_quotas(quotas(small={"maxBlocks": 6, "guaranteedBlocks": 3}))
    a.allocate_sequence("s2", "small", 12)  # 3 more blocks now fit
    assert a.book.accounts["small"].guaranteed == 3
    # Lowering the maximum below current usage takes nothing away but refuses the next allocation.
    a.set_quotas(quotas(small={"maxBlocks": 1}))
    try:
        a.allocate_sequence("s3", "small", 4)
        raise AssertionError("over the lowered quota must be refused")
    except QuotaExceeded:
        pass
    assert a.book.accounts["small"].usage == 5
    # A tenant dropped from the list falls back to the default (unlimited here) once idle.
    a.set_quotas(quotas())
    for seq in ("s1", "s2"):
        a.free_sequence(seq)
    check_consistency(a)


def test_engine_applies_rewritten_quotas_without_restart(
    start_engine: Callable[[dict[str, Any]], EngineProcess], key_dir: Path, tmp_path: Path
) -> None:
    cfg = config_dict(key_dir, quotas={"tenants": {"small": {"maxBlocks": 1}}})
    proc = start_engine(cfg)
    client = Client(proc.base, Signer((key_dir / "current").read_bytes()))
    body = {"model": "tiny", "prompt": "z" * 40, "max_tokens": 8}
    assert client.one("/v1/completions", body, tenant="small").status == 400  # beyond maxBlocks 1

    cfg["quotas"] = {"tenants": {"small": {"maxBlocks": 16}}}
    path = tmp_path / "engine-0.yaml"  # the file the fixture started the engine with
    path.write_text(yaml.safe_dump(cfg))
    deadline = time.monotonic() + 60
    status = 400
    while status == 400 and time.monotonic() < deadline:
        time.sleep(0.3)
        status = client.one("/v1/completions", body, tenant="small").status
    assert status == 200
    assert proc.stop() == 0


def test_engine_pins_rewritten_shared_prefixes_without_restart(
    start_engine: Callable[[dict[str, Any]], EngineProcess], key_dir: Path, tmp_path: Path
) -> None:
    system = "You are a careful assistant for a bakery. Answer in one sentence and never quote prices. "
    cfg = config_dict(key_dir)
    proc = start_engine(cfg)
    client = Client(proc.base, Signer((key_dir / "current").read_bytes()))
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": system}]}

    def cached(tenant: str, question: str) -> int:
        body = {**chat, "messages": [*chat["messages"], {"role": "user", "content": question}]}
        reply = client.one("/v1/chat/completions", body, tenant=tenant)
        assert reply.status == 200, reply.json()
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("acme", "Do you sell rye?") == 0
    cfg["prefixCache"] = {"sharedPrefixes": [{"name": "bakery", "form": "chat", "text": system}]}
    (tmp_path / "engine-0.yaml").write_text(yaml.safe_dump(cfg))
    deadline = time.monotonic() + 60
    got, i = 0, 0
    while got == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
        i += 1
        got = cached(f"tenant-{i}", "Open on Sunday?")  # each time a tenant's first request
    shared = len(TOKENIZER.encode(TOKENIZER.chat_messages([("system", system)]))) // 16 * 16
    assert got == shared  # every tenant's first request: exactly the declared part
    assert cached("gamma", "Gluten free?") == shared
    metrics = prom.samples(client.one("/metrics", method="GET", signed=False).text)
    assert metrics["kvfence_engine_shared_prefixes_pinned"] == 2  # the base model and the adapter
    assert metrics["kvfence_engine_kv_blocks_pinned"] == 2 * shared // 16
    assert proc.stop() == 0


def test_rewritten_weights_reach_the_scheduler_without_restart(key_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    cfg = config_dict(key_dir, quotas={"default": {"weight": 2}, "tenants": {"big": {"weight": 5}}})
    path.write_text(yaml.safe_dump(cfg))
    server = EngineServer(load_config(path), config_path=str(path))
    fair = server.engine.fair
    assert (fair.weight("big"), fair.weight("other")) == (5, 2)
    cfg["quotas"] = {"default": {"weight": 1}, "tenants": {"big": {"weight": 3}, "new": {"weight": 7}}}
    path.write_text(yaml.safe_dump(cfg))
    assert server.quotas is not None
    server.quotas.check()
    assert (fair.weight("big"), fair.weight("new"), fair.weight("other")) == (3, 7, 1)
    assert server.config.quotas.tenants["new"].weight == 7
