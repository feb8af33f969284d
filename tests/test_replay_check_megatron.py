"""The replay validator on the megatron actor (megatron-core's RouterReplay, CPU, a gloo world of
one): replay broken in three ways stops the pi_old pass naming the layer; intact replay passes.

Shapes: B batch, T tokens, L MoE layers, K top-k, E experts.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from lockstep.moe.config import ModelConfig  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.moe.replay_check import ReplayCheck, ReplayCheckError  # noqa: E402
from lockstep.replay import ReplayMode  # noqa: E402
from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.actor.megatron.actor import MegatronActor  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def setup():
    """A 3-layer model (decoder layer 0 dense, MoE layers 0, 1 = decoder layers 1, 2), E=4,
    K=2; a batch of 8 rows whose rollout routes are the actor's own recorded ones."""
    cfg = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      mlp_only_layers=[0])
    torch.manual_seed(0)
    model = MoEModel(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.1)
    B, T = 8, 12
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([12, 11, 10, 12, 9, 12, 11, 10])
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    t_T = torch.arange(T)
    ids[t_T[None] >= lens[:, None]] = 0
    resp = (t_T[None] >= 3) & (t_T[None] < lens[:, None])
    valid = t_T[None] < (lens[:, None] - 1)
    actor = MegatronActor(model, ActorConfig(lr=1e-2, mini_batch_size=8, micro_batch_size=4),
                          total_updates=4, replay_check=ReplayCheck.FULL)
    recorded = actor.logprobs(Batch(ids, resp, torch.zeros(B, T), lens), record=True).routes_BTLK
    own = Batch(ids, resp, torch.zeros(B, T), lens, recorded.to(torch.uint8), valid)
    other = torch.rand(B, T, cfg.num_moe_layers, cfg.num_experts, generator=g).argsort(-1)[..., :2]
    foreign = Batch(ids, resp, torch.zeros(B, T), lens, other.to(torch.uint8), valid)
    return actor, own, foreign


def test_intact_replay_passes_and_foreign_routes_stop_the_pass(setup):
    actor, own, foreign = setup
    actor.old_logprobs(own, ReplayMode.R3, step=1)
    # routes of another step: run as given, but they agree with the routers' own top-k by chance
    with pytest.raises(ReplayCheckError) as e:
        actor.old_logprobs(foreign, ReplayMode.R3, step=2)
    msg = str(e.value)
    assert msg.startswith("step 2 (pi_old): replay check (log-prob forward): MoE layer "), msg
    assert "agree with the router's own top-k on only" in msg and "floor 75.0%" in msg


def test_a_router_that_bypasses_replay_stops_the_pass(setup, monkeypatch):
    """megatron-core skips RouterReplay where the router is fused (moe_router_fusion): the
    routers then run their own top-k whatever they were given."""
    import megatron.core.transformer.moe.router as mrouter
    actor, _, foreign = setup
    real = mrouter.topk_routing_with_score_function

    def fused(*args, router_replay=None, **kw):
        return real(*args, router_replay=None, **kw)
    for r in actor.replays:
        monkeypatch.setattr(r, "min_overlap", 0.0)  # only the ids-run check: foreign routes ok
    actor.old_logprobs(foreign, ReplayMode.R3, step=1)
    monkeypatch.setattr(mrouter, "topk_routing_with_score_function", fused)
    with pytest.raises(ReplayCheckError) as e:
        actor.old_logprobs(foreign, ReplayMode.R3, step=2)
    msg = str(e.value)
    assert msg.startswith("step 2 (pi_old): replay check (log-prob forward): MoE layer 0 "
                          "(decoder layer 1): the router did not run the replayed ids: at "
                          "sample "), msg


def test_a_replay_buffer_registered_for_two_layers_stops_the_pass(setup, monkeypatch):
    """verl #7340: layer 0's RouterReplay stands in the list for MoE layer 1 too, so layer 1's
    own router gets no replay action and routes on its own."""
    actor, own, _ = setup
    routers = actor.route_replay.routers
    monkeypatch.setattr(actor.route_replay, "routers", [routers[0], routers[0]])
    with pytest.raises(ReplayCheckError) as e:
        actor.old_logprobs(own, ReplayMode.R3, step=3)
    assert str(e.value) == (
        "step 3 (pi_old): replay check (log-prob forward): MoE layer 1 (decoder layer 2) "
        "received no replayed ids (its replay buffer was left unconsumed)")


def test_a_router_in_a_dense_layer_is_named():
    """megatron-core's routers map to the config's MoE layers; one in a layer the config calls
    dense (an orphaned router) is refused by name, not with a bare KeyError."""
    from lockstep.trainer.actor.megatron.replay import moe_indices
    assert moe_indices([1, 3], [1, 2, 3], "model chunk 0 of pipeline stage 0") == [0, 2]
    with pytest.raises(ReplayCheckError, match=r"router in decoder layer 0 \(model chunk 1 of "
                                               r"pipeline stage 1\).*MoE layers are \[1, 2, 3\]"):
        moe_indices([0, 1], [1, 2, 3], "model chunk 1 of pipeline stage 1")
