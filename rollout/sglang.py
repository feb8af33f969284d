"""Launch a real SGLang server that returns routed experts, wait for it, push weights to it.

SGLang is a GPU-only optional dependency (`pip install lockstep[gpu]`); nothing here imports
it. `SGLangConfig.command()` is the exact argv we run, so it is what CPU tests check. Once the
server is up, `lockstep.rollout.client.HTTPBackend` talks to it like to our own server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ..kernels.dtypes import HF_PRECISIONS
from ..moe.config import need as _need, strict_kwargs

_DTYPES = ("auto", *HF_PRECISIONS)


class SGLangError(RuntimeError):
    """The SGLang server failed to start, died, or refused a request."""


@dataclass
class SGLangConfig:
    """How to launch `python -m sglang.launch_server` for lockstep rollouts."""

    model_path: str
    """HF Qwen3-MoE folder (what `save_hf` writes) or hub id on a machine that has it."""
    host: str = "127.0.0.1"
    """Interface to bind; keep loopback unless the trainer runs on another machine."""
    port: int = 30000
    """HTTP port."""
    tp_size: int = 1
    """Tensor-parallel GPUs."""
    ep_size: int = 1
    """Expert-parallel size (divides tp_size in SGLang)."""
    dtype: str = "bfloat16"
    """Weights/activations dtype: auto, bfloat16, float16, float32."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV cache; None = SGLang's default."""
    context_length: int | None = None
    """Override the model's max context length."""
    enable_fp32_lm_head: bool = False
    """Compute the LM head in fp32 (less train/infer mismatch)."""
    enable_deterministic_inference: bool = False
    """Batch-invariant kernels (slower; reproducible log-probs)."""
    sampling_mask_max_tokens: int | None = None
    """Largest sampling support returned with return_sampling_mask (SGLang default 4096)."""
    random_seed: int | None = None
    """Server-wide seed."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>`."""
    weight_version: str | None = None
    """Initial weight version reported in every response (SGLang default "default")."""
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim to the command line."""
    python: str = sys.executable
    """Interpreter that has sglang installed."""

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            _need(cond, f"SGLangConfig: {msg}", ValueError)

        need(isinstance(self.model_path, str) and self.model_path != "",
             f"model_path must be a non-empty string, got {self.model_path!r}")
        need(isinstance(self.port, int) and 0 < self.port < 65536,
             f"port must be in 1..65535, got {self.port!r}")
        for name in ("tp_size", "ep_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, f"{name} must be a positive integer, got {v!r}")
        need(self.tp_size % self.ep_size == 0,
             f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        need(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        need(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
             f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        for name in ("context_length", "sampling_mask_max_tokens"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and v > 0),
                 f"{name} must be a positive integer or None, got {v!r}")
        need(isinstance(self.extra_args, list) and all(isinstance(a, str) for a in self.extra_args),
             f"extra_args must be a list of strings, got {self.extra_args!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SGLangConfig":
        return cls(**strict_kwargs(cls, d, error=ValueError))

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for the server: SGLang must report log-probs AFTER temperature (its
        default), the quantity lockstep's engine reports and the trainer recomputes; the
        variable below would switch it to pre-temperature log-probs, so we pin it off."""
        env = dict(os.environ)
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
        return env

    def command(self) -> list[str]:
        """The argv that launches the server."""
        argv = [self.python, "-m", "sglang.launch_server",
                "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port),
                "--tp-size", str(self.tp_size), "--ep-size", str(self.ep_size),
                "--dtype", self.dtype,
                # lockstep needs token ids in and out, and the routes of every token.
                "--skip-tokenizer-init", "--enable-return-routed-experts"]
        opt = [("--mem-fraction-static", self.mem_fraction_static),
               ("--context-length", self.context_length),
               ("--sampling-mask-max-tokens", self.sampling_mask_max_tokens),
               ("--random-seed", self.random_seed),
               ("--api-key", self.api_key),
               ("--weight-version", self.weight_version)]
        for flag, v in opt:
            if v is not None:
                argv += [flag, str(v)]
        if self.enable_fp32_lm_head:
            argv.append("--enable-fp32-lm-head")
        if self.enable_deterministic_inference:
            argv.append("--enable-deterministic-inference")
        return argv + list(self.extra_args)


class SGLangServer:
    """A running SGLang process: `with SGLangServer(cfg) as srv: srv.update_weights(dir)`."""

    def __init__(self, cfg: SGLangConfig, log_path: str | None = None):
        self.cfg = cfg
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            h["Authorization"] = f"Bearer {self.cfg.api_key}"
        return h

    def _request(self, method: str, path: str, body: dict | None = None,
                 timeout: float = 600.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.cfg.url + path, data=data, method=method,
                                     headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw.strip() else None)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def start(self, timeout_s: float = 900.0) -> "SGLangServer":
        """Spawn the server (own process group) and block until `/health` answers 200."""
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cfg.command(), stdout=out, stderr=subprocess.STDOUT,
                                     env=self.cfg.env(), start_new_session=True)
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SGLangError(f"SGLang exited with code {self.proc.returncode} before it was "
                                  f"healthy; command: {' '.join(self.cfg.command())}; "
                                  f"log {self.log_path or '(not kept)'} ends:\n{self._log_tail()}")
            try:
                status, _ = self._request("GET", "/health", timeout=5.0)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise SGLangError(f"SGLang at {self.cfg.url} not healthy after {timeout_s:.0f}s")

    def _log_tail(self, n_chars: int = 2000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - n_chars))
            return f.read().decode(errors="replace")

    def update_weights(self, model_path: str, weight_version: str | None = None,
                       flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """POST /update_weights_from_disk; raises SGLangError unless it reports success."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache,
                                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        status, resp = self._request("POST", "/update_weights_from_disk", body)
        if status != 200 or not isinstance(resp, dict) or not resp.get("success"):
            raise SGLangError(f"update_weights_from_disk({model_path!r}) failed: HTTP {status} "
                              f"{resp!r}")
        return resp

    def stop(self, grace_s: float = 30.0) -> None:
        """Terminate the server's process group (SGLang spawns scheduler/detokenizer children)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "SGLangServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
