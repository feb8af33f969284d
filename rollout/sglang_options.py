"""The `rollout.sglang` config section: how every SGLang server of the rollout fleet is
launched, mapped onto `lockstep.rollout.sglang.SGLangConfig` (whose `command()` is the argv).

    rollout:
      dtype: bf16                # -> --dtype bfloat16 (one knob for every engine kind)
      lm_head_dtype: fp32        # -> --enable-fp32-lm-head
      num_engines: 2
      sglang:
        tp_size: 4               # -> --tp-size 4: GPUs per server
        ep_size: 4               # -> --ep-size 4 (divides tp_size)
        mem_fraction_static: 0.85
        deterministic_inference: false

`--skip-tokenizer-init` and `--enable-return-routed-experts` are always passed (lockstep sends
token ids and needs the routes of every token); the server's seed is `loop.seed`; with
`cluster.device: cpu` the servers run SGLang's CPU engine (`sglang.CPU_FLAGS`). Nothing here
imports SGLang or reads the experiment config: `lockstep.trainer.driver.sglang_servers` maps an
experiment onto these options (what the fleet launches and what `lockstep plan` prints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lockstep.moe.checks import need as _need


def check(cond: bool, msg: str) -> None:
    """A bad rollout.sglang value: ValueError with the message (the config names the key)."""
    _need(cond, msg, ValueError)


@dataclass
class SGLangOptions:
    """Launch options of each SGLang server (rollout.backend=sglang; `lockstep plan` prints
    the commands). dtype and the fp32 LM head come from rollout.dtype / rollout.lm_head_dtype."""

    tp_size: int = 1
    """--tp-size: tensor-parallel GPUs per server (the GPUs one engine takes)."""
    ep_size: int = 1
    """--ep-size: expert-parallel size inside those GPUs; must divide tp_size."""
    mem_fraction_static: float | None = None
    """--mem-fraction-static: share of each GPU's memory for weights + KV cache, in (0, 1);
    None = SGLang's default (0.9). Colocated with the actor it must leave the actor's room."""
    context_length: int | None = None
    """--context-length: longest prompt + response a server accepts; None = the model's
    max_position_embeddings."""
    deterministic_inference: bool = False
    """--enable-deterministic-inference: batch-invariant kernels (slower); without it runs over
    SGLang are not bit-reproducible and per-request seeds are ignored."""
    sampling_mask_max_tokens: int | None = None
    """--sampling-mask-max-tokens: largest kept candidate set returned for sampling-mask replay
    (SGLang's default 4096); truncated sampling needs rollout.top_k at most this."""
    max_total_tokens: int | None = field(default=None, metadata={"saved": "non_default"})
    """--max-total-tokens: KV-cache size in tokens per server; None = SGLang's own sizing on
    GPUs, 8192 with cluster.device=cpu (SGLang would take a share of the machine's free RAM)."""
    startup_timeout_s: float = 900.0
    """Seconds the fleet waits for its servers: for their placement-group bundles, and for
    each server to load the model and answer /health (also a relaunched one)."""
    bind: Literal["auto", "loopback", "node"] = field(default="auto", metadata={"saved": "non_default"})
    """Address the servers listen on: loopback = 127.0.0.1 (only this machine reaches them;
    needs a one-node Ray cluster), node = the Ray node's IP; auto = loopback when the Ray
    cluster has one node, else node."""
    python: str | None = None
    """Interpreter that has sglang installed (checked before launching); None = the one
    running lockstep."""
    extra_args: list[str] = field(default_factory=list)
    """Appended verbatim to every server's command line (e.g. ["--cuda-graph-max-bs", "256"])."""
    extra_env: list[str] = field(default_factory=list, metadata={"saved": "non_default"})
    """`NAME=VALUE` entries: environment variables set for every server process over the
    inherited ones (e.g. PYTHONPATH for packages SGLang's venv lacks, SGLANG_* switches)."""

    def __post_init__(self) -> None:
        p = "rollout.sglang."
        for name in ("tp_size", "ep_size"):
            v = getattr(self, name)
            check(isinstance(v, int) and 1 <= v <= 1024,
                   f"{p}{name}={v!r} must be an integer in [1, 1024]")
        check(self.tp_size % self.ep_size == 0,
               f"{p}ep_size={self.ep_size} must divide {p}tp_size={self.tp_size} (SGLang lays "
               "expert parallelism inside the tensor-parallel GPUs)")
        check(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
               f"{p}mem_fraction_static={self.mem_fraction_static!r} must be in (0, 1)")
        for name in ("context_length", "sampling_mask_max_tokens", "max_total_tokens"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"{p}{name}={v!r} must be a positive integer or null")
        check(self.startup_timeout_s > 0,
               f"{p}startup_timeout_s={self.startup_timeout_s} must be > 0")
        check(self.python is None or bool(self.python.strip()),
               f"{p}python must be an interpreter path or null, got {self.python!r}")
        check(self.bind in ("auto", "loopback", "node"),
               f"{p}bind={self.bind!r} must be auto, loopback or node")
        bad = [e for e in self.extra_env if not (isinstance(e, str) and e.partition("=")[0]
                                                   and "=" in e)]
        check(not bad, f"{p}extra_env entries must be NAME=VALUE, got {bad}")
        bad = [a for a in self.extra_args if a in _OWN_FLAGS]
        check(not bad, f"{p}extra_args {bad}: set by lockstep from the config "
                        f"({', '.join(_OWN_FLAGS[a] for a in bad)}); drop them")


# Flags the command builder sets itself, with the config key each comes from.
_OWN_FLAGS = {"--model-path": "model.path", "--tp-size": "rollout.sglang.tp_size",
              "--tp": "rollout.sglang.tp_size", "--ep-size": "rollout.sglang.ep_size",
              "--ep": "rollout.sglang.ep_size", "--dtype": "rollout.dtype",
              "--quantization": "rollout.dtype: fp8",
              "--port": "the fleet (a free port per server)", "--host": "the fleet",
              "--mem-fraction-static": "rollout.sglang.mem_fraction_static",
              "--random-seed": "loop.seed",
              "--enable-fp32-lm-head": "rollout.lm_head_dtype: fp32",
              "--enable-deterministic-inference": "rollout.sglang.deterministic_inference",
              "--device": "cluster.device", "--max-total-tokens": "rollout.sglang.max_total_tokens",
              "--api-key": "the fleet (a fresh key per run)",
              "--config": "the fleet (the file that carries the API key)"}

# rollout.sglang keys the fleet uses itself (not SGLangConfig fields)
FLEET_KEYS = ("startup_timeout_s", "bind")
