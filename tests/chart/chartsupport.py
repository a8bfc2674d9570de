"""Helpers for the chart tests: the pinned helm binary, rendering, and picking objects out."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from cluster.localcluster import default_bin_dir

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfence"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.34.0"
NAMESPACE = "kvfence-system"

Obj = dict[str, Any]


def bin_dir() -> Path:
    return default_bin_dir()


def helm_bin() -> Path:
    h = bin_dir() / "helm"
    if not h.exists():
        # The chart tests need the helm built by `make components`: a missing binary is a failure.
        raise AssertionError(f"{h} is missing: run `make components`")
    return h


def helm(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([str(helm_bin()), *args], capture_output=True, text=True, env=env, timeout=300)
    if check and res.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({res.returncode}):\n{res.stderr}")
    return res


def render_raw(
    values: Sequence[Path] = (), sets: Sequence[str] = (), release: str = "kvfence", check: bool = True
) -> subprocess.CompletedProcess[str]:
    args = ["template", release, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return helm(*args, check=check)


def render(values: Sequence[Path] = (), sets: Sequence[str] = (), release: str = "kvfence") -> list[Obj]:
    out = render_raw(values, sets, release).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(objs: Iterable[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: Iterable[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(deploy: Obj) -> Obj:
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def flag(c: Obj, name: str) -> list[str]:
    """Values of ``--name=value`` in a container's args (repeatable flags give several)."""
    prefix = f"--{name}="
    return [a[len(prefix) :] for a in c.get("args", []) if a.startswith(prefix)]


def normalize_rules(rules: Iterable[Obj]) -> list[tuple[Any, ...]]:
    """RBAC rules as comparable tuples (one per apiGroup/resource/verb/resourceName combination)."""
    out = set()
    for r in rules:
        for g in r.get("apiGroups", []):
            for res in r.get("resources", []):
                for verb in r.get("verbs", []):
                    for rn in r.get("resourceNames") or [None]:
                        out.add((g, res, verb, rn))
    return sorted(out, key=repr)
