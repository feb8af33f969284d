"""Gate-weight replay (replay.gates=engine): the engine's gate weights over the wire, replayed
straight-through in the actor's forward (its log-probs then equal the engine's), the router's
gradient under it, R2's recorded own gates, and the config's refusals."""

import copy

import pytest
import torch

from lockstep.replay import (GATES_REQUEST_FIELD, GATES_RESPONSE_FIELD, ReplayOptions, RouteError,
                             decode_gates, encode_gates, update_plan)
from lockstep.rollout.client import HTTPBackend, RolloutError
from lockstep.rollout.engine import Engine
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.load import load_config
from lockstep.trainer.config.sections import ActorConfig

from server_fixtures import ENGINE, call, model, server  # noqa: F401 (pytest fixtures)


def _requests(gates=True):
    g = torch.Generator().manual_seed(3)
    return [GenerateRequest(torch.randint(3, 40, (p,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=10, seed=7 + i, n=2, ignore_eos=True),
                            return_gates=gates)
            for i, p in enumerate([4, 9, 6])]


def _batch(results, cfg):
    return collate(results, 0, cfg.num_experts, cfg.num_moe_layers, cfg.num_experts_per_tok)


def test_gate_payload_round_trips_and_refuses_bad_input():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        g = torch.rand(7, 3, 2).to(dtype)
        back = decode_gates(encode_gates(g), 7, 3, 2)
        assert back.dtype == dtype and torch.equal(back, g)
    p = encode_gates(torch.rand(7, 3, 2).to(torch.bfloat16))
    with pytest.raises(RouteError, match="sample 4: gate weights: .* expected 6 rows"):
        decode_gates(p, 6, 3, 2, sample=4)
    with pytest.raises(RouteError, match="another number of MoE layers or top-k"):
        decode_gates(p, 7, 2, 3)
    bad = torch.rand(2, 1, 2)
    bad[1, 0, 1] = float("nan")
    with pytest.raises(RouteError, match="row 1, layer 0, slot 1 is nan"):
        decode_gates(encode_gates(bad), 2, 1, 2)


def test_server_returns_the_engines_gates_and_the_client_decodes_them(server, model):
    http = HTTPBackend(server.url, model.cfg, max_concurrency=4)
    got = http.generate(_requests())
    want = Engine.from_model(model, ENGINE).generate(_requests())
    for g, w in zip(got, want):
        # (the server batches requests as they arrive: fp32 rounding moves with the batch)
        assert g.gates_NLK.dtype == torch.float32
        assert torch.allclose(g.gates_NLK, w.gates_NLK, atol=1e-6)
        assert g.gates_NLK.shape == g.routes_NLK.shape
    assert all(r.gates_NLK is None for r in http.generate(_requests(gates=False)))
    # gates without the routes they weight: refused by the server, naming the field
    status, body = call(server.url, "/generate", {"input_ids": [3, 4], GATES_REQUEST_FIELD: True})
    assert status == 400 and "needs return_routed_experts=true" in body["error"]["message"]
    # a server that does not send them (real SGLang): one line naming the reason
    req = _requests()[0]
    status, item = call(server.url, "/generate", http.request_body(req))
    item = item[0] if isinstance(item, list) else item
    del item["meta_info"][GATES_RESPONSE_FIELD]
    with pytest.raises(RolloutError, match="real SGLang returns expert ids only"):
        http.parse(item, req, 0, 0)


def test_r3_with_engine_gates_gives_the_engines_logprobs(model):
    """fp32 engine, fp32 actor whose routers differ from the engine's: under R3 the routers
    then act only through the gate weights, so replaying the engine's makes the actor's
    log-probs the engine's; recomputing them does not."""
    engine = Engine.from_model(model, ENGINE)
    results = engine.generate(_requests())
    batch = _batch(results, model.cfg)
    actor_model = copy.deepcopy(model)
    with torch.no_grad():
        for block in actor_model.moe_blocks:
            block.gate.weight.mul_(1.5).add_(0.02 * torch.randn_like(block.gate.weight))
    resp = batch.response_mask_BT
    diffs = {}
    for gates in ("recompute", "engine"):
        actor = TorchActor(copy.deepcopy(actor_model), ActorConfig(mini_batch_size=6,
                           micro_batch_size=6), total_updates=1, replay=ReplayOptions(gates=gates))
        old = actor.old_logprobs(batch, "R3", step=1)
        diffs[gates] = float((old.logprobs_BT - batch.rollout_logprobs_BT)[resp].abs().max())
    assert diffs["engine"] < 1e-5, diffs
    assert diffs["recompute"] > 100 * max(diffs["engine"], 1e-6), diffs  # the routers show


def test_router_gets_gradient_through_replayed_gates(model):
    """Straight-through: the forward uses the replayed gate weights exactly, the router still
    gets the gradient of its own gates (it would get none if the replayed values were used
    as constants)."""
    m = copy.deepcopy(model)
    tokens = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(tokens)
    gates = (ref.gates_BTLK + 0.1 * torch.rand_like(ref.gates_BTLK)).float()
    out = m(tokens, routed_experts_BTLK=ref.routes_BTLK, routed_gates_BTLK=gates)
    assert torch.equal(out.gates_BTLK, gates)
    out.logits_BTV.logsumexp(-1).sum().backward()
    for block in m.moe_blocks:
        assert float(block.gate.weight.grad.abs().sum()) > 0


def test_r2_replays_the_recorded_own_gates(model):
    m = copy.deepcopy(model)
    tokens = torch.randint(3, 40, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        rec = m(tokens)
        for p in m.parameters():  # an update moves the routers
            p.add_(torch.randn_like(p) * 0.05)
        plan = update_plan("R2", recorded_routes_BTLK=rec.routes_BTLK,
                           recorded_gates_BTLK=rec.gates_BTLK)
        out = m(tokens, routed_experts_BTLK=plan.routes_BTLK, replay_mask_BT=plan.replay_mask_BT,
                routed_gates_BTLK=plan.gates_BTLK)
        moved = m(tokens, routed_experts_BTLK=plan.routes_BTLK)
    assert torch.equal(out.gates_BTLK, rec.gates_BTLK)
    assert not torch.equal(moved.gates_BTLK, rec.gates_BTLK)


@pytest.mark.parametrize("overrides, message", [
    (["replay.mode=off"], "replay.mode=off replays none"),
    (["rollout.backend=sglang"], "real SGLang does not return"),
    (["actor.backend=megatron"], "RouterReplay recomputes the gate weights"),
])
def test_config_refuses_gate_replay_where_it_cannot_run(overrides, message):
    with pytest.raises(Exception, match=message):
        load_config("configs/toy_r3.yaml", overrides=["replay.gates=engine", *overrides])


def test_r2_gate_replay_needs_nothing_of_the_engine():
    cfg = load_config("configs/toy_r3.yaml", overrides=["replay.gates=engine", "replay.mode=R2",
                                                        "rollout.backend=sglang"])
    assert cfg.replay.options().replays_gates


def test_plan_names_the_gate_and_partial_replay():
    from lockstep.launch.plan import make_plan
    cfg = load_config("configs/toy_r3.yaml", overrides=[
        "replay.gates=engine", "replay.partial.rule=margin", "replay.partial.threshold=0.05"])
    rp = make_plan(cfg, "configs/toy_r3.yaml")["actor"]["replay"]
    assert rp["gates"] == "the engine's gate weights, straight-through"
    assert rp["partial"] == "only where the actor's router margin < 0.05"
    assert "gates" not in make_plan(load_config("configs/toy_r3.yaml"), "x")["actor"]["replay"]
