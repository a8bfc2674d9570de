"""The reference engine shares each step by weight (kvfence.isolation.fairshare), stepped by hand: no
scheduler thread, no clock. Service is measured from the requests themselves (tokens computed and
generated), not from the policy's counters."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from engine.enginelib import Oracle, make_config

from kvfence.contract import METRIC_TENANT_QUEUE_STEPS, METRIC_TENANT_SERVICE_UNITS, QUEUE_STEP_BUCKETS
from kvfence.engine.engine import (
    MAX_BATCH_TOKENS,
    MAX_RUNNING,
    PREFILL_CHUNK,
    Admitted,
    Engine,
    Event,
    Finished,
    Request,
    Token,
)
from kvfence.isolation.fairshare import request_cost

#: Long prompts and short answers: every backlogged tenant can use more than its share of each step.
PROMPT = 600
MAX_TOKENS = 4
MAX_MODEL_LEN = 700
#: The bound these tests hold the service difference of two backlogged tenants to: twice the largest
#: cost one request can have (VTC's 2U in the form the design uses; the paper's own statement is unchecked).
VTC_BOUND = 2 * request_cost(prefill=PROMPT, output=MAX_TOKENS)


class Harness:
    """An engine with prefix cache off (every token computed) and what each request received."""

    def __init__(self, weights: dict[str, int] | None = None, **over: Any) -> None:
        quotas = {"tenants": {t: {"weight": w} for t, w in (weights or {}).items()}}
        self.cfg = make_config(
            numBlocks=8192, maxModelLen=MAX_MODEL_LEN, prefixCache={"enabled": False}, quotas=quotas, **over
        )
        self.engine = Engine(self.cfg)
        self.requests: list[Request] = []
        self.events: dict[str, list[Event]] = {}
        self._n = 0

    def submit(
        self, tenant: str, count: int, prompt: int = PROMPT, max_tokens: int = MAX_TOKENS
    ) -> list[str]:
        ids = []
        for _ in range(count):
            self._n += 1
            rid = f"{tenant}-{self._n}"
            ev: list[Event] = []
            self.events[rid] = ev
            toks = (np.arange(prompt, dtype=np.int32) * 7 + self._n) % 250 + 3  # distinct, no EOS
            req = Request(rid, tenant, self.engine.context(self.engine.expected_namespace(tenant), ""),
                          toks.astype(np.int32), max_tokens, ev.append)  # fmt: skip
            self.engine.submit(req)
            self.requests.append(req)
            ids.append(rid)
        return ids

    def computed(self) -> Counter[str]:
        """Tokens each tenant had computed (prompt and fed-back generated tokens; a preempted request
        starts again from none)."""
        out: Counter[str] = Counter()
        for r in self.requests:
            out[r.tenant] += r.computed
        return out

    def service(self) -> Counter[str]:
        """VTC's weighted service of each tenant: prompt tokens computed and tokens generated."""
        out: Counter[str] = Counter()
        for r in self.requests:
            out[r.tenant] += request_cost(prefill=min(r.computed, len(r.prompt)), output=r.generated)
        return out

    def step(self) -> Counter[str]:
        """One step; the tokens each tenant computed in it."""
        before = self.computed()
        self.engine.step()
        after = self.computed()
        return Counter({t: after[t] - before[t] for t in after})

    def backlogged(self) -> set[str]:
        """The tenants that could use the whole step: at least one full prompt chunk left in as many
        unfinished requests as a step has chunks."""
        left = Counter(r.tenant for r in self.requests if len(r.prompt) - r.computed >= PREFILL_CHUNK)
        return {t for t, n in left.items() if n * PREFILL_CHUNK >= MAX_BATCH_TOKENS}


@pytest.mark.parametrize(
    "weights", [{"a": 1, "b": 1}, {"a": 2, "b": 1}, {"a": 1, "b": 1, "c": 1}, {"a": 2, "b": 1, "c": 1}]
)
def test_backlogged_tenants_get_the_step_in_the_ratio_of_their_weights(weights: dict[str, int]) -> None:
    h = Harness(weights)
    for t in weights:
        h.submit(t, 12)
    total = sum(weights.values())
    steps = 0
    while h.backlogged() == set(weights):
        got = h.step()
        steps += 1
        assert sum(got.values()) == MAX_BATCH_TOKENS  # work-conserving
        for t, w in weights.items():  # each its share, to the token the integer division leaves
            assert abs(got[t] - MAX_BATCH_TOKENS * w / total) <= 1, (steps, got)
        served = h.service()
        norm = [served[t] / w for t, w in weights.items()]
        assert max(norm) - min(norm) <= VTC_BOUND, (steps, served)
    assert steps > 20


def test_each_tenants_service_is_exported_as_its_requests_received_it() -> None:
    """The service counter on /metrics is each tenant's weighted service as its requests measure it
    (prompt tokens computed, tokens generated, and the end-of-sequence token a request stopped on,
    which the step computed too), after every step and at the end."""
    h = Harness({"a": 2, "b": 1})
    h.submit("a", 6, prompt=100, max_tokens=5)
    h.submit("b", 3, prompt=300, max_tokens=3)

    def exported() -> dict[str, float]:
        return {t: h.engine.metrics.value(METRIC_TENANT_SERVICE_UNITS, {"tenant": t}) for t in ("a", "b")}

    def received() -> Counter[str]:
        out = h.service()
        for r in h.requests:
            out[r.tenant] += sum(
                request_cost(output=1)
                for e in h.events[r.request_id]
                if isinstance(e, Finished) and e.reason == "stop"
            )
        return out

    for _ in range(6):  # prompts part computed, some generating
        h.step()
        assert exported() == received()
    h.engine.run_until_idle()
    assert exported() == received()
    assert exported()["a"] >= 6 * request_cost(prefill=100, output=1)
    assert exported()["b"] >= 3 * request_cost(prefill=300, output=1)
    assert 'kvfence_engine_tenant_service_units_total{tenant="b"}' in h.engine.metrics.render().decode()


def test_an_idle_tenants_share_goes_to_the_others() -> None:
    h = Harness()
    h.submit("a", 40)
    for _ in range(3):
        assert h.step() == {"a": MAX_BATCH_TOKENS}
    h.submit("b", 1, prompt=8, max_tokens=20)  # b uses one token a step once its prompt is in
    h.step()
    for _ in range(10):
        got = h.step()
        assert got["b"] == 1
        assert got["a"] == MAX_BATCH_TOKENS - 1


def test_a_late_tenant_is_served_at_once_and_gets_no_burst_for_its_idle_time() -> None:
    h = Harness()
    h.submit("a", 20)
    for _ in range(20):
        assert h.step() == {"a": MAX_BATCH_TOKENS}  # a is served alone for a long time
    h.submit("b", 10)
    start = h.service()
    for _ in range(15):
        got = h.step()
        assert got["b"] > 0  # not starved
        assert abs(got["a"] - got["b"]) <= 1  # no catch-up for the idle time
    now = h.service()
    assert abs((now["a"] - start["a"]) - (now["b"] - start["b"])) <= VTC_BOUND


def test_a_flood_does_not_delay_another_tenants_first_token_beyond_one_step() -> None:
    h = Harness()
    h.submit("a", 3 * MAX_RUNNING, prompt=100, max_tokens=40)  # holds every slot
    for _ in range(5):
        h.step()
    assert sum(1 for r in h.engine._running if r.tenant == "a") == MAX_RUNNING
    (b,) = h.submit("b", 1, prompt=PREFILL_CHUNK, max_tokens=5)
    h.step()
    assert [type(ev) for ev in h.events[b]] == [Admitted, Token]
    assert h.engine.metrics.value("kvfence_engine_preemptions_total") == 1
    h.engine.run_until_idle()
    oracle = Oracle(h.cfg)
    for r in h.requests:  # the preempted sequence recomputed and finished with the same tokens
        ev = h.events[r.request_id]
        assert isinstance(ev[-1], Finished), ev[-1]
        assert [e.token_id for e in ev if isinstance(e, Token)] == oracle.tokens(r.prompt, r.max_tokens)
    assert sum(isinstance(e, Admitted) for ev in h.events.values() for e in ev) == len(h.requests)


def test_the_engine_counts_the_steps_each_request_waited_and_exports_them_as_the_vllm_plugin_does() -> None:
    # Beside a flood of three times the slots, the other tenant's request is admitted by the next step
    # (0 steps waited); the flood's later requests wait for slots. /metrics carries the histogram with
    # the vLLM plugin's buckets (kvfence.isolation.metrics.queue_steps_family, the same function).
    h = Harness()
    h.submit("a", 3 * MAX_RUNNING, prompt=100, max_tokens=40)
    for _ in range(5):
        h.step()
    h.submit("b", 1, prompt=PREFILL_CHUNK, max_tokens=5)
    h.step()
    h.engine.run_until_idle()
    waits = h.engine.waits.snapshot()
    assert waits["b"] == {"buckets": [1] + [0] * len(QUEUE_STEP_BUCKETS), "sum": 0}
    assert sum(waits["a"]["buckets"]) == 3 * MAX_RUNNING
    assert waits["a"]["buckets"][0] == MAX_RUNNING  # the first slots' worth, by the first step
    assert waits["a"]["sum"] >= 2 * MAX_RUNNING  # the rest waited for slots
    value = h.engine.metrics.value
    name = METRIC_TENANT_QUEUE_STEPS
    assert value(f"{name}_bucket", {"tenant": "b", "le": "0"}) == 1
    assert value(f"{name}_bucket", {"tenant": "a", "le": "+Inf"}) == value(f"{name}_count", {"tenant": "a"})
    assert value(f"{name}_count", {"tenant": "a"}) == 3 * MAX_RUNNING
    assert value(f"{name}_sum", {"tenant": "a"}) == waits["a"]["sum"]
    text = h.engine.metrics.render().decode()
    assert [line.split("le=")[1].split('"')[1] for line in text.splitlines() if 'tenant="b"' in line
            and "_bucket" in line] == [*map(str, QUEUE_STEP_BUCKETS), "+Inf"]  # fmt: skip


def test_running_slots_are_divided_by_weight() -> None:
    h = Harness({"a": 3, "b": 1})
    h.submit("a", MAX_RUNNING, max_tokens=5)
    h.submit("b", MAX_RUNNING, max_tokens=5)
    h.step()
    running = Counter(r.tenant for r in h.engine._running)
    assert running == {"a": MAX_RUNNING * 3 // 4, "b": MAX_RUNNING // 4}


def test_a_reloaded_weight_applies_from_the_next_step() -> None:
    h = Harness()
    h.submit("a", 20)
    h.submit("b", 20)
    assert h.step() == {"a": 128, "b": 128}
    h.engine.set_weights(1, {"b": 3})
    assert h.step() == {"a": 64, "b": 192}
