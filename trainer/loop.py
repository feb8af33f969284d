"""The RL step loop: generate -> old log-probs (replay/record) -> rewards/advantages ->
rollout correction -> update -> sync weights, with metrics, checkpoints and exact resume.

`Trainer.step` is the whole algorithm on one screen; everything else is setup and bookkeeping.
Exact resume: problems, sampling seeds and mini-batch shuffles are pure functions of
(loop.seed, step), the engine is rebuilt from the checkpointed fp32 weights, and the optimiser,
LR schedule and RNG states are restored, so a resumed run logs the same metrics (timings
aside) as an uninterrupted one from the checkpointed step on.

Shapes: B = prompts_per_step x samples_per_prompt rows, T padded time, L MoE layers, K top-k.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from lockstep.moe.model import MoEModel
from lockstep.replay import old_logprob_plan, routing_divergence, update_plan
from lockstep.rollout.client import HTTPBackend, LocalBackend, RolloutBackend
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.tasks import Task
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor import Batch, LogprobResult, TorchActor, collate
from lockstep.trainer.checkpoint import LoopState, load_latest, save_checkpoint, set_rng_state
from lockstep.trainer.config import ExperimentConfig, save_config
from lockstep.trainer.correction import CorrectionResult, correct, is_split_metrics
from lockstep.trainer.dump import maybe_dump
from lockstep.trainer.losses import grpo_advantages, policy_loss
from lockstep.trainer.metrics import MetricsWriter, read_metrics, summarize, write_plots
from lockstep.trainer.warmstart import WarmstartResult, cache_key, warm_start


def run_hash(cfg: ExperimentConfig) -> str:
    """Hash of what determines a run's numbers: every section but `loop`, plus loop.seed (so
    loop.steps may be raised and outputs changed when resuming)."""
    probe = ExperimentConfig(**{**vars(cfg), "loop": type(cfg.loop)(seed=cfg.loop.seed)})
    return probe.hash()


def check_megatron_world(cfg: ExperimentConfig) -> None:
    """Refuse an `actor.megatron` layout the loop cannot run. The loop is one process (every
    rank would run its own engine and write the same run directory), so the megatron actor
    gets a world of one: tensor, expert and expert-tensor parallel sizes must all be 1."""
    import torch.distributed as dist

    if cfg.actor.backend != "megatron":
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != 1:
        raise ValueError(f"Trainer runs in one process, but torch.distributed has a world of "
                         f"{world}: multi-rank megatron (torchrun) is not supported by the loop")
    m = cfg.actor.megatron
    big = {k: v for k, v in (("tensor_parallel", m.tensor_parallel),
                             ("expert_parallel", m.expert_parallel),
                             ("expert_tensor_parallel", m.etp)) if v != 1}
    if big:
        raise ValueError(
            f"{', '.join(f'actor.megatron.{k}={v}' for k, v in big.items())}: the RL loop runs "
            "megatron-core in a world of one process, so every parallel size must be 1; "
            "multi-rank launch (torchrun) is not supported yet (docs/megatron.md)")


class Trainer:
    """Owns the engine, the actor, the task stream and the run directory."""

    def __init__(self, cfg: ExperimentConfig, out_dir: str | Path, resume: bool = False,
                 progress: bool = True, log: Callable[[str], None] = print):
        check_megatron_world(cfg)
        self.cfg, self.out, self.log = cfg, Path(out_dir), log
        self.task = Task(cfg.task)
        self.mode = cfg.replay.mode
        self.max_new_tokens = cfg.rollout.max_new_tokens or self.task.max_new_tokens
        self.warmstart: WarmstartResult | None = None
        if resume:
            found = load_latest(self.out, warn=log)  # falls back past corrupt ones
            if found is None:
                raise FileNotFoundError(
                    f"--resume: {self.out} has no checkpoint yet (the run stopped before its "
                    f"first one); restart it from scratch with `lockstep train "
                    f"{self.out / 'config.yaml'} --out {self.out}`")
            ckpt, model, trainer_state, state = found
            if state.config_hash != run_hash(cfg):
                raise ValueError(f"--resume: {ckpt} was written by a run with another config "
                                 f"(hash {state.config_hash} != {run_hash(cfg)}); only "
                                 f"loop.steps and the output settings may change on resume")
            log(f"resuming from {ckpt} (step {state.step})")
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out / "config.yaml")
            torch.manual_seed(cfg.loop.seed)
            model = MoEModel(cfg.model)
            state = LoopState(step=0, cursor=0, config_hash=run_hash(cfg), weight_version="0")
            if cfg.warmstart.enabled:
                self.warmstart = warm_start(model, self.task, cfg.warmstart, cfg.loop.seed,
                                            cache_key(cfg), log, progress)
                (self.out / "warmstart.json").write_text(json.dumps(asdict(self.warmstart)) + "\n")
        self.state = state
        model.zero_grad(set_to_none=True)  # RL's first update must see only its own gradient
        ro = cfg.rollout
        self.rollout = self.make_backend(model, state.weight_version)
        updates_per_step = cfg.actor.epochs * ro.batch_size // cfg.actor.mini_batch_size
        total_updates = cfg.loop.steps * updates_per_step
        if cfg.actor.backend == "megatron":  # same interface, megatron-core underneath
            from lockstep.trainer.megatron.actor import MegatronActor
            self.actor = MegatronActor(model, cfg.actor, total_updates,
                                       temperature=ro.temperature, options=cfg.actor.megatron)
        else:
            self.actor = TorchActor(model, cfg.actor, total_updates, temperature=ro.temperature)
        if resume:
            self.actor.load_state_dict(trainer_state)
            set_rng_state(trainer_state["rng"])
        self.metrics = MetricsWriter(self.out, cfg.loop.steps, state.step, cfg.loop.tensorboard,
                                     progress)

    def make_backend(self, model: MoEModel, weight_version: str) -> RolloutBackend:
        """The rollout engine, holding `model`'s weights at `weight_version`."""
        ro = self.cfg.rollout
        if ro.backend == "http":
            backend = HTTPBackend(ro.url, self.cfg.model, api_key=ro.api_key,
                                  max_concurrency=ro.prompts_per_step,
                                  weights_dir=ro.weights_dir or self.out / "weights")
            backend.update_weights(model, weight_version)  # the server's weights are unknown
            return backend
        engine_cfg = EngineConfig(
            dtype=ro.dtype, router_dtype=ro.router_dtype, lm_head_dtype=ro.lm_head_dtype,
            max_running=ro.batch_size, max_len=self.task.prompt_len + self.max_new_tokens,
            seed=self.cfg.loop.seed)
        if ro.backend == "ray":  # the same engines as Ray actors; needs the extra 'ray'
            from lockstep.rollout.ray_backend import RayBackend
            return RayBackend.from_model(model, engine_cfg, ro.num_engines, weight_version,
                                         address=ro.ray_address)
        return LocalBackend(Engine.from_model(model, engine_cfg, weight_version=weight_version))

    # -- the RL step -----------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, t = self.cfg, _Timer()
        problems = self.task.problems(cfg.loop.seed, self.state.cursor, cfg.rollout.prompts_per_step)
        results = self.rollout.generate(self.requests(problems, step))                 # generate
        batch = collate(results, self.task.pad_id, *self._route_shape(),
                        sampling_mask=cfg.rollout.mask_replay, vocab_size=cfg.model.vocab_size)
        rewards_B = torch.tensor([self.task.reward(problems[i // cfg.rollout.samples_per_prompt],
                                                   r.output_ids) for i, r in enumerate(results)])
        t.lap("generate")
        plan = old_logprob_plan(self.mode, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
        old = self.actor.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT, record=True)  # pi_old
        t.lap("old_logprob")
        maybe_dump(self, step, batch, rewards_B, old)  # loop.dump_every: samples for diagnose
        group_B = torch.arange(batch.size) // cfg.rollout.samples_per_prompt
        mask_BT = batch.response_mask_BT.float()
        adv_BT = grpo_advantages(rewards_B, group_B, mask_BT,                         # advantages
                                 norm_by_std=cfg.advantage.norm_by_std)
        corr = correct(cfg.correction, old.logprobs_BT, batch.rollout_logprobs_BT, mask_BT)  # IS/RS
        up = update_plan(self.mode, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT,
                         recorded_routes_BTLK=old.routes_BTLK, recorded_valid_BT=batch.token_mask_BT)
        current_BT = torch.zeros_like(old.logprobs_BT)  # pi_theta as the update forwards saw it
        actor_metrics, used_BTLK, natural_BTLK = self.actor.update(                    # update
            batch, self.loss_fn(batch, old, adv_BT, corr, current_BT), up.routes_BTLK,
            up.replay_mask_BT, shuffle_seed=cfg.loop.seed * 1_000_003 + step)
        t.lap("update")
        self.state.weight_version = self.rollout.update_weights(self.actor.master, str(step))  # sync
        t.lap("sync")
        self.state.step, self.state.cursor = step, self.state.cursor + len(problems)
        split = is_split_metrics(current_BT, old.logprobs_BT, batch.rollout_logprobs_BT, mask_BT)
        return {"step": step, **self.reward_metrics(rewards_B, batch, group_B), **corr.metrics,
                **split,
                **self.routing_metrics(batch, old, up, used_BTLK, natural_BTLK),
                **actor_metrics, **t.metrics()}

    # -- pieces of the step ----------------------------------------------------------------
    def requests(self, problems, step: int) -> list[GenerateRequest]:
        """One request per prompt, n samples each; seeds are a function of (seed, step).
        With sampling-mask replay each request also asks for the kept candidate sets."""
        ro, n = self.cfg.rollout, self.cfg.rollout.samples_per_prompt
        base = (self.cfg.loop.seed * 1_000_003 + step) * (1 << 24)
        return [GenerateRequest(self.task.prompt_ids(p), SamplingParams(
            temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
            max_new_tokens=self.max_new_tokens, n=n, seed=base + i * n), rid=f"s{step}p{i}",
            return_sampling_mask=ro.mask_replay)
            for i, p in enumerate(problems)]

    def loss_fn(self, batch: Batch, old: LogprobResult, adv_BT: torch.Tensor,
                corr: CorrectionResult, current_BT: torch.Tensor):
        """The corrected policy loss of one micro-batch, as its share of its mini-batch; also
        keeps the micro-batch's log-probs in `current_BT` (for the staleness metrics)."""
        cfg = self.cfg
        bypass = cfg.correction.bypass_mode  # IS/RS then happen inside policy_loss, vs pi_theta
        mask_BT = (batch.response_mask_BT if bypass else corr.response_mask).float()
        weights_BT = None if bypass else corr.weights

        def fn(lp_BT, ent_BT, rows, mini):
            current_BT[rows] = lp_BT.detach().float()
            out = policy_loss(
                cfg.loss, lp_BT, old.logprobs_BT[rows], adv_BT[rows], mask_BT[rows],
                is_weights=None if weights_BT is None else weights_BT[rows],
                entropy=ent_BT, correction=cfg.correction,
                rollout_logprobs=batch.rollout_logprobs_BT[rows],
                num_tokens=mask_BT[mini].sum().clamp(min=1),
                num_seqs=(mask_BT[mini].sum(-1) > 0).sum().clamp(min=1))
            return out.loss, out.metrics
        return fn

    def reward_metrics(self, rewards_B, batch: Batch, group_B) -> dict:
        n = self.cfg.rollout.samples_per_prompt
        per_group = rewards_B.view(-1, n)
        resp_len = batch.response_mask_BT.sum(1).float()
        return {"reward/mean": float(rewards_B.mean()), "reward/std": float(rewards_B.std()),
                "reward/group_all_equal": float((per_group.std(1) == 0).float().mean()),
                "response/length_mean": float(resp_len.mean()),
                "response/length_max": float(resp_len.max())}

    def routing_metrics(self, batch: Batch, old: LogprobResult, up, used_BTLK, natural_BTLK):
        """Rollout-vs-trainer divergence, staleness, and a check that replay replayed."""
        layers = self.cfg.model.moe_layer_ids
        m = {"replay/mode": self.mode.value}
        m.update(routing_divergence(batch.rollout_routes_BTLK, old.natural_BTLK,
                                    batch.rollout_routes_valid_BT, "routing", layers))
        m.update(routing_divergence(old.natural_BTLK, natural_BTLK, batch.token_mask_BT,
                                    "routing_stale", layers))
        if up.routes_BTLK is not None:
            replayed_BT = up.replay_mask_BT & batch.token_mask_BT
            differs = (used_BTLK[replayed_BT].long() != up.routes_BTLK[replayed_BT].long())
            m["replay/replayed_fraction"] = float(replayed_BT.sum() / batch.token_mask_BT.sum())
            m["replay/mismatch"] = float(differs.any(-1).float().mean()) if differs.numel() else 0.0
        else:
            m["replay/replayed_fraction"], m["replay/mismatch"] = 0.0, 0.0
        return m

    def _route_shape(self) -> tuple[int, int, int]:
        c = self.cfg.model
        return c.num_experts, c.num_moe_layers, c.num_experts_per_tok

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict:
        """Steps until loop.steps, checkpointing every loop.checkpoint_every; plots at the end."""
        cfg = self.cfg.loop
        try:
            for step in range(self.state.step + 1, cfg.steps + 1):
                self.metrics.log(self.step(step))
                if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                    self.save()
        finally:
            self.metrics.close()
            self.rollout.close()
        if cfg.plots:
            write_plots(self.out)
        summary = summarize(read_metrics(self.out / "metrics.jsonl"))
        if self.warmstart is None and (self.out / "warmstart.json").exists():
            self.warmstart = WarmstartResult(**json.loads((self.out / "warmstart.json").read_text()))
        if self.warmstart is not None:
            summary["warmstart/accuracy"] = self.warmstart.accuracy
            summary["warmstart/expected_reward"] = self.warmstart.expected_reward
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def save(self) -> Path:
        return save_checkpoint(self.out, self.actor.master, self.actor.state_dict(), self.state,
                               tokenizer=self.task.tokenizer, keep=self.cfg.loop.keep_checkpoints)


class _Timer:
    """Wall-clock laps of the step's phases -> time/<phase>_s and time/step_s."""

    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[f"time/{name}_s"] = now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        return {**self.laps, "time/step_s": time.perf_counter() - self.t0}
