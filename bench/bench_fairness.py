"""Service isolation on real vLLM: a victim tenant next to noisy neighbours (a benchmark, not a test).

    flock /tmp/kvfence-vllm.lock .venv/bin/python bench/bench_fairness.py [--quick] [--rounds 3]
        [--window 30] [--lead 5] [--max-num-seqs 16] [--big-request 32x2] [--slow-streams 300]
        [--victim-tokens 8] [--scrape-every 0.1] [--source committed|tree] [--vllm-python PATH]
        [--results-dir DIR] [--note TEXT]

Same run, same model, same vLLM arguments (the ones the operator renders for a ``runtime: vllm``
TrustClass, through bench_e2e's servers), three rows:

* ``stock``: stock ``vllm serve`` (first come, first served), reached directly;
* ``stock priority``: the same with ``--scheduling-policy priority``, the victim's requests at
  priority 0 and the attacker's at 1 (the best a stock deployment can do; it trusts the field);
* ``kvfence``: the rendered engine (fenced scheduler, fair share) behind ``kvfence-router`` (its
  default flags: request limits, flow control, connection share per tenant, slow-client cut-off, as
  the chart's defaults), each tenant with its own API key, equal weights. A refused request (429
  from flow control) counts as the attacker's error and is sent again half a second later.

Scenarios (``--source committed``, the default, runs the engine plugin and the router from the
commit at ``--rev``, HEAD by default, exported with ``git archive``, so work in progress in the tree is
not measured):

* ``solo``: the victim alone: one stream at a time, a 64-token prompt, ``--victim-tokens`` out (8:
  short requests, so that a window holds many TTFT samples);
* ``big request``: the attacker keeps two requests of P prompts x ``n`` in flight (``--big-request``;
  the default 32x2 is the largest the router's default limits allow: 32 prompts, 64 sequences; a
  larger shape raises the class's ``requestLimits`` to it). Stock vLLM has no router: sent direct;
* ``long prompts``: 32 concurrent 896-token prompts, 4 tokens out each, resent as each ends;
* ``long generations``: 32 concurrent 32-token prompts, 512 tokens out each;
* ``slow readers``: ``--slow-streams`` streams of 256 tokens each, read one event per second
  through a 4 KiB socket receive buffer (more streams than the router's 256 upstream slots);
* ``backlogged pair``: two tenants of equal weight, both always with work waiting: tenant A with 64
  streams in flight, tenant B with 16 (128-token prompts, 64 tokens out). Not run on ``stock
  priority``: equal weights are equal priorities, which is first come, first served.

Each attacker runs alone (its capacity) and with the victim; it starts ``--lead`` seconds before
the victim, and the victim then sends requests back to back for ``--window`` seconds.

Measured client-side, per request: the send time and the arrival time of every streamed event with
its token count (``return_token_ids``). TTFT is the first event's arrival less the send; ITL the gaps
between a stream's events (as ``vllm bench serve`` counts them). A victim request that fails or gets
no token within ``--victim-timeout`` counts as a miss, with its wait so far as its TTFT (a lower
bound). Service is counted in the fair-share policy's units (``kvfence.isolation.fairshare``): 4 per
prompt token (charged when the prompt's first token arrives), 8 per output token (on arrival); the
client cannot see prefix-cache hits, so every prompt token is counted as computed.

Measured from the servers: during every measurement, on every row alike, the engine's ``/metrics``
(and on ``kvfence`` the router's) is polled every ``--scrape-every`` seconds: vLLM's running and
waiting requests; the router's requests held by flow control per tenant, its queue gauge and its
sequences in flight against its flow-control capacity; and the engine's own count of each tenant's
service, ``kvfence_engine_tenant_service_units_total{tenant}`` (what the fair share charged; the
engine core writes it at most every 0.25 s, so a poll sees it at most that old; stock vLLM has no
such count).

Figures and goals:

* victim TTFT and ITL p50/p99 on each row and scenario, over every round's samples pooled (the
  sample counts printed with them), and p99 TTFT against the same row's pooled solo p99 (goal: at
  most 2x; each round's own ratio is in the results); and p99 TTFT in steps: over the victim's
  TPOT p50 next to the same attacker (its decode time per token after the first, per request: one
  step of the shared batch; ITL is not used, a client that falls behind reads events together), so
  about 2 means the victim waited for the step in flight and its own, never for the attacker's
  backlog. On CPU a step of a full batch costs many times a step of one sequence, far more than on
  a GPU: the ratio to solo can miss where the count of steps does not;
* where the victim's time went (a table): the engine's mean running and waiting requests; on
  ``kvfence``, the victim's requests held by the router's flow control, the seconds they spent held
  next to the victim's summed TTFT, and the router's sequences in flight against its capacity;
* work conservation: the attacker's service rate next to the victim, over the capacity the victim
  leaves (the attacker's rate alone less the victim's rate in the same run; for slow readers, whose
  rate their own reads set, their rate alone; goal: at least 0.9);
* the service difference of the backlogged pair: with W_A(t), W_B(t) each tenant's cumulative units
  and D = W_A - W_B (0 where the measured window starts; printed at each second, the last round's),
  the largest |D(t2) - D(t1)| over t1 < t2 in the window (= max D - min D), that is the largest
  |W_A(t1, t2) - W_B(t1, t2)| over the window's intervals. Measured twice: from the engine's own
  count (the polled counter; what VTC's theorem bounds, the service the scheduler gave) and
  client-side (units counted as tokens reach the client: a prompt's units when its first token
  arrives, after the engine computed it, and an event loop that falls behind delivers a burst, so
  it can exceed what the engine did). Against 2 U with U = max(w_p L_input, w_q M):
  VTC's bound for two clients backlogged over the interval (Sheng et al., "Fairness in Serving Large
  Language Models", OSDI '24, arXiv 2401.00588), with L_input the longest prompt and M the most
  tokens one running batch can hold. That form is not checked against the paper's text: the
  theorem's statement (number, conditions, the definition of M) could not be read where this was
  written, so the comparison is indicative. Here w_p = 4 and w_q = 8 (the policy's costs), and M is
  ``max_num_seqs`` x the longest prompt plus its output (every sequence of these tenants is at most
  that long), the smaller of the two readings of M (the other, the KV cache's token capacity, is
  far larger on CPU). The engine's ``/metrics`` shows its waiting queue as a whole, not per tenant:
  that both tenants kept requests waiting in the engine (the theorem's condition), rather than in
  the router's hold queue, is not checked.

Pairing: each round runs every row of a scenario back to back, in an order rotated every round;
the other engines are stopped (SIGSTOP) while one is measured, and after each measurement the engine
is drained (no request running or waiting) before the next. Results: bench/results/fairness-<time>.json
(date, commit, machine, command, every measurement's figures) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_e2e as e2e

from kvfence.contract import METRIC_TENANT_SERVICE_UNITS, QUEUE_STEP_BUCKETS
from kvfence.isolation.fairshare import OUTPUT_COST, PREFILL_COST

ROOT = e2e.ROOT
ROWS = ("stock", "stock priority", "kvfence")
ATTACKS = ("big request", "long prompts", "long generations", "slow readers")
PAIR = "backlogged pair"
#: the tenants and their API keys at the router
KEYS = {t: f"sk-bench-fair-{t}-0123456789" for t in ("victim", "attacker", "tenant-a", "tenant-b")}
#: the upper bounds of the engine's queue-steps histogram buckets (the last bucket: more), as its stats
#: file carries them to kvfence_engine_tenant_queue_steps
QUEUE_STEP_BOUNDS = (*QUEUE_STEP_BUCKETS, float("inf"))
#: the /metrics series a scrape keeps (the rest of vLLM's page is dropped unparsed)
#: seconds between two reads of the engine's service count, two polls of the router's /metrics
SERVICE_READ_EVERY, ROUTER_SCRAPE_EVERY = 0.1, 0.1
SCRAPED = (METRIC_TENANT_SERVICE_UNITS, "vllm:num_requests_running", "vllm:num_requests_waiting",
           "kvfence_router_queued_requests", "kvfence_router_held_requests_total",
           "kvfence_router_inflight_sequences", "kvfence_router_flow_control_capacity_sequences")  # fmt: skip
TTFT_GOAL = 2.0
WORK_GOAL = 0.9
SLOW_RCVBUF = 4096


# --- the load: one tenant's requests, streamed and timed ---------------------------------------
@dataclass
class Shape:
    """What a tenant sends: ``concurrency`` closed-loop streams of ``prompts`` prompts x ``n``."""

    concurrency: int
    prompt_len: int
    max_tokens: int
    prompts: int = 1
    n: int = 1
    #: seconds between two reads of a stream (0: read as fast as it arrives)
    read_every: float = 0.0


@dataclass
class Record:
    """One request: when it was sent, each event's arrival and tokens, and its service events."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    #: (arrival, service units)
    service: list[tuple[float, int]] = field(default_factory=list)
    error: str = ""
    ended: float = 0.0


def body(shape: Shape, rng: random.Random, vocab: int, priority: int | None) -> dict[str, Any]:
    """A streamed completion of random token ids (distinct prompts: no prefix-cache hits)."""
    prompts = [[rng.randrange(16, vocab) for _ in range(shape.prompt_len)] for _ in range(shape.prompts)]
    doc: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompts[0] if shape.prompts == 1 else prompts,
        "max_tokens": shape.max_tokens,
        "n": shape.n,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if priority is not None:
        doc["priority"] = priority
    return doc


def account(rec: Record, line: bytes, now: float, n: int, prompt_len: int, seen: set[int]) -> None:
    """Record one server-sent event: its arrival, its tokens' units, the prompt's on its first token."""
    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
        return
    doc = json.loads(line[6:])
    if "error" in doc:
        rec.error = str(doc["error"])[:300]
        return
    units = 0
    for choice in doc.get("choices", []):
        units += OUTPUT_COST * len(choice.get("token_ids") or [0])
        prompt = choice["index"] // n
        if prompt not in seen:
            seen.add(prompt)
            units += PREFILL_COST * prompt_len
    if units:
        rec.arrivals.append(now)
        rec.service.append((now, units))


async def send(session: Any, url: str, doc: dict[str, Any], shape: Shape, rec: Record, t0: float) -> None:
    seen: set[int] = set()
    async with session.post(url + "/v1/completions", json=doc) as resp:
        if resp.status != 200:
            rec.error = f"{resp.status} {(await resp.text())[:300]}"
            return
        async for line in resp.content:
            account(rec, line.strip(), time.perf_counter() - t0, shape.n, shape.prompt_len, seen)
            if shape.read_every:
                await asyncio.sleep(shape.read_every)


@dataclass
class Tenant:
    """One tenant's closed loop against one row."""

    name: str
    shape: Shape
    url: str
    headers: dict[str, str]
    priority: int | None
    vocab: int
    seed: int
    timeout: float = 600.0
    records: list[Record] = field(default_factory=list)

    def session(self) -> Any:
        import aiohttp

        slow = self.shape.read_every > 0
        connector = aiohttp.TCPConnector(limit=0, socket_factory=small_rcvbuf if slow else None)
        return aiohttp.ClientSession(
            connector=connector,
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            read_bufsize=1024 if slow else 2**16,
        )

    async def loop(self, t0: float, until: Callable[[], bool]) -> None:
        """``concurrency`` workers, each sending its next request when the last one ended, until
        ``until()`` (a request in flight then is finished; cancel the task to cut it off)."""
        async with self.session() as session:
            await asyncio.gather(
                *(self._worker(session, i, t0, until) for i in range(self.shape.concurrency))
            )

    async def _worker(self, session: Any, i: int, t0: float, until: Callable[[], bool]) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not until():
            rec = Record(time.perf_counter() - t0)
            self.records.append(rec)
            doc = body(self.shape, rng, self.vocab, self.priority)
            try:
                await send(session, self.url, doc, self.shape, rec, t0)
            except asyncio.CancelledError:
                rec.error = rec.error or "cut off at the end of the run"
                raise
            except Exception as exc:  # a timeout or a dropped connection: a miss, recorded
                rec.error = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                rec.ended = time.perf_counter() - t0
            if rec.error:  # refused (429 from flow control, 503): try again, not in a busy loop
                await asyncio.sleep(0.5)


@dataclass
class Scrape:
    """A ``/metrics`` page polled every ``every`` seconds during a measurement: (seconds since the
    start, the kept samples) per poll."""

    url: str
    every: float
    pages: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    async def loop(self, t0: float) -> None:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                try:
                    async with session.get(self.url + "/metrics") as resp:
                        text = await resp.text()
                    self.pages.append((time.perf_counter() - t0, kept_samples(text)))
                except (aiohttp.ClientError, TimeoutError):
                    pass  # a poll lost: the next one follows
                await asyncio.sleep(self.every)


@dataclass
class ServiceFile:
    """The engine core's stats file (``KVFENCE_VLLM_STATS_FILE``), read every ``every`` seconds: each
    tenant's service units as the engine charged them, the figures its ``/metrics`` exports as
    ``kvfence_engine_tenant_service_units_total`` (kvfence.vllm.stats), without making vLLM's API
    server render its whole page ten times a second. (time, units by tenant) per read."""

    path: Path
    every: float
    reads: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    async def loop(self, t0: float) -> None:
        while True:
            try:
                units = json.loads(self.path.read_text()).get("service_units") or {}
                self.reads.append((time.perf_counter() - t0, units))
            except (OSError, ValueError):
                pass  # replaced under us (it is written by rename): the next read follows
            await asyncio.sleep(self.every)


def kept_samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(SCRAPED):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def small_rcvbuf(addr_info: Any) -> socket.socket:
    """A client socket that takes at most a few KiB before the server's writes block."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
    return sock


async def drive(
    victim: Tenant | None,
    attacker: Tenant | None,
    lead: float,
    window: float,
    scrapes: list[Scrape],
) -> tuple[float, float]:
    """The attacker from 0, the victim from ``lead`` for ``window`` seconds (its last request
    finished), ``scrapes`` polled throughout; the measured interval (start, end), in seconds since
    the start."""
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    tasks = [asyncio.create_task(s.loop(t0)) for s in scrapes]
    tasks += [asyncio.create_task(attacker.loop(t0, lambda: False))] if attacker else []
    await asyncio.sleep(lead)
    start = clock()
    if victim:
        await victim.loop(t0, lambda: clock() > start + window)
    else:
        await asyncio.sleep(window)
    end = clock()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return start, end


async def drive_pair(
    a: Tenant, b: Tenant, lead: float, window: float, scrapes: list[Scrape | ServiceFile]
) -> tuple[float, float]:
    """Both tenants from 0; measured from ``lead`` (both backlogged) for ``window`` seconds."""
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(s.loop(t0)) for s in scrapes]
    tasks += [asyncio.create_task(t.loop(t0, lambda: False)) for t in (a, b)]
    await asyncio.sleep(lead + window)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return lead, lead + window


# --- setup: the engines and the router ---------------------------------------------------------
def snapshot(workdir: Path, rev: str) -> Path:
    """engine-image/ and operator/ as committed at ``rev``, with the compiled modules of the tree whose C
    source is unchanged from ``rev`` (others left out: the Python fallback, named in the results)."""
    dest = workdir / "src"
    dest.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "engine-image", "operator"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    for built in ROOT.glob("engine-image/kvfence/**/*.so"):
        source = built.with_name(built.name.split(".")[0] + ".c")
        diff = subprocess.run(
            ["git", "-C", str(ROOT), "diff", "--quiet", rev, "--", str(source)], check=False
        )
        if diff.returncode == 0:
            shutil.copy2(built, dest / built.relative_to(ROOT))
    return dest


def start_engines(stack: e2e.Stack) -> None:
    """The rendered kvfence engine, and stock vLLM with the same arguments twice (first come first
    served, and the priority policy); each paused while the next starts."""
    import vllmserve
    from support.ports import free_port

    from kvfence.contract.engine_config import ENV_VLLM_STATS_FILE

    tc = e2e.trust_class(stack.a, stack.model, free_port())
    args, env, _ = vllmserve.rendered(tc, stack.key_file.read_bytes(), stack.workdir / "kvfence")
    stack.a.stats_file = env[ENV_VLLM_STATS_FILE]
    plain_env = {k: v for k, v in env.items() if not k.startswith("KVFENCE_")}
    for row, extra in (("stock", []), ("stock priority", ["--scheduling-policy", "priority"])):
        port = free_port()
        stack.servers[row] = e2e.start_vllm(stack, row, e2e.stock_args(args, port) + extra, plain_env, port)
        stack.servers[row].pause()
    stack.servers["kvfence"] = e2e.start_vllm(stack, "kvfence", args, env, tc.spec.engine.port)


def request_limits(a: argparse.Namespace) -> dict[str, int] | None:
    """The class's request limits raised to the big request's shape where the defaults refuse it."""
    from kvfence.contract.routing import RequestLimits

    d = RequestLimits()
    prompts, n = a.big_prompts, a.big_n
    if prompts <= d.max_prompts_per_request and n <= d.max_n and prompts * n <= d.max_sequences_per_request:
        return None
    return {
        "maxPromptsPerRequest": max(prompts, d.max_prompts_per_request),
        "maxN": max(n, d.max_n),
        "maxSequencesPerRequest": max(prompts * n, d.max_sequences_per_request),
    }


def setup(a: argparse.Namespace) -> e2e.Stack:
    import tempfile

    import vllmserve

    workdir = Path(tempfile.mkdtemp(prefix="kvfence-bench-fairness-"))
    router_env = None
    if a.source == "committed":
        a.rev = source_commit(a)  # resolved now: HEAD may move while the benchmark runs
        src = snapshot(workdir, a.rev)
        a.plugin_path = str(src / "engine-image")
        router_env = {**os.environ, "PYTHONPATH": f"{src / 'operator'}:{src / 'engine-image'}"}
    model = Path(a.model) if a.model else vllmserve.tiny_model(a.vllm_python)
    a.vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    key_file = workdir / "signing-key"
    key_file.write_bytes(os.urandom(32))
    stack = e2e.Stack(a, workdir, model, key_file)
    try:
        start_engines(stack)
        e2e.start_router(stack, e2e.routing_table(stack, KEYS, request_limits(a)), router_env)
    except BaseException:
        stack.close()
        raise
    return stack


# --- run: every scenario on every row, rounds rotated ------------------------------------------
def activate(stack: e2e.Stack, row: str) -> tuple[str, e2e.Server]:
    """(the URL ``row``'s tenants send to, its engine), that engine running and the others stopped.
    The kvfence row waits until a request passes the router: it marks an engine whose health check
    timed out (stopped for another row) unavailable until its next check succeeds."""
    from router.support import request
    from support.waiting import wait_until

    for name in ROWS:
        if name != row:
            stack.servers[name].pause()
    engine = stack.servers[row]
    engine.resume()
    if row != "kvfence":
        probe = lambda: request("GET", engine.url + "/health", timeout=2)[0] == 200  # noqa: E731
        wait_until(probe, f"{row} ready", 60, 0.2, ignore=(OSError,))
        return engine.url, engine
    url = stack.servers["router"].url
    doc = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}
    auth = {"Authorization": f"Bearer {KEYS['victim']}"}
    served = lambda: request("POST", url + "/v1/completions", doc, auth, timeout=10)[0] == 200  # noqa: E731
    wait_until(served, "kvfence serving through the router", 60, 0.5, ignore=(OSError,))
    return url, engine


def drain(engine: e2e.Server, timeout: float = 180.0) -> float:
    """Wait until the engine has no request running or waiting (the client's cancelled streams
    aborted); the seconds it took."""
    from router.support import request
    from support import prom
    from support.waiting import wait_until

    def idle() -> bool:
        status, _, data = request("GET", engine.url + "/metrics", timeout=5)
        samples = prom.samples(data.decode()) if status == 200 else {}
        busy = prom.total(samples, "vllm:num_requests_running") + prom.total(
            samples, "vllm:num_requests_waiting"
        )
        return status == 200 and busy == 0

    t0 = time.monotonic()
    wait_until(idle, f"{engine.name} drained", timeout, 0.5, ignore=(OSError,))
    return time.monotonic() - t0


def shapes(a: argparse.Namespace) -> dict[str, Shape]:
    return {
        "victim": Shape(1, 64, a.victim_tokens),
        "big request": Shape(2, a.big_prompt_len, a.big_max_tokens, a.big_prompts, a.big_n),
        "long prompts": Shape(a.flood, 896, 4),
        "long generations": Shape(a.flood, 32, 512),
        "slow readers": Shape(a.slow_streams, 32, 256, read_every=1.0),
        "tenant-a": Shape(4 * a.max_num_seqs, 128, 64),
        "tenant-b": Shape(a.max_num_seqs, 128, 64),
    }


def tenant(stack: e2e.Stack, row: str, url: str, name: str, shape: str, seed: int) -> Tenant:
    a = stack.a
    headers = {"Authorization": f"Bearer {KEYS[name]}"} if row == "kvfence" else {}
    priority = {"victim": 0, "attacker": 1}.get(name) if row == "stock priority" else None
    timeout = a.victim_timeout if name == "victim" else 3600.0
    return Tenant(name, shapes(a)[shape], url, headers, priority, a.vocab, seed, timeout)


def measure(stack: e2e.Stack, row: str, scenario: str, part: str, seed: int) -> dict[str, Any]:
    """One run of ``scenario`` on ``row``: ``part`` is ``victim`` (alone), ``attacker`` (alone),
    ``both`` or ``pair``; its figures. The engine's ``/metrics`` (and on ``kvfence`` the router's) is
    polled every ``--scrape-every`` seconds throughout, on every row alike."""
    a = stack.a
    url, engine = activate(stack, row)
    load = os.getloadavg()[0]
    scrapes = {"engine": Scrape(engine.url, a.scrape_every)}
    if row == "kvfence":
        scrapes["router"] = Scrape(stack.servers["router"].url, ROUTER_SCRAPE_EVERY)
    if part == "pair":
        ta, tb = (tenant(stack, row, url, t, t, seed + i) for i, t in enumerate(("tenant-a", "tenant-b")))
        pollers: list[Scrape | ServiceFile] = [*scrapes.values()]
        served = ServiceFile(Path(a.stats_file), SERVICE_READ_EVERY) if row == "kvfence" else None
        pollers += [served] if served else []
        start, end = asyncio.run(drive_pair(ta, tb, a.lead, a.window, pollers))
        figs = pair_figures(ta, tb, start, end, a)
        figs |= engine_pair_figures(served, engine, start, end) if served else {}
    else:
        victim = tenant(stack, row, url, "victim", "victim", seed) if part != "attacker" else None
        attacker = tenant(stack, row, url, "attacker", scenario, seed + 1) if part != "victim" else None
        lead = a.lead if attacker else 0.0
        waits = queue_steps(Path(a.stats_file), "victim") if row == "kvfence" else None
        start, end = asyncio.run(drive(victim, attacker, lead, a.window, list(scrapes.values())))
        figs = load_figures(victim, attacker, start, end) | where_time_goes(scrapes, victim, start, end)
        if waits is not None:
            figs |= steps_waited(waits, queue_steps(Path(a.stats_file), "victim"))
    out = {"row": row, "scenario": scenario, "part": part, "seed": seed, "load_1m": round(load, 2)}
    out.update(figs, seconds=round(end - start, 2), drain_s=round(drain(engine), 1))
    print(f"  {scenario:<16} {row:<14} {part:<8} " + brief(out), file=sys.stderr, flush=True)
    return out


def plan(scenario: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the rows, the parts) ``scenario`` runs."""
    if scenario == "solo":
        return ROWS, ("victim",)
    if scenario == PAIR:
        return ("stock", "kvfence"), ("pair",)
    return ROWS, ("attacker", "both")


def run(stack: e2e.Stack) -> list[dict[str, Any]]:
    a = stack.a
    for row in ROWS:  # untimed warm-up of every path
        warm = argparse.Namespace(**{**vars(a), "window": 3.0})
        measure(
            e2e.Stack(warm, stack.workdir, stack.model, stack.key_file, stack.servers),
            row,
            "solo",
            "victim",
            0,
        )
    runs = []
    for rnd in range(a.rounds):
        for i, scenario in enumerate(("solo", *ATTACKS, PAIR)):
            if scenario != "solo" and a.scenarios and scenario not in a.scenarios:
                continue
            rows, parts = plan(scenario)
            k = rnd % len(rows)
            for row in rows[k:] + rows[:k]:
                for part in parts:
                    seed = a.seed + 1000 * rnd + 10 * i
                    runs.append({"round": rnd, **measure(stack, row, scenario, part, seed)})
    return runs


# --- figures of one run ------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def units_in(records: list[Record], start: float, end: float) -> int:
    return sum(u for r in records for t, u in r.service if start <= t <= end)


def real_errors(records: list[Record]) -> list[str]:
    return [r.error for r in records if r.error and r.error != "cut off at the end of the run"]


def victim_figures(v: Tenant, start: float, end: float) -> dict[str, Any]:
    """TTFT (ms; a miss counts its wait so far) and ITL (ms) percentiles, misses, service rate."""
    ttft, itl, tpot = [], [], []
    for r in v.records:
        if r.arrivals:
            ttft.append((r.arrivals[0] - r.sent) * 1e3)
            itl += [(y - x) * 1e3 for x, y in itertools.pairwise(r.arrivals)]
            tokens = sum(u for _, u in r.service[1:]) // OUTPUT_COST
            if tokens:  # the decode time per token after the first (vLLM's TPOT): one step each
                tpot.append((r.arrivals[-1] - r.arrivals[0]) * 1e3 / tokens)
        else:
            ttft.append((r.ended - r.sent) * 1e3)
    misses = [r.error or "no token" for r in v.records if r.error or not r.arrivals]
    return {
        "victim_requests": len(v.records),
        "victim_misses": len(misses),
        "victim_errors": sorted(set(misses))[:5],
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "victim_units_per_s": units_in(v.records, start, end) / (end - start),
        "ttft_ms": [round(x, 1) for x in ttft],
        "ttft_sent_s": [round(r.sent - start, 2) for r in v.records],
        "itl_ms": [round(x, 1) for x in itl],
        "tpot_ms": [round(x, 2) for x in tpot],
    }


# --- where the victim's time goes: the router's hold queue and the engine's queues -----------------
def summed(scrape: Scrape, name: str, start: float, end: float, label: str = "") -> list[tuple[float, float]]:
    """(time, the sum of every sample of ``name`` whose labels contain ``label``) per poll in [start, end]."""
    out = []
    for t, page in scrape.pages:
        if start <= t <= end:
            vals = [v for k, v in page.items() if (k == name or k.startswith(name + "{")) and label in k]
            if vals:
                out.append((t, sum(vals)))
    return out


def integral(series: list[tuple[float, float]]) -> float:
    """The series held from each poll to the next, integrated (value x seconds)."""
    return sum(v * (t2 - t1) for (t1, v), (t2, _) in itertools.pairwise(series))


def time_mean(series: list[tuple[float, float]]) -> float:
    span = series[-1][0] - series[0][0] if len(series) > 1 else 0.0
    return integral(series) / span if span > 0 else float("nan")


def where_time_goes(scrapes: dict[str, Scrape], v: Tenant | None, start: float, end: float) -> dict[str, Any]:
    """The engine's mean running and waiting requests over the window; on the router, the victim's
    requests held by flow control and the seconds they spent held (the queue gauge integrated), next
    to the victim's summed TTFT; the router's sequences in flight and its flow-control capacity."""
    eng = scrapes["engine"]
    out: dict[str, Any] = {
        "polls": sum(1 for t, _ in eng.pages if start <= t <= end),
        "engine_running_mean": time_mean(summed(eng, "vllm:num_requests_running", start, end)),
        "engine_waiting_mean": time_mean(summed(eng, "vllm:num_requests_waiting", start, end)),
    }
    router = scrapes.get("router")
    if router is None:
        return out
    held = summed(router, "kvfence_router_held_requests_total", start, end, 'tenant="victim"')
    queued = summed(router, "kvfence_router_queued_requests", start, end, 'tenant="victim"')
    inflight = summed(router, "kvfence_router_inflight_sequences", start, end)
    out |= {
        "victim_held": held[-1][1] - held[0][1] if held else 0.0,
        "victim_held_s": integral(queued),
        "router_inflight_sequences_mean": time_mean(inflight),
        "router_capacity_sequences": max((x for _, x in
                                          summed(router, "kvfence_router_flow_control_capacity_sequences",
                                                 start, end)), default=float("nan")),
    }  # fmt: skip
    if v is not None:
        out["victim_ttft_sum_s"] = sum((r.arrivals[0] if r.arrivals else r.ended) - r.sent for r in v.records)
    return out


def queue_steps(path: Path, tenant: str) -> list[int]:
    """The tenant's queue-steps histogram in the engine core's stats file (what /metrics exports as
    kvfence_engine_tenant_queue_steps): requests started, per bucket of QUEUE_STEP_BOUNDS."""
    try:
        h = (json.loads(path.read_text()).get("queue_steps") or {}).get(tenant)
    except (OSError, ValueError):
        return []
    return list(h["buckets"]) if h else []


def steps_waited(before: list[int], after: list[int]) -> dict[str, Any]:
    """The victim's requests started during a measurement, and the steps they waited in the engine
    before the step that took them (the engine's count): at most, and at the 99th percentile (a
    bucket's upper bound)."""
    delta = [n - (before[i] if i < len(before) else 0) for i, n in enumerate(after)]
    total = sum(delta)
    if not total:
        return {"victim_engine_started": 0}
    seen = 0
    p99 = float("inf")
    for bound, n in zip(QUEUE_STEP_BOUNDS, delta, strict=False):
        seen += n
        if seen >= 0.99 * total:
            p99 = bound
            break
    most = max(b for b, n in zip(QUEUE_STEP_BOUNDS, delta, strict=False) if n)
    return {"victim_engine_started": total, "victim_queue_steps_p99": p99, "victim_queue_steps_max": most}


def metrics_match_file(engine: e2e.Server, path: Path) -> bool:
    """Whether the engine's ``/metrics`` exports the stats file's service units (read just after the
    scrape; tried again while the engine still moves them)."""
    from router.support import request

    for _ in range(10):
        page = kept_samples(request("GET", engine.url + "/metrics", timeout=30)[2].decode())
        units = json.loads(path.read_text()).get("service_units") or {}
        if units and all(
            page.get(f'{METRIC_TENANT_SERVICE_UNITS}{{tenant="{t}"}}') == float(u) for t, u in units.items()
        ):
            return True
        time.sleep(0.5)
    return False


def engine_pair_figures(served: ServiceFile, engine: e2e.Server, start: float, end: float) -> dict[str, Any]:
    """The backlogged pair's service difference from the engine's own count (the fair-share units its
    scheduler charged each tenant, read from the engine core's stats file every 0.1 s), and whether
    the engine's ``/metrics`` exports the same count (one scrape after the run, against the last read)."""
    ka, kb = "tenant-a", "tenant-b"
    pts = [(t, u[ka], u[kb]) for t, u in served.reads if start <= t <= end and ka in u and kb in u]
    if len(pts) < 2:
        return {}
    base = pts[0][1] - pts[0][2]
    ds = [(t, wa - wb - base) for t, wa, wb in pts]
    seconds = range(1, int(end - start) + 1)
    by_second = [next((d for t, d in reversed(ds) if t <= start + k), 0.0) for k in seconds]
    return {
        "engine_a_units_per_s": (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]),
        "engine_b_units_per_s": (pts[-1][2] - pts[0][2]) / (pts[-1][0] - pts[0][0]),
        "engine_service_difference": max(d for _, d in ds) - min(d for _, d in ds),
        "engine_difference_by_second": by_second,
        "engine_polls": len(pts),
        "engine_reads": [(round(t - start, 2), wa, wb) for t, wa, wb in pts],
        "engine_distinct_snapshots": len({(wa, wb) for _, wa, wb in pts}),
        "engine_metrics_match_file": metrics_match_file(engine, served.path),
    }


def load_figures(v: Tenant | None, att: Tenant | None, start: float, end: float) -> dict[str, Any]:
    out: dict[str, Any] = victim_figures(v, start, end) if v else {}
    if att:
        errors = real_errors(att.records)
        out |= {
            "attacker_units_per_s": units_in(att.records, start, end) / (end - start),
            "attacker_requests": len(att.records),
            "attacker_errors": len(errors),
            "attacker_error_examples": sorted(set(errors))[:3],
        }
    return out


def service_curve(records: list[Record], start: float, end: float) -> list[tuple[float, int]]:
    return sorted((t, u) for r in records for t, u in r.service if start <= t <= end)


def pair_figures(ta: Tenant, tb: Tenant, start: float, end: float, a: argparse.Namespace) -> dict[str, Any]:
    """Service of two backlogged tenants: rates, B's share, VTC's service difference and its bound."""
    events = sorted([(t, u) for t, u in service_curve(ta.records, start, end)] +
                    [(t, -u) for t, u in service_curve(tb.records, start, end)])  # fmt: skip
    d, lo, hi, by_second = 0, 0, 0, []
    for t, u in events:
        while t >= start + len(by_second) + 1:
            by_second.append(d)
        d += u
        lo, hi = min(lo, d), max(hi, d)
    by_second += [d] * (int(end - start) - len(by_second))
    wa, wb = units_in(ta.records, start, end), units_in(tb.records, start, end)
    sa, sb = shapes(a)["tenant-a"], shapes(a)["tenant-b"]
    longest_prompt = max(sa.prompt_len, sb.prompt_len)
    batch_tokens = a.max_num_seqs * max(sa.prompt_len + sa.max_tokens, sb.prompt_len + sb.max_tokens)
    bound = 2 * max(PREFILL_COST * longest_prompt, OUTPUT_COST * batch_tokens)
    return {
        "a_units_per_s": wa / (end - start),
        "b_units_per_s": wb / (end - start),
        "b_share": wb / (wa + wb) if wa + wb else float("nan"),
        "service_difference": hi - lo,
        "difference_at_end": d,
        "difference_by_second": by_second,
        "vtc_bound": bound,
        "vtc_bound_terms": {
            "w_p": PREFILL_COST,
            "L_input": longest_prompt,
            "w_q": OUTPUT_COST,
            "M": batch_tokens,
        },
        "errors": len(real_errors(ta.records)) + len(real_errors(tb.records)),
    }


def brief(run: dict[str, Any]) -> str:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "victim_misses", "attacker_units_per_s",
            "attacker_errors", "b_share", "service_difference", "vtc_bound", "load_1m",
            "drain_s")  # fmt: skip
    return "  ".join(
        f"{k} {run[k]:.4g}" if isinstance(run[k], float) else f"{k} {run[k]}" for k in keys if k in run
    )


# --- report ------------------------------------------------------------------------------------
def pick(runs: list[dict[str, Any]], scenario: str, row: str, part: str) -> list[dict[str, Any]]:
    return sorted((r for r in runs if (r["scenario"], r["row"], r["part"]) == (scenario, row, part)),
                  key=lambda r: r["round"])  # fmt: skip


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    xs = [r[key] for r in runs if r.get(key) is not None and r[key] == r[key]]
    return statistics.median(xs) if xs else float("nan")


def attack_row(runs: list[dict[str, Any]], scenario: str, row: str) -> dict[str, Any]:
    """Victim figures next to the attacker (every round's samples pooled), pooled p99 TTFT over the
    pooled solo p99 (and each round's own ratio), p99 TTFT in steps (over the victim's own TPOT p50
    next to the attacker: a decode step of the shared batch), the work-conserving ratio (median of
    the rounds'), and where the victim's time went (medians of the rounds)."""
    both, alone = pick(runs, scenario, row, "both"), pick(runs, scenario, row, "attacker")
    solo_runs = pick(runs, "solo", row, "victim")
    solo = {r["round"]: r for r in solo_runs}
    work = [
        b["attacker_units_per_s"] / capacity_left(scenario, s, b) for b, s in zip(both, alone, strict=True)
    ]
    out = victim_row(both)
    out |= {
        "ttft_p99_vs_solo": ratio(out["ttft_p99_ms"], victim_row(solo_runs)["ttft_p99_ms"]),
        "ttft_p99_vs_solo_rounds": [ratio(b["ttft_p99_ms"], solo[b["round"]]["ttft_p99_ms"]) for b in both],
        "ttft_p99_in_steps": ratio(out["ttft_p99_ms"], out["tpot_p50_ms"]),
        "attacker_alone_units_per_s": median_of(alone, "attacker_units_per_s"),
        "attacker_units_per_s": median_of(both, "attacker_units_per_s"),
        "work_conserving": statistics.median(work),
        "attacker_errors": sum(r["attacker_errors"] for r in both + alone),
    }
    out["ttft_met"] = out["ttft_p99_vs_solo"] <= TTFT_GOAL and out["victim_misses"] == 0
    out["work_met"] = out["work_conserving"] >= WORK_GOAL
    out |= {k: median_of(both, k) for k in DIAGNOSIS}
    # the engine's queue steps, the worst over the rounds (a bucket's upper bound)
    out |= {k: max((r[k] for r in both if k in r), default=float("nan"))
            for k in ("victim_queue_steps_p99", "victim_queue_steps_max")}  # fmt: skip
    return out


#: where the victim's time went, per measurement (see where_time_goes)
DIAGNOSIS = ("engine_running_mean", "engine_waiting_mean", "victim_held", "victim_held_s",
             "victim_ttft_sum_s", "router_inflight_sequences_mean", "router_capacity_sequences",
             "victim_engine_started")  # fmt: skip


def ratio(x: float, y: float) -> float:
    return x / y if y and y == y else float("nan")


def capacity_left(scenario: str, alone: dict[str, Any], both: dict[str, Any]) -> float:
    """What the victim leaves the attacker: the attacker's rate alone (the engine saturated) less the
    victim's rate next to it; for slow readers, whose rate their own reads set, their rate alone."""
    left: float = alone["attacker_units_per_s"]
    if scenario != "slow readers":
        left -= both["victim_units_per_s"]
    return left if left > 0 else float("nan")


def victim_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The victim's TTFT and ITL percentiles over every round's samples pooled, and their counts."""
    ttft = [x for r in runs for x in r.get("ttft_ms", [])]
    itl = [x for r in runs for x in r.get("itl_ms", [])]
    tpot = [x for r in runs for x in r.get("tpot_ms", [])]
    out: dict[str, Any] = {
        "tpot_p50_ms": percentile(tpot, 50),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "ttft_samples": len(ttft),
        "itl_samples": len(itl),
        "victim_units_per_s": median_of(runs, "victim_units_per_s"),
    }
    out["victim_requests"] = sum(r["victim_requests"] for r in runs)
    out["victim_misses"] = sum(r["victim_misses"] for r in runs)
    return out


def pair_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the rounds; the last round's D(t) at each second, client-side and (where the engine
    exports its count) the engine's."""
    keys = ("a_units_per_s", "b_units_per_s", "b_share", "service_difference", "vtc_bound",
            "engine_a_units_per_s", "engine_b_units_per_s", "engine_service_difference")  # fmt: skip
    out: dict[str, Any] = {k: median_of(runs, k) for k in keys}
    out["difference_by_second"] = runs[-1].get("difference_by_second", []) if runs else []
    out["engine_difference_by_second"] = runs[-1].get("engine_difference_by_second", []) if runs else []
    out["within_bound_rounds"] = f"{sum(r['service_difference'] <= r['vtc_bound'] for r in runs)}/{len(runs)}"
    engine = [r for r in runs if "engine_service_difference" in r]
    out["engine_within_bound_rounds"] = (
        f"{sum(r['engine_service_difference'] <= r['vtc_bound'] for r in engine)}/{len(engine)}"
        if engine
        else "n/a"
    )
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for row in ROWS:
        rows[f"solo / {row}"] = victim_row(pick(runs, "solo", row, "victim"))
    ran = {r["scenario"] for r in runs}
    for scenario in ATTACKS:
        for row in ROWS if scenario in ran else ():
            rows[f"{scenario} / {row}"] = attack_row(runs, scenario, row)
    pair = {row: pair_row(pick(runs, PAIR, row, "pair")) for row in plan(PAIR)[0]} if PAIR in ran else {}
    return {"rows": rows, "pair": pair}


def fmt(x: Any, spec: str = ".1f") -> str:
    if isinstance(x, bool):
        return "met" if x else "MISSED"
    if isinstance(x, float):
        return "n/a" if x != x else format(x, spec)
    return str(x)


def markdown(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) + " |" for x in lines]
    return "\n".join(out)


def victim_table(summary: dict[str, Any]) -> str:
    header = ["scenario", "row", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "TTFT (ITL) samples", "misses", "p99 TTFT / solo", "<= 2x", "p99 TTFT in steps",
              "attacker units/s alone", "next to victim", "/ capacity left", ">= 0.9"]  # fmt: skip
    lines = []
    for name, s in summary["rows"].items():
        scenario, row = name.split(" / ")
        cells = [fmt(s[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")]
        cells += [f"{s['ttft_samples']} ({s['itl_samples']})", str(s["victim_misses"])]
        if scenario == "solo":
            cells += [""] * 7
        else:
            cells += [
                fmt(s["ttft_p99_vs_solo"], ".2f"),
                fmt(s["ttft_met"]),
                fmt(s["ttft_p99_in_steps"], ".1f"),
            ]
            cells += [fmt(s["attacker_alone_units_per_s"], ".0f"), fmt(s["attacker_units_per_s"], ".0f")]
            cells += [fmt(s["work_conserving"], ".2f"), fmt(s["work_met"])]
        lines.append([scenario, row, *cells])
    return markdown(header, lines)


def diagnosis_table(summary: dict[str, Any]) -> str:
    """Where the victim's time went next to each attacker (medians of the rounds)."""
    header = ["scenario", "row", "engine running", "engine waiting", "victim held (of req)",
              "victim s held / s TTFT", "router seqs in flight / capacity",
              "victim steps queued in engine p99 / max"]  # fmt: skip
    lines = []
    for name, s in summary["rows"].items():
        scenario, row = name.split(" / ")
        if scenario == "solo":
            continue
        cells = [fmt(s["engine_running_mean"]), fmt(s["engine_waiting_mean"])]
        if row == "kvfence":
            cells.append(f"{fmt(s['victim_held'], '.0f')} ({s['victim_requests']})")
            cells.append(f"{fmt(s['victim_held_s'], '.2f')} / {fmt(s['victim_ttft_sum_s'], '.2f')}")
            flight, cap = s["router_inflight_sequences_mean"], s["router_capacity_sequences"]
            cells.append(f"{fmt(flight)} / {fmt(cap, '.0f')}")
            p99, most = s["victim_queue_steps_p99"], s["victim_queue_steps_max"]
            cells.append(f"{fmt(p99, '.0f')} / {fmt(most, '.0f')}")
        else:
            cells += ["", "", "", ""]
        lines.append([scenario, row, *cells])
    return markdown(header, lines)


def pair_table(summary: dict[str, Any]) -> str:
    header = ["row", "A units/s", "B units/s", "B share", "D client-side", "D engine (its count)",
              "VTC bound 2U", "within: client", "within: engine"]  # fmt: skip
    lines = []
    for row, s in summary["pair"].items():
        cells = [fmt(s["a_units_per_s"], ".0f"), fmt(s["b_units_per_s"], ".0f"), fmt(s["b_share"], ".3f")]
        cells += [fmt(s["service_difference"], ".0f"), fmt(s["engine_service_difference"], ".0f")]
        cells += [fmt(s["vtc_bound"], ".0f"), s["within_bound_rounds"], s["engine_within_bound_rounds"]]
        lines.append([row, *cells])
    series = [
        f"{row}: D(t) = W_A - W_B at each second, client-side: {s['difference_by_second']}"
        + (f"; the engine's count: {[round(x) for x in s['engine_difference_by_second']]}"
           if s["engine_difference_by_second"] else "")
        for row, s in summary["pair"].items()
    ]  # fmt: skip
    return markdown(header, lines) + "\n\n" + "\n".join(series)


def report(stack: e2e.Stack, runs: list[dict[str, Any]], started: float, load: list[float]) -> Path:
    """The tables on stdout and the results file (the measurements written first, so that a figure
    that cannot be summarized loses none of them)."""
    a = stack.a
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "commit": source_commit(a),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            **e2e.machine(),
            "load_average_1m": [*load, round(os.getloadavg()[0], 2)],
            "note": a.note,
        },
        "engine": e2e.vllm_facts(a),
        "config": {k: v for k, v in vars(a).items() if k != "func"},
        "vllm_args": stack.args,
        "seconds": round(time.time() - started, 1),
        "runs": runs,
    }
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fairness-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started))}.json"
    path.write_text(json.dumps(e2e._finite(doc), indent=2) + "\n")
    summary = summarize(runs)
    print(f"\nvictim next to each attacker, median of {a.rounds} rotated round(s) ({a.note})\n")
    print(victim_table(summary))
    print("\nwhere the victim's time went (medians of the rounds; router figures on kvfence only)\n")
    print(diagnosis_table(summary))
    print(
        f"\ntwo backlogged tenants of equal weight (A: {4 * a.max_num_seqs} streams, B: {a.max_num_seqs})\n"
    )
    print(pair_table(summary))
    path.write_text(json.dumps(e2e._finite({**doc, "summary": summary}), indent=2) + "\n")
    print(f"\nwritten to {path}")
    return path


def source_commit(a: argparse.Namespace) -> str:
    """The commit the engine plugin and the router ran from: ``--rev`` for ``--source committed``, else the
    tree's (``+uncommitted`` where it differs)."""
    if a.source == "tree":
        return e2e.commit()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", a.rev], capture_output=True, text=True, check=False
    )
    return head.stdout.strip() or "unknown"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, short windows, smaller floods")
    p.add_argument(
        "--scenarios",
        type=lambda x: [s.strip() for s in x.split(",") if s.strip()],
        default=[],
        help=f"comma-separated, of: {', '.join((*ATTACKS, PAIR))} (default all; solo always runs)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=30.0, help="seconds the victim sends for")
    p.add_argument("--lead", type=float, default=5.0, help="seconds the attacker runs before the victim")
    p.add_argument("--victim-timeout", type=float, default=120.0, help="a victim request's limit (a miss)")
    p.add_argument("--victim-tokens", type=int, default=8, help="tokens out per victim request")
    p.add_argument("--scrape-every", type=float, default=1.0,
                   help="seconds between two polls of the engine's /metrics (vLLM renders the page in "
                        "tens of ms of its API server's time on CPU)")  # fmt: skip
    p.add_argument("--big-request", default="32x2", help="PROMPTSxN of the big request")
    p.add_argument("--big-prompt-len", type=int, default=256)
    p.add_argument("--big-max-tokens", type=int, default=128)
    p.add_argument("--flood", type=int, default=32, help="concurrent long prompts / long generations")
    p.add_argument("--slow-streams", type=int, default=300)
    p.add_argument("--max-num-seqs", type=int, default=16, help="in the class's extraArgs")
    p.add_argument("--source", choices=("committed", "tree"), default="committed",
                   help="engine plugin and router: --rev (git archive) or the working tree")  # fmt: skip
    p.add_argument("--rev", default="HEAD", help="the commit --source committed runs (default HEAD)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="model directory (default: the tiny test model, built offline)")
    p.add_argument("--vllm-python", default=None, help="the Python vLLM is installed in")
    p.add_argument("--plugin-path", default=str(ROOT / "engine-image"), help="for --source tree")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--note", default="", help="what else ran on the machine (kept in the results)")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.window, a.lead, a.victim_timeout = 1, 8.0, 2.0, 60.0
    prompts, _, n = a.big_request.partition("x")
    a.big_prompts, a.big_n = int(prompts), int(n or 1)
    a.vllm_python = a.vllm_python or e2e.default_vllm_python()
    unknown = set(a.scenarios) - {*ATTACKS, PAIR}
    if unknown:
        p.error(f"--scenarios: unknown {sorted(unknown)}; known: {', '.join((*ATTACKS, PAIR))}")
    return a


def main() -> None:
    a = parse(sys.argv[1:])
    started, load = time.time(), [round(os.getloadavg()[0], 2)]
    stack = setup(a)
    try:
        runs = run(stack)
    finally:
        stack.close()
    report(stack, runs, started, load)


if __name__ == "__main__":
    main()
