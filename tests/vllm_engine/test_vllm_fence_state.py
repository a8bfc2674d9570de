"""A hypothesis state machine over vLLM's real scheduler with the kvfence plugin: random tenants,
shared prefixes, aborts, steps and (with quotas) carol's maximum changed at any time, raised or
lowered below what she holds; after every step the fence's shadow agrees with vLLM's block pool,
no running request holds a block with another namespace's or other tokens' content, quotas and
guarantees hold, and (with sha256) nothing is ever counted as a collision, cross access or stale use.
At the end every request has finished normally: nothing is lost or stuck."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.request import RequestStatus
from vllm_engine.vllmsched import Harness

PREFIXES = [list(range(10_000 + 1000 * p, 10_000 + 1000 * p + 48)) for p in range(3)]
ALICE_MAX = 6
QUOTAS = {"alice": {"maxBlocks": ALICE_MAX, "guaranteedBlocks": 2}, "bob": {"guaranteedBlocks": 4}}
TENANTS = ["alice", "bob", "carol"]


class FencedScheduling(RuleBasedStateMachine):
    quotas: dict[str, Any] = QUOTAS

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.h = Harness(Path(self.tmp.name), num_blocks=24, quotas=self.quotas)
        self.rng = random.Random(0)
        #: request id -> (finish reason, output tokens) expected
        self.expected: dict[str, tuple[str, int]] = {}
        self.aborted: set[str] = set()
        #: carol's requests sent since her maximum first changed: each finishes, cut or refused to fit
        #: whatever maximum is in force when it runs (at most its max_tokens)
        self.loose: dict[str, int] = {}
        self.requotaed = False
        self.carol_max = self.h.num_blocks  # unlimited: the pool
        fence = self.h.fence
        take_for = fence.take_for
        #: allocations the guarantee check below saw (it must see the pool's: the test fails otherwise)
        self.checked_takes = 0

        def checked_take_for(acct: Any, n: int) -> Any:
            # (what the pool allocates with: an allocation never takes another tenant below its guarantee)
            tenant = acct.tenant
            before = {t: (a.usage, a.guaranteed) for t, a in fence.book.accounts.items() if t != tenant}
            out = take_for(acct, n)
            self.checked_takes += 1
            for t, (usage, guaranteed) in before.items():
                after = fence.book.accounts[t].usage if t in fence.book.accounts else 0
                assert after >= min(usage, guaranteed), (tenant, t, usage, after, guaranteed)
            return out

        fence.take_for = checked_take_for  # type: ignore[method-assign]

    def teardown(self) -> None:
        try:
            self.h.run(max_steps=2000)
            self.h.check()
            if any(self.h.outputs.get(rid) for rid in self.expected):  # one ran: blocks were allocated
                assert self.checked_takes > 0
            for rid, (reason, n) in self.expected.items():
                if rid in self.aborted:
                    continue
                if rid in self.loose:
                    assert self.h.finished.get(rid) in ("length", "error"), (rid, self.h.finished.get(rid))
                    assert len(self.h.outputs[rid]) <= self.loose[rid]
                    continue
                assert self.h.finished.get(rid) == reason, (rid, self.h.finished.get(rid), reason)
                assert len(self.h.outputs[rid]) == n
        finally:
            # The scheduler's stats writer (a thread writing into the directory) stops first, or the
            # directory can be written while it is removed.
            self.h.sched.shutdown()
            self.tmp.cleanup()

    @rule(
        tenant=st.sampled_from(TENANTS),
        prefix=st.integers(0, 2),
        keep=st.integers(0, 48),
        suffix=st.integers(1, 40),
        max_tokens=st.integers(1, 24),
    )
    def add(self, tenant: str, prefix: int, keep: int, suffix: int, max_tokens: int) -> None:
        tokens = PREFIXES[prefix][:keep] + [self.rng.randrange(1, 4000) for _ in range(suffix)]
        req = self.h.add(tenant, tokens, max_tokens=max_tokens)
        expected = ("length", max_tokens)
        if tenant == "alice" and self.quotas:  # requests beyond her maximum are cut to fit it, or refused
            room = ALICE_MAX * self.h.block_size - len(tokens)
            expected = ("error", 0) if room < 1 else ("length", min(max_tokens, room))
        self.expected[req.request_id] = expected
        if tenant == "carol" and self.requotaed:
            self.loose[req.request_id] = max_tokens

    @precondition(lambda self: bool(self.quotas))
    @rule(carol_max=st.one_of(st.none(), st.integers(2, 10)))
    def requota(self, carol_max: int | None) -> None:
        """carol's maximum set, raised, lowered (even below what she holds) or lifted, as the operator
        rewrites the engine config; the scheduler applies it at its next step."""
        tenants = dict(self.quotas)
        if carol_max is not None:
            tenants["carol"] = {"maxBlocks": carol_max}
            if carol_max < self.carol_max:  # what she holds above it may only shrink from here on
                held = self.h.over_max.get("carol", self.carol_max)
                self.h.over_max["carol"] = max(held, min(self.carol_max, self.h.num_blocks))
        self.carol_max = carol_max if carol_max is not None else self.h.num_blocks
        time.sleep(0.01)  # a new file stamp
        self.h.write_quotas(tenants)
        self.h.sched._next_reload = 0
        self.h.sched._maybe_reload()  # what its next step does first: the new maximum is in force now
        assert self.h.fence.maximum("carol") == carol_max
        if not self.requotaed:
            self.requotaed = True
            for rid in self.expected:  # carol's requests in flight fit whatever comes now
                if rid.startswith("carol-"):
                    self.loose[rid] = self.expected[rid][1]
        event(f"carol's maximum {carol_max}")

    @rule(tenant=st.sampled_from(TENANTS), n=st.integers(2, 5), prefix=st.integers(0, 2))
    def burst(self, tenant: str, n: int, prefix: int) -> None:
        for _ in range(n):
            self.add(tenant, prefix, 48, self.rng.randrange(1, 30), self.rng.randrange(1, 24))

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            if self.h.sched.has_requests():
                out = self.h.step()
                if out.preempted_req_ids:
                    event("a request was preempted")
        c = self.h.fence.counters
        for name, value in (
            ("own evictions", c.evictions_own),
            ("cross evictions", c.evictions_cross),
            ("held back for a quota", sum(c.quota_held_back.values())),
        ):
            if value:
                event(name)

    @precondition(lambda self: any(not r.is_finished() for r in self.h.sched.requests.values()))
    @rule(pick=st.integers(0, 10_000))
    def abort(self, pick: int) -> None:
        live = sorted(r.request_id for r in self.h.sched.requests.values() if not r.is_finished())
        rid = live[pick % len(live)]
        self.h.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(rid)

    @invariant()
    def consistent(self) -> None:
        self.h.check()
        c = self.h.fence.counters
        assert (c.hash_collision, c.cross_access_rejected, c.stale_reference) == (0, 0, 0)
        alice = self.h.fence.book.accounts.get("alice")
        if alice is not None and self.quotas:
            assert alice.active <= ALICE_MAX


FencedScheduling.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFencedScheduling = FencedScheduling.TestCase


class FencedSchedulingWithoutQuotas(FencedScheduling):
    """The same, with no quota at all: the fence's fast paths (vLLM pops clean blocks itself; a full
    pool evicts the tenant's own cold blocks first) carry all the traffic."""

    quotas: dict[str, Any] = {}


FencedSchedulingWithoutQuotas.TestCase.settings = FencedScheduling.TestCase.settings
TestFencedSchedulingWithoutQuotas = FencedSchedulingWithoutQuotas.TestCase
