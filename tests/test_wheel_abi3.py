"""The kvfence wheel the images install, built as ``engine-image/build-images.sh`` builds it (its
``engine-image/build-wheel.sh``), then installed into fresh virtual environments (no system site
packages, isolated mode, outside the source tree) of this machine's CPython and of every other CPython
3.11 or later it has: the compiled modules (the vLLM fence's records, the reference engine's prefix
walk) must load from the wheel in each, and be the ones the code runs. The GPU vLLM image installs this
very file into vLLM's own Python, which is not the one that built it.
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_WHEEL = ROOT / "engine-image" / "build-wheel.sh"
COMPILED = {"kvfence/isolation/_prefix_walk.abi3.so", "kvfence/vllm/_records.abi3.so"}

#: run inside each fresh environment: every line asserts something about what loaded
CHECK = r"""
import hashlib, sys, sysconfig
from pathlib import Path
from kvfence.vllm import _records, records
from kvfence.isolation import _prefix_walk

site = Path(sysconfig.get_paths()["platlib"]).resolve()
for mod in (_records, _prefix_walk):
    path = Path(mod.__file__).resolve()
    assert path.parent.parent.parent == site and path.name.endswith(".abi3.so"), path
assert records.COMPILED and records.IMPLEMENTATION == "compiled"
assert records.Record is _records.Record and records.verify_chain is _records.verify_chain
assert records.Record is not records.PyRecord and records.TOKEN_BYTES == 4
toks = list(range(100, 132))
packed = _records.pack(toks)
a = records.Record(None, packed, 0, 16, ("ns",))
b = records.Record(a, toks, 16, 32, None)
assert records.verify_chain([a, b], [0, 1], toks, packed, ("ns",), 16) == 2
assert records.verify_chain([a, b], [0, 1], toks[:16] + [7] * 16, None, ("ns",), 16) == 1
raw, key = bytes(range(64)), b"k" * 32
pos, got, matched, parent, cand = _prefix_walk.walk({}, raw, 0, 64, 64, key, b"", None, None, None, [])
assert (pos, got, cand) == (0, hashlib.sha256(key + raw).digest(), None)
print(f"{sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}")
"""


def cpython_version(python: str) -> tuple[int, int] | None:
    """(major, minor) of a CPython interpreter, None for anything else or anything that does not run."""
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.implementation.name, *sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except OSError:
        return None
    return (int(out[1]), int(out[2])) if len(out) == 3 and out[0] == "cpython" else None


def interpreters() -> dict[tuple[int, int], str]:
    """One CPython >= 3.11 per minor version: this test's own, then those on PATH, in pyenv's versions
    and in /usr/bin."""
    found: dict[tuple[int, int], str] = {sys.version_info[:2]: sys.executable}
    pyenv = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python3.{m}") for m in range(11, 16)]
    candidates += sorted(glob.glob(f"{pyenv}/versions/3.*/bin/python3"))
    candidates += sorted(glob.glob("/usr/bin/python3.1[1-9]"))
    for python in filter(None, candidates):
        v = cpython_version(python)
        if v is not None and v >= (3, 11):
            found.setdefault(v, python)
    return found


INTERPRETERS = interpreters()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "PYTHON": sys.executable, "BUILD_SYSTEM": str(out / "build-system")}
    proc = subprocess.run(
        [str(BUILD_WHEEL), str(out / "dist")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def test_the_wheel_is_one_abi3_wheel_with_both_compiled_modules(wheel: Path) -> None:
    tag = f"cp311-abi3-linux_{platform.machine()}"
    assert wheel.name.startswith("kvfence-") and wheel.name.endswith(f"-{tag}.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/WHEEL")]
        lines = z.read(meta).decode().splitlines()
    assert [line for line in lines if line.startswith("Tag:")] == [f"Tag: {tag}"]
    assert "Root-Is-Purelib: false" in lines
    # Both modules, and no build for one Python only, which would shadow an abi3 module where it loads.
    assert {n for n in names if n.endswith(".so")} == COMPILED


def test_the_compiled_modules_need_no_newer_glibc_than_manylinux_2_28(wheel: Path, tmp_path: Path) -> None:
    """The wheel is built on this machine but runs in the GPU image, on another distribution: its
    modules may ask glibc (and, for the walk, OpenSSL 3's libcrypto) for nothing newer than the
    manylinux_2_28 baseline (glibc 2.28), which vLLM's images are well above."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils) is needed to read the modules' symbol versions"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path, members=sorted(COMPILED))
    for name in sorted(COMPILED):
        table = subprocess.run(
            [objdump, "-T", str(tmp_path / name)], capture_output=True, text=True, check=True
        )
        glibc = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_([0-9.]+)", table.stdout)}
        assert glibc and max(glibc) <= (2, 28), (name, sorted(glibc))
        others = set(re.findall(r"\b([A-Z]+)_[0-9][0-9.]*\b", table.stdout)) - {"GLIBC"}
        assert others <= {"OPENSSL"}, (name, others)


def test_a_second_cpython_is_there_to_load_the_wheel_in() -> None:
    """The point of the abi3 wheel is a Python other than the one that built it (the GPU image's is
    vLLM's): without a second CPython here, the tests below would prove nothing of the kind."""
    others = sorted(v for v in INTERPRETERS if v != sys.version_info[:2])
    assert others, (
        f"only CPython {sys.version_info[0]}.{sys.version_info[1]} found: install another CPython >= 3.11 "
        "(pyenv, or apt-get install python3.12 where the distribution has it)"
    )


@pytest.mark.parametrize("version", sorted(INTERPRETERS), ids=lambda v: f"cpython{v[0]}.{v[1]}")
def test_the_compiled_modules_load_from_the_wheel_in_a_fresh_environment(
    wheel: Path, version: tuple[int, int], tmp_path: Path
) -> None:
    python = INTERPRETERS[version]
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    vpy = str(venv / "bin" / "python")
    install = subprocess.run(
        [vpy, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    # -I: no PYTHONPATH, no user site, no current directory: only what the venv has installed.
    run = subprocess.run([vpy, "-I", "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["cpython", f"{version[0]}.{version[1]}"]
