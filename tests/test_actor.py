"""Torch actor: log-prob alignment, R2 record/replay in updates, micro-batch invariance,
fp32 master weights under a bf16 compute copy, LR schedules."""

import copy

import pytest
import torch

from lockstep.kernels.logprob import logprobs_from_logits
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.replay import old_logprob_plan, update_plan
from lockstep.rollout.types import GenerationResult
from lockstep.trainer.actor.batch import collate
from lockstep.trainer.actor.torch_actor import lr_lambda, run_minibatches, TorchActor
from lockstep.trainer.config.sections import ActorConfig

CFG = ModelConfig(vocab_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48,
                  moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                  mlp_only_layers=[0], eos_token_id=2, pad_token_id=0, bos_token_id=1)


def _model(seed=0):
    torch.manual_seed(seed)
    return MoEModel(CFG)


def _results(model, B=8, seed=0, with_routes=True):
    """Fake-but-consistent engine results: random tokens, routes from a full forward."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(B):
        P, R = 4, int(torch.randint(1, 5, (1,), generator=g))
        ids = torch.randint(3, 16, (P + R,), generator=g)
        with torch.no_grad():
            o = model(ids[None])
        lp = logprobs_from_logits(o.logits_BTV[0, P - 1:-1], ids[P:])
        routes = o.routes_BTLK[0, :-1].to(torch.uint8) if with_routes else None
        out.append(GenerationResult(f"r{b}", 0, ids[:P].tolist(), ids[P:].tolist(), lp, lp,
                                    {"type": "length", "length": R}, "0", routes))
    return out


def _batch(model, **kw):
    return collate(_results(model, **kw), 0, CFG.num_experts, CFG.num_moe_layers,
                   CFG.num_experts_per_tok)


def _pg_loss(batch, adv_B):
    """Token-mean REINFORCE; each micro-batch contributes its share of the mini-batch tokens."""
    def loss_fn(lp_BT, ent_BT, rows, mini):
        mask = batch.response_mask_BT[rows].float()
        n_mini = batch.response_mask_BT[mini].sum()
        loss = -(adv_B[rows, None] * lp_BT * mask).sum() / n_mini
        return loss, {"actor/pg_loss": float(loss.detach()) * len(mini) / len(rows)}
    return loss_fn


def test_collate_aligns_tokens_logprobs_routes():
    model = _model()
    res = _results(model, B=5)
    batch = collate(res, 0, CFG.num_experts, CFG.num_moe_layers, CFG.num_experts_per_tok)
    for b, r in enumerate(res):
        P, R = r.prompt_tokens, r.completion_tokens
        assert batch.input_ids_BT[b, :P + R].tolist() == r.prompt_ids + r.output_ids
        assert batch.response_mask_BT[b].nonzero().flatten().tolist() == list(range(P, P + R))
        assert torch.equal(batch.rollout_logprobs_BT[b, P:P + R], r.output_logprobs)
        assert batch.rollout_routes_valid_BT[b].sum() == P + R - 1
    bad = _results(model, B=2)
    bad[1].routes_NLK = bad[1].routes_NLK[:-1]
    with pytest.raises(ValueError, match="sample 1"):
        collate(bad, 0, CFG.num_experts, CFG.num_moe_layers, CFG.num_experts_per_tok)


def test_logprobs_match_full_log_softmax_with_temperature():
    model = _model()
    batch = _batch(model)
    actor = TorchActor(model, ActorConfig(micro_batch_size=3, mini_batch_size=6,
                                          logprob_chunk=5), 1, temperature=0.7)
    res = actor.logprobs(batch)
    with torch.no_grad():
        logits = model(batch.input_ids_BT).logits_BTV
    ref = logprobs_from_logits(logits[:, :-1], batch.input_ids_BT[:, 1:], temperature=0.7)
    m = batch.response_mask_BT
    assert torch.allclose(res.logprobs_BT[:, 1:][m[:, 1:]], ref[m[:, 1:]], atol=1e-5)
    assert res.routes_BTLK is None and res.natural_BTLK.dtype == torch.uint8


def test_replayed_forward_runs_the_given_routes():
    model = _model()
    batch = _batch(model)
    actor = TorchActor(model, ActorConfig(micro_batch_size=2), 1)
    # replay routes different from the natural ones: the forward must run exactly them
    other = (batch.rollout_routes_BTLK.long() + 1) % CFG.num_experts
    res = actor.logprobs(batch, other, batch.rollout_routes_valid_BT, record=True)
    v = batch.rollout_routes_valid_BT
    assert torch.equal(res.routes_BTLK[v].long(), other[v])
    assert not torch.equal(res.natural_BTLK[v].long(), other[v])


def test_r2_update_replays_exactly_the_recorded_routes():
    model = _model()
    batch = _batch(model, B=8)
    cfg = ActorConfig(lr=3e-2, epochs=2, mini_batch_size=2, micro_batch_size=1)
    actor = TorchActor(model, cfg, total_updates=8)
    plan = old_logprob_plan("R2")
    old = actor.logprobs(batch, plan.routes_BTLK, plan.replay_mask_BT, record=plan.record)
    up = update_plan("R2", recorded_routes_BTLK=old.routes_BTLK,
                     recorded_valid_BT=batch.token_mask_BT)
    adv = torch.randn(8)
    _, used, natural = actor.update(batch, _pg_loss(batch, adv), up.routes_BTLK,
                                    up.replay_mask_BT, shuffle_seed=0)
    tok = batch.token_mask_BT
    assert torch.equal(used[tok], old.routes_BTLK[tok])
    # the weights moved over 8 optimiser steps, so the router's own choice drifted somewhere
    assert not torch.equal(natural[tok], old.routes_BTLK[tok])


def test_micro_batching_does_not_change_the_update():
    base = _model()
    batch = _batch(base, B=8)
    adv = torch.randn(8)
    grads = []
    for micro in (8, 2, 1):
        model = copy.deepcopy(base)
        actor = TorchActor(model, ActorConfig(lr=1e-2, mini_batch_size=8,
                                              micro_batch_size=micro), 1)
        metrics, _, _ = actor.update(batch, _pg_loss(batch, adv))
        # after one AdamW step exp_avg = (1 - beta1) * grad: the accumulated gradient
        grads.append(torch.cat([actor.optimizer.state[p]["exp_avg"].flatten()
                                for p in model.parameters()]))
        assert metrics["actor/grad_norm"] > 0
        assert not torch.equal(model.embed_tokens.weight, base.embed_tokens.weight)
    scale = grads[0].abs().max()
    assert torch.allclose(grads[0], grads[1], atol=1e-5 * scale)
    assert torch.allclose(grads[0], grads[2], atol=1e-5 * scale)


def test_bf16_compute_copy_keeps_fp32_master():
    model = _model()
    batch = _batch(model, B=4)
    before = copy.deepcopy(model)
    actor = TorchActor(model, ActorConfig(dtype="bf16", router_dtype="fp32", lr=1e-2,
                                          mini_batch_size=4, micro_batch_size=2), 1)
    assert actor.compute is not model
    assert actor.compute.layers[1].mlp.gate.weight.dtype == torch.float32
    assert actor.compute.embed_tokens.weight.dtype == torch.bfloat16
    actor.update(batch, _pg_loss(batch, torch.randn(4)))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters())]
    assert all(moved)
    for pm, pc in zip(model.parameters(), actor.compute.parameters()):
        assert torch.equal(pc, pm.to(pc.dtype))
    with pytest.raises(ValueError, match="master model must be fp32"):
        TorchActor(actor.compute, ActorConfig(), 1)


def test_lr_schedules():
    f = lr_lambda(ActorConfig(lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1), 12)
    assert [round(f(s), 4) for s in (0, 1, 2, 7, 12, 20)] == [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]
    g = lr_lambda(ActorConfig(lr_schedule="linear"), 10)
    assert g(0) == 1.0 and g(5) == pytest.approx(0.5) and g(10) == 0.0
    assert lr_lambda(ActorConfig(), 10)(7) == 1.0


def test_run_minibatches_shuffles_by_seed_and_averages_step_metrics():
    cfg = ActorConfig(epochs=2, mini_batch_size=3, micro_batch_size=1)
    seen = []

    def step(mini):
        seen.append(mini.tolist())
        return {"n": float(len(seen)), "first": float(mini[0])}

    metrics = run_minibatches(6, cfg, 5, step)
    # each epoch is one permutation of the rows, drawn from one generator seeded once
    g = torch.Generator().manual_seed(5)
    want = [p.tolist() for _ in range(2) for p in torch.randperm(6, generator=g).split(3)]
    assert seen == want and sorted(seen[0] + seen[1]) == list(range(6))
    assert seen[:2] != seen[2:]  # a fresh order per epoch, not the same one twice
    assert metrics == {"n": 2.5, "first": sum(m[0] for m in want) / 4}
    seen.clear()
    run_minibatches(6, cfg, None, step)
    assert seen == [[0, 1, 2], [3, 4, 5]] * 2
    with pytest.raises(ValueError, match="batch of 7 rows .*mini_batch_size=3"):
        run_minibatches(7, cfg, 0, step)
