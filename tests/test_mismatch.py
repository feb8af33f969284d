"""Engine-side injected mismatch (rollout/mismatch.py): deterministic, batch-independent noise,
calibrated to a flip rate, the engine's alone."""

import copy

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.replay.route_divergence import routing_divergence
from lockstep.rollout import mismatch as MM
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig

from model_fixtures import tiny_config

CFG = tiny_config(vocab_size=24, hidden_size=32, num_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=8, max_position_embeddings=40, num_hidden_layers=4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = MoEModel(CFG)
    with torch.no_grad():  # router logits of a trained model's spread, not bf16-rounded ties
        for block in m.moe_blocks:
            block.gate.weight.mul_(40)
    return m


def _reqs(n_req, seed0, n=4, rid="r"):
    g = torch.Generator().manual_seed(seed0)
    return [GenerateRequest(torch.randint(3, 24, (int(torch.randint(3, 9, (1,), generator=g)),),
                                          generator=g).tolist(),
                            SamplingParams(max_new_tokens=8, seed=seed0 * 1000 + 10 * i, n=n),
                            rid=f"{rid}{i}") for i in range(n_req)]


def _engine(model, **kw):
    return Engine.from_model(model, EngineConfig(dtype="bf16", max_len=40, exact=True, **kw))


def _batch(results):
    return collate(results, CFG.pad_token_id, CFG.num_experts, CFG.num_moe_layers,
                   CFG.num_experts_per_tok)


def _actor(model):
    cfg = ActorConfig(dtype="bf16", micro_batch_size=64, mini_batch_size=64)
    return TorchActor(copy.deepcopy(model), cfg, total_updates=1, exact=True)


def test_noise_is_a_pure_function_of_its_keys():
    seed = torch.tensor([5, 5, 6, 2**62 + 5])
    pos = torch.arange(4)
    a = MM.normal(seed[:, None], pos[None, :])
    assert torch.equal(a, MM.normal(seed[:, None], pos[None, :]))
    assert torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2]) and not torch.equal(a[0], a[3])
    z = MM.normal(torch.arange(200)[:, None], torch.arange(500)[None, :])
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02


def test_injected_routes_do_not_depend_on_the_batch(model):
    mine = _reqs(2, 1)
    alone = {(r.rid, r.index): r for r in _engine(model, router_noise=0.004).generate(mine)}
    crowd = _engine(model, router_noise=0.004, max_running=5).generate(_reqs(3, 2, rid="o") + mine)
    for r in crowd:
        if (r.rid, r.index) in alone:
            a = alone[(r.rid, r.index)]
            assert r.output_ids == a.output_ids
            assert torch.equal(r.routes_NLK, a.routes_NLK)
            assert torch.equal(r.output_logprobs, a.output_logprobs)


def test_calibrated_flip_rate_is_measured_by_the_actor_and_its_routes_untouched(model):
    eng = _engine(model)
    b0 = _batch(eng.generate(_reqs(8, 3)))
    actor = _actor(model)
    rates = []
    for target in (0.03, 0.12):
        cal = MM.calibrate(eng.model, b0.input_ids_BT, b0.rollout_routes_valid_BT, target)
        assert abs(cal.measured - target) <= 0.03 * target
        eng.set_mismatch(router_noise=cal.sigma)
        b = _batch(eng.generate(_reqs(8, 4)))
        out = actor.logprobs(b)
        m = routing_divergence(b.rollout_routes_BTLK, out.natural_BTLK, b.rollout_routes_valid_BT)
        rates.append(m["routing/flip_rate"])
        assert abs(m["routing/flip_rate"] - target) < 0.35 * target, (target, m)
        # the actor's routes are its own router's on the engine's tokens: a clean forward's
        with torch.no_grad():
            clean = actor.compute(b.input_ids_BT, compute_logits=False).natural_BTLK
        v = b.rollout_routes_valid_BT
        assert torch.equal(out.natural_BTLK.long()[v], clean[v])
        assert not torch.equal(b.rollout_routes_BTLK.long()[v], clean[v])
    assert rates[0] < rates[1]


def test_logprob_noise_raises_k3_and_is_deterministic(model):
    actor = _actor(model)
    k3 = []
    for s in (0.0, 0.1, 0.4):
        res = _engine(model, logprob_noise=s).generate(_reqs(4, 5))
        again = _engine(model, logprob_noise=s).generate(_reqs(4, 5))
        assert all(torch.equal(a.output_logprobs, b.output_logprobs) for a, b in zip(res, again))
        b = _batch(res)
        d = (actor.logprobs(b).logprobs_BT - b.rollout_logprobs_BT)[b.response_mask_BT]
        k3.append(float((d.exp() - 1 - d).mean()))
    assert k3[0] == 0.0 and 0 < k3[1] < k3[2]


def test_mismatch_config_is_checked():
    with pytest.raises(ValueError, match="router_flip_rate"):
        MM.MismatchConfig(router_flip_rate=1.5)
    with pytest.raises(ValueError, match="both set"):
        MM.MismatchConfig(router_flip_rate=0.1, router_noise=0.01)
    with pytest.raises(ValueError, match="logprob_noise"):
        MM.MismatchConfig(logprob_noise=-1)
    assert not MM.MismatchConfig().enabled and MM.MismatchConfig(router_flip_rate=0.1).calibrated


def test_diagnose_prints_the_injection_that_reproduces_a_report():
    import re

    from lockstep.launch.diagnose_report import injection_settings
    from lockstep.trainer.config.load import load_config
    m = {"routing/flip_rate": 0.1, "rollout_corr/k3_kl": 2e-3, "diagnose/routing_k3_share": 0.75}
    assert injection_settings(m) == {"router_flip_rate": 0.1,
                                     "logprob_noise": pytest.approx(1e-3 ** 0.5)}
    assert injection_settings({"routing/flip_rate": 0.0, "rollout_corr/k3_kl": 0.0}) == {}
    body = ", ".join(f"{k}: {v:.3g}" for k, v in injection_settings(m).items())
    cfg = load_config("configs/study_mismatch.yaml", [f"rollout.mismatch={{{body}}}"])
    assert cfg.rollout.mismatch.router_flip_rate == 0.1
    assert re.fullmatch(r"0\.0316\d*", str(cfg.rollout.mismatch.logprob_noise))
