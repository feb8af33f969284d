"""Typed experiment configuration: one dataclass tree, read from YAML with dotted overrides.

Every field has a one-line docstring and is checked when the file is read (types, bounds,
choices); unknown keys are rejected with the list of valid ones, naming the dotted path:

    cfg = load_config("configs/toy_r3.yaml", overrides=["actor.lr=1e-4", "replay.mode=off"])

Sections: `model` (HF Qwen3-MoE fields, or `path` to an HF folder), `task`, `data` (prompt data
sets), `reward`, `rollout` (engine), `actor`, `replay`, `correction` (rollout correction, verl
semantics), `advantage`, `loss`, `warmstart`, `loop`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from lockstep.moe.config import ModelConfig, need
from lockstep.replay import ReplayMode
from lockstep.rollout.rewards import RewardConfig
from lockstep.rollout.sglang_options import SGLangOptions
from lockstep.rollout.tasks import Task, TaskConfig
from lockstep.trainer.correction import CorrectionConfig
from lockstep.trainer.data import DataConfig
from lockstep.trainer.losses import LossConfig
from lockstep.trainer.megatron.model import MegatronOptions  # no megatron-core import

Dtype = Literal["bf16", "fp16", "fp32"]


class ExperimentConfigError(ValueError):
    """An experiment YAML file or override that does not describe a valid experiment."""


def _need(cond: bool, msg: str) -> None:
    need(cond, msg, ExperimentConfigError)


def _in(section: str, obj: Any, name: str, lo: float | None = None, hi: float | None = None,
        lo_open: bool = False) -> None:
    """Check `lo <= obj.name <= hi` (or `lo < ...` when lo_open); the message names the key."""
    v = getattr(obj, name)
    ok = (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
    lo_s = "" if lo is None else f"{'(' if lo_open else '['}{lo}, "
    hi_s = "" if hi is None else f"{hi}]"
    _need(ok, f"{section}.{name}={v!r} is outside {lo_s or '(-inf, '}{hi_s or 'inf)'}")


@dataclass
class RolloutConfig:
    """The rollout engine: how many samples per step and how they are drawn."""

    prompts_per_step: int = 32
    """Distinct prompts per RL step."""
    samples_per_prompt: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; rollout log-probs are of the tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = whole vocabulary)."""
    sampling_mask_replay: bool | None = None
    """Record each token's kept candidate set and have the actor recompute log-probs over it
    (rollout log-probs := the engine's truncated, renormalised `sampling_logprobs`). None = on
    exactly when sampling is truncated (top_p < 1 or top_k set); truncated sampling with false
    is refused (TIS/IcePop would see a ratio biased by the kept mass)."""
    max_new_tokens: int | None = None
    """Response length cap; None = the task's own cap."""
    dtype: Dtype = "bf16"
    """Engine compute dtype (the train/infer mismatch comes from here)."""
    router_dtype: Dtype | None = None
    """Engine router dtype; None = same as dtype."""
    lm_head_dtype: Dtype | None = None
    """Engine LM-head dtype; None = same as dtype."""
    backend: Literal["embedded", "http", "ray", "serve", "sglang"] = "embedded"
    """embedded: our engine in this process; http: SGLang-compatible server(s) at `url` or
    `urls`; ray: `num_engines` embedded engines as Ray actors (extra 'ray';
    lockstep.rollout.ray_backend); serve / sglang: a fleet of `num_engines` lockstep / real
    SGLang servers launched as Ray actors behind one balancing client (lockstep.rollout.fleet)."""
    num_engines: int = 1
    """ray, serve, sglang backends: engines, one bundle each in a placement group."""
    ray_address: str | None = None
    """ray backend: cluster to join (None: RAY_ADDRESS, else the one `ray start` began on this
    machine, else a new local one)."""
    max_engine_restarts: int = 3
    """Restarts of a dead or hung engine allowed per engine per run; past it the run stops with
    a RolloutError naming the engine (0: the first engine failure stops the run)."""
    url: str | None = None
    """http backend: server base URL, e.g. http://127.0.0.1:30000."""
    urls: list[str] | None = None
    """http backend: several running servers behind one balancing client (lockstep.rollout.fleet)
    instead of `url`."""
    api_key_file: str | None = None
    """http backend: file holding the server's bearer token (first line). The token itself is
    never part of the config (it would be saved in config.yaml and show in `ps`): it comes from
    this file, else the LOCKSTEP_API_KEY environment variable (`rollout_api_key`)."""
    weights_dir: str | None = None
    """http backend: folder shared with the server for weight pushes (None = out_dir/weights)."""
    request_timeout_s: float = 600.0
    """A request or weight push not answered in this time fails naming its engine; the fleet
    (serve, sglang, http with urls) then marks that engine dead, retries its requests on the
    others and relaunches it; the ray backend kills and replaces it (docs/ray.md, "Faults")."""
    weight_sync: Literal["auto", "distributed", "tensor", "disk", "object_store"] = "auto"
    """How each step's weights reach the engines (docs/rollout.md, "Weight sync"): http takes
    distributed (a gloo/NCCL group the server joins; no disk), tensor (safetensors over HTTP),
    disk (`weights_dir` + /update_weights_from_disk) or auto (distributed, else disk); ray takes
    object_store (= auto); embedded copies in process (auto)."""
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    """How each SGLang server is launched (TP/EP sizes, memory, determinism): maps onto
    rollout/sglang.py's SGLangConfig (lockstep.rollout.sglang_options; docs/cluster.md)."""

    def __post_init__(self) -> None:
        _need(self.backend != "http" or bool(self.url) or bool(self.urls),
              "rollout.backend=http needs rollout.url (the server's base URL) or rollout.urls")
        _need(not (self.url and self.urls), "rollout.url and rollout.urls are both set; give "
              "one server as url or several as urls")
        _in("rollout", self, "num_engines", 1, 1 << 12)
        _in("rollout", self, "request_timeout_s", 0.0, lo_open=True)
        valid_sync = {"embedded": ("auto",), "ray": ("auto", "object_store"),
                      "http": ("auto", "distributed", "tensor", "disk"),
                      "serve": ("auto", "distributed", "disk"),
                      "sglang": ("auto", "distributed", "disk")}.get(self.backend)
        _need(valid_sync is None or self.weight_sync in valid_sync,
              f"rollout.weight_sync={self.weight_sync!r} does not apply to "
              f"rollout.backend={self.backend}; valid there: {list(valid_sync or ())}")
        _in("rollout", self, "max_engine_restarts", 0, 1 << 20)
        _in("rollout", self, "prompts_per_step", 1, 1 << 20)
        # GRPO normalises rewards within a group: one sample gives zero advantage, no signal.
        _in("rollout", self, "samples_per_prompt", 2, 1 << 12)
        _in("rollout", self, "temperature", 0.0, 100.0, lo_open=True)
        _in("rollout", self, "top_p", 0.0, 1.0, lo_open=True)
        _need(self.top_k == -1 or self.top_k >= 1, f"rollout.top_k={self.top_k} must be -1 or >= 1")
        if self.sampling_mask_replay is False and self.truncates:
            fields = [f"rollout.{k}={getattr(self, k)!r}" for k in ("top_p", "top_k")
                      if getattr(self, k) != getattr(RolloutConfig, k)]
            raise ExperimentConfigError(
                f"{', '.join(fields)}: truncated sampling needs sampling-mask replay, but "
                "rollout.sampling_mask_replay=false; the trainer would compare full-vocabulary "
                "log-probs with those of the truncated distribution (an IS ratio biased by the "
                "kept mass). Leave rollout.sampling_mask_replay unset (or true), or sample the "
                "full distribution (top_p=1, top_k=-1)")
        if self.max_new_tokens is not None:
            _in("rollout", self, "max_new_tokens", 1, 1 << 20)

    @property
    def batch_size(self) -> int:
        """Sequences per step."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def truncates(self) -> bool:
        """True when top-p / top-k can drop candidates (the temperature is always > 0)."""
        return self.top_p < 1.0 or self.top_k != -1

    @property
    def mask_replay(self) -> bool:
        """Whether the loop records sampling masks and replays them in the actor."""
        return self.truncates if self.sampling_mask_replay is None else self.sampling_mask_replay


@dataclass
class ActorConfig:
    """The trainer-side policy: backend, precision, optimiser and batching."""

    backend: Literal["torch", "megatron"] = "torch"
    """Training backend: our torch model, or megatron-core."""
    dtype: Dtype = "fp32"
    """Master-weight and compute dtype of the actor."""
    router_dtype: Dtype | None = None
    """Router dtype; None = same as dtype (the Megatron moe_router_dtype knob)."""
    lm_head_dtype: Dtype | None = None
    """LM-head dtype; None = same as dtype (the MiniMax-M1 fp32 head knob)."""
    lr: float = 3e-4
    """AdamW peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global grad norm (0 = no clipping)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """LR after warm-up: constant, cosine or linear decay to min_lr_ratio * lr at loop.steps."""
    warmup_steps: int = 0
    """Linear LR warm-up, in optimiser steps."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of lr for decaying schedules."""
    epochs: int = 1
    """Passes over each RL batch (PPO epochs)."""
    mini_batch_size: int = 256
    """Sequences per optimiser step; must divide the rollout batch."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation); must divide mini_batch_size."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget per forward/backward (rows x their longest row): rows are packed by length
    into as few micro-batches as fit, replacing micro_batch_size; None = micro_batch_size rows."""
    logprob_chunk: int = 4096
    """Vocabulary chunk of the log-prob kernel (the [tokens, V] log-softmax is never built)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (0 = off)."""
    expert_bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): after each optimiser step every MoE layer's
    e_score_correction_bias += rate * sign(mean load - load), the load counted over the routes
    the mini-batch ran (the replayed ones under R2/R3). Sigmoid-router models, torch backend;
    0 = off."""
    megatron: MegatronOptions = field(default_factory=MegatronOptions)
    """backend=megatron only: TP/EP/ETP layout, dispatcher, TE, recompute (docs/megatron.md)."""

    def __post_init__(self) -> None:
        _in("actor", self, "lr", 0.0, 1.0, lo_open=True)
        _need(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
              f"actor.betas={self.betas} must be two numbers in [0, 1)")
        _in("actor", self, "weight_decay", 0.0, 1.0)
        _in("actor", self, "eps", 0.0, 1.0, lo_open=True)
        _in("actor", self, "grad_clip", 0.0)
        _in("actor", self, "warmup_steps", 0)
        _in("actor", self, "min_lr_ratio", 0.0, 1.0)
        _in("actor", self, "epochs", 1, 100)
        _in("actor", self, "mini_batch_size", 1)
        _in("actor", self, "micro_batch_size", 1)
        _need(self.mini_batch_size % self.micro_batch_size == 0,
              f"actor.micro_batch_size={self.micro_batch_size} must divide "
              f"actor.mini_batch_size={self.mini_batch_size}")
        _in("actor", self, "logprob_chunk", 1)
        if self.max_tokens_per_micro_batch is not None:
            _in("actor", self, "max_tokens_per_micro_batch", 1)
        _in("actor", self, "aux_loss_coef", 0.0)
        _in("actor", self, "expert_bias_update_rate", 0.0)
        _need(self.expert_bias_update_rate == 0 or self.backend == "torch",
              f"actor.expert_bias_update_rate={self.expert_bias_update_rate} is implemented by "
              f"the torch actor only; actor.backend={self.backend!r}")
        default = MegatronOptions()
        for name, instead in _MEGATRON_FROM_ACTOR.items():
            _need(getattr(self.megatron, name) == getattr(default, name),
                  f"actor.megatron.{name}={getattr(self.megatron, name)!r}: set {instead} "
                  f"instead (the megatron actor takes it from there)")
        changed = [f"actor.megatron.{f.name}={getattr(self.megatron, f.name)!r}"
                   for f in dataclasses.fields(MegatronOptions)
                   if getattr(self.megatron, f.name) != getattr(default, f.name)]
        _need(self.backend == "megatron" or not changed,
              f"{', '.join(changed)}: actor.megatron options apply only to actor.backend="
              f"megatron, but actor.backend={self.backend!r}; drop them or set "
              "actor.backend=megatron")


# MegatronOptions fields the megatron actor overwrites from ActorConfig (actor.options_for).
_MEGATRON_FROM_ACTOR = {"params_dtype": "actor.dtype", "router_dtype": "actor.router_dtype",
                        "aux_loss_coef": "actor.aux_loss_coef"}


@dataclass
class ReplayConfig:
    """Routing replay: which routes the actor's forwards run."""

    mode: ReplayMode = ReplayMode.R3
    """off: actor routes freely; R2: updates replay the actor's own old-logprob routes;
    R3: old-logprob and update forwards replay the rollout engine's routes."""


@dataclass
class AdvantageConfig:
    """GRPO advantages: rewards centred within each prompt's group of samples."""

    norm_by_std: bool = True
    """Divide by the group's reward std (False = Dr. GRPO: centre only)."""


@dataclass
class WarmstartConfig:
    """Supervised warm start on task demonstrations, so RL starts from a policy that sometimes
    succeeds; the result is cached on disk keyed by a hash of model, task and this section."""

    enabled: bool = True
    """Run (or load from the cache) the warm start before RL."""
    target_accuracy: float = 0.30
    """Stop once greedy exact-match accuracy on held-out prompts reaches this."""
    lr: float = 5e-3
    """AdamW learning rate of the warm start."""
    batch_size: int = 64
    """Demonstrations per step."""
    max_steps: int = 3000
    """Give up (keep the model) after this many steps."""
    eval_every: int = 25
    """Steps between greedy evaluations."""
    eval_size: int = 256
    """Held-out prompts per evaluation."""
    cache_dir: str = "~/.cache/lockstep/warmstart"
    """Where warm-started checkpoints are cached (HF folders)."""

    def __post_init__(self) -> None:
        _in("warmstart", self, "target_accuracy", 0.0, 1.0)
        _in("warmstart", self, "lr", 0.0, 1.0, lo_open=True)
        _in("warmstart", self, "batch_size", 1)
        _in("warmstart", self, "max_steps", 1)
        _in("warmstart", self, "eval_every", 1)
        _in("warmstart", self, "eval_size", 1)


@dataclass
class LoopConfig:
    """The RL step loop: length, seeding, outputs."""

    steps: int = 100
    """RL steps to run."""
    seed: int = 0
    """Seeds model init, problem stream, sampling and everything else."""
    checkpoint_every: int = 25
    """Save a resumable checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk (0 = keep all)."""
    out_dir: str = "runs/default"
    """Run directory (metrics.jsonl, tensorboard/, checkpoints/, plots); --out overrides it."""
    tensorboard: bool = True
    """Also write TensorBoard event files under out_dir/tensorboard."""
    plots: bool = True
    """Write reward / flip-rate / k3_kl PNG plots into out_dir at the end."""
    dump_every: int = 0
    """Write every N-th step's samples to out_dir/dumps/step_<n>.safetensors (0 = never);
    `lockstep diagnose --dump FILE` reads them (docs/diagnose.md)."""
    val_every: int = 0
    """Score data.val_files every N steps, logged as val/... (0 = never), in [0, 2^31)."""
    max_staleness: int = 0
    """Async rollout (docs/training.md): 0 = synchronous, step n samples with the weights of
    step n-1's update; k >= 1 = the engines generate the next steps' samples while the actor
    trains, so a step's samples may come from up to k versions before the current one
    (exactly k once the pipeline is full). k >= 1 keeps k earlier weight versions on CPU."""

    def __post_init__(self) -> None:
        _in("loop", self, "steps", 1)
        _in("loop", self, "max_staleness", 0, 64)
        _in("loop", self, "val_every", 0, 2**31 - 1)
        _in("loop", self, "seed", 0, 2**31 - 1)
        _in("loop", self, "checkpoint_every", 0)
        _in("loop", self, "keep_checkpoints", 0)
        _in("loop", self, "dump_every", 0)


@dataclass
class ClusterConfig:
    """Where the actor runs: in this process (1 rank) or as a Ray actor group (docs/cluster.md)."""

    actor_ranks: int = 1
    """Actor ranks. 1 = in this process, without Ray; N > 1 = N Ray actors in one placement
    group forming one torch.distributed world (torch backend: data parallel)."""
    ray_address: str | None = None
    """Ray cluster to join (e.g. 'ray://head:10001' or 'auto'); None = start a local Ray for
    the run and shut it down after."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """Device of the actor ranks and the embedded engine: auto = cuda when present."""
    threads_per_rank: int = 1
    """torch threads of each actor rank (more than the cores per rank oversubscribes)."""
    weight_bucket_mb: float = 256.0
    """Weights travel from the actor to the rollout engine and to checkpoints in buckets of
    at most this many MiB (one larger tensor is a bucket of its own)."""
    nodes: int = 1
    """Machines of the cluster (`lockstep plan` lays the actor ranks and engines over them)."""
    gpus_per_node: int = 0
    """GPUs per machine; 0 = no GPUs (every rank and engine on CPU bundles)."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (e.g. 79.6 for an 80 GB H100, 140 for an H200); `lockstep
    plan` refuses layouts whose estimate exceeds it; None = not checked."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: rollout engines on GPUs of their own; colocated: engines share the actor
    ranks' GPUs (the engines release their memory while the actor trains)."""
    gpus_per_engine: int | None = None
    """GPUs of one rollout engine; None = rollout.sglang.tp_size with rollout.backend=sglang
    (the embedded engines of the other backends run on CPU)."""

    def __post_init__(self) -> None:
        _in("cluster", self, "actor_ranks", 1, 4096)
        _in("cluster", self, "threads_per_rank", 1, 1024)
        _in("cluster", self, "weight_bucket_mb", 0.0, lo_open=True)
        _in("cluster", self, "nodes", 1, 4096)
        _in("cluster", self, "gpus_per_node", 0, 64)
        if self.gpu_memory_gib is not None:
            _in("cluster", self, "gpu_memory_gib", 0.0, 1 << 20, lo_open=True)
        if self.gpus_per_engine is not None:
            _in("cluster", self, "gpus_per_engine", 1, 1024)

    @property
    def weight_bucket_bytes(self) -> int:
        return max(1, int(self.weight_bucket_mb * 2**20))


@dataclass
class ExperimentConfig:
    """A whole RL experiment."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        vocab_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    """Policy architecture (HF config.json fields; `model_type` picks the family, docs/model.md);
    random init under loop.seed."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The synthetic verifiable task (unused when data.train_files is set)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data sets (verl columns) instead of the synthetic task: lockstep.trainer.data."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function of data-set samples: lockstep.rollout.rewards."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engine and sampling."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Trainer-side policy and optimiser."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Routing replay mode."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Rollout correction (IS/RS with verl rollout_corr semantics)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """GRPO advantage estimation."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss (PPO clip / GSPO, aggregation, KL, entropy): lockstep.trainer.losses."""
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    """Supervised warm start before RL."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """Step loop, checkpoints and outputs."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Actor ranks (in-process or a Ray actor group), devices, weight buckets."""

    def __post_init__(self) -> None:
        B = self.rollout.batch_size
        if self.actor.backend == "megatron":
            # refuses the model fields trainer/megatron does not map (naming each)
            from lockstep.moe.config import ConfigError
            from lockstep.trainer.megatron.model import check_supported
            try:
                check_supported(self.model)
            except ConfigError as e:
                _need(False, str(e))
        _need(B % self.actor.mini_batch_size == 0,
              f"actor.mini_batch_size={self.actor.mini_batch_size} must divide the rollout batch "
              f"rollout.prompts_per_step * rollout.samples_per_prompt = {B}")
        c, sg = self.cluster, self.rollout.sglang
        _need(c.gpus_per_engine in (None, sg.tp_size) or self.rollout.backend != "sglang",
              f"cluster.gpus_per_engine={c.gpus_per_engine} but an SGLang server takes "
              f"rollout.sglang.tp_size={sg.tp_size} GPUs; drop cluster.gpus_per_engine")
        _need(self.loop.val_every == 0 or bool(self.data.val_files),
              f"loop.val_every={self.loop.val_every} needs data.val_files")
        if self.data.enabled:
            self._check_data()
            return
        _need(self.reward == RewardConfig(),
              "the reward section applies to data sets (data.train_files); the synthetic task "
              "keeps its own exact-match reward")
        task = Task(self.task)
        _need(self.model.vocab_size >= task.vocab_size,
              f"model.vocab_size={self.model.vocab_size} is smaller than the task tokenizer's "
              f"{task.vocab_size} tokens")
        for name, want in (("eos_token_id", task.eos_id), ("pad_token_id", task.pad_id),
                           ("bos_token_id", task.bos_id)):
            _need(getattr(self.model, name) == want,
                  f"model.{name}={getattr(self.model, name)!r} must be the tokenizer's id {want}")

    def _check_data(self) -> None:
        """A data-set run: a pretrained folder with its tokenizer, no synthetic warm start."""
        _need(bool(self.model.path),
              "data.train_files needs model.path: an HF folder whose tokenizer (and chat "
              "template) tokenises the prompts")
        _need(not self.warmstart.enabled,
              "warmstart.enabled=true: the warm start trains on the synthetic task's "
              "demonstrations, not on data.train_files; set warmstart.enabled=false (the "
              "policy starts from model.path)")
        _need(self.rollout.max_new_tokens is not None,
              "data.train_files needs rollout.max_new_tokens (the response length cap)")
        _need(self.model.eos_token_id is not None,
              f"{self.model.path}: config.json has no eos_token_id (generation must stop)")
        longest = self.data.max_prompt_length + self.rollout.max_new_tokens
        _need(longest <= self.model.max_position_embeddings,
              f"data.max_prompt_length + rollout.max_new_tokens = {longest} exceeds the model's "
              f"max_position_embeddings={self.model.max_position_embeddings}")

    def to_dict(self) -> dict[str, Any]:
        """Every section; a default `cluster` (one in-process actor) is left out, so saved
        configs and hashes read as before the section existed."""
        d = dataclasses.asdict(self)
        if self.cluster == ClusterConfig():
            d.pop("cluster")
        else:  # the plan's keys at their defaults: as before they existed (runs resume)
            for k in _PLAN_KEYS:
                if d["cluster"][k] == getattr(ClusterConfig, k):
                    d["cluster"].pop(k)
        if self.rollout.sglang == SGLangOptions():
            d["rollout"].pop("sglang")
        for k in ("weight_sync", *_FLEET_KEYS):  # at defaults: saved as before they existed
            if d["rollout"][k] == getattr(RolloutConfig, k):
                d["rollout"].pop(k)
        return d

    def hash(self, *sections: str) -> str:
        """Short stable hash of the named sections (all when none), e.g. for caches.
        A default `actor.megatron` and an unset `rollout.sampling_mask_replay` are left out (a
        default `cluster` too, by `to_dict`), so configs hash as they did before they existed
        (runs written then still resume); any other value changes the hash."""
        d = self.to_dict()
        if self.actor.megatron == MegatronOptions():
            d["actor"].pop("megatron")
        else:  # megatron options added later are left out at their defaults, likewise
            for k in ("logprob_chunk_tokens", "virtual_pipeline_parallel"):
                if getattr(self.actor.megatron, k) == getattr(MegatronOptions(), k):
                    d["actor"]["megatron"].pop(k)
        if self.rollout.sampling_mask_replay is None:
            d["rollout"].pop("sampling_mask_replay")
        if self.loop.max_staleness == 0 and "loop" in d:  # synchronous runs hash as before
            d["loop"].pop("max_staleness", None)
        # where the API key is read from is not the run's identity; runs written while the key
        # itself was a (null) config field keep their hash
        d["rollout"].pop("api_key_file")
        for k in ("weight_sync", "request_timeout_s", "max_engine_restarts"):  # not the numbers
            d["rollout"].pop(k, None)
        d["rollout"]["api_key"] = None
        if self.model.path is None:
            d["model"].pop("path")
        for name, default in (("data", DataConfig()), ("reward", RewardConfig())):
            if getattr(self, name) == default:
                d.pop(name)
        d = {k: d[k] for k in (sections or d)}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


# rollout keys of the fleet and its fault handling; left out at their defaults
_FLEET_KEYS = ("urls", "request_timeout_s", "max_engine_restarts")
# cluster keys `lockstep plan` reads; left out of saved configs and hashes at their defaults
_PLAN_KEYS = ("nodes", "gpus_per_node", "gpu_memory_gib", "placement", "gpus_per_engine")


# -- reading -------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML 1.2 core-schema scalars: only true/false are booleans (so `mode: off` stays the
    string 'off'), `3e-4` is a number, and `1_5` / `1:30` stay strings (IcePop "1_5")."""


    def construct_mapping(self, node, deep=False):
        """Refuse duplicate keys (PyYAML silently keeps the last), naming key and lines."""
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:
                    continue  # unhashable: the base class raises its own error
                if first != key_node.start_mark.line + 1:
                    raise ExperimentConfigError(
                        f"duplicate key {key!r} at lines {first} and "
                        f"{key_node.start_mark.line + 1} (YAML would silently keep the last)")
        return super().construct_mapping(node, deep)


_STRICT = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in _STRICT]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (
        ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
        ("tag:yaml.org,2002:int", r"^[-+]?[0-9]+$", "-+0123456789"),
        ("tag:yaml.org,2002:float",
         r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
         r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+.0123456789")):
    _Loader.add_implicit_resolver(_tag, re.compile(_rx), list(_first))


_NUMBER = re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$")


def _yaml_load(text: str) -> Any:
    """Parse YAML text; any failure is an ExperimentConfigError (e.g. a bad date, deep nesting)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except ExperimentConfigError:
        raise
    except yaml.YAMLError as e:
        raise ExperimentConfigError(f"not valid YAML: {e}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise ExperimentConfigError(f"not valid YAML: {type(e).__name__}: {e}") from None


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Coerce a YAML value to the annotated type `tp`, or raise naming `where`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _convert(value, a, where)
            except ExperimentConfigError as e:
                errors.append(str(e))
        raise ExperimentConfigError(errors[0] if len(errors) == 1 else
                                    f"{where}={value!r} matches none of {args}")
    if origin is Literal:
        _need(value in args, f"{where}={value!r} is not one of {list(args)}")
        return value
    if _is_dataclass_type(tp):
        _need(isinstance(value, dict), f"{where} must be a mapping, got {value!r}")
        return build(tp, value, where)
    if origin in (list, tuple):
        _need(isinstance(value, (list, tuple)), f"{where} must be a list, got {value!r}")
        (item,) = args[:1] or (Any,)
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        _need(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        _need(isinstance(value, int) and not isinstance(value, bool),
              f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        # NOTE: YAML 1.1 reads `3e-4` (no dot) as a string; accept any numeric spelling.
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)
        _need(isinstance(value, (int, float)) and not isinstance(value, bool),
              f"{where} must be a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:
            raise ExperimentConfigError(f"{where}={value!r} is too large for a float") from None
    if tp is str:
        _need(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ExperimentConfigError(
                f"{where}={value!r} is not one of {[m.value for m in tp]}") from None
    raise ExperimentConfigError(f"{where}: unsupported field type {tp!r}")


def build(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, checking keys and types (recursively)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(str(k) for k in data if k not in names)
    prefix = f"{where}." if where else ""
    _need(not unknown, f"unknown key(s) {[prefix + k for k in unknown]}; valid keys"
                       f"{' in ' + where if where else ''} are {names}"
                       f"{_closest(unknown, names, prefix)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if (_is_dataclass_type(hints[f.name]) and isinstance(value, dict)
                and f.default_factory is not dataclasses.MISSING):
            # A section given in part keeps this tree's defaults for the rest (e.g. the toy
            # model's vocabulary and special ids), not those of the section class.
            # The model's family fields stay unset, so `model_type: glm4_moe` gets GLM's defaults.
            default = f.default_factory()
            value = {**(default.partial_dict() if isinstance(default, ModelConfig)
                        else dataclasses.asdict(default)), **value}
        kwargs[f.name] = _convert(value, hints[f.name], prefix + f.name)
    try:
        return cls(**kwargs)
    except ExperimentConfigError:
        raise
    except (ValueError, TypeError, ArithmeticError, KeyError, IndexError) as e:
        # a section's own validation (model, task, correction)
        raise ExperimentConfigError(f"{where or cls.__name__}: {e}") from None


def _closest(unknown: list[str], names: list[str], prefix: str) -> str:
    """'; did you mean 'a.b'?' for the valid key closest to each unknown one (none: '')."""
    import difflib

    near = [m[0] for k in unknown if (m := difflib.get_close_matches(k, names, n=1, cutoff=0.6))]
    return f"; did you mean {', '.join(repr(prefix + m) for m in near)}?" if near else ""


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a', 'b', 'c'], YAML-parsed value)."""
    key, sep, raw = text.partition("=")
    _need(bool(sep) and bool(key.strip()), f"override {text!r} must look like key.sub=value")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except ExperimentConfigError as e:
        raise ExperimentConfigError(f"override {text!r}: value is {e}") from None
    return key.strip().split("."), value


def _apply_override(data: dict[str, Any], path: list[str], value: Any, cls: type) -> None:
    node, tp = data, cls
    for i, part in enumerate(path):
        names = [f.name for f in dataclasses.fields(tp)] if _is_dataclass_type(tp) else []
        _need(part in names, f"override key {'.'.join(path)!r}: {part!r} is not a valid key of "
                             f"{'.'.join(path[:i]) or 'the config'}; valid keys are {names}"
                             f"{_closest([part], names, '.'.join(path[:i] + ['']))}")
        if i == len(path) - 1:
            node[part] = value
            return
        tp = typing.get_type_hints(tp)[part]
        node = node.setdefault(part, {})
        _need(isinstance(node, dict), f"override {'.'.join(path)}: {part} is not a section")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                ) -> ExperimentConfig:
    """Read an experiment YAML (None = all defaults) and apply `key.sub=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        _need(not path.is_dir(), f"{path} is a directory, not an experiment YAML file")
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ExperimentConfigError(f"no config file at {path}") from None
        except UnicodeDecodeError:
            raise ExperimentConfigError(f"{path} is not a text (UTF-8) file") from None
        except OSError as e:
            raise ExperimentConfigError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            data = _yaml_load(text)
        except ExperimentConfigError as e:
            raise ExperimentConfigError(f"{path}: {e}") from None
        _need(data is not None, f"{path} is empty (or only comments): refusing to start an "
                                f"all-defaults run; start from configs/toy_r3.yaml")
        _need(isinstance(data, dict), f"{path}: top level must be a mapping of sections")
    for text in overrides or []:
        key, value = parse_override(text)
        if key == ["rollout", "api_key"]:
            _refuse_secrets({"rollout": {"api_key": value or "?"}}, None)
        _apply_override(data, key, value, ExperimentConfig)
    _refuse_secrets(data, path)
    if isinstance(data.get("model"), dict) and data["model"].get("path") is not None:
        data["model"] = _model_from_folder(data["model"])
    try:
        return build(ExperimentConfig, data)
    except ExperimentConfigError as e:
        raise ExperimentConfigError(f"{path}: {e}" if path else str(e)) from None


def _refuse_secrets(data: dict[str, Any], path: Path | None) -> None:
    """`rollout.api_key` is not a config field: a key in a file or on the command line would be
    saved in DIR/config.yaml and visible in `ps`. (A null one, as in run directories written
    by older versions, is dropped.)"""
    ro = data.get("rollout")
    if isinstance(ro, dict) and "api_key" in ro:
        _need(ro["api_key"] is None,
              f"{str(path) + ': ' if path else ''}rollout.api_key: secrets are not taken from "
              f"config files or --set (they would be saved in the run directory and show in "
              f"`ps`); export LOCKSTEP_API_KEY or set rollout.api_key_file to a file holding it")
        ro.pop("api_key")


def rollout_api_key(ro: RolloutConfig) -> str | None:
    """The http backend's bearer token: the first line of `rollout.api_key_file`, else the
    LOCKSTEP_API_KEY environment variable, else None."""
    import os

    if ro.api_key_file:
        try:
            key = Path(ro.api_key_file).expanduser().read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ExperimentConfigError(f"rollout.api_key_file={ro.api_key_file!r}: cannot "
                                        f"read it ({getattr(e, 'strerror', None) or e})") from None
        _need(bool(key) and bool(key[0].strip()),
              f"rollout.api_key_file={ro.api_key_file!r} is empty")
        return key[0].strip()
    return os.environ.get("LOCKSTEP_API_KEY") or None


def _model_from_folder(section: dict[str, Any]) -> dict[str, Any]:
    """The `model` section of `model.path: DIR`: the fields of DIR/config.json; fields given
    next to `path` must equal the folder's (a saved config repeats them all)."""
    path = section["path"]
    _need(isinstance(path, str), f"model.path must be a string, got {path!r}")
    try:
        folder = dataclasses.asdict(ModelConfig.from_json(Path(path).expanduser()))
    except ValueError as e:
        raise ExperimentConfigError(f"model.path={path!r}: {e}") from None
    differ = [f"model.{k}={v!r} (the folder has {folder[k]!r})" for k, v in section.items()
              if k != "path" and k in folder and _plain(v) != _plain(folder[k])]
    _need(not differ, f"model.path={path!r} gives the architecture, but {', '.join(differ)}; "
                      "drop those keys")
    return {**section, **{k: v for k, v in folder.items() if k != "path"}}


def _plain(v: Any) -> Any:
    return json.loads(json.dumps(v))


def save_config(cfg: ExperimentConfig, path: str | Path) -> None:
    """Write the resolved config (atomically); `load_config` reads it back to an equal config.
    It holds no secret (see `rollout_api_key`)."""
    d = json.loads(json.dumps(cfg.to_dict(), default=lambda o: getattr(o, "value", str(o))))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a planted link there: replaced, never written through
    tmp.write_text(yaml.safe_dump(d, sort_keys=False))
    tmp.replace(path)
