"""Where an engine's time goes during a benchmark run, sampled by py-spy (``bench_e2e.py --py-spy``).

vLLM serves from two processes of its own: the API server (the HTTP server, the kvfence middleware,
the streamed answers) and the engine core (the scheduler, waiting for the model worker between its
steps), with the model worker(s) beside them. For one measured run :class:`Sampler` attaches
``py-spy record --nonblocking`` (it reads the processes' memory; it never stops them) to the API server
and the engine core of the engine the run loads, and :func:`tally` counts the samples of each file in
the parts that tell the plugin's share:

* the engine core: samples inside its step (``EngineCore.step``), of them inside the scheduler's
  ``schedule`` or ``update_from_output`` (on the step's critical path with synchronous scheduling), and
  ``add_request`` samples outside the step (requests taken between steps), and those spent in kvfence's
  own code (as below) on the loop's thread and on its other threads (the stats file's writer, which
  does its file I/O without the GIL, beside the loop);
* the API server: its samples (py-spy leaves out threads it finds idle), and of them those spent in
  kvfence's code (the middleware): its innermost kvfence frame has only the standard library's below it
  (its JSON, its HMACs), not vLLM's application it awaits.

Samples are wall-clock ticks at ``RATE`` per second per thread; divided by the run's completed requests
they give milliseconds per request. The sampler runs on the router's CPUs when the benchmark pins, so
it takes CPU from the router row: use it to attribute a difference, not for the goal runs.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

RATE = 200  # samples a second
#: how vLLM names its engine-core process (setproctitle)
ENGINE_CORE_TITLE = "VLLM::EngineCore"
SCHEDULER_CALLS = (".schedule", ".update_from_output")
#: the engine core's main loop: its thread takes requests and runs the steps (the scheduler's thread)
BUSY_LOOP = "EngineCoreProc.run_busy_loop"
SITE = "site-packages/"
#: what :func:`tally` counts in a file
COUNTS = ("samples", "step", "scheduler", "add_request", "kvfence", "kvfence_loop")


def py_spy() -> str:
    """The py-spy executable (the benchmark's environment, else PATH); a clear error without it."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("--py-spy needs py-spy (pip install py-spy; `make venv` installs it)")
    return found


def processes(leader: int) -> dict[str, int]:
    """The API server (``leader``: the ``vllm serve`` process, its group's leader) and the engine core
    of that group, found in /proc."""
    out = {"api server": leader}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # gone since the listing
        if int(fields[2]) == leader and cmdline.startswith(ENGINE_CORE_TITLE.encode()):
            out["engine core"] = int(stat.parent.name)
    if "engine core" not in out:
        raise RuntimeError(f"no {ENGINE_CORE_TITLE} process in the group of {leader}")
    return out


@dataclass
class Sampler:
    """py-spy recording each of ``pids`` (part -> pid) into ``out_dir`` while a run lasts."""

    pids: dict[str, int]
    out_dir: Path
    pinned: list[str] = field(default_factory=list)  # taskset prefix, or none
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, IO[bytes]]] = field(default_factory=dict)

    def start(self) -> Sampler:
        exe = py_spy()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for part, pid in self.pids.items():
            out = self.out_dir / f"{part.replace(' ', '-')}.txt"
            cmd = [*self.pinned, exe, "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw"]
            cmd += ["--nonblocking", "--full-filenames", "-o", str(out)]
            log = (self.out_dir / f"{part.replace(' ', '-')}.log").open("wb")
            self.procs[part] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out, log)
        return self

    def stop(self) -> dict[str, dict[str, int]]:
        """Stop recording (py-spy writes its file on SIGINT) and tally each part's samples."""
        for proc, _, _ in self.procs.values():
            proc.send_signal(signal.SIGINT)
        got: dict[str, dict[str, int]] = {}
        for part, (proc, out, log) in self.procs.items():
            proc.wait(timeout=60)
            log.close()
            got[part] = tally(out.read_text().splitlines() if out.exists() else [])
        return got


def tally(lines: Iterable[str]) -> dict[str, int]:
    """The samples of a py-spy raw file (``frame;frame;... count`` per line, a frame ``name (file:line)``),
    counted in the parts the module lists."""
    n = dict.fromkeys(COUNTS, 0)
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = stack.split(";")
        names = [f.split(" (", 1)[0] for f in frames]
        n["samples"] += k
        if _in_kvfence(frames):
            n["kvfence"] += k
            if BUSY_LOOP in names:
                n["kvfence_loop"] += k
        if "EngineCore.step" in names:
            n["step"] += k
            if any(name.endswith(SCHEDULER_CALLS) for name in names):
                n["scheduler"] += k
        elif any(name.endswith(".add_request") for name in names):
            n["add_request"] += k
    return n


def _origin(frame: str) -> str:
    """Whose code a frame (``name (file:line)``, full file names) runs: kvfence, stdlib or other."""
    path = frame.rpartition(" (")[2]
    if SITE in path:  # an installed package: kvfence (as in the engine images) or another
        return "kvfence" if path.rsplit(SITE, 1)[1].startswith("kvfence/") else "other"
    return "kvfence" if "/kvfence/" in path else "stdlib"  # a source tree (kvfence's), or CPython's own


def _in_kvfence(frames: list[str]) -> bool:
    """Whether a sample is kvfence's own work: its innermost kvfence frame has only stdlib frames below."""
    origins = [_origin(f) for f in frames]
    if "kvfence" not in origins:
        return False
    last = len(origins) - 1 - origins[::-1].index("kvfence")
    return all(o == "stdlib" for o in origins[last + 1 :])


def per_request_ms(runs: list[dict[str, dict[str, int]]], completed: int) -> dict[str, float]:
    """The runs' samples (part -> tally, summed) as milliseconds per completed request."""
    if not completed:
        return {}
    ms = 1000 / RATE / completed
    total = {
        (part, key): sum(r.get(part, {}).get(key, 0) for r in runs)
        for part in ("engine core", "api server")
        for key in COUNTS
    }
    return {
        "engine core step": total["engine core", "step"] * ms,
        "scheduler (in the step)": total["engine core", "scheduler"] * ms,
        "add_request (between steps)": total["engine core", "add_request"] * ms,
        "engine core, kvfence code": total["engine core", "kvfence_loop"] * ms,
        "engine core, kvfence's other threads": (
            total["engine core", "kvfence"] - total["engine core", "kvfence_loop"]
        )
        * ms,
        "api server": total["api server", "samples"] * ms,
        "api server, kvfence code": total["api server", "kvfence"] * ms,
    }
