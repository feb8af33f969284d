"""The experiment's `replay` section (trainer/config/sections.py imports it): the replay mode, the
replay validator, gate-weight replay, partial replay and the bias meter, and the checks of
what they need of the other sections (docs/replay.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lockstep.moe.replay_check import ReplayCheck
from lockstep.replay import PartialReplay, ReplayMode, ReplayOptions
from lockstep.trainer.config.types import Float, LATER, NOT_HASHED, Section, need


class PartialReplayConfig(Section):
    """Partial replay: replay a (token, layer) route only where the actor's router is unsure
    enough; elsewhere that layer routes naturally (lockstep.replay.PartialReplay)."""

    rule: Literal["margin", "tolerance"]
    """margin: replay where the router margin is below threshold (0 = replay off, .inf = full
    replay); tolerance: replay where the actor's probability mass on the replayed experts is
    within threshold of the mass on its own top-k (prime-rl #2703)."""
    threshold: Float = Field(ge=0.0)
    """The rule's bound (a probability difference; YAML .inf for no bound)."""


class ReplayConfig(Section):
    """Routing replay: which routes the actor's forwards run."""

    mode: ReplayMode = Field(ReplayMode.R3, strict=False)
    """off: actor routes freely; R2: updates replay the actor's own old-logprob routes;
    R3: old-logprob and update forwards replay the rollout engine's routes."""
    check: ReplayCheck = Field(ReplayCheck.SAMPLE, strict=False, json_schema_extra={**LATER, **NOT_HASHED})
    """Replay validator in every replayed forward (moe/replay_check.py): each MoE layer got
    ids, ran them, none left over; `sample` checks every 8th token, `full` all, `off` none."""
    min_overlap: Float | None = Field(None, ge=0.0, le=1.0, json_schema_extra={**LATER, **NOT_HASHED})
    """Validator, pi_old forwards of synchronous runs: least share of replayed expert slots
    the router's own top-k must agree with (null: halfway between chance K/E and 1; 0: off)."""

    missing: Literal["refuse", "live"] = Field("refuse", json_schema_extra=LATER)
    """A route row the engine sent as missing (-1 in every slot): refuse (the step stops,
    naming sample and position) or live (that token routes with the actor's own router in
    every forward; replay/fallback_fraction logs the share of rows; docs/replay.md)."""
    gates: Literal["recompute", "engine"] = Field("recompute", json_schema_extra=LATER)
    """Gate weights of the replayed experts: recompute (from the actor's router) or engine
    (replay the weights of whoever picked the routes: the engine's under R3, the old-logprob
    forward's under R2; straight-through, so the router still learns; docs/replay.md)."""

    partial: PartialReplayConfig | None = Field(None, json_schema_extra=LATER)
    """Replay only where the actor's router is unsure (None: wherever a route exists)."""
    bias_meter_rows: Float = Field(0.125, ge=0.0, le=1.0, json_schema_extra=LATER)
    """Fraction of rows the replay bias meter re-runs after each update, replayed and natural
    (replay_bias/k3; 0 = only the flip rate; docs/replay.md)."""
    indexer: Literal["off", "r2", "r3"] = Field("off", json_schema_extra=LATER)
    """DSA models (deepseek_v32, glm_moe_dsa): lightning-indexer replay, independent of mode:
    off (every forward picks its own keys), r2 (updates replay the old-logprob forward's
    picks), r3 (every forward replays the engine's picks; docs/replay.md "Indexer replay")."""

    def options(self) -> ReplayOptions:
        """What the actor needs beyond the mode (lockstep.replay.ReplayOptions)."""
        p = self.partial
        return ReplayOptions(gates=self.gates, partial=None if p is None else
                             PartialReplay(p.rule, p.threshold),
                             bias_meter_rows=self.bias_meter_rows, indexer=self.indexer)


def check_replay(cfg) -> None:
    """replay.gates=engine, replay.partial and replay.indexer: what they need of the mode, the
    model, the rollout backend and the actor (`cfg`: the ExperimentConfig being validated)."""
    rp = cfg.replay
    if rp.indexer != "off":
        need(cfg.model.is_dsa,
             f"replay.indexer={rp.indexer} replays lightning-indexer picks, but model_type "
             f"{cfg.model.model_type} has no indexer (DSA models: deepseek_v32, glm_moe_dsa); "
             f"set replay.indexer=off")
    if rp.partial is not None:
        need(rp.mode is not ReplayMode.OFF,
             "replay.partial narrows where routes are replayed, but replay.mode=off "
             "replays none; set replay.mode to R2 or R3")
        need(cfg.actor.backend != "megatron",
             "replay.partial is not available with actor.backend=megatron: megatron-core's "
             "RouterReplay replays every token of a layer or none; use actor.backend=torch")
    if rp.gates != "engine":
        return
    need(rp.mode is not ReplayMode.OFF,
         "replay.gates=engine replays the gate weights of replayed routes, but "
         "replay.mode=off replays none; set replay.mode to R2 or R3")
    need(not (rp.mode is ReplayMode.R3 and cfg.rollout.backend == "sglang"),
         "replay.gates=engine with replay.mode=R3 needs the engine's gate weights, which "
         "real SGLang does not return (expert ids only); use rollout.backend embedded, ray "
         "or serve (lockstep's server returns them), or replay.gates=recompute")
    need(cfg.actor.backend != "megatron",
         "replay.gates=engine is not available with actor.backend=megatron: megatron-core's "
         "RouterReplay recomputes the gate weights of replayed ids and takes no given ones; "
         "use actor.backend=torch or replay.gates=recompute")


def wants_indexer_picks(cfg) -> bool:
    """Whether rollouts ask the engine for its indexer picks (`return_indexer_topk`): DSA
    models under replay.indexer=r3, and under the other modes from lockstep's own engines
    (embedded, ray, serve), for the indexer flip rate. A real SGLang returns them only with
    --enable-return-indexer-topk on CUDA / NPU, so it is asked only when r3 needs them."""
    if not cfg.model.is_dsa:
        return False
    return cfg.replay.indexer == "r3" or cfg.rollout.backend in ("embedded", "ray", "serve")
