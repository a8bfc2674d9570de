"""Prometheus metrics of the operator (served by ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "kvfence_operator_reconciles",
    "Reconciles run, by kind (class, routing, binding) and result (ok, requeue, error).",
    ["kind", "result"],
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "kvfence_operator_reconcile_errors",
    "Reconciles that raised an error, by kind.",
    ["kind"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "kvfence_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, by kind.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
API_REQUESTS = Counter(
    "kvfence_operator_api_requests",
    "Requests the reconciler sent to the Kubernetes API, by HTTP verb and resource (leader election apart).",
    ["verb", "resource"],
    registry=REGISTRY,
)
CACHE_READS = Counter(
    "kvfence_operator_watch_cache_reads",
    "Objects a reconcile read from the watches' cache instead of GETting them, by resource.",
    ["resource"],
    registry=REGISTRY,
)
LEASE_REQUESTS = Counter(
    "kvfence_operator_lease_requests",
    "Requests sent for leader election, by HTTP verb.",
    ["verb"],
    registry=REGISTRY,
)
SECRET_EVENTS = Counter(
    "kvfence_operator_secret_events",
    "Secret watch events, by kind (signing-key, api-key) and result: enqueued (a reconcile follows), "
    "current (a referenced Secret at the version already read), ignored (a Secret nothing depends on).",
    ["kind", "result"],
    registry=REGISTRY,
)
SECRET_WATCH_NAMESPACES = Gauge(
    "kvfence_operator_secret_watch_namespaces",
    "Tenant namespaces whose API-key Secrets are watched, by state (watching, forbidden: the namespace "
    "did not grant list/watch, its Secrets are re-read at each resync).",
    ["state"],
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge("kvfence_operator_queue_depth", "Keys waiting in the work queue.", registry=REGISTRY)
LEADER = Gauge("kvfence_operator_leader", "1 while this replica holds the leader lease.", registry=REGISTRY)


def count_request(verb: str, resource: str) -> None:
    API_REQUESTS.labels(verb=verb, resource=resource).inc()


def count_cache_read(resource: str) -> None:
    CACHE_READS.labels(resource=resource).inc()
