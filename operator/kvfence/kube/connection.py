"""Where the Kubernetes API server is and how to authenticate to it.

:func:`load` is what every component calls: with an explicit kubeconfig it reads that; else, inside a
pod, the ServiceAccount's mounted credentials (:func:`in_cluster`); else ``$KUBECONFIG`` (a
``:``-separated list, merged as kubectl merges it: the first file to name an entry wins) or
``~/.kube/config`` (:func:`from_kubeconfig`).

A kubeconfig may give the cluster's CA, a client certificate and key (as files or as inline data,
which are written to a private temporary directory, since Python's TLS loads certificates only from
files), a bearer token or a ``tokenFile``, a user name and password, or an ``exec`` credential plugin
(``client.authentication.k8s.io`` ExecCredential; its token is kept until its expiry and the plugin
run again then). What this client cannot honour is refused with a :class:`ConfigError` that names the
field: ``auth-provider`` (the removed in-tree GCP/Azure/OIDC plugins), an exec plugin that answers
with a client certificate, ``tls-server-name``, ``proxy-url``, impersonation.

Tokens read from files (in-cluster, ``tokenFile``) are read again a minute after the last read: a
projected ServiceAccount token is rotated by the kubelet while the process runs.
"""

from __future__ import annotations

import atexit
import base64
import datetime as dt
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: Where a pod finds its ServiceAccount's token, CA and namespace.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: Seconds a token read from a file is used before the file is read again.
TOKEN_FILE_REFRESH = 60.0
#: Seconds before an exec plugin's token expires at which the plugin is run again.
EXEC_EXPIRY_MARGIN = 30.0
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")


class ConfigError(Exception):
    """The credentials cannot be found or cannot be used (the message names the field)."""


class _Token:
    """A bearer token: fixed, read from a file (again every :data:`TOKEN_FILE_REFRESH` s), or from
    an exec plugin (again before it expires)."""

    def __init__(
        self,
        *,
        value: str | None = None,
        path: str | None = None,
        exec_spec: Mapping[str, Any] | None = None,
        base_dir: Path | None = None,
    ) -> None:
        self._value, self._path, self._exec = value, path, exec_spec
        self._base_dir = base_dir or Path.cwd()
        self._expires = float("inf") if value is not None else 0.0
        self._expiration: dt.datetime | None = None
        self._lock = threading.Lock()

    def get(self) -> str:
        with self._lock:
            if self._value is None or time.time() >= self._expires:
                self._refresh()
            assert self._value is not None
            return self._value

    @property
    def expiration(self) -> dt.datetime | None:
        """When an exec plugin's token expires (None for the other kinds)."""
        self.get()
        return self._expiration

    def _refresh(self) -> None:
        if self._path is not None:
            try:
                self._value = Path(self._path).read_text().strip()
            except OSError as e:
                raise ConfigError(f"cannot read the token file {self._path}: {e}") from None
            self._expires = time.time() + TOKEN_FILE_REFRESH
        elif self._exec is not None:
            self._value, self._expiration = run_exec_plugin(self._exec, self._base_dir)
            self._expires = (
                self._expiration.timestamp() - EXEC_EXPIRY_MARGIN if self._expiration else float("inf")
            )


@dataclass
class Connection:
    """One API server and the credentials to use with it."""

    server: str  # scheme://host:port, no trailing slash
    ca_file: str | None = None
    insecure: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = None
    token: _Token | None = field(default=None, repr=False)
    namespace: str | None = None  # the context's (or the pod's) namespace, when given

    def authorization(self) -> str | None:
        """The ``Authorization`` header's value, or None (client certificates only)."""
        if self.token is not None:
            return f"Bearer {self.token.get()}"
        if self.username is not None and self.password is not None:
            return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        return None

    def headers(self, accept: str = "application/json") -> dict[str, str]:
        out = {"Accept": accept}
        auth = self.authorization()
        if auth:
            out["Authorization"] = auth
        return out

    @property
    def tls(self) -> bool:
        return self.server.startswith("https:")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for this server (None for plain http)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def token_expiration(self) -> dt.datetime | None:
        return self.token.expiration if self.token is not None else None


# --- loading ---------------------------------------------------------------------------------------
def load(kubeconfig: str | None = None) -> Connection:
    """The explicit ``kubeconfig`` if given; else in-cluster when running in a pod; else the default
    kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``)."""
    if kubeconfig:
        return from_kubeconfig(kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT_DIR / "token").exists():
        return in_cluster()
    return from_kubeconfig()


def in_cluster(sa_dir: Path | None = None, environ: Mapping[str, str] | None = None) -> Connection:
    """The pod's ServiceAccount: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the mounted token, CA and
    namespace (in ``sa_dir``, default :data:`SERVICE_ACCOUNT_DIR`)."""
    env = os.environ if environ is None else environ
    sa_dir = sa_dir or SERVICE_ACCOUNT_DIR
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ConfigError("not in a cluster: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are unset")
    if not (sa_dir / "token").exists():
        raise ConfigError(f"not in a cluster: {sa_dir / 'token'} does not exist")
    if ":" in host:
        host = f"[{host}]"
    ns = sa_dir / "namespace"
    return Connection(
        server=f"https://{host}:{port}",
        ca_file=str(sa_dir / "ca.crt"),
        token=_Token(path=str(sa_dir / "token")),
        namespace=ns.read_text().strip() if ns.exists() else None,
    )


def from_kubeconfig(paths: str | None = None, context: str | None = None) -> Connection:
    """The current (or the named) context of a kubeconfig: ``paths`` is one file or a ``:``-separated
    list (default ``$KUBECONFIG``, else ``~/.kube/config``)."""
    spec = paths or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    files = [Path(p).expanduser() for p in spec.split(os.pathsep) if p]
    docs: list[tuple[Path, dict[str, Any]]] = []
    for f in files:
        try:
            doc = yaml.safe_load(f.read_text()) or {}
        except FileNotFoundError:
            continue
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read the kubeconfig {f}: {e}") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"the kubeconfig {f} is not a mapping")
        docs.append((f.resolve().parent, doc))
    if not docs:
        raise ConfigError(f"no kubeconfig found at {spec} (and not running in a cluster)")

    def entry(section: str, name: str) -> tuple[Path, dict[str, Any]]:
        for base, doc in docs:  # the first file to name it wins, as kubectl merges
            for item in doc.get(section) or ():
                if isinstance(item, dict) and item.get("name") == name:
                    body = item.get(section[:-1])
                    return base, body if isinstance(body, dict) else {}
        raise ConfigError(f"the kubeconfig has no {section[:-1]} named {name!r}")

    ctx_name = context or next((d["current-context"] for _, d in docs if d.get("current-context")), None)
    if not ctx_name:
        raise ConfigError(f"the kubeconfig {spec} sets no current-context")
    _, ctx = entry("contexts", ctx_name)
    if not ctx.get("cluster"):
        raise ConfigError(f"context {ctx_name!r} names no cluster")
    cluster_dir, cluster = entry("clusters", ctx["cluster"])
    user_dir, user = entry("users", ctx["user"]) if ctx.get("user") else (cluster_dir, {})
    return _connection(ctx_name, cluster_dir, cluster, user_dir, user, ctx.get("namespace"))


def _connection(
    ctx_name: str,
    cluster_dir: Path,
    cluster: Mapping[str, Any],
    user_dir: Path,
    user: Mapping[str, Any],
    namespace: str | None,
) -> Connection:
    where = f"kubeconfig context {ctx_name!r}"
    for key in ("tls-server-name", "proxy-url"):
        if cluster.get(key):
            raise ConfigError(f"{where}: cluster.{key} is not supported by kvfence's client")
    for key in ("auth-provider", "as", "as-uid", "as-groups", "as-user-extra"):
        if user.get(key):
            hint = " (use an exec credential plugin instead)" if key == "auth-provider" else ""
            raise ConfigError(f"{where}: user.{key} is not supported by kvfence's client{hint}")
    server = str(cluster.get("server") or "").rstrip("/")
    if not server:
        raise ConfigError(f"{where}: cluster.server is empty")
    conn = Connection(
        server=server,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        namespace=namespace,
        ca_file=_file(cluster, "certificate-authority", cluster_dir),
        cert_file=_file(user, "client-certificate", user_dir),
        key_file=_file(user, "client-key", user_dir),
    )
    if bool(conn.cert_file) != bool(conn.key_file):
        raise ConfigError(f"{where}: user.client-certificate and user.client-key go together")
    if user.get("token"):
        conn.token = _Token(value=str(user["token"]))
    elif user.get("tokenFile"):
        conn.token = _Token(path=str(_resolve(str(user["tokenFile"]), user_dir)))
    elif user.get("exec"):
        conn.token = _Token(exec_spec=user["exec"], base_dir=user_dir)
        conn.token.get()  # run it now: a plugin that fails says so at start, not at the first request
    elif user.get("username") is not None:
        conn.username, conn.password = str(user["username"]), str(user.get("password", ""))
    return conn


def _resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


_private_dir: str | None = None
_private_lock = threading.Lock()


def _write_private(data: bytes, suffix: str) -> str:
    """``data`` in a file only this process's user can read, removed at exit."""
    global _private_dir
    with _private_lock:
        if _private_dir is None:
            _private_dir = tempfile.mkdtemp(prefix="kvfence-kube-")  # mode 0700
            atexit.register(shutil.rmtree, _private_dir, True)
    fd, path = tempfile.mkstemp(dir=_private_dir, suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _file(section: Mapping[str, Any], key: str, base: Path) -> str | None:
    """The path of ``key`` (a file) or of ``key-data`` (base64, written to a private file)."""
    data = section.get(f"{key}-data")
    if data:
        try:
            raw = base64.b64decode(str(data), validate=True)
        except ValueError:
            raise ConfigError(f"{key}-data is not base64") from None
        return _write_private(raw, ".pem")
    path = section.get(key)
    return str(_resolve(str(path), base)) if path else None


# --- exec credential plugins ----------------------------------------------------------------------
def run_exec_plugin(spec: Mapping[str, Any], base_dir: Path) -> tuple[str, dt.datetime | None]:
    """Run a ``client.authentication.k8s.io`` exec plugin (non-interactively) and return its token
    and the token's expiry."""
    command = spec.get("command")
    api_version = spec.get("apiVersion") or EXEC_API_VERSIONS[0]
    if not command:
        raise ConfigError("user.exec.command is empty")
    if api_version not in EXEC_API_VERSIONS:
        known = ", ".join(EXEC_API_VERSIONS)
        raise ConfigError(f"user.exec.apiVersion {api_version!r} is not one of {known}")
    if spec.get("provideClusterInfo"):
        raise ConfigError("user.exec.provideClusterInfo is not supported by kvfence's client")
    cmd = str(command)
    if os.sep in cmd and not os.path.isabs(cmd):
        cmd = str(base_dir / cmd)  # a relative path is relative to the kubeconfig, as kubectl reads it
    env = dict(os.environ)
    for item in spec.get("env") or ():
        env[str(item["name"])] = str(item["value"])
    env["KUBERNETES_EXEC_INFO"] = json.dumps(
        {"apiVersion": api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
    )
    try:
        proc = subprocess.run(
            [cmd, *map(str, spec.get("args") or ())],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        hint = f" ({spec['installHint']})" if spec.get("installHint") else ""
        raise ConfigError(f"exec credential plugin {cmd!r} could not run: {e}{hint}") from None
    if proc.returncode != 0:
        raise ConfigError(
            f"exec credential plugin {cmd!r} exited {proc.returncode}: "
            f"{proc.stderr.decode(errors='replace').strip()[-500:]}"
        )
    try:
        status = json.loads(proc.stdout)["status"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"exec credential plugin {cmd!r} did not print an ExecCredential") from None
    if status.get("clientCertificateData"):
        raise ConfigError(
            f"exec credential plugin {cmd!r} answered with a client certificate; kvfence's client "
            "takes tokens from exec plugins only"
        )
    token = status.get("token")
    if not token:
        raise ConfigError(f"exec credential plugin {cmd!r} returned no status.token")
    expiry = status.get("expirationTimestamp")
    when = dt.datetime.fromisoformat(str(expiry).replace("Z", "+00:00")) if expiry else None
    return str(token), when
