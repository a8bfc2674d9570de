"""The fair-share policy on its own (kvfence.isolation.fairshare): counters, the lift rule, the waiting
order, the weighted division of a budget and the choice of whom to preempt."""

from __future__ import annotations

import random

import pytest

from kvfence.isolation.fairshare import CACHED_COST, OUTPUT_COST, PREFILL_COST, FairShare, request_cost


def test_costs_put_a_cached_token_below_a_computed_one_below_an_output_token() -> None:
    assert 0 < CACHED_COST < PREFILL_COST < OUTPUT_COST
    assert (
        request_cost(prefill=10, cached=20, output=3)
        == 10 * PREFILL_COST + 20 * CACHED_COST + 3 * OUTPUT_COST
    )


def test_a_counter_is_service_divided_by_weight() -> None:
    fs = FairShare(1, {"a": 2})
    fs.sync(["a", "b"])
    fs.charge("a", 100)
    fs.charge("b", 100)
    assert fs.counter("a") == 50
    assert fs.counter("b") == 100


def test_a_tenant_that_gets_work_is_lifted_to_the_smallest_counter_and_never_lowered() -> None:
    fs = FairShare()
    fs.sync(["a", "b"])
    fs.charge("a", 1000)
    fs.charge("b", 400)
    fs.sync(["a"])  # b leaves with 400
    fs.charge("a", 1000)
    fs.sync(["a", "c"])  # c never had work: lifted to a's 2000, no credit for having been idle
    assert fs.counter("c") == 2000
    fs.sync(["a", "b", "c"])  # b is lifted from 400 to 2000
    assert fs.counter("b") == 2000
    fs.charge("b", 5000)
    fs.sync(["a", "c"])
    fs.sync(["a", "b", "c"])  # b comes back above the others: it keeps its own counter
    assert fs.counter("b") == 7000


def test_when_nobody_has_work_a_newcomer_starts_at_the_last_counter() -> None:
    fs = FairShare()
    fs.sync(["a"])
    fs.charge("a", 300)
    fs.sync([])
    fs.sync(["b"])
    assert fs.counter("b") == 300


def test_idle_tenants_at_or_below_the_floor_are_forgotten() -> None:
    fs = FairShare()
    fs.sync([f"t{i}" for i in range(100)])
    fs.charge("t0", 1)
    fs.sync(["t0"])
    fs.charge("t0", 10)
    fs.sync(["t0", "x"])
    assert fs._counter.keys() == {"t0", "x"}


def test_the_waiting_order_interleaves_tenants_by_counter_and_keeps_each_fifo() -> None:
    fs = FairShare(1, {"a": 2})
    fs.sync(["a", "b"])
    queue = [("a", i) for i in range(6)] + [("b", i) for i in range(3)]
    got = fs.order(queue, lambda x: x[0], lambda x: 10)
    assert [x for x in got if x[0] == "a"] == [("a", i) for i in range(6)]
    assert [x for x in got if x[0] == "b"] == [("b", i) for i in range(3)]
    # a (weight 2) advances 5 per item, b 10: two of a's for each of b's
    assert [t for t, _ in got] == ["a", "b", "a", "a", "b", "a", "a", "b", "a"]


def test_the_waiting_order_puts_the_tenant_behind_first_whatever_arrived_first() -> None:
    fs = FairShare()
    fs.sync(["a", "b"])
    fs.charge("a", 50)
    got = fs.order([("a", 0), ("a", 1), ("b", 0)], lambda x: x[0], lambda x: 100)
    assert got[0] == ("b", 0)


@pytest.mark.parametrize(
    ("weights", "budget", "demands", "expected"),
    [
        ({}, 256, {"a": 1000, "b": 1000}, {"a": 128, "b": 128}),
        ({"a": 2}, 300, {"a": 1000, "b": 1000}, {"a": 200, "b": 100}),
        ({}, 256, {"a": 1000, "b": 10}, {"a": 246, "b": 10}),  # what b cannot use goes to a
        ({}, 256, {"a": 1000, "b": 0}, {"a": 256, "b": 0}),  # an idle tenant's share too
        ({}, 256, {"a": 100, "b": 100}, {"a": 100, "b": 100}),  # never above the demand
        ({"a": 3, "b": 2}, 60, {"a": 1000, "b": 1000, "c": 5}, {"a": 33, "b": 22, "c": 5}),
    ],
)
def test_divide_is_weighted_and_work_conserving(
    weights: dict[str, int], budget: int, demands: dict[str, int], expected: dict[str, int]
) -> None:
    fs = FairShare(1, weights)
    fs.sync(demands)
    assert fs.divide(budget, demands) == expected


def test_divide_gives_the_remainder_to_the_smallest_counter() -> None:
    fs = FairShare()
    fs.sync(["a", "b", "c"])
    fs.charge("a", 5)
    fs.charge("c", 5)
    assert fs.divide(10, {"a": 100, "b": 100, "c": 100}) == {"a": 3, "b": 4, "c": 3}


def test_divide_on_random_inputs_never_exceeds_budget_or_demand_and_wastes_nothing() -> None:
    rng = random.Random(7)
    for _ in range(500):
        tenants = [f"t{i}" for i in range(rng.randint(1, 6))]
        fs = FairShare(1, {t: rng.randint(1, 5) for t in tenants})
        fs.sync(tenants)
        for t in tenants:
            fs.charge(t, rng.randint(0, 50))
        demands = {t: rng.randint(0, 120) for t in tenants}
        budget = rng.randint(0, 300)
        got = fs.divide(budget, demands)
        assert all(0 <= got[t] <= demands[t] for t in tenants)
        assert sum(got.values()) == min(budget, sum(demands.values()))
        for t in tenants:  # a tenant short of its demand got at least its weighted share
            if got[t] < demands[t]:
                total = sum(fs.weight(u) for u in tenants if demands[u] > 0)
                assert got[t] >= budget * fs.weight(t) // total


def test_a_kept_division_hands_its_remainder_out_by_the_counters_of_the_moment() -> None:
    fs = FairShare()
    fs.sync(["a", "b", "c"])
    kept = fs.fill(10, {"a": 100, "b": 100, "c": 2})  # c sated; a and b split 8, no remainder
    assert (kept.grant, kept.remainder) == ({"a": 4, "b": 4, "c": 2}, 0)
    kept = fs.fill(11, {"a": 100, "b": 100, "c": 2})  # 9 between a and b: one left over
    assert (sorted(kept.short), kept.remainder) == (["a", "b"], 1)
    assert fs.hand_out(kept) == {"a": 5, "b": 4, "c": 2}  # equal counters: by name
    fs.charge("a", 3)
    assert fs.hand_out(kept) == {"a": 4, "b": 5, "c": 2}  # the same division, counters moved
    assert kept.grant == {"a": 4, "b": 4, "c": 2}  # handing out never changes what is kept


def test_charging_a_step_at_once_is_charging_each_tenant() -> None:
    one, each = FairShare(1, {"a": 2}), FairShare(1, {"a": 2})
    for fs in (one, each):
        fs.sync(["a", "b"])
    units = {"a": 30, "b": 7, "c": 0, "d": 5}  # d has no counter yet: lifted as charge() lifts it
    one.charge_all(units)
    for t, u in units.items():
        each.charge(t, u)
    assert {t: one.counter(t) for t in "abcd"} == {t: each.counter(t) for t in "abcd"}


def test_the_victim_is_the_tenant_furthest_above_its_share_never_one_below() -> None:
    fs = FairShare()
    fs.sync(["a", "b", "c"])
    assert fs.victim({"a": 40, "b": 20, "c": 4}, {"a": 30, "b": 16, "c": 18}) == "a"
    assert fs.victim({"a": 30, "b": 16, "c": 4}, {"a": 30, "b": 16, "c": 18}) is None
    fs.charge("b", 10)  # a tie in excess: the larger counter goes first
    assert fs.victim({"a": 32, "b": 18, "c": 4}, {"a": 30, "b": 16, "c": 18}) == "b"


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        FairShare(0)
    with pytest.raises(ValueError, match="positive"):
        FairShare(1, {"a": 0})


def test_the_waiting_order_always_takes_the_head_with_the_smallest_projected_counter() -> None:
    rng = random.Random(11)
    for _ in range(200):
        tenants = [f"t{i}" for i in range(rng.randint(1, 5))]
        fs = FairShare(1, {t: rng.randint(1, 4) for t in tenants})
        fs.sync(tenants)
        for t in tenants:
            fs.charge(t, rng.randint(0, 40))
        queue = [(rng.choice(tenants), n, rng.randint(1, 30)) for n in range(rng.randint(0, 40))]
        got = fs.order(queue, lambda x: x[0], lambda x: x[2])
        assert sorted(got) == sorted(queue)
        heads = {t: [x for x in queue if x[0] == t] for t in tenants}
        level = {t: fs.counter(t) for t in tenants}
        for item in got:
            t = item[0]
            assert heads[t][0] == item  # first in, first out within a tenant
            assert level[t] <= min(level[u] for u in tenants if heads[u])
            heads[t].pop(0)
            level[t] += item[2] / fs.weight(t)
