# The compiled walk (_prefix_walk.c): see that file and kvfence.isolation.prefix_cache.
from typing import Any

def walk(
    index: dict[bytes, Any],
    raw: bytes,
    pos: int,
    end: int,
    block_bytes: int,
    key: bytes,
    matched: bytes,
    ctx: object,
    parent: Any,
    fenced: object,
    blocks: list[Any],
) -> tuple[int, bytes, bytes, Any, Any]: ...
