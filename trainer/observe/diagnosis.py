"""Where, why and how much the engine and the actor disagree on one step's samples.

`analyze(record)` turns a `StepRecord` (a rollout dump, or what `lockstep diagnose` collected
live) into the report `lockstep diagnose` writes as report.json. Numbers that training also
logs come from the same functions and carry the same names, so a report and a run's
metrics.jsonl compare line by line:
  routing/*        `replay.route_divergence.routing_divergence(rollout routes, actor natural top-k,
                   rollout_routes_valid)`: every routed row, prompt rows included
  rollout_corr/*   `trainer.objective.correction.correct(run's correction config, pi_old, mu_old)`
  rollout/moe/*, actor/moe/*   expert load per MoE layer of the engine's routes and of the
                   actor's natural top-k (`trainer.expert_load`): response tokens with a route
What only a diagnosis has is under `diagnose/`:
  k3_kl_natural / k3_kl_replayed   k3 of mu_old vs the actor routing on its own / replaying
                   the engine's routes (R3's forward); the difference is what routing adds
  routing_k3_kl    k3(pi_old) - k3_kl_replayed: the part of the run's mismatch that routing
                   causes (0 under R3 by construction: its pi_old *is* the replayed forward)
  routing_k3_share routing_k3_kl / k3(pi_old)
  flipped_token_fraction, flipped_token_k3_share   response tokens whose predicting row
                   (position t-1: its hidden state gives token t's logits) has >= 1 flipped
                   layer, and their share of the summed per-token k3
  tis_clip_fraction / icepop_mask_fraction   response tokens token-level TIS would clip
                   (w > C) / IcePop would mask (w outside [lo, hi]), w = exp(pi_old - mu_old)
plus per-layer tables, tokens per expert and MoE layer (`expert_load`), flips and k3 by position, per-layer expert confusion, router margins
of flipped vs kept routes, the IS-weight distribution and the most divergent tokens.

Shapes: B samples, T time, L MoE layers, K top-k, E experts, N selected entries.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lockstep.replay import compare_routes
from lockstep.trainer.objective.correction import correct, CorrectionConfig
from lockstep.trainer.objective.rollout_corr import compute_offpolicy_metrics, parse_is_threshold
from lockstep.trainer.objective.stats import clamp_log_ratio, k3
from lockstep.trainer.observe.dump import StepRecord
from lockstep.trainer.observe.expert_load import (ACTOR_PREFIX, counted_tokens, load_counts,
                                                  load_metrics, ROLLOUT_PREFIX)

DEFAULT_TIS = 2.0
DEFAULT_ICEPOP = "0.5_2.0"
QUANTILES = (0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0)


def _stats(v: torch.Tensor) -> dict[str, float]:
    if v.numel() == 0:
        return {"count": 0}
    v = v.double()
    q = torch.quantile(v, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    return {"count": int(v.numel()), "mean": float(v.mean()),
            **{f"p{int(round(p * 100))}": x for p, x in zip(QUANTILES, q)}}


def _thresholds(corr: dict[str, Any]) -> tuple[float, tuple[float, float]]:
    """(TIS cap, IcePop bounds): the run's own where its correction is token TIS / IcePop."""
    tis, icepop = DEFAULT_TIS, parse_is_threshold(DEFAULT_ICEPOP)
    if corr.get("rollout_is") == "token":
        upper, lower = parse_is_threshold(corr["rollout_is_threshold"])
        if lower is None:
            tis = upper
        else:
            icepop = (upper, lower)
    return tis, (icepop[1], icepop[0])


def indexer_metrics(rollout_BTLK, actor_BTLK, valid_BT, model: dict) -> dict[str, float]:
    """indexer/flip_rate, per layer and token_any_flip (`replay.indexer_flip_rate`, the
    numbers training logs)."""
    from lockstep.replay import indexer_flip_rate

    r = indexer_flip_rate(rollout_BTLK, actor_BTLK, valid_BT)
    layers = model.get("indexer_layer_ids") or list(range(rollout_BTLK.shape[2]))
    out = {"indexer/flip_rate": float(r["flip_rate"]),
           "indexer/token_any_flip": float(r["token_any_flip"])}
    out.update({f"indexer/flip_rate/layer_{int(i)}": float(f)
                for i, f in zip(layers, r["flip_rate_layers"].tolist())})
    return out


def confusion(rollout_NLK: torch.Tensor, actor_NLK: torch.Tensor, E: int) -> torch.Tensor:
    """[L, E, E] counts: row = expert the engine used, column = expert the actor's router
    picked. Experts in both sets count on the diagonal; at a flipped (token, layer) the experts
    only the engine used are paired, in id order, with those only the actor picked."""
    N, L, K = rollout_NLK.shape
    a = rollout_NLK.long().sort(-1).values
    b = actor_NLK.long().sort(-1).values
    in_b = (a[..., :, None] == b[..., None, :]).any(-1)  # [N, L, K]
    in_a = (b[..., :, None] == a[..., None, :]).any(-1)
    layer_NLK = torch.arange(L)[None, :, None].expand(N, L, K)
    out = torch.zeros(L * E * E, dtype=torch.long)
    out.index_add_(0, (layer_NLK[in_b] * E + a[in_b]) * E + a[in_b],
                   torch.ones(int(in_b.sum()), dtype=torch.long))
    # order (token, layer, rank): the i-th engine-only expert of a row meets its i-th actor-only
    src = (layer_NLK[~in_b] * E + a[~in_b]) * E
    out.index_add_(0, src + b[~in_a], torch.ones(len(src), dtype=torch.long))
    return out.view(L, E, E)


def analyze(rec: StepRecord, tokenizer=None, top_tokens: int = 12,
            margin_bins: int = 30, weight_bins: int = 40) -> dict[str, Any]:
    """The report dict (see module doc). `tokenizer` (a `tokenizers.Tokenizer`) decodes the most
    divergent tokens; without one they are shown as ids."""
    h, t = rec.header, rec.tensors
    layers = rec.layer_names
    E, L = int(h["model"]["num_experts"]), len(layers)
    resp_BT = rec.response_mask
    valid_BT = t["rollout_routes_valid"]
    cmp = compare_routes(t["rollout_routes"], t["actor_routes"], valid_BT)
    metrics: dict[str, Any] = {"step": h["step"], "replay/mode": h["replay_mode"]}
    metrics.update(cmp.metrics("routing", layers))
    if "turns" in t:  # multi-turn: observation tokens are routed (and replayed), not trained
        obs_BT = (t["turns"] >= 0) & ~resp_BT
        metrics["diagnose/num_observation_tokens"] = int(obs_BT.sum())
        metrics["diagnose/num_turns_max"] = int(t["turns"].max()) + 1
        for name, m_BT in (("sampled", resp_BT), ("observation", obs_BT)):
            part = compare_routes(t["rollout_routes"], t["actor_routes"], valid_BT & m_BT)
            metrics[f"routing/{name}/flip_rate"] = part.metrics("r", layers)["r/flip_rate"]
    if "rollout_indexer" in t:  # DSA models: the indexer flip rate, as training logs it
        metrics.update(indexer_metrics(t["rollout_indexer"], t["actor_indexer"],
                                       t["rollout_indexer_valid"], h["model"]))
    corr_cfg = CorrectionConfig.from_dict(h["correction"])
    mask_f = resp_BT.float()
    metrics.update(correct(corr_cfg, t["old_logprobs"], t["rollout_logprobs"], mask_f).metrics)

    # k3 exactly as training computes rollout_corr/k3_kl (fp32), for all three forwards
    lr_BT = t["old_logprobs"] - t["rollout_logprobs"]
    k3_BT = k3(clamp_log_ratio(lr_BT))
    k3_old, k3_nat, k3_rep = (
        compute_offpolicy_metrics(t[k], t["rollout_logprobs"], mask_f)["k3_kl"]
        for k in ("old_logprobs", "natural_logprobs", "replayed_logprobs"))
    routing_k3 = k3_old - k3_rep
    # the row that predicts token t is t-1 (NOTE: position 0 is never a response token)
    pred_flip_BT = torch.zeros_like(resp_BT)
    pred_flip_BT[:, 1:] = cmp.any_flip_BT[:, :-1]
    flipped_BT = pred_flip_BT & resp_BT
    k3_sum = float(k3_BT[resp_BT].sum())
    tis, (ice_lo, ice_hi) = _thresholds(h["correction"])
    w_N = torch.exp(clamp_log_ratio(lr_BT))[resp_BT]
    n_resp = max(int(resp_BT.sum()), 1)
    metrics.update({
        "diagnose/num_samples": rec.size,
        "diagnose/num_response_tokens": int(resp_BT.sum()),
        "diagnose/k3_kl": k3_old,
        "diagnose/k3_kl_natural": k3_nat,
        "diagnose/k3_kl_replayed": k3_rep,
        "diagnose/routing_k3_kl": routing_k3,
        "diagnose/routing_k3_share": routing_k3 / k3_old if k3_old > 0 else 0.0,
        "diagnose/flipped_token_fraction": int(flipped_BT.sum()) / n_resp,
        "diagnose/flipped_token_k3_share":
            float(k3_BT[flipped_BT].sum()) / k3_sum if k3_sum > 0 else 0.0,
        "diagnose/tis_threshold": tis,
        "diagnose/tis_clip_fraction": float((w_N > tis).double().mean()) if len(w_N) else 0.0,
        "diagnose/icepop_bounds": [ice_lo, ice_hi],
        "diagnose/icepop_mask_fraction":
            float(((w_N < ice_lo) | (w_N > ice_hi)).double().mean()) if len(w_N) else 0.0,
        "diagnose/reward_mean": float(t["rewards"].nanmean()),  # NaN: a prompt without answer
    })

    # -- per layer: flips, overlap, margins of flipped vs kept routes ------------------
    margin_BTL = t["router_margin"]
    flip_NL, margin_NL = cmp.flip_BTL[valid_BT], margin_BTL[valid_BT]
    n_valid = max(int(valid_BT.sum()), 1)
    per_layer = []
    for j, name in enumerate(layers):
        f, m = flip_NL[:, j], margin_NL[:, j]
        per_layer.append({
            "layer": int(name), "flip_rate": metrics[f"routing/flip_rate/layer_{name}"],
            "topk_overlap": float(cmp.overlap_BTL[..., j][valid_BT].double().sum() / n_valid),
            "flips": int(f.sum()),
            "margin_flipped_median": float(m[f].median()) if f.any() else None,
            "margin_kept_median": float(m[~f].median()) if (~f).any() else None})
    top = float(margin_NL.max()) if margin_NL.numel() else 1.0
    edges = torch.linspace(0.0, max(top, 1e-6), margin_bins + 1)
    margin = {"flipped": _stats(margin_NL[flip_NL]), "kept": _stats(margin_NL[~flip_NL]),
              "hist": {"edges": edges.tolist(),
                       "flipped": torch.histogram(margin_NL[flip_NL].float(), edges)[0].long().tolist(),
                       "kept": torch.histogram(margin_NL[~flip_NL].float(), edges)[0].long().tolist()}}

    # -- by position (absolute position in prompt + response) ---------------------------
    T = resp_BT.shape[1]
    n_T = valid_BT.sum(0)
    flips_LT = cmp.flip_BTL.sum(0).T.double()  # invalid rows are False
    heat_LT = torch.where(n_T > 0, flips_LT / n_T.clamp(min=1), torch.full_like(flips_LT, math.nan))
    by_position = []
    for p in range(T):
        r = resp_BT[:, p]
        by_position.append({
            "position": p, "routed_tokens": int(n_T[p]),
            "flip_rate": float(heat_LT[:, p].mean()) if n_T[p] else None,
            "token_any_flip": float(cmp.any_flip_BT[:, p][valid_BT[:, p]].double().mean())
            if n_T[p] else None,
            "response_tokens": int(r.sum()),
            "k3_kl": float(k3_BT[:, p][r].mean()) if r.any() else None})

    # -- IS weights ------------------------------------------------------------------------
    logw = clamp_log_ratio(lr_BT[resp_BT].double())
    span = max(float(logw.abs().max()) if len(logw) else 0.0, math.log(tis) * 1.2, 1e-3)
    w_edges = torch.linspace(-span, span, weight_bins + 1, dtype=torch.float64)
    is_weights = {"stats": _stats(w_N), "log_hist": {
        "edges": w_edges.tolist(), "counts": torch.histogram(logw, w_edges)[0].long().tolist()}}

    conf = confusion(t["rollout_routes"][valid_BT], t["actor_routes"][valid_BT], E)
    # -- expert load, as training logs it: response tokens that have a route ---------------
    load_BT = counted_tokens(resp_BT, rec.seq_lens) & valid_BT
    loads = {who: load_counts(t[key], load_BT, E) for who, key in
             (("rollout", "rollout_routes"), ("actor", "actor_routes"))}
    metrics.update(load_metrics(loads["rollout"], layers, ROLLOUT_PREFIX))
    metrics.update(load_metrics(loads["actor"], layers, ACTOR_PREFIX))
    return {"header": h, "metrics": metrics, "per_layer": per_layer,
            "expert_load": {"layers": [int(x) for x in layers],
                            **{who: c.tolist() for who, c in loads.items()}},
            "by_position": by_position,
            "flip_heatmap": {"layers": [int(x) for x in layers],
                             "rows": [[None if math.isnan(x) else x for x in row]
                                      for row in heat_LT.tolist()]},
            "confusion": {f"layer_{name}": conf[j].tolist() for j, name in enumerate(layers)},
            "margin": margin, "is_weights": is_weights,
            "top_tokens": divergent_tokens(rec, lr_BT, k3_BT, cmp.flip_BTL, tokenizer, top_tokens)}


def _tok(tokenizer, i: int) -> str:
    if tokenizer is None:
        return f"<{i}>"
    s = tokenizer.id_to_token(int(i))
    return f"<{i}>" if s is None else s


def divergent_tokens(rec: StepRecord, lr_BT, k3_BT, flip_BTL, tokenizer, n: int) -> list[dict]:
    """The `n` response tokens with the largest per-token k3, decoded in context: the sample's
    text with the token in [brackets], the two log-probs, and the layers flipped at the row
    that predicted it."""
    resp = rec.response_mask
    score = torch.where(resp, k3_BT, torch.full_like(k3_BT, -1.0)).flatten()
    k = min(n, int(resp.sum()))
    out = []
    layers = rec.layer_names
    T = resp.shape[1]
    for idx in score.topk(k).indices.tolist():
        b, p = divmod(idx, T)
        ids = rec.input_ids[b, :int(rec.seq_lens[b])].tolist()
        P = int(rec.prompt_lens[b])
        text = "".join(_tok(tokenizer, i) for i in ids[:P]) + " | " + "".join(
            f"[{_tok(tokenizer, i)}]" if P + j == p else _tok(tokenizer, i)
            for j, i in enumerate(ids[P:]))
        out.append({"sample": b, "position": p, "response_position": p - P,
                    "token": _tok(tokenizer, ids[p]), "context": text,
                    "rollout_logprob": float(rec.rollout_logprobs[b, p]),
                    "old_logprob": float(rec.old_logprobs[b, p]),
                    "log_ratio": float(lr_BT[b, p]), "k3": float(k3_BT[b, p]),
                    "flipped_layers": [int(layers[j]) for j in
                                       flip_BTL[b, p - 1].nonzero().flatten().tolist()]})
    return out
