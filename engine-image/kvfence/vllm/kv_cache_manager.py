"""vLLM's ``KVCacheManager`` with verified prefix hits, stale checks and per-tenant admission.

:class:`FencedKVCacheManager` is vLLM's own KV-cache manager (``vllm/v1/core/kv_cache_manager.py``):
``get_computed_blocks`` keeps vLLM's hash lookup and verifies each hit block against its record (the
hit ends at the first mismatch); ``allocate_slots`` admits a request from vLLM's waiting queue only if
the blocks of its hit have not moved since the lookup and its tenant has room for all it can reach;
``free`` closes the request's books, and keeps the blocks of a request that computed a declared shared
prefix (:class:`kvfence.vllm.fence.SharedPin`).
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Any

from kvfence.isolation.blocks import BlockState
from kvfence.vllm.block_pool import FencedBlockPool, extra_keys_of, namespace_of
from kvfence.vllm.fence import UNATTRIBUTED, SharedPin, TenantFence, Verdict
from kvfence.vllm.prologue import with_prologue
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.request import Request, RequestStatus

log = logging.getLogger("kvfence.vllm.kv_cache_manager")


_block_id_of = attrgetter("block_id")

#: vLLM's own method, called directly (cheaper than super() on a path taken for every request of
#: every step)
_vllm_allocate_slots = KVCacheManager.allocate_slots


class FencedKVCacheManager(KVCacheManager):  # type: ignore[misc]
    """vLLM's ``KVCacheManager`` with verified lookups, stale checks and per-tenant allocation."""

    fence: TenantFence
    fenced_pool: FencedBlockPool
    tenant_of: dict[str, str]
    reach_of: dict[str, int]
    #: request id -> its verified prefix hit at lookup: (the hit's blocks, their ids, fence.moves then)
    lookups: dict[str, tuple[list[Any], list[int], int]]
    #: the pool's dict: request id -> its prompt packed on arrival
    packed_of: dict[str, bytes]
    fence_block_size: int
    #: request id -> the pinned prefix it begins with (the scheduler's dict)
    shared_pin_of: dict[str, SharedPin]
    #: pin request id -> (prefix name, its tokens, its full blocks): requests computing a shared prefix
    pinning: dict[str, tuple[str, list[int], int]]

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        blocks, num_tokens, boundary = super().get_computed_blocks(request)
        rid = request.request_id
        if num_tokens == 0:
            self.lookups.pop(rid, None)
            return blocks, num_tokens, boundary
        hit = blocks.blocks[0]
        fence = self.fence
        ids = list(map(_block_id_of, hit))
        extras = extra_keys_of(request, len(ids), self.fence_block_size)
        pin = self.shared_pin_of.get(rid)
        shared = pin.records[: min(pin.num_blocks, len(ids))] if pin is not None else ()
        ok, verdict = fence.verify(
            ids, request._all_token_ids, namespace_of(request), extras, shared, self.packed_of.get(rid)
        )
        if pin is not None and ok >= pin.num_blocks:
            fence.counters.shared_hit_tokens += pin.num_blocks * self.fence_block_size
        if ok < len(ids):
            log.warning(
                "kvfence: prefix hit of request %s refused at block %d of %d (%s)",
                rid,
                ok,
                len(ids),
                "another cache namespace" if verdict == Verdict.CROSS_ACCESS else "hash collision",
            )
            hit = hit[:ok]
            ids = ids[:ok]
            blocks = self.create_kv_cache_blocks((hit,))
            num_tokens, boundary = ok * self.fence_block_size, 0
        self.lookups[rid] = (hit, ids, fence.moves)
        return blocks, num_tokens, boundary

    #: vLLM's own allocate_slots, compiled again with these statements first (kvfence.vllm.prologue:
    #: one frame, not an override forwarding twelve parameters on every request of every step): the
    #: pool learns which request it allocates for, and a request from vLLM's waiting queue goes to
    #: _admit ({args}: vLLM's parameters after self, in order). vLLM's scheduler passes
    #: ``new_computed_blocks`` for a waiting request (its prefix hit, empty or not) and never for a
    #: running one (test_vllm_fence.py::test_vllm_passes_computed_blocks_only_for_waiting_requests), so
    #: the running requests of every step, admitted when they left the queue, cost one comparison here
    #: (the pool checks that the request it allocates for was admitted).
    allocate_slots = with_prologue(
        KVCacheManager.allocate_slots,
        """
        self.fenced_pool.rid = request.request_id
        if new_computed_blocks is not None:
            return self._admit(request, new_computed_blocks, ({args},))
        """,
        "FencedKVCacheManager.allocate_slots",
    )

    def _admit(self, request: Request, new_computed: KVCacheBlocks | None, args: tuple[Any, ...]) -> Any:
        """A request's first allocation (or after a preemption): its prefix hit still unmoved since
        lookup, and room under its tenant's maximum for all it can reach. ``args``: vLLM's
        allocate_slots parameters after self, in its order, ``request`` first."""
        rid = request.request_id
        fence = self.fence
        tenant = self.tenant_of.get(rid, UNATTRIBUTED)
        looked_up = self.lookups.pop(rid, None)
        if (
            new_computed is not None
            and new_computed.blocks
            and new_computed.blocks[0]
            and not self._unmoved(new_computed.blocks[0], looked_up)
        ):
            fence.counters.stale_reference += 1
            fence.version += 1
            log.warning("kvfence: request %s would take prefix blocks that moved since lookup; refused", rid)
            return None
        if rid in fence.admitted:  # (never expected: an admitted request is running, not waiting)
            return _vllm_allocate_slots(self, *args)
        if tenant == UNATTRIBUTED:  # (never expected: a request without a verified tenant is held back)
            log.error("kvfence: request %s has no verified tenant; its KV blocks are charged to none", rid)
        need = fence.can_admit(tenant, self.reach_of.get(rid, request.num_tokens))
        if need is None:
            return None
        fence.admit(rid, tenant, need)  # first: the pool allocates only for admitted requests
        out = _vllm_allocate_slots(self, *args)
        if out is None:
            fence.release(rid)
        return out

    def _unmoved(self, taken: list[Any], looked_up: tuple[list[Any], list[int], int] | None) -> bool:
        """Whether the prefix blocks a request takes are what its lookup verified, each still at the
        generation it had then and not freed since. A block's generation is the fence's move count
        when it was last handed out, so one that moved since the lookup has a generation above the
        count then; while the count itself has not moved, no block has (the common case: vLLM takes
        the blocks right after the lookup, in the same step)."""
        if looked_up is None:
            return False
        hit, ids, moves = looked_up
        fence = self.fence
        if moves == fence.moves and taken is hit:
            return True
        if list(map(_block_id_of, taken)) != ids[: len(taken)]:
            return False
        blocks = fence.pool.blocks
        return not any(
            blocks[bid].generation > moves or blocks[bid].state is BlockState.FREE
            for bid in ids[: len(taken)]
        )

    def free(self, request: Request) -> None:
        rid = request.request_id
        # A request computing a shared prefix pins it when it finishes; preempted (vLLM's preemption,
        # or a prefix-cache reset that preempts the running requests), it keeps its plan and pins when
        # it has run again.
        plan = self.pinning.pop(rid, None) if request.is_finished() else None
        if plan is not None:
            self._pin(request, plan)
        else:
            super().free(request)
        self.fence.release(rid)
        self.lookups.pop(rid, None)

    def _pin(self, request: Request, plan: tuple[str, list[int], int]) -> None:
        """A request that computed a declared shared prefix finished: keep its prefix's full blocks
        (their references are never dropped: never cold, never evicted, charged to SHARED_OWNER) and
        free the rest."""
        name, tokens, k = plan
        blocks = self.coordinator.pop_blocks_for_free(request.request_id)
        keep, rest = blocks[:k], blocks[k:]
        records = [self.fence.records[b.block_id] for b in keep]
        complete = (
            request.status == RequestStatus.FINISHED_LENGTH_CAPPED
            and len(keep) == k
            and all(r is not None for r in records)
            and len(request.block_hashes) >= k
        )
        if not complete:
            log.error("kvfence: shared prefix %r could not be pinned (%s); not shared", name, request.status)
            rest = blocks
        if rest:
            self.block_pool.free_blocks(reversed(rest))
        if not complete:
            return
        pin = SharedPin(
            name,
            list(tokens),
            tuple(b.block_id for b in keep),
            tuple(request.block_hashes[:k]),
            tuple(r for r in records if r is not None),
        )
        # Longest first: a prompt that begins with two declared prefixes shares the longer one.
        self.fence.shared = tuple(sorted((*self.fence.shared, pin), key=lambda p: -len(p.tokens)))
        self.fence.version += 1
        log.info("kvfence: shared prefix %r pinned: %d blocks", name, k)
