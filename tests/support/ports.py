"""A TCP port nobody listens on at the moment of asking."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 the kernel just handed out (free, not reserved: bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
