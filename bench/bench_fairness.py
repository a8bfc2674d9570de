"""Service isolation on real vLLM: a victim tenant next to noisy neighbours (a benchmark, not a test).

    flock /tmp/kvfence-vllm.lock .venv/bin/python bench/bench_fairness.py [--quick] [--rounds 3]
        [--window 30] [--lead 5] [--max-num-seqs 16] [--big-request 32x2] [--slow-streams 300]
        [--source committed|tree] [--vllm-python PATH] [--results-dir DIR] [--note TEXT]

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
commit at HEAD, exported with ``git archive``, so work in progress in the tree is not measured):

* ``solo``: the victim alone: one stream at a time, a 64-token prompt, 32 tokens out;
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

Figures and goals:

* victim TTFT and ITL p50/p99 on each row and scenario, and p99 TTFT against the same row's solo
  p99 (goal: at most 2x);
* work conservation: the attacker's service rate next to the victim, over the capacity the victim
  leaves (the attacker's rate alone less the victim's rate in the same run; for slow readers, whose
  rate their own reads set, their rate alone; goal: at least 0.9);
* the service difference of the backlogged pair: with W_A(t), W_B(t) each tenant's cumulative units
  and D = W_A - W_B (0 where the measured window starts; printed at each second, the last round's),
  the largest |D(t2) - D(t1)| over t1 < t2 in the window (= max D - min D), against the bound VTC
  proves for two backlogged clients (Sheng et al., OSDI '24): 2 U with U = max(w_p L_input, w_q M),
  here w_p = 4, w_q = 8, L_input the longest prompt and M the tokens a running batch can hold
  (``max_num_seqs`` x the longest prompt plus its output).

Pairing: each round runs every row of a scenario back to back, in an order rotated every round;
the other engines are stopped (SIGSTOP) while one is measured, and after each measurement the engine
is drained (no request running or waiting) before the next. Results: bench/results/fairness-<time>.json
(date, commit, machine, command, every measurement's figures) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
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

ROOT = e2e.ROOT
ROWS = ("stock", "stock priority", "kvfence")
ATTACKS = ("big request", "long prompts", "long generations", "slow readers")
PAIR = "backlogged pair"
#: the tenants and their API keys at the router
KEYS = {t: f"sk-bench-fair-{t}-0123456789" for t in ("victim", "attacker", "tenant-a", "tenant-b")}
#: service units per prompt and output token (the fair-share policy's, kvfence.isolation.fairshare)
PROMPT_UNITS, OUTPUT_UNITS = 4, 8
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
        units += OUTPUT_UNITS * len(choice.get("token_ids") or [0])
        prompt = choice["index"] // n
        if prompt not in seen:
            seen.add(prompt)
            units += PROMPT_UNITS * prompt_len
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


def small_rcvbuf(addr_info: Any) -> socket.socket:
    """A client socket that takes at most a few KiB before the server's writes block."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
    return sock


async def drive(
    victim: Tenant | None, attacker: Tenant | None, lead: float, window: float
) -> tuple[float, float]:
    """The attacker from 0, the victim from ``lead`` for ``window`` seconds (its last request
    finished); the measured interval (start, end), in seconds since the start."""
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    tasks = [asyncio.create_task(attacker.loop(t0, lambda: False))] if attacker else []
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


async def drive_pair(a: Tenant, b: Tenant, lead: float, window: float) -> tuple[float, float]:
    """Both tenants from 0; measured from ``lead`` (both backlogged) for ``window`` seconds."""
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(t.loop(t0, lambda: False)) for t in (a, b)]
    await asyncio.sleep(lead + window)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return lead, lead + window


# --- setup: the engines and the router ---------------------------------------------------------
def snapshot(workdir: Path) -> Path:
    """engine-image/ and operator/ as committed at HEAD, with the compiled modules of the tree whose C
    source is unchanged from HEAD (others left out: the Python fallback, named in the results)."""
    dest = workdir / "src"
    dest.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD", "engine-image", "operator"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    for built in ROOT.glob("engine-image/kvfence/**/*.so"):
        source = built.with_name(built.name.split(".")[0] + ".c")
        diff = subprocess.run(
            ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", str(source)], check=False
        )
        if diff.returncode == 0:
            shutil.copy2(built, dest / built.relative_to(ROOT))
    return dest


def start_engines(stack: e2e.Stack) -> None:
    """The rendered kvfence engine, and stock vLLM with the same arguments twice (first come first
    served, and the priority policy); each paused while the next starts."""
    import vllmserve
    from support.ports import free_port

    tc = e2e.trust_class(stack.a, stack.model, free_port())
    args, env, _ = vllmserve.rendered(tc, stack.key_file.read_bytes(), stack.workdir / "kvfence")
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
        src = snapshot(workdir)
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
        "victim": Shape(1, 64, 32),
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
    ``both`` or ``pair``; its figures."""
    a = stack.a
    url, engine = activate(stack, row)
    load = os.getloadavg()[0]
    if part == "pair":
        ta, tb = (tenant(stack, row, url, t, t, seed + i) for i, t in enumerate(("tenant-a", "tenant-b")))
        start, end = asyncio.run(drive_pair(ta, tb, a.lead, a.window))
        figs = pair_figures(ta, tb, start, end, a)
    else:
        victim = tenant(stack, row, url, "victim", "victim", seed) if part != "attacker" else None
        attacker = tenant(stack, row, url, "attacker", scenario, seed + 1) if part != "victim" else None
        lead = a.lead if attacker else 0.0
        start, end = asyncio.run(drive(victim, attacker, lead, a.window))
        figs = load_figures(victim, attacker, start, end)
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
    ttft, itl = [], []
    for r in v.records:
        if r.arrivals:
            ttft.append((r.arrivals[0] - r.sent) * 1e3)
            itl += [(y - x) * 1e3 for x, y in zip(r.arrivals, r.arrivals[1:], strict=False)]
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
    bound = 2 * max(PROMPT_UNITS * longest_prompt, OUTPUT_UNITS * batch_tokens)
    return {
        "a_units_per_s": wa / (end - start),
        "b_units_per_s": wb / (end - start),
        "b_share": wb / (wa + wb) if wa + wb else float("nan"),
        "service_difference": hi - lo,
        "difference_at_end": d,
        "difference_by_second": by_second,
        "vtc_bound": bound,
        "vtc_bound_terms": {
            "w_p": PROMPT_UNITS,
            "L_input": longest_prompt,
            "w_q": OUTPUT_UNITS,
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
    """Victim figures next to the attacker, p99 TTFT over solo and the work-conserving ratio, each the
    median of the rounds' own ratios."""
    both, alone = pick(runs, scenario, row, "both"), pick(runs, scenario, row, "attacker")
    solo = {r["round"]: r for r in pick(runs, "solo", row, "victim")}
    ttft_x = [b["ttft_p99_ms"] / solo[b["round"]]["ttft_p99_ms"] for b in both]
    work = [
        b["attacker_units_per_s"] / capacity_left(scenario, s, b) for b, s in zip(both, alone, strict=True)
    ]
    out = victim_row(both)
    out |= {
        "ttft_p99_vs_solo": statistics.median(ttft_x),
        "attacker_alone_units_per_s": median_of(alone, "attacker_units_per_s"),
        "attacker_units_per_s": median_of(both, "attacker_units_per_s"),
        "work_conserving": statistics.median(work),
        "attacker_errors": sum(r["attacker_errors"] for r in both + alone),
    }
    out["ttft_met"] = out["ttft_p99_vs_solo"] <= TTFT_GOAL and out["victim_misses"] == 0
    out["work_met"] = out["work_conserving"] >= WORK_GOAL
    return out


def capacity_left(scenario: str, alone: dict[str, Any], both: dict[str, Any]) -> float:
    """What the victim leaves the attacker: the attacker's rate alone (the engine saturated) less the
    victim's rate next to it; for slow readers, whose rate their own reads set, their rate alone."""
    left: float = alone["attacker_units_per_s"]
    if scenario != "slow readers":
        left -= both["victim_units_per_s"]
    return left if left > 0 else float("nan")


def victim_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "victim_units_per_s")
    out: dict[str, Any] = {k: median_of(runs, k) for k in keys}
    out["victim_requests"] = sum(r["victim_requests"] for r in runs)
    out["victim_misses"] = sum(r["victim_misses"] for r in runs)
    return out


def pair_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("a_units_per_s", "b_units_per_s", "b_share", "service_difference", "vtc_bound")
    out: dict[str, Any] = {k: median_of(runs, k) for k in keys}
    out["difference_by_second"] = runs[-1].get("difference_by_second", []) if runs else []
    out["within_bound_rounds"] = f"{sum(r['service_difference'] <= r['vtc_bound'] for r in runs)}/{len(runs)}"
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for row in ROWS:
        rows[f"solo / {row}"] = victim_row(pick(runs, "solo", row, "victim"))
    for scenario in ATTACKS:
        for row in ROWS:
            rows[f"{scenario} / {row}"] = attack_row(runs, scenario, row)
    pair = {row: pair_row(pick(runs, PAIR, row, "pair")) for row in plan(PAIR)[0]}
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
              "victim req (miss)", "p99 TTFT / solo", "<= 2x", "attacker units/s alone", "next to victim",
              "/ capacity left", ">= 0.9"]  # fmt: skip
    lines = []
    for name, s in summary["rows"].items():
        scenario, row = name.split(" / ")
        cells = [fmt(s[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")]
        cells.append(f"{s['victim_requests']} ({s['victim_misses']})")
        if scenario == "solo":
            cells += [""] * 6
        else:
            cells += [fmt(s["ttft_p99_vs_solo"], ".2f"), fmt(s["ttft_met"])]
            cells += [fmt(s["attacker_alone_units_per_s"], ".0f"), fmt(s["attacker_units_per_s"], ".0f")]
            cells += [fmt(s["work_conserving"], ".2f"), fmt(s["work_met"])]
        lines.append([scenario, row, *cells])
    return markdown(header, lines)


def pair_table(summary: dict[str, Any]) -> str:
    header = ["row", "A units/s", "B units/s", "B share", "service difference", "VTC bound 2U", "within"]
    lines = []
    for row, s in summary["pair"].items():
        cells = [fmt(s["a_units_per_s"], ".0f"), fmt(s["b_units_per_s"], ".0f"), fmt(s["b_share"], ".3f")]
        cells += [fmt(s["service_difference"], ".0f"), fmt(s["vtc_bound"], ".0f"), s["within_bound_rounds"]]
        lines.append([row, *cells])
    series = [
        f"{row}: D(t) = W_A - W_B at each second: {s['difference_by_second']}"
        for row, s in summary["pair"].items()
    ]
    return markdown(header, lines) + "\n\n" + "\n".join(series)


def report(stack: e2e.Stack, runs: list[dict[str, Any]], started: float, load: list[float]) -> Path:
    a = stack.a
    summary = summarize(runs)
    print(f"\nvictim next to each attacker, median of {a.rounds} rotated round(s) ({a.note})\n")
    print(victim_table(summary))
    print(
        f"\ntwo backlogged tenants of equal weight (A: {4 * a.max_num_seqs} streams, B: {a.max_num_seqs})\n"
    )
    print(pair_table(summary))
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
        "summary": summary,
        "runs": runs,
    }
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fairness-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started))}.json"
    path.write_text(json.dumps(e2e._finite(doc), indent=2) + "\n")
    print(f"\nwritten to {path}")
    return path


def source_commit(a: argparse.Namespace) -> str:
    """The commit the engine plugin and the router ran from: HEAD for ``--source committed``, else the
    tree's (``+uncommitted`` where it differs)."""
    if a.source == "tree":
        return e2e.commit()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return head.stdout.strip() or "unknown"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one round, short windows, smaller floods")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=30.0, help="seconds the victim sends for")
    p.add_argument("--lead", type=float, default=5.0, help="seconds the attacker runs before the victim")
    p.add_argument("--victim-timeout", type=float, default=120.0, help="a victim request's limit (a miss)")
    p.add_argument("--big-request", default="32x2", help="PROMPTSxN of the big request")
    p.add_argument("--big-prompt-len", type=int, default=256)
    p.add_argument("--big-max-tokens", type=int, default=128)
    p.add_argument("--flood", type=int, default=32, help="concurrent long prompts / long generations")
    p.add_argument("--slow-streams", type=int, default=300)
    p.add_argument("--max-num-seqs", type=int, default=16, help="in the class's extraArgs")
    p.add_argument("--source", choices=("committed", "tree"), default="committed",
                   help="engine plugin and router: HEAD (git archive) or the working tree")  # fmt: skip
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
