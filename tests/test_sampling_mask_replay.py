"""Sampling-mask replay in the RL loop: with top-p / top-k the rollout log-probs are those of
the truncated, renormalised distribution, and the actor recomputes over the same kept sets, so
an fp32 engine and an fp32 actor with the same weights give IS ratio 1 (not the kept mass).

Shapes: B batch rows, T padded time, S most kept candidates.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from lockstep.replay import old_logprob_plan
from lockstep.rollout.types import GenerationResult
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.types import ExperimentConfigError
from lockstep.trainer.loop import Trainer, run_hash

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# the toy job, small, with an fp32 engine so engine and actor agree to rounding
SMALL = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
         "actor.mini_batch_size=32", "actor.micro_batch_size=16", "loop.steps=1",
         "loop.tensorboard=false", "loop.plots=false", "rollout.dtype=fp32"]


def _trainer(tmp_path, *extra):
    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + list(extra))
    return Trainer(cfg, tmp_path / "run", progress=False, log=lambda s: None)


def _results(tr, step=1):
    prompts = tr.source.prompts(0, tr.cfg.rollout.prompts_per_step)
    reqs = tr.requests(prompts, step)
    assert all(r.return_sampling_mask == tr.cfg.rollout.mask_replay for r in reqs)
    return tr.rollout.generate(reqs)


@pytest.mark.parametrize("trunc", ["rollout.top_p=0.8", "rollout.top_k=3"])
def test_old_logprobs_equal_truncated_rollout_logprobs(tmp_path, trunc):
    tr = _trainer(tmp_path, trunc)
    assert tr.cfg.rollout.mask_replay  # on by itself when sampling is truncated
    results = _results(tr)
    batch = collate(results, tr.task.pad_id, *tr._route_shape(), sampling_mask=True,
                    vocab_size=tr.cfg.model.vocab_size)
    resp = batch.response_mask_BT
    cand = batch.candidates_BTS
    assert cand.dtype == torch.int16 and cand.shape[:2] == resp.shape
    truncated_BT = resp & (cand >= 0).any(-1)
    assert truncated_BT.sum() > 0.5 * resp.sum()  # most response tokens had a truncated set
    assert not (cand >= 0).any(-1)[~resp].any()   # prompt and padding: no restriction
    plan = old_logprob_plan("R3", batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
    old = tr.actor.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT)
    # with the kept sets replayed: ratio 1 at every response token
    assert (old.logprobs_BT - batch.rollout_logprobs_BT)[resp].abs().max() < 1e-5
    # the full-vocabulary log-prob matches the engine's full-vocabulary one ...
    full_batch = dataclasses.replace(batch, candidates_BTS=None)
    full = tr.actor.logprobs(full_batch, plan.routes_BTLK, plan.replay_mask_BT)
    engine_full_BT = torch.zeros_like(full.logprobs_BT)
    for b, r in enumerate(results):
        engine_full_BT[b, r.prompt_tokens:r.prompt_tokens + r.completion_tokens] = r.output_logprobs
    assert (full.logprobs_BT - engine_full_BT)[resp].abs().max() < 1e-5
    # ... but against the truncated rollout log-prob its ratio is the kept mass, < 1
    ratio_BT = (full.logprobs_BT - batch.rollout_logprobs_BT).exp()
    assert ratio_BT[truncated_BT].max() < 0.999 and ratio_BT[truncated_BT].min() > 0


def test_loop_step_ratios_are_one_in_old_logprob_and_update(tmp_path):
    """The whole step: mismatch (pi_old / mu) and the on-policy update forwards (pi_theta /
    pi_old, one mini-batch: no optimiser step before them) are both over the kept sets."""
    tr = _trainer(tmp_path, "rollout.top_p=0.8")
    seen = {}  # the batches the real actor got (the step itself runs unchanged)
    for name in ("logprobs", "update"):
        def spy(batch, *a, _f=getattr(tr.actor, name), _n=name, **k):
            seen[_n] = batch
            return _f(batch, *a, **k)
        setattr(tr.actor, name, spy)
    m = tr.step(1)
    for name in ("logprobs", "update"):
        assert (seen[name].candidates_BTS >= 0).any(-1)[seen[name].response_mask_BT].all(), name
    for part in ("mismatch", "staleness", "total"):
        assert abs(m[f"is_split/{part}_max"] - 1) < 1e-4, part
        assert abs(m[f"is_split/{part}_min"] - 1) < 1e-4, part


def test_http_backend_step_replays_the_masks_the_server_returned(tmp_path):
    """The same over a real SGLang-wire server on loopback: the masks and "selected" sampling
    log-probs come back over HTTP, and the step's ratios are still 1."""
    from lockstep.moe.model import MoEModel
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.server import ServerThread

    cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + ["rollout.top_k=3"])
    engine = Engine(MoEModel(cfg.model), EngineConfig(dtype="fp32", max_running=32, max_len=16,
                                                      seed=cfg.loop.seed))
    with ServerThread(engine) as srv:
        cfg = load_config(CONFIGS / "toy_r3.yaml", SMALL + [
            "rollout.top_k=3", "rollout.backend=http", f"rollout.url={srv.url}"])
        tr = Trainer(cfg, tmp_path / "http", progress=False, log=lambda s: None)
        m = tr.step(1)
    for part in ("mismatch", "total"):
        assert abs(m[f"is_split/{part}_max"] - 1) < 1e-4, part
        assert abs(m[f"is_split/{part}_min"] - 1) < 1e-4, part


def test_collate_needs_masks_and_logprobs_for_every_sample(tmp_path):
    tr = _trainer(tmp_path, "rollout.top_k=3")
    results = _results(tr)
    V = tr.cfg.model.vocab_size
    bad = list(results)
    bad[2] = dataclasses.replace(results[2], sampling_mask=None)
    with pytest.raises(ValueError, match="sample 2: sampling-mask replay needs a sampling mask"):
        collate(bad, tr.task.pad_id, *tr._route_shape(), sampling_mask=True, vocab_size=V)
    bad[2] = dataclasses.replace(results[2], sampling_logprobs=None)
    with pytest.raises(ValueError, match="sample 2: sampling-mask replay needs sampling_logprobs"):
        collate(bad, tr.task.pad_id, *tr._route_shape(), sampling_mask=True, vocab_size=V)
    r: GenerationResult = results[1]
    mask = list(r.sampling_mask)
    tok = r.output_ids[0]
    mask[0] = torch.tensor([i for i in range(V) if i != tok][:3], dtype=torch.int32)
    bad[2] = results[2]
    bad[1] = dataclasses.replace(r, sampling_mask=mask)
    with pytest.raises(ValueError,
                       match=f"sample 1, output token 0: kept ids .* miss the sampled id {tok}"):
        collate(bad, tr.task.pad_id, *tr._route_shape(), sampling_mask=True, vocab_size=V)


def test_truncated_sampling_with_mask_replay_off_is_refused():
    for field, value in (("top_p", 0.9), ("top_k", 5)):
        with pytest.raises(ExperimentConfigError,
                           match=rf"rollout\.{field}={value}: truncated sampling needs "
                                 r"sampling-mask replay, but rollout\.sampling_mask_replay=false"):
            load_config(CONFIGS / "toy_r3.yaml", [f"rollout.{field}={value}",
                                                  "rollout.sampling_mask_replay=false"])


def test_mask_replay_default_and_hash():
    base = load_config(CONFIGS / "toy_r3.yaml")
    assert not base.rollout.mask_replay  # full-distribution sampling: nothing to replay
    assert load_config(CONFIGS / "toy_r3.yaml", ["rollout.top_k=3"]).rollout.mask_replay
    forced = load_config(CONFIGS / "toy_r3.yaml", ["rollout.sampling_mask_replay=true"])
    assert forced.rollout.mask_replay
    # unset leaves the run hash as before the field existed; an explicit value changes it
    d = base.to_dict()
    assert d["rollout"].pop("sampling_mask_replay") is None
    d["actor"].pop("megatron")  # a default section is left out too
    d["rollout"].pop("api_key_file")  # hashed as when the (null) key was a config field
    d["rollout"]["api_key"] = None
    d["model"].pop("path"), d.pop("data"), d.pop("reward")  # (as are these when unset)
    d["loop"].pop("max_staleness")  # (and a synchronous loop)
    assert base.hash() == hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()
                                         ).hexdigest()[:16]
    assert run_hash(forced) != run_hash(base)
    with pytest.raises(ExperimentConfigError, match="rollout.sampling_mask_replay must be"):
        load_config(CONFIGS / "toy_r3.yaml", ["rollout.sampling_mask_replay=3"])


@pytest.mark.megatron
def test_megatron_actor_replays_the_kept_sets_like_the_torch_actor():
    pytest.importorskip("megatron.core")
    import copy

    from lockstep.moe.config import ModelConfig
    from lockstep.moe.model import MoEModel
    from lockstep.trainer.actor.batch import Batch
    from lockstep.trainer.actor.megatron.actor import MegatronActor
    from lockstep.trainer.actor.torch_actor import TorchActor
    from lockstep.trainer.config.sections import ActorConfig

    cfg = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MoEModel(cfg)
    B, T, P, S = 4, 8, 3, 5
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    lens = torch.tensor([8, 7, 8, 6])
    t_T = torch.arange(T)
    ids[t_T[None] >= lens[:, None]] = 0
    resp = (t_T[None] >= P) & (t_T[None] < lens[:, None])
    cand = torch.full((B, T, S), -1, dtype=torch.int16)
    others = torch.rand(B, T, cfg.vocab_size, generator=g).argsort(-1)[..., :S - 1]
    cand[..., 0] = ids
    cand[..., 1:] = torch.where(others == ids[..., None], -1, others).to(torch.int16)
    cand[~resp] = -1
    cand[0, P] = -1  # one response token sampled from the whole vocabulary
    batch = Batch(ids, resp, torch.zeros(B, T), lens, candidates_BTS=cand)
    acfg = ActorConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2)
    ta = TorchActor(copy.deepcopy(model), acfg, total_updates=1)
    ma = MegatronActor(copy.deepcopy(model), acfg, total_updates=1)
    t_lp, m_lp = ta.logprobs(batch), ma.logprobs(batch)
    assert (t_lp.logprobs_BT - m_lp.logprobs_BT)[resp].abs().max() < 1e-4
    assert (t_lp.entropy_BT - m_lp.entropy_BT)[resp].abs().max() < 1e-4
    full = ta.logprobs(dataclasses.replace(batch, candidates_BTS=None))
    diff_BT = (t_lp.logprobs_BT - full.logprobs_BT).abs()
    assert diff_BT[resp].max() > 0.1 and diff_BT[0, P] < 1e-6
    mask = resp.float()

    def loss_fn(lp_bT, ent_bT, rows, mini):
        return -(lp_bT * mask[rows]).sum() / mask[mini].sum(), {}
    for actor in (ta, ma):
        actor.update(batch, loss_fn)
    after_t, after_m = ta.logprobs(batch).logprobs_BT, ma.logprobs(batch).logprobs_BT
    assert (after_t - after_m)[resp].abs().max() < 1e-4
    assert (after_t - t_lp.logprobs_BT)[resp].abs().max() > 1e-3  # the step did move them
