"""The two source roots are the two images: the control plane (operator/: API, operator, router) uses
the engine side only through ``kvfence.contract``, and the engine image (engine-image/: contract,
engines, vLLM plugin) needs nothing of the control plane."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(root: Path) -> dict[str, set[str]]:
    """Every module each file under ``root`` imports, at any depth (a relative import counts as
    ``.``-prefixed, so no rule below can be side-stepped by one)."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
        out[str(path.relative_to(ROOT))] = names
    return out


def kvfence_imports(root: Path) -> dict[str, set[str]]:
    return {f: {n for n in mods if n.startswith("kvfence")} for f, mods in imports(root).items()}


def test_the_control_plane_reaches_the_engine_side_only_through_the_contract() -> None:
    found = kvfence_imports(ROOT / "operator" / "kvfence")
    assert found, "no control-plane sources found"
    wrong = {
        f: sorted(m for m in mods if m.startswith(("kvfence.engine", "kvfence.vllm")))
        for f, mods in found.items()
    }
    assert not {f: m for f, m in wrong.items() if m}
    assert any(m.startswith("kvfence.contract") for mods in found.values() for m in mods)


def test_the_engine_image_needs_nothing_of_the_control_plane() -> None:
    found = kvfence_imports(ROOT / "engine-image" / "kvfence")
    assert found, "no engine sources found"
    wrong = {
        f: sorted(
            m
            for m in mods
            if m.startswith(("kvfence.api", "kvfence.kube", "kvfence.operator", "kvfence.router"))
        )
        for f, mods in found.items()
    }
    assert not {f: m for f, m in wrong.items() if m}


def test_the_contract_is_self_contained() -> None:
    found = kvfence_imports(ROOT / "engine-image" / "kvfence" / "contract")
    assert {m for mods in found.values() for m in mods} <= {
        "kvfence.contract",
        "kvfence.contract.engine_config",
        "kvfence.contract.errors",
        "kvfence.contract.routing",
    }


def test_the_isolation_core_and_the_vllm_plugin_import_nothing_of_the_reference_engine() -> None:
    """Both engines enforce isolation with ``kvfence.isolation``; neither it nor the vLLM plugin
    depends on the reference engine (``kvfence.engine``), and the isolation core runs without vLLM."""
    engine_side = ROOT / "engine-image" / "kvfence"
    core = imports(engine_side / "isolation")
    plugin = imports(engine_side / "vllm")
    assert core and plugin, "no isolation-core or vLLM-plugin sources found"
    wrong = {
        f: sorted(m for m in mods if m.startswith(".") or m.split(".")[:2] == ["kvfence", "engine"])
        for f, mods in (core | plugin).items()
    }
    assert not {f: m for f, m in wrong.items() if m}
    with_vllm = {f: sorted(m for m in mods if m.split(".")[0] == "vllm") for f, mods in core.items()}
    assert not {f: m for f, m in with_vllm.items() if m}
    assert any(m.startswith("kvfence.isolation") for mods in plugin.values() for m in mods)


def test_the_api_server_is_reached_only_through_kvfence_kube() -> None:
    """The project's own client (kvfence.kube) is the one way to the Kubernetes API: the ``kubernetes``
    package is neither imported nor a dependency (kopf would import it, ~10-20 MiB, whenever it is
    installed; see docs/operator.md)."""
    import tomllib

    imported: dict[str, set[str]] = {}
    for root in ("operator", "engine-image", "bench", "e2e", "tests"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    else []
                )
                for n in names:
                    if n.split(".")[0] in ("kubernetes", "kubernetes_asyncio", "pykube"):
                        imported.setdefault(str(path.relative_to(ROOT)), set()).add(n)
    assert not imported
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [*project["dependencies"], *(d for ds in project["optional-dependencies"].values() for d in ds)]
    assert not [d for d in deps if d.split(">")[0].split("=")[0].split("[")[0].strip() == "kubernetes"]
