"""The vLLM lane: tests that drive vLLM's own scheduler, KV-cache manager and block pool in-process,
with the kvfence scheduler plugged in. They run under the Python of the real vLLM install
(``tests/vllm/install-vllm.sh``), never the project's venv; ``make test`` runs them as a second
pytest lane::

    $(tests/vllm/install-vllm.sh --print) -m pytest -o addopts="-ra --import-mode=importlib" tests/vllm_engine

A Python without vLLM fails here loudly instead of collecting nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise RuntimeError(
        "tests/vllm_engine needs real vLLM: run it with the Python that tests/vllm/install-vllm.sh prints "
        f"(make test does): {e}"
    ) from None


@pytest.fixture(params=["compiled", "pure Python"])
def record_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The fence with each implementation of its prefix-cache records (kvfence.vllm.records): the
    scheduler records, the fence compares."""
    if request.param == "pure Python":
        from vllm_engine.vllmsched import pure_python_records

        for module, name, value in pure_python_records():
            monkeypatch.setattr(module, name, value)
    yield request.param
