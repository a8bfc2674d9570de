"""The operator's API client on the real API server: paginated lists, reads from the watch cache."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kvfence.kube import connection
from kvfence.operator.apply import Kube
from kvfence.operator.builders import SIGNING_SECRET_NAME
from kvfence.operator.watchcache import WatchCache

pytestmark = pytest.mark.cluster


def test_list_reads_every_page_and_drops_managed_fields(cluster: Any) -> None:
    """A list read a few objects at a time returns every object once, in the server's order, without
    managedFields (which server-side apply wrote on each); a GET still has them; a label selector
    applies on every page."""
    kube = Kube(connection.load(str(cluster.kubeconfig)))
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


def test_get_reads_the_watch_cache_only_once_it_holds_what_the_client_has_seen(cluster: Any) -> None:
    """With a watch cache, a GET of a held object is answered from memory once the watch delivered
    the version the client's own requests returned; a write the watch has not delivered yet, and any
    object the cache does not hold, is read from the API server."""
    cache = WatchCache()
    kube = Kube(connection.load(str(cluster.kubeconfig)), cache=cache)
    ns = "kube-client-cache"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

    def secret(value: str, name: str = SIGNING_SECRET_NAME) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": ns},
            "data": {"k": base64.b64encode(value.encode()).decode()},
        }

    def gets() -> int:
        return kube.requests["GET"]

    first = kube.apply(secret("one"))
    before = gets()
    assert kube.get("v1", "Secret", SIGNING_SECRET_NAME, ns) is not None
    assert gets() == before + 1  # nothing delivered yet: read from the API server
    cache.event(("Secret", ns, SIGNING_SECRET_NAME), first)  # the watch delivers the apply
    got = kube.get("v1", "Secret", SIGNING_SECRET_NAME, ns)
    assert gets() == before + 1  # from memory
    assert got is not None and got["data"] == first["data"]
    assert "managedFields" not in got["metadata"]
    assert got["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]

    second = kube.apply(secret("two"))  # the client's own write: the cached body is older now
    got = kube.get("v1", "Secret", SIGNING_SECRET_NAME, ns)
    assert gets() == before + 2
    assert got is not None and got["data"] == second["data"]
    cache.event(("Secret", ns, SIGNING_SECRET_NAME), second)
    assert kube.get("v1", "Secret", SIGNING_SECRET_NAME, ns) is not None
    assert gets() == before + 2

    other = kube.apply(secret("key", name="acme-keys"))  # an API key: never held
    cache.event(("Secret", ns, "acme-keys"), other)
    assert kube.get("v1", "Secret", "acme-keys", ns) is not None
    assert gets() == before + 3


def test_every_kind_of_credential_authenticates_on_the_real_api_server(cluster: Any, tmp_path: Any) -> None:
    """A ServiceAccount token reaches the API server as that account whether it comes inline, from a
    token file, from an exec plugin or from a pod's mount (in-cluster), on the blocking client and on
    the asynchronous one; an account with no role is refused as itself (403 naming it), which proves
    the token was sent and accepted."""
    import asyncio
    import sys
    from pathlib import Path
    from urllib.parse import urlsplit

    import yaml

    from kvfence.kube.watch import ApiError, AsyncApi
    from kvfence.operator.apply import KubeError

    ns = "kube-client-creds"
    admin = Kube(connection.load(str(cluster.kubeconfig)))
    admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", ns)
    token = cluster.kubectl("create", "token", "nobody", "-n", ns, "--duration=1h").stdout.strip()
    user = f"system:serviceaccount:{ns}:nobody"
    ca = str(Path(cluster.pki) / "ca.crt")
    d = Path(tmp_path)
    (d / "token").write_text(token)
    plugin = d / "plugin.py"
    plugin.write_text(
        f"#!{sys.executable}\nimport json\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',"
        f" 'status': {{'token': {token!r}}}}}))\n"
    )
    plugin.chmod(0o755)

    def kubeconfig(name: str, user_entry: dict[str, Any]) -> str:
        path = d / name
        path.write_text(
            yaml.safe_dump(
                {
                    "clusters": [
                        {"name": "k", "cluster": {"server": cluster.server, "certificate-authority": ca}}
                    ],
                    "users": [{"name": "u", "user": user_entry}],
                    "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
                    "current-context": "k",
                }
            )
        )
        return str(path)

    sa = d / "sa"
    sa.mkdir()
    (sa / "token").write_text(token)
    (sa / "ca.crt").write_text(Path(ca).read_text())
    (sa / "namespace").write_text(ns)
    url = urlsplit(cluster.server)
    conns = {
        "token": connection.load(kubeconfig("inline", {"token": token})),
        "tokenFile": connection.load(kubeconfig("file", {"tokenFile": "token"})),
        "exec": connection.load(
            kubeconfig(
                "exec", {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "./plugin.py"}}
            )
        ),
        "in-cluster": connection.in_cluster(
            sa, {"KUBERNETES_SERVICE_HOST": str(url.hostname), "KUBERNETES_SERVICE_PORT": str(url.port)}
        ),
    }
    for how, conn in conns.items():
        with pytest.raises(KubeError) as refused:
            Kube(conn).list("v1", "ConfigMap", ns)
        assert refused.value.status == 403, how
        assert user in str(refused.value), how

        async def list_async(conn: connection.Connection = conn) -> None:
            api = AsyncApi(conn)
            try:
                await api.list(f"/api/v1/namespaces/{ns}/configmaps", {})
            finally:
                await api.close()

        with pytest.raises(ApiError) as refused_async:
            asyncio.run(list_async())
        assert refused_async.value.status == 403, how
        assert user in str(refused_async.value), how

    # a wrong token is not that user: 401
    with pytest.raises(KubeError) as unauthorized:
        Kube(connection.load(kubeconfig("wrong", {"token": "not-a-token"}))).list("v1", "ConfigMap", ns)
    assert unauthorized.value.status == 401
    # and the admin's client certificate is the admin: allowed
    assert isinstance(admin.list("v1", "ConfigMap", ns), list)
