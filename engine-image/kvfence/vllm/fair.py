"""The fair-share policy (:mod:`kvfence.isolation.fairshare`) applied to vLLM's scheduler, step by step.

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
* orders the waiting queue by the policy (first in first out within a tenant) for the step.

After ``schedule`` the caller puts the waiting queue back in the order vLLM's first-come-first-served
policy keeps (:func:`restore_order`): the requests preempted (by fair share or by vLLM) at its head,
where vLLM puts a preempted request, and behind them the held requests and those let through but not
admitted, in the order they had before the step. The queue's own order is thus always vLLM's, and
each step's policy order is drawn from it: within a tenant, requests start in the order they arrived.

Then :meth:`StepShares.after` charges each tenant what the step scheduled for it: the
prompt tokens it computes, the tokens its requests sample, and, for a request starting, the prompt
tokens it found in the prefix cache.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvfence.contract.engine_config import QuotasConfig
from kvfence.isolation.fairshare import CACHED_COST, OUTPUT_COST, PREFILL_COST, FairShare
from kvfence.vllm.fence import UNATTRIBUTED


class StepShares:
    """One vLLM scheduler's fair share: the policy's counters and the step hooks (see the module)."""

    def __init__(self, quotas: QuotasConfig, max_num_seqs: int) -> None:
        self.policy = FairShare(quotas.default.weight, quotas.weights())
        self.max_num_seqs = max_num_seqs
        #: requests preempted for a tenant below its share of the slots
        self.preemptions = 0
        #: the waiting queue in vLLM's order when :meth:`before` reordered it this step, else None
        self.fifo: list[Any] | None = None
        #: service units charged to each tenant since the engine started (never lifted or forgotten,
        #: unlike the policy's counters): what ``/metrics`` exports
        self.served: dict[str, int] = {}

    def set_weights(self, quotas: QuotasConfig) -> None:
        self.policy.set_weights(quotas.default.weight, quotas.weights())

    def before(self, sched: Any, tenant_of: Mapping[str, str]) -> list[Any]:
        """Order vLLM's running list and waiting queue and preempt for slots; the waiting requests
        held back for this step (the caller puts them back after ``schedule``, see :func:`restore_order`)."""
        self.fifo = None
        get = tenant_of.get
        running: list[Any] = sched.running
        run_t = [get(r.request_id, UNATTRIBUTED) for r in running]
        wait_t = [get(r.request_id, UNATTRIBUTED) for r in sched.waiting]
        in_run, queued = Counter(run_t), Counter(wait_t)
        policy = self.policy
        policy.sync(in_run.keys() | queued.keys())
        if policy.busy < 2:
            return []
        demand = dict(in_run)
        for t, n in queued.items():
            demand[t] = demand.get(t, 0) + n
        shares = policy.divide(self.max_num_seqs, demand)
        if self._preempt_for_slots(sched, get, in_run, queued, shares):
            run_t = [get(r.request_id, UNATTRIBUTED) for r in running]
            wait_t = [get(r.request_id, UNATTRIBUTED) for r in sched.waiting]
        if _order_matters(sched, running):
            costs = [_running_cost(r.num_prompt_tokens - r.num_computed_tokens) for r in running]
            running[:] = [running[i] for i in policy.ranks(run_t, costs)]
        if len(running) >= self.max_num_seqs:  # no slot: vLLM admits nothing this step
            return []
        queue = sched.waiting  # vLLM's FCFS queue: a deque
        waiting = list(queue)
        keep: list[Any] = []
        held: list[Any] = []
        for i in policy.ranks(wait_t, [r.num_tokens * PREFILL_COST for r in waiting]):
            t = wait_t[i]
            if in_run[t] >= shares.get(t, 0):
                held.append(waiting[i])
            else:
                keep.append(waiting[i])
                in_run[t] += 1
        if held or keep != waiting:
            self.fifo = waiting
            queue.clear()
            queue.extend(keep)
        return held

    def _preempt_for_slots(
        self, sched: Any, get: Any, in_run: Counter[str], queued: Counter[str], shares: dict[str, int]
    ) -> int:
        """While every slot is taken and a tenant below its share has requests waiting, preempt the
        newest running request of the tenant furthest above its share; how many it preempted."""
        running: list[Any] = sched.running
        done = 0
        short = {t: min(n, shares.get(t, 0) - in_run[t]) for t, n in queued.items()}
        want = sum(n for n in short.values() if n > 0)
        while want > 0 and len(running) >= self.max_num_seqs:
            victim_tenant = self.policy.victim(in_run, shares)
            if victim_tenant is None:
                break
            victim = next(r for r in reversed(running) if get(r.request_id, UNATTRIBUTED) == victim_tenant)
            if not sched._request_blocks_can_be_freed(victim):
                break
            running.remove(victim)
            sched._preempt_request(victim, time.monotonic())
            in_run[victim_tenant] -= 1
            queued[victim_tenant] += 1
            self.preemptions += 1
            done += 1
            want -= 1
        return done

    def after(self, output: Any, requests: Mapping[str, Any], tenant_of: Mapping[str, str]) -> None:
        """Charge each tenant what ``output`` (vLLM's SchedulerOutput) scheduled for it."""
        units: dict[str, int] = {}
        get = tenant_of.get
        for new in output.scheduled_new_reqs:
            if new.num_computed_tokens:  # its prefix-cache hit
                t = get(new.req_id, UNATTRIBUTED)
                units[t] = units.get(t, 0) + new.num_computed_tokens * CACHED_COST
        find = requests.get
        for rid, n in output.num_scheduled_tokens.items():
            r = find(rid)
            if r is None:
                continue
            done = r.num_computed_tokens  # vLLM has advanced it by what it scheduled
            if done < r.num_tokens:  # a prompt chunk that samples nothing
                u = n * PREFILL_COST
            elif n == 1 and done > r.num_prompt_tokens:  # a decoding step: one output token
                u = OUTPUT_COST
            else:  # the prompt's last chunk, and its first output token
                u = n * PREFILL_COST + OUTPUT_COST
            t = get(rid, UNATTRIBUTED)
            units[t] = units.get(t, 0) + u
        charge = self.policy.charge
        served = self.served
        for t, u in units.items():
            charge(t, u)
            served[t] = served.get(t, 0) + u


def restore_order(queue: Any, fifo: list[Any], held: list[Any]) -> None:
    """Put vLLM's waiting queue (a deque) back in its first-come-first-served order after a step that
    ran on a reordered queue: first the requests not in ``fifo`` (those vLLM preempted during the
    step: its ``_preempt_request`` puts each at the head, and it admits nothing in a step that
    preempts), as vLLM left them; then, in ``fifo``'s order (the queue as it stood before the step's
    reordering, fair share's own preemptions at its head), those of ``fifo`` still waiting and those
    ``held`` out of the queue for the step."""
    before = set(fifo)
    waiting = set(queue)
    waiting.update(held)
    head = [r for r in queue if r not in before]
    queue.clear()
    queue.extend(head)
    queue.extend([r for r in fifo if r in waiting])


def _order_matters(sched: Any, running: list[Any]) -> bool:
    """Whether the running list's order can change this step: its requests want more tokens than the
    step's budget, or the pool may run short (vLLM then preempts from the end of the list). With
    enough clean free blocks and no quotas (whose reservations hold blocks back) it cannot."""
    fence = sched.fence
    if fence.has_limits:
        return True
    bs: int = sched.block_size
    new: list[int] = [r.num_tokens_with_spec - r.num_computed_tokens for r in running]
    budget: int = sched.max_num_scheduled_tokens
    if sum(new) > budget:
        return True
    return sum([n // bs for n in new]) + len(new) > len(fence.pool.free)


def _running_cost(left: int) -> int:
    """What a running request with ``left`` prompt tokens to compute is projected to compute this
    step: its prompt left, or one token."""
    return left * PREFILL_COST if left > 0 else OUTPUT_COST
