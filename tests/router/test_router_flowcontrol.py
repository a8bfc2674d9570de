"""Flow control's policy (:mod:`kvfence.router.flowcontrol`), pure: which held request goes next."""

from __future__ import annotations

from collections import Counter

from kvfence.router.flowcontrol import ClassFlow


def saturate(flow: ClassFlow[str], sequences: int = 1) -> None:
    while flow.try_admit(sequences):
        pass


def drain(flow: ClassFlow[str], n: int) -> list[str]:
    """Release ``n`` one-sequence requests, one at a time: the tickets that went, in order."""
    out: list[str] = []
    for _ in range(n):
        out += flow.release(1)
    return out


def test_below_capacity_nothing_is_held_and_admission_only_counts() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=4, queue_limit=2)
    assert all(flow.try_admit(1) for _ in range(4)) and flow.inflight == 4
    assert not flow.try_admit(1) and flow.inflight == 4
    assert flow.release(1) == [] and flow.try_admit(1)  # room again, nobody held: admitted at once
    assert flow.tenants == {} and flow.held == 0


def test_flow_control_off_never_holds() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=0, queue_limit=1)
    assert all(flow.try_admit(50) for _ in range(100))


def test_a_request_larger_than_the_capacity_passes_when_nothing_else_runs() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=4, queue_limit=2)
    assert flow.try_admit(10) and not flow.try_admit(1)
    assert flow.hold("a", 1, 10, "big") and flow.release(10) == ["big"]


def test_once_someone_is_held_newcomers_queue_behind_them_even_with_room() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=2, queue_limit=4)
    saturate(flow)
    assert flow.hold("a", 1, 2, "a1")
    assert flow.release(1) == []  # one free, the head needs two: it waits, nobody jumps it
    assert not flow.try_admit(1)
    assert flow.release(1) == ["a1"]


def test_equal_weights_take_turns() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=10)
    saturate(flow)
    for i in range(6):
        assert flow.hold("a", 1, 1, f"a{i}")
    for i in range(3):
        assert flow.hold("b", 1, 1, f"b{i}")
    assert drain(flow, 6) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert drain(flow, 3) == ["a3", "a4", "a5"]  # work-conserving: b has nothing left


def test_weights_two_to_one_are_released_two_to_one() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=100)
    saturate(flow)
    for i in range(60):
        assert flow.hold("heavy", 2, 1, f"heavy{i}")
        assert flow.hold("light", 1, 1, f"light{i}")
    went = drain(flow, 60)
    got = Counter(t.rstrip("0123456789") for t in went)
    assert got == {"heavy": 40, "light": 20}
    # ...and in every prefix the ratio holds within one request (no bursts).
    for n in range(1, 61):
        h = sum(1 for t in went[:n] if t.startswith("heavy"))
        assert abs(h - 2 * n / 3) <= 1, (n, went[:n])


def test_service_is_counted_in_sequences_not_requests() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=4, queue_limit=100)
    saturate(flow)
    for i in range(10):
        assert flow.hold("fat", 1, 4, f"fat{i}")
    for i in range(40):
        assert flow.hold("thin", 1, 1, f"thin{i}")
    went: list[str] = []
    while len(went) < 25:
        went += flow.release(4 if not went or went[-1].startswith("fat") else 1)
    fat = sum(4 for t in went if t.startswith("fat"))
    thin = sum(1 for t in went if t.startswith("thin"))
    assert abs(fat - thin) <= 4, (fat, thin)


def test_a_full_queue_refuses_and_other_tenants_still_queue() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=2)
    saturate(flow)
    assert flow.hold("a", 1, 1, "a0") and flow.hold("a", 1, 1, "a1")
    assert not flow.hold("a", 1, 1, "a2") and flow.queued("a") == 2
    assert flow.hold("b", 1, 1, "b0")


def test_a_flooder_cannot_make_a_newcomer_wait_behind_its_backlog() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=1000)
    saturate(flow)
    for i in range(500):
        assert flow.hold("flood", 1, 1, f"f{i}")
    assert drain(flow, 10) == [f"f{i}" for i in range(10)]
    assert flow.hold("victim", 1, 1, "v0")
    assert drain(flow, 2)[0] == "v0"  # next, not after 490 others


def test_no_starvation_of_a_light_weight_and_cancel_withdraws() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=1000)
    saturate(flow)
    for i in range(999):
        assert flow.hold("heavy", 1000, 1, f"h{i}")
    assert flow.hold("light", 1, 1, "l0") and flow.hold("light", 1, 1, "l1")
    assert flow.cancel("light", "l1") and not flow.cancel("light", "l1")
    went = drain(flow, 1000)
    assert "l0" in went and "l1" not in went and flow.held == 0 and flow.backlogged == {}


def test_a_tenant_back_from_idle_starts_level_with_the_backlogged() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=100)
    saturate(flow)
    for i in range(20):
        flow.hold("a", 1, 1, f"a{i}")
    drain(flow, 10)
    flow.hold("b", 1, 1, "b0")
    flow.hold("b", 1, 1, "b1")
    flow.hold("b", 1, 1, "b2")
    assert drain(flow, 6) == ["b0", "a10", "b1", "a11", "b2", "a12"]


def test_a_tenant_whose_queue_keeps_emptying_still_pays_for_its_service() -> None:
    """A light tenant that keeps exactly one request held (its queue empties at every release) is
    charged like a backlogged one: its counter survives the empty queue, so weights 2:1 still give 2:1
    instead of a fresh start level with the heavy tenant each time."""
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=100)
    saturate(flow)
    for i in range(90):
        assert flow.hold("heavy", 2, 1, f"heavy{i}")
    assert flow.hold("light", 1, 1, "light0")
    went: list[str] = []
    for _ in range(60):
        for ticket in flow.release(1):
            went.append(ticket)
            if ticket.startswith("light"):
                assert flow.hold("light", 1, 1, f"light{len(went)}")
    got = Counter(t.rstrip("0123456789") for t in went)
    assert got == {"heavy": 40, "light": 20}, went


def test_an_idle_tenants_counter_is_forgotten_once_it_is_level_with_the_backlogged() -> None:
    """Counters of tenants with nothing held are kept only while they are above the level a returning
    tenant is lifted to; below it they carry no information, so memory stays bounded."""
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=100)
    saturate(flow)
    flow.hold("a", 1, 1, "a0")
    flow.hold("a", 1, 1, "a1")
    for i in range(5):
        flow.hold("b", 1, 1, f"b{i}")
    assert drain(flow, 3) == ["a0", "b0", "a1"]
    assert "a" in flow.tenants and "a" not in flow.backlogged  # idle, its counter (2) above b's (1)
    assert drain(flow, 1) == ["b1"]
    assert "a" not in flow.tenants  # b's counter reached it: a would start level anyway


def test_more_capacity_releases_what_fits() -> None:
    flow: ClassFlow[str] = ClassFlow(capacity=1, queue_limit=10)
    saturate(flow)
    for i in range(3):
        flow.hold("a", 1, 1, f"a{i}")
    assert flow.set_capacity(3) == ["a0", "a1"] and flow.inflight == 3
