"""Launch a real SGLang server that returns routed experts, wait for it, push weights to it.

SGLang is a GPU-only optional dependency (`pip install lockstep[gpu]`); nothing here imports
it. `SGLangConfig.command()` is the exact argv we run, so it is what CPU tests check. Once the
server is up, `lockstep.rollout.client.HTTPBackend` talks to it like to our own server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ..kernels.dtypes import HF_PRECISIONS
from ..moe.checks import need as _need, strict_kwargs

_DTYPES = ("auto", *HF_PRECISIONS)
# What SGLang 0.5.23 needs to run on a CPU (its CPU platform, no CUDA graphs, an attention
# backend without CUDA kernels); the KV cache is capped because SGLang otherwise sizes it from
# the machine's free RAM (mem_fraction_static of it).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
CPU_MAX_TOTAL_TOKENS = 8192


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
    quantization: str | None = None
    """--quantization: "fp8" (rollout.dtype=fp8; the block-FP8 recipe when the model folder's
    config.json carries quantization_config with weight_block_size, otherwise SGLang
    quantises online per tensor); None = none (or what the folder's config.json says)."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV cache; None = SGLang's default."""
    context_length: int | None = None
    """Override the model's max context length."""
    enable_fp32_lm_head: bool = False
    """Compute the LM head in fp32 (less train/infer mismatch)."""
    enable_deterministic_inference: bool = False
    """Batch-invariant kernels (slower; reproducible log-probs)."""
    enable_return_indexer_topk: bool = False
    """--enable-return-indexer-topk: the DSA indexer's picks per token (replay.indexer=r3;
    SGLang captures them on CUDA / NPU only)."""
    sampling_mask_max_tokens: int | None = None
    """Largest sampling support returned with return_sampling_mask (SGLang default 4096)."""
    random_seed: int | None = None
    """Server-wide seed."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>`. Never on the command line: `SGLangServer` hands
    it to SGLang in a private `--config` file (mode 0600) removed once the server is up."""
    weight_version: str | None = None
    """Initial weight version reported in every response (SGLang default "default")."""
    device: str = "cuda"
    """cuda, or cpu: SGLang's CPU engine (`CPU_FLAGS`, `CPU_ENV`; tests and small models)."""
    max_total_tokens: int | None = None
    """--max-total-tokens: KV-cache size in tokens; None = SGLang's choice on cuda,
    CPU_MAX_TOTAL_TOKENS on cpu."""
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim to the command line."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for the server process (over the inherited ones)."""
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
        need(self.quantization in (None, "fp8"),
             f"quantization must be fp8 or None, got {self.quantization!r}")
        need(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
             f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        for name in ("context_length", "sampling_mask_max_tokens"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and v > 0),
                 f"{name} must be a positive integer or None, got {v!r}")
        need(isinstance(self.extra_args, list) and all(isinstance(a, str) for a in self.extra_args),
             f"extra_args must be a list of strings, got {self.extra_args!r}")
        need(self.device in ("cuda", "cpu"), f"device must be cuda or cpu, got {self.device!r}")
        need(self.max_total_tokens is None or (isinstance(self.max_total_tokens, int)
                                               and self.max_total_tokens > 0),
             f"max_total_tokens must be a positive integer or None, got {self.max_total_tokens!r}")
        need(isinstance(self.extra_env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.extra_env.items()),
             f"extra_env must map names to strings, got {self.extra_env!r}")

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
        env = {**os.environ, **self.extra_env, **(CPU_ENV if self.device == "cpu" else {})}
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
        return env

    def command(self, config_file: str | None = None) -> list[str]:
        """The argv that launches the server; `config_file`: the YAML file holding the API key
        (`SGLangServer` writes it), passed as `--config`. The key itself is never in argv."""
        argv = [self.python, "-m", "sglang.launch_server",
                "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port),
                "--tp-size", str(self.tp_size), "--ep-size", str(self.ep_size),
                "--dtype", self.dtype,
                *(["--quantization", self.quantization] if self.quantization else []),
                # lockstep needs token ids in and out, and the routes of every token.
                "--skip-tokenizer-init", "--enable-return-routed-experts"]
        opt = [("--mem-fraction-static", self.mem_fraction_static),
               ("--context-length", self.context_length),
               ("--sampling-mask-max-tokens", self.sampling_mask_max_tokens),
               ("--random-seed", self.random_seed),
               ("--weight-version", self.weight_version),
               ("--max-total-tokens", self.max_total_tokens or (
                   CPU_MAX_TOTAL_TOKENS if self.device == "cpu" else None)),
               ("--config", config_file)]
        for flag, v in opt:
            if v is not None:
                argv += [flag, str(v)]
        if self.enable_fp32_lm_head:
            argv.append("--enable-fp32-lm-head")
        if self.enable_deterministic_inference:
            argv.append("--enable-deterministic-inference")
        if self.enable_return_indexer_topk:
            argv.append("--enable-return-indexer-topk")
        if self.device == "cpu":
            argv += CPU_FLAGS
        return argv + list(self.extra_args)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that spawned it dies (Linux)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_GUARD = """
import os, signal, sys, time
signal.signal(signal.SIGHUP, lambda *a: os.killpg(0, signal.SIGKILL))
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
if os.getppid() != int(sys.argv[1]):  # the spawning thread died before the death signal was set
    os.killpg(0, signal.SIGKILL)
while True:
    time.sleep(3600)
"""
"""The group guard of a server that must die with its parent: the leader of the server's process
group, told by the kernel (SIGHUP, PR_SET_PDEATHSIG) when the thread that started it dies, and
then killing the whole group. A death signal on the server alone does not reach what the server
started: vLLM's EngineCore and its workers outlive a killed API server (seen on the CPU tier:
orphaned engine cores of 1.7 GB each, for 20 minutes and more)."""


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone already
        pass


def _guard_before_exec() -> None:
    os.setpgid(0, 0)  # a process group of its own, in our session (the server joins it)
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG


class SGLangServer:
    """A running SGLang process: `with SGLangServer(cfg) as srv: srv.update_weights(dir)`.
    The server runs in a process group of its own, and `stop` ends the whole group (also when
    the server itself has died and left children behind). `die_with_parent`: the group is
    killed when the thread that started it dies (the fleet's Ray actors: a killed actor must not
    leave its server, or the server's children, running; `_GUARD`). Linux only."""

    def __init__(self, cfg: SGLangConfig, log_path: str | None = None,
                 die_with_parent: bool = False):
        self.cfg = cfg
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.guard: subprocess.Popen | None = None  # the group's guard (die_with_parent)
        self.pgid: int | None = None

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

    NAME = "SGLang"

    def start(self, timeout_s: float = 900.0) -> "SGLangServer":
        """Spawn the server (own process group) and block until `/health` answers 200. The
        API key goes in a private YAML file (`--config`, SGLang reads it at start-up), removed
        once the server is up or has failed: it is not in `ps` or in the environment. SGLang
        still logs it among its `server_args` (the log file is created mode 0600)."""
        key_dir = config = None
        if self.cfg.api_key:
            key_dir = tempfile.mkdtemp(prefix="lockstep-sglang-")  # mode 0700
            config = os.path.join(key_dir, "api_key.yaml")
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"api-key: {json.dumps(self.cfg.api_key)}\n")  # JSON string = YAML
        try:
            return self._spawn(self.cfg.command(config), timeout_s)
        finally:
            if key_dir is not None:
                shutil.rmtree(key_dir, ignore_errors=True)

    def _spawn(self, argv: list[str], timeout_s: float) -> "SGLangServer":
        """Start `argv` in its own process group with `cfg.env()`, logging to `log_path`
        (mode 0600), and wait for /health; stopped again when that fails."""
        if self.log_path:
            out = os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                    0o600), "ab")
        else:
            out = subprocess.DEVNULL
        try:
            if self.die_with_parent:
                self.guard = subprocess.Popen(
                    [sys.executable, "-E", "-S", "-c", _GUARD, str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, preexec_fn=_guard_before_exec)
                self.pgid = self.guard.pid
                self.proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=self._env(),
                    process_group=self.pgid, preexec_fn=_die_with_parent)
            else:
                self.proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT,
                    env=self._env(), start_new_session=True)
                self.pgid = self.proc.pid
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop(grace_s=5.0)
            raise
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        return self

    def _env(self) -> dict[str, str]:
        """The server process's environment."""
        return self.cfg.env()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SGLangError(f"{self.NAME} exited with code {self.proc.returncode} before it was "
                                  f"healthy; command: {' '.join(self.cfg.command())}; "
                                  f"log {self.log_path or '(not kept)'} ends:\n{self._log_tail()}")
            try:
                status, _ = self._request("GET", "/health", timeout=5.0)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise SGLangError(f"{self.NAME} at {self.cfg.url} not healthy within {timeout_s:g}s "
                          f"(start-up timeout); log {self.log_path or '(not kept)'} ends:\n"
                          f"{self._log_tail()}")

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
        """End the server's process group: SIGTERM and `grace_s` for the server to exit, then
        SIGKILL for whatever is left of the group (SGLang's scheduler and detokenizer, vLLM's
        EngineCore and workers, the guard), also when the server had died already."""
        if self.proc is None or self.pgid is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.pgid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.pgid, signal.SIGKILL)
        self.proc.wait()
        if self.guard is not None:
            self.guard.wait()
        self.pgid = None  # swept once: the number may name another group later

    def __enter__(self) -> "SGLangServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
