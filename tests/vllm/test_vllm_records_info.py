"""Which prefix-cache records the vLLM fence runs is never a secret: the compiled ones (``_records.c``)
where they load, else the pure-Python fallback, named by a warning when the module is imported and on
``/metrics`` as ``kvfence_engine_info{records=...} 1``, from the engine core's stats snapshot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvfence.vllm import records
from kvfence.vllm.stats import EdgeCounters, FenceCollector, StatsWriter

ENGINE_IMAGE = Path(__file__).resolve().parents[2] / "engine-image"


class Fence:
    version = 1

    def snapshot(self) -> dict[str, Any]:
        return {"blocks": {"total": 8}}


def info_series(path: Path) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(FenceCollector(EdgeCounters(), path))
    return {
        s.labels["records"]: s.value
        for f in registry.collect()
        if f.name == "kvfence_engine_info"
        for s in f.samples
    }


def test_this_install_runs_the_compiled_records() -> None:
    assert records.COMPILED, "kvfence.vllm._records is not built: run `make venv`"
    assert records.IMPLEMENTATION == "compiled"


def test_the_engine_cores_snapshot_names_the_records_and_metrics_export_them(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    writer = StatsWriter(Fence(), path, interval=60)
    writer.stop()
    snap = json.loads(path.read_text())
    assert snap["records"] == records.IMPLEMENTATION and snap["blocks"] == {"total": 8}
    assert info_series(path) == {records.IMPLEMENTATION: 1.0}


@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_metrics_say_what_the_engine_core_runs(tmp_path: Path, impl: str) -> None:
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"records": impl}))
    assert info_series(path) == {impl: 1.0}


def test_before_the_first_snapshot_metrics_say_what_this_install_runs(tmp_path: Path) -> None:
    assert info_series(tmp_path / "absent.json") == {records.IMPLEMENTATION: 1.0}


def test_without_the_compiled_module_the_fallback_runs_and_says_so() -> None:
    code = (
        "import sys, logging; logging.basicConfig(format='%(levelname)s %(name)s %(message)s')\n"
        "sys.modules['kvfence.vllm._records'] = None  # the compiled module cannot be imported\n"
        "from kvfence.vllm import records\n"
        "assert not records.COMPILED and records.IMPLEMENTATION == 'python'\n"
        "assert records.Record is records.PyRecord and records.pack is None\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ENGINE_IMAGE)},
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "WARNING kvfence.vllm.records kvfence: the compiled prefix-cache records did not load" in proc.stderr
    )
    assert "pure-Python records" in proc.stderr
