"""The router's Prometheus metrics.

A tiny registry instead of ``prometheus_client``: the hot path only increments dict entries keyed by
label tuples (no locks, no label validation per call; the router is one asyncio thread), and
``render()`` writes the text exposition format on scrape.

With ``--workers N`` each worker process keeps its own registry; a scrape is answered by one of
them, which merges the others' ``snapshot()`` into its own (``merged()``; the exchange itself is in
``siblings.py``): counters and histograms add up, and each gauge says how its per-worker values
combine (``sum`` for what each worker holds, ``min``/``max`` for a state every worker observes on
its own, so that one lagging worker shows).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

Labels = tuple[str, ...]
#: What one metric's values look like between processes: ``[[labels...], value]`` rows (JSON).
Snapshot = dict[str, list[Any]]
GaugeMerge = Literal["sum", "min", "max"]

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

    def snapshot(self) -> list[Any]:
        return [[list(k), v] for k, v in self.values.items()]

    def merge(self, rows: list[Any]) -> None:
        """Add another worker's values (a copy made for one scrape, never the live registry)."""
        values = self.values
        for labels, v in rows:
            key = tuple(labels)
            values[key] = values.get(key, 0.0) + v


class Gauge(Counter):
    def __init__(self, name: str, help_: str, labelnames: Labels = (), merge: GaugeMerge = "sum") -> None:
        super().__init__(name, help_, labelnames)
        self.merge_mode: GaugeMerge = merge

    def set(self, value: float, labels: Labels = ()) -> None:
        self.values[labels] = value

    def merge(self, rows: list[Any]) -> None:
        if self.merge_mode == "sum":
            super().merge(rows)
            return
        pick = min if self.merge_mode == "min" else max
        values = self.values
        for labels, v in rows:
            key = tuple(labels)
            values[key] = pick(values[key], v) if key in values else v

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

    def snapshot(self) -> list[Any]:
        return [[list(k), counts, total[0]] for k, (counts, total) in self.values.items()]

    def merge(self, rows: list[Any]) -> None:
        width = len(self.buckets) + 1
        for labels, counts, total in rows:
            if len(counts) != width:
                raise ValueError(f"{self.name}: {len(counts)} buckets from a sibling, {width} here")
            key = tuple(labels)
            entry = self.values.get(key)
            if entry is None:
                entry = self.values[key] = ([0] * width, [0.0])
            mine = entry[0]
            for i, c in enumerate(counts):
                mine[i] += c
            entry[1][0] += total


class RouterMetrics:
    """Every metric the router exports, in one place."""

    def __init__(self) -> None:
        self._request_metrics()
        self._engine_metrics()
        self._table_metrics()
        self._flow_metrics()
        #: Called before each scrape to set gauges that are read from live state (in-flight counts).
        self.collect: Callable[[], None] | None = None
        # Render order, and the order merged() pairs a copy's metrics with this one's.
        self.all: tuple[Counter | Histogram, ...] = (
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
            self.queued,
            self.inflight_sequences,
            self.share_sequences,
            self.flow_capacity,
            self.held,
            self.flow_rejections,
            self.slow_clients,
        )

    def _request_metrics(self) -> None:
        """What each request was answered, and why one was refused."""
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
            "kvfence_router_inflight_requests", "Requests being proxied now.", ("trust_class",), merge="sum"
        )

    def _engine_metrics(self) -> None:
        """The engine replicas: which serve, how requests were spread over them and retried."""
        self.engine_healthy = Gauge(
            "kvfence_router_engine_healthy",
            "1 if at least one replica of the trust class's engine serves (ready and healthy).",
            ("trust_class",),
            merge="min",
        )
        self.endpoint_serving = Gauge(
            "kvfence_router_engine_endpoint_serving",
            "1 if this engine replica (ip:port) receives requests: ready in its EndpointSlice and "
            "passing the router's health checks; 0 if it is known but left out.",
            ("trust_class", "engine"),
            merge="min",
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
            merge="sum",
        )
        self.affinity = Counter(
            "kvfence_router_affinity_total",
            "Replica choices: hit (the tenant's home replica) or spill (the home was at its load bound).",
            ("trust_class", "result"),
        )
        self.retries = Counter(
            "kvfence_router_engine_retries_total",
            "Requests sent again to another replica because they provably never reached the first, "
            "by what happened (connect, unsent).",
            ("trust_class", "reason"),
        )

    def _table_metrics(self) -> None:
        """The routing table and the replica count quotas are divided by."""
        self.router_replicas = Gauge(
            "kvfence_router_replicas",
            "Router replicas this router divides each tenant's quotas by (ready endpoints of its "
            "Service with --router-service, else --replicas).",
            merge="max",
        )
        self.reloads = Counter(
            "kvfence_router_routing_table_reloads_total", "Routing table loads, by result.", ("result",)
        )
        self.table_generation = Gauge(
            "kvfence_router_routing_table_generation",
            "How many valid routing tables were loaded (with --workers: by the worker that loaded fewest).",
            merge="min",
        )
        self.table_tenants = Gauge(
            "kvfence_router_routing_table_tenants", "Tenants in the current table.", merge="min"
        )

    def _flow_metrics(self) -> None:
        """Flow control (requests held while a class's engines are saturated) and slow clients."""
        self.queued = Gauge(
            "kvfence_router_queued_requests",
            "Requests held by flow control while their trust class's engines are saturated.",
            ("trust_class", "tenant"),
        )
        self.inflight_sequences = Gauge(
            "kvfence_router_inflight_sequences",
            "Sequences (prompts x n) in flight to a trust class's engines, as flow control counts them.",
            ("trust_class",),
        )
        self.share_sequences = Gauge(
            "kvfence_router_share_sequences",
            "Of the sequences in flight to a trust class's engines, those flow control let through on "
            "their tenant's guaranteed share while the class was at capacity (at most the capacity).",
            ("trust_class",),
        )
        self.flow_capacity = Gauge(
            "kvfence_router_flow_control_capacity_sequences",
            "Sequences in flight to a trust class's engines above which requests are held "
            "(--sequences-per-engine times the serving replicas, this process's part).",
            ("trust_class",),
        )
        self.held = Counter(
            "kvfence_router_held_requests_total",
            "Requests flow control held before sending them on (engines saturated).",
            ("tenant",),
        )
        self.flow_rejections = Counter(
            "kvfence_router_flow_control_rejections_total",
            "Requests refused with 429 by flow control: the tenant's queue was full (queue_full) or the "
            "request waited the whole hold timeout (timeout).",
            ("tenant", "reason"),
        )
        self.slow_clients = Counter(
            "kvfence_router_slow_clients_total",
            "Client connections cut off because they left an answer unread longer than "
            "--client-write-timeout.",
        )

    def _collect(self) -> None:
        if self.collect is not None:
            self.collect()

    def snapshot(self) -> Snapshot:
        """This process's values, for a sibling worker's scrape (JSON-serialisable)."""
        self._collect()
        return {m.name: m.snapshot() for m in self.all}

    def merged(self, siblings: Iterable[Snapshot]) -> RouterMetrics:
        """A new registry holding this process's values plus every sibling's."""
        self._collect()
        out = RouterMetrics()
        for theirs, mine in zip(out.all, self.all, strict=True):
            theirs.merge(mine.snapshot())
        by_name = {m.name: m for m in out.all}
        for snap in siblings:
            for name, rows in snap.items():
                metric = by_name.get(name)
                if metric is None:
                    raise ValueError(f"a sibling worker exports {name!r}, unknown here")
                metric.merge(rows)
        return out

    def render(self) -> bytes:
        self._collect()
        out: list[str] = []
        for m in self.all:
            m.render(out)
        out.append("")
        return "\n".join(out).encode("utf-8")
