"""Prompt data sets: verl's columns from JSONL and Parquet, chat template, length filter,
seeded per-epoch order and the cursor; the config rules of a data-set run."""

from __future__ import annotations

import json

import pytest

from data_fixtures import CHAT_TEMPLATE, build_tokenizer, word_problems, write_jsonl
from lockstep.rollout.rewards import RewardConfig
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.config.sections import DataConfig
from lockstep.trainer.driver.data import DatasetSource, encode_prompt, load_prompts

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    rows = word_problems(12, 0)
    build_tokenizer(root, [json.dumps(r["prompt"]) for r in rows] * 4)
    return root


def test_jsonl_and_parquet_give_the_same_prompts(folder, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from lockstep.trainer.driver.data import load_tokenizer

    tok = load_tokenizer(folder)
    rows = word_problems(8, 3)
    chat = [r for r in rows if not isinstance(r["prompt"], str)]  # Parquet: one column type
    jsonl = write_jsonl(tmp_path / "p.jsonl", chat)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(chat), parquet)
    a = load_prompts([str(jsonl)], tok, 512, "train", log=lambda s: None)
    b = load_prompts([str(parquet)], tok, 512, "train", log=lambda s: None)
    assert [(p.ids, p.ground_truth, p.data_source) for p in a] == \
           [(p.ids, p.ground_truth, p.data_source) for p in b]
    # chat messages go through the chat template with the generation prompt; strings do not
    text = tok.decode(list(a[0].ids))
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    mixed = load_prompts([str(write_jsonl(tmp_path / "m.jsonl", rows))], tok, 512, "train",
                         log=lambda s: None)
    assert tok.decode(list(mixed[3].ids)) == rows[3]["prompt"]
    assert CHAT_TEMPLATE == tok.chat_template


def test_bad_rows_are_named(folder, tmp_path):
    from lockstep.trainer.driver.data import load_tokenizer

    tok = load_tokenizer(folder)
    good = word_problems(2, 0)
    cases = [({"data_source": "x", "reward_model": {"ground_truth": "1"}}, "no 'prompt' column"),
             ({"prompt": "hi", "reward_model": {"style": "rule"}}, "needs reward_model.ground_truth"),
             ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}},
              "prompt must be a string or a non-empty list")]
    for bad, msg in cases:
        path = write_jsonl(tmp_path / "bad.jsonl", good + [bad])
        with pytest.raises(ValueError, match=rf"bad.jsonl: row 3: {msg}"):
            load_prompts([str(path)], tok, 512, "train", log=lambda s: None)
    (tmp_path / "torn.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"torn.jsonl:2: not valid JSON"):
        load_prompts([str(tmp_path / "torn.jsonl")], tok, 512, "train")
    with pytest.raises(ValueError, match="no prompt is at most data.max_prompt_length=3"):
        load_prompts([str(write_jsonl(tmp_path / "g.jsonl", good))], tok, 3, "train",
                     log=lambda s: None)
    tok.chat_template = None
    with pytest.raises(ValueError, match="need a chat template"):
        encode_prompt(tok, good[0]["prompt"], "here")


def test_epoch_order_is_seeded_and_the_cursor_wraps(folder, tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", word_problems(10, 0))
    cfg = DataConfig(train_files=[str(train)])
    src = DatasetSource(cfg, RewardConfig(num_workers=1), str(folder), seed=5, log=lambda s: None)
    try:
        e0, e1 = src.order(0), src.order(1)
        assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1
        again = DatasetSource(cfg, RewardConfig(num_workers=1), str(folder), seed=5,
                              log=lambda s: None)
        assert again.order(1) == e1 and again.order(0) == e0
        again.close()
        # cursor 8..11 = the last two of epoch 0, then the first two of epoch 1
        got = src.prompts(8, 4)
        want = [src.train[i] for i in (e0[8], e0[9], e1[0], e1[1])]
        assert got == want
        assert src.pad_id == src.tokenizer.pad_token_id
    finally:
        src.close()


def test_data_run_config_rules(folder, tmp_path):
    train = str(write_jsonl(tmp_path / "t.jsonl", word_problems(4, 0)))
    base = [f"data.train_files=[{train}]", "rollout.max_new_tokens=8"]
    with pytest.raises(ExperimentConfigError, match="data.train_files needs model.path"):
        load_config(None, base + ["warmstart.enabled=false"])
    # a model folder: the architecture comes from its config.json
    from lockstep.moe.checkpoint import save_hf
    from lockstep.moe.model import MoEModel
    from lockstep.trainer.config.load import save_config
    from model_fixtures import tiny_config as tiny

    save_hf(MoEModel(tiny()), tmp_path / "m")
    m = [f"model.path={tmp_path / 'm'}"]
    # unset, a data run's warm start is off (tests/test_config_defaults.py); set, refused
    assert not load_config(None, base + m).warmstart.enabled
    with pytest.raises(ExperimentConfigError, match="warmstart.enabled=true: the warm start"):
        load_config(None, base + m + ["warmstart.enabled=true"])
    cfg = load_config(None, base + m + ["warmstart.enabled=false"])
    assert cfg.model.vocab_size == tiny().vocab_size and cfg.model.path == str(tmp_path / "m")
    save_config(cfg, tmp_path / "c.yaml")  # a saved config repeats the folder's fields
    assert load_config(tmp_path / "c.yaml") == cfg
    with pytest.raises(ExperimentConfigError, match=r"model.hidden_size=64 \(the folder has 32\)"):
        load_config(None, base + m + ["warmstart.enabled=false", "model.hidden_size=64"])
    # unset lengths are taken from the data at start; one that fills the context is refused
    assert load_config(None, [f"data.train_files=[{train}]"] + m).rollout.max_new_tokens is None
    context = cfg.model.max_position_embeddings
    with pytest.raises(ExperimentConfigError, match=rf"rollout.max_new_tokens={context} leaves "
                                                    "no room .* for the prompt"):
        load_config(None, [f"data.train_files=[{train}]", f"rollout.max_new_tokens={context}"] + m)
    with pytest.raises(ExperimentConfigError, match="the reward section applies to data sets"):
        load_config(None, ["reward.function=math_verify"])
    with pytest.raises(ExperimentConfigError, match="loop.val_every=2 needs data.val_files"):
        load_config(None, ["loop.val_every=2"])
    with pytest.raises(ExperimentConfigError, match="neither .jsonl nor .parquet"):
        load_config(None, ["data.train_files=[a.csv]"])
