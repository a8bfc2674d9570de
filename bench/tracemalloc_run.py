"""Run a module under tracemalloc and keep where its memory was at its peak (a benchmark helper).

    python bench/tracemalloc_run.py OUT.txt MODULE [ARGS...]

Every second it compares the traced size with the largest seen; at a new peak (2% above it) it takes
a snapshot, writes its largest allocation sites to OUT.txt (by line, by file, and by call stack of up
to ``FRAMES`` frames) and dumps the snapshot itself to OUT.snapshot (``tracemalloc.Snapshot.load``),
so both hold the largest heap the module had, whenever it ends. Every ``LATEST_S`` seconds it also
writes the same statistics of the heap as it is then to OUT.latest.txt: at the end, what the module
holds once it is idle (what stays, rather than what a burst held). Used by ``bench/bench_operator.py
--tracemalloc``: tracing slows the process down several times, so a traced run measures memory, not
time.
"""

from __future__ import annotations

import runpy
import sys
import threading
import time
import tracemalloc
from pathlib import Path

FRAMES = 12
INTERVAL_S = 1.0
LATEST_S = 20.0
TOP = 40


def _write(out: Path, snap: tracemalloc.Snapshot, size: int) -> None:
    snap = snap.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    lines = [f"traced {size / 2**20:.1f} MiB at {time.strftime('%H:%M:%S')}", "", "by line:"]
    for st in snap.statistics("lineno")[:TOP]:
        lines.append(f"{st.size / 2**20:8.2f} MiB {st.count:9d}  {st.traceback[0]}")
    lines += ["", "by file:"]
    for st in snap.statistics("filename")[:TOP]:
        lines.append(f"{st.size / 2**20:8.2f} MiB {st.count:9d}  {st.traceback[0].filename}")
    lines += ["", "by call stack:"]
    for st in snap.statistics("traceback")[:15]:
        lines.append(f"{st.size / 2**20:8.2f} MiB {st.count:9d}")
        lines += [f"      {frame}" for frame in st.traceback.format()]
    out.write_text("\n".join(lines) + "\n")


def _watch(out: Path) -> None:
    best = 0
    latest = time.monotonic()
    while True:
        time.sleep(INTERVAL_S)
        size, _ = tracemalloc.get_traced_memory()
        if time.monotonic() - latest >= LATEST_S:
            _write(out.with_suffix(".latest.txt"), tracemalloc.take_snapshot(), size)
            latest = time.monotonic()
        if size > best * 1.02:
            best = size
            snap = tracemalloc.take_snapshot()
            snap.dump(str(out.with_suffix(".snapshot")))
            _write(out, snap, size)


def main() -> None:
    out, module, *args = sys.argv[1:]
    tracemalloc.start(FRAMES)
    threading.Thread(target=_watch, args=(Path(out),), daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
