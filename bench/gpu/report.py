"""One table from a GPU run's results (bench/gpu/run.sh): the plugin's scheduler-step cost
(bench/bench_vllm.py --lockstep --floor, ``vllm-<time>.json``: the newest of each workload, the
saturated default mix and the light engine of ``--users``) and the end-to-end cost
(bench/bench_e2e.py, ``e2e-*.json``: the newest), in the directory given.

    python3 bench/gpu/report.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STEP_GOAL = 1.05
THROUGHPUT_GOAL = 0.98
TTFT_GOAL_MS = 1.0


def newest(d: Path, prefix: str) -> dict[str, Any] | None:
    found = sorted(d.glob(f"{prefix}-*.json"))
    return json.loads(found[-1].read_text()) if found else None


def step_docs(d: Path) -> list[dict[str, Any]]:
    """The newest lockstep result (``vllm-<time>.json``, not the probes' ``vllm-hooks-*`` and the like)
    of each workload in ``d``, in the order the workloads first ran."""
    by_workload: dict[str, dict[str, Any]] = {}
    for p in sorted(d.glob("vllm-[0-9]*.json")):
        doc = json.loads(p.read_text())
        by_workload[workload(doc)] = doc
    return list(by_workload.values())


def workload(doc: dict[str, Any]) -> str:
    """The tenants and their concurrent users, as bench_vllm.py --users sets them."""
    users = [n for n in doc["setup"].get("users_per_tenant", {}).values() if n]
    return f"{len(users)} tenants x users {','.join(map(str, users))}" if users else "the default mix"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def step_rows(doc: dict[str, Any] | None) -> list[list[str]]:
    """The lockstep benchmark's verdict (bench_vllm.verdict: like-for-like figures; with fair share on,
    the saturated steps and the whole workload's time, not the per-step mean), and its other figures."""
    if doc is None:
        return [["scheduler step, fenced / stock", "not run", f"<= {STEP_GOAL}", "-"]]
    v = doc["variants"]["no quotas"]
    decided = v["verdict"]
    floor = v.get("floor", {}).get("ratio_mean_step", float("nan"))
    under = f"{decided['rounds_under']} of {decided['rounds']} rounds <= {STEP_GOAL}"
    return [
        [
            f"scheduler, fenced / stock (no quotas, lockstep, {workload(doc)}), on the {decided['figure']}",
            f"{decided['ratio']:.3f} ({under})",
            f"<= {STEP_GOAL}",
            verdict(decided["met"]),
        ],
        ["  mean step", f"{v['ratio_mean_step']:.3f}", "-", "-"],
        ["  saturated step", ratio(v["ratio_saturated_step"]), "-", "-"],
        ["  whole workload", f"{v['ratio_total']:.3f}", "-", "-"],
        *split_rows(v.get("split")),
        ["  A/A floor (stock / stock)", f"{floor:.3f}", "near 1.000", "-"],
    ]


def ratio(x: float | None) -> str:
    """A ratio, or n/a where the run had no such steps (a light engine never saturates)."""
    return "n/a" if x is None else f"{x:.3f}"


def split_rows(split: dict[str, Any] | None) -> list[list[str]]:
    """``--split``: the fence alone against stock (its own verdict), and fair share on top of it."""
    if split is None:
        return []
    fence, fair = split["fence_only"], split["fair_share_on_fence"]
    v = fence["verdict"]
    return [
        [
            f"  the fence alone / stock (fair share patched out), on the {v['figure']}",
            f"{v['ratio']:.3f}",
            f"<= {STEP_GOAL}",
            verdict(v["met"]),
        ],
        [
            "  fair share on top of it (as shipped / fence alone), saturated step",
            ratio(fair["ratio_saturated_step"]),
            "-",
            "-",
        ],
        ["  fair share on top of it, whole workload", f"{fair['ratio_total']:.3f}", "-", "-"],
    ]


def _interval(ci: list[float | None] | None, fmt: str) -> str:
    """`` [low, high]`` (a 95% interval) where the results have one (bench_e2e.py records it)."""
    if not ci or None in ci:
        return ""
    return f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _ms(part: float | dict[str, Any]) -> str:
    """A part of the TTFT added: a figure in ms, or one with its interval."""
    if isinstance(part, dict):
        return f"{part['ms']:+.2f}{_interval(part.get('ci95'), '+.2f')}"
    return f"{part:+.2f}"


def e2e_rows(doc: dict[str, Any] | None) -> list[list[str]]:
    if doc is None:
        return [["end to end (vllm bench serve)", "not run", "", "-"]]
    rows = []
    for s in doc["summary"]["rows"].values():
        m = s["median"]
        value = f"{m['request_throughput']:.2f} req/s, TTFT p50 {m['median_ttft_ms']:.1f} ms"
        value += f", ITL p50 {m['median_itl_ms']:.2f} ms"
        rows.append([f"rate {s['rate']}: {s['row']}", value, "", "-"])
    g = doc["summary"]["goals"]
    if "throughput_ratio" in g:  # saturation ran
        ci = g.get("throughput_ratio_ci95")
        rows.append(
            [
                f"throughput at {g['saturation_rate']}, kvfence + router / stock",
                f"{g['throughput_ratio']:.3f}{_interval(ci, '.3f')} (engine "
                f"{g['throughput_engine_part']:.3f}, router {g['throughput_router_part']:.3f})",
                f">= {THROUGHPUT_GOAL}",
                g.get("throughput_verdict") or verdict(g["throughput_met"]),
            ]
        )
    for rate, t in g["ttft_added_ms"].items():
        rows.append(
            [
                f"TTFT p50 added at {rate} req/s",
                f"{t['total']:+.2f} ms{_interval(t.get('ci95'), '+.2f')} (engine {_ms(t['engine_part'])}, "
                f"router {_ms(t['router_part'])})",
                f"<= {TTFT_GOAL_MS} ms",
                t.get("verdict") or verdict(t["met"]),
            ]
        )
    return rows


def header_lines(step: dict[str, Any] | None, e2e: dict[str, Any] | None) -> list[str]:
    lines = []
    if e2e is not None:
        eng = e2e.get("engine", {})
        records = {True: "compiled", False: "pure Python"}.get(eng.get("records_compiled"), "unknown")
        lines.append(f"date {e2e['date']}, commit {e2e['commit']}, vLLM {eng.get('vllm')}, records {records}")
        lines.append(f"machine: {e2e['machine'].get('gpus')} {e2e['machine'].get('cpu')}")
    if step is not None:
        lines.append(f"scheduler benchmark: vLLM {step['setup']['vllm']}, {step['setup']['rounds']} rounds")
    return lines


def main() -> None:
    d = Path(sys.argv[1])
    steps, e2e = step_docs(d), newest(d, "e2e")
    rows = [row for doc in steps or [None] for row in step_rows(doc)] + e2e_rows(e2e)
    header = ["figure", "value", "goal", "verdict"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("\n".join(header_lines(steps[-1] if steps else None, e2e)) + "\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
