# The compiled records (_records.c): see that file and kvfence.vllm.records (PyRecord is the same
# interface in Python).
from typing import Any

TOKEN_BYTES: int

class Record:
    @property
    def parent(self) -> Record | None: ...
    @property
    def tokens(self) -> Any: ...
    @property
    def namespace(self) -> Any: ...
    @property
    def root(self) -> bool: ...
    def __init__(
        self,
        parent: Record | None,
        tokens: list[int] | bytes,
        start: int,
        stop: int,
        namespace: Any,
        root: bool = False,
    ) -> None: ...

def equal(packed: Any, tokens: list[int], start: int, /) -> bool: ...
def pack(tokens: list[int], /) -> bytes: ...
def verify_chain(
    records: list[Any],
    block_ids: list[int],
    tokens: list[int],
    packed: bytes | None,
    namespace: Any,
    block_size: int,
    /,
) -> int: ...
def record_chain(
    records: list[Any],
    blocks: list[Any],
    start: int,
    stop: int,
    parent: Record | None,
    tokens: list[int],
    packed: bytes | None,
    block_size: int,
    root: int,
    namespace: Any,
    /,
) -> None: ...
def slot_tokens() -> int: ...
