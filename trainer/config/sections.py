"""The experiment configuration as strict pydantic v2 models: one model per section.

Every field has a one-line docstring (the model's field description), its bounds as field
constraints and its variants as Literal / Enum choices; unknown keys are refused
(`extra="forbid"`) and values keep their YAML types (strict: `1.5` is not an integer, `yes` is
not a boolean). The sections that belong to a lower folder (`model`, `task`, `reward`, `data`,
`loss`, `correction`, `actor.megatron`, `rollout.sglang`) stay the dataclasses their code uses;
`dataclass_section` (trainer/config/types.py, with the shared building blocks) reads them
through a strict model built from the dataclass's own fields,
so they are checked the same way. Reading YAML, `--set` overrides and the one-line error
messages are in trainer/config/load.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from lockstep.kernels.dtypes import ENGINE_PRECISIONS, PRECISIONS
from lockstep.rollout.backends import BACKENDS
from lockstep.rollout.env import EnvConfig
from lockstep.rollout.mismatch import MismatchConfig
from lockstep.rollout.seeds import MAX_LOOP_SEED, MAX_STEPS
from lockstep.rollout.sglang_options import SGLangOptions
from lockstep.rollout.vllm_options import VLLMOptions
from lockstep.rollout.types import GREEDY_TEMPERATURE
from lockstep.trainer.config.megatron import MegatronOptions  # no megatron-core import
from lockstep.trainer.config.types import (dataclass_section, ExperimentConfigError, Float,
                                           HASHED_LATER, LATER, need, NOT_HASHED, Section)


# why a bound is what it is, added to the message of a value outside it
BOUND_REASONS = {"rollout.temperature": (
    f"below {GREEDY_TEMPERATURE} an engine samples greedily (SGLang's rule) and reports "
    "temperature-1 log-probs, which the actor would compare with tempered ones")}

Dtype = Literal[PRECISIONS]  # our spellings in the one dtype table (kernels/dtypes.py)
EngineDtype = Literal[ENGINE_PRECISIONS]  # the same plus "fp8" (bf16 with block-FP8 matmuls)
RolloutBackend = Literal[tuple(BACKENDS)]
WeightSync = Literal[tuple(dict.fromkeys(s for b in BACKENDS.values() for s in b.weight_syncs))]


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
    sampling_mask_replay: bool | None = Field(None, json_schema_extra=HASHED_LATER)
    """Record each token's kept candidate set and have the actor recompute log-probs over it
    (rollout log-probs := the engine's truncated, renormalised `sampling_logprobs`). None = on
    exactly when sampling is truncated (top_p < 1 or top_k set); truncated sampling with false
    is refused (TIS/IcePop would see a ratio biased by the kept mass)."""
    max_new_tokens: int | None = Field(None, ge=1, le=1 << 20)
    """Response length cap; None = the task's own cap, or in a data run the model's context
    left after the longest prompt (max_position_embeddings - data.max_prompt_length)."""
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
    lockstep.rollout.fleet, Fleet.ray); serve / sglang / vllm: a fleet of `num_engines` lockstep /
    real SGLang / real vLLM servers launched as Ray actors behind one balancing client
    (lockstep.rollout.fleet)."""
    num_engines: int = Field(1, ge=1, le=1 << 12)
    """ray, serve, sglang, vllm backends: engines, one bundle each in a placement group."""
    ray_address: str | None = None
    """ray backend: cluster to join (None: RAY_ADDRESS, else the one `ray start` began on this
    machine, else a new local one)."""
    max_engine_restarts: int = Field(3, ge=0, le=1 << 20, json_schema_extra={**LATER, **NOT_HASHED})
    """Restarts of a dead or hung engine allowed per engine per run; past it the run stops with
    a RolloutError naming the engine (0: the first engine failure stops the run)."""
    routes_by_reference: bool = Field(False, json_schema_extra=LATER)
    """ray backend with an actor group: each sample's routes stay in the object store of the
    node that generated them; the driver gets refs, each actor rank fetches its rows' routes
    (docs/cluster.md "Routes by reference")."""
    url: str | None = None
    """http backend: server base URL, e.g. http://127.0.0.1:30000."""
    urls: list[str] | None = Field(None, json_schema_extra=LATER)
    """http backend: several running servers behind one balancing client (lockstep.rollout.fleet)
    instead of `url`."""
    engine: Literal["auto", "sglang", "vllm"] = Field("auto", json_schema_extra={**LATER, **NOT_HASHED})
    """http backend: the wire the server(s) at url/urls speak: sglang (SGLang's /generate: real
    SGLang or lockstep serve), vllm (vLLM 0.32's /inference/v1/generate and its native weight
    sync; docs/rollout.md "vLLM"), or auto (asked of the first server's /server_info once, and
    said in the log)."""
    api_key_file: str | None = Field(None, json_schema_extra=NOT_HASHED)
    """http backend: file holding the server's bearer token (first line). The token itself is
    never part of the config (it would be saved in config.yaml and show in `ps`): it comes from
    this file, else the LOCKSTEP_API_KEY environment variable (`rollout_api_key`)."""
    weights_dir: str | None = None
    """http backend: folder shared with the server for weight pushes (None = out_dir/weights)."""
    request_timeout_s: Float = Field(600.0, gt=0.0, json_schema_extra={**LATER, **NOT_HASHED})
    """A request or weight push not answered in this time fails naming its engine; the fleet
    (serve, sglang, http with urls) then marks that engine dead, retries its requests on the
    others and relaunches it; the ray backend kills and replaces it (docs/ray.md, "Faults")."""
    weight_sync: WeightSync = Field("auto", json_schema_extra={**LATER, **NOT_HASHED})
    """How each step's weights reach the engines (docs/rollout.md, "Weight sync"): http takes
    distributed (a gloo/NCCL group the server joins; no disk), tensor (safetensors over HTTP),
    disk (`weights_dir` + /update_weights_from_disk) or auto (distributed, else disk); ray takes
    object_store (= auto); embedded copies in process (auto)."""
    env: dataclass_section(EnvConfig) | None = Field(None, json_schema_extra=LATER)
    """Multi-turn trajectories: the env (or tool) answering each turn (docs/agent.md); null: one."""
    sglang: dataclass_section(SGLangOptions) = Field(default_factory=SGLangOptions, json_schema_extra=LATER)
    """How each SGLang server is launched (TP/EP sizes, memory, determinism): maps onto
    rollout/sglang.py's SGLangConfig (lockstep.rollout.sglang_options; docs/cluster.md)."""
    vllm: dataclass_section(VLLMOptions) = Field(default_factory=VLLMOptions, json_schema_extra=LATER)
    """rollout.backend=vllm: how each vLLM server is launched (TP size, expert parallelism,
    memory, its interpreter): maps onto rollout/vllm.py's VLLMConfig
    (lockstep.rollout.vllm_options; docs/rollout.md "vLLM")."""
    exact: bool = Field(False, json_schema_extra=LATER)
    """Exact mode: the engine and the torch actor run batch-invariant kernels (kernels/exact.py)
    so the engine's log-probs and routes are bitwise the actor's (k3 KL and flip rate exactly
    0); needs actor.dtype = rollout.dtype (docs/precision.md "Exact mode")."""
    mismatch: dataclass_section(MismatchConfig) | None = Field(None, json_schema_extra=LATER)
    """Injected engine-side mismatch (rollout/mismatch.py): router_flip_rate (calibrated
    target), router_noise (fixed), logprob_noise, calibrate_every; null = none."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        need(self.backend != "http" or bool(self.url) or bool(self.urls),
             "rollout.backend=http needs rollout.url (the server's base URL) or rollout.urls")
        need(not (self.url and self.urls), "rollout.url and rollout.urls are both set; give "
             "one server as url or several as urls")
        valid_sync = BACKENDS[self.backend].weight_syncs
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
class LRTriggerConfig(Section):
    """actor.lr_schedule=triggered: when and by how much the LR is cut."""

    factor: Float = Field(0.5, gt=0.0, lt=1.0)
    """Multiply the LR by this at every trigger."""
    length_growth: Float | None = Field(None, gt=0.0)
    """Trigger when the mean response length grows faster than this fraction of itself per
    step (least-squares slope over length_window steps / their mean length); None = off."""
    length_window: int = Field(10, ge=2, le=10_000)
    """Steps the length growth is measured over (it is measured once the window is full)."""
    k3_kl: Float | None = Field(None, gt=0.0)
    """Trigger when the step's k3 KL between pi_old and mu_old (rollout_corr/k3_kl) passes
    this; None = off."""
    flip_rate: Float | None = Field(None, gt=0.0, le=1.0)
    """Trigger when the step's routing flip rate (routing/flip_rate: rollout routes vs the
    trainer's natural top-k) passes this; None = off."""
    cooldown: int = Field(10, ge=0, le=MAX_STEPS)
    """Steps after a trigger during which no other fires."""
    min_scale: Float = Field(0.0, ge=0.0, lt=1.0)
    """The LR multiplier never goes below this (0 = no floor)."""

    @model_validator(mode="after")
    def _check(self) -> LRTriggerConfig:
        need(self.enabled_causes(), "actor.lr_trigger: set at least one of length_growth, "
             "k3_kl, flip_rate (each null = that trigger off)")
        return self

    def enabled_causes(self) -> dict[str, float]:
        """cause -> threshold of the triggers that are on."""
        return {k: v for k, v in (("length_growth", self.length_growth), ("k3_kl", self.k3_kl),
                                  ("flip_rate", self.flip_rate)) if v is not None}


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
    fp8: bool = Field(False, json_schema_extra=LATER)
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
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    """Linear LR warm-up, in optimiser steps."""
    min_lr_ratio: Float = Field(0.0, ge=0.0, le=1.0)
    """Final LR as a fraction of lr for decaying schedules."""
    epochs: int = Field(1, ge=1, le=100)
    """Passes over each RL batch (PPO epochs)."""
    mini_batch_size: int = Field(256, ge=1, le=1 << 20)
    """Sequences per optimiser step; must divide the rollout batch."""
    micro_batch_size: int = Field(64, ge=1, le=1 << 20)
    """Sequences per forward/backward (gradient accumulation); must divide mini_batch_size."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1, le=1 << 31)
    """Token budget per forward/backward (rows x their longest row): rows are packed by length
    into as few micro-batches as fit, replacing micro_batch_size; None = micro_batch_size rows."""
    logprob_chunk: int = Field(4096, ge=1, le=1 << 31)
    """Vocabulary chunk of the log-prob kernel (the [tokens, V] log-softmax is never built)."""
    aux_loss_coef: Float = Field(0.0, ge=0.0)
    """Weight of the load-balancing loss (0 = off)."""
    expert_bias_update_rate: Float = Field(0.0, ge=0.0)
    """Aux-loss-free balancing (DeepSeek-V3): after each optimiser step every MoE layer's
    e_score_correction_bias += rate * sign(mean load - load), the load counted over the routes
    the mini-batch ran (the replayed ones under R2/R3). Sigmoid-router models, torch backend;
    0 = off."""
    lr_trigger: LRTriggerConfig | None = Field(None, json_schema_extra=LATER)
    """lr_schedule=triggered only: the triggers, factor and cooldown (trainer/driver/lr_trigger.py)."""
    megatron: dataclass_section(MegatronOptions) = Field(default_factory=MegatronOptions, json_schema_extra=HASHED_LATER)
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
    """Run (or load from the cache) the warm start before RL; unset in a data run: false (it
    trains on the synthetic task; the policy starts from model.path)."""
    target_accuracy: Float = Field(0.30, ge=0.0, le=1.0)
    """Stop once greedy exact-match accuracy on held-out prompts reaches this."""
    lr: Float = Field(5e-3, gt=0.0, le=1.0)
    """AdamW learning rate of the warm start."""
    batch_size: int = Field(64, ge=1, le=1 << 20)
    """Demonstrations per step."""
    max_steps: int = Field(3000, ge=1, le=MAX_STEPS)
    """Give up (keep the model) after this many steps."""
    eval_every: int = Field(25, ge=1, le=MAX_STEPS)
    """Steps between greedy evaluations."""
    eval_size: int = Field(256, ge=1, le=1 << 20)
    """Held-out prompts per evaluation."""
    cache_dir: str = "~/.cache/lockstep/warmstart"
    """Where warm-started checkpoints are cached (HF folders)."""


class WandbConfig(Section):
    """Weights & Biases logging of the run (trainer/observe/wandb_log.py; extra 'wandb')."""

    project: str = Field(min_length=1)
    """W&B project the run is logged to."""
    name: str | None = None
    """Display name of the W&B run (None = W&B picks one)."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online = upload as it runs; offline = files only (`wandb sync` later); disabled."""


class LoopConfig(Section):
    """The RL step loop: length, seeding, outputs."""

    steps: int = Field(100, ge=1, le=MAX_STEPS)
    """RL steps to run."""
    seed: int = Field(0, ge=0, le=MAX_LOOP_SEED)
    """Seeds model init, problem stream, sampling and everything else, in [0, 2^31)
    (sampling seeds stay int64 for all of them: rollout/seeds.py)."""
    checkpoint_every: int = Field(25, ge=0, le=MAX_STEPS)
    """Save a resumable checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=0, le=MAX_STEPS)
    """Newest checkpoints kept on disk (0 = keep all)."""
    out_dir: str = "runs/default"
    """Run directory (metrics.jsonl, tensorboard/, checkpoints/, plots); --out overrides it."""
    tensorboard: bool = True
    """Also write TensorBoard event files under out_dir/tensorboard."""
    plots: bool = True
    """Write reward / flip-rate / k3_kl PNG plots into out_dir at the end."""
    dump_every: int = Field(0, ge=0, le=MAX_STEPS)
    """Write every N-th step's samples to out_dir/dumps/step_<n>.safetensors (0 = never);
    `lockstep diagnose --dump FILE` reads them (docs/diagnose.md)."""
    val_every: int = Field(0, ge=0, le=MAX_STEPS)
    """Score data.val_files every N steps, logged as val/... (0 = never), in [0, 2^31)."""
    wandb: WandbConfig | None = Field(None, json_schema_extra=LATER)
    """Also log every metric row, the plots and the config to Weights & Biases, e.g.
    `{project: moe-rl, name: r3, mode: offline}` (None = no W&B)."""
    max_staleness: int = Field(0, ge=0, le=64, json_schema_extra=HASHED_LATER)
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
    nodes: int = Field(1, ge=1, le=4096, json_schema_extra=LATER)
    """Machines of the cluster (`lockstep plan` lays the actor ranks and engines over them);
    training over more than one needs ray_address, the Ray cluster spanning them."""
    gpus_per_node: int = Field(0, ge=0, le=64, json_schema_extra=LATER)
    """GPUs per machine; 0 = no GPUs (every rank and engine on CPU bundles)."""
    gpu_memory_gib: Float | None = Field(None, gt=0.0, le=1 << 20, json_schema_extra=LATER)
    """Memory of one GPU in GiB (e.g. 79.6 for an 80 GB H100, 140 for an H200); `lockstep
    plan` refuses layouts whose estimate exceeds it; None = not checked."""
    placement: Literal["disaggregated", "colocated"] = Field("disaggregated", json_schema_extra=LATER)
    """disaggregated: rollout engines on GPUs of their own; colocated: engines share the actor
    ranks' GPUs (the engines release their memory while the actor trains)."""
    gpus_per_engine: int | None = Field(None, ge=1, le=1024, json_schema_extra=LATER)
    """GPUs of one rollout engine; None = rollout.sglang.tp_size with rollout.backend=sglang
    (the embedded engines of the other backends run on CPU)."""
    cpus_per_node: int = Field(0, ge=0, le=1 << 16, json_schema_extra=LATER)
    """CPUs per machine for CPU bundles (no GPUs): `lockstep plan` lays the CPU actor ranks
    and then the engines node by node by it; 0 = Ray chooses each bundle's node."""
    node_label: str | None = Field(None, min_length=1, max_length=63, json_schema_extra=LATER)
    """Ray node label whose value is the plan's node index (`ray start
    --labels='{"lockstep-node": "0"}'`): every actor-rank and engine bundle is pinned to the
    node `lockstep plan` gives it; None = Ray chooses (PACK)."""

    @property
    def weight_bucket_bytes(self) -> int:
        return max(1, int(self.weight_bucket_mb * 2**20))


@dataclass
class DataConfig:
    """Prompt data sets (verl's columns); empty train_files = the synthetic `task` section."""

    train_files: list[str] | str = field(default_factory=list)
    """JSONL (.jsonl) or Parquet (.parquet) files of training prompts, concatenated in order;
    one file may be given as a string (as verl's configs write it), read as a list of one."""
    val_files: list[str] | str = field(default_factory=list)
    """Validation prompts (same format, a string or a list), scored every loop.val_every steps."""
    max_prompt_length: int | None = 512
    """Prompts longer than this many tokens (after the chat template) are dropped, in [1, 2^20];
    unset in a data run (None): the longest prompt of the data, within the model's context
    (minus rollout.max_new_tokens where given, else half of it), said in the log."""
    shuffle: bool = True
    """Visit the training prompts in a new seeded order each epoch (False: file order)."""
    val_samples: int = 1
    """Samples per validation prompt, in [1, 1024]: 1 = greedy; n > 1 = sampled at
    rollout.temperature, reported as mean reward and pass@n."""

    def __post_init__(self) -> None:
        for key in ("train_files", "val_files"):
            if isinstance(getattr(self, key), str):
                setattr(self, key, [getattr(self, key)])
            for f in getattr(self, key):
                if not str(f).endswith((".jsonl", ".parquet")):
                    raise ValueError(f"data.{key}: {f!r} is neither .jsonl nor .parquet")
        if self.val_files and not self.train_files:
            raise ValueError("data.val_files is set but data.train_files is empty")
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length <= 1 << 20:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} is outside "
                             "[1, 1048576]")
        if not 1 <= self.val_samples <= 1024:
            raise ValueError(f"data.val_samples={self.val_samples} is outside [1, 1024]")

    @property
    def enabled(self) -> bool:
        return bool(self.train_files)

    def prompt_cap(self, max_new_tokens: int | None, context: int) -> int:
        """Prompts longer than this are dropped: max_prompt_length, or unset, what the model's
        `context` leaves after rollout.max_new_tokens (unset too: half the context)."""
        if self.max_prompt_length is not None:
            return self.max_prompt_length
        return context - max_new_tokens if max_new_tokens is not None else max(1, context // 2)
