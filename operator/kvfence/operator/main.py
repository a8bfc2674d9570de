"""``kvfence-operator``: run the kopf operator with leader election, health and metrics endpoints
(:mod:`kvfence.operator.health`) and JSON logs.

    kvfence-operator [--kubeconfig PATH] [--router-namespace kvfence-system] [--health-port 8080]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import faulthandler
import functools
import logging
import os
import signal
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import kopf

from kvfence.api.common import API_VERSION
from kvfence.kube import connection
from kvfence.operator import (
    handlers,  # noqa: F401 - registers the kopf handlers
    kopf_settings,
    metrics,
)
from kvfence.operator.apply import RESOURCES, Kube
from kvfence.operator.builders import (
    DEFAULT_KEY_PROPAGATION_SECONDS,
    TENANT_SECRETS_ROLE,
    OperatorOptions,
    parse_labels,
)
from kvfence.operator.events import EventRecorder
from kvfence.operator.health import Health, serve_health
from kvfence.operator.leader import LeaderElector
from kvfence.operator.reconciler import Reconciler
from kvfence.operator.watchcache import WatchCache
from kvfence.operator.workqueue import Controller

log = logging.getLogger("kvfence.operator")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json

        out: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for attr in ("k8s_ref",):
            if hasattr(record, attr):
                out[attr] = getattr(record, attr)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("urllib3", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not verbose:
        # kopf logs every successful handler call; ours only enqueue keys.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfence-operator", description="The kvfence operator.")
    p.add_argument(
        "--kubeconfig", default=os.environ.get("KUBECONFIG"), help="kubeconfig (default: in-cluster)"
    )
    p.add_argument("--router-namespace", default="kvfence-system", help="where the routing table Secret goes")
    p.add_argument(
        "--router-pod-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="labels of the router pods the engines' NetworkPolicy admits (repeatable; default "
        "app.kubernetes.io/name=kvfence, app.kubernetes.io/component=router)",
    )
    p.add_argument(
        "--metrics-scraper-namespace-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="opt-in: the engines' NetworkPolicy also admits a metrics scraper (Prometheus) from the "
        "namespaces with these labels, to the engines' metrics port only (repeatable; e.g. "
        "kubernetes.io/metadata.name=monitoring). Default: no scraper is admitted",
    )
    p.add_argument(
        "--metrics-scraper-pod-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --metrics-scraper-namespace-label: only the scraper's pods with these labels "
        "(repeatable; default: every pod of those namespaces)",
    )
    p.add_argument("--cluster-domain", default="cluster.local")
    p.add_argument(
        "--signing-key-propagation-seconds",
        type=float,
        default=DEFAULT_KEY_PROPAGATION_SECONDS,
        help="after a signing-key rotation, how long the router keeps signing with the previous key: at "
        "least the kubelet's refresh of a mounted Secret (its syncFrequency plus the Secret cache TTL; "
        "60 s + 60 s by default) plus a second for the engines' reload",
    )
    p.add_argument(
        "--tenant-secrets-role",
        default=TENANT_SECRETS_ROLE,
        help="the ClusterRole a namespace binds to let the operator read its Secrets (named in the "
        "conditions that ask for that grant)",
    )
    _runtime_arguments(p)
    return p


def _runtime_arguments(p: argparse.ArgumentParser) -> None:
    """Health endpoint, leader election, work queue and logging."""
    p.add_argument("--health-port", type=int, default=8080, help="/healthz, /readyz, /metrics (0: off)")
    p.add_argument("--health-host", default="0.0.0.0")  # noqa: S104 - a pod listens on its own IP
    p.add_argument(
        "--liveness",
        metavar="URL",
        help="kopf-style spelling of the health endpoint, e.g. http://0.0.0.0:8080/healthz "
        "(sets --health-host and --health-port; /readyz and /metrics are served there too)",
    )
    p.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "kvfence-system"))
    p.add_argument("--lease-name", default="kvfence-operator")
    p.add_argument("--lease-seconds", type=int, default=15)
    p.add_argument("--identity", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--resync-seconds", type=float, default=300.0)
    p.add_argument("--log-format", choices=["json", "text"], default="json")
    p.add_argument("--verbose", action="store_true")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser()
    args = p.parse_args(argv)
    try:
        args.router_labels = parse_labels(args.router_pod_label)
        args.scraper_namespace_labels = parse_labels(args.metrics_scraper_namespace_label)
        args.scraper_pod_labels = parse_labels(args.metrics_scraper_pod_label)
    except ValueError as e:
        p.error(str(e))
    if args.signing_key_propagation_seconds < 0:
        p.error("--signing-key-propagation-seconds must be >= 0")
    if args.scraper_pod_labels and not args.scraper_namespace_labels:
        p.error("--metrics-scraper-pod-label needs --metrics-scraper-namespace-label")
    if args.liveness:
        url = urllib.parse.urlsplit(args.liveness)
        if url.scheme != "http" or not url.port:
            p.error("--liveness must look like http://HOST:PORT/healthz")
        args.health_host, args.health_port = url.hostname or "0.0.0.0", url.port  # noqa: S104
    return args


#: the custom resources the handlers watch (the built-in ones are served as soon as the API server is)
WATCHED_CUSTOM = tuple(r.plural for (av, _), r in RESOURCES.items() if av == API_VERSION)


def wait_until_served(kube: Kube, stop: threading.Event, interval: float = 1.0) -> bool:
    """Until the API server's discovery lists :data:`WATCHED_CUSTOM` (True), or ``stop`` is set (False).

    kopf discovers the resources it watches once per run (``settings.scanning.disabled``: no CRD
    watch), so a leadership term begun while an API server that has just restarted does not serve the
    CRDs' group yet would watch nothing for the whole term. Each term waits for them first."""
    path = f"/apis/{API_VERSION}"
    told = False
    while not stop.is_set():
        try:
            doc = kube.request("GET", path)
            served = {r.get("name") for r in (doc or {}).get("resources", [])}
            missing = sorted(set(WATCHED_CUSTOM) - served)
            why = f"not yet served: {', '.join(missing)}"
        except Exception as e:  # unreachable, 404 while the group is not served, ...: wait
            missing, why = list(WATCHED_CUSTOM), (str(e).splitlines() or [type(e).__name__])[0][:200]
        if not missing:
            if told:
                log.info("the API server serves %s: reconciling", path)
            return True
        if not told:
            log.info("waiting for the API server to serve %s (%s)", path, why)
            told = True
        stop.wait(interval)
    return False


def operator_options(args: argparse.Namespace) -> OperatorOptions:
    opts = OperatorOptions(
        router_namespace=args.router_namespace,
        cluster_domain=args.cluster_domain,
        metrics_scraper_namespace_labels=args.scraper_namespace_labels,
        metrics_scraper_pod_labels=args.scraper_pod_labels,
        signing_key_propagation_seconds=args.signing_key_propagation_seconds,
        tenant_secrets_role=args.tenant_secrets_role,
    )
    if args.router_labels:
        opts = dataclasses.replace(opts, router_pod_labels=args.router_labels)
    if opts.metrics_scraper_namespace_labels:
        log.info(
            "engines admit a metrics scraper: namespaces %s, pods %s",
            opts.metrics_scraper_namespace_labels,
            opts.metrics_scraper_pod_labels or "(any)",
        )
    return opts


def leader_elector(args: argparse.Namespace, conn: connection.Connection) -> LeaderElector | None:
    if not args.leader_elect:
        return None
    lease_kube = Kube(conn, on_request=lambda v, _: metrics.LEASE_REQUESTS.labels(v).inc())
    return LeaderElector(
        lease_kube,
        args.lease_namespace,
        args.lease_name,
        args.identity,
        lease_seconds=args.lease_seconds,
        renew_seconds=max(1.0, args.lease_seconds / 3),
    )


def beat_while_kopf_runs(health: Health, current: dict[str, Reconciler]) -> None:
    """kopf ticks ``health``'s heartbeat from its event loop while it runs; ready once the reconciler
    of the term (``current``) has made its first routing decision."""
    beats: list[asyncio.Task[None]] = []

    def routing_ready() -> bool:
        r = current.get("reconciler")
        return r is not None and r.state.routing_ready.is_set()

    @kopf.on.startup()
    async def _start_heartbeat(**_: Any) -> None:
        beats.append(asyncio.get_running_loop().create_task(health.beat(routing_ready)))

    @kopf.on.cleanup()
    async def _stop_heartbeat(**_: Any) -> None:
        for t in beats:
            t.cancel()
        beats.clear()


def lead(
    args: argparse.Namespace,
    conn: connection.Connection,
    kube: Kube,
    opts: OperatorOptions,
    health: Health,
    current: dict[str, Reconciler],
    stop: threading.Event,
) -> None:
    """One term of leadership: a fresh reconciler and work queue, run by kopf until ``stop`` is set."""
    health.leading.set()
    metrics.LEADER.set(1)
    reconciler = Reconciler(kube, opts, emit=EventRecorder(kube, args.identity))
    current["reconciler"] = reconciler
    controller = Controller(
        reconciler,
        workers=args.workers,
        resync_seconds=args.resync_seconds,
        on_stop=stop.set,
        secrets_conn=conn,
    )
    try:
        if wait_until_served(kube, stop):
            kopf.run(
                clusterwide=True,
                standalone=True,
                stop_flag=stop,
                memo=kopf.Memo(controller=controller),
                memories=kopf_settings.EventOnlyMemories(),
            )
    finally:
        stop.set()
        metrics.LEADER.set(0)
        health.ready.clear()
        health.leading.clear()
        current.pop("reconciler", None)


def run_terms(elector: LeaderElector | None, lead_term: Callable[[threading.Event], None]) -> None:
    """One term of leadership per iteration. Losing the lease (another replica took it, or the API
    server could not be reached to renew it in time) stops reconciling at once and goes back to
    waiting for the lease; only SIGTERM (or SIGINT) ends the loop."""
    terminated = threading.Event()
    while not terminated.is_set():
        # Stops kopf, the lease renewal and a wait for the lease. kopf waits for a threading.Event
        # in an executor thread, so it is also set when kopf stops on its own: see Controller.stop.
        stop = threading.Event()
        lost = threading.Event()

        def _terminate(*_: Any, stop: threading.Event = stop) -> None:
            terminated.set()
            stop.set()

        signal.signal(signal.SIGTERM, _terminate)
        signal.signal(signal.SIGINT, _terminate)
        if elector is not None:
            if not elector.acquire(stop):
                break

            def _lost(stop: threading.Event = stop, lost: threading.Event = lost) -> None:
                lost.set()
                stop.set()

            elector.keep_renewing(stop, _lost)
        try:
            lead_term(stop)
        finally:
            if elector is not None and not lost.is_set():
                elector.release()
        if not lost.is_set():
            break  # kopf stopped on SIGTERM/SIGINT (or on its own): the process ends
        log.warning("stopped reconciling after losing the lease; waiting to lead again")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` dumps every thread's stack
    setup_logging(args.log_format, args.verbose)
    health = Health()
    if args.health_port:
        serve_health(args.health_port, args.health_host, health)
    try:
        conn = connection.load(args.kubeconfig)
    except connection.ConfigError as e:
        raise SystemExit(f"kvfence-operator: {e}") from None
    kopf_settings.LOGIN["connection"] = conn
    kube = Kube(
        conn, on_request=metrics.count_request, cache=WatchCache(), on_cache_read=metrics.count_cache_read
    )
    opts = operator_options(args)
    current: dict[str, Reconciler] = {}
    beat_while_kopf_runs(health, current)
    log.info("kvfence-operator %s starting (router namespace %s)", opts.version, opts.router_namespace)
    run_terms(leader_elector(args, conn), functools.partial(lead, args, conn, kube, opts, health, current))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
