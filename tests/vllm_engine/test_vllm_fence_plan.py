"""The fence's fast allocation path decides exactly what the reference engine's planner decides.

``TenantFence.take_for`` answers the common cases itself (no quota at all; with quotas, a tenant within
its maximum served from clean blocks and its own cold ones) and leaves the rest to
``plan_allocation``. Here a fence alone (plain ``KVBlock``s, no vLLM) is driven through random
allocations, releases and quota changes; before every allocation it is copied, the copy allocates
through the planner (``_take_planned``), and both must hand out the same blocks in the same order and
end in the same books: usage, cold lists, free stack, records, counters, reservations.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfence.contract.engine_config import QuotasConfig
from kvfence.isolation.quotas import AllocationError
from kvfence.vllm.fence import FenceError, TenantFence

TENANTS = ["a", "b", "c"]
NUM_BLOCKS = 24

quota = st.fixed_dictionaries(
    {},
    optional={
        "maxBlocks": st.integers(1, NUM_BLOCKS),
        "guaranteedBlocks": st.integers(0, 6),
    },
)
quotas = st.dictionaries(st.sampled_from(TENANTS), quota, max_size=3)


def books(f: TenantFence) -> dict[str, Any]:
    """Everything an allocation may change, by value."""
    return {
        "accounts": {
            t: (a.usage, a.open_sequences, [b.block_id for b in a.cold]) for t, a in f.book.accounts.items()
        },
        "free": [b.block_id for b in f.pool.free],
        "blocks": [(b.state, b.owner, b.generation) for b in f.pool.blocks],
        "records": [r is None for r in f.records],
        "counters": (f.counters.evictions_own, f.counters.evictions_cross),
        "released": list(f.released_ids),
        "reservations": f.book.total_unused_reservation,
        # kept current only while some tenant has a guarantee (obtainable() reads it only then;
        # set_quotas counts it afresh)
        "reclaimable": (f.total_reclaimable, dict(f._reclaimable)) if f.has_guarantees else None,
        "moves": f.moves,
    }


def outcome(f: TenantFence, take: Any, tenant: str, n: int) -> tuple[Any, dict[str, Any]]:
    try:
        got: Any = [b.block_id for b in take(f.admitted[tenant][0], n)]
    except AllocationError as e:
        got = type(e).__name__
    return got, books(f)


def as_config(q: dict[str, dict[str, int]]) -> QuotasConfig:
    fixed = {}
    for t, v in q.items():  # a guarantee is at most the maximum (the CRD's rule)
        v = dict(v)
        if "maxBlocks" in v and v.get("guaranteedBlocks", 0) > v["maxBlocks"]:
            v["guaranteedBlocks"] = v["maxBlocks"]
        fixed[t] = v
    return QuotasConfig.model_validate({"tenants": fixed})


@settings(max_examples=300, deadline=None)
@given(initial=quotas, data=st.data())
def test_the_fast_path_hands_out_what_the_planner_would(initial: dict[str, Any], data: st.DataObject) -> None:
    fence = TenantFence(NUM_BLOCKS, 16, as_config(initial))
    for t in TENANTS:  # one open request per tenant: the account the pool allocates with
        fence.admit(t, t, 0)
    held: dict[str, list[Any]] = {t: [] for t in TENANTS}
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["take", "take", "take", "release", "requota"]))
        tenant = data.draw(st.sampled_from(TENANTS))
        if op == "take":
            n = data.draw(st.integers(0, 6))  # (vLLM asks for 0 blocks too)
            planned = copy.deepcopy(fence)
            fast = outcome(fence, fence.take_for, tenant, n)
            assert fast == outcome(planned, planned._take_planned, tenant, n), (tenant, n)
            if isinstance(fast[0], list):
                held[tenant].extend(fence.pool.blocks[i] for i in fast[0])
                fence.released_ids.clear()  # (what the pool does with them: out of vLLM's cache)
        elif op == "release" and held[tenant]:
            k = data.draw(st.integers(1, len(held[tenant])))
            out, held[tenant] = held[tenant][:k], held[tenant][k:]
            cached = data.draw(st.lists(st.booleans(), min_size=k, max_size=k))
            cold = [b for b, c in zip(out, cached, strict=True) if c]
            for b in cold:
                fence.records[b.block_id] = object()  # a cache entry (the fast path must drop it)
            fence.release_blocks(cold, [b for b, c in zip(out, cached, strict=True) if not c])
        elif op == "requota":
            # (guarantees adding up beyond the pool are refused before anything changes)
            with contextlib.suppress(FenceError):
                fence.set_quotas(as_config(data.draw(quotas)))
