"""The router benchmark's paired-rounds verdict (bench/bench_router.py): a pure function, tested here
because the benchmark's "met / not met" lines rest on it."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
from support import benchmod


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return benchmod.load("bench_router")


def test_the_sign_test_gives_the_binomial_tail(bench: ModuleType) -> None:
    assert bench.sign_test(12, 12) == pytest.approx(1 / 4096)
    assert bench.sign_test(11, 12) == pytest.approx(13 / 4096)  # 0.0032
    assert bench.sign_test(0, 12) == 1.0
    assert bench.sign_test(6, 12) == pytest.approx(sum(math.comb(12, k) for k in range(6, 13)) / 4096)


def test_paired_rounds_count_wins_by_direction(bench: ModuleType) -> None:
    # throughput: higher is better; the last round is a loss
    wins, n, ratio, p = bench.paired([110.0, 120.0, 90.0], [100.0, 100.0, 100.0], True)
    assert (wins, n) == (2, 3)
    assert ratio == pytest.approx(1.1)
    assert p == pytest.approx(4 / 8)
    # CPU per request: lower is better; a tie counts for us (the goal is "at most the peer's")
    wins, n, _, _ = bench.paired([80.0, 100.0, 120.0], [100.0, 100.0, 100.0], False)
    assert (wins, n) == (2, 3)


def test_rounds_with_a_missing_figure_are_left_out(bench: ModuleType) -> None:
    wins, n, ratio, _ = bench.paired([math.nan, 50.0, 0.0], [40.0, 40.0, 40.0], True)
    assert (wins, n) == (1, 1)
    assert ratio == pytest.approx(1.25)
    wins, n, ratio, p = bench.paired([math.nan], [1.0], True)
    assert (wins, n) == (0, 0) and math.isnan(ratio) and math.isnan(p)
