"""What the kvfence scheduler plugin costs inside vLLM, next to stock vLLM (a benchmark, not a test).

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(tests/vllm/install-vllm.sh --print) bench/bench_vllm.py \
        [--quick] [--rounds 5] [--profile] [--process-per-run | --lockstep [--floor] [--split]]
        [--async-scheduling] [--variants "no quotas,quotas"] [--hit-rate] [--callgrind [--callgrind-keep DIR]]
        [--bytecodes] [--hooks] [--fair-share-off] [--users 48,32,24,20,16,16,16,16] [--requests-per-user N]

Same process, same run: vLLM's own ``vllm.v1.core.sched.scheduler.Scheduler`` (the peer, "stock") and
``kvfence.vllm.scheduler.FencedScheduler`` ("fenced") are built by tests/vllm_engine/vllmsched.py's
``Harness`` over the same VllmConfig and KVCacheConfig, sized like a GPU engine (block size 16, 4096
blocks, max_num_seqs 128, max_num_batched_tokens 8192, chunked prefill, prefix caching with sha256
block hashes; the synchronous scheduler, or with ``--async-scheduling`` vLLM's AsyncScheduler, its GPU
default), and driven with fake model outputs (one sampled token per request whose prefill is
complete; no model runs). What is timed is the scheduler's own work per engine step: the
``add_request`` calls of the requests that arrived since the last step (vLLM's engine core makes them on
the scheduler's thread; the plugin checks the tenant tag and packs the prompt there), ``schedule()`` and
``update_from_output()``. Building requests (block hashing belongs to vLLM's input processing, not to
the scheduler) and the fake model output are not timed; ``add_request`` is also reported apart.

Workload (seeded; both schedulers see the identical request stream): 8 tenants, each with its own system
prompt of 32-96 blocks (512-1536 tokens) that every request of the tenant starts with, then a unique
suffix of 16-240 tokens; max_tokens 16-256. Each tenant is a closed loop of concurrent users (48, 32,
24, 20, 16, 16, 16, 16: a skewed mix; ``--users`` sets others), so the engine is saturated (more
requests than max_num_seqs, a waiting queue every step, the pool full of cached blocks and evicting) and
a heavy tenant's backlog stays bounded. Requests carry the cache salt and the ``vllm_xargs`` (tenant +
tag) the kvfence middleware sets (each request its own string objects, as vLLM's engine core decodes
them); stock vLLM ignores the extra args and partitions its prefix cache by the same salt, so per-tenant
hit rates must agree.

Variants:

* ``no quotas``: the plugin without quotas in its engine config (every tenant unlimited): verified
  hits, stale checks, shadow pool, tenant-partitioned eviction and admission bookkeeping, but no limit
  ever binds. Fair share (``kvfence.vllm.fair``) is on, and with 8 tenants that have work it orders
  the running list and the waiting queue by their counters and holds a tenant at its share of the
  slots: the fenced schedule is then not stock vLLM's. It drains differently (a heavy tenant held to
  its share finishes last, alone, in small batches: more steps, fewer requests a step), so the whole
  run's per-step and per-request figures weigh the drain; the "saturated" line compares the steps
  that left requests waiting, where both run full batches (but not the same steps: in the full
  workload fair share's run has fewer of them), and the "whole workload" line the time each scheduler
  spent serving the same requests, its drain included. With ``--fair-share-off`` the schedule must be
  step-for-step identical to stock vLLM's ("same schedule"); the per-step times are then paired, and a
  least-squares fit splits the fence's cost into a part per scheduled request, per new request
  (prefix lookup + verification + admission) and per finished one.
* ``quotas``: every tenant ``maxBlocks`` 2048 / ``guaranteedBlocks`` 256 in the engine config the
  plugin reads (KVFENCE_ENGINE_CONFIG). The heaviest tenant's requests are held back at its maximum
  (admission reserves prompt + max_tokens per request), so the fenced schedule differs (more steps,
  fewer requests per step): per scheduled request is the comparable figure there.

Rounds interleave the two (stock, fenced, stock, fenced, ...), each from a fresh scheduler, after one
untimed warm-up of each; every figure is the median over the rounds. ``--process-per-run`` runs each
round in a process forked for it alone (after a warm-up of its kind there): both schedulers run vLLM's
own code (``Scheduler.schedule``, ``KVCacheManager.allocate_slots``, ...) with objects of different
classes, and in one process CPython's adaptive specialisation of those shared call sites sees both,
which no real engine (one scheduler per process) does. It made no measurable difference to the
per-step minima (the ``--process-per-run`` row in bench/results/engine.jsonl), so one process stays the
default. ``--lockstep`` runs each round's two schedulers at once, in two forked processes (each after
its own warm-up) stepped in turn, one step each, the order swapped every step, only one running at any
time: a step of one and the same step of the other are then milliseconds apart, so a change in the
machine's other load hits both alike (on a shared VM, rounds minutes apart can give the same code
ratios 20% apart). Step times are wall clock; the same steps in the thread's CPU time ("CPU")
are shown too, as a check that preemption of the benchmark by other work on the machine did not make
the ratio. ``--floor`` adds, after each round, a lockstep round of stock vLLM against itself: the same
ratios for two identical schedulers, measured in the same minutes, say how far from 1.000 the method
lands on this machine (an unbiased method gives a median near 1.000; its spread is the noise a
fenced/stock figure carries). The verdict (:func:`verdict`) is on like-for-like figures: the mean step
where the two schedule alike, else the larger of the saturated step and the whole workload. When it
is missed (or with ``--profile``), one more run of each is made under cProfile (enabled only around
the timed calls) and the plugin's top costs are printed. The result goes to bench/results/vllm-<time>.json.

The three modes that show where the cost lands (``--callgrind``, ``--hooks``, ``--bytecodes``) are in
bench/vllm_probes.py, on this module's workload and :func:`drive`.

``--callgrind`` counts instead of timing (for machines whose other load makes a 5% difference
untimeable): one run of each scheduler under valgrind's callgrind, both at once, collection on only
inside the calls the timed runs time (``add_request`` included), the last-level cache simulated as
this machine kind's per-core L2 (the plugin's stats snapshot written every 166 steps on the scheduler's
thread, what its thread's 0.25 s interval is in real time, rather than as often as valgrind's slowness
lets it, and its once-a-second check of its key and config files every 666 steps: under valgrind a step
takes about a second, so the check ran at nearly every step, about 100k instructions a step that no
real engine spends); it reports instructions, L1 and last-level misses per step,
callgrind's cycle estimate (Ir + 10 x L1 misses + 100 x last-level misses) and the branches its
simple predictor mispredicts (conditional and indirect: the interpreter's dispatch is an indirect
branch) for each, and their fenced/stock ratios, all of the whole run's counts
(bench/results/vllm-callgrind-<time>.json). The ratios move by up to a point between runs of the
same code (bench/results/engine.jsonl), so one run does not decide a smaller change. Needs valgrind
and gcc (a two-line client-request library is compiled on the fly).

``--pure-python-records`` runs the fenced scheduler with the pure-Python prefix-cache records
(``kvfence.vllm.records.PyRecord`` and its functions), the fallback an engine runs only where the
compiled records do not load (every image ships them: docs/engine.md), instead of the compiled ones
this machine built; any mode.

``--fair-share-off`` is a BENCHMARK-ONLY A/B, not a product switch (the plugin has none: a class
with tenants always schedules by fair share): in this process and the ones it forks, the fenced
scheduler's fair-share hooks (``StepShares.before``/``after``) are patched to do nothing, so the
fenced schedule is stock vLLM's and fenced/stock is the fence's own cost. Run with and without it in
the same minutes: the difference per scheduled request is fair share's cost (its own work and the
different schedule it makes). With ``--callgrind`` its processes are started with the flag and patch
themselves. ``--split`` (with ``--lockstep``) measures both in the same rounds instead: a third
process, the fenced scheduler with fair share patched out in it alone, is stepped in lockstep with
stock and fenced, and the results add the fence alone against stock (its own verdict: the same
schedule) and fair share on top of it (as shipped against the fence alone).

``--hooks`` times where the plugin's cost lands: ``schedule`` (the fenced one includes fair share's
``StepShares.before`` and ``after``, timed apart, 0 for stock), and each vLLM method the plugin
overrides (``add_request``, ``get_computed_blocks``, ``allocate_slots``, ``get_new_blocks``,
``cache_full_blocks``, ``touch``, ``_free_request``, ``free``, ``free_blocks``), each wrapped in a
wall-clock timer, in stock and fenced runs
alike, alternating, a forked process each; per hook, microseconds per step, fenced - stock (a hook's
time includes the hooks it calls), over all steps and over the saturated ones (where fair share's
work is largest: a slot frees while requests of every tenant wait). Unlike cProfile (whose overhead
per call swamps a sub-microsecond difference) and callgrind (a simulated cache), this shows the cache
misses a hook causes on this machine. The timers cost both sides alike.

``--bytecodes`` counts Python bytecodes instead (``sys.settrace`` with opcode events, only inside the
timed calls, one run of each scheduler in this process, the stats write and file check paced as under
``--callgrind``): per step, each scheduler's total and, function by function, where the fenced run
executes more or fewer than the stock one. Deterministic and needs nothing beyond vLLM, but blind to
work done in C (the compiled records, vLLM's hashing) and to what a bytecode costs.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import hashlib
import json
import multiprocessing
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / p) for p in ("operator", "engine-image", "tests")]
if __name__ == "__main__":  # bench/vllm_probes.py imports this module by name: this one, not a second copy
    sys.modules.setdefault("bench_vllm", sys.modules[__name__])
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import vllm  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm_engine.vllmsched import Harness, base_config, pure_python_records  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
MAX_NUM_SEQS = 128
MAX_BATCHED_TOKENS = 8192
MAX_MODEL_LEN = 4096
VOCAB = 4096  # the tiny model's
TENANTS = [f"t{i}" for i in range(8)]
CONCURRENCY = [48, 32, 24, 20, 16, 16, 16, 16]  # concurrent users per tenant (closed loop)
VARIANTS: dict[str, dict[str, Any]] = {
    "no quotas": {},
    "quotas": {t: {"maxBlocks": 2048, "guaranteedBlocks": 256} for t in TENANTS},
}
SAMPLED = 7  # the fake model's token
TARGET = 1.05
KINDS = ("stock", "fenced")
COST_TERMS = ("per_sched_req", "per_new_req", "per_finished_req")


@dataclass(frozen=True)
class Spec:
    tenant: str
    rid: str
    prompt: list[int]
    max_tokens: int


def workload(requests_per_user: int, seed: int) -> dict[str, list[Spec]]:
    """Per tenant, the requests its users send, in order."""
    rng = random.Random(seed)
    out: dict[str, list[Spec]] = {}
    for t, users in zip(TENANTS, CONCURRENCY, strict=True):
        system = [rng.randrange(VOCAB) for _ in range(rng.randint(32, 96) * BLOCK_SIZE)]
        specs = []
        for k in range(users * requests_per_user):
            suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(16, 240))]
            specs.append(Spec(t, f"{t}-{k}", system + suffix, rng.randint(16, 256)))
        out[t] = specs
    return out


@dataclass
class Run:
    """One scheduler's pass over the whole workload."""

    kind: str
    step_ns: list[int] = field(default_factory=list)
    #: the same steps in this thread's CPU time (immune to the scheduler thread being preempted)
    cpu_ns: list[int] = field(default_factory=list)
    #: per step: requests scheduled, new requests scheduled, requests finished
    shape: list[tuple[int, int, int]] = field(default_factory=list)
    #: per step: requests were left waiting after it (the engine saturated; see :meth:`saturated_summary`)
    saturated: list[bool] = field(default_factory=list)
    schedule_ns: int = 0
    update_ns: int = 0
    add_ns: int = 0
    added: int = 0
    scheduled_reqs: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    vllm_queries: int = 0
    vllm_hits: int = 0
    preempted: int = 0
    finish: dict[str, int] = field(default_factory=dict)
    fingerprint: str = ""
    fence: dict[str, Any] = field(default_factory=dict)
    #: --hooks: ns spent inside each timed vLLM method (HOOKS), over the whole run
    hooks: dict[str, int] = field(default_factory=dict)
    #: --hooks: the same, over the saturated steps only
    hooks_saturated: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        s = sorted(self.step_ns)
        total = sum(s)
        return {
            "steps": len(s),
            "mean_us": total / len(s) / 1e3,
            "p50_us": s[len(s) // 2] / 1e3,
            "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3,
            "cpu_mean_us": sum(self.cpu_ns) / len(s) / 1e3,
            "total_ms": total / 1e6,
            "schedule_ms": self.schedule_ns / 1e6,
            "update_ms": self.update_ns / 1e6,
            "us_per_sched_req": total / self.scheduled_reqs / 1e3,
            "reqs_per_step": self.scheduled_reqs / len(s),
            "add_us_per_req": self.add_ns / self.added / 1e3,
            **self.saturated_summary(),
        }

    def saturated_summary(self) -> dict[str, float]:
        """The steps after which requests were still waiting: the engine saturated, every slot or the
        token budget taken. Fair share changes how a finite workload drains (a heavy tenant held to
        its share all along finishes last, alone, in small batches: more steps, fewer requests each),
        which weighs on per-step and per-request figures over the whole run; over the saturated steps
        both schedulers run full batches of the same workload."""
        steps = [ns for ns, sat in zip(self.step_ns, self.saturated, strict=True) if sat]
        reqs = sum(sh[0] for sh, sat in zip(self.shape, self.saturated, strict=True) if sat)
        return {
            "saturated_steps": len(steps),
            "saturated_mean_us": sum(steps) / max(1, len(steps)) / 1e3,
            "saturated_us_per_sched_req": sum(steps) / max(1, reqs) / 1e3,
            "saturated_reqs_per_step": reqs / max(1, len(steps)),
        }


class Drive:
    """One pass of the workload through a built scheduler: the closed-loop users, the timed calls and
    the counts kept between steps (see :func:`drive`)."""

    def __init__(
        self, h: Harness, streams: dict[str, list[Spec]], run: Run, prof: cProfile.Profile | None
    ) -> None:
        self.h, self.sched, self.streams, self.run = h, h.sched, streams, run
        self.nxt = dict.fromkeys(TENANTS, 0)
        self.users = dict(zip(TENANTS, CONCURRENCY, strict=True))
        self.open_ = dict.fromkeys(TENANTS, 0)
        self.tenant_of: dict[str, str] = {}
        self.seen: set[str] = set()
        self.digest = hashlib.sha256()
        self.on: Callable[[], None] = prof.enable if prof is not None else (lambda: None)
        self.off: Callable[[], None] = prof.disable if prof is not None else (lambda: None)
        self.add_step = self.add_cpu = 0  # add_request time since the last step

    def send_arrivals(self) -> None:
        """Every user with nothing outstanding sends its next request (``add_request`` timed)."""
        h, sched, run, on, off = self.h, self.sched, self.run, self.on, self.off
        pc, tt = time.perf_counter_ns, time.thread_time_ns
        for t in TENANTS:
            stream = self.streams[t]
            while self.open_[t] < self.users[t] and self.nxt[t] < len(stream):
                spec = stream[self.nxt[t]]
                self.nxt[t] += 1
                # Fresh int objects for every request, as vLLM's engine core decodes each
                # request's token ids (msgspec): prompts of one tenant share no int objects.
                prompt = array("q", spec.prompt).tolist()
                req = h.make(t, prompt, spec.max_tokens, request_id=spec.rid)
                self.tenant_of[spec.rid] = t
                on()
                c0 = tt()
                t0 = pc()
                sched.add_request(req)
                t1 = pc()
                c1 = tt()
                off()
                run.add_ns += t1 - t0
                self.add_step += t1 - t0
                self.add_cpu += c1 - c0
                run.added += 1
                self.open_[t] += 1

    def step(self, writer: Any, stats_every: int) -> None:
        """One engine step: ``schedule()`` and ``update_from_output()`` timed (with the stats write
        when ``writer`` is due), the model's part not."""
        sched, requests, run, on, off = self.sched, self.sched.requests, self.run, self.on, self.off
        pc, tt = time.perf_counter_ns, time.thread_time_ns
        on()
        c0 = tt()
        t0 = pc()
        out = sched.schedule()
        t1 = pc()
        c1 = tt()
        off()
        run.saturated.append(bool(sched.waiting))
        # The model's part (not timed): one token for every request whose prompt is complete
        # (schedule() has already advanced num_computed_tokens by what it scheduled).
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = requests[rid]
            sampled.append([SAMPLED] if r.num_computed_tokens >= r.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        on()
        c2 = tt()
        t2 = pc()
        ecos = sched.update_from_output(out, mro)
        if writer is not None and len(run.step_ns) % stats_every == 0:
            writer.write()
        t3 = pc()
        c3 = tt()
        off()
        # The step includes the add_request calls before it: vLLM's engine core adds arriving
        # requests on the scheduler's thread, and the plugin does work there too.
        run.step_ns.append(t1 - t0 + t3 - t2 + self.add_step)
        run.cpu_ns.append(c1 - c0 + c3 - c2 + self.add_cpu)
        self.add_step = self.add_cpu = 0
        run.schedule_ns += t1 - t0
        run.update_ns += t3 - t2
        run.scheduled_reqs += len(ids)
        self.record(out, ids, ecos)

    def record(self, out: Any, ids: list[str], ecos: Any) -> None:
        """The step's counts: its schedule in the fingerprint, new requests' cache hits, preemptions,
        vLLM's prefix-cache stats and the finished requests (whose users send again)."""
        run = self.run
        self.digest.update(repr(sorted(out.num_scheduled_tokens.items())).encode())
        new = 0
        for nr in out.scheduled_new_reqs:
            if nr.req_id in self.seen:  # resumed after preemption
                continue
            self.seen.add(nr.req_id)
            new += 1
            t = self.tenant_of[nr.req_id]
            run.hit_tokens[t] = run.hit_tokens.get(t, 0) + nr.num_computed_tokens
            run.prompt_tokens[t] = run.prompt_tokens.get(t, 0) + len(nr.prompt_token_ids or ())
        run.preempted += len(out.preempted_req_ids or ())
        finished = 0
        for eco in ecos.values():
            st = eco.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                run.vllm_queries += st.prefix_cache_stats.queries
                run.vllm_hits += st.prefix_cache_stats.hits
            for o in eco.outputs:
                if o.finish_reason is not None:
                    reason = str(o.finish_reason)
                    run.finish[reason] = run.finish.get(reason, 0) + 1
                    self.open_[self.tenant_of[o.request_id]] -= 1
                    finished += 1
        run.shape.append((len(ids), new, finished))


def fence_counters(c: Any) -> dict[str, Any]:
    return {
        "hash_collision": c.hash_collision,
        "cross_access_rejected": c.cross_access_rejected,
        "stale_reference": c.stale_reference,
        "evictions_own": c.evictions_own,
        "evictions_cross": c.evictions_cross,
        "quota_held_back": dict(c.quota_held_back),
        "quota_rejected": dict(c.quota_rejected),
        "identity_rejected": dict(c.identity_rejected),
    }


def drive(
    kind: str,
    streams: dict[str, list[Spec]],
    quotas: dict[str, Any],
    config: Any,
    prof: cProfile.Profile | None = None,
    stats_every: int = 0,
    reload_every: int = 0,
    pace: Callable[[], None] | None = None,
) -> Run:
    """Runs the whole workload through a fresh scheduler of ``kind`` (stock or fenced). ``stats_every``:
    instead of the plugin's stats thread (a snapshot every 0.25 s of wall time), its write is made on
    the scheduler's thread every that many steps, inside the timed calls. ``reload_every``: the
    plugin's check of its key and config files (every second of wall time) is made at the first
    call of every that many steps instead, counted (see :func:`callgrind`). ``pace``: called before
    each step (its arriving requests included), outside the timed calls (see :func:`lockstep`)."""
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-vllm-") as tmp:
        h = Harness(
            Path(tmp),
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            quotas=quotas,
            config=config,
            stock=kind == "stock",
        )
        sched = h.sched
        run = Run(kind)
        writer = getattr(sched, "stats", None) if stats_every else None
        if writer is not None:
            writer.stop()  # its thread ends; write() is called below instead
        # The fenced scheduler checks its files when its clock passes _next_reload (FenceMixin._maybe_reload).
        reloader: Any = sched if reload_every and hasattr(sched, "_next_reload") else None
        d = Drive(h, streams, run, prof)
        # As vLLM's engine core does once its scheduler is built (vllm.utils.gc_utils.freeze_gc_heap):
        # the startup heap, the scheduler's structures included, is frozen out of the collector.
        gc.collect()
        gc.freeze()
        try:
            while True:
                if pace is not None:
                    pace()
                if reloader is not None:  # due at this step's first call, or not before the next such step
                    reloader._next_reload = 0.0 if len(run.step_ns) % reload_every == 0 else float("inf")
                d.send_arrivals()
                if not sched.has_requests():
                    break
                d.step(writer, stats_every)
            run.fingerprint = d.digest.hexdigest()[:16]
            if h.fence is not None:
                h.check()  # the shadow still agrees with vLLM's pool (not timed)
                run.fence = fence_counters(h.fence.counters)
        finally:
            gc.unfreeze()
            sched.shutdown()
    assert run.added == sum(len(s) for s in streams.values()), "not every request was sent"
    assert sum(run.finish.values()) == run.added, f"not every request finished: {run.finish}"
    return run


def isolated(fn: Callable[[], Run]) -> Run:
    """``fn()`` in a child process forked for it (see the module docstring), its result sent back."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def target() -> None:
        try:
            send.send(("ok", fn()))
        except BaseException as e:  # reported to the parent, which raises it
            send.send(("error", f"{type(e).__name__}: {e}"))

    proc = ctx.Process(target=target)
    proc.start()
    status, value = recv.recv()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"benchmark run failed in its process: {value}")
    run: Run = value
    return run


def lockstep(
    streams: dict[str, list[Spec]],
    warm: dict[str, list[Spec]],
    quotas: dict[str, Any],
    config: Any,
    sides: dict[str, str] | None = None,
) -> dict[str, Run]:
    """One round of both schedulers in lockstep: each in a process forked for it (after a warm-up of
    its kind there), the two stepped in turn, one step each, the order swapped every step, so that a
    step of one and the same step of the other are milliseconds apart and see the same machine. Only
    one of them runs at any time (the other waits on its pipe). Rounds minutes apart on a shared VM
    saw the same code's ratio move by 20%; this pairs every step instead. ``sides``: label -> the
    scheduler kind run under it (default: stock and fenced; the A/A floor runs stock on both;
    ``--split`` adds :data:`FENCE_ONLY`, the fenced scheduler without fair share). With more than two
    sides each step's order is a permutation drawn anew (seeded): a fixed order reversed every step
    would run the sides at its ends twice in a row at every turn, their caches still warm, and the
    middle one never."""
    sides = sides or {k: k for k in KINDS}
    labels = list(sides)
    ctx = multiprocessing.get_context("fork")
    conns: dict[str, Any] = {}
    procs: dict[str, Any] = {}
    for label in labels:
        parent, child = ctx.Pipe()

        def target(kind: str = sides[label], conn: Any = child) -> None:
            try:
                if kind == FENCE_ONLY:  # in this forked process alone
                    patch_out_fair_share()
                drive(kind, warm, quotas, config)  # warm-up of this kind, not counted

                def pace() -> None:
                    conn.send(None)  # the previous step is done (or: ready for the first)
                    conn.recv()

                conn.send(("ok", drive(kind, streams, quotas, config, pace=pace)))
            except BaseException as e:  # reported to the parent, which raises it
                conn.send(("error", f"{type(e).__name__}: {e}"))

        procs[label] = ctx.Process(target=target)
        procs[label].start()
        conns[label] = parent
    done: dict[str, Any] = {}
    for label in labels:  # each one's first message: ready for its first step (or its failure)
        msg = conns[label].recv()
        if msg is not None:
            done[label] = msg
    step = 0
    shuffle = random.Random(len(labels)).sample
    while len(done) < len(labels):
        pair_order = labels if step % 2 == 0 else labels[::-1]
        for label in shuffle(labels, len(labels)) if len(labels) > 2 else pair_order:
            if label in done:
                continue
            conns[label].send(True)  # go: one step
            msg = conns[label].recv()  # None once it is done, ready for the next; its result at the end
            if msg is not None:
                done[label] = msg
        step += 1
    for proc in procs.values():
        proc.join()
    runs: dict[str, Run] = {}
    for label, (status, value) in done.items():
        if status != "ok":
            raise RuntimeError(f"benchmark run of {label} failed in its process: {value}")
        runs[label] = value
    return runs


#: the A/A floor's two sides: stock vLLM against itself, in lockstep (--floor)
FLOOR_SIDES = {"stock": "stock", "stock again": "stock"}
#: ``--split``'s third side: the fenced scheduler with fair share patched out in its process
FENCE_ONLY = "fence only"
SPLIT_SIDES = {**{k: k for k in KINDS}, FENCE_ONLY: FENCE_ONLY}


def step_ratios(first: list[Run], second: list[Run]) -> tuple[list[float], float]:
    """second/first of the mean step time in each round, and of the per-step minima over the rounds
    (each step's fastest of the rounds, summed: noise only adds time)."""
    per_round = [b.summary()["mean_us"] / a.summary()["mean_us"] for a, b in zip(first, second, strict=True)]
    minima = float(
        np.min(np.array([r.step_ns for r in second]), axis=0).sum()
        / np.min(np.array([r.step_ns for r in first]), axis=0).sum()
    )
    return per_round, minima


def cost_model(stock: list[Run], fenced: list[Run]) -> dict[str, float]:
    """Least-squares fit of the per-step CPU time (median over rounds; CPU time, so that a step in
    which the benchmark was preempted does not skew the fit) to b * requests scheduled + c * new
    requests + d * requests finished, for stock and for the paired difference fenced - stock. Only
    meaningful when both scheduled identically (the same steps, the same requests in each). No
    intercept: nearly every step schedules max_num_seqs requests, so a per-step constant could not be
    told apart from the per-request term (it is folded into it)."""
    shape = np.array(stock[0].shape, dtype=float)
    s = np.median(np.array([r.cpu_ns for r in stock], dtype=float), axis=0) / 1e3
    f = np.median(np.array([r.cpu_ns for r in fenced], dtype=float), axis=0) / 1e3
    out: dict[str, float] = {}
    for label, y in (("stock", s), ("extra", f - s)):
        coef = np.linalg.lstsq(shape, y, rcond=None)[0]
        for name, c in zip(COST_TERMS, coef, strict=True):
            out[f"{label}_{name}_us"] = float(c)
    means = shape.mean(axis=0)
    out["mean_sched_reqs"], out["mean_new_reqs"], out["mean_finished_reqs"] = (float(x) for x in means)
    return out


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")


#: the plugin's overrides and the fence calls they make (for the inclusive-time table)
ENTRY_POINTS = {
    "schedule",
    "_hold_back",
    "_maybe_reload",
    "update_from_output",
    "_free_request",
    "add_request",
    "_identify",
    "get_computed_blocks",
    "verify",
    "allocate_slots",
    "free",
    "get_num_free_blocks",
    "obtainable",
    "get_new_blocks",
    "take",
    "touch",
    "revive",
    "free_blocks",
    "released",
    "cache_full_blocks",
    "intern",
}


def profile(streams: dict[str, list[Spec]], quotas: dict[str, Any], config: Any) -> dict[str, Any]:
    """cProfile of one stock and one fenced run (the timed calls only): where the fenced run's extra
    time goes. cProfile inflates Python call overhead, so shares are indicative, not exact."""
    stats: dict[str, Any] = {}
    for kind in KINDS:
        prof = cProfile.Profile()
        drive(kind, streams, quotas, config, prof)
        stats[kind] = pstats.Stats(prof)
    stock_total: float = stats["stock"].total_tt
    fenced_total: float = stats["fenced"].total_tt
    raw: dict[Any, Any] = stats["fenced"].stats
    stock_raw: dict[Any, Any] = stats["stock"].stats
    plugin_root = str(ROOT / "engine-image" / "kvfence")

    def name(fn: tuple[str, int, str]) -> str:
        path, line, func = fn
        short = "/".join(Path(path).parts[-3:]) if os.sep in path else path
        return f"{short}:{line}({func})"

    def is_plugin(fn: tuple[str, int, str]) -> bool:
        return fn[0].startswith(plugin_root)

    # Self time of kvfence code (kvfence.vllm.* and the kvfence.isolation.* it calls).
    own = sorted(((fn, v[2], v[1]) for fn, v in raw.items() if is_plugin(fn)), key=lambda x: -x[1])
    plugin_self = sum(x[1] for x in own)
    # Self time that grew against the stock run, any code (vLLM code that runs more, builtins the
    # plugin calls).
    none = (0, 0, 0.0, 0.0)
    delta = sorted(
        ((fn, v[2] - stock_raw.get(fn, none)[2], v[1] - stock_raw.get(fn, none)[1]) for fn, v in raw.items()),
        key=lambda x: -x[1],
    )
    entry = sorted(
        (
            (fn, v[3], v[1])
            for fn, v in raw.items()
            if is_plugin(fn) and fn[2] in ENTRY_POINTS and f"{os.sep}vllm{os.sep}" in fn[0]
        ),
        key=lambda x: -x[1],
    )
    return {
        "stock_total_s": stock_total,
        "fenced_total_s": fenced_total,
        "profiled_ratio": fenced_total / stock_total,
        "plugin_self_s": plugin_self,
        "plugin_self_share": plugin_self / fenced_total,
        "top_plugin_self": [
            {"function": name(fn), "self_s": tt, "share": tt / fenced_total, "calls": n}
            for fn, tt, n in own[:15]
        ],
        "top_extra_vs_stock": [
            {"function": name(fn), "extra_self_s": d, "share": d / fenced_total, "extra_calls": n}
            for fn, d, n in delta[:15]
        ],
        "plugin_inclusive": [
            {"function": name(fn), "cum_s": ct, "share": ct / fenced_total, "calls": n} for fn, ct, n in entry
        ],
    }


def print_profile(label: str, p: dict[str, Any]) -> None:
    print(
        f"\nProfile [{label}] (cProfile around the timed calls only): stock {p['stock_total_s']:.3f} s, "
        f"fenced {p['fenced_total_s']:.3f} s (x{p['profiled_ratio']:.2f} under the profiler); self time "
        f"in kvfence code {p['plugin_self_s']:.3f} s = {100 * p['plugin_self_share']:.1f}% of the fenced run"
    )
    table(
        f"[{label}] Self time in kvfence code (share of the fenced run's profiled time)",
        ["function", "calls", "self s", "share"],
        [
            [x["function"], f"{x['calls']:,}", f"{x['self_s']:.4f}", f"{100 * x['share']:.2f}%"]
            for x in p["top_plugin_self"]
        ],
    )
    table(
        f"[{label}] Plugin overrides and fence calls, inclusive (with the vLLM code they wrap)",
        ["function", "calls", "cum s", "share"],
        [
            [x["function"], f"{x['calls']:,}", f"{x['cum_s']:.4f}", f"{100 * x['share']:.2f}%"]
            for x in p["plugin_inclusive"]
        ],
    )
    table(
        f"[{label}] Self time added against the stock run, any code",
        ["function", "extra calls", "extra self s", "share"],
        [
            [x["function"], f"{x['extra_calls']:,}", f"{x['extra_self_s']:.4f}", f"{100 * x['share']:.2f}%"]
            for x in p["top_extra_vs_stock"]
        ],
    )


def pair_ratios(first: list[Run], second: list[Run]) -> dict[str, Any]:
    """``second``/``first`` of each round's figures (the two runs of a round are a pair), the median
    over the rounds and each round's: what :func:`verdict` decides on."""
    pairs = list(zip(first, second, strict=True))
    ratio_step, minima = step_ratios(first, second)
    ratio_req = [f.summary()["us_per_sched_req"] / s.summary()["us_per_sched_req"] for s, f in pairs]
    ratio_cpu = [f.summary()["cpu_mean_us"] / s.summary()["cpu_mean_us"] for s, f in pairs]
    sat_step, sat_req = "saturated_mean_us", "saturated_us_per_sched_req"
    # A light engine (--users) may never leave a request waiting: no saturated figures then.
    saturated = all(r.summary()["saturated_steps"] for r in (*first, *second))
    ratio_sat = [f.summary()[sat_step] / s.summary()[sat_step] for s, f in pairs] if saturated else []
    ratio_sat_req = [f.summary()[sat_req] / s.summary()[sat_req] for s, f in pairs] if saturated else []
    ratio_total = [f.summary()["total_ms"] / s.summary()["total_ms"] for s, f in pairs]
    same = first[0].fingerprint == second[0].fingerprint
    return {
        "same_schedule": same,
        "ratio_mean_step": statistics.median(ratio_step),
        "ratio_mean_step_per_round": ratio_step,
        "ratio_per_sched_req": statistics.median(ratio_req),
        "ratio_per_sched_req_per_round": ratio_req,
        "ratio_cpu_mean_step": statistics.median(ratio_cpu),
        "ratio_cpu_mean_step_per_round": ratio_cpu,
        "ratio_saturated_step": statistics.median(ratio_sat) if saturated else None,
        "ratio_saturated_step_per_round": ratio_sat,
        "ratio_saturated_per_sched_req": statistics.median(ratio_sat_req) if saturated else None,
        "ratio_total": statistics.median(ratio_total),
        "ratio_total_per_round": ratio_total,
        # Identical schedules: each step's fastest of the rounds, summed (the least disturbed estimate).
        "ratio_min_per_step": minima if same else None,
    }


def split_figures(stock: list[Run], fence_only: list[Run], fenced: list[Run]) -> dict[str, Any]:
    """``--split``: the fence alone against stock vLLM (the same schedule; its own :func:`verdict`),
    and fair share's cost on top of it (as shipped against the fence alone), from the same rounds."""
    fence = pair_ratios(stock, fence_only)
    fence["verdict"] = verdict(fence)
    return {"fence_only": fence, "fair_share_on_fence": pair_ratios(fence_only, fenced)}


def summarize(label: str, got: dict[str, list[Run]]) -> dict[str, Any]:
    stock, fenced = got["stock"], got["fenced"]
    for kind in got:  # deterministic: every round schedules alike
        assert len({r.fingerprint for r in got[kind]}) == 1, f"{label}/{kind}: rounds scheduled differently"
    res: dict[str, Any] = {"quotas": VARIANTS[label], **pair_ratios(stock, fenced)}
    res["cost_model"] = cost_model(stock, fenced) if res["same_schedule"] else None
    res["verdict"] = verdict(res)
    if FENCE_ONLY in got:
        res["split"] = split_figures(stock, got[FENCE_ONLY], fenced)
    for kind, runs in got.items():
        first = runs[0]  # counts are the same in every round (checked above)
        prompt = sum(first.prompt_tokens.values())
        res[kind] = {
            **{k: statistics.median(r.summary()[k] for r in runs) for k in first.summary()},
            "rounds": [r.summary() for r in runs],
            "hit_rate": sum(first.hit_tokens.values()) / max(1, prompt),
            "hit_rate_by_tenant": {
                t: first.hit_tokens.get(t, 0) / max(1, first.prompt_tokens.get(t, 0)) for t in TENANTS
            },
            "vllm_prefix_cache_stats": {"queries": first.vllm_queries, "hits": first.vllm_hits},
            "preempted": first.preempted,
            "fingerprint": first.fingerprint,
            "finish": first.finish,
            "fence": first.fence,
        }
    return res


def step_table(results: dict[str, Any], rounds: int, n_req: int) -> None:
    """Each variant's stock and fenced step times, with the fenced/stock ratios."""
    rows = []
    for label, res in results.items():
        for kind in [k for k in SPLIT_SIDES if k in res]:
            x = res[kind]
            # the ratios to stock: as shipped, or (--split) the fence alone
            ratios = res if kind == "fenced" else res["split"]["fence_only"] if kind == FENCE_ONLY else None
            rows.append(
                [
                    label,
                    kind,
                    f"{x['steps']:,.0f}",
                    f"{x['reqs_per_step']:.1f}",
                    f"{x['mean_us']:.0f}",
                    f"{x['p50_us']:.0f}",
                    f"{x['p99_us']:.0f}",
                    f"{x['cpu_mean_us']:.0f}",
                    f"{x['us_per_sched_req']:.2f}",
                    f"{x['add_us_per_req']:.1f}",
                    f"{ratios['ratio_mean_step']:.3f}" if ratios else "",
                    f"{ratios['ratio_cpu_mean_step']:.3f}" if ratios else "",
                    f"{ratios['ratio_per_sched_req']:.3f}" if ratios else "",
                    ("yes" if ratios["same_schedule"] else "no") if ratios else "",
                    f"{100 * x['hit_rate']:.1f}%",
                ]
            )
    table(
        "Scheduler step = add_request() + schedule() + update_from_output(); medians of "
        f"{rounds} interleaved rounds "
        f"({n_req} requests, {NUM_BLOCKS} blocks of {BLOCK_SIZE}, max_num_seqs {MAX_NUM_SEQS}, "
        f"max_num_batched_tokens {MAX_BATCHED_TOKENS}; vLLM {vllm.__version__})",
        [
            "variant",
            "scheduler",
            "steps",
            "reqs/step",
            "mean us",
            "p50 us",
            "p99 us",
            "CPU mean us",
            "us/sched req",
            "add_request us",
            "fenced/stock step",
            "fenced/stock CPU",
            "fenced/stock per req",
            "same schedule",
            "hit rate",
        ],
        rows,
    )


def hit_rate_table(results: dict[str, Any]) -> None:
    hrows = []
    for label, res in results.items():
        for t in TENANTS:
            s, f = res["stock"]["hit_rate_by_tenant"][t], res["fenced"]["hit_rate_by_tenant"][t]
            hrows.append([label, t, f"{100 * s:.2f}%", f"{100 * f:.2f}%", f"{100 * (f - s):+.2f}"])
    table(
        "Prefix-cache hit rate per tenant (prompt tokens served from the cache when first scheduled)",
        ["variant", "tenant", "stock", "fenced", "fenced - stock (pp)"],
        hrows,
    )


def cost_model_tables(results: dict[str, Any]) -> None:
    """The per-step cost model of each variant that scheduled alike."""
    for label, res in results.items():
        cm = res["cost_model"]
        if cm is None:
            continue
        table(
            f"[{label}] Per-step cost model (CPU time, least squares over {res['stock']['steps']:.0f} "
            "paired steps; "
            f"a step has on average {cm['mean_sched_reqs']:.1f} scheduled, {cm['mean_new_reqs']:.2f} new "
            f"and {cm['mean_finished_reqs']:.2f} finished requests)",
            ["term", "stock us", "added by the plugin us", "added %"],
            [
                [
                    term.replace("_", " "),
                    f"{cm[f'stock_{term}_us']:.2f}",
                    f"{cm[f'extra_{term}_us']:.2f}",
                    f"{100 * cm[f'extra_{term}_us'] / cm[f'stock_{term}_us']:+.0f}%",
                ]
                for term in COST_TERMS
            ],
        )


def verdict(res: dict[str, Any]) -> dict[str, Any]:
    """The target's verdict on like-for-like figures. The same schedule: the mean step, and the
    per-step minima (the median of a few rounds swings by several points between runs of the same
    code; the minima, noise only adding time, swing less): both at or under the target. Different
    schedules (fair share on): the per-step mean weighs steps the two do not share (fair share drains
    a finite workload in more, smaller steps), so the saturated steps and the whole workload's time
    decide, the larger of the two."""
    if res["same_schedule"]:
        figure, ratio, per_round = "mean step", res["ratio_mean_step"], res["ratio_mean_step_per_round"]
        minima = res["ratio_min_per_step"]
        met = ratio <= TARGET and (minima is None or minima <= TARGET)
    else:
        sat, tot = res["ratio_saturated_step"], res["ratio_total"]
        if sat is not None and sat >= tot:
            figure, ratio, per_round = "saturated step", sat, res["ratio_saturated_step_per_round"]
        else:
            figure, ratio, per_round = "whole workload", tot, res["ratio_total_per_round"]
        met = ratio <= TARGET
    under = sum(1 for x in per_round if x <= TARGET)
    return {"figure": figure, "ratio": ratio, "met": met, "rounds_under": under, "rounds": len(per_round)}


def verdict_text(v: dict[str, Any]) -> str:
    """A :func:`verdict` in words."""
    return (
        f"on the {v['figure']}: {v['ratio']:.3f} ({'met' if v['met'] else 'NOT met'}; {v['rounds_under']} of "
        f"{v['rounds']} rounds at or under {TARGET:.2f})"
    )


def print_targets(results: dict[str, Any]) -> None:
    """Per variant: the target's verdict, and the A/A floor's ratios where measured."""
    for label, res in results.items():
        v = res["verdict"]
        minima = res["ratio_min_per_step"]
        print(
            f"target [{label}]: fenced/stock <= {TARGET:.2f}, {verdict_text(v)}; mean step "
            f"{res['ratio_mean_step']:.3f}, in CPU time {res['ratio_cpu_mean_step']:.3f}, "
            + (f"per-step minima over the rounds {minima:.3f}, " if minima is not None else "")
            + f"per scheduled request {res['ratio_per_sched_req']:.3f}"
        )
        sat = res["ratio_saturated_step_per_round"]
        st, fe = res["stock"], res["fenced"]
        if not sat:
            print(f"saturated [{label}]: no step left requests waiting (a light engine): no such figures")
        else:
            print(
                f"saturated [{label}]: over the steps that left requests waiting (stock "
                f"{st['saturated_steps']:.0f}, fenced {fe['saturated_steps']:.0f}; requests "
                f"a step {st['saturated_reqs_per_step']:.1f} / {fe['saturated_reqs_per_step']:.1f}) "
                f"fenced/stock mean step {res['ratio_saturated_step']:.3f} ({sum(x <= TARGET for x in sat)} "
                f"of {len(sat)} rounds at or under {TARGET:.2f}), per scheduled request "
                f"{res['ratio_saturated_per_sched_req']:.3f}"
            )
        tot = res["ratio_total_per_round"]
        print(
            f"whole workload [{label}]: fenced/stock of the time the scheduler spent serving the same "
            f"requests (steps: stock {st['steps']:.0f}, fenced {fe['steps']:.0f}) {res['ratio_total']:.3f} "
            f"({sum(x <= TARGET for x in tot)} of {len(tot)} rounds at or under {TARGET:.2f})"
        )
        if "split" in res:
            print_split(label, res["split"])
        aa = res.get("floor")
        if aa is not None:
            aa_rounds = aa["ratio_mean_step_per_round"]
            print(
                f"floor [{label}]: stock/stock in lockstep, the same rounds: {aa['ratio_mean_step']:.3f} "
                f"(rounds {min(aa_rounds):.3f}-{max(aa_rounds):.3f}); per-step minima "
                f"{aa['ratio_min_per_step']:.3f}: how far from 1.000 the method itself lands here"
            )


def print_split(label: str, split: dict[str, Any]) -> None:
    """``--split``'s two lines: the fence alone against stock, and fair share on top of it."""
    fence, fair = split["fence_only"], split["fair_share_on_fence"]
    minima = fence["ratio_min_per_step"]
    print(
        f"split [{label}]: the fence alone (fair share patched out, the same rounds) / stock, "
        f"{verdict_text(fence['verdict'])}; same schedule: {fence['same_schedule']}"
        + (f"; per-step minima {minima:.3f}" if minima is not None else "")
    )
    sat = fair["ratio_saturated_step"]
    print(
        f"split [{label}]: fair share on top of the fence (as shipped / fence alone): saturated step "
        f"{'n/a' if sat is None else f'{sat:.3f}'}, whole workload {fair['ratio_total']:.3f}, mean step "
        f"{fair['ratio_mean_step']:.3f}"
    )


def report(results: dict[str, Any], rounds: int, n_req: int) -> None:
    step_table(results, rounds, n_req)
    hit_rate_table(results)
    cost_model_tables(results)
    print()
    for label, res in results.items():
        print(
            f"[{label}] fence counters {json.dumps(res['fenced']['fence'])}; preempted: stock "
            f"{res['stock']['preempted']}, fenced {res['fenced']['preempted']}; vLLM PrefixCacheStats: stock "
            f"{res['stock']['vllm_prefix_cache_stats']}, fenced {res['fenced']['vllm_prefix_cache_stats']}"
        )
    print()
    print_targets(results)


HIT_TENANTS = ["h0", "h1", "h2", "h3"]
#: about 1,000 tokens of the tiny model's tokenizer: the system prompt every tenant's requests start with
HIT_SYSTEM = " ".join(
    f"Rule {i}: answer the customer politely, cite the manual section, never guess prices." for i in range(40)
)


def hit_rates(config: Any, rounds: int, seed: int) -> list[list[str]]:
    """The shared-system-prompt workload of bench/bench_engine.py on vLLM's own scheduler (one trust
    class, 4 tenants; one system prompt + a 256-token context per tenant + a 64-token question per
    request, one request at a time): the prefix-cache hit rate (tokens) of stock vLLM without a salt
    ("global", no isolation), the plugin with TrustClass scope, with Tenant scope, and with Tenant scope
    plus the system prompt declared as a shared prefix, in a roomy pool and a tight one."""
    from vllm_engine.vllmsched import salt_of

    rows = []
    for pool_label in ("roomy", "tight"):
        for mode in ("Tenant", "Tenant+shared", "TrustClass", "global"):
            with tempfile.TemporaryDirectory(prefix="kvfence-bench-hits-") as tmp:
                shared = [{"name": "system", "form": "completion", "text": HIT_SYSTEM}]
                probe = Harness(
                    Path(tmp) / "probe", num_blocks=256, block_size=BLOCK_SIZE, shared=shared, config=config
                )
                probe.step()
                probe.run()
                system = list(probe.fence.shared[0].tokens)  # the declared prompt, as vLLM tokenizes it
                probe.sched.shutdown()
                per_request = -(-(len(system) + 256 + 64) // BLOCK_SIZE)
                blocks = NUM_BLOCKS if pool_label == "roomy" else 3 * per_request
                h = Harness(
                    Path(tmp) / "run",
                    num_blocks=blocks,
                    block_size=BLOCK_SIZE,
                    shared=shared if mode == "Tenant+shared" else [],
                    stock=mode == "global",
                    config=config,
                )
                if mode == "Tenant+shared":
                    h.step()  # the plugin computes and pins the declared prefix
                    h.run()
                rng = random.Random(seed)
                context = {t: [rng.randrange(VOCAB) for _ in range(256)] for t in HIT_TENANTS}
                hits = total = 0
                for _ in range(rounds):
                    for t in HIT_TENANTS:
                        prompt = [*system, *context[t], *(rng.randrange(VOCAB) for _ in range(64))]
                        scope = "TrustClass" if mode == "TrustClass" else "Tenant"
                        salt = "" if mode == "global" else salt_of(t, scope)
                        req = h.add(t, prompt, 1, salt=salt)
                        hits += h.hits(h.step(), req.request_id)
                        total += len(prompt)
                        h.run()
                h.sched.shutdown()
            label = {
                "Tenant": "Tenant (kvfence default)",
                "Tenant+shared": "Tenant + declared shared prefix",
                "TrustClass": "TrustClass",
                "global": "global (stock vLLM, no salt)",
            }[mode]
            rows.append([pool_label, label, str(blocks), f"{100 * hits / total:.1f}%"])
    return rows


def write_results(prefix: str, doc: dict[str, Any]) -> Path:
    """``doc`` as bench/results/<prefix>-<time>.json (not committed); its path."""
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def records_kind(a: argparse.Namespace) -> str:
    return "pure-Python" if a.pure_python_records else "compiled"


def fair_share_kind(a: argparse.Namespace) -> str:
    return "off (bench-only A/B: StepShares.before/after patched out)" if a.fair_share_off else "on"


def patch_out_fair_share() -> None:
    """BENCHMARK-ONLY A/B, never a product switch: the fenced scheduler's fair-share hooks
    (:class:`kvfence.vllm.fair.StepShares` ``before``/``after``) replaced by no-ops in this process
    (and the processes it forks), so that the fenced schedule is stock vLLM's and the ratio is the
    fence's own cost (see ``--fair-share-off``)."""
    from kvfence.vllm.fair import StepShares

    def before(self: Any, sched: Any) -> list[Any] | None:
        return None  # the whole waiting queue, in its order

    def after(self: Any, sched: Any, output: Any) -> None:
        return None

    StepShares.before = before  # type: ignore[method-assign]
    StepShares.after = after  # type: ignore[method-assign]


def use_pure_python_records() -> None:
    """The fenced scheduler with the pure-Python fallback records (the switch the vLLM lane's
    ``record_impl`` fixture makes for a test)."""
    for module, name, value in pure_python_records():
        setattr(module, name, value)


def argument_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run: fewer requests, 3 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 3)")
    ap.add_argument("--requests-per-user", type=int, default=None, help="default 8; quick 2")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument(
        "--users",
        default=",".join(map(str, CONCURRENCY)),
        help="concurrent users of each tenant, t0 first (default: the skewed mix above; e.g. 2,2,2 for "
        "a light engine of three tenants, where the plugin's per-step cost weighs most)",
    )
    ap.add_argument(
        "--hit-rate",
        action="store_true",
        help="only the prefix-cache hit rates of the shared-system-prompt workload (four modes)",
    )
    ap.add_argument("--profile", action="store_true", help="profile even when within the target")
    ap.add_argument(
        "--process-per-run",
        action="store_true",
        help="run each round in a forked process of its own (default: all in this process; see above)",
    )
    ap.add_argument(
        "--lockstep",
        action="store_true",
        help="run each round's two schedulers in lockstep, a forked process each (see above)",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="with --lockstep: after each round, a round of stock vLLM against itself (the A/A floor)",
    )
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's AsyncScheduler (its default on GPUs) for both, instead of the synchronous one",
    )
    ap.add_argument(
        "--callgrind",
        action="store_true",
        help="instead of timing: count instructions and simulated cache misses under valgrind (see above)",
    )
    ap.add_argument(
        "--callgrind-keep", metavar="DIR", help="with --callgrind: keep callgrind's output files here"
    )
    ap.add_argument(
        "--pure-python-records",
        action="store_true",
        help="the fenced scheduler with the pure-Python fallback records (see above)",
    )
    ap.add_argument(
        "--bytecodes",
        action="store_true",
        help="instead of timing: count the Python bytecodes each function executes (see above)",
    )
    ap.add_argument(
        "--hooks",
        action="store_true",
        help="time the plugin's hooks in vLLM, fenced against stock, a forked process per run (see above)",
    )
    ap.add_argument(
        "--fair-share-off",
        action="store_true",
        help="benchmark-only A/B: the fenced scheduler with its fair-share hooks patched out (see above)",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="with --lockstep: a third side, the fence alone (fair share patched out), in every round",
    )
    ap.add_argument("--callgrind-child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--callgrind-lib", help=argparse.SUPPRESS)
    return ap


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The flags, and the variants ``--variants`` chose."""
    ap = argument_parser()
    a = ap.parse_args()
    chosen = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = set(chosen) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    if a.floor and not a.lockstep:
        ap.error("--floor needs --lockstep (the floor is stock against itself, stepped in lockstep)")
    if a.split and (not a.lockstep or a.fair_share_off):
        ap.error("--split needs --lockstep, and not --fair-share-off (its third side is the fence alone)")
    try:
        users = [int(u) for u in a.users.split(",")]
    except ValueError:
        ap.error(f"--users: comma-separated counts, got {a.users!r}")
    if not 0 < len(users) <= len(TENANTS) or min(users) < 0 or not any(users):
        ap.error(f"--users: 1 to {len(TENANTS)} counts of at least 0, one of them above 0")
    # The workload's and the driver's: set before any scheduler is built (the lockstep sides fork after).
    CONCURRENCY[:] = users + [0] * (len(TENANTS) - len(users))
    return a, chosen


def scheduler_config(a: argparse.Namespace) -> Any:
    """The VllmConfig both schedulers are built over."""
    config = base_config(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS
    )
    if a.async_scheduling:  # driven step by step all the same: each output comes back before the next step
        config = copy.copy(config)
        config.scheduler_config = copy.copy(config.scheduler_config)
        config.scheduler_config.async_scheduling = True
    return config


def print_hit_rates(config: Any, a: argparse.Namespace) -> None:
    """``--hit-rate``: the four modes' hit rates, roomy and tight pool."""
    n_rounds = 6 if a.quick else 12
    rows = hit_rates(config, n_rounds, a.seed)
    table(
        f"Prefix-cache hit rate on vLLM's scheduler, shared-system-prompt workload ({n_rounds} rounds x "
        f"{len(HIT_TENANTS)} tenants, one at a time; the declared system prompt + 256-token tenant "
        f"context + 64-token question; blocks of {BLOCK_SIZE}; tight pool = 3 requests' blocks; vLLM "
        f"{vllm.__version__})",
        ["pool", "mode", "blocks", "hit rate (tokens)"],
        rows,
    )


def print_header(a: argparse.Namespace, sc: Any, n_req: int, rounds: int) -> None:
    mode = (
        "in lockstep, a forked process each"
        if a.lockstep
        else "a forked process per run"
        if a.process_per_run
        else "all in this process"
    )
    print(
        f"kvfence vLLM scheduler benchmark - vLLM {vllm.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} cores; {NUM_BLOCKS} blocks of {BLOCK_SIZE}, max_num_seqs "
        f"{sc.max_num_seqs}, max_num_batched_tokens {sc.max_num_batched_tokens}, chunked prefill "
        f"{sc.enable_chunked_prefill}, async scheduling {sc.async_scheduling}; {n_req} requests from "
        f"{len(TENANTS)} tenants ({sum(CONCURRENCY)} concurrent users); {rounds} rounds, "
        f"{mode}; {records_kind(a)} prefix-cache records; fair share {fair_share_kind(a)}",
        file=sys.stderr,
    )


def timed_run(
    a: argparse.Namespace,
    kind: str,
    streams: dict[str, list[Spec]],
    warm: dict[str, list[Spec]],
    quotas: dict[str, Any],
    config: Any,
) -> Run:
    """One run of ``kind`` outside lockstep: in this process, or in a forked process of its own after
    a warm-up there (``--process-per-run``)."""
    if not a.process_per_run:
        return drive(kind, streams, quotas, config)

    def warm_then_timed() -> Run:
        drive(kind, warm, quotas, config)  # warm-up of this kind, not counted
        return drive(kind, streams, quotas, config)

    return isolated(warm_then_timed)


def time_variant(
    a: argparse.Namespace, label: str, streams: dict[str, list[Spec]], config: Any, rounds: int
) -> dict[str, Any]:
    """Every round of one variant, its progress on stderr; the variant's summary (and floor)."""
    quotas = VARIANTS[label]
    warm = workload(1, a.seed + 1)
    if not a.process_per_run and not a.lockstep:
        for kind in KINDS:  # warm-up (imports, caches), not counted
            drive(kind, warm, quotas, config)
    sides = SPLIT_SIDES if a.split else {k: k for k in KINDS}
    got: dict[str, list[Run]] = {k: [] for k in sides}
    floor: dict[str, list[Run]] = {k: [] for k in FLOOR_SIDES}
    for rnd in range(rounds):
        paired = lockstep(streams, warm, quotas, config, sides) if a.lockstep else {}
        if a.floor:  # the A/A floor's round, right after this round (same minutes, same machine)
            for side, r in lockstep(streams, warm, quotas, config, FLOOR_SIDES).items():
                floor[side].append(r)
            print(
                f"  [{label}] round {rnd + 1}/{rounds}  floor: stock again/stock "
                f"{step_ratios(floor['stock'][-1:], floor['stock again'][-1:])[0][0]:.3f}",
                file=sys.stderr,
            )
        for kind in sides:
            r = paired[kind] if a.lockstep else timed_run(a, kind, streams, warm, quotas, config)
            got[kind].append(r)
            s = r.summary()
            print(
                f"  [{label}] round {rnd + 1}/{rounds} {kind:>10}: {s['steps']} steps, mean step "
                f"{s['mean_us']:.0f} us, {s['us_per_sched_req']:.2f} us per scheduled request",
                file=sys.stderr,
            )
    res = summarize(label, got)
    if a.floor:
        per_round, minima = step_ratios(floor["stock"], floor["stock again"])
        res["floor"] = {
            "ratio_mean_step": statistics.median(per_round),
            "ratio_mean_step_per_round": per_round,
            "ratio_min_per_step": minima,
        }
    return res


def timed_setup(
    a: argparse.Namespace, sc: Any, load_before: float, rounds: int, n_req: int, per_user: int
) -> dict[str, Any]:
    """The timed run's conditions, as its JSON records them."""
    return {
        "vllm": vllm.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rounds": rounds,
        "requests": n_req,
        "requests_per_user": per_user,
        "seed": a.seed,
        "users_per_tenant": dict(zip(TENANTS, CONCURRENCY, strict=True)),
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": MAX_MODEL_LEN,
        "chunked_prefill": sc.enable_chunked_prefill,
        "async_scheduling": sc.async_scheduling,
        "target_ratio": TARGET,
        "process_per_run": a.process_per_run,
        "lockstep": a.lockstep,
        "records": records_kind(a),
        "fair_share": fair_share_kind(a),
    }


def timed(a: argparse.Namespace, chosen: list[str], config: Any, rounds: int, per_user: int) -> None:
    """The timed benchmark: the rounds of every chosen variant, the report, the profiles where over
    the target (or with ``--profile``), the JSON."""
    sc = config.scheduler_config
    streams = workload(per_user, a.seed)
    n_req = sum(len(s) for s in streams.values())
    load_before = os.getloadavg()[0]
    print_header(a, sc, n_req, rounds)
    results = {label: time_variant(a, label, streams, config, rounds) for label in chosen}
    report(results, rounds, n_req)

    profiles: dict[str, Any] = {}
    for label, res in results.items():
        if a.profile or not res["verdict"]["met"]:
            profiles[label] = profile(streams, VARIANTS[label], config)
            print_profile(label, profiles[label])

    setup = timed_setup(a, sc, load_before, rounds, n_req, per_user)
    path = write_results("vllm", {"setup": setup, "variants": results, "profiles": profiles})
    print(f"\nwritten to {path}")


def main() -> None:
    a, chosen = parse_args()
    rounds = a.rounds or (3 if a.quick else 5)
    per_user = a.requests_per_user or (2 if a.quick else 8)
    config = scheduler_config(a)
    if a.pure_python_records:
        use_pure_python_records()
    if a.fair_share_off:
        patch_out_fair_share()
    if a.callgrind_child or a.callgrind or a.bytecodes or a.hooks:
        import vllm_probes as probes

        if a.callgrind_child:
            quotas = VARIANTS[a.variants]
            probes.callgrind_child(a.callgrind_child, per_user, a.seed, quotas, config, a.callgrind_lib)
        elif a.callgrind:
            probes.callgrind(chosen, per_user, a)
        elif a.bytecodes:
            probes.bytecodes(chosen, per_user, a.seed, config, records_kind(a))
        else:
            probes.hooks(chosen, per_user, a.seed, config, rounds)
    elif a.hit_rate:
        print_hit_rates(config, a)
    else:
        timed(a, chosen, config, rounds, per_user)


if __name__ == "__main__":
    main()
