"""Experiment config: YAML reading, dotted overrides, type/bound checks, unknown keys."""

import hashlib
import json
from pathlib import Path

import pytest

from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.load import load_config, save_config
from lockstep.trainer.config.types import ExperimentConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_defaults_are_valid():
    cfg = load_config()
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.rollout.dtype == "bf16" and cfg.actor.dtype == "fp32"
    assert cfg.model.vocab_size == 16 and cfg.model.eos_token_id == 2


def test_yaml_and_overrides(tmp_path):
    p = _write(tmp_path, "actor:\n  lr: 3e-4\n  epochs: 2\nreplay:\n  mode: R2\n")
    cfg = load_config(p, ["actor.lr=1e-4", "replay.mode=off", "loop.steps=7",
                          "rollout.max_new_tokens=null", "actor.betas=[0.8, 0.9]"])
    assert cfg.actor.lr == pytest.approx(1e-4) and isinstance(cfg.actor.lr, float)
    assert cfg.actor.epochs == 2 and cfg.replay.mode == "off" and cfg.loop.steps == 7
    assert cfg.rollout.max_new_tokens is None and cfg.actor.betas == [0.8, 0.9]
    assert load_config(p).actor.lr == pytest.approx(3e-4)  # YAML '3e-4' (no dot) is a number


def test_unknown_keys_list_valid_ones(tmp_path):
    with pytest.raises(ExperimentConfigError, match=r"actor\.learning_rate.*valid keys in actor "
                                                    r"are \[.*'lr'"):
        load_config(_write(tmp_path, "actor:\n  learning_rate: 0.1\n"))
    with pytest.raises(ExperimentConfigError, match=r"'optim'.*valid keys are \[.*'actor'"):
        load_config(_write(tmp_path, "optim: {}\n"))
    with pytest.raises(ExperimentConfigError, match=r"'lrr' is not a valid key of actor"):
        load_config(None, ["actor.lrr=1"])
    with pytest.raises(ExperimentConfigError, match=r"key\.sub=value"):
        load_config(None, ["actor.lr"])


def test_types_bounds_and_choices():
    cases = {
        "actor.lr=0": r"actor\.lr=0\.0 is outside \(0\.0, 1\.0\]",
        "actor.lr=fast": r"actor\.lr must be a number, got 'fast'",
        "actor.epochs=1.5": r"actor\.epochs must be an integer",
        "replay.mode=R4": r"replay\.mode='R4' is not one of \['off', 'R2', 'R3'\]",
        "rollout.dtype=int8": r"rollout\.dtype='int8' is not one of",
        "rollout.temperature=0": r"rollout\.temperature",
        "rollout.samples_per_prompt=1": r"rollout\.samples_per_prompt=1 is outside \[2, 4096\]",
        "loop.tensorboard=yes please": r"loop\.tensorboard must be true or false",
        "actor.micro_batch_size=3": r"micro_batch_size=3 must divide",
        "actor.mini_batch_size=192": r"mini_batch_size=192 must divide the rollout batch",
        "model.vocab_size=8": r"vocab_size=8 is smaller than the task tokenizer's 16",
        "model.num_experts_per_tok=9": r"model: num_experts_per_tok must be in",
        "task.name=divide": r"task\.name='divide' is not one of",
    }
    for override, msg in cases.items():
        with pytest.raises(ExperimentConfigError, match=msg):
            load_config(None, [override])


def test_save_load_round_trip(tmp_path):
    cfg = load_config(None, ["replay.mode=R2", "actor.lr=2e-4", "model.hidden_size=64"])
    save_config(cfg, tmp_path / "c.yaml")
    back = load_config(tmp_path / "c.yaml")
    assert back == cfg
    assert back.hash() == cfg.hash()
    assert back.hash("model", "task") == load_config(None, ["model.hidden_size=64"]).hash(
        "model", "task")
    assert cfg.hash("model") != load_config().hash("model")


@pytest.mark.parametrize("name", ["toy_off", "toy_r2", "toy_r3"])
def test_shipped_configs_load_and_differ_only_in_replay(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    ref = load_config(CONFIGS / "toy_r3.yaml")
    assert cfg.replay.mode == {"toy_off": "off", "toy_r2": "R2", "toy_r3": "R3"}[name]
    a, b = cfg.to_dict(), ref.to_dict()
    a.pop("replay"), b.pop("replay")
    assert a == b


def test_actor_megatron_section(tmp_path):
    p = _write(tmp_path, "actor:\n  backend: megatron\n  megatron:\n    expert_parallel: 2\n")
    cfg = load_config(p, ["actor.megatron.tensor_parallel=2",
                          "actor.megatron.token_dispatcher=allgather"])
    m = cfg.actor.megatron
    assert (m.tensor_parallel, m.expert_parallel, m.etp, m.token_dispatcher) == (2, 2, 2,
                                                                                  "allgather")
    assert m.seed == 1234 and m.expert_tensor_parallel is None  # the rest keeps its defaults
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    # a default section leaves the hash as it was before the section existed; a layout changes it
    plain = load_config(None, ["actor.backend=megatron"])
    d = plain.to_dict()
    d["actor"].pop("megatron")  # what to_dict gave before the section existed
    d["rollout"].pop("sampling_mask_replay")  # (and before this field existed)
    d["rollout"].pop("api_key_file")  # (and while the key itself was a config field)
    d["rollout"]["api_key"] = None
    d["model"].pop("path"), d.pop("data"), d.pop("reward")  # (and before these)
    d["loop"].pop("max_staleness")  # (and before async rollout)
    assert plain.hash() == hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()
                                          ).hexdigest()[:16]
    assert plain.hash() != cfg.hash()
    assert plain.hash() != load_config(None, ["actor.backend=megatron",
                                              "actor.megatron.recompute_activations=true"]).hash()


def test_actor_megatron_errors(tmp_path):
    mg = "actor.backend=megatron"
    with pytest.raises(ExperimentConfigError, match=r"'tp' is not a valid key of actor\.megatron; "
                                                    r"valid keys are \[.*'tensor_parallel'"):
        load_config(None, [mg, "actor.megatron.tp=2"])
    with pytest.raises(ExperimentConfigError, match=r"actor\.megatron\.tp.*valid keys in "
                                                    r"actor\.megatron are \[.*'expert_parallel'"):
        load_config(_write(tmp_path, "actor:\n  backend: megatron\n  megatron: {tp: 2}\n"))
    cases = {
        "actor.megatron.tensor_parallel=0": r"tensor_parallel must be a positive integer, got 0",
        "actor.megatron.tensor_parallel=two": r"actor\.megatron\.tensor_parallel must be an int",
        "actor.megatron.token_dispatcher=flex": r"token_dispatcher='flex' is not one of",
        "actor.megatron.expert_tensor_parallel=2": r"expert_tensor_parallel=2 with "
                                                   r"expert_parallel=1 must equal",
        "actor.megatron.params_dtype=bfloat16": r"params_dtype='bfloat16': set actor\.dtype",
        "actor.megatron.router_dtype=fp32": r"router_dtype='fp32': set actor\.router_dtype",
        "actor.megatron.aux_loss_coef=0.1": r"aux_loss_coef=0\.1: set actor\.aux_loss_coef",
    }
    for override, msg in cases.items():
        with pytest.raises(ExperimentConfigError, match=msg):
            load_config(None, [mg, override])
    with pytest.raises(ExperimentConfigError, match=r"actor\.megatron\.tensor_parallel=2: "
                                                    r"actor\.megatron options apply only to "
                                                    r"actor\.backend=megatron, but actor\.backend"
                                                    r"='torch'"):
        load_config(None, ["actor.megatron.tensor_parallel=2"])


def test_rollout_fault_keys_are_checked_and_leave_the_hash():
    base = load_config(None)
    cfg = load_config(None, ["rollout.request_timeout_s=5", "rollout.max_engine_restarts=0"])
    assert (cfg.rollout.request_timeout_s, cfg.rollout.max_engine_restarts) == (5.0, 0)
    assert cfg.hash() == base.hash()  # a resumed run may change how faults are handled
    with pytest.raises(ExperimentConfigError, match=r"rollout.request_timeout_s=0\.0 is outside"):
        load_config(None, ["rollout.request_timeout_s=0"])
    with pytest.raises(ExperimentConfigError, match=r"rollout.max_engine_restarts=-1 is outside"):
        load_config(None, ["rollout.max_engine_restarts=-1"])
