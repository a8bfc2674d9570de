"""kvfence's own Kubernetes connection (kvfence.kube.connection): kubeconfig and in-cluster credentials
as kubectl reads them, and every field it cannot honour refused by name. Pure: files, environment and
real exec-plugin processes, no API server (tests/operator/test_kube_client.py uses these credentials
on a real one)."""

from __future__ import annotations

import base64
import json
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfence.kube import connection
from kvfence.kube.connection import ConfigError, from_kubeconfig, in_cluster


def _kubeconfig(
    path: Path,
    *,
    cluster: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
    current: str | None = "c",
    name: str = "c",
    namespace: str | None = None,
) -> Path:
    ctx: dict[str, Any] = {"cluster": name, "user": name}
    if namespace:
        ctx["namespace"] = namespace
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster or {"server": "https://10.0.0.1:6443"}}],
        "users": [{"name": name, "user": user or {}}],
        "contexts": [{"name": name, "context": ctx}],
    }
    if current:
        doc["current-context"] = current
    path.write_text(yaml.safe_dump(doc))
    return path


def _plugin(tmp_path: Path, status: dict[str, Any], *, exit_code: int = 0) -> Path:
    """A real exec credential plugin: records each run (its argv and environment) and prints ``status``."""
    script = tmp_path / "plugin.py"
    log = tmp_path / "runs.jsonl"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'info': os.environ.get('KUBERNETES_EXEC_INFO'),\n"
        "                        'extra': os.environ.get('KVF_EXTRA')}) + '\\n')\n"
        f"if {exit_code}:\n"
        "    sys.stderr.write('no credentials for you\\n')\n"
        f"    sys.exit({exit_code})\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',\n"
        f"                  'status': {status!r}}}))\n"
    )
    script.chmod(0o755)
    return script


def _runs(tmp_path: Path) -> list[dict[str, Any]]:
    log = tmp_path / "runs.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_kubeconfig_with_file_paths_resolves_them_against_its_own_directory(tmp_path: Path) -> None:
    """Relative certificate paths are relative to the kubeconfig (as kubectl reads them), and the
    client's TLS context loads them."""
    from cluster.localcluster import make_pki  # real certificates: the test cluster's own PKI

    pki = tmp_path / "conf" / "pki"
    make_pki(pki)
    path = _kubeconfig(
        tmp_path / "conf" / "kubeconfig",
        cluster={"server": "https://10.0.0.1:6443/", "certificate-authority": "pki/ca.crt"},
        user={"client-certificate": "pki/admin.crt", "client-key": "pki/admin.key"},
        namespace="team-a",
    )
    conn = from_kubeconfig(str(path))
    assert conn.server == "https://10.0.0.1:6443"  # the trailing slash dropped
    assert conn.ca_file == str(pki / "ca.crt")
    assert (conn.cert_file, conn.key_file) == (str(pki / "admin.crt"), str(pki / "admin.key"))
    assert conn.namespace == "team-a"
    assert conn.authorization() is None  # a client certificate, no header
    ctx = conn.ssl_context()
    assert ctx is not None and ctx.verify_mode.name == "CERT_REQUIRED" and ctx.check_hostname
    assert ctx.get_ca_certs()  # the cluster CA is loaded


def test_inline_data_is_written_to_files_only_this_user_can_read(tmp_path: Path) -> None:
    from cluster.localcluster import make_pki

    pki = tmp_path / "pki"
    make_pki(pki)

    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    path = _kubeconfig(
        tmp_path / "kubeconfig",
        cluster={"server": "https://10.0.0.1:6443", "certificate-authority-data": b64("ca.crt")},
        user={"client-certificate-data": b64("admin.crt"), "client-key-data": b64("admin.key")},
    )
    conn = from_kubeconfig(str(path))
    for got, name in ((conn.ca_file, "ca.crt"), (conn.cert_file, "admin.crt"), (conn.key_file, "admin.key")):
        assert got is not None
        assert Path(got).read_bytes() == (pki / name).read_bytes()
        assert stat.S_IMODE(Path(got).stat().st_mode) == 0o600
        assert stat.S_IMODE(Path(got).parent.stat().st_mode) == 0o700
    assert conn.ssl_context() is not None

    bad = _kubeconfig(
        tmp_path / "bad", cluster={"server": "https://x", "certificate-authority-data": "not base64!"}
    )
    with pytest.raises(ConfigError, match="certificate-authority-data is not base64"):
        from_kubeconfig(str(bad))


def test_kubeconfig_lists_merge_as_kubectl_merges_them(tmp_path: Path) -> None:
    """``$KUBECONFIG=a:b``: the first file to name an entry wins; the current context is the first
    one set."""
    a = _kubeconfig(tmp_path / "a", cluster={"server": "https://a:1"}, user={"token": "ta"}, current=None)
    b = _kubeconfig(tmp_path / "b", cluster={"server": "https://b:2"}, user={"token": "tb"}, current="c")
    conn = from_kubeconfig(f"{a}:{b}")
    assert conn.server == "https://a:1"
    assert conn.authorization() == "Bearer ta"
    assert from_kubeconfig(f"{b}:{a}").server == "https://b:2"
    # a missing file in the list is skipped, as kubectl skips it
    assert from_kubeconfig(f"{tmp_path / 'absent'}:{b}").server == "https://b:2"
    with pytest.raises(ConfigError, match="sets no current-context"):
        from_kubeconfig(str(a))
    assert from_kubeconfig(str(a), context="c").server == "https://a:1"
    with pytest.raises(ConfigError, match="no context named 'nope'"):
        from_kubeconfig(str(a), context="nope")
    with pytest.raises(ConfigError, match="no kubeconfig found"):
        from_kubeconfig(str(tmp_path / "absent"))


def test_tokens_basic_auth_and_skipped_verification(tmp_path: Path) -> None:
    conn = from_kubeconfig(str(_kubeconfig(tmp_path / "k1", user={"username": "u", "password": "p:w"})))
    assert conn.authorization() == "Basic " + base64.b64encode(b"u:p:w").decode()
    assert conn.headers("application/yaml") == {
        "Accept": "application/yaml",
        "Authorization": "Basic " + base64.b64encode(b"u:p:w").decode(),
    }
    insecure = from_kubeconfig(
        str(_kubeconfig(tmp_path / "k2", cluster={"server": "https://x:1", "insecure-skip-tls-verify": True}))
    )
    ctx = insecure.ssl_context()
    assert insecure.insecure and ctx is not None and not ctx.check_hostname
    assert ctx.verify_mode.name == "CERT_NONE"
    plain = from_kubeconfig(str(_kubeconfig(tmp_path / "k3", cluster={"server": "http://127.0.0.1:8080"})))
    assert plain.ssl_context() is None


def test_a_token_file_is_read_again_once_its_refresh_period_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A projected ServiceAccount token is rotated on disk while the process runs."""
    token = tmp_path / "token"
    token.write_text("one\n")
    conn = from_kubeconfig(str(_kubeconfig(tmp_path / "k", user={"tokenFile": "token"})))
    assert conn.authorization() == "Bearer one"
    token.write_text("two\n")
    assert conn.authorization() == "Bearer one"  # within the refresh period: not read again
    now = connection.time.time()
    monkeypatch.setattr(connection.time, "time", lambda: now + connection.TOKEN_FILE_REFRESH + 1)
    assert conn.authorization() == "Bearer two"
    token.unlink()
    monkeypatch.setattr(connection.time, "time", lambda: now + 2 * connection.TOKEN_FILE_REFRESH + 2)
    with pytest.raises(ConfigError, match="cannot read the token file"):
        conn.authorization()


def test_an_exec_plugin_runs_at_load_and_again_only_when_its_token_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _plugin(tmp_path, {"token": "from-plugin", "expirationTimestamp": "2030-01-01T00:00:00Z"})
    exec_spec = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": str(script),
        "args": ["get-token", "--cluster", "x"],
        "env": [{"name": "KVF_EXTRA", "value": "42"}],
        "interactiveMode": "Never",
    }
    conn = from_kubeconfig(str(_kubeconfig(tmp_path / "k", user={"exec": exec_spec})))
    assert len(_runs(tmp_path)) == 1  # at load: a plugin that fails says so at start
    assert conn.authorization() == "Bearer from-plugin"
    assert conn.authorization() == "Bearer from-plugin"
    runs = _runs(tmp_path)
    assert len(runs) == 1
    assert runs[0]["argv"] == ["get-token", "--cluster", "x"]
    assert runs[0]["extra"] == "42"
    assert json.loads(runs[0]["info"]) == {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "spec": {"interactive": False},
    }
    expiry = conn.token_expiration()
    assert expiry is not None and expiry.isoformat() == "2030-01-01T00:00:00+00:00"
    # past the expiry (less the margin): run again
    monkeypatch.setattr(connection.time, "time", lambda: expiry.timestamp() - connection.EXEC_EXPIRY_MARGIN)
    assert conn.authorization() == "Bearer from-plugin"
    assert len(_runs(tmp_path)) == 2


def test_what_an_exec_plugin_cannot_give_is_refused_by_name(tmp_path: Path) -> None:
    def load(status: dict[str, Any], exit_code: int = 0, **extra: Any) -> None:
        d = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        spec = {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(_plugin(d, status, exit_code=exit_code)),
        }
        from_kubeconfig(str(_kubeconfig(d / "k", user={"exec": {**spec, **extra}})))

    with pytest.raises(ConfigError, match="exited 3: no credentials for you"):
        load({"token": "x"}, exit_code=3)
    with pytest.raises(ConfigError, match="answered with a client certificate"):
        load({"clientCertificateData": "PEM", "clientKeyData": "PEM"})
    with pytest.raises(ConfigError, match=r"returned no status\.token"):
        load({})
    with pytest.raises(ConfigError, match="provideClusterInfo is not supported"):
        load({"token": "x"}, provideClusterInfo=True)
    with pytest.raises(
        ConfigError, match=r"apiVersion 'client\.authentication\.k8s\.io/v1alpha1' is not one of"
    ):
        load({"token": "x"}, apiVersion="client.authentication.k8s.io/v1alpha1")
    with pytest.raises(ConfigError, match=r"could not run: .*\(install it\)"):
        from_kubeconfig(
            str(
                _kubeconfig(
                    tmp_path / "missing",
                    user={"exec": {"command": str(tmp_path / "absent"), "installHint": "install it"}},
                )
            )
        )


@pytest.mark.parametrize(
    ("cluster", "user", "field"),
    [
        ({"server": "https://x", "tls-server-name": "y"}, {}, "cluster.tls-server-name"),
        ({"server": "https://x", "proxy-url": "http://p"}, {}, "cluster.proxy-url"),
        ({"server": "https://x"}, {"auth-provider": {"name": "gcp"}}, "user.auth-provider"),
        ({"server": "https://x"}, {"as": "system:admin"}, "user.as"),
        (
            {"server": "https://x"},
            {"client-certificate": "c.crt"},
            "user.client-certificate and user.client-key",
        ),
        ({"server": ""}, {}, "cluster.server is empty"),
    ],
)
def test_what_the_client_cannot_honour_is_refused_naming_the_field(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=f"kubeconfig context 'c': {field}"):
        from_kubeconfig(str(_kubeconfig(tmp_path / "k", cluster=cluster, user=user)))


def test_in_cluster_reads_the_service_account_mount(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_text("")
    (tmp_path / "namespace").write_text("kvfence-system")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    conn = in_cluster(tmp_path, env)
    assert conn.server == "https://10.96.0.1:443"
    assert conn.ca_file == str(tmp_path / "ca.crt")
    assert conn.authorization() == "Bearer sa-token"
    assert conn.namespace == "kvfence-system"
    v6 = in_cluster(tmp_path, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert v6.server == "https://[fd00::1]:443"
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster(tmp_path, {})
    with pytest.raises(ConfigError, match="does not exist"):
        in_cluster(tmp_path / "absent", env)


def test_load_prefers_an_explicit_kubeconfig_then_the_pod_then_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    monkeypatch.setattr(connection, "SERVICE_ACCOUNT_DIR", sa)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    explicit = _kubeconfig(tmp_path / "explicit", cluster={"server": "https://explicit:1"})
    default = _kubeconfig(tmp_path / "default", cluster={"server": "https://default:1"})
    monkeypatch.setenv("KUBECONFIG", str(default))
    assert connection.load(str(explicit)).server == "https://explicit:1"
    assert connection.load().server == "https://10.96.0.1:443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert connection.load().server == "https://default:1"
