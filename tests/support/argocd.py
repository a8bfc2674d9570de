"""The chart's Argo CD health checks (charts/kvfence/files/argocd), run by a real Lua runtime of the
dialect Argo CD runs them in: Argo CD embeds gopher-lua, a Lua 5.1, so the scripts run under Lua 5.1
(a 5.2+ construct such as ``goto`` or integer division fails here as it would there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51 as lua51

ARGOCD = Path(__file__).resolve().parents[2] / "charts" / "kvfence" / "files" / "argocd"


def argocd_health(kind: str, obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) of the chart's Argo CD health check of ``kind`` for ``obj``, the way Argo CD
    runs it: the script's body with the object as the global ``obj``."""
    rt = lua51.LuaRuntime(unpack_returned_tuples=True)
    rt.globals().obj = _to_lua(rt, obj)
    script = (ARGOCD / f"health-{kind}.lua").read_text()
    hs = rt.execute(script)
    return str(hs["status"]), str(hs["message"] or "")


def _to_lua(rt: Any, v: Any) -> Any:
    if isinstance(v, dict):
        return rt.table_from({k: _to_lua(rt, x) for k, x in v.items()})
    if isinstance(v, list):
        return rt.table_from([_to_lua(rt, x) for x in v])
    return v
