"""bench/bench_vllm.py's ratios and verdict (pure functions over recorded runs): a light engine, where no
step leaves a request waiting, has no saturated figures and is judged on its steps or its whole run."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from support import benchmod


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return benchmod.load("bench_vllm")


def runs(bench: ModuleType, kind: str, step: int, saturated: bool, schedule: str = "same") -> list[Any]:
    """Three rounds of ten equal steps of one request each."""
    n = 10
    return [
        bench.Run(
            kind,
            step_ns=[step] * n,
            cpu_ns=[step] * n,
            shape=[(1, 0, 0)] * n,
            saturated=[saturated] * n,
            add_ns=1,
            added=1,
            scheduled_reqs=n,
            fingerprint=schedule,
        )
        for _ in range(3)
    ]


def test_a_light_engine_is_judged_on_its_steps_without_saturated_figures(bench: ModuleType) -> None:
    res = bench.pair_ratios(runs(bench, "stock", 100_000, False), runs(bench, "fenced", 110_000, False))
    assert res["ratio_saturated_step"] is None and res["ratio_saturated_step_per_round"] == []
    assert res["ratio_mean_step"] == pytest.approx(1.1)
    v = bench.verdict(res)
    assert (v["figure"], v["met"]) == ("mean step", False)
    assert v["ratio"] == pytest.approx(1.1)
    # Another schedule (fair share's): the whole workload decides where nothing saturated
    stock, fenced = runs(bench, "stock", 100_000, False), runs(bench, "fenced", 104_000, False, "x")
    other = bench.pair_ratios(stock, fenced)
    v = bench.verdict(other)
    assert (v["figure"], v["met"]) == ("whole workload", True)
    assert v["ratio"] == pytest.approx(1.04)


def test_a_saturated_engine_is_judged_on_the_larger_of_its_saturated_steps_and_whole_run(
    bench: ModuleType,
) -> None:
    res = bench.pair_ratios(runs(bench, "stock", 100_000, True), runs(bench, "fenced", 107_000, True, "x"))
    assert res["ratio_saturated_step"] == pytest.approx(1.07)
    v = bench.verdict(res)
    assert v["figure"] == "saturated step" and not v["met"]
