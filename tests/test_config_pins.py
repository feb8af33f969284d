"""Pins of what a config change must not move: the run hash (checkpoints of existing runs resume
only under the same hash) and the bytes `save_config` writes (a run directory's config.yaml),
measured on the code before the config moved to pydantic models."""

import hashlib
from pathlib import Path

import pytest

from lockstep.trainer.config.load import load_config, save_config
from lockstep.trainer.loop import run_hash

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# (config file, overrides) -> (run_hash, run_hash(layout=True), cfg.hash(), sha256 of config.yaml)
PINS = {
    ('toy_r3', ()):
        ('cdcd402a3f2def5a', 'cdcd402a3f2def5a', 'ca2ee681cb752ec3', 'c9529d23c493f235'),
    ('toy_r2', ()):
        ('dbf85c7bbd6b4e38', 'dbf85c7bbd6b4e38', '67005a7c3537fe3e', '74f17b784d063aaf'),
    ('toy_off', ()):
        ('cb5f18ad2a0dbf4b', 'cb5f18ad2a0dbf4b', '0479197ef6cb0693', '83f5fd7e026603b8'),
    ('study_routing', ()):
        ('25dbaf69230bf50a', '25dbaf69230bf50a', '754a51f9afa059ee', '72bd033a72cc7a7d'),
    ('study_routing_top2', ()):
        ('8b5e29a6ba274aeb', '8b5e29a6ba274aeb', 'f9a78ce9b7ed8d63', 'e279b88a069d212c'),
    ('cluster_qwen3_30b_a3b', ()):
        ('3f76706997330e99', '2d5352e5de023e2f', '89b0c5ae29052e6d', 'ec40f7b59dc3e855'),
    ('cluster_qwen3_30b_a3b_colocated', ()):
        ('36e2bf99b3098203', 'df59e4f5bad9aa36', '81053dace0948b91', 'cc1f4ba39ebc3f18'),
    ('toy_r3', ('actor.backend=megatron', 'actor.megatron.expert_parallel=2', 'actor.megatron.virtual_pipeline_parallel=2', 'actor.megatron.pipeline_parallel=3', 'rollout.top_p=0.9', 'loop.max_staleness=2')):
        ('7d2fd792dc150081', 'ccac74c322243940', '394a7ac7ce2b5b50', 'a13cb5c166cf7ffb'),
    ('toy_r3', ('rollout.backend=http', 'rollout.urls=[http://a:1, http://b:2]', 'rollout.weight_sync=tensor', 'rollout.request_timeout_s=5', 'cluster.actor_ranks=2', 'cluster.nodes=2', 'cluster.ray_address=auto', 'rollout.api_key_file=/tmp/k', 'rollout.sampling_mask_replay=true')):
        ('9a71a722d9b3fd65', '5a78530db8e59739', '86f832c2d1f250ed', 'daaad1003d52c255'),
    ('toy_r3', ('correction.rollout_is=token', 'correction.rollout_is_threshold=1_5', 'loss.kl_coef=0.1', 'task.name=sort', 'warmstart.lr=1e-3', 'model.model_type=qwen2_moe', 'model.shared_expert_intermediate_size=48', 'model.mlp_only_layers=[0]', 'actor.betas=[0.8, 0]')):
        ('69ea39f5a194a9c5', '69ea39f5a194a9c5', '95f58ef99f961992', 'd8202bcc9786ed70'),
    ('toy_r3', ('rollout.backend=sglang', 'rollout.sglang.tp_size=2', 'rollout.num_engines=2', 'rollout.sglang.extra_args=[--x]', 'cluster.gpus_per_node=8', 'correction.rollout_rs=token_k1', 'correction.rollout_rs_threshold=2.0')):
        ('d108bc49102690f0', 'd108bc49102690f0', '57b20068ede78aed', '45ad2b7061c7d9a1'),
}


@pytest.mark.parametrize("name,overrides", list(PINS))
def test_run_hash_and_saved_config_are_pinned(tmp_path, name, overrides):
    cfg = load_config(CONFIGS / f"{name}.yaml", list(overrides))
    save_config(cfg, tmp_path / "config.yaml")
    saved = hashlib.sha256((tmp_path / "config.yaml").read_bytes()).hexdigest()[:16]
    assert (run_hash(cfg), run_hash(cfg, layout=True), cfg.hash(), saved) == PINS[name, overrides]
    assert load_config(tmp_path / "config.yaml") == cfg


def test_the_compatibility_markers_each_do_what_they_say():
    """One rule (trainer/config/types.py): a `saved: non_default` field is saved (and hashed)
    only away from its default, a `hashed: False` one never moves the hash, a
    `hashed: non_default` one is saved always and hashed only away from its default."""
    base = load_config(CONFIGS / "toy_r3.yaml", [])
    moved = {s: load_config(CONFIGS / "toy_r3.yaml", [s]) for s in (
        "replay.bias_meter_rows=0.5",        # saved: non_default
        "rollout.request_timeout_s=5",       # saved: non_default, hashed: False
        "rollout.sampling_mask_replay=true")}  # hashed: non_default
    assert "bias_meter_rows" not in base.to_dict()["replay"]
    assert moved["replay.bias_meter_rows=0.5"].to_dict()["replay"]["bias_meter_rows"] == 0.5
    assert moved["replay.bias_meter_rows=0.5"].hash() != base.hash()
    assert moved["rollout.request_timeout_s=5"].to_dict()["rollout"]["request_timeout_s"] == 5
    assert moved["rollout.request_timeout_s=5"].hash() == base.hash()
    assert "sampling_mask_replay" in base.to_dict()["rollout"]
    assert moved["rollout.sampling_mask_replay=true"].hash() != base.hash()
    gpt_oss = ["model.model_type=gpt_oss", "model.intermediate_size=96"]  # saved: family_default
    family = load_config(CONFIGS / "toy_r3.yaml", gpt_oss)
    assert family.model.swiglu_limit == 7.0 and "swiglu_limit" not in family.to_dict()["model"]
    other = load_config(CONFIGS / "toy_r3.yaml", [*gpt_oss, "model.swiglu_limit=5.0"])
    assert other.to_dict()["model"]["swiglu_limit"] == 5.0
