"""Router benchmark (not a test): what kvfence-router adds in front of a fast upstream, next to peers.

    .venv/bin/python bench/bench_router.py [--rate 1000] [--seconds 10] [--rounds 3] [--pin]
                                           [--vllm-router PATH|install] [--only NAME,...]
    .venv/bin/python bench/bench_router.py --callgrind [--vllm-router PATH|install] [--only NAME,...]

Peers to install first: ``apt-get install -y nginx wrk`` (Debian); ``--vllm-router install`` puts
vllm-router 0.1.17 with its dependencies (its launcher imports setproctitle, fastapi, uvicorn, aiohttp,
orjson) into a venv under the temporary directory, once, and uses it.

Same run, same fixed-response upstream, same request (POST /v1/completions, a small JSON body, an
Authorization header), four paths:

* ``direct``        the load generator talks to the upstream itself (the baseline);
* ``kvfence-router`` auth, quotas, body strip + salt, HMAC signing, relay; once with one worker and
                     once with ``--workers 2`` (quota counters in shared memory, SO_REUSEPORT);
* ``nginx``          Debian's nginx as a plain reverse proxy with an upstream keep-alive pool;
* ``vllm-router``    the Rust router from PyPI (``--vllm-router install``, or the path of an installed
                     ``bin/vllm-router``);
* ``kvfence HTTP layer`` the router's own HTTP server and upstream pool (kvfence.router.http /
                     .upstream) relaying with no router logic (no auth, quotas, stripping, salt or
                     signing), on uvloop with the router's GC settings: the floor of the Python router,
                     so the table shows what the router's logic costs above it;
* ``aiohttp proxy``  a bare aiohttp pass-through proxy (no auth, quotas or signing): what a general
                     asyncio HTTP framework costs by itself, three times the whole of vllm-router,
                     and the reason the router has its own HTTP layer (kvfence.router.http /
                     .upstream).

Measurements:

* latency at a fixed rate (open loop, ``--rate`` req/s for ``--seconds``): each request's latency is
  taken from its *scheduled* send time, so queueing inside the system under test is counted (no
  coordinated omission). Router-added latency = proxied percentile - direct percentile.
* maximum throughput: ``wrk`` (closed loop, 1 thread, ``--connections``) when installed, else a
  closed-loop Python generator in its own process;
* CPU per request: user+system CPU time of the proxy's processes (and threads) during the throughput
  run, divided by the requests served. Much less sensitive to other load on the machine than
  requests per second.
* paired rounds: each round measures every target within a minute, so for kvfence-router against
  vllm-router the run also counts the rounds each side won (throughput, CPU per request) and gives
  the one-sided sign test's p-value: a verdict that the medians alone cannot give when the two are
  within the machine's swings. The JSON result keeps every round.
* ``--callgrind`` (instead of the above): user-space instructions per request, counted by valgrind's
  callgrind for kvfence-router, the kvfence HTTP layer and vllm-router. Deterministic: the same count
  whatever else runs on the machine, so a change to the router can be measured to the percent where
  timings swing by ten; it leaves out the kernel's share (the same socket calls for every proxy).

The upstream is nginx answering a fixed body (``return 200``) when nginx is installed, else a tiny
asyncio fixed-response server in its own process. The load generator always runs in its own process.
A peer that cannot run gets a "not run: reason" row. The machine's cores are shared by everything.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.ports import free_port

API_KEY = "sk-bench-0123456789"
BODY = json.dumps({"model": "tiny", "prompt": "Say hello to the benchmark.", "max_tokens": 16}).encode()
RESPONSE = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [{"index": 0, "text": "hello benchmark", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8},
    },
    separators=(",", ":"),
).encode()
PATH = "/v1/completions"
#: ``taskset`` prefixes (``--pin``): the system under test on the last core, everything else on the
#: others. Empty: the kernel places everything.
PIN_SUT: list[str] = []
PIN_LOAD: list[str] = []
#: Seconds a system under test has to come up (raised under valgrind, ``--callgrind``).
START_TIMEOUT = [60.0]


def wait_http(url: str, timeout: float | None = None, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + (timeout or START_TIMEOUT[0])
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s")


# --- the fixed-response upstream (fallback when nginx is missing) -----------------------------------
class _FixedResponse(asyncio.Protocol):
    REPLY = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(RESPONSE)).encode()
        + b"\r\n\r\n"
        + RESPONSE
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                length = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(self.REPLY)  # type: ignore[attr-defined]


async def _serve_fixed(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_FixedResponse, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# --- load generators (run in their own process) -----------------------------------------------------
def _request_bytes(host: str, port: int) -> bytes:
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    low = head.lower()
    i = low.find(b"content-length:")
    if i >= 0:
        n = int(low[i + 15 : low.find(b"\r\n", i)])
        await reader.readexactly(n)
    elif b"transfer-encoding: chunked" in low:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


async def _open_loop(port: int, rate: float, seconds: float, conns: int) -> dict[str, float]:
    req = _request_bytes("127.0.0.1", port)
    pool: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    for _ in range(conns):
        pool.put_nowait(await asyncio.open_connection("127.0.0.1", port))
    lat: list[float] = []
    errors = 0

    async def one(scheduled: float) -> None:
        nonlocal errors
        r, w = await pool.get()
        try:
            w.write(req)
            status = await _read_response(r)
            if status != 200:
                errors += 1
            lat.append(time.perf_counter() - scheduled)
            pool.put_nowait((r, w))
        except (OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1
            pool.put_nowait(await asyncio.open_connection("127.0.0.1", port))

    # warm-up
    for _ in range(200):
        await one(time.perf_counter())
    lat.clear()
    errors = 0
    n = int(rate * seconds)
    start = time.perf_counter() + 0.05
    tasks = []
    for i in range(n):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    lat.sort()

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {
        "p50": pct(0.50),
        "p99": pct(0.99),
        "max": lat[-1] * 1000 if lat else float("nan"),
        "achieved_rps": len(lat) / elapsed,
        "errors": errors,
    }


async def _closed_loop(port: int, seconds: float, conns: int) -> dict[str, float]:
    req = _request_bytes("127.0.0.1", port)
    done = 0
    errors = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        r, w = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < stop:
            w.write(req)
            if await _read_response(r) == 200:
                done += 1
            else:
                errors += 1
        w.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conns)))
    return {"rps": done / (time.perf_counter() - t0), "errors": errors}


def run_loadgen(mode: str, port: int, rate: float, seconds: float, conns: int) -> dict[str, float]:
    args = [
        sys.executable,
        __file__,
        "--role",
        f"loadgen-{mode}",
        "--target-port",
        str(port),
        "--rate",
        str(rate),
        "--seconds",
        str(seconds),
        "--connections",
        str(conns),
    ]
    out = subprocess.run(
        [*PIN_LOAD, *args], capture_output=True, text=True, check=True, timeout=seconds * 4 + 120
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _tree_cpu_seconds(pids: list[int]) -> float:
    """user+system CPU seconds of these processes and all their descendants (threads included)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry), int(fields[1])
        stats[pid] = (ppid, (int(fields[11]) + int(fields[12])) / tick)
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, list(pids)
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, []))
    return total


def run_wrk(port: int, seconds: float, conns: int, workdir: Path) -> dict[str, float]:
    script = workdir / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(BODY.decode())}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"\n'
        "done = function(summary, latency, requests)\n"
        '  io.write(string.format("JSON {\\"requests\\": %d, \\"seconds\\": %f, \\"non2xx\\": %d, '
        '\\"errors\\": %d}\\n", summary.requests, summary.duration / 1e6, summary.errors.status, '
        "summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))\n"
        "end\n"
    )
    out = subprocess.run(
        [
            *PIN_LOAD,
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{int(seconds)}s",
            "-s",
            str(script),
            f"http://127.0.0.1:{port}{PATH}",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("JSON "))
    doc = json.loads(line[5:])
    return {
        "rps": doc["requests"] / doc["seconds"],
        "requests": doc["requests"],
        "errors": doc["non2xx"] + doc["errors"],
    }


# --- systems under test ------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    port: int | None
    procs: list[subprocess.Popen[bytes]]
    reason: str = ""


def start_upstream(workdir: Path) -> Target:
    port = free_port()
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx:
        conf = workdir / "upstream.conf"
        conf.write_text(
            _nginx_conf(
                workdir / "up",
                f"""
            server {{
                listen 127.0.0.1:{port} backlog=4096;
                keepalive_requests 1000000;
                location / {{
                    default_type application/json;
                    return 200 '{RESPONSE.decode()}';
                }}
            }}""",
            )
        )
        p = subprocess.Popen(
            [*PIN_LOAD, nginx, "-c", str(conf), "-p", str(workdir / "up")], stderr=subprocess.DEVNULL
        )
        wait_http(f"http://127.0.0.1:{port}/health", proc=p)
        return Target("upstream (nginx return 200)", port, [p])
    p = subprocess.Popen(
        [*PIN_LOAD, sys.executable, __file__, "--role", "upstream", "--target-port", str(port)]
    )
    wait_http(f"http://127.0.0.1:{port}/health", proc=p)
    return Target("upstream (python fixed response)", port, [p])


def _nginx_conf(prefix: Path, server: str) -> str:
    prefix.mkdir(parents=True, exist_ok=True)
    (prefix / "logs").mkdir(exist_ok=True)
    return f"""
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log error;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    {server}
}}
"""


def start_kvfence(workdir: Path, upstream_port: int, workers: int = 1) -> Target:
    key = hashlib.sha256(b"bench-signing-key").digest()
    table = {
        "version": 1,
        "trustClasses": {
            "gold": {
                "endpoint": f"http://127.0.0.1:{upstream_port}",
                "servedModels": ["tiny"],
                "signingKeys": [base64.b64encode(key).decode()],
            }
        },
        "tenants": {
            "bench": {
                "trustClass": "gold",
                "apiKeyHashes": ["sha256:" + hashlib.sha256(API_KEY.encode()).hexdigest()],
            }
        },
    }
    path = workdir / "routing.json"
    path.write_text(json.dumps(table))
    port = free_port()
    exe = [*PIN_SUT, sys.executable, "-m", "kvfence.router.server"]
    p = subprocess.Popen(
        [
            *exe,
            "--routing-table",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            "--health-interval",
            "5",
            "--workers",
            str(workers),
        ],
    )
    wait_http(f"http://127.0.0.1:{port}/readyz", proc=p)
    return Target("kvfence-router" if workers == 1 else f"kvfence-router {workers} workers", port, [p])


def _serve_aiohttp_floor(port: int, upstream_port: int) -> None:
    """A bare aiohttp pass-through proxy (no auth, no quotas, no signing): the framework's cost."""
    import aiohttp
    from aiohttp import web

    async def make() -> web.Application:
        app = web.Application()
        url = f"http://127.0.0.1:{upstream_port}{PATH}"
        session: list[aiohttp.ClientSession] = []

        async def ctx(app: web.Application):  # type: ignore[no-untyped-def]
            session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=256)))
            yield
            await session[0].close()

        async def proxy(request: web.Request) -> web.Response:
            body = await request.read()
            async with session[0].post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                data = await r.read()
            return web.Response(body=data, status=r.status, content_type="application/json")

        app.cleanup_ctx.append(ctx)
        app.router.add_post(PATH, proxy)
        return app

    web.run_app(make(), host="127.0.0.1", port=port, access_log=None, print=None)


def _serve_http_layer_floor(port: int, upstream_port: int) -> None:
    """The router's HTTP server and upstream pool relaying each request as it came, with nothing of
    the router's logic: the floor of this HTTP layer, measured beside the router."""
    import gc

    import uvloop

    from kvfence.router.http import HttpServer, Request
    from kvfence.router.http import Response as Answer
    from kvfence.router.server import GC_YOUNG_THRESHOLD
    from kvfence.router.upstream import Pool

    async def serve() -> None:
        pool = Pool("127.0.0.1", upstream_port)
        json_head = b"Content-Type: application/json\r\n"

        async def relay(req: Request) -> Answer:
            resp = await pool.request("POST", PATH, None, req.body, head=json_head)
            try:
                body = await resp.read()
            finally:
                resp.release()
            return Answer(resp.status, body)

        def error(status: int, message: str) -> Answer:
            return Answer(status, json.dumps({"error": {"message": message}}).encode())

        server = HttpServer(relay, error, max_body=1 << 20)
        await server.start("127.0.0.1", port)
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)  # as the router does
        await asyncio.Event().wait()

    uvloop.run(serve())


def start_floor(role: str, name: str, upstream_port: int) -> Target:
    """One of this file's own relays (``--role``), in a process of its own."""
    port = free_port()
    p = subprocess.Popen(
        [*PIN_SUT, sys.executable, __file__, "--role", role, "--target-port", str(port),
         "--upstream-port", str(upstream_port)]
    )  # fmt: skip
    wait_for_port(port, p)
    return Target(name, port, [p])


def start_http_layer_floor(upstream_port: int) -> Target:
    return start_floor("http-layer-floor", "kvfence HTTP layer", upstream_port)


def start_aiohttp_floor(upstream_port: int) -> Target:
    return start_floor("aiohttp-floor", "aiohttp proxy", upstream_port)


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float | None = None) -> None:
    deadline = time.monotonic() + (timeout or START_TIMEOUT[0])
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"port {port} not listening after {timeout}s")


def start_nginx_proxy(workdir: Path, upstream_port: int) -> Target:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if not nginx:
        return Target("nginx", None, [], "not run: nginx not installed (apt-get install nginx)")
    port = free_port()
    conf = workdir / "proxy.conf"
    conf.write_text(
        _nginx_conf(
            workdir / "px",
            f"""
        upstream engine {{ server 127.0.0.1:{upstream_port}; keepalive 256; }}
        server {{
            listen 127.0.0.1:{port} backlog=4096;
            keepalive_requests 1000000;
            location / {{
                proxy_pass http://engine;
                proxy_http_version 1.1;
                proxy_set_header Connection "";
                proxy_buffering off;
            }}
        }}""",
        )
    )
    p = subprocess.Popen(
        [*PIN_SUT, nginx, "-c", str(conf), "-p", str(workdir / "px")], stderr=subprocess.DEVNULL
    )
    wait_http(f"http://127.0.0.1:{port}/health", proc=p)
    return Target("nginx (1 worker)", port, [p])


def start_vllm_router(
    exe: str | None, upstream_port: int, workdir: Path, policy: str = "round_robin", name: str = "vllm-router"
) -> Target:
    """vllm-router in its leanest configuration (round robin, no retries, no circuit breaker) unless
    ``policy`` says otherwise."""
    exe = exe or shutil.which("vllm-router")
    if not exe or not os.path.exists(exe):
        return Target(name, None, [], "not run: vllm-router not found (pass --vllm-router PATH)")
    port = free_port()
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(
        [
            *PIN_SUT,
            exe,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            f"http://127.0.0.1:{upstream_port}",
            "--policy",
            policy,
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
            "--disable-retries",
            "--disable-circuit-breaker",
            "--health-check-interval-secs",
            "60",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT[0]
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"exited {p.returncode}: {(workdir / f'{name}.log').read_text()[-300:]}")
            with contextlib.suppress(OSError):
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}{PATH}",
                    data=BODY,
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError("not answering 200 after 60s")
            time.sleep(0.2)
    except RuntimeError as e:
        p.terminate()
        reason = " ".join(str(e).split())[-160:]
        return Target(name, None, [], f"not run: {reason}")
    return Target(name, port, [p])


VLLM_ROUTER_VERSION = "0.1.17"


def install_vllm_router() -> str:
    """vllm-router from PyPI with its dependencies in a venv of its own (reused when present): the
    Python launcher imports setproctitle, fastapi, uvicorn, aiohttp and orjson before it starts the
    Rust router, so a ``--no-deps`` install does not start."""
    venv = Path(tempfile.gettempdir()) / f"kvfence-vllm-router-{VLLM_ROUTER_VERSION}"
    exe = venv / "bin" / "vllm-router"
    check = [str(venv / "bin" / "python"), "-c", "import vllm_router.launch_router"]
    if exe.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(exe)
    print(f"installing vllm-router {VLLM_ROUTER_VERSION} into {venv}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"vllm-router=={VLLM_ROUTER_VERSION}"], check=True
    )
    subprocess.run(check, check=True)
    return str(exe)


def sign_test(wins: int, n: int) -> float:
    """One-sided exact sign test: the chance of ``wins`` or more wins in ``n`` paired rounds if
    neither side were better (each round a fair coin)."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / (1 << n)


def paired(ours: list[float], peer: list[float], higher_is_better: bool) -> tuple[int, int, float, float]:
    """Round by round (the rounds interleave the targets, so a round's two figures saw the same
    machine): rounds ours won, rounds compared, the median of the per-round ratios ours/peer, and the
    sign test's p-value for "ours is at least as good". Rounds with a missing figure are left out."""
    pairs = [(a, b) for a, b in zip(ours, peer, strict=True) if a > 0 and b > 0]
    if not pairs:
        return 0, 0, math.nan, math.nan
    wins = sum(1 for a, b in pairs if (a >= b if higher_is_better else a <= b))
    ratio = statistics.median(a / b for a, b in pairs)
    return wins, len(pairs), ratio, sign_test(wins, len(pairs))


def _json_row(row: Mapping[str, object]) -> dict[str, object]:
    """``row`` for JSON: NaN (a figure not measured) becomes null."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def cpu_text(v: object) -> str:
    x = float(v)  # type: ignore[arg-type]
    return "-" if math.isnan(x) else f"{x:.1f}"


def stop(t: Target) -> None:
    for p in t.procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


# --- --callgrind: user-space instructions per request --------------------------------------------
async def _send_requests(port: int, n: int, conns: int = 4) -> None:
    req = _request_bytes("127.0.0.1", port)

    async def one_connection(k: int) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(k):
            w.write(req)
            if await _read_response(r) != 200:
                raise RuntimeError("a request failed")
        w.close()

    await asyncio.gather(*(one_connection(n // conns) for _ in range(conns)))


def _callgrind_total(path: Path) -> int:
    # "summary:" in the header (0 with --instr-atstart=no) and "totals:" at the end
    counts = [
        int(line.split()[1])
        for line in path.read_text(errors="replace").splitlines()
        if line.startswith(("summary:", "totals:"))
    ]
    if not counts:
        raise RuntimeError(f"no totals in {path}")
    return max(counts)


def callgrind_per_request(
    workdir: Path, name: str, start: Callable[[], Target], small: int = 400, large: int = 1600
) -> float:
    """User-space instructions one proxied request costs ``name`` (all its threads), counted by
    callgrind: the proxy runs under valgrind with instrumentation off, is warmed with 200 requests,
    counts ``small`` and then, in a second process, ``large`` requests; the difference divided by
    ``large - small`` leaves out start-up and what a run costs whatever its length. Deterministic
    (the same binaries and inputs give the same count whatever else the machine does), unlike time;
    what it leaves out is the kernel (the sockets), the same two reads and two writes for every proxy."""
    totals = []
    for n in (small, large):
        out = workdir / f"callgrind-{name.replace(' ', '-')}-{n}"
        PIN_SUT[:] = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p"]
        try:
            t = start()
        finally:
            PIN_SUT[:] = []
        if t.port is None:
            raise RuntimeError(f"{name}: {t.reason}")
        pid = str(t.procs[0].pid)
        try:
            asyncio.run(_send_requests(t.port, 200))
            subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
            asyncio.run(_send_requests(t.port, n))
            subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
        finally:
            stop(t)
        totals.append(max(_callgrind_total(f) for f in workdir.glob(f"{out.name}.*")))
    return (totals[1] - totals[0]) / (large - small)


def run_callgrind(a: argparse.Namespace) -> None:
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        raise SystemExit("--callgrind needs valgrind (apt-get install -y valgrind)")
    START_TIMEOUT[0] = 600.0
    workdir = Path(tempfile.mkdtemp(prefix="kvfence-bench-"))
    upstream = start_upstream(workdir)
    assert upstream.port is not None
    up = upstream.port
    targets: list[tuple[str, Callable[[], Target]]] = [
        ("kvfence-router", lambda: start_kvfence(workdir, up)),
        ("kvfence HTTP layer", lambda: start_http_layer_floor(up)),
        ("vllm-router", lambda: start_vllm_router(a.vllm_router, up, workdir)),
    ]
    only = [x.strip() for x in a.only.split(",") if x.strip()]
    rows = []
    try:
        for name, start in targets:
            if only and name not in only:
                continue
            if name == "vllm-router" and not a.vllm_router:
                rows.append((name, "not run: pass --vllm-router PATH|install"))
                continue
            per = callgrind_per_request(workdir, name, start)
            rows.append((name, f"{per / 1000:,.1f}k"))
            print(f"  {name}: {per:,.0f} instructions a request", file=sys.stderr)
    finally:
        stop(upstream)
    print(f"{'path':<24} {'user-space instructions per request (callgrind)':>50}")
    for name, text in rows:
        print(f"{name:<24} {text:>50}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="bench")
    ap.add_argument("--target-port", type=int, default=0)
    ap.add_argument("--upstream-port", type=int, default=0)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=64, help="connections for the throughput runs")
    ap.add_argument("--latency-connections", type=int, default=32)
    ap.add_argument(
        "--vllm-router",
        default=None,
        help="path of bin/vllm-router, or 'install': from PyPI into a venv under the temporary directory",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated names: measure only the targets whose name starts with one of them "
        "(direct is always measured, as the baseline)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="taskset: the proxy under test on the last core, load generator and upstream on the others",
    )
    ap.add_argument(
        "--callgrind",
        action="store_true",
        help="instead of timing: user-space instructions per request under valgrind's callgrind "
        "(kvfence-router, the kvfence HTTP layer, vllm-router with --vllm-router), deterministic",
    )
    return ap.parse_args()


def serve_role(a: argparse.Namespace) -> bool:
    """Run the helper process ``--role`` names (a floor proxy, the upstream, a load generator);
    False for the benchmark itself."""
    if a.role == "http-layer-floor":
        _serve_http_layer_floor(a.target_port, a.upstream_port)
    elif a.role == "aiohttp-floor":
        _serve_aiohttp_floor(a.target_port, a.upstream_port)
    elif a.role == "upstream":
        asyncio.run(_serve_fixed(a.target_port))
    elif a.role == "loadgen-open":
        print(json.dumps(asyncio.run(_open_loop(a.target_port, a.rate, a.seconds, a.connections))))
    elif a.role == "loadgen-closed":
        print(json.dumps(asyncio.run(_closed_loop(a.target_port, a.seconds, a.connections))))
    else:
        return False
    return True


def start_targets(a: argparse.Namespace, workdir: Path, up: int) -> list[Target]:
    """``direct`` (the baseline) and every peer ``--only`` selects, started."""
    starters: list[tuple[str, Callable[[], Target]]] = [
        ("kvfence-router", lambda: start_kvfence(workdir, up)),
        # Two workers on the same pinned core(s): what the supervisor, SO_REUSEPORT and the shared
        # quota lock cost per request; on a machine with spare cores, give them one each.
        ("kvfence-router 2 workers", lambda: start_kvfence(workdir, up, workers=2)),
        ("nginx", lambda: start_nginx_proxy(workdir, up)),
        ("vllm-router", lambda: start_vllm_router(a.vllm_router, up, workdir)),
        (
            "vllm-router cache_aware",
            lambda: start_vllm_router(a.vllm_router, up, workdir, "cache_aware", "vllm-router cache_aware"),
        ),
        ("kvfence HTTP layer", lambda: start_http_layer_floor(up)),
        ("aiohttp proxy", lambda: start_aiohttp_floor(up)),
    ]
    only = [x.strip() for x in a.only.split(",") if x.strip()]
    return [Target("direct", up, [])] + [
        start() for name, start in starters if not only or any(name == o for o in only)
    ]


def measure(a: argparse.Namespace, t: Target, workdir: Path, have_wrk: bool) -> dict[str, float]:
    """One round of one target: open-loop latency, then throughput with the proxy's CPU time."""
    assert t.port is not None
    lat = run_loadgen("open", t.port, a.rate, a.seconds, a.latency_connections)
    cpu0 = _tree_cpu_seconds([p.pid for p in t.procs])
    thr = (
        run_wrk(t.port, a.seconds, a.connections, workdir)
        if have_wrk
        else run_loadgen("closed", t.port, a.rate, a.seconds, a.connections)
    )
    cpu = _tree_cpu_seconds([p.pid for p in t.procs]) - cpu0
    done = thr.get("requests", thr["rps"] * a.seconds)
    cpu_us = cpu / done * 1e6 if t.procs and done else float("nan")
    return {**lat, "rps": thr["rps"], "thr_errors": thr["errors"], "cpu_us": cpu_us}


def run_rounds(
    a: argparse.Namespace, targets: list[Target], workdir: Path, have_wrk: bool
) -> dict[str, list[dict[str, float]]]:
    """Rounds interleave the targets, so that a burst of load from elsewhere on the machine hits all of
    them alike; each figure is the median over the rounds."""
    samples: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
    for rnd in range(a.rounds):
        for t in targets:
            if t.port is None:
                continue
            samples[t.name].append(measure(a, t, workdir, have_wrk))
            print(f"  round {rnd + 1}/{a.rounds}: measured {t.name}", file=sys.stderr)
    return samples


def median_rows(targets: list[Target], samples: dict[str, list[dict[str, float]]]) -> list[dict[str, object]]:
    """One row per target: the rounds' medians and error sums, or why it did not run."""
    rows: list[dict[str, object]] = []
    for t in targets:
        if t.port is None:
            rows.append({"name": t.name, "reason": t.reason})
            continue
        got = samples[t.name]
        row: dict[str, object] = {"name": t.name}
        for key in ("p50", "p99", "max", "achieved_rps", "rps", "cpu_us"):
            row[key] = statistics.median(x[key] for x in got)
        row["errors"] = sum(x["errors"] for x in got)
        row["thr_errors"] = sum(x["thr_errors"] for x in got)
        rows.append(row)
    return rows


def find_row(rows: list[dict[str, object]], name: str) -> dict[str, object] | None:
    return next((r for r in rows if r["name"] == name and "rps" in r), None)


def print_table(a: argparse.Namespace, rows: list[dict[str, object]], setup: dict[str, object]) -> None:
    base, vllm = rows[0], find_row(rows, "vllm-router")
    print()
    print(
        f"medians of {a.rounds} interleaved rounds; upstream: {setup['upstream']}; "
        f"latency: open loop at {a.rate:.0f} req/s for {a.seconds:.0f}s "
        f"over {a.latency_connections} connections; throughput: {setup['throughput']}; "
        f"cores: {setup['cores']}; pinning: {setup['pinning']}; "
        f"load average {setup['load_before']:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    hdr = (
        f"{'path':<24} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10} {'achieved':>9} "
        f"{'errors':>6} {'max req/s':>10} {'vs vllm-router':>15} {'CPU us/req':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "reason" in r:
            print(f"{r['name']:<24} {r['reason']}")
            continue
        ratio = f"{float(r['rps']) / float(vllm['rps']):.2f}x" if vllm else "n/a"  # type: ignore[arg-type]
        added50 = float(r["p50"]) - float(base["p50"])  # type: ignore[arg-type]
        added99 = float(r["p99"]) - float(base["p99"])  # type: ignore[arg-type]
        print(
            f"{r['name']:<24} {r['p50']:>8.3f} {r['p99']:>8.3f} {added50:>10.3f} {added99:>10.3f} "
            f"{r['achieved_rps']:>9.0f} {int(r['errors']) + int(r['thr_errors']):>6} {r['rps']:>10.0f} "  # type: ignore[call-overload]
            f"{ratio:>15} {cpu_text(r['cpu_us']):>11}"
        )


def print_targets(
    a: argparse.Namespace, rows: list[dict[str, object]], samples: dict[str, list[dict[str, float]]]
) -> None:
    """The goals' lines: kvfence-router's added p99, and against vllm-router its throughput and CPU
    per request, with the paired rounds' sign test."""
    base, vllm, kv = rows[0], find_row(rows, "vllm-router"), find_row(rows, "kvfence-router")
    print()
    if kv is None:
        print("kvfence-router not measured")
    else:
        kv_added = float(kv["p99"]) - float(base["p99"])  # type: ignore[arg-type]
        print(f"target: kvfence-router added p99 <= 0.1 ms at {a.rate:.0f} req/s: {kv_added:.3f} ms")
    if vllm and kv:
        floor = next((r["cpu_us"] for r in rows if r["name"] == "aiohttp proxy" and "cpu_us" in r), math.nan)
        print(
            f"CPU per request: kvfence-router {cpu_text(kv['cpu_us'])} us, "
            f"vllm-router {cpu_text(vllm['cpu_us'])} us, aiohttp proxy {cpu_text(floor)} us"
        )
        kv_ratio = float(kv["rps"]) / float(vllm["rps"])  # type: ignore[arg-type]
        print(f"target: kvfence-router throughput >= 1.0x vllm-router (one pinned core): {kv_ratio:.2f}x")
        # The medians above can differ by less than the machine swings between runs; the rounds are
        # paired (interleaved), so count them: a side better in 11 of 12 rounds is better (p = 0.003).
        ours, peer = samples["kvfence-router"], samples["vllm-router"]
        for label, key, higher in (("throughput", "rps", True), ("CPU per request", "cpu_us", False)):
            wins, n, median_ratio, p = paired([x[key] for x in ours], [x[key] for x in peer], higher)
            print(
                f"paired rounds, {label}: kvfence-router as good or better in {wins} of {n} rounds, "
                f"median per-round ratio {median_ratio:.3f}, sign test p = {p:.4f}"
            )


def write_result(
    a: argparse.Namespace,
    rows: list[dict[str, object]],
    samples: dict[str, list[dict[str, float]]],
    setup: dict[str, object],
) -> None:
    out_dir = Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"router-{time.strftime('%Y%m%dT%H%M%S')}.json"
    record = {
        "rounds": a.rounds,
        "seconds": a.seconds,
        "rate": a.rate,
        "latency_connections": a.latency_connections,
        "throughput": setup["throughput"],
        "upstream": setup["upstream"],
        "cores": setup["cores"],
        "pinning": setup["pinning"],
        "load_average": [round(float(setup["load_before"]), 2), round(os.getloadavg()[0], 2)],  # type: ignore[arg-type]
    }
    clean = [_json_row(r) for r in rows]
    per_round = {name: [_json_row(x) for x in got] for name, got in samples.items()}
    path.write_text(
        json.dumps({"setup": record, "rows": clean, "rounds": per_round}, indent=2, default=str) + "\n"
    )
    print(f"written to {path}")


def pin_processes() -> None:
    """``--pin``: the proxy under test on the last core, load generator and upstream on the others."""
    cores = os.cpu_count() or 1
    if cores >= 2 and shutil.which("taskset"):
        PIN_SUT[:] = ["taskset", "-c", str(cores - 1)]
        PIN_LOAD[:] = ["taskset", "-c", f"0-{cores - 2}"]


def main() -> None:
    a = parse_args()
    if serve_role(a):
        return
    if a.vllm_router == "install":
        a.vllm_router = install_vllm_router()
    if a.callgrind:
        run_callgrind(a)
        return
    if a.pin:
        pin_processes()
    workdir = Path(tempfile.mkdtemp(prefix="kvfence-bench-"))
    load_before = os.getloadavg()[0]
    upstream = start_upstream(workdir)
    assert upstream.port is not None
    targets = start_targets(a, workdir, upstream.port)
    have_wrk = shutil.which("wrk") is not None
    try:
        samples = run_rounds(a, targets, workdir, have_wrk)
    finally:
        for t in [*targets, upstream]:
            stop(t)
    rows = median_rows(targets, samples)
    setup: dict[str, object] = {
        "upstream": upstream.name,
        "throughput": f"wrk -t1 -c{a.connections}" if have_wrk else "python closed loop",
        "cores": os.cpu_count() or 1,
        "pinning": f"proxy on core {PIN_SUT[-1]}, load+upstream on {PIN_LOAD[-1]}" if PIN_SUT else "none",
        "load_before": load_before,
    }
    print_table(a, rows, setup)
    print_targets(a, rows, samples)
    write_result(a, rows, samples, setup)


if __name__ == "__main__":
    main()
