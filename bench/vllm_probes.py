"""Where the kvfence scheduler plugin's cost lands inside vLLM: the ``--callgrind``, ``--bytecodes`` and
``--hooks`` modes of bench/bench_vllm.py (see its docstring), on its workload and its :func:`drive`.

* ``--callgrind``: instructions and simulated cache misses of the timed calls, stock and fenced, under
  valgrind (counts that do not depend on the machine's other load);
* ``--bytecodes``: Python bytecodes per step, function by function;
* ``--hooks``: wall-clock time in each vLLM method the plugin overrides, stock and fenced.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import vllm
from bench_vllm import (
    KINDS,
    ROOT,
    TARGET,
    VARIANTS,
    Run,
    Spec,
    drive,
    fair_share_kind,
    isolated,
    records_kind,
    table,
    workload,
    write_results,
)

#: a client request of valgrind's, callable from Python (ctypes): toggles callgrind's collection
CALLGRIND_TOGGLE_C = r"""
#include <valgrind/callgrind.h>
void kvfence_cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void kvfence_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void kvfence_cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""
#: the simulated last-level cache: this machine kind's per-core L2 (AMD EPYC: 2 MiB, 16-way, 64 B)
CALLGRIND_LL = "2097152,16,64"
CALLGRIND_EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


#: Under callgrind the plugin's stats thread would write its snapshot every 0.25 s of *valgrind's* time,
#: about every other step of a run 50-100x slower than real, and how often would depend on the machine's
#: load. Instead the write is made every this many steps, on the scheduler's thread, counted: the steps in
#: 0.25 s at about 1.5 ms per step (the stock scheduler's mean step on this workload, in the timed runs'
#: records of bench/results/engine.jsonl).
CALLGRIND_STATS_EVERY = 166
#: Likewise the plugin's check of its key and config files, every second of wall time: under callgrind a
#: step takes about a second, so it ran at almost every step (three file stats through pathlib, about
#: 100k instructions, 0.9% of a step's). It is made every this many steps instead: 1 s at 1.5 ms per step.
CALLGRIND_RELOAD_EVERY = 666


def callgrind_child(
    kind: str, per_user: int, seed: int, quotas: dict[str, Any], config: Any, lib_path: str | None
) -> None:
    """Under valgrind (see :func:`callgrind`): one warm-up run, not instrumented, then the workload,
    instrumented, with collection on only inside the calls the timed runs time."""
    import ctypes

    assert lib_path is not None
    lib = ctypes.CDLL(lib_path)
    drive(kind, workload(1, seed + 1), quotas, config)

    class Toggle:  # drive()'s profiler interface: on around each timed call, off after it
        def enable(self) -> None:
            lib.kvfence_cg_toggle()

        def disable(self) -> None:
            lib.kvfence_cg_toggle()

    streams = workload(per_user, seed)
    lib.kvfence_cg_start()
    run = drive(
        kind,
        streams,
        quotas,
        config,
        Toggle(),  # type: ignore[arg-type]
        stats_every=CALLGRIND_STATS_EVERY,
        reload_every=CALLGRIND_RELOAD_EVERY,
    )
    lib.kvfence_cg_stop()
    print(json.dumps({"steps": len(run.step_ns), "fingerprint": run.fingerprint}))


def callgrind_command(
    kind: str, label: str, per_user: int, a: argparse.Namespace, lib: Path, out: Path
) -> list[str]:
    """valgrind running this script as ``--callgrind-child``, collection off until it turns it on."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--cache-sim=yes",
        "--branch-sim=yes",
        f"--LL={CALLGRIND_LL}",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        str(ROOT / "bench" / "bench_vllm.py"),
        "--callgrind-child",
        kind,
        "--callgrind-lib",
        str(lib),
        "--variants",
        label,
        "--requests-per-user",
        str(per_user),
        "--seed",
        str(a.seed),
        *(["--pure-python-records"] if a.pure_python_records else []),
        *(["--fair-share-off"] if a.fair_share_off else []),
    ]


def callgrind_counts(out: Path) -> dict[str, int]:
    """callgrind's totals from its output file, with the L1 and last-level misses and its cycle
    estimate (CEst) summed up."""
    events = totals = None
    for line in out.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("totals:"):
            totals = [int(x) for x in line.split()[1:]]
    assert events is not None and totals is not None, f"no totals in {out}"
    counts = dict(zip(events, totals, strict=True))
    counts["LLm"] = counts["ILmr"] + counts["DLmr"] + counts["DLmw"]
    counts["L1m"] = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
    counts["CEst"] = counts["Ir"] + 10 * counts["L1m"] + 100 * counts["LLm"]
    counts["Bm"] = counts["Bcm"] + counts["Bim"]  # conditional and indirect branches mispredicted
    return counts


def callgrind_variant(
    label: str, per_user: int, a: argparse.Namespace, tmp: Path, lib: Path, env: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Both kinds of one variant under valgrind at once; each one's counts, steps and fingerprint."""
    import subprocess

    procs = {}
    for kind in KINDS:
        out = tmp / f"callgrind.{kind}"
        cmd = callgrind_command(kind, label, per_user, a, lib, out)
        procs[kind] = (out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
    got: dict[str, dict[str, Any]] = {}
    for kind, (out, proc) in procs.items():
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"[{label}] the {kind} run under valgrind failed (exit {proc.returncode})")
        counts = callgrind_counts(out)
        if a.callgrind_keep:  # for callgrind_annotate / KCachegrind
            Path(a.callgrind_keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(out, Path(a.callgrind_keep) / f"callgrind.{label.replace(' ', '-')}.{kind}")
        got[kind] = {**counts, **json.loads(stdout.decode().strip().splitlines()[-1])}
    return got


def callgrind_table(label: str, got: dict[str, dict[str, Any]], res: dict[str, Any]) -> None:
    """Counts per step of each kind, the fenced/stock ratios, and the target's verdict."""
    steps = got["stock"]["steps"]
    rows = [
        [
            label,
            kind,
            str(got[kind]["steps"]),
            f"{got[kind]['Ir'] / steps / 1e3:,.0f}",
            f"{got[kind]['L1m'] / steps:,.0f}",
            f"{got[kind]['LLm'] / steps:,.0f}",
            f"{got[kind]['CEst'] / steps / 1e3:,.0f}",
            f"{got[kind]['Bm'] / steps:,.0f}",
            "" if kind == "stock" else f"{res['ratio_Ir']:.3f}",
            "" if kind == "stock" else f"{res['ratio_LLm']:.3f}",
            "" if kind == "stock" else f"{res['ratio_CEst']:.3f}",
            "" if kind == "stock" else f"{res['ratio_Bm']:.3f}",
            "" if kind == "stock" else ("yes" if res["same_schedule"] else "NO"),
        ]
        for kind in KINDS
    ]
    table(
        f"Scheduler step = add_request() + schedule() + update_from_output(), under callgrind: "
        f"counts per stock step (ratios: the whole run's), last-level cache simulated as {CALLGRIND_LL} "
        f"(size, ways, line), branches as callgrind predicts them; vLLM "
        f"{vllm.__version__}",
        [
            "variant",
            "scheduler",
            "steps",
            "k instr/step",
            "L1 misses/step",
            "LL misses/step",
            "k CEst/step",
            "mispredicts/step",
            "fenced/stock instr",
            "fenced/stock LL misses",
            "fenced/stock CEst",
            "fenced/stock mispredicts",
            "same schedule",
        ],
        rows,
    )
    if label == "no quotas":
        verdict = "met" if res["ratio_CEst"] <= TARGET else "NOT met"
        print(
            f"\ntarget [{label}]: fenced/stock estimated cycles <= {TARGET}: {res['ratio_CEst']:.3f} "
            f"({verdict}; instructions {res['ratio_Ir']:.3f})"
        )


def callgrind(chosen: list[str], per_user: int, a: argparse.Namespace) -> None:
    """Instructions and simulated cache misses of the same timed calls, stock and fenced, under
    valgrind's callgrind (both kinds at once, one process each): counts that do not depend on what
    else the machine runs. The cycle estimate is callgrind's own (KCachegrind's CEst): Ir + 10 x L1
    misses + 100 x last-level misses; the mispredicted branches (``--branch-sim``) are reported beside
    it, not in it, so that it stays comparable with earlier runs."""
    import subprocess

    if not shutil.which("valgrind"):
        raise SystemExit("--callgrind needs valgrind (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-cg-") as tmp:
        src, lib = Path(tmp) / "toggle.c", Path(tmp) / "libtoggle.so"
        src.write_text(CALLGRIND_TOGGLE_C)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        results: dict[str, Any] = {}
        for label in chosen:
            got = callgrind_variant(label, per_user, a, Path(tmp), lib, env)
            res: dict[str, Any] = {k: got[k] for k in KINDS}
            res["same_schedule"] = got["stock"]["fingerprint"] == got["fenced"]["fingerprint"]
            for key in ("Ir", "L1m", "LLm", "CEst", "Bm"):
                res[f"ratio_{key}"] = got["fenced"][key] / got["stock"][key]
            results[label] = res
            callgrind_table(label, got, res)
    setup = {
        "vllm": vllm.__version__,
        "python": platform.python_version(),
        "requests_per_user": per_user,
        "seed": a.seed,
        "last_level_cache": CALLGRIND_LL,
        "records": records_kind(a),
        "fair_share": fair_share_kind(a),
    }
    path = write_results("vllm-callgrind", {"setup": setup, "variants": results})
    print(f"\nwritten to {path}")


class OpcodeCounter:
    """drive()'s profiler interface: counts the bytecodes each function executes while enabled."""

    def __init__(self) -> None:
        self.counts: dict[Any, int] = {}

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            self.counts[code] = self.counts.get(code, 0) + 1
        return self._local

    def _call(self, frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return self._local

    def enable(self) -> None:
        sys.settrace(self._call)

    def disable(self) -> None:
        sys.settrace(None)


def code_name(code: Any) -> str:
    """A code object as ``path:line(qualified name)``, the path from site-packages or the repository."""
    path = code.co_filename
    for root in ("site-packages/", f"{ROOT}/"):
        path = path.split(root)[-1]
    return f"{path}:{code.co_firstlineno}({code.co_qualname})"


def count_bytecodes(
    kind: str, quotas: dict[str, Any], per_user: int, seed: int, config: Any
) -> tuple[dict[str, float], float, str]:
    """One run of ``kind`` after a warm-up, its bytecodes counted: per step, by function and in all;
    and its schedule's fingerprint."""
    drive(kind, workload(1, seed + 1), quotas, config)  # warm-up, not counted
    counter = OpcodeCounter()
    run = drive(
        kind,
        workload(per_user, seed),
        quotas,
        config,
        counter,  # type: ignore[arg-type]
        stats_every=CALLGRIND_STATS_EVERY,
        reload_every=CALLGRIND_RELOAD_EVERY,
    )
    steps = len(run.step_ns)
    funcs: dict[str, float] = {}
    for c, n in counter.counts.items():  # (two code objects may share a name: summed)
        funcs[code_name(c)] = funcs.get(code_name(c), 0.0) + n / steps
    return funcs, sum(counter.counts.values()) / steps, run.fingerprint


def bytecodes(chosen: list[str], per_user: int, seed: int, config: Any, records: str, top: int = 25) -> None:
    """Bytecodes per step of each scheduler, and the functions where the fenced run differs most."""
    results: dict[str, Any] = {}
    for label in chosen:
        per_step: dict[str, dict[str, float]] = {}
        totals: dict[str, float] = {}
        fingerprints = {}
        for kind in KINDS:
            per_step[kind], totals[kind], fingerprints[kind] = count_bytecodes(
                kind, VARIANTS[label], per_user, seed, config
            )
        ratio = totals["fenced"] / totals["stock"]
        print(
            f"\n[{label}, {records} records] bytecodes per step: stock {totals['stock']:,.0f}, "
            f"fenced {totals['fenced']:,.0f}, "
            f"fenced/stock {ratio:.4f} (same schedule: {fingerprints['stock'] == fingerprints['fenced']})"
        )
        names = set(per_step["stock"]) | set(per_step["fenced"])
        diff = sorted(
            ((per_step["fenced"].get(f, 0.0) - per_step["stock"].get(f, 0.0), f) for f in names),
            key=lambda d: -abs(d[0]),
        )
        table(
            f"[{label}] bytecodes per step, fenced - stock, the {top} largest differences",
            ["function", "stock", "fenced", "fenced - stock"],
            [
                [
                    f,
                    f"{per_step['stock'].get(f, 0.0):,.1f}",
                    f"{per_step['fenced'].get(f, 0.0):,.1f}",
                    f"{d:+,.1f}",
                ]
                for d, f in diff[:top]
            ],
        )
        results[label] = {"per_step": totals, "ratio": ratio, "functions": per_step}
    path = write_results("vllm-bytecodes", {"records": records, "variants": results})
    print(f"\nwritten to {path}")


#: ``--hooks``: the vLLM methods the plugin overrides (or compiles again, allocate_slots), timed in both
#: schedulers: (which object, method). Nested: allocate_slots includes get_new_blocks, cache_full_blocks
#: and touch; _free_request includes free, which includes free_blocks.
HOOKS = (
    ("scheduler", "schedule"),
    ("fair", "before"),
    ("fair", "after"),
    ("scheduler", "add_request"),
    ("manager", "get_computed_blocks"),
    ("manager", "allocate_slots"),
    ("pool", "get_new_blocks"),
    ("pool", "cache_full_blocks"),
    ("pool", "touch"),
    ("scheduler", "_free_request"),
    ("manager", "free"),
    ("pool", "free_blocks"),
)


def hooked_run(
    kind: str,
    streams: dict[str, list[Spec]],
    warm: dict[str, list[Spec]],
    quotas: dict[str, Any],
    config: Any,
) -> Run:
    """One run of ``kind`` after a warm-up, each of :data:`HOOKS` wrapped in a wall-clock timer (in this
    process's classes: call it in a process of its own, :func:`isolated`). A timer costs both schedulers
    the same; the fenced - stock difference per hook is what the plugin adds there, cache misses and
    all, which neither callgrind (a simulated cache) nor cProfile (its own overhead per call) shows."""
    drive(kind, warm, quotas, config)  # warm-up, not counted
    if kind == "stock":
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler

        classes: dict[str, type] = {"scheduler": Scheduler, "manager": KVCacheManager, "pool": BlockPool}
    else:
        from kvfence.vllm.block_pool import FencedBlockPool
        from kvfence.vllm.fair import StepShares
        from kvfence.vllm.kv_cache_manager import FencedKVCacheManager
        from kvfence.vllm.scheduler import FenceMixin

        classes = {
            "scheduler": FenceMixin,
            "manager": FencedKVCacheManager,
            "pool": FencedBlockPool,
            "fair": StepShares,
        }
    spent: dict[str, int] = {}
    pc = time.perf_counter_ns
    for where, method in HOOKS:
        key = f"{where}.{method}"
        spent[key] = 0
        if where not in classes:  # fair share: the fenced scheduler's alone (0 for stock)
            continue
        inner = classes[where].__dict__[method]

        def timer(*args: Any, _inner: Any = inner, _key: str = key, **kwargs: Any) -> Any:
            t0 = pc()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_key] += pc() - t0

        setattr(classes[where], method, timer)
    # ``spent`` as it stood before each step's arrivals (drive's pace), and once more at the end: the
    # difference of two is one step's, which the run marks saturated or not.
    before_step: list[dict[str, int]] = []
    run = drive(kind, streams, quotas, config, pace=lambda: before_step.append(dict(spent)))
    before_step.append(dict(spent))
    run.hooks = spent
    run.hooks_saturated = {
        key: sum(
            after[key] - at[key]
            for at, after, sat in zip(before_step, before_step[1:], run.saturated, strict=False)
            if sat
        )
        for key in spent
    }
    return run


def hook_means(runs: list[Run], *, saturated: bool) -> dict[str, float]:
    """Per hook, and for the whole step, the median over the rounds of its microseconds per step: over
    every step, or over the saturated ones (:meth:`Run.saturated_summary`)."""

    def steps(r: Run) -> int:
        return max(1, sum(r.saturated)) if saturated else len(r.step_ns)

    def whole(r: Run) -> float:
        return r.saturated_summary()["saturated_mean_us"] if saturated else r.summary()["mean_us"]

    return {
        **{
            key: statistics.median(
                (r.hooks_saturated if saturated else r.hooks)[key] / steps(r) / 1e3 for r in runs
            )
            for key in runs[0].hooks
        },
        "the whole step": statistics.median(whole(r) for r in runs),
    }


def hooks(chosen: list[str], per_user: int, seed: int, config: Any, rounds: int) -> None:
    """Where the plugin's time goes, timed: :func:`hooked_run` of each scheduler, alternating, a forked
    process each; per hook the median over the rounds of its microseconds per step."""
    results: dict[str, Any] = {}
    streams, warm = workload(per_user, seed), workload(1, seed + 1)
    for label in chosen:
        quotas = VARIANTS[label]
        got: dict[str, list[Run]] = {k: [] for k in KINDS}
        for rnd in range(rounds):
            for kind in KINDS:
                got[kind].append(
                    isolated(lambda kind=kind, quotas=quotas: hooked_run(kind, streams, warm, quotas, config))
                )
            print(f"  [{label}] round {rnd + 1}/{rounds}", file=sys.stderr)
        per_step = {kind: hook_means(runs, saturated=False) for kind, runs in got.items()}
        per_saturated = {kind: hook_means(runs, saturated=True) for kind, runs in got.items()}
        same = len({r.fingerprint for runs in got.values() for r in runs}) == 1
        table(
            f"[{label}] microseconds per step inside each hook, medians of {rounds} rounds (nested hooks "
            f"are included in their callers; same schedule: {same}); all steps, and the saturated ones "
            "(requests left waiting: full batches both sides)",
            ["hook", "stock", "fenced", "fenced - stock", "saturated: stock", "fenced", "fenced - stock"],
            [
                [k]
                + [
                    f"{x:.1f}" if i < 2 else f"{x:+.1f}"
                    for means in (per_step, per_saturated)
                    for i, x in enumerate(
                        (means["stock"][k], means["fenced"][k], means["fenced"][k] - means["stock"][k])
                    )
                ]
                for k in per_step["stock"]
            ],
        )
        results[label] = {
            "us_per_step": per_step,
            "us_per_saturated_step": per_saturated,
            "same_schedule": same,
        }
    path = write_results("vllm-hooks", {"rounds": rounds, "variants": results})
    print(f"\nwritten to {path}")


# 64 lines: one add_argument per flag, in --help order.
