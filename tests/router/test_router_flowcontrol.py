"""Flow control's policy (:mod:`kvfence.router.flowcontrol`), pure: which requests pass, which are
held, and which held request goes next."""

from __future__ import annotations

import random
from collections import Counter, deque

from kvfence.router.flowcontrol import ClassFlow


class Flow:
    """A :class:`ClassFlow` and the requests it let through, which end oldest first. A ticket names
    its tenant (``"a3"`` is tenant ``a``'s)."""

    def __init__(self, capacity: int, queue_limit: int = 100) -> None:
        self.flow: ClassFlow[str] = ClassFlow(capacity, queue_limit)
        self.running: deque[tuple[str, int]] = deque()  # (tenant, sequences), oldest first
        self.sizes: dict[str, int] = {}  # held ticket -> its sequences

    def admit(self, tenant: str, sequences: int = 1, weight: int = 1) -> bool:
        ok = self.flow.try_admit(tenant, weight, sequences)
        if ok:
            self.running.append((tenant, sequences))
        return ok

    def hold(self, ticket: str, sequences: int = 1, weight: int = 1) -> bool:
        self.sizes[ticket] = sequences
        return self.flow.hold(tenant_of(ticket), weight, sequences, ticket)

    def went(self, tickets: list[str]) -> list[str]:
        self.running += [(tenant_of(t), self.sizes.pop(t)) for t in tickets]
        return tickets

    def end(self, n: int = 1) -> list[str]:
        """End the ``n`` oldest requests, one at a time: the tickets that went, in order."""
        out: list[str] = []
        for _ in range(n):
            tenant, sequences = self.running.popleft()
            out += self.went(self.flow.release(tenant, sequences))
        return out

    def saturate(self, tenant: str = "x", sequences: int = 1) -> None:
        while self.admit(tenant, sequences):
            pass

    def of(self, tenant: str) -> int:
        return sum(s for t, s in self.running if t == tenant)


def tenant_of(ticket: str) -> str:
    return ticket.rstrip("0123456789")


def test_below_capacity_nothing_is_held_and_admission_only_counts() -> None:
    f = Flow(capacity=4, queue_limit=2)
    assert all(f.admit("a") for _ in range(4)) and f.flow.inflight == 4
    assert not f.admit("a") and f.flow.inflight == 4  # at capacity, and at its share (it is alone)
    assert f.end() == [] and f.admit("a")  # room again, nobody held: admitted at once
    assert f.flow.tenants == {} and f.flow.held == 0 and f.flow.reserved == 0
    f.end(4)
    assert f.flow.inflight_of == {} and f.flow.weights == 0 and f.flow.inflight == 0  # memory follows load


def test_flow_control_off_never_holds() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=0, queue_limit=1)
    assert all(flow.try_admit(f"t{i % 3}", 1, 50) for i in range(100))


def test_a_request_larger_than_the_capacity_passes_when_nothing_else_runs() -> None:
    f = Flow(capacity=4, queue_limit=2)
    assert f.admit("a", 10) and not f.admit("a")
    assert f.hold("a0", 10) and f.end() == ["a0"]


def test_a_tenant_below_its_share_passes_while_another_request_fills_the_capacity() -> None:
    """One request of 32 sequences fills a capacity of 8; the victim's share is 8 x 1/2: four of its
    requests pass at once, the fifth waits, and the attacker gets nothing more."""
    f = Flow(capacity=8)
    assert f.admit("attacker", 32)
    assert [f.admit("victim") for _ in range(5)] == [True] * 4 + [False]
    assert not f.admit("attacker") and f.flow.inflight == 36 and f.flow.reserved == 4
    assert f.hold("victim0") and f.end() == ["victim0"]  # the attacker's request ends: room


def test_a_tenant_below_its_share_passes_while_others_are_held() -> None:
    f = Flow(capacity=4)
    f.saturate("flood")
    for i in range(10):
        assert f.hold(f"flood{i}")
    assert f.admit("victim") and f.admit("victim")  # its share: 4 x 1/2
    assert not f.admit("victim")  # at its share: held
    assert f.flow.queued("flood") == 10 and f.flow.inflight == 6 and f.flow.reserved == 2


def test_a_tenant_at_its_share_is_held_and_released_within_it_first() -> None:
    """A held tenant whose share frees up is released ahead of the pool's order: the flood is first
    in the VTC order, but only the victim fits (its share), so the victim's end releases the victim."""
    f = Flow(capacity=4)
    f.saturate("flood")
    assert f.hold("flood0") and f.admit("victim") and f.admit("victim")
    assert not f.admit("victim") and f.hold("victim0") and f.hold("victim1")
    f.running.rotate(-4)  # the victim's two requests end first
    assert f.end() == ["victim0"] and f.end() == ["victim1"]
    assert f.end() == ["flood0"]  # the pool's first freed slot goes to the flood's head


def test_weights_divide_the_shares() -> None:
    """Capacity 12 filled by a weight-1 flood: a weight-4 tenant's share is 12 x 4/5 (9 sequences);
    then a weight-1 tenant's is 12 x 1/6 (2)."""
    f = Flow(capacity=12)
    f.saturate("flood")
    heavy = sum(f.admit("heavy", weight=4) for _ in range(20))
    light = sum(f.admit("light", weight=1) for _ in range(20))
    assert (heavy, light) == (9, 2) and f.flow.weights == 6 and f.flow.reserved == 11


def test_a_reloaded_weight_releases_what_its_larger_share_now_holds() -> None:
    """Capacity 4 filled by a flood: the victim (weight 1) gets 2 and its third is held; a table that
    raises its weight to 3 (a share of 3) releases that request at once, before any request ends."""
    f = Flow(capacity=4)
    f.saturate("flood")
    assert f.admit("victim") and f.admit("victim") and not f.admit("victim")
    assert f.hold("victim0")
    assert f.went(f.flow.set_weights({"flood": 1})) == []  # nothing moved: nothing released
    assert f.went(f.flow.set_weights({"victim": 3, "flood": 1})) == ["victim0"]
    assert f.flow.weights == 4 and f.of("victim") == 3


def test_a_tenant_never_passes_its_own_held_requests() -> None:
    """FIFO within a tenant: the victim's request of three sequences is beyond its share (two) and
    waits; its next request, which would fit its share, waits behind it, and they go in order."""
    f = Flow(capacity=4)
    f.saturate("flood")
    assert not f.admit("victim", 3) and f.hold("victim0", 3)
    assert not f.admit("victim") and f.hold("victim1")
    assert f.end(2) == [] and f.end() == ["victim0"]  # the pool has room for three
    assert f.end() == ["victim1"]


def test_shares_granted_one_after_another_stay_within_the_capacity() -> None:
    """Tenants arriving one by one while the pool is full: each newcomer's share is computed against
    more tenants than its predecessors' were (6/2, 6/3, 6/4, ...). The reserved sequences stop at the
    capacity, so the class has at most twice the capacity in flight."""
    f = Flow(capacity=6)
    f.saturate("a")
    for tenant in "bcdef":
        while f.admit(tenant):
            pass
    assert [f.of(t) for t in "abcdef"] == [6, 3, 2, 1, 0, 0]
    assert f.flow.reserved == 6 and f.flow.inflight == 12
    f.running.rotate(-6)  # b's requests end first: f's share (6/5) admits one again
    f.end(3)
    assert f.admit("f") and f.flow.inflight == 10


def test_equal_weights_take_turns() -> None:
    f = Flow(capacity=1, queue_limit=10)
    f.saturate()
    for i in range(6):
        assert f.hold(f"a{i}")
    for i in range(3):
        assert f.hold(f"b{i}")
    assert f.end(6) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert f.end(3) == ["a3", "a4", "a5"]  # work-conserving: b has nothing left


def test_weights_two_to_one_are_released_two_to_one() -> None:
    f = Flow(capacity=1)
    f.saturate()
    for i in range(60):
        assert f.hold(f"heavy{i}", weight=2)
        assert f.hold(f"light{i}", weight=1)
    went = f.end(60)
    got = Counter(tenant_of(t) for t in went)
    assert got == {"heavy": 40, "light": 20}
    # ...and in every prefix the ratio holds within one request (no bursts).
    for n in range(1, 61):
        h = sum(1 for t in went[:n] if t.startswith("heavy"))
        assert abs(h - 2 * n / 3) <= 1, (n, went[:n])


def test_service_is_counted_in_sequences_not_requests() -> None:
    """A tenant of four-sequence requests and one of one-sequence requests, both backlogged behind the
    pool: over the releases, each gets about as many sequences as the other, and the four-sequence
    head, which needs the whole pool, is not starved by the other's admissions on its share."""
    f = Flow(capacity=4)
    f.saturate("x", 4)
    for i in range(10):
        assert f.hold(f"fat{i}", 4)
    for i in range(40):
        assert f.hold(f"thin{i}")
    went: list[str] = []
    while len(went) < 25:
        went += f.end()
    fat = sum(4 for t in went if t.startswith("fat"))
    thin = sum(1 for t in went if t.startswith("thin"))
    assert abs(fat - thin) <= 4, (fat, thin)


def test_a_full_queue_refuses_and_other_tenants_still_queue() -> None:
    f = Flow(capacity=1, queue_limit=2)
    f.saturate()
    assert f.hold("a0") and f.hold("a1")
    assert not f.hold("a2") and f.flow.queued("a") == 2
    assert f.hold("b0")


def test_a_flooder_cannot_make_a_newcomer_wait_behind_its_backlog() -> None:
    f = Flow(capacity=1, queue_limit=1000)
    f.saturate("flood")
    for i in range(500):
        assert f.hold(f"flood{i}")
    assert f.end(10) == [f"flood{i}" for i in range(10)]
    assert not f.admit("victim") and f.hold("victim0")  # its share, 1 x 1/2, is less than a sequence
    assert f.end(2)[0] == "victim0"  # next, not after 490 others


def test_no_starvation_of_a_light_weight_and_cancel_withdraws() -> None:
    f = Flow(capacity=1, queue_limit=1000)
    f.saturate()
    for i in range(999):
        assert f.hold(f"heavy{i}", weight=1000)
    assert f.hold("light0") and f.hold("light1")
    assert f.flow.cancel("light", "light1") and not f.flow.cancel("light", "light1")
    went = f.end(1000)
    assert "light0" in went and "light1" not in went and f.flow.held == 0 and f.flow.backlogged == {}


def test_a_tenant_back_from_idle_starts_level_with_the_backlogged() -> None:
    f = Flow(capacity=1)
    f.saturate()
    for i in range(20):
        f.hold(f"a{i}")
    f.end(10)
    for i in range(3):
        f.hold(f"b{i}")
    assert f.end(6) == ["b0", "a10", "b1", "a11", "b2", "a12"]


def test_a_tenant_whose_queue_keeps_emptying_still_pays_for_its_service() -> None:
    """A light tenant that keeps exactly one request held (its queue empties at every release) is
    charged like a backlogged one: its counter survives the empty queue, so weights 2:1 still give 2:1
    instead of a fresh start level with the heavy tenant each time."""
    f = Flow(capacity=1)
    f.saturate()
    for i in range(90):
        assert f.hold(f"heavy{i}", weight=2)
    assert f.hold("light0")
    went: list[str] = []
    for _ in range(60):
        for ticket in f.end():
            went.append(ticket)
            if ticket.startswith("light"):
                assert f.hold(f"light{len(went)}")
    got = Counter(tenant_of(t) for t in went)
    assert got == {"heavy": 40, "light": 20}, went


def test_an_idle_tenants_counter_is_forgotten_once_it_is_level_with_the_backlogged() -> None:
    """Counters of tenants with nothing held are kept only while they are above the level a returning
    tenant is lifted to; below it they carry no information, so memory stays bounded."""
    f = Flow(capacity=1)
    f.saturate()
    f.hold("a0")
    f.hold("a1")
    for i in range(5):
        f.hold(f"b{i}")
    assert f.end(3) == ["a0", "b0", "a1"]
    assert "a" in f.flow.tenants and "a" not in f.flow.backlogged  # idle, its counter (2) above b's (1)
    assert f.end() == ["b1"]
    assert "a" not in f.flow.tenants  # b's counter reached it: a would start level anyway


def test_more_capacity_releases_what_fits() -> None:
    f = Flow(capacity=1, queue_limit=10)
    f.saturate("a")
    for i in range(3):
        f.hold(f"a{i}")
    assert f.flow.set_capacity(3) == ["a0", "a1"] and f.flow.inflight == 3


def test_cancelled_and_ended_requests_leave_nothing_counted() -> None:
    """Held requests withdrawn (a timeout, a client gone) and admitted ones ended: every count returns
    to zero and no tenant stays in memory."""
    f = Flow(capacity=2)
    f.saturate("a")
    assert f.hold("a0") and f.hold("b0", 3) and f.hold("b1")
    assert f.flow.weights == 2 and set(f.flow.inflight_of) == set(f.flow.weight_of) == {"a", "b"}
    assert f.flow.cancel("b", "b0") and f.flow.cancel("b", "b1")
    assert (
        "b" not in f.flow.inflight_of and "b" not in f.flow.weight_of and f.flow.weights == 1
    )  # nothing in flight or held: forgotten
    assert f.went(f.flow.pump()) == []
    assert f.end(2) == ["a0"] and f.end() == []
    assert f.flow.inflight_of == f.flow.weight_of == {} and f.flow.weights == 0
    assert f.flow.inflight == 0 and f.flow.held == 0


def held_below_share(flow: ClassFlow[str], weights: dict[str, int], running: Counter[str]) -> list[str]:
    """The held tenants whose head would fit their guaranteed share now, computed from the outside."""
    active = {t for t, n in running.items() if n} | set(flow.backlogged)
    total = sum(weights[t] for t in active)
    out = []
    for tenant, t in flow.backlogged.items():
        need = t.queue[0].sequences
        mine = (running[tenant] + need) * total <= flow.capacity * weights[tenant]
        if mine and flow.reserved + need <= flow.capacity:
            out.append(tenant)
    return out


def test_in_flight_stays_bounded_and_nobody_below_its_share_stays_held_under_random_load() -> None:
    """Random arrivals, ends and cancellations of requests of 1 to 8 sequences from 8 tenants of
    weights 1 to 4 against a capacity of 8: after every step the class has at most twice the capacity
    in flight (the reserved sequences at most the capacity), no held tenant's head fits its share, and
    the counts match the requests in flight; at the end everything returns to zero."""
    rng = random.Random(20261207)
    capacity, tickets = 8, 0
    f = Flow(capacity=capacity, queue_limit=4)
    weights = {f"t{i}x": rng.randint(1, 4) for i in range(8)}
    peak = peak_reserved = 0
    for step in range(20000):
        roll, tenant = rng.random(), rng.choice(list(weights))
        if roll < 0.5:
            size = rng.randint(1, capacity)
            if not f.admit(tenant, size, weights[tenant]):
                tickets += 1
                f.hold(f"{tenant}{tickets}", size, weights[tenant])
        elif roll < 0.9 and f.running:
            f.running.rotate(-rng.randrange(len(f.running)))
            f.end()
        elif f.flow.backlogged:
            name = rng.choice(list(f.flow.backlogged))
            ticket = rng.choice(list(f.flow.backlogged[name].queue)).ticket
            assert f.flow.cancel(name, ticket)
            f.sizes.pop(ticket)
            f.went(f.flow.pump())
        running = Counter[str]()
        for t, s in f.running:
            running[t] += s
        assert f.flow.inflight == sum(running.values()) <= 2 * capacity, step
        assert f.flow.reserved <= capacity
        assert {t: n for t, n in f.flow.inflight_of.items() if n} == +running
        assert f.flow.weights == sum(weights[t] for t in f.flow.weight_of)
        assert sum(f.flow.reserved_of.values()) == f.flow.reserved
        assert held_below_share(f.flow, weights, running) == [], step
        peak, peak_reserved = max(peak, f.flow.inflight), max(peak_reserved, f.flow.reserved)
    assert peak > capacity and peak_reserved == capacity  # the load did reach past the pool
    while f.running:
        f.end()
    assert f.flow.held == 0 and f.flow.inflight == 0 and f.flow.reserved == 0
    assert f.flow.inflight_of == f.flow.weight_of == f.flow.reserved_of == {} and f.flow.weights == 0
