"""The fair-share policy (:mod:`kvfence.isolation.fairshare`) applied to vLLM's scheduler, step by step.

vLLM's ``schedule`` serves its running list in order while the step's token budget lasts, preempts
from the end of that list when a running request cannot get blocks, and then admits from the head of
its waiting queue while slots and budget last. Before each ``schedule`` the fenced scheduler calls
:meth:`StepShares.before`, which, when more than one tenant has work:

* orders the running list by the policy (the next request always of the tenant with the smallest
  counter, advanced by what its earlier requests in the list will compute), so the budget goes to
  the tenants furthest below their share first and vLLM's preemption takes the tenant furthest above
  its share first (left as it is in a step that serves all of it and cannot run short of blocks);
* gives each tenant at most its weighted share of the running slots (``max_num_seqs``) when the
  requests outnumber the slots: a tenant below its share with requests waiting while every slot is
  taken preempts the newest running request of the tenant furthest above its share (never one at or
  below it), and waiting requests of a tenant at its share sit out the step;
* orders the waiting requests let through by the policy (first in first out within a tenant).

The caller shows vLLM's ``schedule`` only the waiting requests let through, in that order
(:class:`WaitingView`): vLLM's queue itself keeps its first-come-first-served order, and each step's
policy order is drawn from it, so within a tenant requests start in the order they arrived. After
``schedule`` the requests the step admitted leave the queue, and those vLLM preempted during it go to
its head, where vLLM puts a preempted request.

Then :meth:`StepShares.after` charges each tenant what the step scheduled for it: the
prompt tokens it computes, the tokens its requests sample, and, for a request starting, the prompt
tokens it found in the prefix cache.

Cost: the scheduler runs every step, over every running and waiting request, so the hooks keep their
per-request work to what a decision needs. The tenants with work and their request counts are kept as
requests arrive and leave (:meth:`StepShares.arrive`, :meth:`StepShares.leave`), not recounted; the slot
shares are divided only when the requests outnumber the slots, and again only when the counts or the
weights changed; the waiting requests each tenant's share lets through are found by the list's own
search, not by a loop over the queue, on their tenants looked up by the request objects themselves
(vLLM's requests hash by identity: of each queued request only its object header is read, never its
attributes), compared by identity (one tenant object per tenant, see the scheduler's ``_identify``); the
running list is ordered only when its order can change the step (:func:`_order_matters`, from vLLM's own
set of requests still computing their prompts); vLLM is shown the requests let through in a queue of
their own (:class:`WaitingView`), not the whole queue reordered and then put back; and
:meth:`StepShares.after` looks at each request that computed prompt tokens, the rest (one token sampled
each) are counted per tenant in one pass. A step in which every running request decoded one token (most
steps of an engine with nothing waiting) charges each tenant one output token per running request
from a map kept until the running requests change: no request is looked at.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from itertools import repeat
from typing import Any

from kvfence.contract.engine_config import QuotasConfig
from kvfence.isolation.fairshare import (
    CACHED_COST,
    OUTPUT_COST,
    PREFILL_COST,
    Division,
    FairShare,
    QueueSteps,
)
from kvfence.vllm.fence import UNATTRIBUTED

log = logging.getLogger("kvfence.vllm.fair")


class StepShares:
    """One vLLM scheduler's fair share: the policy's counters and the step hooks (see the module).
    ``tenant_of``: the scheduler's map of request id to verified tenant."""

    def __init__(self, quotas: QuotasConfig, max_num_seqs: int, tenant_of: Mapping[str, str]) -> None:
        self.policy = FairShare(quotas.default.weight, quotas.weights())
        self.max_num_seqs = max_num_seqs
        self.tenant_of = tenant_of
        #: the same map keyed by the request objects themselves (vLLM's Request hashes by identity): the
        #: per-step scans of the waiting queue and the running list look a request's tenant up without
        #: reading the request's attributes (hashing reads only its object header)
        self.tenant_by_request: dict[Any, str] = {}
        #: requests preempted for a tenant below its share of the slots
        self.preemptions = 0
        #: service units charged to each tenant since the engine started (never lifted or forgotten,
        #: unlike the policy's counters): what ``/metrics`` exports
        self.served: dict[str, int] = {}
        #: requests of each tenant the scheduler holds and has not finished (running or waiting)
        self.work: dict[str, int] = {}
        self.total = 0
        #: the running requests (ids), and how many of them each tenant has
        self.running: set[str] = set()
        self.in_run: Counter[str] = Counter()
        #: what a step of the running requests decoding one token each charges (:meth:`_decode_units`)
        self._decode_step: dict[str, int] | None = None
        #: times the running requests kept here were found to differ from vLLM's and were recounted
        self.recounts = 0
        self._synced = True  # the policy knows the tenants of ``work`` (see :meth:`_sync`)
        #: the slots divided (:meth:`_slot_shares`), and the request counts they were divided for
        self._division: Division | None = None
        self._divided_for: tuple[tuple[str, int], ...] = ()
        self._prefilling: list[str] = []  # running requests computing their prompts as the step began
        #: steps run so far; the step count when each request not yet started arrived
        self.steps = 0
        self._arrived: dict[str, int] = {}
        #: the steps each request waited before the one that first scheduled it, by tenant
        self.waits = QueueSteps()

    def set_weights(self, quotas: QuotasConfig) -> None:
        self.policy.set_weights(quotas.default.weight, quotas.weights())
        self._division = None

    # --- the scheduler's requests ---------------------------------------------------------------
    def arrive(self, request: Any, tenant: str) -> None:
        """The scheduler took ``request`` (vLLM's Request) of ``tenant``."""
        rid = request.request_id
        self.tenant_by_request[request] = tenant
        self._arrived[rid] = self.steps
        n = self.work.get(tenant, 0)
        self.work[tenant] = n + 1
        self.total += 1
        if not n:
            self._synced = False

    def stopped(self, rid: str) -> None:
        """A running request was preempted, or finished (see :meth:`leave`)."""
        if rid in self.running:
            self.running.discard(rid)
            self._decode_step = None
            self.in_run[self.tenant_of.get(rid, UNATTRIBUTED)] -= 1

    def leave(self, request: Any, tenant: str) -> None:
        """``request`` of ``tenant`` finished (or was aborted); call before its tenant is forgotten."""
        rid = request.request_id
        self.tenant_by_request.pop(request, None)
        self.stopped(rid)
        self._arrived.pop(rid, None)
        n = self.work[tenant] - 1
        self.total -= 1
        if n:
            self.work[tenant] = n
        else:
            del self.work[tenant]
            self._synced = False

    def _started(self, rids: Any) -> None:
        get, running, in_run = self.tenant_of.get, self.running, self.in_run
        for rid in rids:
            if rid not in running:
                running.add(rid)
                in_run[get(rid, UNATTRIBUTED)] += 1
                self._decode_step = None

    def _recount(self, sched_running: list[Any]) -> None:
        """Take the running requests from vLLM's list when those kept here differ in number (a path
        that started or stopped a request without the hooks seeing it): never expected, and cheap to
        check every step."""
        if len(sched_running) == len(self.running):
            return
        self.recounts += 1
        log.warning(
            "kvfence: fair share's count of running requests (%d) differs from vLLM's (%d): recounted",
            len(self.running),
            len(sched_running),
        )
        get = self.tenant_of.get
        self._decode_step = None
        self.running = {r.request_id for r in sched_running}
        self.in_run = Counter([get(rid, UNATTRIBUTED) for rid in self.running])

    def _sync(self) -> None:
        """Tell the policy which tenants have work, when that set changed (a tenant came or went): the
        policy's :meth:`~kvfence.isolation.fairshare.FairShare.sync` lifts newcomers and forgets idle
        counters the others passed, and forgetting one a few steps late changes no decision."""
        if not self._synced:
            self.policy.sync(self.work)
            self._synced = True

    def _slot_shares(self) -> dict[str, int]:
        """Each tenant's share of the running slots. The division is kept while the request counts are
        the ones it was made for: a closed loop's next request arrives as its last one finishes, and
        the counts of the step are then those of the step before."""
        counts = tuple(self.work.items())
        if self._division is None or counts != self._divided_for:
            self._division = self.policy.fill(self.max_num_seqs, self.work)
            self._divided_for = counts
        return self.policy.hand_out(self._division)

    # --- before the step ------------------------------------------------------------------------
    def before(self, sched: Any) -> list[Any] | None:
        """Order vLLM's running list and preempt for slots; the waiting requests vLLM may admit this
        step, in the policy's order (the caller shows vLLM only those: :class:`WaitingView`), or None
        when that is the whole queue in its own order."""
        self.steps += 1
        prefills = _prefilling(sched)
        self._prefilling = [r.request_id for r in prefills] if prefills else []
        self._sync()
        if self.policy.busy < 2:
            return None
        running: list[Any] = sched.running
        self._recount(running)
        shares: dict[str, int] | None = None
        if self.total > self.max_num_seqs:  # more requests than slots: each tenant gets its share
            shares = self._slot_shares()
            self._preempt_for_slots(sched, shares)
        if _order_matters(sched, running, prefills):
            run_t = list(map(self.tenant_by_request.get, running, repeat(UNATTRIBUTED)))
            costs = [_running_cost(r.num_prompt_tokens - r.num_computed_tokens) for r in running]
            running[:] = [running[i] for i in self.policy.ranks(run_t, costs)]
        if len(running) >= self.max_num_seqs or not sched.waiting:  # vLLM admits nothing this step
            return None
        return self._let_through(list(sched.waiting), shares)

    def _let_through(self, waiting: list[Any], shares: dict[str, int] | None) -> list[Any] | None:
        """Each tenant's first ``waiting`` requests up to its share of the slots (all of them when the
        slots are not short), in the policy's order; None when that is all of them in their order."""
        if shares is None:
            keep = list(range(len(waiting)))
            tenants = list(map(self.tenant_by_request.get, waiting, repeat(UNATTRIBUTED)))
        else:
            keep, tenants = self._first_within_shares(waiting, shares)
        if len(set(tenants)) > 1:
            ranks = self.policy.ranks(tenants, [waiting[i].num_tokens * PREFILL_COST for i in keep])
            keep = [keep[j] for j in ranks]
        if len(keep) == len(waiting) and keep == sorted(keep):
            return None
        return [waiting[i] for i in keep]

    def _first_within_shares(self, waiting: list[Any], shares: dict[str, int]) -> tuple[list[int], list[str]]:
        """The positions in ``waiting`` of each tenant's first requests up to what its share of the
        slots leaves beside its running ones, in queue order, and their tenants. Found by the list's
        own search for each tenant with room: in a saturated engine most tenants are at their share,
        and the queue is long."""
        in_run = self.in_run
        room = {t: left for t in self.work if (left := shares.get(t, 0) - in_run[t]) > 0}
        if not room:
            return [], []
        queued = list(map(self.tenant_by_request.get, waiting, repeat(UNATTRIBUTED)))
        keep: list[int] = []
        for t, left in room.items():
            at = -1
            for _ in range(left):
                try:
                    at = queued.index(t, at + 1)
                except ValueError:  # fewer waiting than its room (some are elsewhere: a KV transfer)
                    break
                keep.append(at)
        keep.sort()
        return keep, [queued[i] for i in keep]

    def _preempt_for_slots(self, sched: Any, shares: dict[str, int]) -> None:
        """While every slot is taken and a tenant below its share has requests waiting, preempt the
        newest running request of the tenant furthest above its share (the scheduler's
        ``_preempt_request`` tells :meth:`stopped`)."""
        running: list[Any] = sched.running
        if len(running) < self.max_num_seqs:
            return
        in_run, tenant = self.in_run, self.tenant_by_request.get
        # The tenants' requests not running are waiting, unless vLLM keeps some elsewhere (a KV
        # transfer): the estimate from the counts kept is confirmed on the waiting queue itself.
        want = _short({t: n - in_run[t] for t, n in self.work.items()}, in_run, shares)
        if want > 0:
            queued = map(tenant, sched.waiting, repeat(UNATTRIBUTED))
            want = _short(Counter(queued), in_run, shares)
        while want > 0 and len(running) >= self.max_num_seqs:
            victim_tenant = self.policy.victim(in_run, shares)
            if victim_tenant is None:
                break
            victim = next(r for r in reversed(running) if tenant(r, UNATTRIBUTED) == victim_tenant)
            if not sched._request_blocks_can_be_freed(victim):
                break
            running.remove(victim)
            sched._preempt_request(victim, time.monotonic())
            self.preemptions += 1
            want -= 1

    # --- after the step -------------------------------------------------------------------------
    def after(self, sched: Any, output: Any) -> None:
        """Note the requests ``output`` (vLLM's SchedulerOutput) started, and charge each tenant what
        it scheduled for it (:meth:`_charges`, or in a step where every running request decoded one
        token, what such a step charges: :meth:`_decode_units`)."""
        if self._decoded_one_each(output, sched.running):
            self._charge(self._decode_units())
            return
        started = [new.req_id for new in output.scheduled_new_reqs]
        resumed = output.scheduled_cached_reqs.resumed_req_ids
        self._started(started)
        self._started(resumed)
        if started:
            self._count_waits(started)
        self._recount(sched.running)
        self._charge(self._charges(sched, output, started, resumed))

    def _decoded_one_each(self, output: Any, running: list[Any]) -> bool:
        """Whether the step ``output`` scheduled one token for each of vLLM's ``running`` requests, all
        of them decoding: none started, resumed or computed its prompt, and the running requests are
        the ones counted here (what :meth:`_charges` would find, without looking at any request)."""
        return (
            not output.scheduled_new_reqs
            and not self._prefilling
            and output.total_num_scheduled_tokens == len(output.num_scheduled_tokens) == len(running)
            and len(running) == len(self.running)
            and not output.scheduled_cached_reqs.resumed_req_ids
        )

    def _charge(self, units: dict[str, int]) -> None:
        self.policy.charge_all(units)
        served = self.served
        for t, u in units.items():
            served[t] = served.get(t, 0) + u

    def _decode_units(self) -> dict[str, int]:
        """What a step in which every running request decoded one token charges each tenant, kept
        until the running requests change (:meth:`_started`, :meth:`stopped`, :meth:`_recount`)."""
        if self._decode_step is None:
            self._decode_step = {t: k * OUTPUT_COST for t, k in self.in_run.items() if k}
        return self._decode_step

    def _count_waits(self, started: list[str]) -> None:
        """For each request the step started for the first time: the steps that ran while it waited."""
        get, arrived, steps = self.tenant_of.get, self._arrived, self.steps
        for rid in started:
            at = arrived.pop(rid, None)
            if at is None:
                continue
            self.waits.started(get(rid, UNATTRIBUTED), at, steps)

    def _charges(self, sched: Any, output: Any, started: list[str], resumed: Any) -> dict[str, int]:
        """Each tenant's units of the step. A request that was decoding and got one token samples one;
        the others (starting, resuming, computing its prompt, or given several tokens) are looked at
        one by one. When every running request was scheduled and only those others got more than one
        token, the decoding ones of each tenant are its running ones less its others: no request is
        looked up."""
        scheduled: dict[str, int] = output.num_scheduled_tokens
        get = self.tenant_of.get
        others = {rid: scheduled[rid] for rid in (*started, *resumed, *self._prefilling) if rid in scheduled}
        extra = output.total_num_scheduled_tokens - len(scheduled) - sum(others.values()) + len(others)
        if extra or len(scheduled) != len(sched.running):
            units: dict[str, int] = {}
            for t in [get(rid, UNATTRIBUTED) for rid in scheduled]:
                units[t] = units.get(t, 0) + OUTPUT_COST
            others.update({rid: n for rid, n in scheduled.items() if n != 1})
        else:
            units = dict(self._decode_units())
        find = sched.requests.get
        for rid, n in others.items():
            r = find(rid)
            if r is not None:
                t = get(rid, UNATTRIBUTED)
                cost = _step_cost(n, r.num_computed_tokens, r.num_prompt_tokens, r.num_tokens)
                units[t] = units.get(t, 0) + cost - OUTPUT_COST
        for new in output.scheduled_new_reqs:
            if new.num_computed_tokens:  # its prefix-cache hit
                t = get(new.req_id, UNATTRIBUTED)
                units[t] = units.get(t, 0) + new.num_computed_tokens * CACHED_COST
        return units


def _short(waiting: Mapping[str, int], in_run: Counter[str], shares: dict[str, int]) -> int:
    """Slots the tenants below their shares could fill now: each tenant's ``waiting`` requests, up to
    what its share leaves beside its running ones."""
    return sum(max(0, min(n, shares.get(t, 0) - in_run[t])) for t, n in waiting.items())


def _step_cost(n: int, done: int, prompt: int, tokens: int) -> int:
    """Units of a request that got ``n`` tokens this step and has ``done`` computed after it (vLLM
    advances the count as it schedules) of ``tokens``, ``prompt`` of them its prompt."""
    if done < tokens:  # a prompt chunk that samples nothing
        return n * PREFILL_COST
    if n == 1 and done > prompt:  # a decoding step: one output token
        return OUTPUT_COST
    return n * PREFILL_COST + OUTPUT_COST  # the prompt's last chunk, and its first output token


class WaitingView:
    """vLLM's waiting queue as ``schedule`` sees it for one step: only the requests let through (by
    :meth:`StepShares.before` and the quota checks), in the order given, in a queue of vLLM's own type
    that stands in for the scheduler's ``waiting`` while ``schedule`` runs. vLLM's queue keeps its
    first-come-first-served order untouched; :meth:`close` then takes out of it the requests the step
    admitted, and puts at its head, as vLLM left them, those vLLM put into the view that were not let
    through: the requests it preempted during the step (vLLM puts a preempted request at the head, and
    admits nothing in a step that preempts). A request let through and skipped (vLLM waits for its
    grammar, its KV transfer) is back in the view, and so keeps its place in the queue."""

    #: up to this many requests admitted, each is taken out of vLLM's queue by the deque's own search;
    #: beyond, by one pass (vLLM's ``remove_requests``)
    REMOVE_ONE_BY_ONE = 4

    __slots__ = ("queue", "through", "view")

    def __init__(self, queue: Any, through: list[Any]) -> None:
        self.queue = queue
        self.through = through
        self.view = type(queue)(through)

    def close(self) -> None:
        """Bring vLLM's queue up to date with what ``schedule`` did to the view (see the class)."""
        through, queue = self.through, self.queue
        left = set(self.view)
        admitted = [r for r in through if r not in left]
        if len(admitted) <= self.REMOVE_ONE_BY_ONE:
            for r in admitted:
                queue.remove(r)
        else:
            queue.remove_requests(admitted)
        if len(left) > len(through) - len(admitted):  # vLLM put requests into the view
            passed = set(through)
            queue.extendleft(reversed([r for r in self.view if r not in passed]))


def _prefilling(sched: Any) -> Any:
    """The running requests still computing their prompts: vLLM's own set of them (kept as it
    schedules), or, on a vLLM without it, found by looking at each."""
    prefills = getattr(sched, "_inflight_prefills", None)
    if prefills is None:
        return [r for r in sched.running if r.num_computed_tokens < r.num_tokens]
    return prefills


def _order_matters(sched: Any, running: list[Any], prefills: Any) -> bool:
    """Whether the running list's order can change this step: its requests want more tokens than the
    step's budget, or the pool may run short (vLLM then preempts from the end of the list). A request
    decoding wants one token (and its speculative ones) and at most one new block; one computing its
    prompt wants the rest of it. With enough free blocks and no quotas (whose reservations and
    guarantees make a tenant's free blocks its own) the order cannot matter."""
    if not sched.fence.unlimited:
        return True
    per_decode: int = 1 + (getattr(sched, "num_spec_tokens", 0) or 0)
    tokens = (len(running) - len(prefills)) * per_decode
    blocks = len(running)
    if prefills:
        bs: int = sched.block_size
        left: list[int] = [r.num_tokens - r.num_computed_tokens for r in prefills]
        tokens += sum(left)
        blocks += sum([n // bs for n in left])
    if tokens > sched.max_num_scheduled_tokens:
        return True
    free: int = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return blocks > free


def _running_cost(left: int) -> int:
    """What a running request with ``left`` prompt tokens to compute is projected to compute this
    step: its prompt left, or one token."""
    return left * PREFILL_COST if left > 0 else OUTPUT_COST
