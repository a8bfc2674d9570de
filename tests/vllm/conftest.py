"""tests/vllm: the kvfence vLLM middleware, the vLLM pins, and vLLM's own parser, request models and
middleware loader on what the operator renders. Everything here is always collected and always runs.

``test_vllm_args.py`` asks real vLLM (the release pinned in engine-image/vllm.env, for CPU), which is
not a project dependency: it runs that vLLM's Python in a subprocess (vllm_probe.py). That Python is

* ``KVFENCE_VLLM_PYTHON``, if set;
* otherwise the one ``tests/vllm/install-vllm.sh --print`` names (the cached install that
  ``tests/vllm/install-vllm.sh``, ``make vllm`` and ``make test`` create), if it exists.

Without either the tests fail and say how to install it; they are never skipped or left out:

    tests/vllm/install-vllm.sh && .venv/bin/pytest tests/vllm
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INSTALL = HERE / "install-vllm.sh"


def find_vllm_python() -> tuple[str | None, str]:
    """(the vLLM Python, or None; what was looked at, for the failure message)."""
    env = os.environ.get("KVFENCE_VLLM_PYTHON")
    if env:
        if Path(env).exists():
            return env, f"KVFENCE_VLLM_PYTHON={env}"
        return None, f"KVFENCE_VLLM_PYTHON={env} does not exist"
    if not INSTALL.exists():
        return None, f"KVFENCE_VLLM_PYTHON is unset and {INSTALL} is missing"
    res = subprocess.run(
        ["bash", str(INSTALL), "--print"], capture_output=True, text=True, timeout=60, check=False
    )
    path = res.stdout.strip()
    if res.returncode != 0 or not path:
        return None, f"`{INSTALL} --print` failed ({res.returncode}): {res.stderr.strip()[-500:]}"
    if Path(path).exists():
        return path, path
    return None, f"KVFENCE_VLLM_PYTHON is unset and {path} (from `{INSTALL} --print`) does not exist"


@dataclass(frozen=True)
class VllmPython:
    path: str | None
    looked: str

    def require(self) -> str:
        """The path; fails the calling test (a failure, never a skip) when there is no vLLM."""
        if self.path is None:
            pytest.fail(
                f"no vLLM to test against: {self.looked}. Install the pinned vLLM for CPU with "
                "`tests/vllm/install-vllm.sh` (`make vllm`; `make test` runs it), or set "
                "KVFENCE_VLLM_PYTHON to a Python that has it.",
                pytrace=False,
            )
        return self.path


@pytest.fixture(scope="session")
def vllm_python() -> VllmPython:
    """The Python of the pinned vLLM. Never fails in setup: tests call ``require()`` in their body, so
    a missing install shows as failed tests (not as setup errors, and never as skips)."""
    return VllmPython(*find_vllm_python())
