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

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from lockstep.moe.checkpoint import load_hf
from lockstep.moe.model import MoEModel
from lockstep.rollout.agent import ObservationCodec, TrajectoryRunner, Turns
from lockstep.rollout.client import RolloutBackend
from lockstep.rollout.env import EnvPool
from lockstep.rollout.seeds import sampling_seed
from lockstep.rollout.tasks import Task
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import Batch, collate, fallback_fraction
from lockstep.trainer.actor.build import colocates_fleet, make_actor, run_reference
from lockstep.trainer.actor.rank import OldLogprobs, shuffle_seed, UpdateInputs
from lockstep.trainer.actor.versions import VersionSplit, stale_turn_mask
from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.load import save_config
from lockstep.trainer.config.megatron import check_world
from lockstep.trainer.driver.agent import env_problem, trajectory_rewards, turn_k3
from lockstep.trainer.driver.data import (check_data_on_resume, DatasetSource,
                                         resolve_lengths, TaskSource)
from lockstep.trainer.driver.lr_trigger import LRTrigger
from lockstep.trainer.driver.pipeline import RolloutPipeline
from lockstep.trainer.driver.requests import step_requests
from lockstep.trainer.driver.rollouts import make_rollout, needs_initial_push
from lockstep.trainer.driver.warmstart import WarmstartResult, cache_key, warm_start
from lockstep.trainer.objective.correction import (correct, CorrectionResult, is_split_metrics,
                                                   version_split_metrics)
from lockstep.trainer.objective.losses import grpo_advantages
from lockstep.trainer.objective.stats import stats_values
from lockstep.trainer.observe.dump import maybe_dump
from lockstep.trainer.observe.expert_load import step_load_metrics
from lockstep.trainer.observe.metrics import (merge_metrics, MetricsWriter, read_metrics,
                                              save_history, summarize, write_plots)
from lockstep.trainer.observe.nonfinite import check_step, check_weight_names, from_step_error
from lockstep.trainer.driver.injection import InjectionControl
from lockstep.trainer.observe.wandb_log import WandbRun
from lockstep.trainer.state.checkpoint import (latest_checkpoint, load_latest, LoopState,
                                               save_actor_checkpoint, set_rng_state)


def run_hash(cfg: ExperimentConfig, layout: bool = False) -> str:
    """Hash of what determines a run's numbers: every section but `loop`, plus loop.seed (so
    loop.steps may be raised and outputs changed when resuming). The actor's layout
    (`actor_ckpt.LAYOUT_KEYS`) is left out: checkpoints resume on another one (their
    optimiser state is HF-named); `layout=True` keeps it, as run hashes did before
    (checkpoints written then resume only on their own layout)."""
    parts = {**vars(cfg), "loop": type(cfg.loop)(seed=cfg.loop.seed,
                                                 max_staleness=cfg.loop.max_staleness)}
    if not layout:
        from lockstep.trainer.actor.checkpoint import without_layout
        parts.update(without_layout(cfg))
    return ExperimentConfig(**parts).hash()


def lean_startup(cfg: ExperimentConfig) -> bool:
    """Whether the driver starts without the policy's weights: with an actor group
    (`cluster.actor_ranks > 1`) every rank reads its part of an HF folder (`model.path`, the
    checkpoint's `hf/` on --resume, or the random init / warm start written once to
    `RUN/weights/initial`) and the engines load the same folder."""
    return cfg.cluster.actor_ranks > 1


def initial_folder(cfg: ExperimentConfig, run_dir: Path, model: MoEModel) -> Path:
    """Write a run's initial weights (random init or warm start) once as an HF folder for the
    actor group's ranks and the engines: `RUN/reference/` when the KL reference is kept there
    (the same weights), else `RUN/weights/initial/`."""
    from lockstep.moe.checkpoint import save_hf
    from lockstep.trainer.actor.reference import REFERENCE_DIR, reference_source
    own_ref = Path(run_dir) / REFERENCE_DIR
    if cfg.loss.kl_coef > 0 and reference_source(cfg, run_dir) == own_ref:
        return save_hf(model, own_ref)
    return save_hf(model, Path(run_dir) / "weights" / "initial")


class Trainer:
    """Owns the engine, the actor, the prompt source (task or data set) and the run directory.

    A run owns what it starts: the reward and environment workers, the actor (group), the
    rollout backend (servers, weight groups), the async pipeline and the metrics writer are
    closed together, newest first, by `close()` (a context manager: `with Trainer(...) as t`),
    on every exit path: a failed start-up, an exception or Ctrl-C mid-step, the run's end."""

    def __init__(self, cfg: ExperimentConfig, out_dir: str | Path, resume: bool = False,
                 progress: bool = True, log: Callable[[str], None] = print):
        self._owned = contextlib.ExitStack()
        self.rollout: RolloutBackend | None = None
        self.wandb: WandbRun | None = None
        try:
            self._build(cfg, out_dir, resume, progress, log)
        except BaseException:  # a failed start-up leaves no worker, actor or weight group
            self.close()
            raise

    def _own(self, part):
        """`part`, closed by `close()` (newest first)."""
        self._owned.callback(part.close)
        return part

    def close(self, failed: bool = False) -> None:
        """Close everything this run started, newest first (idempotent); an open W&B run is
        finished (`failed`: as a failed one)."""
        try:
            if self.wandb is not None:
                self.wandb.finish(failed=failed)
        finally:
            self._owned.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def _build(self, cfg: ExperimentConfig, out_dir: str | Path, resume: bool,
               progress: bool, log: Callable[[str], None]) -> None:
        check_world(cfg)
        self.cfg, self.out, self.log = cfg, Path(out_dir), log
        self.task = Task(cfg.task)
        if cfg.data.enabled:  # a data set's reward workers
            self.source = self._own(DatasetSource(
                cfg.data, cfg.reward, cfg.model.path, cfg.loop.seed, log, cfg.data.prompt_cap(
                    cfg.rollout.max_new_tokens, cfg.model.max_position_embeddings)))
            # unset lengths from the data and the model's context (config.yaml records them)
            cfg = self.cfg = resolve_lengths(cfg, self.source, log)
        else:
            self.source = self._own(TaskSource(self.task, cfg.loop.seed))
        self.mode = cfg.replay.mode
        self.max_new_tokens = cfg.rollout.max_new_tokens or self.task.max_new_tokens
        self.warmstart: WarmstartResult | None = None
        # actor.lr_schedule=triggered: the LR multiplier, decided here from the step's metrics
        self.lr_trigger = (None if cfg.actor.lr_trigger is None
                           else LRTrigger(cfg.actor.lr_trigger, log))
        lean = lean_startup(cfg)  # an actor group reads its weights from an HF folder
        ckpt, model, trainer_state, self.state = (self._resume_from(lean) if resume
                                                  else self._start(lean, progress))
        if not lean:
            model.zero_grad(set_to_none=True)  # RL's first update must see only its own gradient
        # pi_ref next to the actor, which replays the update's routes in it
        reference = run_reference(cfg, self.out, None if resume or lean else model,
                                  in_driver=not lean)
        self._make_backends(model, self.state.weight_version)
        self._own(self.actor)
        self._own(self.rollout)  # closed before the actor: colocated servers are in its bundles
        self.runner = self._make_runner()  # rollout.env: multi-turn trajectories
        # loop.max_staleness >= 1: generation of the next steps runs while the actor trains
        self.pipeline = self._own(RolloutPipeline(self.rollout, self.step_requests, cfg.loop.max_staleness,
                                        cfg.loop.steps, first_version=int(self.state.weight_version),
                                        generate=None if self.runner is None else self.trajectories,
                                        turns=self.trajectory_turns,
                                        turns_before_push=0 if cfg.rollout.env is None else
                                        cfg.rollout.env.turns_before_push))
        # pi_gen of samples of older versions: the actor's ranks keep their own old shards
        self.versions = VersionSplit(cfg.loop.max_staleness)
        if lean and needs_initial_push(cfg):  # the servers' weights are not the policy's
            self.rollout.update_weights(self.actor.export_weights(
                cfg.cluster.weight_bucket_bytes), self.state.weight_version)  # from the group
        if reference is not None:
            self.actor.set_reference(reference)
        if resume:
            if "actor" in trainer_state:  # HF-named optimiser state: any layout
                self.actor.load_checkpoint(ckpt, trainer_state["actor"])
            else:  # checkpoints of earlier versions: per-rank state, same layout
                self.actor.load_rank_state(trainer_state)
            set_rng_state(trainer_state["rng"])
            if self.lr_trigger is not None:
                self.lr_trigger.load_state(trainer_state["lr_trigger"])
        # rollout.mismatch: the engine's injected noise, calibrated between steps
        self.injection = None if cfg.rollout.mismatch is None or not \
            cfg.rollout.mismatch.enabled else InjectionControl(cfg.rollout.mismatch,
                                                               self.rollout.engine, log)
        if resume and self.injection is not None and "mismatch" in trainer_state:
            self.injection.load_state(trainer_state["mismatch"])
        self.metrics = self._own(MetricsWriter(self.out, cfg.loop.steps, self.state.step,
                                               cfg.loop.tensorboard, progress, log=log))
        self.wandb = WandbRun.start(cfg, self.out, resume)  # loop.wandb; None when unset

    def _resume_from(self, lean: bool) -> tuple[Path, MoEModel | Path, dict, LoopState]:
        """(checkpoint, its weights, trainer state, loop state) of the newest valid checkpoint,
        checked to belong to this config; `lean`: the weights stay in the folder."""
        cfg, log = self.cfg, self.log
        found = load_latest(self.out, warn=log, weights=not lean)  # past corrupt ones
        if found is None:
            raise FileNotFoundError(
                f"--resume: {self.out} has no checkpoint yet (the run stopped before its "
                f"first one); restart it from scratch with `lockstep train "
                f"{self.out / 'config.yaml'} --out {self.out}`")
        ckpt, model, trainer_state, state = found
        if state.config_hash not in (run_hash(cfg), run_hash(cfg, layout=True)):
            raise ValueError(f"--resume: {ckpt} was written by a run with another config "
                             f"(hash {state.config_hash} != {run_hash(cfg)}); only "
                             f"loop.steps, the output settings and the actor's layout "
                             f"(cluster.actor_ranks, actor.megatron.*_parallel; not for "
                             f"checkpoints of earlier versions) may change on resume")
        if "actor" not in trainer_state and state.config_hash != run_hash(cfg, layout=True):
            raise ValueError(f"--resume: {ckpt} holds each rank's optimiser state as "
                             f"earlier lockstep versions wrote it, which loads only on the "
                             f"layout it was written with; resume with that run's "
                             f"cluster.actor_ranks and actor.megatron parallel sizes")
        check_data_on_resume(self.source, self.out, fresh=False)
        log(f"resuming from {ckpt} (step {state.step})")
        return ckpt, model, trainer_state, state

    def _start(self, lean: bool, progress: bool) -> tuple[None, MoEModel | Path, dict, LoopState]:
        """A fresh run: its directory and config.yaml, the initial policy (random init under
        loop.seed, model.path, then the warm start); `lean`: written once as an HF folder."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out / "config.yaml")
        torch.manual_seed(cfg.loop.seed)
        model = (Path(cfg.model.path) if lean and cfg.model.path and not cfg.warmstart.enabled
                 else load_hf(cfg.model.path) if cfg.model.path else MoEModel(cfg.model))
        check_data_on_resume(self.source, self.out, fresh=True)
        if cfg.warmstart.enabled:
            self.warmstart = warm_start(model, self.task, cfg.warmstart, cfg.loop.seed,
                                        cache_key(cfg), self.log, progress)
            (self.out / "warmstart.json").write_text(json.dumps(asdict(self.warmstart)) + "\n")
        if lean and isinstance(model, MoEModel):  # random init / warm start: one folder
            model = initial_folder(cfg, self.out, model)
        return None, model, {}, LoopState(step=0, cursor=0, config_hash=run_hash(cfg),
                                          weight_version="0")

    def _make_backends(self, model: MoEModel | Path, weight_version: str) -> None:
        """`self.actor` (in process, or a Ray actor group) and `self.rollout`. A colocated
        fleet's servers join the group's bundles, so the group comes first; otherwise the
        engines do. A failure closes what was built."""
        cfg = self.cfg
        updates_per_step = cfg.actor.epochs * cfg.rollout.batch_size // cfg.actor.mini_batch_size
        total_updates = cfg.loop.steps * updates_per_step
        group = cfg.cluster.actor_ranks > 1
        if group:
            from lockstep.trainer.actor.group import ActorGroup
        self.actor = None
        if group and colocates_fleet(cfg):
            self.actor = ActorGroup(cfg, model, total_updates)
        try:
            self.rollout = self.make_backend(model, weight_version)
        except BaseException:
            if self.actor is not None:
                self.actor.close()
            raise
        if self.actor is None:
            try:
                self.actor = (ActorGroup(cfg, model, total_updates) if group
                              else make_actor(cfg, model, total_updates))
            except BaseException:
                self.rollout.close()
                raise

    def make_backend(self, model: MoEModel | Path, weight_version: str) -> RolloutBackend:
        """The rollout backend (trainer/driver/rollouts.py `make_rollout`), holding `model`'s
        weights at `weight_version`; colocated servers join the actor group's bundles."""
        return make_rollout(self.cfg, model, weight_version, max_len=self.engine_max_len,
                            run_dir=self.out, log=self.log,
                            actor_pg=getattr(self.actor, "placement_group", None))

    @property
    def engine_max_len(self) -> int:
        """The engines' context: prompt + response, or a whole trajectory (rollout.env)."""
        if self.cfg.rollout.env is not None:
            return self.cfg.model.max_position_embeddings
        return self.source.max_prompt_len + self.max_new_tokens

    def _make_runner(self) -> TrajectoryRunner | None:
        """rollout.env's workers and the trajectory runner over the rollout backend."""
        env = self.cfg.rollout.env
        if env is None:
            return None
        c = self.cfg.model
        return TrajectoryRunner(self.rollout.generate, self._own(EnvPool(env, self.log)),
                                ObservationCodec(self.source.tokenizer, env.observation_role),
                                self.engine_max_len, c.num_experts, c.eos_token_id,
                                c.vocab_size, release=self.rollout.release_trajectories)

    def trajectories(self, prompts, requests: list[GenerateRequest]) -> list:
        """A step's multi-turn trajectories (rollout/agent.py), one per sample."""
        return self.runner.run(requests, [env_problem(p) for p in prompts])

    def trajectory_turns(self, prompts, requests: list[GenerateRequest]) -> Turns:
        """The same, turn by turn (the pipeline pauses them for a push: turns_before_push)."""
        return Turns(self.runner.turns(requests, [env_problem(p) for p in prompts]))

    def mask_stale_turns(self, batch: Batch, versions: list) -> dict[str, float]:
        """rollout.env.mask_stale_turns: drop the sampled tokens of turns older than their
        trajectory's newest from the loss mask (in place); their share as a metric."""
        env = self.cfg.rollout.env
        if env is None or not env.mask_stale_turns:
            return {}
        stale_BT = stale_turn_mask(versions, batch.input_ids_BT.shape[1]) & batch.response_mask_BT
        sampled = float(batch.response_mask_BT.sum())
        batch.response_mask_BT &= ~stale_BT
        return {"rollout/stale_turn_tokens_masked": float(stale_BT.sum()) / max(sampled, 1.0)}

    def rewards(self, prompts, results) -> tuple[torch.Tensor, dict]:
        """(rewards [B], metrics) of sample b of prompt `prompts[b]`: the source's reward, or
        with rollout.env a trajectory's (trainer/driver/agent.py)."""
        if self.runner is None:
            return self.source.rewards(prompts, results)
        return trajectory_rewards(self.source.rewards, prompts, results, self.cfg.rollout.env)

    # -- the RL step -----------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, t = self.cfg, _Timer()
        self.calibrate_injection(step)  # rollout.mismatch: the noise of this step's samples
        prompts, results, gen_s = self.pipeline.take(step)  # generate (made ahead when async)
        versions, lag_m = self.pipeline.check_versions(results, step)  # in {step-1-k..step-1}
        batch = collate(results, self.source.pad_id, *self._route_shape(),
                        sampling_mask=cfg.rollout.mask_replay, vocab_size=cfg.model.vocab_size,
                        missing=cfg.replay.missing)
        lag_m.update(self.mask_stale_turns(batch, versions))  # rollout.env.mask_stale_turns
        rewards_B, reward_m = self.rewards(                                            # rewards
            [prompts[i // cfg.rollout.samples_per_prompt] for i in range(len(results))], results)
        t.lap("generate")
        old = self.actor.old_logprobs(batch, self.mode, step)  # pi_old; R2 routes stay on ranks
        gen_BT = self.versions.gen_logprobs(self.actor, batch, versions, old.logprobs_BT,
                                            self.mode, step)  # pi_gen, on the actor's ranks
        t.lap("old_logprob")
        maybe_dump(self, step, batch, rewards_B, None)  # loop.dump_every: for diagnose
        group_B = torch.arange(batch.size) // cfg.rollout.samples_per_prompt
        mask_BT = batch.response_mask_BT.float()
        adv_BT = grpo_advantages(rewards_B, group_B, mask_BT,                         # advantages
                                 norm_by_std=cfg.advantage.norm_by_std)
        corr = correct(cfg.correction, old.logprobs_BT, batch.rollout_logprobs_BT, mask_BT)  # IS/RS
        lr_m = self.trigger_lr(step, batch, corr, old)  # actor.lr_schedule=triggered: maybe cut
        if batch.turn_BT is not None:  # multi-turn: the train/infer k3 of each turn
            reward_m.update(turn_k3(batch.turn_BT, batch.response_mask_BT, old.logprobs_BT,
                                    batch.rollout_logprobs_BT))
        upd = self.actor.policy_update(batch, self.update_inputs(batch, old, adv_BT, corr, step),
                                       self.mode, step)                                # update
        t.lap("update")
        self.state.weight_version = self.sync_weights(step)                            # sync
        t.lap("sync")
        self.state.step, self.state.cursor = step, self.state.cursor + len(prompts)
        split = is_split_metrics(upd.logprobs_BT, old.logprobs_BT, batch.rollout_logprobs_BT,
                                 mask_BT)
        split.update(version_split_metrics(old.logprobs_BT, gen_BT, batch.rollout_logprobs_BT,
                                           mask_BT))  # pi_old/mu = version lag x engine
        moe_load = step_load_metrics(batch, old.stats, *self._load_shape())  # rollout/, actor/moe
        if self.injection is not None:
            self._last_batch = batch
        # bypass mode: the update recomputes rollout_corr/* against pi_theta (verl's metrics);
        # the driver's pi_old-vs-mu_old ones are is_split/mismatch_*
        driver_corr = {} if cfg.correction.bypass_mode else corr.metrics
        return merge_metrics(
            step={"step": step}, rewards=self.reward_metrics(rewards_B, batch, group_B),
            reward_parts=reward_m, correction=driver_corr, is_split=split, expert_load=moe_load,
            mode={"replay/mode": self.mode.value, **self.fallback(batch)}, old_logprobs=stats_values(old.stats),
            update=stats_values(upd.stats), lr_trigger=lr_m, versions=lag_m,
            rollout=self.rollout.counters(),
            mismatch={} if self.injection is None else self.injection.metrics(),
            time={"time/rollout_s": gen_s, **t.metrics()})

    # -- pieces of the step ----------------------------------------------------------------
    def fallback(self, batch) -> dict:
        """replay.missing=live: replay/fallback_fraction, the share of route rows the engine
        sent without a route (routed by the actor's live router)."""
        if self.cfg.replay.missing != "live":
            return {}
        return {"replay/fallback_fraction": fallback_fraction(batch)}

    def calibrate_injection(self, step: int) -> None:
        """rollout.mismatch.router_flip_rate: recalibrate the router noise when it is due, on
        the last step's samples (before the first step: a batch generated for it)."""
        inj = self.injection
        if inj is None or not inj.due(step):
            return
        batch = getattr(self, "_last_batch", None)
        if batch is None:
            prompts, _ = self.step_requests(step)
            results = self.rollout.generate(self.requests(prompts, 0))  # step 0: no step's seeds
            batch = collate(results, self.source.pad_id, *self._route_shape())
        inj.calibrate(step, batch.input_ids_BT, batch.rollout_routes_valid_BT, self.cfg.loop.seed)


    def step_requests(self, step: int) -> tuple[list, list[GenerateRequest]]:
        """(prompts, requests) of step `step`, from the cursor it will start at."""
        n = self.cfg.rollout.prompts_per_step
        cursor = self.state.cursor + (step - self.state.step - 1) * n
        prompts = self.source.prompts(cursor, n)
        return prompts, self.requests(prompts, step)

    def requests(self, prompts, step: int) -> list[GenerateRequest]:
        """Step `step`'s requests for `prompts` (trainer/driver/requests.py)."""
        return step_requests(self.cfg, prompts, step, self.max_new_tokens)

    def trigger_lr(self, step: int, batch: Batch, corr: CorrectionResult,
                   old: OldLogprobs) -> dict[str, float]:
        """actor.lr_schedule=triggered: feed the step's symptoms (mean response length, k3
        KL of pi_old vs mu_old, routing flip rate) to the trigger, which may cut the LR of
        this step's update on; its lr_trigger/* metrics ({} for other schedules)."""
        if self.lr_trigger is None:
            return {}
        length = float(batch.response_mask_BT.sum(1).float().mean())
        return self.lr_trigger.observe(step, {"response/length_mean": length, **corr.metrics,
                                              **stats_values(old.stats)})

    def update_inputs(self, batch: Batch, old: OldLogprobs, adv_BT: torch.Tensor,
                      corr: CorrectionResult, step: int) -> UpdateInputs:
        """The per-token inputs of the corrected policy loss (the actor splits them by rows).
        In bypass mode IS/RS happen inside the loss, against pi_theta."""
        cfg = self.cfg
        bypass = cfg.correction.bypass_mode
        return UpdateInputs(
            old_logprobs_BT=old.logprobs_BT, advantages_BT=adv_BT,
            loss_mask_BT=(batch.response_mask_BT if bypass else corr.response_mask).float(),
            is_weights_BT=None if bypass else corr.weights,
            shuffle_seed=shuffle_seed(cfg.loop.seed, step), loss=cfg.loss,
            correction=cfg.correction,
            lr_scale=1.0 if self.lr_trigger is None else self.lr_trigger.scale)

    def sync_weights(self, step: int) -> str:
        """Stream the actor's HF-named weight buckets to the engines, one bucket at a time
        (`rollout.weight_sync`); a checkpoint exports again. Ray engines fed by an actor group
        fetch each bucket from rank 0's node (cast there to their dtypes): no weight byte
        passes through the driver (docs/cluster.md "Weight sync at scale")."""
        bucket = self.cfg.cluster.weight_bucket_bytes
        transport = getattr(self.rollout, "transport", None)
        if hasattr(self.actor, "export_refs") and getattr(transport, "weight_sync", None) == \
                "object_store":
            weights = self.actor.export_refs(bucket, transport.dtypes)
        else:
            weights = self.actor.export_weights(bucket)
        return self.pipeline.update_weights(weights, str(step))

    def saves_at(self, step: int) -> bool:
        cfg = self.cfg.loop
        return step == cfg.steps or bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0)

    def reward_metrics(self, rewards_B, batch: Batch, group_B) -> dict:
        n = self.cfg.rollout.samples_per_prompt
        per_group = rewards_B.view(-1, n)
        resp_len = batch.response_mask_BT.sum(1).float()
        return {"reward/mean": float(rewards_B.mean()), "reward/std": float(rewards_B.std()),
                "reward/group_all_equal": float((per_group.std(1) == 0).float().mean()),
                "response/length_mean": float(resp_len.mean()),
                "response/length_max": float(resp_len.max())}

    def _load_shape(self) -> tuple[list[int], int]:
        return self.cfg.model.moe_layer_ids, self.cfg.model.num_experts

    def _route_shape(self) -> tuple[int, int, int]:
        c = self.cfg.model
        return c.num_experts, c.num_moe_layers, c.num_experts_per_tok

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict:
        """Steps until loop.steps, checkpointing every loop.checkpoint_every; plots and
        summary.json at the end. Every way out closes the run (`close`)."""
        with self:
            step = self._steps()
            self._owned.close()  # workers, backends and the metrics file before the summary
            summary = self._summary(step)
            if self.wandb is not None:
                self.wandb.finish(summary)
        return summary

    def _steps(self) -> int:
        """The steps after the loop state's, each logged and checked; the last step's number."""
        cfg = self.cfg.loop
        step = self.state.step
        for step in range(self.state.step + 1, cfg.steps + 1):
            try:
                m = self.step(step)
            except (ValueError, RuntimeError, FloatingPointError) as e:  # NaN checks inside
                raise from_step_error(step, e, self.cfg, latest_checkpoint(self.out)) or e
            if cfg.val_every and step % cfg.val_every == 0:
                m.update(self.validate(step))
            self.metrics.log(m)
            if self.wandb is not None:
                self.wandb.log(m)
            # NaN/Inf stops the run here, before a checkpoint could keep the broken model
            check_step(step, m, self.cfg, latest_checkpoint(self.out))
            if self.saves_at(step):
                self.save()
                if cfg.plots and step != cfg.steps:
                    self._plots(step)  # refreshed at each checkpoint, not only at the end
        return step

    def _summary(self, step: int) -> dict:
        """The end-of-run plots and summary.json (run means, the warm start's accuracy)."""
        if self.cfg.loop.plots:
            self._plots(step)
        summary = summarize(read_metrics(self.out / "metrics.jsonl"))
        if self.warmstart is None and (self.out / "warmstart.json").exists():
            self.warmstart = WarmstartResult(**json.loads((self.out / "warmstart.json").read_text()))
        if self.warmstart is not None:
            summary["warmstart/accuracy"] = self.warmstart.accuracy
            summary["warmstart/expected_reward"] = self.warmstart.expected_reward
        pools = {"reward": getattr(self.source, "pool", None),
                 "agent": None if self.runner is None else self.runner.env.pool}
        for prefix, pool in pools.items():  # the first messages of each error kind, if any
            if pool is not None and pool.first_errors:
                summary[f"{prefix}/first_errors"] = pool.first_errors
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _plots(self, step: int) -> None:
        paths = write_plots(self.out)
        if self.wandb is not None:
            self.wandb.plots(paths, step)

    def validate(self, step: int) -> dict:
        """val/... metrics of data.val_files under the current weights (greedy, or
        data.val_samples samples per prompt seeded by (loop.seed, step))."""
        n, ro = self.cfg.data.val_samples, self.cfg.rollout
        params = [SamplingParams(temperature=0.0 if n == 1 else ro.temperature,
                                 max_new_tokens=self.max_new_tokens, n=n,
                                 seed=sampling_seed(self.cfg.loop.seed, step, i * n, True))
                  for i in range(len(self.source.val))]
        if self.runner is None:
            return self.source.validate(self.rollout, params)
        env = self.cfg.rollout.env  # trajectories, scored like training's (val/agent/...)
        return self.source.validate(self.rollout, params, generate=self.trajectories,
                                    score=lambda prompts, results: trajectory_rewards(
                                        lambda p, r: self.source.score(p, r, prefix="val"),
                                        prompts, results, env, prefix="val/agent"))

    def save(self) -> Path:
        """The actor writes `hf/` and its HF-named optimiser state (a group: each rank its
        parts, nothing through this process); this process writes the loop state, the RNG and
        the manifest (trainer/actor/checkpoint.py)."""
        from lockstep.trainer.actor.checkpoint import layout_state

        def write_actor(tmp: Path) -> tuple[dict, dict]:
            state, known = self.actor.write_checkpoint(tmp, self.source.tokenizer)
            save_history(self.metrics.path, tmp)  # restores a damaged metrics.jsonl on resume
            check_weight_names(self.state.step, state.pop("nonfinite"), self.cfg,
                               latest_checkpoint(self.out))
            return {**state, **layout_state(self.cfg)}, known
        extra = {} if self.lr_trigger is None else {"lr_trigger": self.lr_trigger.state()}
        if self.injection is not None:
            extra["mismatch"] = self.injection.state()
        return save_actor_checkpoint(self.out, write_actor, extra, self.state,
                                     keep=self.cfg.loop.keep_checkpoints)


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
