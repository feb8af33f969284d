"""The trainer's batch: DP shard plans (rows, balance, mini-batch parts), trimmed shards,
compact routes on the wire, the one-process gradient from the ranks' parts, and micro-batches
packed by a token budget."""

import copy

import pytest
import torch

from lockstep.kernels.logprob import logprobs_from_logits
from lockstep.moe.config import ModelConfig
from lockstep.moe.model import MoEModel
from lockstep.rollout.types import GenerationResult
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.actor.batch import (Batch, collate, micro_batches, minibatch_schedule,
                                    plan_shards, trim, trim_batch, wire_bytes)
from lockstep.trainer.config.sections import ActorConfig

from metric_fixtures import metric_close

CFG = ModelConfig(vocab_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48,
                  moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                  mlp_only_layers=[0], eos_token_id=2, pad_token_id=0, bos_token_id=1)


def _results(model, B=12, seed=0):
    """Engine-like results with ragged lengths; routes and log-probs from a real forward."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(B):
        P, R = int(torch.randint(2, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(3, 16, (P + R,), generator=g)
        with torch.no_grad():
            o = model(ids[None])
        lp = logprobs_from_logits(o.logits_BTV[0, P - 1:-1], ids[P:])
        out.append(GenerationResult(f"r{b}", 0, ids[:P].tolist(), ids[P:].tolist(), lp, lp,
                                    {"type": "length", "length": R}, "0",
                                    o.routes_BTLK[0, :-1].to(torch.uint8)))
    return out


def _collate(results):
    return collate(results, 0, CFG.num_experts, CFG.num_moe_layers, CFG.num_experts_per_tok)


@pytest.mark.parametrize("dp,mini,epochs", [(2, 4, 1), (3, 6, 2), (4, 12, 1), (2, 3, 1)])
def test_plan_shards_partitions_every_minibatch_with_balanced_rows_and_tokens(dp, mini, epochs):
    g = torch.Generator().manual_seed(dp)
    lens = torch.randint(5, 200, (12,), generator=g)
    schedule = minibatch_schedule(12, mini, epochs, shuffle_seed=7)
    plan = plan_shards(lens, dp, schedule)
    assert torch.equal(torch.cat(plan.rows).sort().values, torch.arange(12))
    for s, m in enumerate(schedule):  # each step: the ranks' parts are exactly the mini-batch
        parts = [plan.rows[r][plan.steps[r][s]] for r in range(dp)]
        assert sorted(torch.cat(parts).tolist()) == sorted(m.tolist())
        for p in parts:  # and keep the mini-batch's own order
            pos = [m.tolist().index(i) for i in p.tolist()]
            assert pos == sorted(pos)
        if s < 12 // mini:  # first epoch: row counts within one of each other
            n = [len(p) for p in parts]
            assert max(n) - min(n) <= 1
    tokens = [int(lens[r].sum()) for r in plan.rows]
    if mini % dp == 0:
        assert max(tokens) - min(tokens) <= int(lens.max()) * (12 // mini)
    again = plan_shards(lens, dp, schedule)  # deterministic
    assert all(torch.equal(a, b) for a, b in zip(plan.rows, again.rows))


def test_plan_shards_balances_tokens_better_than_contiguous_rows():
    lens = torch.tensor([100] * 8 + [10] * 8)  # sorted lengths: contiguous halves are 800 vs 80
    plan = plan_shards(lens, 2, minibatch_schedule(16, 16, 1, None))
    assert [int(lens[r].sum()) for r in plan.rows] == [440, 440]


def test_plan_shards_refuses_bad_input():
    with pytest.raises(ValueError, match="cannot feed 4 DP ranks"):
        plan_shards(torch.tensor([3, 4]), 4, minibatch_schedule(2, 2, 1, None))
    with pytest.raises(ValueError, match="first epoch"):
        plan_shards(torch.tensor([3, 4, 5, 6]), 2, [torch.tensor([0, 1]), torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="leave DP rank 1 of 2 no row: actor.mini_batch_size"):
        plan_shards(torch.tensor([3, 4, 5, 6]), 2, minibatch_schedule(4, 1, 1, None))


def test_shards_are_trimmed_rows_with_compact_routes_aligned_to_tokens():
    torch.manual_seed(0)
    batch = _collate(_results(MoEModel(CFG)))
    plan = plan_shards(batch.seq_lens_B, 3, minibatch_schedule(12, 6, 1, 3))
    total = 0
    for r in range(3):
        rows = plan.rows[r]
        sh = plan.batch(r, batch)
        t = int(batch.seq_lens_B[rows].max())
        assert sh.input_ids_BT.shape == (len(rows), t)
        assert sh.rollout_routes_BTLK.dtype == torch.uint8
        assert torch.equal(sh.rollout_routes_BTLK, batch.rollout_routes_BTLK[rows, :t])
        assert torch.equal(sh.input_ids_BT, batch.input_ids_BT[rows, :t])
        assert torch.equal(sh.rollout_routes_valid_BT, batch.rollout_routes_valid_BT[rows, :t])
        assert torch.equal(plan.take(r, batch.rollout_logprobs_BT, batch.seq_lens_B),
                           sh.rollout_logprobs_BT)
        # nothing real was cut: every row keeps all its tokens and routes
        assert int(sh.token_mask_BT.sum()) == int(batch.seq_lens_B[rows].sum())
        assert int(sh.rollout_routes_valid_BT.sum()) == int((batch.seq_lens_B[rows] - 1).sum())
        n = wire_bytes(sh)
        assert n == sum(x.numel() * x.element_size() for x in
                        (sh.input_ids_BT, sh.response_mask_BT, sh.rollout_logprobs_BT,
                         sh.seq_lens_B, sh.rollout_routes_BTLK, sh.rollout_routes_valid_BT))
        total += n
    assert total <= wire_bytes(batch)  # trimmed shards together cost no more than the batch


def test_uint16_routes_shard_without_widening():
    ids = torch.randint(0, 1000, (4, 9, 2, 3)).to(torch.uint16)
    out = trim(ids, torch.tensor([3, 1]), 5)
    assert out.dtype == torch.uint16
    assert torch.equal(out.to(torch.int32), ids.to(torch.int32)[[3, 1], :5])
    b = Batch(torch.zeros(4, 9, dtype=torch.long), torch.ones(4, 9, dtype=torch.bool),
              torch.zeros(4, 9), torch.tensor([9, 2, 5, 3]), ids, torch.ones(4, 9, dtype=torch.bool))
    assert trim_batch(b, torch.tensor([1, 3])).rollout_routes_BTLK.shape == (2, 3, 2, 3)


def _minibatch_grads(model, batch, mini_rows, adv_b, n_tokens):
    """Gradient of the token-sum REINFORCE loss (advantages `adv_b` of `mini_rows`) over
    n_tokens, routes replayed."""
    model.zero_grad()
    sub = trim_batch(batch, mini_rows)
    out = model(sub.input_ids_BT, routed_experts_BTLK=sub.rollout_routes_BTLK,
                replay_mask_BT=sub.rollout_routes_valid_BT)
    lp = logprobs_from_logits(out.logits_BTV[:, :-1], sub.input_ids_BT[:, 1:])
    loss = -(adv_b[:, None] * lp * sub.response_mask_BT[:, 1:]).sum() / n_tokens
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_sum_of_rank_parts_is_the_one_process_minibatch_gradient():
    """What DP needs from the plan: each rank runs its part of each mini-batch on its own
    trimmed shard (replaying its routes); the sum of the ranks' gradients (the all-reduce) is the
    gradient of the whole mini-batch in one process. A shard whose routes slipped one position
    against its tokens would fail this."""
    torch.manual_seed(0)
    model = MoEModel(CFG)
    batch = _collate(_results(model, B=12, seed=1))
    schedule = minibatch_schedule(12, 6, 1, shuffle_seed=5)
    plan = plan_shards(batch.seq_lens_B, 2, schedule)
    shards = [plan.batch(r, batch) for r in range(2)]
    adv_B = torch.arange(12) % 3 - 1.0
    for s, mini in enumerate(schedule):
        n_tok = batch.response_mask_BT[mini].sum()
        want = _minibatch_grads(model, batch, mini, adv_B[mini], n_tok)
        got = None
        for r in range(2):
            part = plan.steps[r][s]
            g = _minibatch_grads(model, shards[r], part, adv_B[plan.rows[r][part]], n_tok)
            got = g if got is None else [a + b for a, b in zip(got, g)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", [None, 1, 20, 37, 1000])
def test_micro_batches_pack_rows_by_length_under_the_token_budget(budget):
    lens = torch.tensor([9, 3, 17, 4, 4, 12, 1, 30, 8, 2])
    rows = torch.tensor([7, 0, 2, 5, 9, 3, 1])
    cfg = ActorConfig(mini_batch_size=8, micro_batch_size=2, max_tokens_per_micro_batch=budget)
    mbs = micro_batches(rows, lens, cfg)
    assert sorted(torch.cat(mbs).tolist()) == sorted(rows.tolist())
    if budget is None:
        assert [m.tolist() for m in mbs] == [[7, 0], [2, 5], [9, 3], [1]]
        return
    for m in mbs:
        assert len(m) == 1 or len(m) * int(lens[m].max()) <= budget
    # greedy by length: no two consecutive micro-batches could have been merged
    for a, b in zip(mbs, mbs[1:]):
        assert (len(a) + len(b)) * int(lens[a].max()) > budget
    assert [m.tolist() for m in micro_batches(rows, lens, cfg)] == [m.tolist() for m in mbs]


def test_max_tokens_per_micro_batch_is_validated():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        ActorConfig(max_tokens_per_micro_batch=0)


class _GradRecordingActor(TorchActor):
    """The real actor, keeping each optimiser step's gradients before it steps."""

    def _optimizer_step(self, lr_scale: float = 1.0):
        self.grads.append([p.grad.clone() for p in self.master.parameters()])
        return super()._optimizer_step(lr_scale)


def test_token_budget_micro_batches_give_the_fixed_size_gradients_and_logprobs():
    """One update, R3 replay: trimmed micro-batches packed by a token budget give the same
    gradients, old log-probs and replayed routes as fixed-size micro-batches of full width."""
    torch.manual_seed(0)
    model = MoEModel(CFG)
    batch = _collate(_results(model, B=12, seed=2))
    adv_B = torch.arange(12) % 3 - 1.0

    def loss_fn(lp_BT, ent_BT, rows, mini):
        mask = batch.response_mask_BT[rows].float()
        loss = -(adv_B[rows, None] * lp_BT * mask).sum() / batch.response_mask_BT[mini].sum()
        return loss, {}

    runs = []
    for budget in (None, 24):
        cfg = ActorConfig(lr=1e-3, mini_batch_size=6, micro_batch_size=2,
                          max_tokens_per_micro_batch=budget)
        actor = _GradRecordingActor(copy.deepcopy(model), cfg, total_updates=2)
        actor.grads = []
        if budget is not None:  # the budget really changes the split
            sizes = [len(m) for m in micro_batches(torch.arange(12), batch.seq_lens_B, cfg)]
            assert sizes != [2] * 6
        old = actor.logprobs(batch, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT,
                             record=True)
        _, used, _ = actor.update(batch, loss_fn, batch.rollout_routes_BTLK,
                                  batch.rollout_routes_valid_BT, shuffle_seed=3)
        runs.append((old, used, actor.grads))
    (old_a, used_a, g_a), (old_b, used_b, g_b) = runs
    real_BT = batch.token_mask_BT
    torch.testing.assert_close(old_b.logprobs_BT[real_BT], old_a.logprobs_BT[real_BT])
    valid_BT = batch.rollout_routes_valid_BT
    assert torch.equal(used_b[valid_BT], used_a[valid_BT])
    assert torch.equal(used_b[valid_BT], batch.rollout_routes_BTLK[valid_BT])
    assert len(g_a) == len(g_b) == 2
    for step_a, step_b in zip(g_a, g_b):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_loop_step_with_a_token_budget_matches_fixed_micro_batches(tmp_path):
    """One RL step of the (smaller) toy R3 job: rows packed into micro-batches by a token budget
    give the metrics of fixed-size micro-batches (same rollout, gradients up to fp32 order)."""
    from pathlib import Path

    from lockstep.trainer.config.load import load_config
    from lockstep.trainer.loop import Trainer

    config = Path(__file__).resolve().parent.parent / "configs" / "toy_r3.yaml"
    small = ["warmstart.enabled=false", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
             "actor.mini_batch_size=16", "actor.micro_batch_size=8", "loop.steps=1",
             "loop.tensorboard=false", "loop.plots=false"]
    runs = []
    for extra in ([], ["actor.max_tokens_per_micro_batch=60"]):
        tr = Trainer(load_config(config, small + extra), tmp_path / str(len(extra)), progress=False,
                     log=lambda s: None)
        runs.append(tr.step(1))
    fixed, packed = runs
    # is_split/log_corr is a ratio of rounding noise while the policy has not moved (an
    # untrained policy's rewards are mostly equal, so its updates barely move it)
    keys = [k for k in fixed if not k.startswith("time/") and isinstance(fixed[k], float)
            and k != "is_split/log_corr"]
    assert "actor/grad_norm" in keys and "actor/pg_loss" in keys
    for k in keys:
        assert metric_close(k, fixed[k], packed[k]), (k, fixed[k], packed[k])
