"""The experiment configuration as strict pydantic v2 models: one model per section.

Every field has a one-line docstring (the model's field description), its bounds as field
constraints and its variants as Literal / Enum choices; unknown keys are refused
(`extra="forbid"`) and values keep their YAML types (strict: `1.5` is not an integer, `yes` is
not a boolean). The sections that belong to a lower folder (`model`, `task`, `reward`, `data`,
`loss`, `correction`, `actor.megatron`, `rollout.sglang`) stay the dataclasses their code uses;
`dataclass_section` (trainer/section_types.py, with the shared building blocks) reads them
through a strict model built from the dataclass's own fields,
so they are checked the same way. Reading YAML, `--set` overrides and the one-line error
messages are in trainer/config.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from lockstep.kernels.dtypes import ENGINE_PRECISIONS, PRECISIONS
from lockstep.moe.config import ConfigError, ModelConfig
from lockstep.rollout.env import EnvConfig
from lockstep.rollout.rewards import RewardConfig
from lockstep.rollout.sglang_options import SGLangOptions
from lockstep.rollout.tasks import Task, TaskConfig
from lockstep.rollout.types import GREEDY_TEMPERATURE
from lockstep.trainer.correction import CorrectionConfig
from lockstep.trainer.correction_presets import expand_preset
from lockstep.trainer.data import DataConfig
from lockstep.trainer.losses import LossConfig
from lockstep.trainer.lr_trigger import LRTriggerConfig
from lockstep.trainer.megatron.model import MegatronOptions  # no megatron-core import
from lockstep.trainer.section_replay import (PartialReplayConfig, ReplayConfig,  # noqa: F401
                                             check_replay)
from lockstep.trainer.section_types import (ExperimentConfigError, Float, Section,  # noqa: F401
                                            dataclass_section, need, plain)


# why a bound is what it is, added to the message of a value outside it
BOUND_REASONS = {"rollout.temperature": (
    f"below {GREEDY_TEMPERATURE} an engine samples greedily (SGLang's rule) and reports "
    "temperature-1 log-probs, which the actor would compare with tempered ones")}

Dtype = Literal[PRECISIONS]  # our spellings in the one dtype table (kernels/dtypes.py)
EngineDtype = Literal[ENGINE_PRECISIONS]  # the same plus "fp8" (bf16 with block-FP8 matmuls)
RolloutBackend = Literal["embedded", "http", "ray", "serve", "sglang"]
WeightSync = Literal["auto", "distributed", "tensor", "disk", "object_store"]
# weight_sync values each rollout backend takes
WEIGHT_SYNC_OF: dict[str, tuple[str, ...]] = {
    "embedded": ("auto",), "ray": ("auto", "object_store"),
    "http": ("auto", "distributed", "tensor", "disk"),
    "serve": ("auto", "distributed", "disk"), "sglang": ("auto", "distributed", "disk")}


class RolloutConfig(Section):
    """The rollout engine: how many samples per step and how they are drawn."""

    prompts_per_step: int = Field(32, ge=1, le=1 << 20)
    """Distinct prompts per RL step."""
    samples_per_prompt: int = Field(8, ge=2, le=1 << 12)
    """Samples per prompt (the GRPO group size; one sample gives zero advantage, no signal)."""
    temperature: Float = Field(1.0, ge=GREEDY_TEMPERATURE, le=100.0)
    """Sampling temperature, at least rollout.types.GREEDY_TEMPERATURE (below it an engine
    samples greedily, as SGLang does); rollout log-probs are of the tempered distribution."""
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = whole vocabulary)."""
    sampling_mask_replay: bool | None = None
    """Record each token's kept candidate set and have the actor recompute log-probs over it
    (rollout log-probs := the engine's truncated, renormalised `sampling_logprobs`). None = on
    exactly when sampling is truncated (top_p < 1 or top_k set); truncated sampling with false
    is refused (TIS/IcePop would see a ratio biased by the kept mass)."""
    max_new_tokens: int | None = Field(None, ge=1, le=1 << 20)
    """Response length cap; None = the task's own cap."""
    dtype: EngineDtype = "bf16"
    """Engine compute dtype (the train/infer mismatch comes from here); fp8: bf16 with every
    attention/MLP/expert matmul in block FP8 (e4m3, 128x128 weight blocks, 1x128 activation
    groups; docs/precision.md)."""
    router_dtype: Dtype | None = None
    """Engine router dtype; None = same as dtype."""
    lm_head_dtype: Dtype | None = None
    """Engine LM-head dtype; None = same as dtype."""
    backend: RolloutBackend = "embedded"
    """embedded: our engine in this process; http: SGLang-compatible server(s) at `url` or
    `urls`; ray: `num_engines` embedded engines as Ray actors (extra 'ray';
    lockstep.rollout.fleet, Fleet.ray); serve / sglang: a fleet of `num_engines` lockstep / real
    SGLang servers launched as Ray actors behind one balancing client (lockstep.rollout.fleet)."""
    num_engines: int = Field(1, ge=1, le=1 << 12)
    """ray, serve, sglang backends: engines, one bundle each in a placement group."""
    ray_address: str | None = None
    """ray backend: cluster to join (None: RAY_ADDRESS, else the one `ray start` began on this
    machine, else a new local one)."""
    max_engine_restarts: int = Field(3, ge=0, le=1 << 20)
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
    request_timeout_s: Float = Field(600.0, gt=0.0)
    """A request or weight push not answered in this time fails naming its engine; the fleet
    (serve, sglang, http with urls) then marks that engine dead, retries its requests on the
    others and relaunches it; the ray backend kills and replaces it (docs/ray.md, "Faults")."""
    weight_sync: WeightSync = "auto"
    """How each step's weights reach the engines (docs/rollout.md, "Weight sync"): http takes
    distributed (a gloo/NCCL group the server joins; no disk), tensor (safetensors over HTTP),
    disk (`weights_dir` + /update_weights_from_disk) or auto (distributed, else disk); ray takes
    object_store (= auto); embedded copies in process (auto)."""
    env: dataclass_section(EnvConfig) | None = None
    """Multi-turn trajectories: the env (or tool) answering each turn (docs/agent.md); null: one."""
    sglang: dataclass_section(SGLangOptions) = Field(default_factory=SGLangOptions)
    """How each SGLang server is launched (TP/EP sizes, memory, determinism): maps onto
    rollout/sglang.py's SGLangConfig (lockstep.rollout.sglang_options; docs/cluster.md)."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        need(self.backend != "http" or bool(self.url) or bool(self.urls),
             "rollout.backend=http needs rollout.url (the server's base URL) or rollout.urls")
        need(not (self.url and self.urls), "rollout.url and rollout.urls are both set; give "
             "one server as url or several as urls")
        valid_sync = WEIGHT_SYNC_OF[self.backend]
        need(self.weight_sync in valid_sync,
             f"rollout.weight_sync={self.weight_sync!r} does not apply to "
             f"rollout.backend={self.backend}; valid there: {list(valid_sync)}")
        need(self.top_k == -1 or self.top_k >= 1, f"rollout.top_k={self.top_k} must be -1 or >= 1")
        if self.sampling_mask_replay is False and self.truncates:
            fields = [f"rollout.{k}={getattr(self, k)!r}" for k in ("top_p", "top_k")
                      if getattr(self, k) != type(self).model_fields[k].default]
            raise ExperimentConfigError(
                f"{', '.join(fields)}: truncated sampling needs sampling-mask replay, but "
                "rollout.sampling_mask_replay=false; the trainer would compare full-vocabulary "
                "log-probs with those of the truncated distribution (an IS ratio biased by the "
                "kept mass). Leave rollout.sampling_mask_replay unset (or true), or sample the "
                "full distribution (top_p=1, top_k=-1)")
        return self

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


# MegatronOptions fields the megatron actor overwrites from ActorConfig (actor.options_for).
_MEGATRON_FROM_ACTOR = {"params_dtype": "actor.dtype", "router_dtype": "actor.router_dtype",
                        "aux_loss_coef": "actor.aux_loss_coef", "fp8": "actor.fp8"}


class ActorConfig(Section):
    """The trainer-side policy: backend, precision, optimiser and batching."""

    backend: Literal["torch", "megatron"] = "torch"
    """Training backend: our torch model, or megatron-core."""
    dtype: Dtype = "fp32"
    """Master-weight and compute dtype of the actor."""
    router_dtype: Dtype | None = None
    """Router dtype; None = same as dtype (the Megatron moe_router_dtype knob)."""
    lm_head_dtype: Dtype | None = None
    """LM-head dtype; None = same as dtype (the MiniMax-M1 fp32 head knob)."""
    fp8: bool = False
    """Run the forward's attention/MLP/expert matmuls in block FP8 as rollout.dtype=fp8 does
    (the same quantiser), with a straight-through backward into the actor.dtype master
    weights ("unified FP8" with rollout.dtype=fp8; docs/precision.md). Megatron backend: TE's
    blockwise FP8 recipe, GPU with transformer-engine only."""
    lr: Float = Field(3e-4, gt=0.0, le=1.0)
    """AdamW peak learning rate."""
    betas: list[Float] = Field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: Float = Field(0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    eps: Float = Field(1e-8, gt=0.0, le=1.0)
    """AdamW epsilon."""
    grad_clip: Float = Field(1.0, ge=0.0)
    """Max global grad norm (0 = no clipping)."""
    lr_schedule: Literal["constant", "cosine", "linear", "triggered"] = "constant"
    """LR after warm-up: constant, cosine or linear decay to min_lr_ratio * lr at loop.steps,
    or triggered: constant, cut by actor.lr_trigger when mismatch symptoms show."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warm-up, in optimiser steps."""
    min_lr_ratio: Float = Field(0.0, ge=0.0, le=1.0)
    """Final LR as a fraction of lr for decaying schedules."""
    epochs: int = Field(1, ge=1, le=100)
    """Passes over each RL batch (PPO epochs)."""
    mini_batch_size: int = Field(256, ge=1)
    """Sequences per optimiser step; must divide the rollout batch."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward (gradient accumulation); must divide mini_batch_size."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget per forward/backward (rows x their longest row): rows are packed by length
    into as few micro-batches as fit, replacing micro_batch_size; None = micro_batch_size rows."""
    logprob_chunk: int = Field(4096, ge=1)
    """Vocabulary chunk of the log-prob kernel (the [tokens, V] log-softmax is never built)."""
    aux_loss_coef: Float = Field(0.0, ge=0.0)
    """Weight of the load-balancing loss (0 = off)."""
    expert_bias_update_rate: Float = Field(0.0, ge=0.0)
    """Aux-loss-free balancing (DeepSeek-V3): after each optimiser step every MoE layer's
    e_score_correction_bias += rate * sign(mean load - load), the load counted over the routes
    the mini-batch ran (the replayed ones under R2/R3). Sigmoid-router models, torch backend;
    0 = off."""
    lr_trigger: LRTriggerConfig | None = None
    """lr_schedule=triggered only: the triggers, factor and cooldown (trainer/lr_trigger.py)."""
    megatron: dataclass_section(MegatronOptions) = Field(default_factory=MegatronOptions)
    """backend=megatron only: TP/EP/ETP layout, dispatcher, TE, recompute (docs/megatron.md)."""

    @model_validator(mode="after")
    def _check(self) -> ActorConfig:
        need(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
             f"actor.betas={self.betas} must be two numbers in [0, 1)")
        need(self.mini_batch_size % self.micro_batch_size == 0,
             f"actor.micro_batch_size={self.micro_batch_size} must divide "
             f"actor.mini_batch_size={self.mini_batch_size}")
        need((self.lr_schedule == "triggered") == (self.lr_trigger is not None),
             f"actor.lr_schedule={self.lr_schedule!r} with actor.lr_trigger "
             f"{'unset' if self.lr_trigger is None else 'set'}: the triggered schedule needs "
             "actor.lr_trigger (its thresholds), and only it takes one")
        need(self.expert_bias_update_rate == 0 or self.backend == "torch",
             f"actor.expert_bias_update_rate={self.expert_bias_update_rate} is implemented by "
             f"the torch actor only; actor.backend={self.backend!r}")
        default = MegatronOptions()
        for name, instead in _MEGATRON_FROM_ACTOR.items():
            need(getattr(self.megatron, name) == getattr(default, name),
                 f"actor.megatron.{name}={getattr(self.megatron, name)!r}: set {instead} "
                 f"instead (the megatron actor takes it from there)")
        changed = [f"actor.megatron.{f.name}={getattr(self.megatron, f.name)!r}"
                   for f in dataclasses.fields(MegatronOptions)
                   if getattr(self.megatron, f.name) != getattr(default, f.name)]
        need(self.backend == "megatron" or not changed,
             f"{', '.join(changed)}: actor.megatron options apply only to actor.backend="
             f"megatron, but actor.backend={self.backend!r}; drop them or set "
             "actor.backend=megatron")
        return self


class AdvantageConfig(Section):
    """GRPO advantages: rewards centred within each prompt's group of samples."""

    norm_by_std: bool = True
    """Divide by the group's reward std (False = Dr. GRPO: centre only)."""


class WarmstartConfig(Section):
    """Supervised warm start on task demonstrations, so RL starts from a policy that sometimes
    succeeds; the result is cached on disk keyed by a hash of model, task and this section."""

    enabled: bool = True
    """Run (or load from the cache) the warm start before RL."""
    target_accuracy: Float = Field(0.30, ge=0.0, le=1.0)
    """Stop once greedy exact-match accuracy on held-out prompts reaches this."""
    lr: Float = Field(5e-3, gt=0.0, le=1.0)
    """AdamW learning rate of the warm start."""
    batch_size: int = Field(64, ge=1)
    """Demonstrations per step."""
    max_steps: int = Field(3000, ge=1)
    """Give up (keep the model) after this many steps."""
    eval_every: int = Field(25, ge=1)
    """Steps between greedy evaluations."""
    eval_size: int = Field(256, ge=1)
    """Held-out prompts per evaluation."""
    cache_dir: str = "~/.cache/lockstep/warmstart"
    """Where warm-started checkpoints are cached (HF folders)."""


class WandbConfig(Section):
    """Weights & Biases logging of the run (trainer/wandb_log.py; extra 'wandb')."""

    project: str = Field(min_length=1)
    """W&B project the run is logged to."""
    name: str | None = None
    """Display name of the W&B run (None = W&B picks one)."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online = upload as it runs; offline = files only (`wandb sync` later); disabled."""


class LoopConfig(Section):
    """The RL step loop: length, seeding, outputs."""

    steps: int = Field(100, ge=1)
    """RL steps to run."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seeds model init, problem stream, sampling and everything else."""
    checkpoint_every: int = Field(25, ge=0)
    """Save a resumable checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=0)
    """Newest checkpoints kept on disk (0 = keep all)."""
    out_dir: str = "runs/default"
    """Run directory (metrics.jsonl, tensorboard/, checkpoints/, plots); --out overrides it."""
    tensorboard: bool = True
    """Also write TensorBoard event files under out_dir/tensorboard."""
    plots: bool = True
    """Write reward / flip-rate / k3_kl PNG plots into out_dir at the end."""
    dump_every: int = Field(0, ge=0)
    """Write every N-th step's samples to out_dir/dumps/step_<n>.safetensors (0 = never);
    `lockstep diagnose --dump FILE` reads them (docs/diagnose.md)."""
    val_every: int = Field(0, ge=0, le=2**31 - 1)
    """Score data.val_files every N steps, logged as val/... (0 = never), in [0, 2^31)."""
    wandb: WandbConfig | None = None
    """Also log every metric row, the plots and the config to Weights & Biases, e.g.
    `{project: moe-rl, name: r3, mode: offline}` (None = no W&B)."""
    max_staleness: int = Field(0, ge=0, le=64)
    """Async rollout (docs/training.md): 0 = synchronous, step n samples with the weights of
    step n-1's update; k >= 1 = the engines generate the next steps' samples while the actor
    trains, so a step's samples may come from up to k versions before the current one
    (exactly k once the pipeline is full). k >= 1 keeps k earlier weight versions on CPU."""


class ClusterConfig(Section):
    """Where the actor runs: in this process (1 rank) or as a Ray actor group (docs/cluster.md)."""

    actor_ranks: int = Field(1, ge=1, le=4096)
    """Actor ranks. 1 = in this process, without Ray; N > 1 = N Ray actors in one placement
    group forming one torch.distributed world (torch backend: data parallel)."""
    ray_address: str | None = None
    """Ray cluster to join (e.g. 'ray://head:10001' or 'auto'); None = start a local Ray for
    the run and shut it down after."""
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    """Device of the actor ranks and the embedded engine: auto = cuda when present."""
    threads_per_rank: int = Field(1, ge=1, le=1024)
    """torch threads of each actor rank (more than the cores per rank oversubscribes)."""
    weight_bucket_mb: Float = Field(256.0, gt=0.0)
    """Weights travel from the actor to the rollout engine and to checkpoints in buckets of
    at most this many MiB (one larger tensor is a bucket of its own)."""
    nodes: int = Field(1, ge=1, le=4096)
    """Machines of the cluster (`lockstep plan` lays the actor ranks and engines over them);
    training over more than one needs ray_address, the Ray cluster spanning them."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """GPUs per machine; 0 = no GPUs (every rank and engine on CPU bundles)."""
    gpu_memory_gib: Float | None = Field(None, gt=0.0, le=1 << 20)
    """Memory of one GPU in GiB (e.g. 79.6 for an 80 GB H100, 140 for an H200); `lockstep
    plan` refuses layouts whose estimate exceeds it; None = not checked."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: rollout engines on GPUs of their own; colocated: engines share the actor
    ranks' GPUs (the engines release their memory while the actor trains)."""
    gpus_per_engine: int | None = Field(None, ge=1, le=1024)
    """GPUs of one rollout engine; None = rollout.sglang.tp_size with rollout.backend=sglang
    (the embedded engines of the other backends run on CPU)."""

    @property
    def weight_bucket_bytes(self) -> int:
        return max(1, int(self.weight_bucket_mb * 2**20))


def _toy_model() -> ModelConfig:
    return ModelConfig(vocab_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model_on_toy(value: Any) -> Any:
    """A `model` mapping given in part keeps the toy model's vocabulary and special ids; the
    family fields stay unset, so `model_type: glm4_moe` gets GLM's defaults."""
    if isinstance(value, dict):
        return {**_toy_model().partial_dict(), **value}
    return value


def _correction_preset(value: Any) -> Any:
    """A `correction` mapping with `preset: NAME` as the preset's fields (the saved config
    records those); a given field that differs from the preset's is refused naming both."""
    if not isinstance(value, dict):
        return value
    try:
        return expand_preset(value)
    except ValueError as e:
        raise PydanticCustomError("section", "{error}", {"error": str(e)}) from None


# loss / correction options added later (issue 20); left out at their defaults
_LATER_KEYS = {"loss": (LossConfig, ("loss_mode", "unbiased_kl", "opsm_delta", "opsm_logprobs")),
               "correction": (CorrectionConfig, ("m2po_threshold",))}
# actor.megatron keys added after saved configs were pinned; left out at their defaults
_LATER_MEGATRON_KEYS = ("pipeline_layers", "context_parallel", "fp8")
# rollout keys of the fleet and its fault handling; left out at their defaults
_FLEET_KEYS = ("urls", "request_timeout_s", "max_engine_restarts")
# cluster keys `lockstep plan` reads; left out of saved configs and hashes at their defaults
_PLAN_KEYS = ("nodes", "gpus_per_node", "gpu_memory_gib", "placement", "gpus_per_engine")


class ExperimentConfig(Section):
    """A whole RL experiment."""

    model: Annotated[dataclass_section(ModelConfig), BeforeValidator(_model_on_toy)] = Field(
        default_factory=_toy_model)
    """Policy architecture (HF config.json fields; `model_type` picks the family, docs/model.md);
    random init under loop.seed."""
    task: dataclass_section(TaskConfig) = Field(default_factory=TaskConfig)
    """The synthetic verifiable task (unused when data.train_files is set)."""
    data: dataclass_section(DataConfig) = Field(default_factory=DataConfig)
    """Prompt data sets (verl columns) instead of the synthetic task: lockstep.trainer.data."""
    reward: dataclass_section(RewardConfig) = Field(default_factory=RewardConfig)
    """Reward function of data-set samples: lockstep.rollout.rewards."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout engine and sampling."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """Trainer-side policy and optimiser."""
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    """Routing replay mode."""
    correction: Annotated[dataclass_section(CorrectionConfig), BeforeValidator(_correction_preset)] = Field(
        default_factory=CorrectionConfig)
    """Rollout correction (IS/RS with verl rollout_corr semantics); `preset: NAME` expands to
    verl's `RolloutCorrectionConfig.NAME()` fields (trainer/correction_presets.py)."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """GRPO advantage estimation."""
    loss: dataclass_section(LossConfig) = Field(default_factory=LossConfig)
    """Policy loss (PPO clip / GSPO, aggregation, KL, entropy): lockstep.trainer.losses."""
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    """Supervised warm start before RL."""
    loop: LoopConfig = Field(default_factory=LoopConfig)
    """Step loop, checkpoints and outputs."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Actor ranks (in-process or a Ray actor group), devices, weight buckets."""

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        B = self.rollout.batch_size
        if self.actor.backend == "megatron":
            # refuses the model fields trainer/megatron does not map (naming each)
            from lockstep.trainer.megatron.model import check_supported
            try:
                check_supported(self.model)
            except ConfigError as e:
                need(False, str(e))
        need(B % self.actor.mini_batch_size == 0,
             f"actor.mini_batch_size={self.actor.mini_batch_size} must divide the rollout batch "
             f"rollout.prompts_per_step * rollout.samples_per_prompt = {B}")
        c, sg = self.cluster, self.rollout.sglang
        need(c.gpus_per_engine in (None, sg.tp_size) or self.rollout.backend != "sglang",
             f"cluster.gpus_per_engine={c.gpus_per_engine} but an SGLang server takes "
             f"rollout.sglang.tp_size={sg.tp_size} GPUs; drop cluster.gpus_per_engine")
        need(self.loop.val_every == 0 or bool(self.data.val_files),
             f"loop.val_every={self.loop.val_every} needs data.val_files")
        env = self.rollout.env
        need(env is None or env.turns_before_push == 0 or self.loop.max_staleness >= 1,
             f"rollout.env.turns_before_push={env and env.turns_before_push} generates turns "
             f"ahead of a weight push: it needs loop.max_staleness >= 1 (got "
             f"{self.loop.max_staleness})")
        check_replay(self)
        if self.data.enabled:
            self._check_data()
            return self
        need(self.reward == RewardConfig(),
             "the reward section applies to data sets (data.train_files); the synthetic task "
             "keeps its own exact-match reward")
        task = Task(self.task)
        need(not task.uses_tool or self.rollout.env is not None, f"task.name={self.task.name} "
             "calls a calculator between turns: it needs rollout.env (configs/toy_agent_r3.yaml)")
        need(self.model.vocab_size >= task.vocab_size,
             f"model.vocab_size={self.model.vocab_size} is smaller than the task tokenizer's "
             f"{task.vocab_size} tokens")
        for name, want in (("eos_token_id", task.eos_id), ("pad_token_id", task.pad_id),
                           ("bos_token_id", task.bos_id)):
            need(getattr(self.model, name) == want,
                 f"model.{name}={getattr(self.model, name)!r} must be the tokenizer's id {want}")
        return self

    def _check_data(self) -> None:
        """A data-set run: a pretrained folder with its tokenizer, no synthetic warm start."""
        need(bool(self.model.path),
             "data.train_files needs model.path: an HF folder whose tokenizer (and chat "
             "template) tokenises the prompts")
        need(not self.warmstart.enabled,
             "warmstart.enabled=true: the warm start trains on the synthetic task's "
             "demonstrations, not on data.train_files; set warmstart.enabled=false (the "
             "policy starts from model.path)")
        need(self.rollout.max_new_tokens is not None,
             "data.train_files needs rollout.max_new_tokens (the response length cap)")
        need(self.model.eos_token_id is not None,
             f"{self.model.path}: config.json has no eos_token_id (generation must stop)")
        longest = self.data.max_prompt_length + self.rollout.max_new_tokens
        need(longest <= self.model.max_position_embeddings,
             f"data.max_prompt_length + rollout.max_new_tokens = {longest} exceeds the model's "
             f"max_position_embeddings={self.model.max_position_embeddings}")

    def to_dict(self) -> dict[str, Any]:
        """Every section; a default `cluster` (one in-process actor) and an unset
        `actor.lr_trigger` are left out, so saved configs and hashes read as before they
        existed."""
        d = plain(self)
        if self.cluster == ClusterConfig():
            d.pop("cluster")
        else:  # the plan's keys at their defaults: as before they existed (runs resume)
            for k in _PLAN_KEYS:
                if d["cluster"][k] == ClusterConfig.model_fields[k].default:
                    d["cluster"].pop(k)
        if self.actor.lr_trigger is None:  # as before the triggered schedule existed
            d["actor"].pop("lr_trigger")
        if self.rollout.sglang == SGLangOptions():
            d["rollout"].pop("sglang")
        else:  # rollout.sglang keys added later, at their defaults: as before they existed
            for k in ("max_total_tokens", "bind", "extra_env"):
                if d["rollout"]["sglang"][k] == getattr(SGLangOptions(), k):
                    d["rollout"]["sglang"].pop(k)
        for k in ("weight_sync", "env", *_FLEET_KEYS):  # at defaults: saved as before they existed
            if d["rollout"][k] == RolloutConfig.model_fields[k].default:
                d["rollout"].pop(k)
        if d["reward"]["import_timeout_s"] == RewardConfig.import_timeout_s:  # likewise
            d["reward"].pop("import_timeout_s")
        if self.loop.wandb is None:  # likewise
            d["loop"].pop("wandb")
        d["correction"].pop("preset")  # always None here: a preset is saved as its fields
        for section, (cls, keys) in _LATER_KEYS.items():  # at defaults: saved as before they existed
            for k in keys:
                if d[section][k] == cls.__dataclass_fields__[k].default:
                    d[section].pop(k)
        if not self.actor.fp8:  # likewise
            d["actor"].pop("fp8")
        # replay options at their defaults: as before they existed
        for k in ("gates", "check", "min_overlap", "partial", "bias_meter_rows"):
            if d["replay"][k] == ReplayConfig.model_fields[k].default:
                d["replay"].pop(k)
        for k in _LATER_MEGATRON_KEYS:  # likewise
            if d["actor"]["megatron"][k] == getattr(MegatronOptions(), k):
                d["actor"]["megatron"].pop(k)
        return d

    def hash(self, *sections: str) -> str:
        """Short stable hash of the named sections (all when none), e.g. for caches.
        A default `actor.megatron` and an unset `rollout.sampling_mask_replay` are left out (a
        default `cluster` and an unset `actor.lr_trigger` too, by `to_dict`), so configs hash
        as they did before they existed (runs written then still resume); any other value
        changes the hash."""
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
        for k in ("check", "min_overlap"):  # the validator checks; it changes no numbers
            d["replay"].pop(k, None)
        if self.model.path is None:
            d["model"].pop("path")
        for name, default in (("data", DataConfig()), ("reward", RewardConfig())):
            if getattr(self, name) == default:
                d.pop(name)
        d = {k: d[k] for k in (sections or d)}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
