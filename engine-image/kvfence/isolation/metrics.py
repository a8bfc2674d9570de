"""The engine's Prometheus metrics, one :class:`CollectorRegistry` per engine.

The isolation counters carry the names the wire contract fixes (:mod:`kvfence.contract`), so the
router, the vLLM middleware and the reference engine all export the same series; dashboards and
alerts need not care which engine runs a trust class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from kvfence.contract import (
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_HASH_COLLISION,
    METRIC_SIGNATURE_REJECTED,
    METRIC_STALE_REFERENCE,
    METRIC_TENANT_QUEUE_STEPS,
    METRIC_TENANT_SERVICE_UNITS,
    QUEUE_STEP_BUCKETS,
)
from kvfence.isolation.fairshare import QueueSteps


class EngineMetrics:
    """Counters and gauges of one engine. Every engine (and every test) gets its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._isolation_counters(self.registry)
        self._serving_counters(self.registry)
        self._gauges: dict[str, Gauge] = {}
        self._info = Gauge(
            "kvfence_engine_info",
            "The engine's build: which prefix-cache walk runs (compiled, python, or none without a cache)",
            labelnames=["prefix_walk"],
            registry=self.registry,
        )
        self._info.labels(prefix_walk="none").set(1)

    def _isolation_counters(self, r: CollectorRegistry) -> None:
        """The contract's isolation counters, and quota refusals."""
        self.hash_collision = Counter(
            METRIC_HASH_COLLISION,
            "Prefix-cache hits whose stored block did not match the request token for token (a miss)",
            registry=r,
        )
        self.cross_access_rejected = Counter(
            METRIC_CROSS_ACCESS_REJECTED,
            "Prefix-cache entries reached by a request of another cache namespace, refused",
            registry=r,
        )
        self.stale_reference = Counter(
            METRIC_STALE_REFERENCE,
            "Uses of a block handle whose block was freed or reallocated since, refused",
            registry=r,
        )
        self.signature_rejected = Counter(
            METRIC_SIGNATURE_REJECTED,
            "Requests refused because their router signature did not verify",
            ["reason"],
            registry=r,
        )
        self.quota_rejected = Counter(
            "kvfence_engine_quota_rejected_total",
            "Requests refused because the tenant's KV-block quota would be exceeded",
            ["tenant"],
            registry=r,
        )

    def _serving_counters(self, r: CollectorRegistry) -> None:
        """What the engine answered, served from its prefix cache, evicted, generated and preempted."""
        self.requests = Counter(
            "kvfence_engine_requests_total",
            "Requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prefix_queries = Counter(
            "kvfence_engine_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "kvfence_engine_prefix_cache_hits_total", "Prompt tokens served from the prefix cache", registry=r
        )
        self.shared_prefix_hits = Counter(
            "kvfence_engine_shared_prefix_hits_total",
            "Prompt tokens served from the trust class's declared, pinned shared prefixes (also counted "
            "in kvfence_engine_prefix_cache_hits_total)",
            registry=r,
        )
        self.evictions = Counter(
            "kvfence_engine_kv_evictions_total",
            "Cached blocks evicted, by whether the evicting tenant was the owner (own) or not (cross)",
            ["kind"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "kvfence_engine_generated_tokens_total", "Tokens generated", registry=r
        )
        self.preemptions = Counter(
            "kvfence_engine_preemptions_total",
            "Running sequences sent back to the waiting queue for a tenant below its fair share",
            registry=r,
        )
        self.service_units = Counter(
            METRIC_TENANT_SERVICE_UNITS,
            "Service units fair share charged each tenant (prompt tokens computed, cached prompt tokens "
            "and output tokens at the policy's costs) since the engine started",
            ["tenant"],
            registry=r,
        )

    def prefix_walk(self, walk: str) -> None:
        """``kvfence_engine_info{prefix_walk=walk} 1``, the only series (the prefix cache sets it)."""
        self._info.clear()
        self._info.labels(prefix_walk=walk).set(1)

    def export_queue_steps(self, waits: QueueSteps) -> None:
        """``kvfence_engine_tenant_queue_steps{tenant}``, read from ``waits`` at scrape time."""
        self.registry.register(_QueueStepsCollector(waits))

    def gauge_function(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge whose value is read from ``fn`` at scrape time (block counts, queue lengths)."""
        g = Gauge(name, doc, registry=self.registry)
        g.set_function(fn)
        self._gauges[name] = g

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The current value of one sample (tests and the benchmark read counters through this)."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)


def queue_steps_family(hist: Mapping[str, Mapping[str, Any]]) -> HistogramMetricFamily:
    """``kvfence_engine_tenant_queue_steps`` from :meth:`QueueSteps.snapshot`'s form, as both engines
    export it (the vLLM middleware from the engine core's stats file)."""
    fam = HistogramMetricFamily(
        METRIC_TENANT_QUEUE_STEPS,
        "Engine steps that ran while a new request of the tenant waited, before the step that first "
        "scheduled it (0: the next step took it)",
        labels=["tenant"],
    )
    bounds = [*map(str, QUEUE_STEP_BUCKETS), "+Inf"]
    for tenant, h in sorted(hist.items()):
        fam.add_metric([tenant], list(zip(bounds, accumulate(h["buckets"]), strict=True)), h["sum"])
    return fam


class _QueueStepsCollector(Collector):
    def __init__(self, waits: QueueSteps) -> None:
        self.waits = waits

    def collect(self) -> Iterator[HistogramMetricFamily]:
        yield queue_steps_family(self.waits.snapshot())
