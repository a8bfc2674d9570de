"""Builds vLLM's real scheduler with the kvfence plugin, and drives it without a model.

:class:`Harness` owns one scheduler of ``num_blocks`` blocks of ``block_size`` tokens, the trust class's
signing key, the engine config file the plugin reads quotas from, and the stats file it writes. Requests
are made as vLLM's engine core makes them (``Request`` with the sha256 block hasher, or another hash
function to force collisions), with the ``vllm_xargs`` the kvfence middleware would set. ``step`` runs
one ``schedule`` and feeds back a model output with one sampled token per scheduled request, as vLLM's
own tests/v1/core do.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvfence.vllm.block_pool as fenced_pool
import kvfence.vllm.scheduler as fenced_scheduler
from kvfence.contract import (
    XARG_TENANT,
    XARG_TENANT_TAG,
    cache_namespace,
    derive_cache_salt,
    tenant_tag,
)
from kvfence.vllm.fence import root_namespace

TRUST_CLASS = "gold"
KEY = bytes(range(32))
SCHEDULER_CLS = "kvfence.vllm.scheduler.FencedScheduler"


@functools.cache
def base_config(max_model_len: int = 1024, max_num_seqs: int = 16, max_num_batched_tokens: int = 4096) -> Any:
    """One VllmConfig around the tiny model (built offline, see tests/vllm/tinymodel.py); the
    arguments let bench/bench_vllm.py size the scheduler like a GPU engine's."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
    import tinymodel
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tinymodel.ensure()),
        dtype="float32",
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduler_cls=SCHEDULER_CLS,
    )
    return args.create_engine_config()


def salt_of(tenant: str, scope: str = "Tenant", key: bytes = KEY) -> str:
    return derive_cache_salt(key, TRUST_CLASS, cache_namespace(TRUST_CLASS, tenant, scope))


def weak_hash(obj: Any) -> bytes:
    """A deliberately weak block hash: it ignores the extra keys (cache salt, adapter) and all but the
    first 8 tokens of a block, so blocks that differ only there collide, deterministically."""
    if isinstance(obj, tuple) and len(obj) == 3:
        parent, tokens, _extra = obj
        return sha256((parent, tuple(tokens[:8])))
    return sha256(obj)  # vLLM's seed of the first block's parent


@dataclass
class Harness:
    dir: Path
    num_blocks: int = 64
    block_size: int = 16
    quotas: dict[str, Any] = field(default_factory=dict)
    #: the engine config's quotas.default (every tenant not listed)
    default_quota: dict[str, Any] = field(default_factory=dict)
    #: the engine config's prefixCache.sharedPrefixes (declared shared prefixes)
    shared: list[dict[str, Any]] = field(default_factory=list)
    hash_fn: Callable[[Any], bytes] = sha256
    sched: Any = None
    _ids: Any = field(default_factory=lambda: itertools.count())
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str | None] = field(default_factory=dict)
    #: the VllmConfig to build from (default: base_config())
    config: Any = None
    #: build vLLM's own scheduler (of the kind the fenced one would extend) instead: the peer of
    #: bench/bench_vllm.py; ``fence`` is then None
    stock: bool = False
    #: tenant -> the most active blocks it may hold while above a maximum lowered at run time (what it
    #: held stays with its running requests): :meth:`check` then asserts what it holds only shrinks,
    #: until it is within the maximum again
    over_max: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        keys = self.dir / "keys"
        keys.mkdir(parents=True, exist_ok=True)
        (keys / "current").write_bytes(KEY)
        self.config_path = self.dir / "engine.json"
        self.stats_path = self.dir / "stats.json"
        self.write_quotas(self.quotas, self.default_quota)
        os.environ["KVFENCE_ENGINE_CONFIG"] = str(self.config_path)
        os.environ["KVFENCE_VLLM_STATS_FILE"] = str(self.stats_path)
        os.environ.pop("KVFENCE_TRUST_CLASS", None)
        os.environ.pop("KVFENCE_SIGNING_KEY_DIR", None)
        cfg = copy.copy(self.config if self.config is not None else base_config())
        cfg.cache_config = copy.copy(cfg.cache_config)
        cfg.cache_config.num_gpu_blocks = self.num_blocks
        spec = FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=4, head_size=32, dtype=torch.float32
        )
        kv = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        )
        init_none_hash(self.hash_fn)
        self.hasher = get_request_block_hasher(self.block_size, self.hash_fn)
        cls = cfg.scheduler_config.get_scheduler_cls()
        if self.stock:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler
            from vllm.v1.core.sched.scheduler import Scheduler

            cls = AsyncScheduler if cfg.scheduler_config.async_scheduling else Scheduler
        self.sched = cls(
            vllm_config=cfg,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=self.block_size,
            log_stats=True,
        )
        self.fence: Any = getattr(self.sched, "fence", None)
        self.pool = self.sched.kv_cache_manager.block_pool

    def write_quotas(self, tenants: dict[str, Any], default: dict[str, Any] | None = None) -> None:
        cfg = {
            "trustClass": TRUST_CLASS,
            "model": {"name": "tiny"},
            "numBlocks": 4096,
            "maxModelLen": 1024,
            "signingKeyDir": str(self.dir / "keys"),
            "quotas": {"default": default or {}, "tenants": tenants},
            "prefixCache": {"sharedPrefixes": self.shared},
        }
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cfg))
        os.replace(tmp, self.config_path)

    # --- requests ---------------------------------------------------------------------------------
    def make(
        self,
        tenant: str | None,
        tokens: list[int],
        max_tokens: int = 4,
        *,
        salt: str | None = None,
        tag: str | None = None,
        xargs: dict[str, Any] | None = None,
        lora: Any = None,
        request_id: str | None = None,
    ) -> Request:
        rid = request_id if request_id is not None else f"{tenant}-{next(self._ids)}"
        if salt is None and tenant is not None:
            salt = salt_of(tenant)
        if xargs is None:
            xargs = {}
            if tenant is not None:
                xargs = {
                    XARG_TENANT: _own_copy(tenant),
                    XARG_TENANT_TAG: tag
                    if tag is not None
                    else tenant_tag(KEY, TRUST_CLASS, tenant, salt or ""),
                }
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=xargs or None)
        return Request(
            rid, list(tokens), sp, None, cache_salt=salt, block_hasher=self.hasher, lora_request=lora
        )

    def add(self, *args: Any, **kwargs: Any) -> Request:
        req = self.make(*args, **kwargs)
        self.sched.add_request(req)
        self.outputs[req.request_id] = []
        return req

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens  # schedule() has already counted this step's tokens
            # A token only when the prefill is complete (as the model runner does).
            sampled.append([1000 + (done % 97)] if done >= req.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        for eco in self.sched.update_from_output(out, mro).values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)
        if not self.stock:
            self.check_fair_share_counts()
        return out

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def hits(self, out: SchedulerOutput, rid: str) -> int:
        """Prefix-cache tokens a newly scheduled request started from."""
        for new in out.scheduled_new_reqs:
            if new.req_id == rid:
                return int(new.num_computed_tokens)
        raise KeyError(rid)

    # --- invariants -------------------------------------------------------------------------------
    def check_fair_share_counts(self) -> None:
        """Fair share's request counts, kept as requests arrive, start, stop and leave, are what the
        scheduler holds, and were never recounted."""
        sched, fair = self.sched, self.sched.fair
        tenant = sched._tenant_of
        assert fair.running == {r.request_id for r in sched.running}
        assert +fair.in_run == Counter(tenant[r.request_id] for r in sched.running)
        held = [*sched.running, *sched.waiting]
        assert fair.work == Counter(tenant[r.request_id] for r in held if r.request_id in tenant)
        assert fair.total == sum(fair.work.values()) and fair.recounts == 0
        # The tenant of every request the scheduler holds, by the request object, and of no other.
        assert fair.tenant_by_request == {r: tenant[r.request_id] for r in held if r.request_id in tenant}

    def check(self) -> None:
        """The shadow agrees with vLLM's pool; quotas, reservations and records hold."""
        from kvfence.isolation.blocks import BlockState

        fence = self.fence
        for block in self.pool.blocks:
            if block.is_null:
                continue
            st = fence.state(block.block_id)
            if block.ref_cnt > 0:
                assert st is BlockState.ACTIVE, (block, st)
                assert fence.owner(block.block_id) is not None
            elif block.block_hash is not None:
                assert st is BlockState.COLD, (block, st)
            else:
                assert st is BlockState.FREE, (block, st)
                assert fence.records[block.block_id] is None
        usage: dict[str, int] = {}
        for block in self.pool.blocks[1:]:
            owner = fence.owner(block.block_id)
            if owner is not None:
                usage[owner] = usage.get(owner, 0) + 1
        for tenant, acct in fence.book.accounts.items():
            assert acct.usage == usage.get(tenant, 0), (tenant, acct.usage, usage)
            if acct.limited and tenant in self.over_max:
                assert acct.active <= self.over_max[tenant], (tenant, acct.active, self.over_max)
                if acct.active <= acct.max_blocks:
                    del self.over_max[tenant]
                else:
                    self.over_max[tenant] = acct.active
            elif acct.limited:
                assert acct.active <= acct.max_blocks, (tenant, acct.active, acct.max_blocks)
        if fence.has_guarantees:  # the running total obtainable() answers from
            total = sum(a.reclaimable_by_others for a in fence.book.accounts.values())
            assert fence.total_reclaimable == total
        assert len(fence.pool.free) == sum(
            1 for b in self.pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is None
        )
        self.check_fair_share_counts()
        # Every block a running request holds carries that request's own tokens (no foreign KV).
        mgr = self.sched.kv_cache_manager
        bs = self.block_size
        for req in self.sched.running:
            # admitted when it left the waiting queue (the pool allocates only for admitted requests)
            assert req.request_id in fence.admitted, req.request_id
            blocks = mgr.coordinator.single_type_managers[0].req_to_blocks[req.request_id]
            tokens = list(req.all_token_ids)
            for i, block in enumerate(blocks):
                rec = fence.records[block.block_id]
                if rec is None:
                    continue
                # as the scheduler records them (compiled or pure Python: see test_vllm_records.py)
                want = fenced_pool.Record(None, tokens, i * bs, (i + 1) * bs, None)
                assert rec.tokens == want.tokens, (req.request_id, i)
                # where the request's namespace entered (after a shared prefix, if any)
                ns = root_namespace(rec)
                assert ns is not None and ns[0][0] == req.cache_salt


def pure_python_records() -> list[tuple[Any, str, Any]]:
    """(module, name, value): what makes the fenced scheduler run the pure-Python prefix-cache records
    (kvfence.vllm.records), as the GPU image does, where this machine built the compiled ones. The
    vLLM lane's ``record_impl`` fixture sets them for a test, bench/bench_vllm.py for a run."""
    import kvfence.vllm.fence as fence_mod
    from kvfence.vllm import records

    return [
        (fenced_pool, "Record", records.PyRecord),
        (fenced_scheduler, "pack", None),
        (fenced_pool, "record_chain", records.py_record_chain),
        (fenced_scheduler, "records_compiled", False),  # (its start-up log line says which)
        (fence_mod, "equal", records.py_equal),
        (fence_mod, "verify_chain", records.py_verify_chain),
    ]


def _own_copy(name: str) -> str:
    """``name`` as a string object of its own, as vLLM's engine core gets each request's
    ``vllm_xargs``: decoded from the request's message, never shared with another request (but for a
    one-character name: CPython keeps one object for each, however it is made)."""
    return name.encode("utf-8").decode("utf-8") if len(name) > 1 else name
