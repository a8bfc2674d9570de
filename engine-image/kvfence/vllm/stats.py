"""The fence's counters on vLLM's ``/metrics``, across vLLM's processes.

The scheduler (and so the fence) runs in vLLM's engine-core process; ``/metrics`` is served by the API
server process, where the kvfence middleware runs. The engine core writes a small JSON snapshot
(:class:`StatsWriter`, a background thread, at most four times a second and only when something
changed) to the file named by ``KVFENCE_VLLM_STATS_FILE`` (the operator sets it to a file on the pod's
``/tmp`` volume); the API server exports it at scrape time (:class:`FenceCollector`), merged with the
middleware's own counters. The series carry the contract's names, so the chart's alerts and dashboards
treat a vLLM class like a reference one:

* ``kv_cache_hash_collision_total``, ``kv_cache_tenant_cross_access_rejected_total`` (refused prefix
  hits from another namespace, plus cache salts refused at the HTTP edge),
  ``kv_cache_stale_reference_error_total``;
* ``kvfence_engine_signature_rejected_total{reason}`` (the middleware's refusals, plus requests the
  scheduler refused for a missing or wrong tenant tag);
* ``kvfence_engine_quota_rejected_total{tenant}``, ``kvfence_engine_quota_held_back_total{tenant}``,
  ``kvfence_engine_kv_evictions_total{kind="own"|"cross"}``;
* ``kvfence_engine_tenant_kv_blocks{tenant,state="active"|"cached"|"reserved"}``,
  ``kvfence_engine_tenant_kv_blocks_limit{tenant,kind="max"|"guaranteed"}``,
  ``kvfence_engine_kv_blocks_total``, ``kvfence_engine_kv_blocks_free``, ``kvfence_engine_kv_blocks_active``,
  ``kvfence_engine_kv_blocks_cached`` (the reference engine's names, so the chart's dashboard shows
  both runtimes);
* ``kvfence_engine_tenant_service_units_total{tenant}``: the service units fair share charged each
  tenant since the engine started (kvfence.vllm.fair's ``StepShares.served``), the series the
  reference engine exports too;
* ``kvfence_engine_tenant_queue_steps{tenant}`` (a histogram): for each request of the tenant, the engine
  steps that ran while it waited before the step that first scheduled it (``StepShares.waits``);
  0 when the next step took it, whatever other tenants had queued (the reference engine's buckets);
* ``kvfence_engine_info{records="compiled"|"python"}`` (always 1): which prefix-cache records the fence
  runs (kvfence.vllm.records), as the engine core reports it in its snapshot; before its first
  snapshot, what this process imported (the same install, so the same answer).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvfence.contract import (
    METRIC_CROSS_ACCESS_REJECTED,
    METRIC_HASH_COLLISION,
    METRIC_SIGNATURE_REJECTED,
    METRIC_STALE_REFERENCE,
    METRIC_TENANT_SERVICE_UNITS,
)
from kvfence.contract.engine_config import ENV_VLLM_STATS_FILE
from kvfence.vllm import records

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

    from kvfence.isolation.fairshare import QueueSteps

log = logging.getLogger("kvfence.vllm.stats")

ENV_STATS_FILE = ENV_VLLM_STATS_FILE
WRITE_INTERVAL = 0.25  # seconds


def stats_path() -> Path:
    value = os.environ.get(ENV_STATS_FILE)
    return Path(value) if value else Path(tempfile.gettempdir()) / "kvfence-vllm-stats.json"


class Snapshotting(Protocol):
    @property
    def version(self) -> int: ...

    def snapshot(self) -> dict[str, Any]: ...


class Served(Protocol):
    @property
    def served(self) -> Mapping[str, int]:
        """tenant -> service units charged since the engine started (only ever grows)"""

    @property
    def waits(self) -> QueueSteps:
        """each tenant's started requests by the steps they waited"""


class EngineStats:
    """The fence's snapshot with fair share's service units and queue-steps histograms: a new version
    whenever any of them moved (all only grow, so their sum moves exactly when one of them does)."""

    def __init__(self, fence: Snapshotting, fair: Served) -> None:
        self.fence = fence
        self.fair = fair

    @property
    def version(self) -> int:
        started = sum(sum(counts) for counts in list(self.fair.waits.counts.values()))
        return self.fence.version + sum(list(self.fair.served.values())) + started

    def snapshot(self) -> dict[str, Any]:
        fair = self.fair
        return {
            **self.fence.snapshot(),
            "service_units": dict(fair.served),
            "queue_steps": fair.waits.snapshot(),
        }


class StatsWriter:
    """Writes ``fence.snapshot()`` to the stats file whenever ``fence.version`` moved."""

    def __init__(self, fence: Snapshotting, path: Path, interval: float = WRITE_INTERVAL) -> None:
        self.fence = fence
        self.path = path
        self.interval = interval
        self._stop = threading.Event()
        self._written = -1
        self.write()  # a fresh engine starts from zero, whatever an earlier one left
        self._thread = threading.Thread(target=self._run, name="kvfence-stats", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, fence: Snapshotting) -> StatsWriter:
        return cls(fence, stats_path())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.fence.version != self._written:
                self.write()

    def write(self) -> None:
        version = self.fence.version
        for _ in range(5):
            try:
                snap = self.fence.snapshot()
                break
            except RuntimeError:  # a dict changed size under the scheduler thread: take it again
                continue
        else:
            return
        snap = {**snap, "records": records.IMPLEMENTATION}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(snap, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("kvfence: cannot write %s: %s", self.path, e)
            return
        self._written = version

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.write()


class EdgeCounters:
    """The middleware's own counts (API-server process), merged into the exported series."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.signature_rejected: dict[str, int] = {}
        self.cross_access_rejected = 0

    def rejected(self, reason: str) -> None:
        with self._lock:
            self.signature_rejected[reason] = self.signature_rejected.get(reason, 0) + 1

    def cross_access(self) -> None:
        with self._lock:
            self.cross_access_rejected += 1


class FenceCollector:
    """A Prometheus collector reading the engine core's stats file at scrape time."""

    def __init__(self, edge: EdgeCounters, path: Path | None = None) -> None:
        self.edge = edge
        self.path = path if path is not None else stats_path()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def collect(self) -> Iterator[Any]:
        s = self._read()
        yield from _isolation_families(s, self.edge)
        yield from _quota_families(s)
        yield from _block_families(s)
        yield from _tenant_families(s)
        yield _service_family(s)
        yield _queue_steps_family(s)
        yield _info_family(s)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


def _isolation_families(s: dict[str, Any], edge: EdgeCounters) -> Iterator[Metric]:
    """The contract's isolation counters: the engine core's, plus the middleware's refusals."""
    from prometheus_client.core import CounterMetricFamily

    yield _counter(
        METRIC_HASH_COLLISION,
        "Prefix-cache hits whose stored block did not match the request token for token (a miss)",
        s.get("hash_collision", 0),
    )
    yield _counter(
        METRIC_CROSS_ACCESS_REJECTED,
        "Prefix-cache entries reached by a request of another cache namespace, refused",
        s.get("cross_access_rejected", 0) + edge.cross_access_rejected,
    )
    yield _counter(
        METRIC_STALE_REFERENCE,
        "Uses of a block whose generation moved since it was looked up, refused",
        s.get("stale_reference", 0),
    )
    reasons = dict(edge.signature_rejected)
    for reason, n in (s.get("identity_rejected") or {}).items():
        reasons[reason] = reasons.get(reason, 0) + n
    fam = CounterMetricFamily(
        METRIC_SIGNATURE_REJECTED.removesuffix("_total"),
        "Requests refused because their router signature (or tenant tag) did not verify",
        labels=["reason"],
    )
    for reason, n in sorted(reasons.items()):
        fam.add_metric([reason], n)
    yield fam


def _quota_families(s: dict[str, Any]) -> Iterator[Metric]:
    """Quota refusals and waits per tenant, and evictions by whose block was evicted."""
    from prometheus_client.core import CounterMetricFamily

    for name, doc, key in (
        (
            "kvfence_engine_quota_rejected",
            "Requests refused because they can never fit the tenant's KV-block quota",
            "quota_rejected",
        ),
        (
            "kvfence_engine_quota_held_back",
            "Scheduling steps in which a request waited for its tenant's KV-block quota",
            "quota_held_back",
        ),
    ):
        fam = CounterMetricFamily(name, doc, labels=["tenant"])
        for tenant, n in sorted((s.get(key) or {}).items()):
            fam.add_metric([tenant], n)
        yield fam
    ev = s.get("evictions") or {}
    fam = CounterMetricFamily(
        "kvfence_engine_kv_evictions",
        "Cached blocks evicted, by whether the evicting tenant was the owner (own) or not (cross)",
        labels=["kind"],
    )
    for kind in ("own", "cross"):
        fam.add_metric([kind], ev.get(kind, 0))
    yield fam


def _block_families(s: dict[str, Any]) -> Iterator[Metric]:
    """The pool's blocks by state, and the declared shared prefixes."""
    from prometheus_client.core import GaugeMetricFamily

    blocks = s.get("blocks") or {}
    for name, doc, key in (
        ("kvfence_engine_kv_blocks_total", "KV blocks in vLLM's pool (without the null block)", "total"),
        ("kvfence_engine_kv_blocks_free", "KV blocks free and holding no cache entry", "free"),
        ("kvfence_engine_kv_blocks_active", "KV blocks referenced by running requests", "active"),
        ("kvfence_engine_kv_blocks_cached", "Unreferenced KV blocks held by the prefix cache", "cached"),
        (
            "kvfence_engine_kv_blocks_pinned",
            "KV blocks pinned for the declared shared prefixes (outside every tenant's quota)",
            "pinned",
        ),
    ):
        yield GaugeMetricFamily(name, doc, value=blocks.get(key, 0))
    yield _counter(
        "kvfence_engine_shared_prefix_hits",
        "Prompt tokens served from the trust class's declared, pinned shared prefixes",
        s.get("shared_prefix_hit_tokens", 0),
    )
    yield GaugeMetricFamily(
        "kvfence_engine_shared_prefixes_pinned",
        "Declared shared prefixes computed and pinned",
        value=s.get("shared_prefixes", 0),
    )


def _tenant_families(s: dict[str, Any]) -> Iterator[Metric]:
    """Each tenant's blocks by state, and its quota."""
    from prometheus_client.core import GaugeMetricFamily

    usage = GaugeMetricFamily(
        "kvfence_engine_tenant_kv_blocks",
        "KV blocks charged to a tenant: active (in use), cached (cold, evictable), reserved "
        "(what its admitted requests may reach)",
        labels=["tenant", "state"],
    )
    limits = GaugeMetricFamily(
        "kvfence_engine_tenant_kv_blocks_limit",
        "A tenant's KV-block quota: max (absent: the pool) and guaranteed",
        labels=["tenant", "kind"],
    )
    for tenant, t in sorted((s.get("tenants") or {}).items()):
        for state in ("active", "cached", "reserved"):
            usage.add_metric([tenant, state], t.get(state, 0))
        if t.get("max") is not None:
            limits.add_metric([tenant, "max"], t["max"])
        limits.add_metric([tenant, "guaranteed"], t.get("guaranteed", 0))
    yield usage
    yield limits


def _service_family(s: dict[str, Any]) -> CounterMetricFamily:
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily(
        METRIC_TENANT_SERVICE_UNITS.removesuffix("_total"),
        "Service units fair share charged each tenant (prompt tokens computed, cached prompt tokens "
        "and output tokens at the policy's costs) since the engine started",
        labels=["tenant"],
    )
    for tenant, n in sorted((s.get("service_units") or {}).items()):
        fam.add_metric([tenant], n)
    return fam


def _queue_steps_family(s: dict[str, Any]) -> HistogramMetricFamily:
    from kvfence.isolation.metrics import queue_steps_family

    return queue_steps_family(s.get("queue_steps") or {})


def _info_family(s: dict[str, Any]) -> GaugeMetricFamily:
    from prometheus_client.core import GaugeMetricFamily

    info = GaugeMetricFamily(
        "kvfence_engine_info",
        "The engine's build: which prefix-cache records the fence runs (compiled or python)",
        labels=["records"],
    )
    info.add_metric([str(s.get("records") or records.IMPLEMENTATION)], 1)
    return info
