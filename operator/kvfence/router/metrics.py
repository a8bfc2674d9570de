"""The router's Prometheus metrics.

A tiny registry instead of ``prometheus_client``: the hot path only increments dict entries keyed by
label tuples (no locks, no label validation per call; the router is one asyncio thread), and
``render()`` writes the text exposition format on scrape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

Labels = tuple[str, ...]

# Buckets (seconds) for the request-duration histogram: router-added overhead is sub-millisecond,
# model answers take seconds.
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Labels, values: Labels, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Counter:
    def __init__(self, name: str, help_: str, labelnames: Labels = ()) -> None:
        self.name, self.help, self.labelnames = name, help_, labelnames
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, labels: Labels = ()) -> float:
        return self.values.get(labels, 0.0)

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {self.help}")
        out.append(f"# TYPE {self.name} counter")
        for labels, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.labelnames, labels)} {_num(v)}")


class Gauge(Counter):
    def set(self, value: float, labels: Labels = ()) -> None:
        self.values[labels] = value

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {self.help}")
        out.append(f"# TYPE {self.name} gauge")
        for labels, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.labelnames, labels)} {_num(v)}")


class Histogram:
    def __init__(
        self, name: str, help_: str, labelnames: Labels = (), buckets: tuple[float, ...] = DURATION_BUCKETS
    ) -> None:
        self.name, self.help, self.labelnames = name, help_, labelnames
        self.buckets = buckets
        # labels -> [count per bucket (non-cumulative, last = +Inf), sum]
        self.values: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, labels: Labels = ()) -> None:
        entry = self.values.get(labels)
        if entry is None:
            entry = self.values[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1][0] += value

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {self.help}")
        out.append(f"# TYPE {self.name} histogram")
        for labels, (counts, total) in sorted(self.values.items()):
            acc = 0
            for bound, c in zip((*self.buckets, math.inf), counts, strict=True):
                acc += c
                le = f'le="{_num(bound)}"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, labels, le)} {acc}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, labels)} {_num(total[0])}")
            out.append(f"{self.name}_count{_labels(self.labelnames, labels)} {acc}")


class RouterMetrics:
    """Every metric the router exports, in one place."""

    def __init__(self) -> None:
        self.requests = Counter(
            "kvfence_router_requests_total",
            "Requests answered, by tenant, trust class, endpoint and HTTP status code.",
            ("tenant", "trust_class", "endpoint", "code"),
        )
        self.duration = Histogram(
            "kvfence_router_request_duration_seconds",
            "Time from request received to response finished (streams: to the last chunk).",
            ("trust_class", "endpoint"),
        )
        self.auth_failures = Counter(
            "kvfence_router_auth_failures_total", "Requests refused with 401, by reason.", ("reason",)
        )
        self.forbidden = Counter(
            "kvfence_router_forbidden_total",
            "Requests refused with 403 (model or adapter outside the tenant's allowlist).",
            ("tenant",),
        )
        self.quota_rejections = Counter(
            "kvfence_router_quota_rejections_total",
            "Requests refused with 429, by tenant and quota (concurrency, requests, tokens).",
            ("tenant", "quota"),
        )
        self.tokens = Counter(
            "kvfence_router_tokens_total",
            "Tokens charged to a tenant's tokens-per-minute quota after correction.",
            ("tenant",),
        )
        self.stripped = Counter(
            "kvfence_router_client_fields_stripped_total",
            "Client-sent headers or body fields removed because they could pick an identity or a "
            "cache namespace.",
            ("kind",),
        )
        self.upstream_errors = Counter(
            "kvfence_router_upstream_errors_total",
            "Requests the router could not complete because of the engine, by reason.",
            ("trust_class", "reason"),
        )
        self.inflight = Gauge(
            "kvfence_router_inflight_requests", "Requests being proxied now.", ("trust_class",)
        )
        self.engine_healthy = Gauge(
            "kvfence_router_engine_healthy",
            "1 if at least one replica of the trust class's engine serves (ready and healthy).",
            ("trust_class",),
        )
        self.endpoint_serving = Gauge(
            "kvfence_router_engine_endpoint_serving",
            "1 if this engine replica (ip:port) receives requests: ready in its EndpointSlice and "
            "passing the router's health checks; 0 if it is known but left out.",
            ("trust_class", "engine"),
        )
        self.endpoint_requests = Counter(
            "kvfence_router_engine_endpoint_requests_total",
            "Requests sent to each engine replica (retries included).",
            ("trust_class", "engine"),
        )
        self.endpoint_inflight = Gauge(
            "kvfence_router_engine_endpoint_inflight_requests",
            "Requests in flight on each engine replica, as the router counts them.",
            ("trust_class", "engine"),
        )
        self.affinity = Counter(
            "kvfence_router_affinity_total",
            "Replica choices: hit (the tenant's home replica) or spill (the home was at its load bound).",
            ("trust_class", "result"),
        )
        self.retries = Counter(
            "kvfence_router_engine_retries_total",
            "Requests sent again to another replica because the first could not have answered them, "
            "by what happened (connect, closed, stale).",
            ("trust_class", "reason"),
        )
        self.router_replicas = Gauge(
            "kvfence_router_replicas",
            "Router replicas this router divides each tenant's quotas by (ready endpoints of its "
            "Service with --router-service, else --replicas).",
        )
        self.reloads = Counter(
            "kvfence_router_routing_table_reloads_total", "Routing table loads, by result.", ("result",)
        )
        self.table_generation = Gauge(
            "kvfence_router_routing_table_generation", "How many valid routing tables were loaded."
        )
        self.table_tenants = Gauge("kvfence_router_routing_table_tenants", "Tenants in the current table.")
        #: Called before each scrape to set gauges that are read from live state (in-flight counts).
        self.collect: Callable[[], None] | None = None
        self.all = (
            self.requests,
            self.duration,
            self.auth_failures,
            self.forbidden,
            self.quota_rejections,
            self.tokens,
            self.stripped,
            self.upstream_errors,
            self.inflight,
            self.engine_healthy,
            self.endpoint_serving,
            self.endpoint_requests,
            self.endpoint_inflight,
            self.affinity,
            self.retries,
            self.router_replicas,
            self.reloads,
            self.table_generation,
            self.table_tenants,
        )

    def render(self) -> bytes:
        if self.collect is not None:
            self.collect()
        out: list[str] = []
        for m in self.all:
            m.render(out)
        out.append("")
        return "\n".join(out).encode("utf-8")
