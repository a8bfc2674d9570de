"""bench/bench_vllm.py's ratios and verdict (pure functions over recorded runs): a light engine, where no
step leaves a request waiting, has no saturated figures and is judged on its steps or its whole run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
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


def lockstep_doc(bench: ModuleType, users: list[int], fenced_ns: int, saturated: bool) -> dict[str, Any]:
    """A ``vllm-<time>.json`` as bench_vllm.py --lockstep --floor --split writes it, by its own
    ``summarize`` over recorded runs (stock steps of 100 us, the fence alone 104 us; as shipped, a
    saturated engine's schedule is fair share's, a light one's is stock's)."""
    got = {
        "stock": runs(bench, "stock", 100_000, saturated),
        "fenced": runs(bench, "fenced", fenced_ns, saturated, "fair share" if saturated else "same"),
        bench.FENCE_ONLY: runs(bench, bench.FENCE_ONLY, 104_000, saturated),
    }
    variant = bench.summarize("no quotas", got)
    variant["floor"] = {"ratio_mean_step": 1.0}
    setup = {"vllm": "0", "rounds": 3, "users_per_tenant": dict(zip(bench.TENANTS, users, strict=False))}
    return {"setup": setup, "variants": {"no quotas": variant}}


def test_the_gpu_report_has_the_newest_lockstep_result_of_each_workload(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    report = benchmod.load("gpu/report")
    mix = [48, 32, 24, 20, 16, 16, 16, 16]
    docs = {
        "vllm-20261201T000000.json": lockstep_doc(bench, mix, 120_000, True),  # older: left out
        "vllm-20261201T010000.json": lockstep_doc(bench, mix, 107_000, True),
        "vllm-20261201T020000.json": lockstep_doc(bench, [2, 2, 2], 110_000, False),
        "vllm-hooks-20261201T030000.json": {"not": "a lockstep result"},
    }
    for name, doc in docs.items():
        (tmp_path / name).write_text(json.dumps(doc))
    monkeypatch.setattr(sys, "argv", ["report.py", str(tmp_path)])
    report.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    saturated = next(r for r in rows if "8 tenants x users 48,32,24,20,16,16,16,16" in r)
    light = next(r for r in rows if "3 tenants x users 2,2,2" in r)
    assert "on the saturated step" in saturated and "1.070" in saturated and "MISSED" in saturated
    assert "on the mean step" in light and "1.100" in light
    assert not any("1.200" in r for r in rows)
    assert sum("saturated step" in r and "n/a" in r for r in rows) == 2  # the light engine's two
    assert any("end to end" in r and "not run" in r for r in rows)
