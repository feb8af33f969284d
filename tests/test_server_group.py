"""A launched server's process group ends with it (rollout/sglang.py `SGLangServer`, which
`VLLMServer` is): `stop` kills what a dead server left behind, and with `die_with_parent` the
whole group dies with the thread that started it. vLLM's API server starts an EngineCore
(and workers) that outlive it when only the API server is killed: a real process tree of the
same shape stands in for it here (a /health server that starts a grandchild)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lockstep.cluster.ports import free_port
from lockstep.rollout.sglang import SGLangConfig, SGLangServer

SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _gone(pids, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _start(tmp_path, die_with_parent: bool) -> tuple[SGLangServer, int]:
    port = free_port()
    srv = SGLangServer(SGLangConfig(model_path="unused", port=port),
                       die_with_parent=die_with_parent)
    pidfile = tmp_path / f"child-{port}"
    srv._spawn([sys.executable, "-c", SERVER, str(port), str(pidfile)], timeout_s=30.0)
    return srv, int(pidfile.read_text())


@pytest.mark.parametrize("die_with_parent", [False, True])
def test_stop_ends_what_a_dead_server_left(tmp_path, die_with_parent):
    srv, child = _start(tmp_path, die_with_parent)
    try:
        os.kill(srv.proc.pid, signal.SIGKILL)  # the API server dies; its child lives on
        srv.proc.wait()
        assert _alive(child)
        srv.stop(grace_s=5.0)
        assert _gone([child]), "stop left the dead server's child running"
    finally:
        os.kill(child, signal.SIGKILL) if _alive(child) else None


def test_the_group_dies_with_the_thread_that_started_it(tmp_path):
    """A Ray actor that starts a server and is killed: nothing of the server survives it."""
    port = free_port()
    pidfile = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.argv = ["x"]
        from lockstep.rollout.sglang import SGLangConfig, SGLangServer
        srv = SGLangServer(SGLangConfig(model_path="unused", port={port}), die_with_parent=True)
        srv._spawn([sys.executable, "-c", {SERVER!r}, "{port}", "{pidfile}.child"], 30.0)
        open("{pidfile}", "w").write(str(srv.proc.pid))
        time.sleep(600)
    """)])
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text():
        assert parent.poll() is None and time.monotonic() < deadline, "the parent did not start"
        time.sleep(0.1)
    server = int(pidfile.read_text())
    child = int((tmp_path / "pids.child").read_text())
    group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _alive(int(p))
             and os.getpgid(int(p)) == os.getpgid(server)]
    try:
        assert server in group and child in group
        parent.kill()
        parent.wait()
        assert _gone(group), "the server's group outlived its parent"
    finally:
        for p in group:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
