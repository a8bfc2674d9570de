"""The operator's API client on the real API server: paginated lists."""

from __future__ import annotations

from typing import Any

import pytest

from kvfence.operator.apply import Kube, load_api_client

pytestmark = pytest.mark.cluster


def test_list_reads_every_page_and_drops_managed_fields(cluster: Any) -> None:
    """A list read a few objects at a time returns every object once, in the server's order, without
    managedFields (which server-side apply wrote on each); a GET still has them; a label selector
    applies on every page."""
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    ns = "kube-client-list"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    names = [f"cm-{i:02d}" for i in range(7)]
    for i, name in enumerate(names):
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": ns, "labels": {"odd": str(i % 2)}},
                "data": {"i": str(i)},
            }
        )
    before = kube.requests["GET"]
    items = kube.list("v1", "ConfigMap", ns, page=2)
    got = [o["metadata"]["name"] for o in items if o["metadata"]["name"].startswith("cm-")]
    assert got == names
    assert kube.requests["GET"] - before >= 4  # 7+ objects, 2 a page: at least four pages
    assert all("managedFields" not in o["metadata"] for o in items)
    assert [o["data"]["i"] for o in items if o["metadata"]["name"].startswith("cm-")] == [
        str(i) for i in range(7)
    ]
    live = kube.get("v1", "ConfigMap", "cm-00", ns)
    assert live is not None and live["metadata"]["managedFields"]
    odd = kube.list("v1", "ConfigMap", ns, label_selector="odd=1", page=1)
    assert [o["metadata"]["name"] for o in odd] == ["cm-01", "cm-03", "cm-05"]
    # each() maps every object of every page as it arrives: what the list returns is what it kept
    seen: list[str] = []

    def keep_name(o: dict[str, Any]) -> dict[str, Any]:
        seen.append(o["metadata"]["name"])
        assert "managedFields" not in o["metadata"]
        return {"name": o["metadata"]["name"]}

    kept = kube.list("v1", "ConfigMap", ns, page=3, each=keep_name)
    assert [k["name"] for k in kept if k["name"].startswith("cm-")] == names
    assert [k["name"] for k in kept] == seen
