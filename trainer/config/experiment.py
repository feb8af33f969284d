"""The whole experiment: every section in one strict model, the checks across sections, and
the saved form (`to_dict`, what config.yaml holds) and run hash of a config.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from lockstep.moe.checks import ConfigError
from lockstep.moe.config import ModelConfig
from lockstep.rollout.rewards import RewardConfig
from lockstep.rollout.seeds import MAX_SAMPLES
from lockstep.rollout.tasks import Task, TaskConfig
from lockstep.trainer.config.mismatch import check_exact, check_mismatch
from lockstep.trainer.config.replay import ReplayConfig, check_replay
from lockstep.trainer.config.sections import (ActorConfig, AdvantageConfig, ClusterConfig,
                                              DataConfig, LoopConfig, RolloutConfig,
                                              WarmstartConfig)
from lockstep.trainer.config.types import (compat_form, dataclass_section, HASHED_LATER, LATER, need,
                                           Section)
from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.losses import LossConfig
from lockstep.trainer.objective.presets import expand_preset


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


# a rollout field removed after the first release, kept in the hashed form with the one value
# it ever had, so that the hashes of runs written while it existed still hold
REMOVED_HASHED_ROLLOUT = {"api_key": None}


class ExperimentConfig(Section):
    """A whole RL experiment."""

    model: Annotated[dataclass_section(ModelConfig), BeforeValidator(_model_on_toy)] = Field(
        default_factory=_toy_model)
    """Policy architecture (HF config.json fields; `model_type` picks the family, docs/model.md);
    random init under loop.seed."""
    task: dataclass_section(TaskConfig) = Field(default_factory=TaskConfig)
    """The synthetic verifiable task (unused when data.train_files is set)."""
    data: dataclass_section(DataConfig) = Field(default_factory=DataConfig,
                                                json_schema_extra=HASHED_LATER)
    """Prompt data sets (verl columns) instead of the synthetic task: lockstep.trainer.driver.data."""
    reward: dataclass_section(RewardConfig) = Field(default_factory=RewardConfig,
                                                    json_schema_extra=HASHED_LATER)
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
    verl's `RolloutCorrectionConfig.NAME()` fields (trainer/objective/presets.py)."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """GRPO advantage estimation."""
    loss: dataclass_section(LossConfig) = Field(default_factory=LossConfig)
    """Policy loss (PPO clip / GSPO, aggregation, KL, entropy): lockstep.trainer.objective.losses."""
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    """Supervised warm start before RL."""
    loop: LoopConfig = Field(default_factory=LoopConfig)
    """Step loop, checkpoints and outputs."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, json_schema_extra=LATER)
    """Actor ranks (in-process or a Ray actor group), devices, weight buckets."""

    @model_validator(mode="before")
    @classmethod
    def _data_run_defaults(cls, data: Any) -> Any:
        """A data run's prompt length, unset, is taken from the data (trainer/driver/data.py
        `resolve_lengths`): None until then."""
        d = data.get("data") if isinstance(data, dict) else None
        if isinstance(d, dict) and d.get("train_files") and "max_prompt_length" not in d:
            data = {**data, "data": {**d, "max_prompt_length": None}}
        return data

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        ws = self.warmstart
        if self.data.enabled and "enabled" not in ws.model_fields_set:
            # a data run's warm start, unset: off (it trains on the synthetic task only); the
            # unset mark stays, so the trainer says the choice (`data_run_defaults`)
            self.__dict__["warmstart"] = WarmstartConfig.model_construct(
                set(ws.model_fields_set), **{**dict(ws), "enabled": False})
        B = self.rollout.batch_size
        need(B <= MAX_SAMPLES, f"rollout.prompts_per_step x rollout.samples_per_prompt = {B} "
             f"sequences per step; at most {MAX_SAMPLES} (2^23) get their own sampling seed "
             f"(rollout/seeds.py)")
        if self.actor.backend == "megatron":
            # refuses the model fields trainer/actor/megatron does not map (naming each)
            from lockstep.trainer.config.megatron import check_supported
            try:
                check_supported(self.model)
            except ConfigError as e:
                need(False, str(e))
        need(B % self.actor.mini_batch_size == 0,
             f"actor.mini_batch_size={self.actor.mini_batch_size} must divide the rollout batch "
             f"rollout.prompts_per_step * rollout.samples_per_prompt = {B}")
        c, ro = self.cluster, self.rollout
        for kind, name in (("sglang", "an SGLang"), ("vllm", "a vLLM")):
            tp = getattr(ro, kind).tp_size
            need(c.gpus_per_engine in (None, tp) or ro.backend != kind,
                 f"cluster.gpus_per_engine={c.gpus_per_engine} but {name} server takes "
                 f"rollout.{kind}.tp_size={tp} GPUs; drop cluster.gpus_per_engine")
        need(self.loop.val_every == 0 or bool(self.data.val_files),
             f"loop.val_every={self.loop.val_every} needs data.val_files")
        env = self.rollout.env
        need(env is None or env.turns_before_push == 0 or self.loop.max_staleness >= 1,
             f"rollout.env.turns_before_push={env and env.turns_before_push} generates turns "
             f"ahead of a weight push: it needs loop.max_staleness >= 1 (got "
             f"{self.loop.max_staleness})")
        need(env is None or not env.mask_stale_turns or env.turns_before_push >= 1,
             "rollout.env.mask_stale_turns=true has no effect: no trajectory spans a weight "
             "push unless rollout.env.turns_before_push >= 1 (with loop.max_staleness >= 1); "
             "set those or drop it")
        check_replay(self)
        check_exact(self)
        check_mismatch(self)
        if self.rollout.routes_by_reference:
            self._check_routes_by_reference()
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

    def _check_routes_by_reference(self) -> None:
        """rollout.routes_by_reference: Ray engines feeding an actor group, and nothing on the
        driver that reads the routes themselves."""
        ro, f = self.rollout, "rollout.routes_by_reference=true"
        need(ro.backend == "ray", f"{f} needs rollout.backend=ray (embedded engines as Ray "
             f"actors, whose node keeps the routes), got {ro.backend!r}")
        need(self.replay.gates != "engine", f"{f} does not carry the engine's gate weights "
             f"(replay.gates=engine)")
        need(ro.env is None, f"{f} does not stitch multi-turn routes (rollout.env)")
        need(self.replay.missing == "refuse", f"{f}: the ranks lay out the routes they fetch "
             f"and refuse rows with no route; replay.missing=live needs the routes on the "
             f"driver (routes_by_reference=false)")
        from lockstep.rollout.route_refs import KEEP_VERSIONS
        need(self.loop.max_staleness <= KEEP_VERSIONS - 2, f"{f}: the engines' route stores keep "
             f"{KEEP_VERSIONS} weight versions, so loop.max_staleness <= {KEEP_VERSIONS - 2} "
             f"(got {self.loop.max_staleness})")
        need(self.loop.dump_every == 0, f"{f}: loop.dump_every writes the routes from the "
             f"driver; dump without routes by reference")

    def _check_data(self) -> None:
        """A data-set run: a pretrained folder with its tokenizer, no synthetic warm start."""
        need(bool(self.model.path),
             "data.train_files needs model.path: an HF folder whose tokenizer (and chat "
             "template) tokenises the prompts")
        need(not self.warmstart.enabled,
             "warmstart.enabled=true: the warm start trains on the synthetic task's "
             "demonstrations, not on data.train_files; drop it or set warmstart.enabled=false "
             "(the policy starts from model.path)")
        need(self.model.eos_token_id is not None,
             f"{self.model.path}: config.json has no eos_token_id (generation must stop)")
        P, R = self.data.max_prompt_length, self.rollout.max_new_tokens
        context = self.model.max_position_embeddings
        if P is not None and R is not None:
            need(P + R <= context,
                 f"data.max_prompt_length + rollout.max_new_tokens = {P + R} exceeds the "
                 f"model's max_position_embeddings={context}")
        elif (P or R or 0) >= context:
            need(False, f"{'data.max_prompt_length' if P else 'rollout.max_new_tokens'}="
                        f"{P or R} leaves no room in the model's max_position_embeddings="
                        f"{context} for the {'response' if P else 'prompt'}")

    def to_dict(self) -> dict[str, Any]:
        """Every section, as config.yaml saves it: the fields added after the first release
        are left out at their defaults (config/types.py "Saved-config compatibility"), so
        files written before them read the same bytes."""
        return compat_form(self, "saved")

    def hash(self, *sections: str) -> str:
        """Short stable hash of the named sections (all when none), e.g. for caches: the saved
        form without what changes no number and without the hash-later fields at their
        defaults, so runs written before those existed still resume; any other value changes
        the hash."""
        d = compat_form(self, "saved", "hashed")
        d["rollout"].update(REMOVED_HASHED_ROLLOUT)
        d = {k: d[k] for k in (sections or d)}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
