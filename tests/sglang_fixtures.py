"""Real SGLang 0.5.23 servers on loopback for the `sglang` test tier (tests marked `sglang`).

SGLang lives in its own venv (tests/sglang_cpu/install.sh; `LOCKSTEP_SGLANG_VENV` overrides
the path): its torch never meets ours. Where the venv is absent the tests skip saying how to
install it. A server starts from an HF folder our code writes, with the two test-only shims
of tests/sglang_cpu/shims on its PYTHONPATH, on 127.0.0.1 and a free port; start-up takes
20-40 s and the scheduler busy-polls a core, so test modules share one server
(`module_server`) and stop it (its whole process group) when they end.

    from sglang_fixtures import sglang_server
    with sglang_server(hf_folder, "float32", log_dir) as url: ...
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lockstep.cluster.ports import free_port

from load_fixtures import Deadline

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "sglang_cpu" / "shims"
VENV = Path(os.environ.get("LOCKSTEP_SGLANG_VENV",
                           Path.home() / ".cache" / "lockstep" / "sglang-0.5.23"))
PYTHON = VENV / "bin" / "python"
STARTUP_S = 240.0  # on a quiet 2-core machine; stretched by the load (load_fixtures.Deadline)


def require_sglang() -> Path:
    """The venv's interpreter, or skip the test with how to get it."""
    if not PYTHON.exists():
        pytest.skip(f"real SGLang venv not found at {VENV}; run tests/sglang_cpu/install.sh")
    return PYTHON


def launch_args(folder: Path, dtype: str, port: int) -> list[str]:
    """SGLang's CPU flags (see tests/sglang_cpu/README.md): torch-native attention, no CUDA
    graphs, routes returned, token ids in and out."""
    return [str(PYTHON), "-m", "sglang.launch_server", "--model-path", str(folder),
            "--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "torch_native",
            "--disable-cuda-graph", "--max-total-tokens", "8192",
            "--enable-return-routed-experts", "--dtype", dtype, "--host", "127.0.0.1",
            "--port", str(port)]


def _get(url: str, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@contextlib.contextmanager
def sglang_server(folder: Path, dtype: str, log_dir: Path):
    """A real SGLang server over `folder`, healthy on yield (its URL); stopped at exit."""
    require_sglang()
    port = free_port()
    log = Path(log_dir) / f"sglang-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(SHIMS), "SGLANG_USE_CPU_ENGINE": "1",
           "LOCKSTEP_SGLANG_CPU_HOST_BUFFER": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(launch_args(folder, dtype, port), stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = Deadline(STARTUP_S)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang exited with {proc.returncode} during start-up; "
                                   f"its log ({log}) ends:\n{log.read_text()[-3000:]}")
            try:
                if _get(url, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if deadline.passed():
                raise RuntimeError(f"SGLang not healthy within {deadline.seconds:.0f}s (load "
                                   f"{os.getloadavg()[0]:.1f}); log: {log}")
            time.sleep(0.5)
        yield url
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (its scheduler and detokenizer too), then KILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)


def alive(url: str) -> bool:
    try:
        return _get(url, "/health", 10.0)[0] == 200
    except OSError:
        return False


def server_info(url: str) -> dict:
    return json.loads(_get(url, "/server_info")[1])
