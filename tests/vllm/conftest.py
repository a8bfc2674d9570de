"""tests/vllm: the kvfence vLLM middleware (always), and vLLM's own parser on the rendered args (only
where a Python with vLLM exists).

``test_vllm_args.py`` needs vLLM, which is not a project dependency (a CUDA wheel of ~340 MB plus
torch). It is collected only when ``KVFENCE_VLLM_PYTHON`` names a Python that can import vLLM, or the
running Python can; otherwise it does not exist for this run (never a skip counted as a pass):

    python -m venv /tmp/vllmvenv && /tmp/vllmvenv/bin/pip install vllm
    KVFENCE_VLLM_PYTHON=/tmp/vllmvenv/bin/python .venv/bin/pytest tests/vllm
"""

from __future__ import annotations

import importlib.util
import os
import sys


def vllm_python() -> str | None:
    env = os.environ.get("KVFENCE_VLLM_PYTHON")
    if env:
        return env
    # Without importing anything: tests/vllm itself is a namespace package on pythonpath (origin None),
    # the real vLLM is a regular package.
    spec = importlib.util.find_spec("vllm")
    return sys.executable if spec is not None and spec.origin is not None else None


collect_ignore = [] if vllm_python() else ["test_vllm_args.py"]
