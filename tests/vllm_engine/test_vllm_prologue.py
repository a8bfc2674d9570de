"""kvfence.vllm.prologue: vLLM's own functions compiled again with the fence's statements first. An empty
prologue gives back vLLM's very code; a prologue runs before the unchanged body; what cannot be compiled
faithfully is refused. The fenced ``allocate_slots`` built this way is exercised by every other test of
this lane (admission, quotas, stale references)."""

from __future__ import annotations

import functools
import traceback
from pathlib import Path
from typing import Any

import pytest

from kvfence.vllm.prologue import PrologueError, positional_params, with_prologue


class Counter:
    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def add(self, a: int, b: int = 2, c: list[int] | None = None) -> int:
        """Adds."""
        if a < 0:
            raise ValueError("negative")  # the line a traceback must name
        return a + b + (len(c) if c else 0)


RAISE_LINE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if "the line a traceback must name" in line
)


def top_level(x: int) -> int:
    return x * 2


def decorated(fn: Any) -> Any:
    @functools.wraps(fn)
    def inner(*args: Any) -> Any:
        return fn(*args)

    return inner


@decorated
def wrapped_function(x: int) -> int:
    return x


def test_an_empty_prologue_compiles_to_vllms_own_code() -> None:
    # The recompilation itself changes nothing: same bytecode, constants, names, line table, flags.
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    for fn in (KVCacheManager.allocate_slots, hash_block_tokens):
        again = with_prologue(fn, "")
        assert again.__code__ == fn.__code__
        assert again.__defaults__ is fn.__defaults__
        assert again.__doc__ == fn.__doc__


def test_the_fenced_allocate_slots_is_vllms_with_the_fences_prologue() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvfence.vllm.kv_cache_manager import FencedKVCacheManager

    ours: Any = FencedKVCacheManager.allocate_slots
    theirs = KVCacheManager.allocate_slots
    assert ours.__wrapped__ is theirs
    assert ours.__qualname__ == ours.__code__.co_qualname == "FencedKVCacheManager.allocate_slots"
    assert ours.__code__.co_filename == theirs.__code__.co_filename  # tracebacks point at vLLM's source
    assert (
        ours.__code__.co_varnames[: theirs.__code__.co_argcount]
        == theirs.__code__.co_varnames[: theirs.__code__.co_argcount]
    )
    # The prologue is the only addition: vLLM's names and constants all still there, plus the fence's.
    assert set(theirs.__code__.co_names) <= set(ours.__code__.co_names)
    assert {"fenced_pool", "rid", "_admit"} <= set(ours.__code__.co_names)
    assert positional_params(theirs)[:4] == [
        "request",
        "num_new_tokens",
        "num_new_computed_tokens",
        "new_computed_blocks",
    ]


def test_a_prologue_runs_first_then_the_unchanged_body() -> None:
    add: Any = with_prologue(Counter.add, "self.seen.append(({args},))")
    c = Counter()
    assert add(c, 1) == 3
    assert add(c, 1, 5, [7, 7]) == 8
    assert c.seen == [(1, 2, None), (1, 5, [7, 7])]
    assert add.__defaults__ is Counter.add.__defaults__
    assert add.__doc__ == "Adds."
    # The body keeps its own line numbers in tracebacks; the prologue's are the def line.
    with pytest.raises(ValueError) as err:
        add(c, -1)
    assert traceback.extract_tb(err.value.__traceback__)[-1].lineno == RAISE_LINE
    broken: Any = with_prologue(Counter.add, "self.missing.append(1)")
    with pytest.raises(AttributeError) as err2:
        broken(c, 1)
    assert traceback.extract_tb(err2.value.__traceback__)[-1].lineno == Counter.add.__code__.co_firstlineno


def test_a_prologue_may_return_early() -> None:
    double: Any = with_prologue(top_level, "if x == 0:\n    return -1\n")
    assert (double(0), double(3)) == (-1, 6)
    assert double.__code__.co_qualname == "top_level"


def test_what_cannot_be_compiled_faithfully_is_refused() -> None:
    def outer() -> Any:
        k = 3

        def closure(x: int) -> int:
            return x + k

        return closure

    def kw_only(a: int, *, b: int = 1) -> int:
        return a + b

    namespace: dict[str, Any] = {}
    exec("def from_string(self, x):\n    return x\n", namespace)  # noqa: S102 - no source file
    cases: list[tuple[Any, str]] = [
        (outer(), "not a plain function"),
        (len, "not a plain function"),
        (wrapped_function, "not a plain function"),  # the wrapper is a closure
        (wrapped_function.__wrapped__, "not one undecorated function"),
        (namespace["from_string"], "cannot read the source"),
    ]
    for fn, why in cases:
        with pytest.raises(PrologueError, match=why):
            with_prologue(fn, "pass")
    with pytest.raises(PrologueError, match="keyword-only"):
        with_prologue(kw_only, "print({args})")
    assert with_prologue(kw_only, "pass")(1, b=2) == 3  # without {args}, any signature
    # A prologue may hold braces of its own.
    assert with_prologue(top_level, "d = {'x': x}\nx = d['x'] + 1")(1) == 4
