"""Issue 22, slowloris: connections that send part of a request and then idle are closed within
the server's bounds (rollout/server_limits.py), and past the connection cap the oldest idle
ones make room, so /health and /generate keep answering. Raw sockets against a real
ServerThread on loopback; every wait is bounded."""

import json
import socket
import time

import pytest

from lockstep.rollout.engine import Engine
from lockstep.rollout.server import ServerThread
from lockstep.rollout.server_limits import ServerLimits

from server_fixtures import ENGINE, call, model  # noqa: F401 (pytest fixture)

HEAD = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{")


def _open(port, data):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


def _closed_after(s, bound):
    """Seconds until the server answers or closes `s` (reads until EOF), and what it sent."""
    t0, got = time.monotonic(), b""
    s.settimeout(bound)
    try:
        while chunk := s.recv(4096):
            got += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return time.monotonic() - t0, got


def test_partial_bodies_and_headers_are_timed_out(model):  # noqa: F811
    """Before: a body that stops after one byte held its connection (and handler) forever, and
    ServerThread's keep-alive timer was aiohttp's 3630 s."""
    limits = ServerLimits(idle_timeout_s=1.0, body_timeout_s=1.0)
    with ServerThread(Engine.from_model(model, ENGINE), limits=limits) as srv:
        body = _open(srv.port, HEAD)
        header = _open(srv.port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")
        idle = _open(srv.port, b"")
        took, got = _closed_after(body, 10)
        assert took < 5 and got.startswith(b"HTTP/1.1 408"), (took, got[:200])
        assert b"did not arrive within 1s" in got and b"--body-timeout" in got
        for s in (header, idle):
            took, got = _closed_after(s, 10)
            assert took < 5 and got == b"", (took, got)
        assert call(srv.url, "/health", timeout=5)[0] == 200


def test_connection_cap_evicts_the_oldest_idle(model):  # noqa: F811
    """Past the cap the oldest idle or slow-body connection is closed for the new one: /health
    and /generate answer while 3x the cap of slowloris connections keep arriving."""
    limits = ServerLimits(idle_timeout_s=60, body_timeout_s=60, max_connections=16)
    with ServerThread(Engine.from_model(model, ENGINE), limits=limits) as srv:
        held = []
        worst = 0.0
        for i in range(48):
            held.append(_open(srv.port, HEAD if i % 2 else b"GET /health HTTP/1.1\r\nHo"))
            if i % 8 == 7:
                t0 = time.monotonic()
                assert call(srv.url, "/health", timeout=5)[0] == 200
                status, out = call(srv.url, "/generate", {"input_ids": [1, 2], "sampling_params": {
                    "max_new_tokens": 2}}, timeout=10)
                assert status == 200, out
                worst = max(worst, time.monotonic() - t0)
        info = call(srv.url, "/server_info")[1]["connections"]
        assert info["cap"] == 16 and info["open"] <= 17 and info["evicted"] >= 30, info
        assert worst < 5, worst
        for s in held:
            s.close()


@pytest.mark.parametrize("field", ["idle_timeout_s", "body_timeout_s", "max_connections"])
def test_limits_are_checked(field):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: 0})


def test_server_info_reports_connections(model):  # noqa: F811
    with ServerThread(Engine.from_model(model, ENGINE)) as srv:
        info = call(srv.url, "/server_info")[1]["connections"]
    assert info["cap"] <= 4096 and info["open"] >= 1, json.dumps(info)


def test_bad_requests_in_a_loop_keep_the_log_small(model, caplog):  # noqa: F811
    """Before: aiohttp logged every malformed request with its traceback (a client in a loop
    grew the log without bound)."""
    with ServerThread(Engine.from_model(model, ENGINE)) as srv:
        for _ in range(10):
            took, got = _closed_after(_open(srv.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n"
                                                      b"Content-Length: -5\r\n\r\n"), 10)
            assert b" 400 " in got.split(b"\r\n")[0], got[:100]
        assert call(srv.url, "/health", timeout=5)[0] == 200
    lines = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert 1 <= len(lines) <= 2, [r.getMessage()[:80] for r in lines]
