"""Many threads allocating, committing, looking up and freeing on one allocator at once."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
from engine.oracle import check_consistency

from kvfence.contract.engine_config import QuotasConfig
from kvfence.isolation.allocator import AllocationError, FencedAllocator
from kvfence.isolation.blocks import BlockHandle
from kvfence.isolation.metrics import EngineMetrics
from kvfence.isolation.prefix_cache import CacheContext, PrefixCache

BS = 4
TENANTS = ("a", "b", "c", "d")


def test_concurrent_allocate_free_lookup_keeps_every_invariant() -> None:
    metrics = EngineMetrics()
    alloc = FencedAllocator(
        "gold",
        48,
        BS,
        tensor_parallel_size=2,
        quotas=QuotasConfig.model_validate(
            {
                "default": {"maxBlocks": 20},
                "tenants": {"a": {"guaranteedBlocks": 6}, "b": {"guaranteedBlocks": 4}},
            }
        ),
        metrics=metrics,
        prefix_cache=PrefixCache(BS, metrics),
    )
    shared = [np.arange(i, i + 12, dtype=np.int32) for i in (0, 100, 200)]
    errors: list[BaseException] = []
    fenced: list[BlockHandle] = []
    fenced_lock = threading.Lock()
    done = {"alloc": 0, "refused": 0, "hits": 0}
    done_lock = threading.Lock()
    start = threading.Barrier(8)

    def worker(wid: int) -> None:
        rng = random.Random(wid)
        try:
            start.wait()
            for i in range(250):
                # finish the fence of a few blocks other threads freed (rank 1 signals late)
                with fenced_lock:
                    mine = [fenced.pop() for _ in range(min(len(fenced), rng.randrange(1, 5)))]
                for h in mine:
                    alloc.writer_done(h, 1)
                tenant = rng.choice(TENANTS)
                ctx = CacheContext("m", "r", "", "none", "gold", f"tenant/gold/{tenant}")
                prompt = np.concatenate(
                    [
                        rng.choice(shared),
                        np.array([rng.randrange(4) for _ in range(rng.randrange(8))], dtype=np.int32),
                    ]
                )
                sid = (wid, i)
                try:
                    got = alloc.allocate_sequence(
                        sid, tenant, len(prompt) + rng.randrange(6), ctx=ctx, prompt=prompt
                    )
                except AllocationError:
                    with done_lock:
                        done["refused"] += 1
                    continue
                # every block we were given is live and at the generation we were told
                alloc.check_handles(got.handles)
                alloc.commit(sid, prompt, len(prompt))
                alloc.cached_prefix_tokens(ctx, prompt)
                hs = alloc.free_sequence(sid)
                # rank 0 signals now; rank 1 later, from whichever thread picks the handle up
                for h in hs:
                    alloc.writer_done(h, 0)
                with fenced_lock:
                    fenced.extend(hs)
                with done_lock:
                    done["alloc"] += 1
                    done["hits"] += got.num_cached_tokens > 0
        except BaseException as e:
            errors.append(e)

    def checker() -> None:
        try:
            start.wait()
            for _ in range(60):
                check_consistency(alloc)
        except BaseException as e:
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(7)] + [
        threading.Thread(target=checker)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.setswitchinterval(old)
    assert not errors, errors
    for h in fenced:
        alloc.writer_done(h, 1)
    acc = check_consistency(alloc)
    assert acc.active == 0 and acc.fenced == 0 and acc.sequences == 0
    assert acc.free + acc.cold == 48
    assert done["alloc"] > 500 and done["hits"] > 0
    assert metrics.value("kv_cache_stale_reference_error_total") == 0
    assert metrics.value("kv_cache_tenant_cross_access_rejected_total") == 0
