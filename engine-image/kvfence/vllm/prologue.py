"""vLLM's own function with a few of kvfence's statements in front of its body: one frame instead of two.

The fence has to see some calls that vLLM makes on its hottest paths (``allocate_slots``: every scheduled
request of every step). A Python override that forwards to vLLM's method costs a second frame and a
call that passes every parameter on: on CPython 3.11, for ``allocate_slots``' twelve parameters, about
1,070 instructions a call on top of the 870 of vLLM's method itself (callgrind, docs/engine.md); a C
forwarder saves only about 100 of them (calling a Python function from C enters a new interpreter loop).
:func:`with_prologue` instead compiles vLLM's function again from vLLM's own source, with the
prologue's statements first in its body: the same code in the same globals, under vLLM's file
name and line numbers (tracebacks point at vLLM's source), plus the prologue.

The prologue may write ``{args}``: the function's parameters after the first (a method's ``self``), in
order, comma-separated (to pass them all on, e.g. to the override's slow path).
``tests/vllm_engine/test_vllm_prologue.py`` checks that an empty prologue compiles to vLLM's very code
object, and that a prologue runs before the unchanged body.
"""

from __future__ import annotations
import __future__

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any


class PrologueError(RuntimeError):
    """vLLM's function cannot be compiled again with a prologue (the message says why)."""


def positional_params(fn: Callable[..., Any]) -> list[str]:
    """``fn``'s parameters after the first (``self``); every one may be passed by position."""
    params = list(inspect.signature(fn).parameters.values())
    for p in params:
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            raise PrologueError(f"{fn.__qualname__}: parameter {p.name!r} is {p.kind.description}")
    return [p.name for p in params[1:]]


def with_prologue(fn: Callable[..., Any], prologue: str, qualname: str | None = None) -> Callable[..., Any]:
    """``fn`` (a plain function: a method taken from its class) compiled again from its source with
    ``prologue``'s statements run first, named ``qualname`` (default: ``fn``'s). Raises
    :class:`PrologueError` if its source cannot be read or it is not a plain function (a closure, a
    decorated or nested one)."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars:
        raise PrologueError(f"{getattr(fn, '__qualname__', fn)!r} is not a plain function")
    try:
        lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn)
    except (OSError, TypeError) as e:
        raise PrologueError(f"cannot read the source of {fn.__qualname__}: {e}") from None
    if filename is None:
        raise PrologueError(f"cannot find the source file of {fn.__qualname__}")
    source = "".join(lines)
    # A method's source is indented: parsed inside an ``if True:`` (not dedented), so that its columns
    # and its docstring stay exactly vLLM's.
    nested = source[:1].isspace()
    tree = ast.parse(f"if True:\n{source}" if nested else source)
    ast.increment_lineno(tree, first - 2 if nested else first - 1)
    outer: list[ast.stmt] = tree.body
    if nested and len(outer) == 1 and isinstance(outer[0], ast.If):
        outer = outer[0].body
    fdef = outer[0] if len(outer) == 1 else None
    if not isinstance(fdef, ast.FunctionDef) or fdef.decorator_list or fdef.name != fn.__name__:
        raise PrologueError(f"{fn.__qualname__}: its source is not one undecorated function")
    text = textwrap.dedent(prologue)
    if "{args}" in text:
        text = text.replace("{args}", ", ".join(positional_params(fn)))
    stmts = ast.parse(text).body
    if not stmts and prologue.strip():
        raise PrologueError("the prologue has no statements")
    for node in stmts:  # the prologue "is" the def line, for tracebacks
        for sub in ast.walk(node):
            if "lineno" in sub._attributes:
                sub.lineno = sub.end_lineno = fdef.lineno  # type: ignore[attr-defined]
                sub.col_offset = sub.end_col_offset = 0  # type: ignore[attr-defined]
    doc = ast.get_docstring(fdef, clean=False) is not None  # the docstring stays first: it is __doc__
    fdef.body[doc:doc] = stmts
    # Compiled under fn's own module's __future__ imports, in fn's module globals: as vLLM compiled it.
    futures = (getattr(__future__, name).compiler_flag for name in __future__.all_feature_names)
    flags = sum(f for f in futures if code.co_flags & f)
    compiled = compile(tree, filename, "exec", flags=flags, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(compiled, fn.__globals__, namespace)  # noqa: S102 - vLLM's own source, read from its file
    new: Any = namespace[fn.__name__]
    new.__qualname__ = qualname or fn.__qualname__
    new.__code__ = new.__code__.replace(co_qualname=new.__qualname__)
    # Defaults are fn's own objects (the source evaluated them again: equal, but not the same objects).
    new.__defaults__ = fn.__defaults__
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__wrapped__ = fn
    out: Callable[..., Any] = new
    return out
