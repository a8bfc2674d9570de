"""A TCP port nobody listens on at the moment of asking."""

from __future__ import annotations

import socket
from collections.abc import Iterable

#: Every port this process has handed out: a port picked but not bound yet (a local cluster picks a
#: dozen before it starts the processes that bind them) is free to the kernel, which may hand it out
#: again; it once gave etcd's port to kube-router's health server too.
_handed_out: set[int] = set()


def free_port(avoid: Iterable[int] = ()) -> int:
    """A port on 127.0.0.1 the kernel just handed out (free, not reserved: bind it soon), never one
    this process handed out before nor one of ``avoid`` (ports picked by another process, say a
    cluster's saved ports)."""
    taken = _handed_out.union(avoid)
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port that was not handed out before, in 1000 tries")
