"""megatron-core on 2 CPU processes (gloo): EP=2 and TP=2 (+SP) give the log-probs and routes
of a single process, with routing replay and recording on, and export the same HF weights.

Shapes: B batch, T tokens, L MoE layers, K top-k, E experts.
"""

import copy
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from lockstep.moe.checkpoint import hf_state_dict, load_hf_state_dict  # noqa: E402
from lockstep.moe.config import ModelConfig  # noqa: E402
from lockstep.moe.model import MoEModel  # noqa: E402

# Two spawned processes each import megatron-core (~10 s CPU each): minutes on a busy 2-core box.
pytestmark = [pytest.mark.megatron, pytest.mark.slow]

TOL = 1e-4
LAYOUTS = {  # name -> MegatronOptions kwargs
    "dp2": dict(),
    "ep2": dict(expert_parallel=2),
    "tp2_sp": dict(tensor_parallel=2),  # experts split over TP too (ETP = TP = 2)
    "ep2_allgather": dict(expert_parallel=2, token_dispatcher="allgather"),
}


def _cfg() -> ModelConfig:
    return ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       mlp_only_layers=[1])


def _rows_for(layout: str, rank: int, B: int) -> list[int]:
    # TP ranks share their data; DP/EP ranks each take their own rows (unequal token counts
    # per expert across ranks exercise the all-to-all split sizes).
    return list(range(B)) if layout.startswith("tp") else list(range(rank, B, 2))


def _worker(rank: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lockstep.trainer.actor.megatron import convert
    from lockstep.trainer.actor.megatron.model import (build_gpt_model, forward_logits,
                                                       initialize_parallel, token_logprobs)
    from lockstep.trainer.config.megatron import MegatronOptions
    from lockstep.trainer.actor.megatron.replay import Mode, RouteReplay

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    data = torch.load(path)
    cfg, sd = ModelConfig.from_hf_dict(data["cfg"]), data["sd"]
    out = {}
    for layout, kw in LAYOUTS.items():
        opts = MegatronOptions(**kw)
        initialize_parallel(opts)
        model = build_gpt_model(cfg, opts).eval()
        convert.load_hf_into_megatron(model, sd, cfg)
        rows = _rows_for(layout, rank, data["ids"].shape[0])
        ids, routes, valid = data["ids"][rows], data["routes"][rows], data["valid"][rows]
        B, T = ids.shape
        replay = RouteReplay(model, cfg.num_experts)
        with torch.no_grad():
            with replay.session(Mode.REPLAY):
                replay.set_routes(routes, valid)
                lp_replay = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
            with replay.session(Mode.RECORD):
                lp_natural = token_logprobs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
                recorded = replay.recorded(B, T)
        exported = convert.megatron_to_hf_state_dict(model, cfg)
        streamed = {k: v for b in convert.export_hf(model, cfg, 1 << 12) for k, v in b}
        out[layout] = dict(rows=rows, lp_replay=lp_replay, lp_natural=lp_natural,
                           recorded=recorded,
                           export_exact=all(torch.equal(exported[k], sd[k])
                                            and torch.equal(streamed[k], sd[k]) for k in sd)
                           and set(exported) == set(sd) == set(streamed))
    out["actors"] = _actor_checks(cfg, sd, data)
    torch.save(out, f"{path}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


ACTOR_LAYOUTS = {"ep2": dict(expert_parallel=2),
                 # TP: vocab-parallel log-probs in chunks of 5 tokens (rows are 6 long)
                 "tp2_sp": dict(tensor_parallel=2, logprob_chunk_tokens=5),
                 # stage 0: layers 0 (MoE), 1 (dense); stage 1: layers 2, 3 (MoE)
                 "pp2": dict(pipeline_parallel=2),
                 # uneven stages: stage 0 holds layer 0 (MoE); stage 1 layers 1 (dense), 2, 3
                 "pp2_uneven": dict(pipeline_parallel=2, pipeline_layers=[1, 3]),
                 # activation recomputation under PP: the backward's recomputed forwards
                 # replay the routes their first pass ran (REPLAY_BACKWARD) on each stage
                 "pp2_recompute": dict(pipeline_parallel=2, recompute_activations=True)}
# PP=2 also packs micro-batches by a token budget (rows of 7, 5, 6, 3 tokens -> [7], [6, 5],
# [3]): micro-batches of different rows and lengths travel between the stages
ACTOR_CFG = {"pp2": dict(max_tokens_per_micro_batch=12),
             # EP=2 (DP=2) with a budget: rank 0's rows (7, 5 tokens) pack into 2 micro-batches,
             # rank 1's (6, 3) into 1, which it splits to 2 (each forward is an all-to-all over
             # both ranks); without the load-balancing loss (it depends on the packing)
             "ep2": dict(max_tokens_per_micro_batch=12, aux_loss_coef=0.0),
             # recomputation under PP is refused with a load-balancing loss (model.py)
             "pp2_recompute": dict(aux_loss_coef=0.0)}


def _batch(data):
    from lockstep.trainer.actor.batch import Batch

    ids, lens, valid = data["ids"], data["lens"], data["valid"]
    T = ids.shape[1]
    resp = (torch.arange(T)[None] >= 2) & (torch.arange(T)[None] < lens[:, None])
    return Batch(ids, resp, torch.zeros(ids.shape), lens, data["routes"], valid)


def _loss_fn(batch, adv_B):
    mask = batch.response_mask_BT.float()

    def fn(lp_bT, ent_bT, rows, mini):
        loss = -(lp_bT * adv_B[rows, None] * mask[rows]).sum() / mask[mini].sum()
        return loss, {"loss/pg": float(loss.detach()) * len(mini) / len(rows)}
    return fn


AUX = 0.1  # load-balancing loss weight (its TP / DP reductions are under test too)


def _actor_cfg(**kw):
    from lockstep.trainer.config.sections import ActorConfig
    return ActorConfig(**{"lr": 1e-2, "mini_batch_size": 4, "micro_batch_size": 2,
                          "grad_clip": 1.0, "aux_loss_coef": AUX, **kw})


def _torch_grads(model, batch, adv_B, cfg):
    """HF-named gradients of the loss over the whole batch as one mini-batch of micro-batches
    (as `cfg` packs them) on our torch model (R3 replay), load-balancing loss as TorchActor
    adds it."""
    from lockstep.trainer.actor.batch import micro_batches
    m = copy.deepcopy(model)
    mini = torch.arange(batch.size)
    for rows in micro_batches(mini, batch.seq_lens_B, cfg):
        mb = batch.rows(rows)
        out = m(mb.input_ids_BT, routed_experts_BTLK=mb.rollout_routes_BTLK,
                replay_mask_BT=mb.rollout_routes_valid_BT)
        lp = torch.log_softmax(out.logits_BTV, -1)[:, :-1].gather(
            -1, mb.input_ids_BT[:, 1:, None])[..., 0]
        lp = torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)
        loss = _loss_fn(batch, adv_B)(lp, lp, rows, mini)[0]
        aux = m.load_balancing_loss(out, mb.token_mask_BT)
        (loss + cfg.aux_loss_coef * aux * len(rows) / len(mini)).backward()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    return {k: v.detach().clone() for k, v in hf_state_dict(m).items()}


def _actor_step(actor, batch, adv_B):
    grads = actor.gradients(batch, _loss_fn(batch, adv_B), batch.rollout_routes_BTLK,
                            batch.rollout_routes_valid_BT) if hasattr(actor, "gradients") \
        else _torch_grads(actor.master, batch, adv_B, actor.cfg)
    rec = actor.logprobs(batch, record=True)  # R2's old-log-prob pass: recorded routes
    r2 = actor.logprobs(batch, rec.routes_BTLK, batch.token_mask_BT, record=True)
    before = actor.logprobs(batch, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT,
                            record=True)
    metrics, used, natural = actor.update(batch, _loss_fn(batch, adv_B),
                                          batch.rollout_routes_BTLK,
                                          batch.rollout_routes_valid_BT, shuffle_seed=3)
    after = actor.logprobs(batch, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT)
    return dict(grads=grads, lp_before=before.logprobs_BT, routes_before=before.routes_BTLK,
                lp_natural=rec.logprobs_BT, recorded=rec.routes_BTLK,
                r2_lp=r2.logprobs_BT, r2_routes=r2.routes_BTLK,
                metrics=metrics, used=used, natural=natural, lp_after=after.logprobs_BT,
                weights=_weights(actor))


def _weights(actor) -> dict:
    if hasattr(actor, "export_weights"):  # the megatron actor: gathered over TP/EP ranks
        return {k: v.clone() for bucket in actor.export_weights(1 << 16) for k, v in bucket}
    return {k: v.detach().clone() for k, v in hf_state_dict(actor.master).items()}


def _actor_checks(cfg, sd, data):
    """MegatronActor (EP=2, TP=2) on this rank: log-probs and one R3 update."""
    from lockstep.trainer.actor.megatron import convert
    from lockstep.trainer.actor.megatron.actor import MegatronActor
    from lockstep.trainer.config.megatron import MegatronOptions
    from test_device import collective_devices, lockstep_audited

    out = {}
    for layout, kw in ACTOR_LAYOUTS.items():
        model = MoEModel(cfg)
        load_hf_state_dict(model, sd)
        actor = MegatronActor(model, _actor_cfg(**ACTOR_CFG.get(layout, {})), total_updates=2,
                              options=MegatronOptions(**kw))
        batch = _batch(data)
        # device audit (tests/test_device.py): every tensor lockstep makes names its device;
        # every tensor collective lockstep runs (DP / PP sums, micro-batch counts, TP gathers
        # of routes, the load-balancing statistics) gets tensors on the actor's device
        with lockstep_audited(), collective_devices() as seen:
            out[layout] = _actor_step(actor, batch, data["adv"])
        out[layout]["collectives"] = [(n, sorted(d), str(actor.device)) for n, d, caller in seen
                                      if caller.startswith("lockstep.")]
        out[layout]["stage_layers"] = [sorted(convert.stage_layers(m).values())
                                       for m in actor.chunks]
    return out


def _random_model(cfg: ModelConfig) -> MoEModel:
    """Seed 0, non-trivial weights: router N(0, 0.5), other matrices N(0, 0.1), norms as built."""
    torch.manual_seed(0)
    model = MoEModel(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.5 if "gate" in n and "proj" not in n else 0.1)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ep2_and_tp2_match_single_process(tmp_path):
    cfg = _cfg()
    ref_model = _random_model(cfg)
    sd = {k: v.detach().clone() for k, v in hf_state_dict(ref_model).items()}
    load_hf_state_dict(ref_model, sd)
    B, T, L, K = 4, 7, cfg.num_moe_layers, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    lens = torch.tensor([7, 5, 6, 3])
    t_T = torch.arange(T)
    ids[t_T[None] >= lens[:, None]] = 0  # right padding
    valid = t_T[None] < (lens[:, None] - 1)  # P+R tokens have P+R-1 routes
    routes = torch.rand(B, T, L, cfg.num_experts, generator=g).argsort(-1)[..., :K]
    routes[~valid] = 0
    routes = routes.to(torch.uint8)
    path = str(tmp_path / "inputs.pt")
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    torch.save(dict(cfg=cfg.to_hf_dict(), sd=sd, ids=ids, routes=routes, valid=valid,
                    lens=lens, adv=adv), path)

    mp.spawn(_worker, args=(_free_port(), path), nprocs=2, join=True)

    with torch.no_grad():
        ref = ref_model(ids, routed_experts_BTLK=routes, replay_mask_BT=valid)
        nat = ref_model(ids)
    def shifted(logits):
        return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    want_replay, want_natural = shifted(ref.logits_BTV), shifted(nat.logits_BTV)
    scored = valid[:, :-1]  # positions whose target is a real token
    scored_all = torch.cat([torch.zeros(B, 1, dtype=torch.bool), scored], 1)
    results = [torch.load(f"{path}.rank{r}") for r in range(2)]
    for layout in LAYOUTS:
        for res in (results[0][layout], results[1][layout]):
            rows = res["rows"]
            m = scored[rows]
            assert res["export_exact"], layout
            err = (res["lp_replay"] - want_replay[rows])[m].abs().max()
            assert err <= TOL, f"{layout}: replay log-probs differ by {err}"
            err = (res["lp_natural"] - want_natural[rows])[m].abs().max()
            assert err <= TOL, f"{layout}: natural log-probs differ by {err}"
            rec, want = res["recorded"], nat.natural_BTLK[rows]
            real = t_T[None] < lens[rows][:, None]
            assert torch.equal(rec.sort(-1).values[real], want.sort(-1).values[real]), layout
    # the TP ranks agree with each other exactly (same data, same routes)
    assert torch.equal(results[0]["tp2_sp"]["lp_replay"], results[1]["tp2_sp"]["lp_replay"])

    # MegatronActor with EP=2 (DP=2: rows split, grads averaged) and TP=2 (SP: norm grads
    # summed over TP) against the torch actor on one process: log-probs, routes, one step
    from lockstep.trainer.actor.torch_actor import TorchActor
    data = torch.load(path)
    batch = _batch(data)
    refs = {None: _actor_step(TorchActor(copy.deepcopy(ref_model), _actor_cfg(), total_updates=2),
                              batch, adv)}
    for layout, kw in ACTOR_CFG.items():
        refs[layout] = _actor_step(TorchActor(copy.deepcopy(ref_model), _actor_cfg(**kw),
                                              total_updates=2), batch, adv)
    # the stages megatron-core built: the even split, and pipeline_layers=[1, 3]
    assert [results[r]["actors"]["pp2"]["stage_layers"] for r in range(2)] == [[[0, 1]],
                                                                              [[2, 3]]]
    assert [results[r]["actors"]["pp2_uneven"]["stage_layers"] for r in range(2)] == [
        [[0]], [[1, 2, 3]]]
    for layout in ACTOR_LAYOUTS:
        ref = refs[layout if layout in ACTOR_CFG else None]
        for rank in range(2):
            got = results[rank]["actors"][layout]
            err = (got["lp_before"] - ref["lp_before"])[scored_all].abs().max()
            assert err <= TOL, f"actor {layout} rank {rank}: old log-probs differ by {err}"
            assert torch.equal(got["routes_before"][valid], routes[valid])
            # R2: recorded = the torch actor's natural routes; replaying them runs them
            real = batch.token_mask_BT
            assert torch.equal(got["recorded"].sort(-1).values[real],
                               ref["recorded"].sort(-1).values[real]), layout
            assert torch.equal(got["r2_routes"][real], got["recorded"][real]), layout
            for k in ("lp_natural", "r2_lp"):
                err = (got[k] - ref[k])[scored_all].abs().max()
                assert err <= TOL, f"actor {layout} rank {rank}: {k} differs by {err}"
            assert torch.equal(got["used"][valid], routes[valid])
            scale = max(g.abs().max() for g in ref["grads"].values())
            diff, key = max(((got["grads"][k] - ref["grads"][k]).abs().max(), k)
                            for k in ref["grads"])
            assert diff <= 1e-5 * scale, f"actor {layout} rank {rank}: grads: {diff} ({key})"
            for k in ("loss/pg", "actor/grad_norm", "actor/aux_loss")[
                    :2 if ACTOR_CFG.get(layout, {}).get("aux_loss_coef") == 0 else 3]:
                a, b = ref["metrics"][k], got["metrics"][k]
                assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (layout, k, a, b)
            err = (got["lp_after"] - ref["lp_after"])[scored_all].abs().max()
            assert err <= 1e-3, f"actor {layout} rank {rank}: log-probs after the step: {err}"
            # Adam's first step is ~lr * g / (|g| + eps): on elements whose gradient is ~eps,
            # rounding in g (reduction order over ranks) moves the step by a fraction of lr
            diff, key = max(((got["weights"][k] - ref["weights"][k]).abs().max(), k)
                            for k in ref["weights"])
            assert diff <= 0.1 * _actor_cfg().lr, \
                f"actor {layout} rank {rank}: weights after the step: {diff} ({key})"
            # the DP / PP sums, the expert-parallel micro-batch count, TP's route gathers
            names = {n for n, _, _ in got["collectives"]}
            assert "all_reduce" in names, (layout, names)
            assert all(d == [dev] for _, d, dev in got["collectives"]), got["collectives"]
