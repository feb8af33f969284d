"""Bad configs through `lockstep train`: one-line errors naming the key, before any work; and the
config edges of issue 22 (section overrides merge, one temperature rule, multi-node without a
Ray address, data files as a string)."""

from pathlib import Path

import pytest

from lockstep.moe.config import ModelConfig
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError

TOY = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"


def _train(capsys, tmp_path, *sets, config=TOY) -> tuple[int, str]:
    from lockstep.launch.cli import main

    argv = ["train", str(config), "--out", str(tmp_path / "run")]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    return code, capsys.readouterr().err


# --set overrides -> what the one-line error must say (each names its dotted key)
BAD = {
    ("rollout.temperature=1e-9",): r"rollout\.temperature=1e-09 is outside \[1e-06, 100\.0\]; "
                                   r"below 1e-06 an engine samples greedily",
    ("rollout={temperature: 0}",): r"rollout\.temperature=0\.0 is outside",
    ("rollout.top_p=1.5",): r"rollout\.top_p=1\.5 is outside \(0\.0, 1\.0\]",
    ("rollout.num_engines=0",): r"rollout\.num_engines=0 is outside \[1, 4096\]",
    ("rollout.weight_sync=tensor",): r"rollout\.weight_sync='tensor' does not apply to "
                                     r"rollout\.backend=embedded",
    ("rollout.url=http://a:1", "rollout.urls=[http://b:2]"): r"rollout\.url and rollout\.urls",
    ("rollout.sglang.ep_size=3", "rollout.sglang.tp_size=2"): r"rollout\.sglang\.ep_size=3 must "
                                                              r"divide",
    ("actor.weight_decay=-0.1",): r"actor\.weight_decay=-0\.1 is outside \[0\.0, 1\.0\]",
    ("actor.lr_schedule=exponential",): r"actor\.lr_schedule='exponential' is not one of "
                                        r"\['constant', 'cosine', 'linear', 'triggered'\]",
    ("actor.betas=[0.9]",): r"actor\.betas=\[0\.9\] must be two numbers",
    ("actor.megatron.pipeline_parallel=2",): r"actor\.megatron\.pipeline_parallel=2: actor\.megatron "
                                             r"options apply only to actor\.backend=megatron",
    ("actor.optimizer=sgd",): r"'actor\.optimizer': 'optimizer' is not a valid "
                                 r"key of actor; valid keys are \['backend'",
    ("loop.checkpoint_every=-1",): r"loop\.checkpoint_every=-1 is outside \[0, 2147483647\]",
    # a bound given as lt= is described open, as enforced: (0, 1) for the trigger's factor
    ("actor.lr_schedule=triggered", "actor.lr_trigger={k3_kl: 0.01, factor: 2}"):
        r"actor\.lr_trigger\.factor=2\.0 is outside \(0\.0, 1\.0\)$",
    # integers are bounded where they end up: a step count past int64 would overflow seeds
    ("loop.steps=9223372036854775808",): r"loop\.steps=9223372036854775808 is outside "
                                         r"\[1, 2147483647\]",
    ("loop.plots=maybe",): r"loop\.plots must be true or false, got 'maybe'",
    ("loop.seed=2147483648",): r"loop\.seed=2147483648 is outside \[0, 2147483647\]",
    ("cluster.device=tpu",): r"cluster\.device='tpu' is not one of \['auto', 'cpu', 'cuda'\]",
    ("cluster.nodes=2",): r"cluster\.nodes=2.*cluster\.ray_address",
    ("warmstart.eval_size=ten",): r"warmstart\.eval_size must be an integer, got 'ten'",
    ("data.train_files=[prompts.csv]",): r"data\.train_files: 'prompts\.csv' is neither",
    ("reward.num_workers=0",): r"yaml: reward\.num_workers=0 is outside \[1, 256\]",
    ("model.num_experts=0",): r"model: num_experts must be >= 1",
    ("model.router=top1",): r"model\.router='top1' is not one of \['softmax_topk', 'topk_softmax', "
                            r"'sigmoid', None\]",
    ("loss.loss_agg_mode=sum",): r"loss\.loss_agg_mode='sum' is not one of \['token-mean', ",
    ("correction.rollout_is=tokens",): r"correction\.rollout_is='tokens' is not one of "
                                       r"\['token', 'sequence', 'geometric', None\]",
    ("task.sort_length=64",): r"task\.sort_length must be an integer in \[1, 32\]",
    ("model.hidden_size=1000000000",): r"the 4,371\.00B-parameter policy \(model\.hidden_size="
                                       r"1000000000, .* would need [\d,]+\.\d GB but this "
                                       r"machine's memory is",
}


@pytest.mark.parametrize("sets", list(BAD), ids=[" ".join(s) for s in BAD])
def test_bad_config_is_one_line_naming_the_key(capsys, tmp_path, sets):
    import re

    code, err = _train(capsys, tmp_path, *sets)
    line = err.strip().removeprefix("error: ")
    assert code == 2 and "\n" not in err.strip(), err
    assert re.search(BAD[sets], line), line
    assert not (tmp_path / "run").exists()  # refused before the run directory (and any model)


def test_duplicate_key_in_the_file_is_one_line(capsys, tmp_path):
    bad = tmp_path / "dup.yaml"
    bad.write_text(TOY.read_text() + "\nloop:\n  steps: 3\n")
    code, err = _train(capsys, tmp_path, config=bad)
    assert code == 2 and "duplicate key 'loop' at lines" in err and "\n" not in err.strip()


def test_set_section_merges_into_the_file(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text("rollout:\n  prompts_per_step: 4\n  samples_per_prompt: 4\n  temperature: 0.7\n"
                 "actor:\n  backend: megatron\n  mini_batch_size: 16\n  micro_batch_size: 8\n"
                 "  megatron: {seed: 7}\n")
    cfg = load_config(p, ["rollout={temperature: 1.0, top_k: 5}",
                          "actor={lr: 1e-4, megatron: {seed: 9}}"])
    ro = cfg.rollout
    assert (ro.prompts_per_step, ro.samples_per_prompt, ro.temperature, ro.top_k) == (4, 4, 1.0, 5)
    assert (cfg.actor.mini_batch_size, cfg.actor.lr, cfg.actor.megatron.seed) == (16, 1e-4, 9)
    # a dict-valued field is a value, not a section: replaced as given
    cfg = load_config(None, ["model.model_type=deepseek_v3", "model.kv_lora_rank=16",
                             "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
                             "model.v_head_dim=8", "model.rope_scaling={rope_type: yarn, factor: 2}",
                             "model.rope_scaling={rope_type: yarn, factor: 4}"])
    assert cfg.model.rope_scaling == {"rope_type": "yarn", "factor": 4}


def test_one_temperature_rule_for_config_and_engine():
    from lockstep.rollout.sampling import SamplingTensors
    from lockstep.rollout.types import GREEDY_TEMPERATURE, SamplingParams

    assert load_config(None, [f"rollout.temperature={GREEDY_TEMPERATURE}"]).rollout.temperature \
        == GREEDY_TEMPERATURE
    with pytest.raises(ExperimentConfigError, match="samples greedily"):
        load_config(None, [f"rollout.temperature={GREEDY_TEMPERATURE / 10}"])
    # the engine's rule is the same constant: greedy exactly below it
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 10).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    st = SamplingTensors.build([GREEDY_TEMPERATURE / 10, GREEDY_TEMPERATURE], [-1, -1],
                               [1.0, 1.0], [0.0, 0.0], 16)
    assert st.greedy_B.tolist() == [True, False]


def test_data_files_may_be_a_string(tmp_path):
    folder = tmp_path / "policy"
    folder.mkdir()
    ModelConfig(vocab_size=64, eos_token_id=2, pad_token_id=0).save_json(folder / "config.json")
    base = [f"model.path={folder}", "warmstart.enabled=false", "rollout.max_new_tokens=8"]
    cfg = load_config(None, base + ["data.train_files=train.jsonl", "data.val_files=val.jsonl"])
    assert (cfg.data.train_files, cfg.data.val_files) == (["train.jsonl"], ["val.jsonl"])
    listed = load_config(None, base + ["data.train_files=[train.jsonl]",
                                       "data.val_files=[val.jsonl]"])
    assert cfg == listed and cfg.hash() == listed.hash()


def test_engine_buffers_are_estimated_before_allocation():
    from lockstep.moe.model import MoEModel
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig

    model = MoEModel(ModelConfig(vocab_size=16, max_position_embeddings=10**9))
    with pytest.raises(ValueError, match=r"KV cache and sequence buffers \(64 slots x max_len "
                                         r"1000000000 tokens x 3 layers\) would need [\d,]+\.\d "
                                         r"GB .*lockstep serve --max-len"):
        Engine(model, EngineConfig())
    assert Engine(model, EngineConfig(max_len=64)).max_len == 64  # a bounded engine builds
