"""GPU check of the megatron backend: Transformer Engine spec (fused norms, grouped GEMM,
TE attention), routing replay, against lockstep's torch model on the CPU.

Run on a machine with CUDA, transformer_engine and megatron-core:
    OMP_NUM_THREADS=1 python tests/gpu/check_megatron_te.py
It prints one JSON line of findings and exits 1 when a parity check fails; without CUDA it
prints a skip line and exits 0. `tests/test_megatron_gpu.py` runs it under pytest (-m gpu).

Checks (fp32 unless said otherwise; TF32 off so fp32 GEMMs are fp32):
- the TE layout is in use (fused input norms, TEGroupedMLP experts) and HF <-> megatron
  conversion round-trips exactly on it;
- R3 replay log-probs and natural log-probs/routes equal the CPU torch model's (<= 1e-4 /
  >= 99% of (token, layer) routes);
- RECORD then REPLAY of the recording reproduces the log-probs bit for bit;
- bf16 (flash / fused attention, router in fp32): R3 log-prob error vs fp32 and the share of
  (token, layer) natural routes that flip relative to fp32 (the mismatch R3 removes);
- options that bypass replay (fused router, token dropping) are refused.
Shapes: B batch, T tokens, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import json
import sys

import torch

TOL = 1e-4


def shifted(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_BTV.float(), -1)[:, :-1].gather(-1, ids_BT[:, 1:, None])[..., 0]


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP check_megatron_te: no CUDA device")
        return 0
    import transformer_engine  # noqa: F401  (the point of this check)

    from lockstep.moe.checkpoint import hf_state_dict
    from lockstep.moe.config import ModelConfig
    from lockstep.moe.model import MoEModel
    from lockstep.trainer.actor.megatron import convert
    from lockstep.trainer.actor.megatron.actor import init_single_process_group
    from lockstep.trainer.actor.megatron.model import (build_gpt_model, check_replay_compatible,
                                                       forward_logits, initialize_parallel,
                                                       ReplayBypassError, token_logprobs,
                                                       transformer_config)
    from lockstep.trainer.config.megatron import MegatronOptions
    from lockstep.trainer.actor.megatron.replay import Mode, RouteReplay

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      mlp_only_layers=[0])
    torch.manual_seed(0)
    ref = MoEModel(cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.1)
    sd = {k: v.detach().clone() for k, v in hf_state_dict(ref).items()}
    B, T, L, K = 4, 32, cfg.num_moe_layers, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    routes = torch.rand(B, T, L, cfg.num_experts, generator=g).argsort(-1)[..., :K]
    with torch.no_grad():
        ref_r3 = shifted(ref(ids, routed_experts_BTLK=routes).logits_BTV, ids)
        nat = ref(ids)
        ref_nat = shifted(nat.logits_BTV, ids)

    init_single_process_group()
    report: dict = {"device": torch.cuda.get_device_name(0)}
    ok = True

    def run(opts: MegatronOptions):
        initialize_parallel(opts)
        model = build_gpt_model(cfg, opts).eval()
        convert.load_hf_into_megatron(model, sd, cfg)
        replay = RouteReplay(model, cfg.num_experts)
        x = ids.cuda()
        with torch.no_grad():
            with replay.session(Mode.REPLAY):
                replay.set_routes(routes)
                r3 = token_logprobs(forward_logits(model, x)[:, :-1], x[:, 1:]).cpu()
            with replay.session(Mode.RECORD):
                natural = token_logprobs(forward_logits(model, x)[:, :-1], x[:, 1:]).cpu()
                rec = replay.recorded(B, T)
            with replay.session(Mode.REPLAY):
                replay.set_routes(rec)
                again = token_logprobs(forward_logits(model, x)[:, :-1], x[:, 1:]).cpu()
        return model, r3, natural, rec, again

    model, r3, natural, rec, again = run(MegatronOptions(use_transformer_engine=True))
    lay = convert.Layout.of_model(model)
    back = convert.megatron_to_hf_state_dict(model, cfg)
    same_routes = (rec.sort(-1).values == nat.natural_BTLK.sort(-1).values).all(-1).float()
    report["fp32"] = {
        "te_fused_norms": lay.te_fused_norms, "grouped_experts": lay.grouped_experts,
        "roundtrip_exact": set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd),
        "r3_maxabs_vs_torch": float((r3 - ref_r3).abs().max()),
        "natural_maxabs_vs_torch": float((natural - ref_nat).abs().max()),
        "natural_route_agreement": float(same_routes.mean()),
        "record_replay_identical": bool(torch.equal(natural, again)),
    }
    f = report["fp32"]
    ok &= f["te_fused_norms"] and f["grouped_experts"] and f["roundtrip_exact"]
    ok &= f["r3_maxabs_vs_torch"] <= TOL and f["record_replay_identical"]
    ok &= f["natural_route_agreement"] >= 0.99

    _, r3_bf16, nat_bf16, rec_bf16, _ = run(MegatronOptions(
        use_transformer_engine=True, params_dtype="bfloat16", router_dtype="fp32"))
    flips = (rec_bf16.sort(-1).values != rec.sort(-1).values).any(-1).float()
    report["bf16"] = {
        "r3_maxabs_vs_fp32": float((r3_bf16 - ref_r3).abs().max()),
        "r3_meanabs_vs_fp32": float((r3_bf16 - ref_r3).abs().mean()),
        "natural_meanabs_vs_fp32": float((nat_bf16 - ref_nat).abs().mean()),
        "route_flip_rate_token_layer": float(flips.mean()),
        "tokens_with_a_flip": float(flips.amax(-1).mean()),
    }

    refused = []
    for field, value in (("moe_router_fusion", True), ("moe_expert_capacity_factor", 1.0)):
        tc = transformer_config(cfg, MegatronOptions(use_transformer_engine=True))
        setattr(tc, field, value)
        try:
            check_replay_compatible(tc)
        except ReplayBypassError:
            refused.append(field)
    report["refused"] = refused
    ok &= len(refused) == 2

    # the actor on CUDA (TE spec where installed): chunked R3 log-probs, routes run, one update
    # with the torch actor's load-balancing loss, and the bucketed HF export
    from lockstep.trainer.actor.batch import Batch
    from lockstep.trainer.config.sections import ActorConfig
    from lockstep.trainer.actor.megatron.actor import MegatronActor
    actor = MegatronActor(ref, ActorConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=2,
                                           aux_loss_coef=0.01), total_updates=2)
    lens = torch.full((B,), T)
    batch = Batch(ids, torch.arange(T)[None].expand(B, T) >= 4, torch.zeros(B, T), lens,
                  routes.to(torch.uint8), torch.ones(B, T, dtype=torch.bool))
    got = actor.logprobs(batch, batch.rollout_routes_BTLK, batch.rollout_routes_valid_BT,
                         record=True)
    err = float((got.logprobs_BT[:, 1:] - ref_r3).abs().max())
    same_routes = bool(torch.equal(got.routes_BTLK.long(), routes))
    mask = batch.response_mask_BT.float()

    def loss_fn(lp, ent, rows, mini):
        return -(lp * mask[rows]).sum() / mask[mini].sum(), {}
    metrics, used, _ = actor.update(batch, loss_fn, batch.rollout_routes_BTLK,
                                    batch.rollout_routes_valid_BT, shuffle_seed=0)
    exported = {k for bucket in actor.export_weights(1 << 20) for k, _ in bucket}
    report["actor"] = {"chunked": actor.chunked_logprobs, "r3_maxabs_vs_torch": err,
                       "routes_run_equal_given": same_routes,
                       "grad_norm": metrics["actor/grad_norm"],
                       "aux_loss": metrics.get("actor/aux_loss"),
                       "export_keys_equal": exported == set(sd)}
    ok &= err <= 1e-4 and same_routes and exported == set(sd) and bool(
        torch.isfinite(torch.tensor(metrics["actor/grad_norm"])))
    report["ok"] = bool(ok)
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
