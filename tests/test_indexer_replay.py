"""Indexer replay end to end: the embedded engine records each DSA layer's picks as the full
forward makes them, they travel on SGLang's wire (`return_indexer_topk`, int32 or compact), and
(tests further down) the actor replays them."""

import pytest
import torch

from lockstep.moe.checkpoint import load_hf
from lockstep.moe.config import ModelConfig
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams

from arch_fixtures import write_hf_folder

PROMPTS = ((5, 9, 1, 7, 3), (5, 9), (3, 4, 8, 8, 1, 2))


def _requests(start=0):
    return [GenerateRequest(list(p), SamplingParams(max_new_tokens=9, seed=i, n=2),
                            return_indexer_topk=True, indexer_start=min(start, len(p)))
            for i, p in enumerate(PROMPTS)]


def _check(results, model):
    for r in results:
        ids = torch.tensor(r.prompt_ids + r.output_ids)[None]
        with torch.no_grad():
            want = model(ids).indexer_BTLK[0, r.indexer.start:len(ids[0]) - 1]
        assert torch.equal(r.indexer.to_int64(), want)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_engine_records_the_picks_of_the_full_forward(family, tmp_path):
    """Prefill and cached decode (the indexer's key cache) pick what one full forward over
    prompt + completion picks, row for row (fp32)."""
    model = load_hf(write_hf_folder(family, tmp_path / family)).eval()
    engine = Engine.from_model(model, EngineConfig(dtype="fp32", max_len=64, max_running=8))
    _check(engine.generate(_requests()), model)


def test_picks_on_the_wire(tmp_path):
    """`lockstep serve`'s /generate answers return_indexer_topk in SGLang's int32 layout and in
    the compact one, from a start position too; the client decodes both."""
    from lockstep.rollout.client import HTTPBackend
    from lockstep.rollout.server import ServerThread

    folder = write_hf_folder("glm_moe_dsa", tmp_path / "g")
    model = load_hf(folder).eval()
    engine = Engine.from_hf(folder, EngineConfig(dtype="fp32", max_len=64, max_running=8))
    cfg = ModelConfig.from_json(folder)
    with ServerThread(engine, model_path=str(folder)) as srv:
        for compact in (False, True):
            http = HTTPBackend(srv.url, cfg, compact_routes=compact)
            _check(http.generate(_requests()), model)
            later = http.generate(_requests(start=3))
            assert [r.indexer.start for r in later] == [3, 3, 2, 2, 3, 3]
            _check(later, model)


def test_indexer_request_on_a_model_without_one_is_refused(tmp_path):
    from lockstep.rollout.types import RequestError

    model = load_hf(write_hf_folder("deepseek_v3", tmp_path / "d")).eval()
    engine = Engine.from_model(model, EngineConfig(dtype="fp32", max_len=32, max_running=2))
    with pytest.raises(RequestError, match="has no lightning indexer"):
        engine.generate(_requests())


def _dsa_engine_batch(tmp_path, family="deepseek_v32"):
    """fp32 engine results of a DSA model, collated; and an actor copy of the model whose
    indexers are perturbed (its own picks differ from the engine's, nothing else does)."""
    import copy

    from lockstep.trainer.actor.batch import collate

    model = load_hf(write_hf_folder(family, tmp_path / family)).eval()
    engine = Engine.from_model(model, EngineConfig(dtype="fp32", max_len=64, max_running=8))
    reqs = [GenerateRequest(list(p), SamplingParams(max_new_tokens=12, seed=i, n=2,
                                                    ignore_eos=True), return_indexer_topk=True)
            for i, p in enumerate(PROMPTS)]
    cfg = model.cfg
    batch = collate(engine.generate(reqs), 0, cfg.num_experts, cfg.num_moe_layers,
                    cfg.num_experts_per_tok)
    actor_model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in actor_model.layers:
            if layer.self_attn.indexer is not None:
                w = layer.self_attn.indexer.wk.weight
                w.add_(0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(9)))
    return batch, actor_model


def _old_logprobs(actor_model, batch, indexer, mode="R3"):
    import copy

    from lockstep.replay import ReplayOptions
    from lockstep.trainer.actor.torch_actor import TorchActor
    from lockstep.trainer.config.sections import ActorConfig

    actor = TorchActor(copy.deepcopy(actor_model), ActorConfig(mini_batch_size=6,
                       micro_batch_size=6), total_updates=1, replay=ReplayOptions(indexer=indexer))
    return actor.old_logprobs(batch, mode, step=1)


def test_r3_indexer_replay_gives_the_engines_logprobs_and_catches_misaligned_picks(tmp_path):
    """The actor's indexers differ from the engine's; under replay.indexer=r3 (and routing R3)
    its old log-probs are the engine's rollout log-probs; picks shifted by one position, or
    taken from the other sample of the prompt, are not, and neither is replay.indexer=off."""
    import dataclasses

    batch, actor_model = _dsa_engine_batch(tmp_path)
    resp = batch.response_mask_BT

    def diff(b, indexer="r3"):
        old = _old_logprobs(actor_model, b, indexer)
        return float((old.logprobs_BT - batch.rollout_logprobs_BT)[resp].abs().max()), old

    good, old = diff(batch)
    assert good < 1e-5
    assert old.stats["indexer/flip_rate"][0] > 0  # the actor's own indexers would pick others
    off, _ = diff(batch, "off")
    assert off > 1e-3
    picks, valid = batch.rollout_indexer_BTLK, batch.rollout_indexer_valid_BT
    # row t gets row t-1's picks (a position still causal for t): an off-by-one alignment
    shifted = torch.cat([picks[:, :1], picks[:, :-1]], 1)
    assert diff(dataclasses.replace(batch, rollout_indexer_BTLK=shifted))[0] > 1e-3
    # sample b gets sample b^1's picks (the other sample of its prompt: same prompt rows)
    other = picks[torch.arange(batch.size) ^ 1]
    both = valid & valid[torch.arange(batch.size) ^ 1]
    swapped = torch.where(both[..., None, None], other, picks)
    assert diff(dataclasses.replace(batch, rollout_indexer_BTLK=swapped))[0] > 1e-3


def test_r2_updates_replay_the_old_logprob_forwards_picks(tmp_path):
    """replay.indexer=r2: pi_old picks freely and its picks are kept; every update forward
    replays them, row for row (its micro-batch's rows and time)."""
    import copy

    from lockstep.replay import ReplayOptions
    from lockstep.trainer.actor.rank import UpdateInputs
    from lockstep.trainer.actor.torch_actor import TorchActor
    from lockstep.trainer.config.sections import ActorConfig
    from lockstep.trainer.objective.correction import CorrectionConfig
    from lockstep.trainer.objective.losses import LossConfig

    batch, actor_model = _dsa_engine_batch(tmp_path, "glm_moe_dsa")
    actor = TorchActor(copy.deepcopy(actor_model), ActorConfig(mini_batch_size=3,
                       micro_batch_size=3), total_updates=2, replay=ReplayOptions(indexer="r2"))
    own = actor.logprobs(batch).indexer_BTLK  # what pi_old's indexers pick
    seen = []
    real_forward = actor._forward

    def spy(b, routes, mask, gates, rows, what):
        seen.append((what, rows, b.recorded_indexer_BTLK))
        return real_forward(b, routes, mask, gates, rows, what)

    actor._forward = spy
    old = actor.old_logprobs(batch, "R2", step=1)
    assert torch.equal(actor._kept_picks[1], own)
    B, T = batch.input_ids_BT.shape
    inputs = UpdateInputs(old.logprobs_BT, torch.randn(B, T) * batch.response_mask_BT,
                          batch.response_mask_BT.float(), None, 0, LossConfig(),
                          CorrectionConfig())
    actor.policy_update(batch, inputs, "R2", step=1)
    updates = [(rows, picks) for what, rows, picks in seen if what == "update forward"]
    assert len(updates) == 2
    for rows, picks in updates:
        assert torch.equal(picks, own[rows, :picks.shape[1]])


def test_replay_indexer_needs_a_dsa_model():
    from lockstep.moe.checks import ConfigError
    from lockstep.trainer.config.load import load_config
    from pathlib import Path

    toy = Path(__file__).parents[1] / "configs" / "toy_r3.yaml"
    with pytest.raises(ConfigError, match="replay.indexer=r3 replays lightning-indexer picks, "
                                          "but model_type qwen3_moe has no indexer"):
        load_config(toy, ["replay.indexer=r3"])


DSA_TOY = ["model.model_type=deepseek_v32", "model.num_key_value_heads=4",
           "model.first_k_dense_replace=1", "model.q_lora_rank=48", "model.kv_lora_rank=32",
           "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
           "model.index_topk=4", "model.index_head_dim=16", "model.index_n_heads=4",
           "warmstart.enabled=false", "loop.steps=2", "rollout.prompts_per_step=8",
           "loop.dump_every=2"]


@pytest.mark.slow
def test_dsa_toy_trains_with_indexer_replay_and_diagnose_reports_it(tmp_path):
    """Two RL steps of a DeepSeek-V3.2-style toy with R3 routing and replay.indexer=r3 (bf16
    engine, fp32 actor): the indexer flip rate is logged beside the routing one, replay
    mismatch is 0, and `lockstep diagnose` of the step's dump reports the logged value."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    toy = Path(__file__).parents[1] / "configs" / "toy_r3.yaml"
    run = tmp_path / "run"
    sets = [a for kv in DSA_TOY + ["replay.indexer=r3"] for a in ("--set", kv)]
    subprocess.run([sys.executable, "-m", "lockstep.launch.cli", "train", str(toy), "--out",
                    str(run), *sets], check=True, capture_output=True)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("indexer/flip_rate" in r and r["replay/mismatch"] == 0 for r in rows)
    assert 0 < rows[-1]["indexer/flip_rate"] < 0.2
    subprocess.run([sys.executable, "-m", "lockstep.launch.cli", "diagnose", "--dump",
                    str(run / "dumps" / "step_2.safetensors"), "--out", str(tmp_path / "d")],
                   check=True, capture_output=True)
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["metrics"]["indexer/flip_rate"] == pytest.approx(rows[-1]["indexer/flip_rate"],
                                                                   rel=1e-5)
