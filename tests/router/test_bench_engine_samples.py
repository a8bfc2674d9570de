"""bench/engine_samples.py (``bench_e2e.py --py-spy``): how a py-spy raw file is counted. Pure functions;
the sampling itself runs against real ``vllm serve`` processes only in the benchmark."""

from __future__ import annotations

from types import ModuleType

import pytest
from support import benchmod

#: vLLM's installed files (under a kvfence cache directory: only site-packages/kvfence/ is kvfence's)
SITE = "/root/.cache/kvfence/vllm/venv/lib/python3.11/site-packages"
CORE = f"{SITE}/vllm/v1/engine/core.py"
STEP = f"EngineCoreProc.run_busy_loop ({CORE}:1555);EngineCore.step ({CORE}:668)"
FENCE = "/work/engine-image/kvfence/vllm/scheduler.py"
MIDDLEWARE = "/work/engine-image/kvfence/vllm/middleware.py"
APP = f"serve_http ({SITE}/vllm/entrypoints/launcher.py:40)"
JSON = "/usr/lib/python3.11/json/__init__.py"


@pytest.fixture(scope="module")
def samples() -> ModuleType:
    return benchmod.load("engine_samples")


def test_samples_are_counted_in_the_step_the_scheduler_and_kvfence_code(samples: ModuleType) -> None:
    lines = [
        f"{STEP};FutureWrapper.result ({SITE}/vllm/v1/executor/multiproc_executor.py:80) 50",
        # the fence's override with vLLM's own schedule under it: the scheduler's, not kvfence's alone
        f"{STEP};FenceMixin.schedule ({FENCE}:453);Scheduler.schedule ({SITE}/vllm/scheduler.py:370) 7",
        f"{STEP};FenceMixin.update_from_output ({FENCE}:530) 3",
        # a request taken between steps: outside the step, and kvfence's code
        f"EngineCoreProc.run_busy_loop ({CORE}:1555);FenceMixin.add_request ({FENCE}:246) 2",
        # the API server: the middleware's own work (its JSON is the standard library's) ...
        f"{APP};KvfenceMiddleware.__call__ ({MIDDLEWARE}:220) 4",
        f"{APP};KvfenceMiddleware._salted ({MIDDLEWARE}:290);dumps ({JSON}:231) 5",
        # ... but not vLLM's application, which it awaits
        f"{APP};KvfenceMiddleware.__call__ ({MIDDLEWARE}:255);Starlette.__call__ ({SITE}/starlette/a.py:9) 6",
        # kvfence installed as a package (the engine images)
        f"{APP};KvfenceMiddleware._verify ({SITE}/kvfence/vllm/middleware.py:281) 1",
        f"{APP} 6",
        "not a sample line",
        "",
    ]
    got = samples.tally(lines)
    assert got == {
        "samples": 84,
        "step": 60,
        "scheduler": 10,
        "add_request": 2,
        "kvfence": 15,
        "kvfence_loop": 5,  # the loop's update_from_output and add_request
    }
    # another thread of the engine core: kvfence's, not the loop's
    other = samples.tally(
        [f"Thread.run (/usr/lib/python3.11/threading.py:975);StatsWriter.write ({FENCE}:9) 4"]
    )
    assert (other["kvfence"], other["kvfence_loop"]) == (4, 0)


def test_per_request_milliseconds_sum_the_runs(samples: ModuleType) -> None:
    rate = samples.RATE
    run = {
        "engine core": {
            "samples": 2 * rate,
            "step": rate,
            "scheduler": rate // 10,
            "add_request": 0,
            "kvfence": rate // 10,
            "kvfence_loop": rate // 20,
        },
        "api server": {
            "samples": rate // 2,
            "step": 0,
            "scheduler": 0,
            "add_request": 0,
            "kvfence": rate // 20,
            "kvfence_loop": 0,
        },
    }
    got = samples.per_request_ms([run, run], completed=100)  # two runs: 2 s of steps over 100 requests
    assert got["engine core step"] == pytest.approx(20.0)
    assert got["scheduler (in the step)"] == pytest.approx(2.0)
    assert got["engine core, kvfence code"] == pytest.approx(1.0)
    assert got["engine core, kvfence's other threads"] == pytest.approx(1.0)
    assert got["api server"] == pytest.approx(10.0)
    assert got["api server, kvfence code"] == pytest.approx(1.0)
    assert samples.per_request_ms([run], completed=0) == {}
