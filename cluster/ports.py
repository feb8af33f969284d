"""Free TCP ports (standard library only: also used where Ray is not installed)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port the OS says is free now on `host` ("" = every interface), bound and released.
    On a remote node, call it there (a method of an actor on that node that returns this)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
