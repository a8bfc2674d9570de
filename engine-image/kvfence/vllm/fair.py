"""The fair-share policy (:mod:`kvfence.engine.fairshare`) applied to vLLM's scheduler, step by step.

vLLM's ``schedule`` serves its running list in order while the step's token budget lasts, preempts
from the end of that list when a running request cannot get blocks, and then admits from the head of
its waiting queue while slots and budget last. Before each ``schedule`` the fenced scheduler calls
:meth:`StepShares.before`, which, when more than one tenant has work:

* orders the running list by the policy (the next request always of the tenant with the smallest
  counter, advanced by what its earlier requests in the list will compute), so the budget goes to
  the tenants furthest below their share first and vLLM's preemption takes the tenant furthest above
  its share first (left as it is in a step that serves all of it and cannot run short of blocks);
* gives each tenant at most its weighted share of the running slots (``max_num_seqs``): a tenant
  below its share with requests waiting while every slot is taken preempts the newest running
  request of the tenant furthest above its share (never one at or below it), and waiting requests of
  a tenant at its share sit out the step;
* orders the waiting queue by the policy (first in first out within a tenant).

After ``schedule``, :meth:`StepShares.after` charges each tenant what the step scheduled for it: the
prompt tokens it computes, the tokens its requests sample, and, for a request starting, the prompt
tokens it found in the prefix cache.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvfence.contract.engine_config import QuotasConfig
from kvfence.engine.fairshare import CACHED_COST, OUTPUT_COST, PREFILL_COST, FairShare
from kvfence.vllm.fence import UNATTRIBUTED


class StepShares:
    """One vLLM scheduler's fair share: the policy's counters and the step hooks (see the module)."""

    def __init__(self, quotas: QuotasConfig, max_num_seqs: int) -> None:
        self.policy = FairShare(quotas.default.weight, quotas.weights())
        self.max_num_seqs = max_num_seqs
        #: requests preempted for a tenant below its share of the slots
        self.preemptions = 0

    def set_weights(self, quotas: QuotasConfig) -> None:
        self.policy.set_weights(quotas.default.weight, quotas.weights())

    def before(self, sched: Any, tenant_of: Mapping[str, str]) -> list[Any]:
        """Order vLLM's running list and waiting queue and preempt for slots; the waiting requests
        held back for this step (the caller puts them back after ``schedule``)."""

        def tenant(r: Any) -> str:
            return tenant_of.get(r.request_id, UNATTRIBUTED)

        running: list[Any] = sched.running
        waiting = list(sched.waiting)
        in_run = Counter(tenant(r) for r in running)
        queued = Counter(tenant(r) for r in waiting)
        policy = self.policy
        policy.sync({*in_run, *queued})
        if len(policy.active) < 2:
            return []
        shares = policy.divide(self.max_num_seqs, in_run + queued)
        self._preempt_for_slots(sched, tenant, in_run, queued, shares)
        if _order_matters(sched, running):
            running[:] = policy.order(running, tenant, _running_cost)
        if len(running) >= self.max_num_seqs:  # no slot: vLLM admits nothing this step
            return []
        waiting = list(sched.waiting)
        keep: list[Any] = []
        held: list[Any] = []
        for r in policy.order(waiting, tenant, _waiting_cost):
            t = tenant(r)
            if in_run[t] >= shares.get(t, 0):
                held.append(r)
            else:
                keep.append(r)
                in_run[t] += 1
        sched.waiting.remove_requests(waiting)
        sched.waiting.prepend_requests(reversed(keep))  # vLLM prepends them last first
        return held

    def _preempt_for_slots(
        self, sched: Any, tenant: Any, in_run: Counter[str], queued: Counter[str], shares: dict[str, int]
    ) -> None:
        """While every slot is taken and a tenant below its share has requests waiting, preempt the
        newest running request of the tenant furthest above its share."""
        running: list[Any] = sched.running
        short = {t: min(n, shares.get(t, 0) - in_run[t]) for t, n in queued.items()}
        want = sum(n for n in short.values() if n > 0)
        while want > 0 and len(running) >= self.max_num_seqs:
            victim_tenant = self.policy.victim(in_run, shares)
            if victim_tenant is None:
                return
            victim = next(r for r in reversed(running) if tenant(r) == victim_tenant)
            if not sched._request_blocks_can_be_freed(victim):
                return
            running.remove(victim)
            sched._preempt_request(victim, time.monotonic())
            in_run[victim_tenant] -= 1
            queued[victim_tenant] += 1
            self.preemptions += 1
            want -= 1

    def after(self, output: Any, requests: Mapping[str, Any], tenant_of: Mapping[str, str]) -> None:
        """Charge each tenant what ``output`` (vLLM's SchedulerOutput) scheduled for it."""
        units: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            if new.num_computed_tokens:  # its prefix-cache hit
                t = tenant_of.get(new.req_id, UNATTRIBUTED)
                units[t] = units.get(t, 0) + new.num_computed_tokens * CACHED_COST
        for rid, n in output.num_scheduled_tokens.items():
            r = requests.get(rid)
            if r is None:
                continue
            before = r.num_computed_tokens - n  # vLLM has advanced it by what it scheduled
            if before + n < r.num_tokens:  # a prompt chunk that samples nothing
                u = n * PREFILL_COST
            elif n == 1 and before >= r.num_prompt_tokens:  # a decoding step: one output token
                u = OUTPUT_COST
            else:  # the prompt's last chunk, and its first output token
                u = n * PREFILL_COST + OUTPUT_COST
            t = tenant_of.get(rid, UNATTRIBUTED)
            units[t] = units.get(t, 0) + u
        for t, u in units.items():
            self.policy.charge(t, u)


def _order_matters(sched: Any, running: list[Any]) -> bool:
    """Whether the running list's order can change this step: its requests want more tokens than the
    step's budget, or the pool may run short (vLLM then preempts from the end of the list). With
    enough clean free blocks and no quotas (whose reservations hold blocks back) it cannot."""
    fence = sched.fence
    if fence.has_limits:
        return True
    bs = sched.block_size
    tokens = blocks = 0
    for r in running:
        new = r.num_tokens_with_spec - r.num_computed_tokens
        tokens += new
        blocks += new // bs + 1
    return tokens > sched.max_num_scheduled_tokens or blocks > len(fence.pool.free)


def _running_cost(r: Any) -> int:
    """What a running request is projected to compute this step: its prompt left, or one token."""
    left: int = r.num_prompt_tokens - r.num_computed_tokens
    return left * PREFILL_COST if left > 0 else OUTPUT_COST


def _waiting_cost(r: Any) -> int:
    return int(r.num_tokens) * PREFILL_COST
