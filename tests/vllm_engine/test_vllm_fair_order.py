"""The waiting-queue mechanics of fair share on vLLM (kvfence.vllm.fair), checked against their plain
definitions on random queues: which requests a step lets through within the tenants' shares, and
vLLM's queue after a step that saw only those (:class:`kvfence.vllm.fair.WaitingView`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.core.sched.request_queue import FCFSRequestQueue

from kvfence.contract.engine_config import QuotasConfig
from kvfence.vllm.fair import StepShares, WaitingView

TENANTS = "abcd"


@dataclass(eq=False)
class Req:
    request_id: str


def queue_of(tenants: list[str]) -> tuple[list[Req], dict[str, str]]:
    reqs = [Req(f"{t}-{i}") for i, t in enumerate(tenants)]
    return reqs, {r.request_id: t for r, t in zip(reqs, tenants, strict=True)}


@given(
    queued=st.lists(st.sampled_from(TENANTS), max_size=40),
    shares=st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 8)),
    running=st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 8)),
)
def test_the_requests_let_through_are_each_tenants_first_within_its_room(
    queued: list[str], shares: dict[str, int], running: dict[str, int]
) -> None:
    waiting, tenant_of = queue_of(queued)
    fair = StepShares(QuotasConfig(), 16, tenant_of)
    fair.tenant_by_request = {r: tenant_of[r.request_id] for r in waiting}
    fair.work = {t: n + running.get(t, 0) for t, n in Counter(queued).items()}
    fair.in_run = Counter(running)
    keep, tenants = fair._first_within_shares(waiting, shares)
    # The definition: in queue order, a request is let through while its tenant has room left.
    room = {t: shares.get(t, 0) - running.get(t, 0) for t in TENANTS}
    expected = []
    for i, t in enumerate(queued):
        if room[t] > 0:
            room[t] -= 1
            expected.append(i)
    assert keep == expected
    assert tenants == [queued[i] for i in expected]


@given(data=st.data(), n=st.integers(0, 30))
def test_vllms_queue_after_a_step_that_saw_a_view_of_it(data: st.DataObject, n: int) -> None:
    fifo = [Req(f"r{i}") for i in range(n)]
    queue = FCFSRequestQueue(fifo)
    held = data.draw(st.lists(st.sampled_from(fifo), unique=True)) if fifo else []
    order = data.draw(st.permutations([r for r in fifo if r not in held]))
    view = WaitingView(queue, order)
    assert list(view.view) == order and list(queue) == fifo
    taken = set(data.draw(st.lists(st.sampled_from(order), unique=True))) if order else set()
    preempted = [Req(f"p{i}") for i in range(data.draw(st.integers(0, 3)))]
    # The step: vLLM took some of the requests let through (in the policy's order; those it skipped
    # are back in place) and put the requests it preempted at the head.
    view.view.clear()
    view.view.extend([*preempted, *(r for r in order if r not in taken)])
    view.close()
    assert list(queue) == [*preempted, *(r for r in fifo if r not in taken)]
