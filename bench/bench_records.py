"""Micro-benchmark of the vLLM fence's prefix-cache records (kvfence.vllm.records): each operation the
scheduler calls, timed on the compiled module and, as the peer in the same run, on the pure-Python
records (or on another build of ``_records``, given with ``--peer``: a shared object file, loaded under
the module's name, to compare two builds of the C source).

    .venv/bin/python bench/bench_records.py [--peer PATH] [--rounds 7] [--json FILE]

Each figure is the best of ``--rounds`` timings of a loop (the least disturbed by other work on a
shared machine), in nanoseconds per call; the ratio is this build's time over the peer's.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import sys
import timeit
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvfence.vllm import records

BLOCK = 16
BLOCKS = 128
TOKENS = [(i * 7919) % 150_000 for i in range(BLOCK * BLOCKS)]


class Block:
    """What record_chain reads of a vLLM KVCacheBlock."""

    __slots__ = ("block_hash", "block_id", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash = b"h"
        self.is_null = False


class PyImpl:
    """The pure-Python records under the compiled module's names."""

    Record = records.PyRecord
    equal = staticmethod(records.py_equal)
    verify_chain = staticmethod(records.py_verify_chain)
    record_chain = staticmethod(records.py_record_chain)
    pack = None


def load(path: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("kvfence.vllm._records", path)
    spec = importlib.util.spec_from_file_location("kvfence.vllm._records", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def cases(m: Any) -> dict[str, Callable[[], object]]:
    """name -> a call of one operation, on module (or namespace) m."""
    toks = list(TOKENS)
    packed = m.pack(toks) if m.pack is not None else None
    blocks = [Block(i) for i in range(BLOCKS)]
    store: list[Any] = [None] * BLOCKS
    m.record_chain(store, blocks, 0, BLOCKS, None, toks, packed, BLOCK, 0, ("ns",))
    ids = list(range(BLOCKS))
    scratch: list[Any] = [None] * BLOCKS
    out: dict[str, Callable[[], object]] = {
        "Record(list)": lambda: m.Record(None, toks, 0, BLOCK, ("ns",)),
        "equal(16 tokens)": lambda: m.equal(store[1].tokens, toks, BLOCK),
        "verify_chain(128 blocks, list)": lambda: m.verify_chain(store, ids, toks, None, ("ns",), BLOCK),
        "record_chain(128 blocks, list)": lambda: m.record_chain(
            scratch, blocks, 0, BLOCKS, None, toks, None, BLOCK, 0, ("ns",)
        ),
    }
    if packed is not None:
        out["pack(2048 tokens)"] = lambda: m.pack(toks)
        out["Record(packed)"] = lambda: m.Record(None, packed, 0, BLOCK, ("ns",))
        out["verify_chain(128 blocks, packed)"] = lambda: m.verify_chain(
            store, ids, toks, packed, ("ns",), BLOCK
        )
        out["record_chain(128 blocks, packed)"] = lambda: m.record_chain(
            scratch, blocks, 0, BLOCKS, None, toks, packed, BLOCK, 0, ("ns",)
        )
    return out


def best_ns(fn: Callable[[], object], rounds: int) -> float:
    number = 1
    while timeit.timeit(fn, number=number) < 0.05:
        number *= 2
    return min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", help="another build of _records (a .so file) to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the figures to this file too")
    args = ap.parse_args()
    if not records.COMPILED:
        sys.exit("bench_records: kvfence.vllm._records is not built (make venv)")
    from kvfence.vllm import _records

    peer: Any = load(args.peer) if args.peer else PyImpl
    peer_name = args.peer or "pure Python"
    mine, theirs = cases(_records), cases(peer)
    rows = []
    print(f"{'operation':36} {'this build ns':>14} {'peer ns':>10} {'ratio':>7}   peer: {peer_name}")
    for name, fn in mine.items():
        if name not in theirs:
            continue
        # Interleaved, so a slow spell of the machine falls on both.
        a, b = [], []
        for _ in range(3):
            a.append(best_ns(fn, args.rounds))
            b.append(best_ns(theirs[name], args.rounds))
        row = {"operation": name, "ns": min(a), "peer_ns": min(b), "ratio": min(a) / min(b)}
        rows.append(row)
        print(f"{name:36} {row['ns']:14.0f} {row['peer_ns']:10.0f} {row['ratio']:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peer": peer_name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
