"""What a client loses end to end through kvfence, measured with vLLM's own client (a benchmark, not a test).

    flock /tmp/kvfence-vllm.lock .venv/bin/python bench/bench_e2e.py [--rates 2,4,8,inf] [--rounds 3]
        [--num-prompts 160] [--input-len 384] [--output-len 32] [--prefix-len 0] [--max-concurrency 16]
        [--max-num-seqs 16] [--model DIR] [--vllm-python PATH] [--plugin-path DIR] [--device cpu|gpu]
        [--results-dir DIR] [--note TEXT]

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

Goals: ``kvfence + router`` keeps at least 0.98x of ``stock``'s request throughput at saturation and adds
at most 1 ms to TTFT p50 below it. ``kvfence direct`` splits a miss between the engine plugin and the
router. Results go to bench/results/e2e-<time>.json (date, commit, machine, load, command, every run).
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
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "vllm")]

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


# --- the client: vLLM's CLI in a process of its own, optionally signing --------------------------
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


def client_main(argv: list[str]) -> None:
    """``bench_e2e.py client [--sign KEYFILE TENANT] -- <vllm CLI arguments>`` (vLLM's Python)."""
    spent: list[float] | None = None
    if argv[:1] == ["--sign"]:
        spent = install_signer(Path(argv[1]).read_bytes(), argv[2])
        argv = argv[3:]
    assert argv[:1] == ["--"], f"usage: client [--sign KEYFILE TENANT] -- ARGS (got {argv[:3]})"
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv[1:]]
    try:
        vllm_main()
    finally:
        if spent:
            print(f"{SIGN_STATS} {len(spent)} {statistics.mean(spent) * 1e6:.1f}", file=sys.stderr)


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

    def close(self) -> None:
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
    cmd = [stack.a.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", *args]
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
    proc = ManagedProcess(cmd, stack.workdir / "router.log", env=env, new_session=True).start()
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(lambda: request("GET", url + "/readyz", timeout=2)[0] == 200, "router /readyz", 60, 0.2)
    stack.servers["router"] = Server("router", url, proc)


def setup(a: argparse.Namespace) -> Stack:
    import vllmserve

    workdir = Path(tempfile.mkdtemp(prefix="kvfence-bench-e2e-"))
    model = Path(a.model) if a.model else vllmserve.tiny_model(a.vllm_python)
    key_file = workdir / "signing-key"
    key_file.write_bytes(os.urandom(32))
    stack = Stack(a, workdir, model, key_file)
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


def client_cmd(stack: Stack, row: str, url: str, rate: str, seed: int, n: int, out: Path) -> list[str]:
    a = stack.a
    cmd = [a.vllm_python, str(Path(__file__).resolve()), "client"]
    if row == "kvfence direct":
        cmd += ["--sign", str(stack.key_file), TENANT[row]]
    cmd += ["--", "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    cmd += ["--model", "tiny", "--tokenizer", str(stack.model), "--dataset-name", "random"]
    cmd += ["--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]
    cmd += ["--random-prefix-len", str(a.prefix_len), "--ignore-eos", "--num-prompts", str(n)]
    cmd += ["--request-rate", rate, "--max-concurrency", str(a.max_concurrency), "--seed", str(seed)]
    cmd += ["--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if row == "kvfence + router":
        cmd += ["--header", f"Authorization=Bearer {API_KEY}"]
    return cmd


def measure(stack: Stack, row: str, rate: str, seed: int, n: int, rnd: int) -> dict[str, Any]:
    """One ``vllm bench serve`` run of ``row``; its figures (all of vLLM's result but the per-request
    lists), the load average when it began and, for the signing row, the client's signing cost."""
    server = target(stack, row)
    out = stack.workdir / "runs" / f"r{rnd}-{rate}-{row.replace(' ', '_').replace('+', '')}.json"
    out.parent.mkdir(exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("OPENAI_API_KEY", None)
    if stack.a.plugin_path:
        env["PYTHONPATH"] = stack.a.plugin_path
    load = os.getloadavg()[0]
    cmd = client_cmd(stack, row, server.url, rate, seed, n, out)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed for {row} at {rate}: {res.stderr[-3000:]}")
    doc = {k: v for k, v in json.loads(out.read_text()).items() if not isinstance(v, list)}
    if not doc.get("completed"):
        raise RuntimeError(f"{row} at {rate}: no request completed: {res.stdout[-3000:]}")
    run = {"row": row, "rate": rate, "round": rnd, "seed": seed, "load_1m": round(load, 2), **doc}
    run.update(sign_cost(res.stderr))
    if doc.get("failed"):  # counted and shown in the table: the figures are of the completed ones
        run["client_errors"] = client_errors(res.stdout)
    print(f"  round {rnd + 1} rate {rate:>4} {row:<16} " + figures_line(run), file=sys.stderr)
    return run


def client_errors(stdout: str) -> str:
    """What vllm bench serve printed about its failed requests (it prints up to 10)."""
    start = stdout.find("Failed requests during benchmark run detected")
    return stdout[start : start + 3000] if start >= 0 else "(not printed)"


def sign_cost(stderr: str) -> dict[str, float]:
    for line in stderr.splitlines():
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


def run(stack: Stack) -> list[dict[str, Any]]:
    a = stack.a
    for row in ROWS:  # untimed warm-up of every path
        measure(stack, row, "inf", a.seed - 1, a.warmup_prompts, -1)
    runs = []
    for rnd in range(a.rounds):
        for i, rate in enumerate(a.rates):
            seed = a.seed + 1000 * rnd + i
            runs += [measure(stack, row, rate, seed, a.num_prompts, rnd) for row in order_of(rnd)]
    return runs


# --- report -------------------------------------------------------------------------------------
def figures(runs: list[dict[str, Any]], rate: str, row: str) -> list[dict[str, Any]]:
    got = sorted((r for r in runs if r["rate"] == rate and r["row"] == row), key=lambda r: r["round"])
    return got


def compare(runs: list[dict[str, Any]], rate: str, row: str, peer: str) -> dict[str, Any]:
    """``row`` against ``peer`` round by round at ``rate``: throughput ratio (median, rounds won, sign
    test) and the TTFT/ITL p50 added, in ms (median of the per-round differences)."""
    from bench_router import paired

    ours, theirs = figures(runs, rate, row), figures(runs, rate, peer)
    wins, n, ratio, p = paired(
        [r["request_throughput"] for r in ours], [r["request_throughput"] for r in theirs], True
    )
    out: dict[str, Any] = {"throughput_ratio": ratio, "throughput_rounds_won": f"{wins}/{n}", "sign_p": p}
    for k in ("median_ttft_ms", "median_itl_ms", "p99_ttft_ms"):
        diffs = [x[k] - y[k] for x, y in zip(ours, theirs, strict=True)]
        out[f"{k}_added"] = statistics.median(diffs)
    return out


def summarize(runs: list[dict[str, Any]], rates: list[str]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for rate in rates:
        for row in ROWS:
            got = figures(runs, rate, row)
            med = {k: statistics.median(r[k] for r in got) for k in METRICS}
            med["failed"] = sum(r.get("failed", 0) for r in got)
            vs = {} if row == "stock" else compare(runs, rate, row, "stock")
            if row == "kvfence + router":
                vs["router_alone"] = compare(runs, rate, row, "kvfence direct")
            rows[f"{rate} {row}"] = {"rate": rate, "row": row, "median": med, "vs_stock": vs}
    return {"rows": rows, "goals": goals(rows, rates), "same_prompts": same_prompts(runs)}


def same_prompts(runs: list[dict[str, Any]]) -> bool:
    """Whether, in every round and at every rate, the server counted the same input tokens on each row."""
    counts: dict[tuple[int, str], set[int]] = {}
    for r in runs:
        counts.setdefault((r["round"], r["rate"]), set()).add(r["total_input_tokens"])
    return all(len(c) == 1 for c in counts.values())


def goals(rows: dict[str, Any], rates: list[str]) -> dict[str, Any]:
    """The two goals, each met or not, with the part of the difference the engine plugin (kvfence
    direct against stock) and the router (kvfence + router against kvfence direct) account for."""
    sat = "inf" if "inf" in rates else max(rates, key=float)
    full = rows[f"{sat} kvfence + router"]["vs_stock"]
    out: dict[str, Any] = {
        "saturation_rate": sat,
        "throughput_ratio": full["throughput_ratio"],
        "throughput_met": full["throughput_ratio"] >= THROUGHPUT_GOAL,
        "throughput_engine_part": rows[f"{sat} kvfence direct"]["vs_stock"]["throughput_ratio"],
        "throughput_router_part": full["router_alone"]["throughput_ratio"],
        "ttft_added_ms": {},
    }
    for rate in (r for r in rates if r != sat):
        c = rows[f"{rate} kvfence + router"]["vs_stock"]
        out["ttft_added_ms"][rate] = {
            "total": c["median_ttft_ms_added"],
            "met": c["median_ttft_ms_added"] <= TTFT_GOAL_MS,
            "engine_part": rows[f"{rate} kvfence direct"]["vs_stock"]["median_ttft_ms_added"],
            "router_part": c["router_alone"]["median_ttft_ms_added"],
        }
    return out


def print_table(summary: dict[str, Any]) -> None:
    header = ["rate", "path", *METRICS.values(), "failed", "req/s vs stock", "TTFT p50 added ms"]
    lines = []
    for s in summary["rows"].values():
        vs = s["vs_stock"]
        ratio = "" if not vs else f"{vs['throughput_ratio']:.3f} ({vs['throughput_rounds_won']})"
        added = "" if not vs else f"{vs['median_ttft_ms_added']:+.2f}"
        cells = [f"{s['median'][k]:.2f}" for k in METRICS]
        lines.append([s["rate"], s["row"], *cells, str(s["median"]["failed"]), ratio, added])
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for x in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) + " |")


def print_goals(g: dict[str, Any]) -> None:
    verdict = {True: "met", False: "MISSED"}
    print(
        f"\nthroughput at saturation ({g['saturation_rate']}): kvfence + router / stock = "
        f"{g['throughput_ratio']:.3f} (goal >= {THROUGHPUT_GOAL}: {verdict[g['throughput_met']]}); "
        f"engine plugin {g['throughput_engine_part']:.3f}, router {g['throughput_router_part']:.3f}"
    )
    for rate, t in g["ttft_added_ms"].items():
        print(
            f"TTFT p50 added at {rate} req/s: {t['total']:+.2f} ms (goal <= {TTFT_GOAL_MS}: "
            f"{verdict[t['met']]}); engine plugin {t['engine_part']:+.2f}, router {t['router_part']:+.2f}"
        )


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


def report(stack: Stack, runs: list[dict[str, Any]], started: float, load: list[float]) -> Path:
    a = stack.a
    summary = summarize(runs, a.rates)
    print(f"\nend to end, vllm bench serve, median of {a.rounds} paired rounds ({a.note})\n")
    print_table(summary)
    print_goals(summary["goals"])
    if not summary["same_prompts"]:
        print("NOTE: the rows of a round were not sent prompts of the same length (see the runs' records)")
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**machine(), "load_average_1m": [*load, round(os.getloadavg()[0], 2)], "note": a.note},
        "engine": vllm_facts(a),
        "config": {k: v for k, v in vars(a).items() if k != "func"},
        "vllm_args": stack.args,
        "seconds": round(time.time() - started, 1),
        "summary": summary,
        "runs": runs,
    }
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"e2e-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started))}.json"
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
    p.add_argument("--rates", default="2,4,8,inf", help="request rates (req/s) to run, inf = saturation")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--warmup-prompts", type=int, default=16)
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
    a = p.parse_args(argv)
    a.rates = [r.strip() for r in a.rates.split(",")]
    a.vllm_python = a.vllm_python or default_vllm_python()
    return a


def main() -> None:
    if sys.argv[1:2] == ["client"]:
        client_main(sys.argv[2:])
        return
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
