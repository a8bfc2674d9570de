"""The end-to-end benchmark's statistics and accounting (bench/bench_e2e.py): pure functions, tested
here because its "met / MISSED / undecided" lines and its CPU attribution rest on them."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
from support import benchmod


@pytest.fixture(scope="module")
def e2e() -> ModuleType:
    return benchmod.load("bench_e2e")


def test_the_median_added_is_the_mean_of_the_per_round_differences(e2e: ModuleType) -> None:
    ours = [[11.0, 12.0, 13.0], [21.0, 22.0, 29.0], [1.0, 2.0, 3.0]]
    peer = [[10.0, 10.5, 11.0], [20.0, 20.0, 20.0], [0.0, 0.5, 1.0]]
    got = e2e.median_added(ours, peer, 200, 1)
    assert got["per_round"] == [1.5, 2.0, 1.5]
    assert got["ms"] == pytest.approx(5 / 3)
    assert got["requests"] == 9
    half = 4.303 * math.sqrt(1 / 12) / math.sqrt(3)  # t(2) times the per-round differences' stdev / sqrt 3
    assert got["ci95"] == pytest.approx([5 / 3 - half, 5 / 3 + half])
    low, high = got["ci95_within"]
    assert low <= got["ms"] <= high


def test_the_verdicts_interval_carries_the_drift_between_rounds(e2e: ModuleType) -> None:
    """Rounds that disagree (the machine changed between them) widen the interval the verdicts use,
    however many requests each round had; the within-round interval does not see it."""
    peer = [[10.0] * 200 for _ in range(3)]
    ours = [[10.0 + shift] * 200 for shift in (0.0, 3.0, 1.5)]
    got = e2e.median_added(ours, peer, 100, 1)
    assert got["ms"] == pytest.approx(1.5)
    assert got["ci95"][0] < 0 and got["ci95"][1] > 5
    assert got["ci95_within"] == pytest.approx([1.5, 1.5])


def test_a_request_that_failed_in_either_run_is_left_out_of_both(e2e: ModuleType) -> None:
    got = e2e.median_added([[1.0, None, 3.0, 100.0]], [[0.0, 5.0, 2.0, None]], 0, 1)
    assert got["per_round"] == [2.0 - 1.0]  # medians of [1, 3] and [0, 2]
    assert got["requests"] == 2
    assert all(math.isnan(x) for x in got["ci95"])  # one round
    assert all(math.isnan(x) for x in got["ci95_within"])  # no resamples asked for


def test_pairing_cancels_the_noise_the_rows_share(e2e: ModuleType) -> None:
    """Request i carries the same machine noise in both rows: the interval of a constant 0.4 ms
    difference is that difference exactly, however noisy the requests are; shuffling the pairs
    (noise no longer shared) widens it."""
    import random

    rng = random.Random(7)
    noise = [[rng.expovariate(1 / 5) for _ in range(300)] for _ in range(3)]
    peer = [[10 + x for x in r] for r in noise]
    ours = [[10.4 + x for x in r] for r in noise]
    got = e2e.median_added(ours, peer, 300, 1)
    assert got["ms"] == pytest.approx(0.4)
    assert got["ci95_within"] == pytest.approx([0.4, 0.4])
    shuffled = [rng.sample(r, len(r)) for r in ours]
    wide = e2e.median_added(shuffled, peer, 300, 1)["ci95_within"]
    assert wide[1] - wide[0] > 0.5


def test_the_throughput_interval_is_a_t_interval_on_the_log_ratios(e2e: ModuleType) -> None:
    mean, low, high = e2e.ratio_interval([99.0, 101.0, 97.0], [100.0, 100.0, 100.0])
    logs = [math.log(0.99), math.log(1.01), math.log(0.97)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    assert mean == pytest.approx(math.exp(m))
    assert low == pytest.approx(math.exp(m - 4.303 * sd / math.sqrt(3)))
    assert high == pytest.approx(math.exp(m + 4.303 * sd / math.sqrt(3)))
    one = e2e.ratio_interval([99.0], [100.0])
    assert one[0] == pytest.approx(0.99) and math.isnan(one[1]) and math.isnan(one[2])


@pytest.mark.parametrize(
    ("low", "high", "goal", "higher", "expected"),
    [
        (0.2, 0.8, 1.0, False, "met"),
        (1.1, 1.9, 1.0, False, "MISSED"),
        (0.5, 1.5, 1.0, False, "undecided"),
        (0.985, 1.02, 0.98, True, "met"),
        (0.90, 0.97, 0.98, True, "MISSED"),
        (0.95, 1.01, 0.98, True, "undecided"),
        (math.nan, math.nan, 0.98, True, "undecided"),
    ],
)
def test_a_goal_is_met_or_missed_only_when_the_whole_interval_says_so(
    e2e: ModuleType, low: float, high: float, goal: float, higher: bool, expected: str
) -> None:
    assert e2e.verdict(low, high, goal, higher) == expected


def test_saturation_runs_are_sized_by_duration_at_the_fastest_warm_up(e2e: ModuleType) -> None:
    assert e2e.prompts_for("inf", 240, 12.0, [50.0, 61.5, 40.0]) == 738
    assert e2e.prompts_for("inf", 240, 1.0, [50.0]) == 240  # never fewer than --num-prompts
    assert e2e.prompts_for("8", 240, 12.0, [50.0]) == 240


def test_the_layout_pins_the_parts_only_where_it_can(e2e: ModuleType) -> None:
    alone = {"engine": "0", "router": "1", "client": "0"}
    assert e2e.layout("auto", "cpu", [0, 1], True) == alone
    assert e2e.layout("router-alone", "cpu", [0, 1, 2, 3], True) == {
        "engine": "0,1,2",
        "router": "3",
        "client": "0,1,2",
    }
    assert e2e.layout("engine-alone", "cpu", [0, 1], True) == {"engine": "0", "router": "1", "client": "1"}
    assert e2e.layout("auto", "gpu", [0, 1], True) == {}
    assert e2e.layout("auto", "cpu", [0], True) == {}
    assert e2e.layout("none", "cpu", [0, 1], True) == {}
    with pytest.raises(SystemExit, match="needs taskset and two CPUs"):
        e2e.layout("engine-alone", "cpu", [0, 1], False)


def test_cpu_ticks_are_read_after_the_process_name(e2e: ModuleType) -> None:
    stat = "4242 (VLLM::Worker (x) y) S 1 4200 4200 0 -1 4194560 100 0 0 0 1234 56 7 8 20 0 9"
    assert e2e.stat_cpu_ticks(stat) == (4200, 1234 + 56)


def test_a_metric_is_summed_over_its_label_sets_and_not_its_namesakes(e2e: ModuleType) -> None:
    text = "\n".join(
        [
            "# TYPE kvfence_router_held_requests_total counter",
            'kvfence_router_held_requests_total{tenant="a"} 3',
            'kvfence_router_held_requests_total{tenant="b"} 4.5',
            "kvfence_router_held_requests_total_extra 100",
            "kvfence_router_request_duration_seconds_count 7",
        ]
    )
    assert e2e.metric_sum(text, "kvfence_router_held_requests_total") == 7.5
    assert e2e.metric_sum(text, "kvfence_router_request_duration_seconds_count") == 7
    assert e2e.metric_sum(text, "kvfence_router_missing") == 0


def test_request_ttfts_keep_request_order_with_failures_as_none(e2e: ModuleType) -> None:
    result = {"ttfts": [0.0123, 0.0, 0.0201], "errors": ["", "Bad Request", ""]}
    assert e2e.request_ttfts_ms(result) == [12.3, None, 20.1]


def test_the_engines_view_is_the_mean_over_all_rounds_requests(e2e: ModuleType) -> None:
    def run(ttft_s: float, n: int, client_ms: float) -> dict[str, object]:
        seen = {"ttft_s": ttft_s, "ttft_n": n, "queue_s": 0.0, "queue_n": n, "prefill_s": 0.0, "prefill_n": 0}
        return {"engine_seen": seen, "mean_ttft_ms": client_ms}

    got = e2e.engine_seen([run(1.0, 100, 12.0), run(3.0, 100, 14.0)])
    assert got["ttft_mean_ms"] == pytest.approx(20.0)  # 4 s over 200 requests
    assert got["queue_mean_ms"] == 0.0
    assert math.isnan(got["prefill_mean_ms"])  # nothing counted
    assert got["client_mean_ttft_ms"] == pytest.approx(13.0)
    text = 'vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5\n'
    assert e2e.metric_sum(text, e2e.ENGINE_METRICS["ttft_s"]) == 1.5
