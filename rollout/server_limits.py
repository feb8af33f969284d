"""Connection limits of `lockstep serve` (rollout/server.py): slow or idle clients cannot hold
the server.

- Idle and partial-header connections are closed `idle_timeout_s` after they connected or got
  their last answer (aiohttp's keep-alive timer, which also runs while headers trickle in).
- A request body must arrive within `body_timeout_s` of its headers (HTTP 408 otherwise); after
  an answer to a request whose body was not read (408, 413) the connection closes within
  `LINGER_S` (aiohttp's default lingers 10 s).
- At most `max_connections` connections are open (never more than the process's open-file
  limit allows, less a margin for the model files and weight groups): one more evicts the
  oldest connection that is idle or still sending its body; when every connection is busy
  computing an answer, the new one is closed.
- The event loop's "socket.accept() out of system resource" error (the fd limit reached by
  something else) and aiohttp's per-request error lines are logged once a minute with a
  count, not once per accept or request.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass

from aiohttp import web

FD_MARGIN = 128  # open files kept for the model, logs, weight groups
LINGER_S = 1.0  # after answering a request whose body was not read (413, 408), wait for its rest
_log = logging.getLogger("lockstep.serve")


@dataclass(frozen=True)
class ServerLimits:
    idle_timeout_s: float = 30.0
    """Close a connection with no request (idle keep-alive, or headers still arriving) this
    long after it connected or got its last answer."""
    body_timeout_s: float = 60.0
    """A request body must arrive within this many seconds of its headers (else HTTP 408)."""
    max_connections: int = 4096
    """Open connections at most (also bounded by RLIMIT_NOFILE less FD_MARGIN)."""

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"ServerLimits.max_connections must be >= 1, got "
                             f"{self.max_connections}")

    @property
    def connection_cap(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = self.max_connections if soft == resource.RLIM_INFINITY else soft - FD_MARGIN
        return max(1, min(self.max_connections, room))


class Connections:
    """The open connections of one server and the cap on them (attached to aiohttp's
    `web.Server` by `Runner`). Handlers mark the requests whose body is still being read
    (`reading`): those connections are as evictable as idle ones."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.cap = limits.connection_cap
        self.reading: set = set()  # RequestHandler protocols reading a request body
        self.evicted = 0
        self.refused = 0
        self._server: web.Server | None = None

    @property
    def open(self) -> int:
        return len(self._server.connections) if self._server is not None else 0

    def attach(self, server: web.Server) -> None:
        self._server = server
        made = server.connection_made

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            if len(server.connections) > self.cap:
                self._make_room(server, handler)
        server.connection_made = connection_made  # the instance's hook, called per connection

    def _make_room(self, server: web.Server, new) -> None:
        for h in server.connections:  # oldest first
            if h is new or h.transport is None:  # closing already (gone once its task ends)
                continue
            if h in self.reading or not h._request_in_progress:
                self.evicted += 1
                self.reading.discard(h)
                h.force_close()
                return
        self.refused += 1  # every connection is computing an answer: this one waits its turn
        new.force_close()


class Runner(web.AppRunner):
    """`web.AppRunner` with the app's `Connections` attached to its server and the keep-alive
    timer at `idle_timeout_s`."""

    def __init__(self, app: web.Application, connections: Connections, **kwargs):
        super().__init__(app, keepalive_timeout=connections.limits.idle_timeout_s,
                         lingering_time=LINGER_S, **kwargs)
        self.connections = connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        self.connections.attach(server)
        return server


class _OncePerKind(logging.Filter):
    """Pass a record of each kind (logger and message) once per `every_s`, with the count of
    those held back since: aiohttp logs every malformed request with its traceback, so a
    client sending bad requests in a loop would grow the log without bound."""

    def __init__(self, every_s: float):
        super().__init__()
        self.every_s = every_s
        self._seen: dict[tuple[str, str], list] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self._seen.setdefault(key, [-self.every_s, 0])
        if now - last[0] < self.every_s:
            last[1] += 1
            return False
        if last[1]:
            record.msg = f"{record.msg} ({last[1]} more like it in the last {self.every_s:g}s)"
        last[0], last[1] = now, 0
        return True


def throttle_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 60.0) -> None:
    """Log the loop's accept-out-of-resources error once per `every_s` with a count (asyncio
    logs it, with a traceback, on every accept it retries); aiohttp's per-request error lines
    ("Error handling request", a bad request line or header) likewise."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OncePerKind) for f in server_log.filters):
        server_log.addFilter(_OncePerKind(every_s))
    state = {"last": -every_s, "count": 0}

    def handler(loop, context) -> None:
        if "accept" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = time.monotonic()
        if now - state["last"] >= every_s:
            _log.error("lockstep serve: %s (%s; %d times since the last such line): the open-file "
                       "limit is reached; raise `ulimit -n` or lower --max-connections",
                       context.get("message"), context.get("exception"), state["count"])
            state["last"], state["count"] = now, 0
    loop.set_exception_handler(handler)
