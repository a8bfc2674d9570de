"""One vLLM release everywhere: ``engine-image/vllm.env`` pins it (the CPU install the vLLM tests run
against, tests/vllm/install-vllm.sh, reads it), and every ``vllm/vllm-openai:<tag>`` the project ships
or tells users to pull must be that release: the GPU image's base (engine-image/Dockerfile.vllm, ARG
VLLM_IMAGE), build-images.sh's default, examples, the chart, the docs and the operator's sources.

Plain text checks: runs in the project's venv, needs no vLLM. (test_vllm_args.py checks that the
vLLM it runs against is this release too.)
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_ENV = ROOT / "engine-image" / "vllm.env"
DOCKERFILE = ROOT / "engine-image" / "Dockerfile.vllm"
#: Where a ``vllm/vllm-openai:`` reference names the release users get.
SCANNED = ("examples", "charts", "docs", "operator", "engine-image", "README.md")
#: A Docker tag (``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``); a placeholder such as ``<tag>`` is no tag.
IMAGE_REF = re.compile(r"vllm/vllm-openai:([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})")


def pins() -> dict[str, str]:
    out = {}
    for line in VLLM_ENV.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{VLLM_ENV}: not KEY=VALUE: {line!r}"
        out[key] = value.strip().strip("'\"")
    return out


def expected_tag() -> str:
    version = pins()["VLLM_VERSION"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"VLLM_VERSION={version!r} is not a release"
    return f"v{version}"


def text_files(top: Path) -> list[Path]:
    if top.is_file():
        return [top]
    return sorted(
        p
        for p in top.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".tgz", ".tar"))
    )


def references() -> list[tuple[str, int, str]]:
    """(file, line, tag) of every ``vllm/vllm-openai:<tag>`` in the scanned trees."""
    out = []
    for name in SCANNED:
        for path in text_files(ROOT / name):
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for m in IMAGE_REF.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                out.append((str(path.relative_to(ROOT)), line, m.group(1)))
    return out


def test_vllm_env_pins_a_vllm_release_and_its_torch() -> None:
    p = pins()
    assert expected_tag().startswith("v")
    assert re.fullmatch(r"\d+\.\d+\.\d+", p.get("VLLM_TORCH_VERSION", "")), p


def test_the_gpu_images_base_is_the_pinned_release() -> None:
    args = re.findall(r"^ARG\s+VLLM_IMAGE=(\S+)\s*$", DOCKERFILE.read_text(), re.MULTILINE)
    assert len(args) == 1, f"{DOCKERFILE}: expected one `ARG VLLM_IMAGE=...`, found {args}"
    image = args[0]
    m = IMAGE_REF.fullmatch(image.split("@", 1)[0])
    assert m, f"{DOCKERFILE}: ARG VLLM_IMAGE={image} is not a vllm/vllm-openai:<tag> image"
    assert m.group(1) == expected_tag(), (
        f"{DOCKERFILE}: ARG VLLM_IMAGE={image}, but {VLLM_ENV.relative_to(ROOT)} pins "
        f"VLLM_VERSION={pins()['VLLM_VERSION']} (tag {expected_tag()}): the GPU image and the tests "
        "must run the same vLLM release"
    )


def test_every_vllm_openai_image_reference_is_the_pinned_release() -> None:
    refs = references()
    # The scan finds what it is meant to find: at least the Dockerfile's base.
    assert any(f == str(DOCKERFILE.relative_to(ROOT)) for f, _, _ in refs), refs
    wrong = [f"{f}:{line}: vllm/vllm-openai:{tag}" for f, line, tag in refs if tag != expected_tag()]
    assert not wrong, (
        f"{VLLM_ENV.relative_to(ROOT)} pins vLLM {pins()['VLLM_VERSION']}; these name another release "
        f"(use vllm/vllm-openai:{expected_tag()}):\n" + "\n".join(wrong)
    )


def test_the_reference_check_catches_another_release() -> None:
    # The regex reads tags as they are written in the files it scans (and ignores placeholders).
    sample = (
        "ARG VLLM_IMAGE=vllm/vllm-openai:v0.1.0\n"
        "image: vllm/vllm-openai:latest\n"
        "VLLM_IMAGE=vllm/vllm-openai:v9.9.9@sha256:abc\n"
        "pull `vllm/vllm-openai:<tag>` or `vllm/vllm-openai`\n"
    )
    assert [m.group(1) for m in IMAGE_REF.finditer(sample)] == ["v0.1.0", "latest", "v9.9.9"]
