"""What a client loses end to end through kvfence, measured with vLLM's own client (a benchmark, not a test).

    flock /tmp/kvfence-vllm.lock .venv/bin/python bench/bench_e2e.py [--rates 8,inf] [--rounds 6]
        [--num-prompts 120] [--saturation-seconds 8] [--warmup-prompts 128] [--num-warmups 8]
        [--pin auto|router-alone|engine-alone|none] [--bootstrap 2000] [--input-len 384]
        [--output-len 32] [--prefix-len 0] [--max-concurrency 16] [--max-num-seqs 16] [--model DIR]
        [--vllm-python PATH] [--plugin-path DIR] [--device cpu|gpu] [--results-dir DIR] [--note TEXT]
        [--py-spy]

Same run, same model, same vLLM arguments (the ones the operator renders for a ``runtime: vllm``
TrustClass, ``kvfence.operator.builders``, through tests/vllm/vllmserve.py's ``rendered``), three rows:

* ``stock``: stock ``vllm serve`` with the rendered arguments minus ``--middleware`` and
  ``--scheduler-cls``, reached directly;
* ``kvfence direct``: the rendered ``vllm serve`` (kvfence middleware and fenced scheduler), reached
  directly with requests signed as the router signs them (the contract's ``sign``);
* ``kvfence + router``: the same engine behind ``kvfence-router`` (a routing table file, as the
  operator's Secret; the router's default flags), reached with a tenant's API key.

Load: ``vllm bench serve`` (the vLLM install's own client, its own figures: request throughput, output
tokens/s, TTFT and ITL p50/p99) with the random dataset (``--prefix-len N``: each prompt starts with the
same N random tokens), streamed completions, ``--max-concurrency``, at each of ``--rates`` (``inf``:
saturation). The client cannot sign, and the middleware has (rightly) no mode that skips the check, so
for ``kvfence direct`` this script runs vLLM's CLI in a process of its own (``bench_e2e.py client``,
under vLLM's Python) with ``aiohttp.ClientSession.post`` wrapped: the JSON body vLLM's request function
built is serialized and signed there, after the client took its start time, so the signing is charged
to that row's TTFT, not hidden (its mean cost per request is reported). Every row goes through the same
wrapper; only that row signs.

Pairing: run order swings throughput on a shared 2-core VM by up to 1.4x (whichever server runs
second wins), so each round runs the three rows back to back at each rate, in an order rotated every
round, and the ratios are taken round by round (median of the per-round ratios, rounds won, one-sided
sign test: bench_router.paired).
Both servers stay up for the whole run; the one not being measured is stopped with SIGSTOP (an idle
``vllm serve`` on CPU keeps a third of a core busy) and continued before its turn; the router is left
running (it is idle between its turns but for a health check every 2 s). Each measured run is preceded
by vLLM's own single-request check, and each row gets one untimed warm-up run before the first round.
Prompts are seeded per round and rate (each row sees the same prompts); the two kvfence rows use two
tenants, so the engine's prefix cache never lets one row reuse what the other computed. vLLM's client
first asks the server's ``/tokenize`` whether its prompts have the intended length (and re-cuts them if
not); the kvfence middleware refuses that path (not an inference path), so on the kvfence rows the
client skips the check. The report compares the input tokens the server counted for each row of a
round and rate (``same_prompts``): equal counts mean the three rows were sent the same prompts.
A run whose requests partly fail keeps its figures (of the completed requests), and the failures are
counted in the table's ``failed`` column with vLLM's error messages in the run's record.

Power by design: a saturation run lasts ``--saturation-seconds`` (its request count is that many
seconds at the fastest row's warm-up throughput), so that the start and the tail of a run, when fewer
than ``--max-concurrency`` requests are in flight, weigh little; each run begins with vLLM's own
``--num-warmups`` requests (not counted; they reuse the run's first prompt); below saturation each run
has ``--num-prompts`` requests and the client saves each request's TTFT (``--save-detailed``). The TTFT
p50 a row adds over its peer is the mean over rounds of the per-round difference of medians; its 95%
interval is Student's t over those per-round differences (the rounds are the units: the interval
carries the machine's drift between rounds, which on a shared VM outweighs the requests' own noise),
and beside it a bootstrap interval over the requests within each round (request indices resampled,
the same indices for both rows: request i is the same prompt sent at the same time on every row of a
round, so the noise they share cancels), the precision if every round had seen the same machine.
The throughput ratio gets a 95% t interval over the rounds' log ratios. A goal is ``met`` when its
whole interval is on the goal's side, ``MISSED`` when it is wholly on the other side, ``undecided``
otherwise: more rounds narrow it.

Layout (``--pin``): ``router-alone`` (the default for a CPU engine on two or more CPUs) runs the router
alone on the last CPU, as a router replica on CPUs of its own, and the engines and the client on the
others (the client's load, alike on every row, comes out of the engine's CPU); ``engine-alone`` runs
the engines alone on all CPUs but the last and the router and the client on the last (then the
router waits behind the client for its CPU); ``none`` leaves placement to the kernel. The results
name the layout that ran.

Attribution: each run records the CPU seconds the engine's processes, the router and the client spent
(CPU ms per request in the table), and, for the router row, the router's own counters around the run
(requests, their summed durations, requests flow control held, upstream errors). With ``--py-spy`` each
run's engine is also sampled (bench/engine_samples.py): milliseconds per request in its engine core's
step, in the scheduler's calls, in its API server and in kvfence's code there (it takes CPU from the
router row: a run to attribute a difference, not one for the goals).

Goals: ``kvfence + router`` keeps at least 0.98x of ``stock``'s request throughput at saturation and adds
at most 1 ms to TTFT p50 below it. ``kvfence direct`` splits a miss between the engine plugin and the
router. Results go to bench/results/e2e-<time>.json (date, commit, machine, load, command, layout,
every run with its per-request TTFTs).
bench/gpu/run.sh runs this inside the GPU image.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "vllm"), str(ROOT / "bench")]

import engine_samples  # noqa: E402 - bench/, this file's own folder

ROWS = ("stock", "kvfence direct", "kvfence + router")
CLASS = "gold"
#: the tenants of the two kvfence rows (distinct: distinct cache salts)
TENANT = {"kvfence direct": "bench-direct", "kvfence + router": "bench-router"}
API_KEY = "sk-bench-e2e-0123456789"
PLUGIN_FLAGS = ("--middleware", "--scheduler-cls")
#: vllm bench serve's result fields reported per row (name in its JSON -> column)
METRICS = {
    "request_throughput": "req/s",
    "output_throughput": "out tok/s",
    "median_ttft_ms": "TTFT p50 ms",
    "p99_ttft_ms": "TTFT p99 ms",
    "median_itl_ms": "ITL p50 ms",
    "p99_itl_ms": "ITL p99 ms",
}
THROUGHPUT_GOAL = 0.98
TTFT_GOAL_MS = 1.0
SIGN_STATS = "kvfence-bench-sign:"
#: what the client prints when a run ended (then its exit status)
DONE = "kvfence-bench-done:"


# --- the client: vLLM's benchmark client in a process of its own, optionally signing ---------------
def install_signer(key: bytes, tenant: str) -> list[float]:
    """Wrap ``aiohttp.ClientSession.post`` so that a JSON request is sent as bytes with the router's
    identity headers for ``tenant``; returns the list the wrapper appends each signing's seconds to."""
    from urllib.parse import urlsplit

    import aiohttp

    from kvfence.contract import Identity, cache_namespace, sign

    identity = Identity(tenant, CLASS, cache_namespace(CLASS, tenant, "Tenant"))
    post = aiohttp.ClientSession.post
    spent: list[float] = []

    def signed_post(self: Any, url: Any, *, json: Any = None, headers: Any = None, **kw: Any) -> Any:
        if json is None:
            return post(self, url, headers=headers, **kw)
        t0 = time.perf_counter()
        raw = _dumps(json)
        signed = sign(key, identity, "POST", urlsplit(str(url)).path, raw)
        h = {**(headers or {}), "Content-Type": "application/json", **signed}
        spent.append(time.perf_counter() - t0)
        return post(self, url, data=raw, headers=h, **kw)

    aiohttp.ClientSession.post = signed_post  # type: ignore[method-assign]
    return spent


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()  # what aiohttp's json= sends


def client_main() -> None:
    """``bench_e2e.py client`` (vLLM's Python): one ``vllm bench serve`` run per line of stdin, a JSON
    object ``{"argv": [its arguments], "sign": [KEYFILE, TENANT] or null}``, all in this one process
    (so that its start-up, seconds of imports on a CPU VM, is paid once a round, not once a run); after each
    run, ``DONE`` and its exit status on stdout."""
    import traceback

    import aiohttp
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    post = aiohttp.ClientSession.post
    for line in sys.stdin:
        job = json.loads(line)
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        spent = install_signer(Path(job["sign"][0]).read_bytes(), job["sign"][1]) if job["sign"] else []
        rc = 0
        try:
            serve(parser.parse_args(job["argv"]))
        except BaseException:  # argparse's SystemExit too: the run failed, the client goes on
            traceback.print_exc(file=sys.stdout)
            rc = 1
        finally:
            aiohttp.ClientSession.post = post  # type: ignore[method-assign]
        if spent:
            print(f"{SIGN_STATS} {len(spent)} {statistics.mean(spent) * 1e6:.1f}")
        print(f"{DONE} {rc}", flush=True)


# --- setup: the servers and the router -------------------------------------------------------------
@dataclass
class Server:
    """A ``vllm serve`` (or the router) in a process group of its own, stoppable with SIGSTOP."""

    name: str
    url: str
    process: Any  # support.process.ManagedProcess
    paused: bool = False

    def pause(self) -> None:
        if not self.paused:
            os.killpg(self.process.popen.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.killpg(self.process.popen.pid, signal.SIGCONT)
            self.paused = False

    def stop(self) -> None:
        self.resume()  # a stopped group would hold SIGTERM until continued
        self.process.stop()


@dataclass
class Stack:
    a: argparse.Namespace
    workdir: Path
    model: Path
    key_file: Path
    servers: dict[str, Server] = field(default_factory=dict)
    #: the rendered ``vllm serve`` arguments of each server (for the results)
    args: dict[str, list[str]] = field(default_factory=dict)
    #: where processes run: ``engine`` (both vllm serve), ``router``, ``client`` -> a CPU list for
    #: taskset; empty: unpinned
    cpus: dict[str, str] = field(default_factory=dict)
    #: the client process (``bench_e2e.py client``), started by the first run of a round
    client: Any = None  # subprocess.Popen[str]

    def pinned(self, part: str, cmd: list[str]) -> list[str]:
        """``cmd`` run on ``part``'s CPUs (``taskset -c``; its children inherit the affinity)."""
        return ["taskset", "-c", self.cpus[part], *cmd] if part in self.cpus else cmd

    def stop_client(self) -> None:
        if self.client is not None:
            self.client.stdin.close()  # its loop ends
            try:
                self.client.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.client.kill()
                self.client.wait()
            self.client = None

    def close(self) -> None:
        self.stop_client()
        for s in self.servers.values():
            s.stop()


def trust_class(a: argparse.Namespace, model: Path, port: int) -> Any:
    """The class whose engine the operator would render: vllmserve's CPU class, or its GPU twin."""
    import vllmserve

    extra = ["--max-num-seqs", str(a.max_num_seqs)]
    if a.device == "cpu":
        return vllmserve.trust_class(model, port, extraArgs=extra)
    from cluster import manifests

    from kvfence.api.trustclass import TrustClass

    engine = {
        "runtime": "vllm",
        "image": "kvfence/engine-vllm:bench",
        "model": {"name": str(model), "revision": "main", "servedName": "tiny"},
        "port": port,
        "maxModelLen": 1024,
        # two engines share the GPU (only one runs at a time, the other is stopped with SIGSTOP)
        "gpuMemoryUtilization": 0.4,
        "extraArgs": extra,
    }
    prefix = {"enabled": True, "scope": "Tenant", "hashAlgorithm": "sha256"}
    return TrustClass.model_validate(
        manifests.trust_class(CLASS, engine=engine, resources={"gpu": {"count": 1}}, prefixCache=prefix)
    )


def stock_args(args: list[str], port: int) -> list[str]:
    """The rendered arguments without the kvfence plugin's two flags (and their values), on ``port``."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg in PLUGIN_FLAGS:
            skip = True
        elif i > 0 and args[i - 1] == "--port":
            out.append(str(port))
        else:
            out.append(arg)
    assert not any(f in out for f in PLUGIN_FLAGS) and len(out) == len(args) - 4, out
    return out


def start_vllm(stack: Stack, name: str, args: list[str], env: dict[str, str], port: int) -> Server:
    from router.support import request
    from support.process import ManagedProcess

    full_env = {
        **os.environ,
        **env,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if stack.a.plugin_path:
        full_env["PYTHONPATH"] = stack.a.plugin_path
    if stack.a.device == "cpu":
        full_env["VLLM_CACHE_ROOT"] = str(Path.home() / ".cache" / "kvfence" / "vllm-compile")
    cmd = stack.pinned("engine", [stack.a.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", *args])
    log = stack.workdir / f"{name.replace(' ', '-')}.log"
    proc = ManagedProcess(cmd, log, env=full_env, new_session=True, grace=60).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(lambda: request("GET", url + "/health", timeout=2)[0] == 200, f"{name} /health", 900, 0.5)
    stack.args[name] = args
    return Server(name, url, proc)


def start_engines(stack: Stack) -> None:
    """The kvfence engine as rendered, and stock vLLM with the same arguments on another port; each
    one paused while the other starts."""
    import vllmserve
    from support.ports import free_port

    tc = trust_class(stack.a, stack.model, free_port())
    args, env, _ = vllmserve.rendered(tc, stack.key_file.read_bytes(), stack.workdir / "kvfence")
    stock_port = free_port()
    plain_env = {k: v for k, v in env.items() if not k.startswith("KVFENCE_")}
    stock = start_vllm(stack, "stock", stock_args(args, stock_port), plain_env, stock_port)
    stack.servers["stock"] = stock
    stock.pause()
    stack.servers["kvfence"] = start_vllm(stack, "kvfence", args, env, tc.spec.engine.port)


def routing_table(
    stack: Stack, tenants: dict[str, str], request_limits: dict[str, int] | None = None
) -> dict[str, Any]:
    """The routing table of the kvfence engine's class with ``tenants`` (tenant -> API key), as the
    operator writes it; ``request_limits`` replaces the router's default request limits."""
    from router.support import b64

    from kvfence.contract.routing import hash_api_key

    route: dict[str, Any] = {
        "endpoint": stack.servers["kvfence"].url,
        "runtime": "vllm",
        "servedModels": ["tiny"],
        "cacheScope": "Tenant",
        "signingKeys": [b64(stack.key_file.read_bytes())],
    }
    if request_limits:
        route["requestLimits"] = request_limits
    bound = {t: {"trustClass": CLASS, "apiKeyHashes": [hash_api_key(k)]} for t, k in tenants.items()}
    return {"version": 1, "trustClasses": {CLASS: route}, "tenants": bound}


def start_router(
    stack: Stack, table: dict[str, Any] | None = None, env: dict[str, str] | None = None
) -> None:
    """kvfence-router with its default flags, following a routing table file (by default: one tenant)."""
    from router.support import request
    from support.ports import free_port
    from support.process import ManagedProcess

    table = table or routing_table(stack, {TENANT["kvfence + router"]: API_KEY})
    path = stack.workdir / "routing.json"
    path.write_text(json.dumps(table))
    port = free_port()
    cmd = [sys.executable, "-m", "kvfence.router.server", "--routing-table", str(path)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = ManagedProcess(
        stack.pinned("router", cmd), stack.workdir / "router.log", env=env, new_session=True
    ).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(lambda: request("GET", url + "/readyz", timeout=2)[0] == 200, "router /readyz", 60, 0.2)
    stack.servers["router"] = Server("router", url, proc)


#: the ``--pin`` layouts: where the engines, the router and the client (with this script) run, as
#: "rest" (all CPUs but the last) or "last" (the last CPU)
LAYOUTS = {
    "engine-alone": {"engine": "rest", "router": "last", "client": "last"},
    "router-alone": {"engine": "rest", "router": "last", "client": "rest"},
}


def layout(pin: str, device: str, cpus: list[int], taskset: bool) -> dict[str, str]:
    """Which CPUs each part runs on (``taskset -c`` lists). ``engine-alone``: the engines on all CPUs
    but the last, the router and the client on the last, so neither takes CPU from the engine (as on a
    GPU host, where the engine's work is on the GPU). ``router-alone``: the router alone on the last
    CPU, as a router replica on CPUs of its own; the engines and the client share the rest (the
    client's load, alike on every row, then comes out of the engine's CPU). ``none``: the kernel
    places everything. ``auto``: ``router-alone`` for a CPU engine on two or more CPUs, else ``none``."""
    if pin == "auto":
        pin = "router-alone" if device == "cpu" and len(cpus) >= 2 and taskset else "none"
    if pin == "none":
        return {}
    if len(cpus) < 2 or not taskset:
        raise SystemExit(f"--pin {pin} needs taskset and two CPUs (this process may run on {cpus})")
    where = {"rest": _cpu_list(cpus[:-1]), "last": str(cpus[-1])}
    return {part: where[at] for part, at in LAYOUTS[pin].items()}


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def layout_text(cpus: dict[str, str]) -> str:
    if not cpus:
        return f"unpinned (every process may run on CPUs {_cpu_list(sorted(os.sched_getaffinity(0)))})"
    return (
        f"engines on CPU {cpus['engine']}; router on CPU {cpus['router']}; client and this script on "
        f"CPU {cpus['client']}"
    )


def setup(a: argparse.Namespace) -> Stack:
    import vllmserve

    workdir = Path(tempfile.mkdtemp(prefix="kvfence-bench-e2e-"))
    model = Path(a.model) if a.model else vllmserve.tiny_model(a.vllm_python)
    key_file = workdir / "signing-key"
    key_file.write_bytes(os.urandom(32))
    cpus = layout(a.pin, a.device, sorted(os.sched_getaffinity(0)), shutil.which("taskset") is not None)
    stack = Stack(a, workdir, model, key_file, cpus=cpus)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus["client"].split(",")})
    print(f"layout: {layout_text(cpus)}", file=sys.stderr)
    try:
        start_engines(stack)
        start_router(stack)
    except BaseException:
        stack.close()
        raise
    return stack


# --- run: rounds of the three rows at each rate, interleaved --------------------------------------
def target(stack: Stack, row: str) -> Server:
    """The server ``row`` talks to, running, with the other engine stopped (SIGSTOP) and ready."""
    from router.support import request
    from support.waiting import wait_until

    engine = "stock" if row == "stock" else "kvfence"
    idle = "kvfence" if engine == "stock" else "stock"
    stack.servers[idle].pause()
    stack.servers[engine].resume()
    server = stack.servers["router" if row == "kvfence + router" else engine]
    ready = "/readyz" if server.name == "router" else "/health"
    probe = lambda: request("GET", server.url + ready, timeout=2)[0] == 200  # noqa: E731
    wait_until(probe, f"{row} ready", 60, 0.2, ignore=(OSError,))
    return server


def client_args(stack: Stack, row: str, url: str, rate: str, seed: int, n: int, out: Path) -> list[str]:
    """``vllm bench serve``'s arguments for a run of ``row``."""
    a = stack.a
    cmd = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    cmd += ["--model", "tiny", "--tokenizer", str(stack.model), "--dataset-name", "random"]
    cmd += ["--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]
    cmd += ["--random-prefix-len", str(a.prefix_len), "--ignore-eos", "--num-prompts", str(n)]
    cmd += ["--request-rate", rate, "--max-concurrency", str(a.max_concurrency), "--seed", str(seed)]
    cmd += ["--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"]
    cmd += ["--save-result", "--save-detailed", "--result-dir", str(out.parent)]
    cmd += ["--result-filename", out.name, "--num-warmups", str(a.num_warmups)]
    if row == "kvfence + router":
        cmd += ["--header", f"Authorization=Bearer {API_KEY}"]
    return cmd


def client_process(stack: Stack) -> subprocess.Popen[str]:
    """The client (``bench_e2e.py client`` under vLLM's Python), started on first use."""
    if stack.client is None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("OPENAI_API_KEY", None)
        if stack.a.plugin_path:
            env["PYTHONPATH"] = stack.a.plugin_path
        cmd = stack.pinned("client", [stack.a.vllm_python, str(Path(__file__).resolve()), "client"])
        with (stack.workdir / "client.log").open("w") as log:
            stack.client = subprocess.Popen(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
    proc: subprocess.Popen[str] = stack.client
    return proc


def measure(stack: Stack, row: str, rate: str, seed: int, n: int, rnd: int) -> dict[str, Any]:
    """One ``vllm bench serve`` run of ``row``: its figures (vLLM's result without its per-request
    lists), each request's TTFT (by request index: the rows of a round send the same prompts at the
    same times), the CPU seconds the engine, the router and the client spent during the measured
    requests, the router's own view (router row), the load average when it began and, for the signing
    row, the client's signing cost."""
    server = target(stack, row)
    out = stack.workdir / "runs" / f"r{rnd}-{rate}-{row.replace(' ', '_').replace('+', '')}.json"
    out.parent.mkdir(exist_ok=True)
    load = os.getloadavg()[0]
    sign = [str(stack.key_file), TENANT[row]] if row == "kvfence direct" else None
    argv = client_args(stack, row, server.url, rate, seed, n, out)
    engine = "stock" if row == "stock" else "kvfence"
    sampler = sample(stack, engine, out.with_suffix(".samples")) if stack.a.py_spy else None
    try:
        stdout, rc, (cpu0, seen0), (cpu1, seen1) = run_client(stack, argv, sign, engine)
    finally:  # py-spy stopped even when the run fails
        samples = sampler.stop() if sampler is not None else None
    if rc != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed for {row} at {rate}: {stdout[-3000:]}")
    raw = json.loads(out.read_text())
    doc = {k: v for k, v in raw.items() if not isinstance(v, list)}
    if not doc.get("completed"):
        raise RuntimeError(f"{row} at {rate}: no request completed: {stdout[-3000:]}")
    run = {"row": row, "rate": rate, "round": rnd, "seed": seed, "load_1m": round(load, 2), **doc}
    parts = {"engine": engine, "router": "router", "client": "client"}
    run["cpu_s"] = {part: round(cpu1[src] - cpu0[src], 3) for part, src in parts.items()}
    run["engine_seen"] = {k: seen1[k] - seen0[k] for k in ENGINE_METRICS}
    if row == "kvfence + router":
        run["router"] = {k: seen1[k] - seen0[k] for k in ROUTER_METRICS}
    if samples is not None:
        run["samples"] = samples
    run.update(sign_cost(stdout))
    if doc.get("failed"):  # counted and shown in the table: the figures are of the completed ones
        run["client_errors"] = client_errors(stdout)
    what = f"round {rnd + 1}" if rnd >= 0 else "warm-up"
    print(f"  {what} rate {rate:>4} {row:<16} " + figures_line(run), file=sys.stderr)
    run["ttfts_ms"] = request_ttfts_ms(raw)
    return run


def sample(stack: Stack, engine: str, out_dir: Path) -> engine_samples.Sampler:
    """py-spy on ``engine``'s API server and engine core for one run (``--py-spy``), on the router's CPUs."""
    pids = engine_samples.processes(stack.servers[engine].process.popen.pid)
    pinned = ["taskset", "-c", stack.cpus["router"]] if "router" in stack.cpus else []
    return engine_samples.Sampler(pids, out_dir, pinned).start()


#: what vllm bench serve prints after its warm-up requests, as its measured requests begin
MAIN_RUN = "Starting main benchmark run"
Counts = tuple[dict[str, float], dict[str, float]]


def run_client(
    stack: Stack, argv: list[str], sign: list[str] | None, engine: str
) -> tuple[str, int, Counts, Counts]:
    """One run by the client: what it printed, its exit status, and the CPU seconds (cpu_seconds) and
    the router's and ``engine``'s counters (seen) when its measured requests began (after its warm-up
    requests) and when it ended."""
    proc = client_process(stack)
    assert proc.stdin is not None and proc.stdout is not None
    base = (cpu_seconds(stack), seen(stack, engine))
    proc.stdin.write(json.dumps({"argv": argv, "sign": sign}) + "\n")
    proc.stdin.flush()
    lines: list[str] = []
    start: Counts | None = None
    for line in proc.stdout:
        if line.startswith(DONE):
            end = (cpu_seconds(stack), seen(stack, engine))
            return "".join(lines), int(line.split()[1]), start or base, end
        lines.append(line)
        if start is None and line.startswith(MAIN_RUN):
            start = (cpu_seconds(stack), seen(stack, engine))
    log = (stack.workdir / "client.log").read_text()[-3000:]
    raise RuntimeError(f"the client exited ({proc.wait()}): {''.join(lines)[-3000:]}\n{log}")


#: the router's own metrics read around its row's runs: key -> metric (summed over its labels)
ROUTER_METRICS = {
    "requests": "kvfence_router_request_duration_seconds_count",
    "seconds": "kvfence_router_request_duration_seconds_sum",
    "held": "kvfence_router_held_requests_total",
    "upstream_errors": "kvfence_router_upstream_errors_total",
}


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system) spent so far by each engine's processes (its process group), the
    router's, and the client's."""
    got = {name: group_cpu_seconds(s.process.popen.pid) for name, s in stack.servers.items()}
    ticks = stat_cpu_ticks(Path(f"/proc/{stack.client.pid}/stat").read_text())[1] if stack.client else 0
    return {**got, "client": ticks / os.sysconf("SC_CLK_TCK")}


def group_cpu_seconds(pgid: int) -> float:
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            group, spent = stat_cpu_ticks(stat.read_text())
        except OSError:  # the process ended while this read the list
            continue
        ticks += spent if group == pgid else 0
    return ticks / os.sysconf("SC_CLK_TCK")


def stat_cpu_ticks(stat: str) -> tuple[int, int]:
    """(process group, user + system clock ticks) of a /proc/PID/stat line (the name, in parentheses,
    may hold spaces and parentheses: the fields are counted after its last ``)``)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[2]), int(fields[11]) + int(fields[12])


#: the engine's own metrics read around each run (vLLM's, from the request's arrival in its engine
#: client, after the HTTP server and the middleware): key -> metric (summed over its labels)
ENGINE_METRICS = {
    "ttft_s": "vllm:time_to_first_token_seconds_sum",
    "ttft_n": "vllm:time_to_first_token_seconds_count",
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "queue_n": "vllm:request_queue_time_seconds_count",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "prefill_n": "vllm:request_prefill_time_seconds_count",
}


def seen(stack: Stack, engine: str) -> dict[str, float]:
    """The router's counters (ROUTER_METRICS) and the running ``engine``'s (ENGINE_METRICS)."""
    return {
        **scrape(stack.servers["router"].url, ROUTER_METRICS),
        **scrape(stack.servers[engine].url, ENGINE_METRICS),
    }


def scrape(url: str, metrics: dict[str, str]) -> dict[str, float]:
    from router.support import request

    status, _, body = request("GET", url + "/metrics", timeout=5)
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    text = body.decode()
    return {k: metric_sum(text, name) for k, name in metrics.items()}


def metric_sum(text: str, name: str) -> float:
    """The sum of a metric's samples (all label sets) in Prometheus text format."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(None, 1)[1])
    return total


def request_ttfts_ms(result: dict[str, Any]) -> list[float | None]:
    """Each request's TTFT in ms from vllm bench serve's detailed result, in request order; None for
    a failed request (so that request i stays request i across rows)."""
    errors = result.get("errors") or [""] * len(result["ttfts"])
    return [None if err else round(t * 1000, 3) for t, err in zip(result["ttfts"], errors, strict=True)]


def client_errors(stdout: str) -> str:
    """What vllm bench serve printed about its failed requests (it prints up to 10)."""
    start = stdout.find("Failed requests during benchmark run detected")
    return stdout[start : start + 3000] if start >= 0 else "(not printed)"


def sign_cost(stdout: str) -> dict[str, float]:
    for line in stdout.splitlines():
        if line.startswith(SIGN_STATS):
            calls, mean_us = line.split()[1:3]
            return {"client_signatures": int(calls), "client_sign_us_mean": float(mean_us)}
    return {}


def figures_line(run: dict[str, Any]) -> str:
    line = "  ".join(f"{col} {run[k]:.2f}" for k, col in METRICS.items())
    return line + f"  failed {run.get('failed', 0)}  load {run['load_1m']}"


def order_of(rnd: int) -> tuple[str, ...]:
    """The rows' order in round ``rnd``: rotated every round, so each row runs first, second, third."""
    k = rnd % len(ROWS)
    return ROWS[k:] + ROWS[:k]


def prompts_for(rate: str, num_prompts: int, seconds: float, throughputs: list[float]) -> int:
    """Requests in a run at ``rate``: ``num_prompts`` below saturation; at saturation (``inf``) enough
    for ``seconds`` on the fastest row of the warm-up (so that start and tail, when fewer than
    ``--max-concurrency`` requests are in flight, weigh little), and never fewer than ``num_prompts``."""
    if rate != "inf":
        return num_prompts
    return max(num_prompts, math.ceil(seconds * max(throughputs)))


def run(stack: Stack) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The warm-up (every path, at saturation, untimed: it also sizes the saturation runs), then the
    rounds, each with a client process of its own; the runs and the requests per run at each rate."""
    a = stack.a
    warm = [measure(stack, row, "inf", a.seed - 1, a.warmup_prompts, -1) for row in ROWS]
    rates = [r["request_throughput"] for r in warm]
    sizes = {rate: prompts_for(rate, a.num_prompts, a.saturation_seconds, rates) for rate in a.rates}
    print(f"requests per run: {sizes}", file=sys.stderr)
    runs = []
    for rnd in range(a.rounds):
        stack.stop_client()  # a fresh client each round: whatever one leaves behind stays in its round
        for i, rate in enumerate(a.rates):
            seed = a.seed + 1000 * rnd + i
            runs += [measure(stack, row, rate, seed, sizes[rate], rnd) for row in order_of(rnd)]
    return runs, sizes


# --- report -------------------------------------------------------------------------------------
def figures(runs: list[dict[str, Any]], rate: str, row: str) -> list[dict[str, Any]]:
    got = sorted((r for r in runs if r["rate"] == rate and r["row"] == row), key=lambda r: r["round"])
    return got


def compare(runs: list[dict[str, Any]], rate: str, row: str, peer: str, boot: int) -> dict[str, Any]:
    """``row`` against ``peer`` round by round at ``rate``: the request throughput ratio (median of the
    per-round ratios, rounds won, sign test; geometric mean with its 95% interval over the rounds),
    the TTFT p50 added with its bootstrap interval (ttft_added), and the ITL p50 and TTFT p99 added in
    ms (median of the per-round differences of vLLM's figures)."""
    from bench_router import paired

    ours, theirs = figures(runs, rate, row), figures(runs, rate, peer)
    tp_ours, tp_peer = [r["request_throughput"] for r in ours], [r["request_throughput"] for r in theirs]
    wins, n, ratio, p = paired(tp_ours, tp_peer, True)
    mean, low, high = ratio_interval(tp_ours, tp_peer)
    out: dict[str, Any] = {"throughput_ratio": ratio, "throughput_rounds_won": f"{wins}/{n}", "sign_p": p}
    out["throughput_ratio_mean"], out["throughput_ratio_ci95"] = mean, [low, high]
    out["throughput_ratios"] = [x / y for x, y in zip(tp_ours, tp_peer, strict=True)]
    for k in ("median_ttft_ms", "median_itl_ms", "p99_ttft_ms"):
        diffs = [x[k] - y[k] for x, y in zip(ours, theirs, strict=True)]
        out[f"{k}_added"] = statistics.median(diffs)
    seed = sum(map(ord, f"{rate} {row} {peer}"))  # the same resamples on a rerun of the report
    out["ttft_added"] = median_added(
        [r["ttfts_ms"] for r in ours], [r["ttfts_ms"] for r in theirs], boot, seed
    )
    return out


def median_added(
    ours: list[list[float | None]], peer: list[list[float | None]], boot: int, seed: int
) -> dict[str, Any]:
    """How much higher ``ours``' median is than ``peer``'s, from per-request figures of paired runs
    (one list per round; request i of a round is the same prompt sent at the same time in both):
    the mean over rounds of the per-round difference of medians, with two 95% intervals. ``ci95``:
    Student's t over the per-round differences (the rounds are the units: it carries both the
    requests' noise and the machine's drift from round to round, and is the one the verdicts use).
    ``ci95_within``: a bootstrap over the requests of each round (``boot`` resamples of the request
    indices, the same indices for both rows, so the pairing's shared noise cancels): the precision
    the request counts alone would give if every round saw the same machine. Requests that failed in
    either run are left out of both."""
    import random

    rounds = [[(a, b) for a, b in zip(o, p, strict=True) if a is not None and b is not None]
              for o, p in zip(ours, peer, strict=True)]  # fmt: skip
    rounds = [r for r in rounds if r]
    if not rounds:
        nan = [math.nan, math.nan]
        return {"ms": math.nan, "ci95": nan, "ci95_within": nan, "per_round": [], "requests": 0}
    per_round = [_median_diff(r) for r in rounds]
    rng = random.Random(seed)
    means = sorted(
        statistics.fmean(_median_diff(rng.choices(r, k=len(r))) for r in rounds) for _ in range(boot)
    )
    low, high = (means[int(q * (boot - 1))] for q in (0.025, 0.975)) if boot else (math.nan, math.nan)
    mean, t_low, t_high = mean_interval(per_round)
    return {
        "ms": mean,
        "ci95": [t_low, t_high],
        "ci95_within": [low, high],
        "per_round": per_round,
        "requests": sum(len(r) for r in rounds),
    }


def _median_diff(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(a for a, _ in pairs) - statistics.median(b for _, b in pairs)


#: two-sided 95% quantiles of Student's t by degrees of freedom (larger: the normal's 1.96 corrected)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def ratio_interval(ours: list[float], peer: list[float]) -> tuple[float, float, float]:
    """The geometric mean of the per-round ratios ours/peer and its 95% t interval (on the log
    ratios: rounds are independent draws of the machine's state); NaN interval with one round."""
    logs = [math.log(a / b) for a, b in zip(ours, peer, strict=True) if a > 0 and b > 0]
    mean, low, high = mean_interval(logs)
    return math.exp(mean), math.exp(low), math.exp(high)


def mean_interval(xs: list[float]) -> tuple[float, float, float]:
    """The mean of ``xs`` and its 95% Student's t interval (NaN where there are too few)."""
    if not xs:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan, math.nan
    df = len(xs) - 1
    half = T95.get(df, 1.96 + 2.4 / df) * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, mean - half, mean + half


def verdict(low: float, high: float, goal: float, higher_is_better: bool) -> str:
    """``met`` when the whole interval is on the goal's side, ``MISSED`` when it is wholly on the
    other, else ``undecided`` (the run could not tell)."""
    if math.isnan(low) or math.isnan(high):
        return "undecided"
    ok, bad = (low >= goal, high < goal) if higher_is_better else (high <= goal, low > goal)
    return "met" if ok else "MISSED" if bad else "undecided"


def cpu_per_request(got: list[dict[str, Any]]) -> dict[str, float]:
    """Median over rounds of the CPU ms each part spent per completed request."""
    parts = got[0]["cpu_s"].keys()
    return {p: statistics.median(1000 * r["cpu_s"][p] / r["completed"] for r in got) for p in parts}


def engine_seen(got: list[dict[str, Any]]) -> dict[str, float]:
    """The engine's own view of a row's runs, means in ms: vLLM's TTFT (from the request's arrival in
    its engine client), its queue time and its prefill time, beside the client's mean TTFT; what the
    client sees beyond vLLM's TTFT is spent before the engine client (the HTTP server, the middleware,
    the router) or after it (the answer's way back)."""
    total = {k: sum(r["engine_seen"][k] for r in got) for k in ENGINE_METRICS}
    out = {f"{k}_mean_ms": _per(total[f"{k}_s"], total[f"{k}_n"]) for k in ("ttft", "queue", "prefill")}
    out["client_mean_ttft_ms"] = statistics.fmean(r["mean_ttft_ms"] for r in got)
    return out


def _per(seconds: float, count: float) -> float:
    return 1000 * seconds / count if count else math.nan


def router_seen(got: list[dict[str, Any]]) -> dict[str, float]:
    """The router's own view of its row's runs: its mean request duration (received to last chunk)
    against the client's mean end-to-end latency, and the requests flow control held."""
    req = sum(r["router"]["requests"] for r in got)
    return {
        "router_mean_ms": 1000 * sum(r["router"]["seconds"] for r in got) / req if req else math.nan,
        "client_mean_e2el_ms": statistics.fmean(r["mean_e2el_ms"] for r in got),
        "held": sum(r["router"]["held"] for r in got),
        "upstream_errors": sum(r["router"]["upstream_errors"] for r in got),
    }


def summarize(runs: list[dict[str, Any]], rates: list[str], boot: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for rate in rates:
        for row in ROWS:
            got = figures(runs, rate, row)
            med = {k: statistics.median(r[k] for r in got) for k in METRICS}
            med["failed"] = sum(r.get("failed", 0) for r in got)
            vs = {} if row == "stock" else compare(runs, rate, row, "stock", boot)
            if row == "kvfence + router":
                vs["router_alone"] = compare(runs, rate, row, "kvfence direct", boot)
            s = {"rate": rate, "row": row, "median": med, "vs_stock": vs, "cpu_ms_per_request": {}}
            s["cpu_ms_per_request"] = cpu_per_request(got)
            s["engine_seen"] = engine_seen(got)
            if all("samples" in r for r in got):
                completed = sum(int(r["completed"]) for r in got)
                s["sampled_ms_per_request"] = engine_samples.per_request_ms(
                    [r["samples"] for r in got], completed
                )
            if row == "kvfence + router":
                s["router_seen"] = router_seen(got)
            rows[f"{rate} {row}"] = s
    return {"rows": rows, "goals": goals(rows, rates), "same_prompts": same_prompts(runs)}


def same_prompts(runs: list[dict[str, Any]]) -> bool:
    """Whether, in every round and at every rate, the server counted the same input tokens on each row."""
    counts: dict[tuple[int, str], set[int]] = {}
    for r in runs:
        counts.setdefault((r["round"], r["rate"]), set()).add(r["total_input_tokens"])
    return all(len(c) == 1 for c in counts.values())


def goals(rows: dict[str, Any], rates: list[str]) -> dict[str, Any]:
    """The two goals, each met, MISSED or undecided by its 95% interval, with the part of the
    difference the engine plugin (kvfence direct against stock) and the router (kvfence + router
    against kvfence direct) account for: throughput where ``inf`` (saturation) ran, TTFT at every
    other rate."""
    out: dict[str, Any] = throughput_goal(rows) if "inf" in rates else {}
    out["ttft_added_ms"] = {rate: ttft_goal(rows, rate) for rate in rates if rate != "inf"}
    return out


def throughput_goal(rows: dict[str, Any]) -> dict[str, Any]:
    full = rows["inf kvfence + router"]["vs_stock"]
    low, high = full["throughput_ratio_ci95"]
    engine, router = rows["inf kvfence direct"]["vs_stock"], full["router_alone"]
    return {
        "saturation_rate": "inf",
        "throughput_ratio": full["throughput_ratio"],
        "throughput_ratio_mean": full["throughput_ratio_mean"],
        "throughput_ratio_ci95": [low, high],
        "throughput_ratios": full["throughput_ratios"],
        "throughput_met": full["throughput_ratio"] >= THROUGHPUT_GOAL,
        "throughput_verdict": verdict(low, high, THROUGHPUT_GOAL, True),
        "throughput_engine_part": engine["throughput_ratio"],
        "throughput_router_part": router["throughput_ratio"],
        "throughput_parts": {
            part: {"mean": c["throughput_ratio_mean"], "ci95": c["throughput_ratio_ci95"]}
            for part, c in (("engine", engine), ("router", router))
        },
    }


def ttft_goal(rows: dict[str, Any], rate: str) -> dict[str, Any]:
    c = rows[f"{rate} kvfence + router"]["vs_stock"]
    t = c["ttft_added"]
    low, high = t["ci95"]
    return {
        "total": t["ms"],
        "ci95": t["ci95"],
        "ci95_within": t["ci95_within"],
        "per_round": t["per_round"],
        "met": t["ms"] <= TTFT_GOAL_MS,
        "verdict": verdict(low, high, TTFT_GOAL_MS, False),
        "engine_part": rows[f"{rate} kvfence direct"]["vs_stock"]["ttft_added"],
        "router_part": c["router_alone"]["ttft_added"],
    }


def _ci(x: dict[str, Any]) -> str:
    return f"{x['ms']:+.2f} [{x['ci95'][0]:+.2f}, {x['ci95'][1]:+.2f}]"


def print_table(summary: dict[str, Any]) -> None:
    header = ["rate", "path", *METRICS.values(), "failed", "req/s vs stock", "TTFT p50 added ms [95%]"]
    header += ["CPU ms/req engine", "router", "client"]
    lines = []
    for s in summary["rows"].values():
        vs, cpu = s["vs_stock"], s["cpu_ms_per_request"]
        ratio = "" if not vs else f"{vs['throughput_ratio']:.3f} ({vs['throughput_rounds_won']})"
        added = "" if not vs else _ci(vs["ttft_added"])
        cells = [f"{s['median'][k]:.2f}" for k in METRICS]
        cpus = [f"{cpu[p]:.2f}" for p in ("engine", "router", "client")]
        lines.append([s["rate"], s["row"], *cells, str(s["median"]["failed"]), ratio, added, *cpus])
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for x in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) + " |")


def _ratio(mean: float, ci: list[float]) -> str:
    return f"{mean:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def print_goals(g: dict[str, Any]) -> None:
    print()
    if "throughput_ratio" in g:
        parts, full = g["throughput_parts"], _ratio(g["throughput_ratio_mean"], g["throughput_ratio_ci95"])
        print(
            f"throughput at saturation: kvfence + router / stock = {g['throughput_ratio']:.3f} (median of "
            f"rounds; geometric mean and 95% {full}; "
            f"goal >= {THROUGHPUT_GOAL}: {g['throughput_verdict']}); per round "
            + ", ".join(f"{x:.3f}" for x in g["throughput_ratios"])
            + f"; engine plugin {_ratio(parts['engine']['mean'], parts['engine']['ci95'])}, "
            f"router {_ratio(parts['router']['mean'], parts['router']['ci95'])}"
        )
    for rate, t in g["ttft_added_ms"].items():
        within = t["ci95_within"]
        print(
            f"TTFT p50 added at {rate} req/s: {t['total']:+.2f} ms, 95% over rounds [{t['ci95'][0]:+.2f}, "
            f"{t['ci95'][1]:+.2f}] (goal <= {TTFT_GOAL_MS}: {t['verdict']}); within rounds "
            f"[{within[0]:+.2f}, {within[1]:+.2f}]; per round "
            + ", ".join(f"{x:+.2f}" for x in t["per_round"])
            + f"; engine plugin {_ci(t['engine_part'])}, router {_ci(t['router_part'])}"
        )


def print_router(summary: dict[str, Any]) -> None:
    for s in summary["rows"].values():
        e = s["engine_seen"]
        print(
            f"engine's view at {s['rate']}, {s['row']}: mean TTFT {e['ttft_mean_ms']:.2f} ms (queue "
            f"{e['queue_mean_ms']:.2f}, prefill {e['prefill_mean_ms']:.2f}); the client's mean TTFT "
            f"{e['client_mean_ttft_ms']:.2f} ms"
        )
    for s in summary["rows"].values():
        if "router_seen" in s:
            v = s["router_seen"]
            print(
                f"router's view at {s['rate']}: mean request {v['router_mean_ms']:.2f} ms (client's mean "
                f"end to end {v['client_mean_e2el_ms']:.2f} ms), held {v['held']:.0f}, upstream errors "
                f"{v['upstream_errors']:.0f}"
            )


def print_samples(summary: dict[str, Any]) -> None:
    """``--py-spy``: each row's sampled milliseconds per request (bench/engine_samples.py)."""
    for s in summary["rows"].values():
        got = s.get("sampled_ms_per_request")
        if got:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in got.items())
            print(f"sampled at {s['rate']}, {s['row']} (ms a request): {parts}")


def machine() -> dict[str, Any]:
    cpu = ""
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    gpu = shutil.which("nvidia-smi")
    gpus = subprocess.run([gpu, "-L"], capture_output=True, text=True, check=False).stdout if gpu else ""
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpus": gpus.strip().splitlines(),
        "python": platform.python_version(),
    }


def commit() -> str:
    """The tree's commit (+uncommitted when bench/, engine-image/ or operator/ differ from it), or
    ``$KVFENCE_BENCH_COMMIT`` where there is no git (inside the GPU image: bench/gpu/run.sh sets it)."""
    if os.environ.get("KVFENCE_BENCH_COMMIT") or not shutil.which("git"):
        return os.environ.get("KVFENCE_BENCH_COMMIT", "unknown")
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "bench", "engine-image", "operator"],
                           capture_output=True, text=True, check=False).stdout  # fmt: skip
    return head.strip() + ("+uncommitted" if dirty.strip() else "") if head else "unknown"


def vllm_facts(a: argparse.Namespace) -> dict[str, Any]:
    """vLLM's version and which prefix-cache records the engine's kvfence loads (its Python, its path)."""
    code = "import json, vllm; from kvfence.vllm import records; "
    code += "print(json.dumps({'vllm': vllm.__version__, 'records_compiled': records.COMPILED}))"
    env = {**os.environ, "PYTHONPATH": a.plugin_path} if a.plugin_path else dict(os.environ)
    res = subprocess.run([a.vllm_python, "-c", code], capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        return {"error": res.stderr[-500:]}
    facts: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return facts


def report(
    stack: Stack,
    runs: list[dict[str, Any]],
    sizes: dict[str, int],
    started: tuple[float, str],
    load: list[float],
) -> Path:
    """The table and the verdicts; the results file. ``started``: the time and the commit (commit())
    the run began at; the file names the commit at its end too where the tree changed meanwhile."""
    started_at, head = started
    a = stack.a
    summary = summarize(runs, a.rates, a.bootstrap)
    print(f"\nend to end, vllm bench serve, median of {a.rounds} paired rounds ({a.note})")
    print(f"requests per run {sizes}; {layout_text(stack.cpus)}\n")
    print_table(summary)
    print_goals(summary["goals"])
    print_router(summary)
    print_samples(summary)
    if not summary["same_prompts"]:
        print("NOTE: the rows of a round were not sent prompts of the same length (see the runs' records)")
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at)),
        "commit": head,
        **({} if commit() == head else {"commit_at_end": commit()}),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**machine(), "load_average_1m": [*load, round(os.getloadavg()[0], 2)], "note": a.note},
        "engine": vllm_facts(a),
        "config": {k: v for k, v in vars(a).items() if k != "func"},
        "layout": {"cpus": stack.cpus, "text": layout_text(stack.cpus)},
        "requests_per_run": sizes,
        "vllm_args": stack.args,
        "seconds": round(time.time() - started_at, 1),
        "summary": summary,
        "runs": runs,
    }
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"e2e-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started_at))}.json"
    path.write_text(json.dumps(_finite(doc), indent=2) + "\n")
    print(f"\nwritten to {path}")
    return path


def _finite(x: Any) -> Any:
    """NaN (a figure not measured) as null, for JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def default_vllm_python() -> str:
    res = subprocess.run(
        [str(ROOT / "tests/vllm/install-vllm.sh"), "--print"], capture_output=True, text=True
    )
    return res.stdout.strip()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="8,inf", help="request rates (req/s) to run, inf = saturation")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--num-prompts", type=int, default=120, help="requests per run below saturation")
    p.add_argument(
        "--saturation-seconds",
        type=float,
        default=8.0,
        help="a saturation run's length: its requests are this many seconds at the warm-up's rate",
    )
    p.add_argument(
        "--warmup-prompts", type=int, default=128, help="each row's untimed warm-up run (saturation)"
    )
    p.add_argument(
        "--num-warmups", type=int, default=8, help="vllm bench serve's warm-up requests before each run"
    )
    p.add_argument(
        "--pin",
        choices=("auto", *LAYOUTS, "none"),
        default="auto",
        help="engine-alone: engines on all CPUs but the last, router and client on the last; "
        "router-alone: router on the last, engines and client on the others; auto: router-alone for "
        "--device cpu on two or more CPUs",
    )
    p.add_argument("--bootstrap", type=int, default=2000, help="resamples for the TTFT intervals")
    p.add_argument("--input-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=0, help="random tokens every prompt starts with")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16, help="in the class's extraArgs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="model directory (default: the tiny test model, built offline)")
    p.add_argument("--vllm-python", default=None, help="the Python vLLM is installed in")
    p.add_argument(
        "--plugin-path",
        default=str(ROOT / "engine-image"),
        help="PYTHONPATH for vLLM's processes ('' where kvfence is installed there, as in the GPU image)",
    )
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--note", default="", help="what else ran on the machine (kept in the results)")
    p.add_argument(
        "--py-spy",
        action="store_true",
        help="sample each run's engine (API server and engine core) with py-spy: where its time goes "
        "(bench/engine_samples.py; it takes CPU from the router row)",
    )
    a = p.parse_args(argv)
    a.rates = [r.strip() for r in a.rates.split(",")]
    a.vllm_python = a.vllm_python or default_vllm_python()
    if a.py_spy:
        engine_samples.py_spy()  # fails now, not after the engines started
    return a


def main() -> None:
    if sys.argv[1:2] == ["client"]:
        client_main()
        return
    a = parse(sys.argv[1:])
    started, load = (time.time(), commit()), [round(os.getloadavg()[0], 2)]
    stack = setup(a)
    try:
        runs, sizes = run(stack)
    finally:
        stack.close()
    report(stack, runs, sizes, started, load)


if __name__ == "__main__":
    main()
