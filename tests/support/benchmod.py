"""A benchmark script of bench/ (not a package) imported by its path, for the tests of its pure
functions (the verdicts and tallies its reports rest on)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """``bench/<name>.py`` (``name`` may be a path: ``gpu/report``) as a module of its own name
    (``<name>_under_test``, a slash as an underscore)."""
    module = name.replace("/", "_") + "_under_test"
    spec = importlib.util.spec_from_file_location(module, BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
