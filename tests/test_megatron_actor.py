"""MegatronActor vs TorchActor on the same weights and batch (CPU, gloo world of one):
log-probs, natural and recorded routes, R3/R2 replay, gradients and one optimiser step.

Shapes: B batch, T tokens, L MoE layers, K top-k, E experts.
"""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

from lockstep.moe.checkpoint import hf_state_dict  # noqa: E402
from lockstep.moe.config import ModelConfig  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402
from lockstep.trainer.actor.batch import Batch
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig
from lockstep.trainer.actor.megatron.actor import MegatronActor  # noqa: E402

pytestmark = pytest.mark.megatron

TOL = 1e-4


def setup(seed: int = 0):
    cfg = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      mlp_only_layers=[0])
    torch.manual_seed(seed)
    model = MoEModel(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.1)
    B, T, L, K = 4, 9, cfg.num_moe_layers, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(seed + 1)
    lens = torch.tensor([9, 7, 8, 6])
    P = 3
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    t_T = torch.arange(T)
    ids[t_T[None] >= lens[:, None]] = 0
    resp = (t_T[None] >= P) & (t_T[None] < lens[:, None])
    valid = t_T[None] < (lens[:, None] - 1)
    routes = torch.rand(B, T, L, cfg.num_experts, generator=g).argsort(-1)[..., :K]
    routes[~valid] = 0
    batch = Batch(ids, resp, torch.zeros(B, T), lens, routes.to(torch.uint8), valid)
    adv_B = torch.tensor([1.0, -0.5, 0.25, -1.0])
    return cfg, model, batch, adv_B


def make_loss(batch: Batch, adv_B: torch.Tensor):
    mask = batch.response_mask_BT.float()

    def loss_fn(lp_bT, ent_bT, rows, mini):
        # this micro-batch's share of the mini-batch token-mean policy-gradient loss
        loss = -(lp_bT * adv_B[rows, None] * mask[rows]).sum() / mask[mini].sum()
        lp_bT = lp_bT.detach()
        return loss, {"loss/pg_mean": float(-(lp_bT * mask[rows]).sum() / mask[rows].sum()),
                      "loss/entropy": float((ent_bT * mask[rows]).sum() / mask[rows].sum())}
    return loss_fn


def actors(model, **kw):
    acfg = ActorConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2, grad_clip=1.0, **kw)
    return (TorchActor(copy.deepcopy(model), acfg, total_updates=4),
            MegatronActor(copy.deepcopy(model), acfg, total_updates=4))


def weights(actor) -> dict[str, torch.Tensor]:
    """HF-named weights: the megatron actor's export, the torch actor's master."""
    if isinstance(actor, MegatronActor):
        return {k: v.clone() for bucket in actor.export_weights(1 << 20) for k, v in bucket}
    return {k: v.detach().clone() for k, v in hf_state_dict(actor.master).items()}


def scored(batch):  # positions t >= 1 whose token is real (they have a log-prob)
    return batch.token_mask_BT & (torch.arange(batch.input_ids_BT.shape[1]) >= 1)


def test_logprobs_natural_and_recorded_routes_match_torch_actor():
    cfg, model, batch, _ = setup()
    ta, ma = actors(model)
    s = scored(batch)
    real = batch.token_mask_BT
    # natural routing, recording (R2's old-log-prob pass)
    t_nat = ta.logprobs(batch, record=True)
    m_nat = ma.logprobs(batch, record=True)
    assert (t_nat.logprobs_BT - m_nat.logprobs_BT)[s].abs().max() <= TOL
    assert (t_nat.entropy_BT - m_nat.entropy_BT)[s].abs().max() <= TOL
    for a, b in ((t_nat.natural_BTLK, m_nat.natural_BTLK), (t_nat.routes_BTLK, m_nat.routes_BTLK)):
        assert torch.equal(a.sort(-1).values[real], b.sort(-1).values[real])
    # R3: the rollout's routes replayed; the routes run are the given ones where valid
    r, v = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
    t_r3 = ta.logprobs(batch, r, v, record=True)
    m_r3 = ma.logprobs(batch, r, v, record=True)
    assert (t_r3.logprobs_BT - m_r3.logprobs_BT)[s].abs().max() <= TOL
    assert (t_r3.logprobs_BT - t_nat.logprobs_BT)[s].abs().max() > 10 * TOL
    assert torch.equal(m_r3.routes_BTLK[v], r[v])
    # natural top-k observed during replay = the router's own choice under replayed history
    assert torch.equal(t_r3.natural_BTLK.sort(-1).values[real],
                       m_r3.natural_BTLK.sort(-1).values[real])


def test_gradients_match_torch_model_with_replay():
    cfg, model, batch, adv_B = setup(seed=2)
    _, ma = actors(model)
    r, v = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
    loss_fn = make_loss(batch, adv_B)
    ref = copy.deepcopy(model)
    out = ref(batch.input_ids_BT, routed_experts_BTLK=r, replay_mask_BT=v)
    lp = torch.log_softmax(out.logits_BTV, -1)[:, :-1].gather(
        -1, batch.input_ids_BT[:, 1:, None])[..., 0]
    lp = torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)
    loss, _ = loss_fn(lp, lp, torch.arange(4), torch.arange(4))
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    want = hf_state_dict(ref)
    got = ma.gradients(batch, loss_fn, r, v)
    assert set(got) == set(want)
    scale = max(g.abs().max() for g in want.values())
    for k in want:
        assert (got[k] - want[k]).abs().max() <= 1e-5 * scale, k
    router = [k for k in want if k.endswith("mlp.gate.weight")]
    assert router and all(got[k].abs().sum() > 0 for k in router)


@pytest.mark.parametrize("replay", ["R3", "R2"])
def test_one_update_matches_torch_actor(replay):
    cfg, model, batch, adv_B = setup(seed=3)
    ta, ma = actors(model)
    loss_fn = make_loss(batch, adv_B)
    results = []
    for actor in (ta, ma):
        if replay == "R3":
            r, v = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
        else:  # R2: routes recorded in the old-log-prob pass are replayed in the update
            r, v = actor.logprobs(batch, record=True).routes_BTLK, batch.token_mask_BT
        metrics, used, natural = actor.update(batch, loss_fn, r, v, shuffle_seed=7)
        assert torch.equal(used[v], r[v])
        after = actor.logprobs(batch, r, v).logprobs_BT
        results.append((metrics, natural, after, weights(actor)))
    (tm, tn, ta_after, tw), (mm, mn, ma_after, mw) = results
    for k in ("loss/pg_mean", "loss/entropy", "actor/grad_norm", "actor/lr"):
        assert abs(tm[k] - mm[k]) <= 1e-4 * max(1.0, abs(tm[k])), (k, tm[k], mm[k])
    real = batch.token_mask_BT
    assert torch.equal(tn.sort(-1).values[real], mn.sort(-1).values[real])
    # Adam's first step is ~lr * sign(grad): the two backends agree to rounding of the grads
    s = scored(batch)
    moved = (ta_after - ma_after)[s].abs().max()
    assert moved <= 1e-3, moved
    assert set(tw) == set(mw)
    diff = max((tw[k] - mw[k]).abs().max() for k in tw)
    assert diff <= 1e-4, diff


def test_gaps_are_routed_naturally_given_the_replayed_history_as_the_torch_actor():
    cfg, model, batch, _ = setup(seed=8)
    with torch.no_grad():  # stronger experts: the replayed history changes later routes
        for n, p in model.named_parameters():
            if "experts" in n or "o_proj" in n:
                p.mul_(3)
    ta, ma = actors(model)
    r, v = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT.clone()
    v[:, 3:6] = False  # e.g. tool-output tokens the engine did not route
    real, s = batch.token_mask_BT, scored(batch)
    want = ta.logprobs(batch, r, v, record=True)
    got = ma.logprobs(batch, r, v, record=True)
    assert torch.equal(got.routes_BTLK[v], r[v])
    assert torch.equal(got.routes_BTLK.sort(-1).values[real], want.routes_BTLK.sort(-1).values[real])
    assert torch.equal(got.natural_BTLK.sort(-1).values[real],
                       want.natural_BTLK.sort(-1).values[real])
    assert (got.logprobs_BT - want.logprobs_BT)[s].abs().max() <= TOL
    # the other semantics (routes of a forward with nothing replayed) differs on this batch
    unreplayed = ta.logprobs(batch).natural_BTLK
    gap = real & ~v
    assert not torch.equal(unreplayed.sort(-1).values[gap], got.routes_BTLK.sort(-1).values[gap])


@pytest.mark.parametrize("replay", ["R3", "none"])
def test_load_balancing_loss_matches_torch_actor(replay):
    """Same aux loss (routes run, real tokens, mean over MoE layers) and same update."""
    cfg, model, batch, adv_B = setup(seed=5)
    ta, ma = actors(model, aux_loss_coef=0.5)
    loss_fn = make_loss(batch, adv_B)
    r, v = (batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT) if replay == "R3" \
        else (None, None)
    (tm, _, _), (mm, _, _) = (a.update(batch, loss_fn, r, v, shuffle_seed=1) for a in (ta, ma))
    for k in ("actor/aux_loss", "actor/grad_norm", "loss/pg_mean"):
        assert abs(tm[k] - mm[k]) <= 1e-5 * max(1.0, abs(tm[k])), (k, tm[k], mm[k])
    tw, mw = weights(ta), weights(ma)
    diff = max((tw[k] - mw[k]).abs().max() for k in tw)
    assert diff <= 1e-4, diff


def test_no_torch_copy_and_export_in_bounded_buckets():
    """The megatron actor keeps no MoEModel (nor refreshes one per optimiser step); its export
    is the trained weights, in buckets of at most bucket_bytes (one tensor over it: alone)."""
    cfg, model, batch, adv_B = setup(seed=6)
    ta, ma = actors(model)
    assert not any(isinstance(v, MoEModel) for v in vars(ma).values())
    r, v = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
    for a in (ta, ma):
        a.update(batch, make_loss(batch, adv_B), r, v, shuffle_seed=2)
    want = weights(ta)
    limit = 4096
    buckets = list(ma.export_weights(limit))
    got = {k: t for b in buckets for k, t in b}
    assert sum(len(b) for b in buckets) == len(got) == len(want)
    assert max((got[k] - want[k]).abs().max() for k in want) <= 1e-4
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= limit or len(b) == 1, (size, [k for k, _ in b])
    assert len(buckets) > 3


@pytest.mark.parametrize("mask_replay", [False, True])
def test_chunked_logprobs_equal_the_full_logits_path(mask_replay):
    """TP=1: log-probs from hidden states with the chunked kernel (no [tokens, V] logits) equal
    megatron's full-logits path, also over sampling-mask candidate sets, and so do gradients."""
    cfg, model, batch, adv_B = setup(seed=7)
    _, ma = actors(model, logprob_chunk=3)  # several chunks per row
    assert ma.chunked_logprobs
    if mask_replay:
        g = torch.Generator().manual_seed(8)
        B, T = batch.input_ids_BT.shape
        cand = torch.rand(B, T, cfg.vocab_size, generator=g).argsort(-1)[..., :5]
        cand[..., 0] = batch.input_ids_BT
        cand[:, :3] = -1  # prompt positions: whole vocabulary
        batch.candidates_BTS = cand.to(torch.int16)
    r, v = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
    out, grads, widths = {}, {}, []
    ma.gpt.output_layer.register_forward_hook(lambda m, a, o: widths.append(o[0].shape[-1]))
    for chunked in (True, False):
        ma.chunked_logprobs = chunked
        out[chunked] = ma.logprobs(batch, r, v)
        grads[chunked] = ma.gradients(batch, make_loss(batch, adv_B), r, v)
        # chunked: the output layer passes hidden states [.., D] on; else logits [.., V]
        assert set(widths) == {cfg.hidden_size if chunked else cfg.vocab_size}, widths
        widths.clear()
    s = scored(batch)
    for f in ("logprobs_BT", "entropy_BT"):
        a, b = getattr(out[True], f), getattr(out[False], f)
        assert (a - b)[s].abs().max() <= 1e-5, f
    scale = max(x.abs().max() for x in grads[False].values())
    assert max((grads[True][k] - grads[False][k]).abs().max() for k in grads[False]) <= 1e-5 * scale


def test_micro_batches_trimmed_and_packed_by_token_budget(monkeypatch):
    """Each micro-batch runs at its own longest row, packed by actor.max_tokens_per_micro_batch
    as the torch actor packs them (rows of 9, 7, 8, 6 tokens, budget 16: [9], [8, 7], [6]);
    log-probs, update metrics (load-balancing loss included) and the step equal the torch
    actor's with the same budget, and the loss metrics equal one untrimmed micro-batch's."""
    from lockstep.trainer.actor.megatron import schedule as mod  # where the passes call it
    cfg, model, batch, adv_B = setup(seed=4)
    seen, real_forward = [], mod.forward_logits
    monkeypatch.setattr(mod, "forward_logits",
                        lambda m, ids: seen.append(tuple(ids.shape)) or real_forward(m, ids))
    want_shapes = [(1, 9), (2, 8), (1, 6)]
    r, v = batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT
    loss_fn = make_loss(batch, adv_B)
    # Adam's first step is lr * g / (|g| + eps): at eps 1e-8 a gradient of rounding size
    # (~1e-8; the packed and the torch micro-batches sum in other orders) moves a weight by a
    # noise-set fraction of lr (measured 3% of it on one element); eps 1e-5 keeps such
    # elements' steps small and every real gradient's step at ~lr
    ta, ma = actors(model, max_tokens_per_micro_batch=16, aux_loss_coef=0.5, eps=1e-5)
    t_lp, m_lp = ta.logprobs(batch, r, v), ma.logprobs(batch, r, v)
    assert seen == want_shapes, seen
    s = scored(batch)
    assert (t_lp.logprobs_BT - m_lp.logprobs_BT)[s].abs().max() <= TOL
    seen.clear()
    (tm, _, _), (mm, mused, _) = (a.update(batch, loss_fn, r, v, shuffle_seed=1) for a in (ta, ma))
    assert seen == want_shapes, seen
    assert torch.equal(mused[v], r[v])
    for k in ("actor/aux_loss", "actor/grad_norm", "loss/pg_mean", "loss/entropy"):
        assert abs(tm[k] - mm[k]) <= 1e-5 * max(1.0, abs(tm[k])), (k, tm[k], mm[k])
    tw, mw = weights(ta), weights(ma)
    assert max((tw[k] - mw[k]).abs().max() for k in tw) <= 1e-4
    # without the load-balancing loss (it balances each micro-batch's own tokens), the
    # budgeted, trimmed micro-batches give one untrimmed [4, 9] micro-batch's metrics
    mask = batch.response_mask_BT.float()

    def share_loss(lp_bT, ent_bT, rows, mini):  # its metric: the mini-batch loss, additive
        loss = -(lp_bT * adv_B[rows, None] * mask[rows]).sum() / mask[mini].sum()
        return loss, {"loss/pg": float(loss.detach()) * len(mini) / len(rows)}
    got = {}
    for name, kw in (("budget", dict(max_tokens_per_micro_batch=16)),
                     ("whole", dict(micro_batch_size=4))):
        seen.clear()
        acfg = ActorConfig(lr=1e-2, mini_batch_size=4, grad_clip=1.0,
                           **{"micro_batch_size": 2, **kw})
        actor = MegatronActor(copy.deepcopy(model), acfg, total_updates=4)
        got[name] = actor.update(batch, share_loss, r, v, shuffle_seed=1)[0], weights(actor)
        assert seen == (want_shapes if name == "budget" else [(4, 9)]), seen
    for k in ("actor/grad_norm", "loss/pg"):
        a, b = got["whole"][0][k], got["budget"][0][k]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (k, a, b)
    assert max((got["whole"][1][k] - got["budget"][1][k]).abs().max() for k in tw) <= 1e-5


def test_split_to_count_gives_every_expert_parallel_rank_the_same_micro_batch_count():
    """Under EP across DP ranks each micro-batch is a collective: a rank whose token budget
    packed fewer micro-batches halves its costliest ones (rows x longest row) to match."""
    from lockstep.trainer.actor.megatron.schedule import split_to_count
    lens = torch.tensor([9, 7, 8, 6, 3])
    micro = [torch.tensor([0]), torch.tensor([2, 1, 3, 4])]
    assert [m.tolist() for m in split_to_count(micro, 4, lens)] == [[0], [2], [1], [3, 4]]
    assert split_to_count(micro, 2, lens) == micro
    with pytest.raises(ValueError, match="cannot run 6 micro-batches on 5 rows"):
        split_to_count(micro, 6, lens)
