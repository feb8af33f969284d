"""Router families and their replay semantics (docs/model.md "Router families").

Shape legend: N tokens, E experts, K top-k, G expert groups.

Every family takes fp32 router logits and, optionally, replayed expert ids with a per-token
mask (and replayed gate weights), and returns (ids_NK, gates_NK, natural_NK):
- `natural_NK`: the family's own choice from the current logits (with the selection bias and
  the group limit where the family has them): what the divergence metrics compare against.
- `ids_NK`: the experts that run: the replayed ids where the mask is set, else natural.
- `gates_NK`: fp32 gate weights recomputed from the CURRENT unbiased scores at ids_NK, as the
  family normalises them, times routed_scaling_factor. The selection bias never enters them, and
  group limits do not apply to replayed ids (a replayed id outside the token's current best
  groups still runs, with its current score as weight). Gates stay differentiable in the logits
  at replayed ids too, so the router keeps its gradient under replay.
- Gate-weight replay (`replay_gates_NK`, docs/replay.md "Gate-weight replay"): where the mask
  is set, the gates' forward VALUE is the replayed weights while their gradient is the
  recomputed gates' (straight-through: g_replayed + (g_own - g_own.detach())), so the experts
  are combined exactly as the engine combined them and the router still learns.
"""

from __future__ import annotations

import torch

from ..kernels import exact as exact_kernels
from .config import ModelConfig


def route(logits_NE: torch.Tensor, cfg: ModelConfig, bias_E: torch.Tensor | None = None,
          replay_ids_NK: torch.Tensor | None = None, replay_mask_N: torch.Tensor | None = None,
          replay_gates_NK: torch.Tensor | None = None, exact: bool = False):
    """Pick (or replay) experts and compute their gate weights; see the module docstring.
    `exact`: batch-invariant softmax / sigmoid, sums in a fixed order and top-k ties to the lower
    index (kernels/exact.py)."""
    K = cfg.num_experts_per_tok
    if exact:
        softmax, sigmoid = exact_kernels.softmax, exact_kernels.sigmoid
        topk, row_sum = exact_kernels.topk_indices, exact_kernels.sum_in_order
    else:
        softmax, sigmoid = (lambda x: x.softmax(dim=-1)), torch.sigmoid
        topk = (lambda x, k: x.topk(k, dim=-1).indices)
        row_sum = (lambda x, dim: x.sum(dim=dim, keepdim=True))
    if replay_gates_NK is not None and replay_ids_NK is None:
        raise ValueError("replay_gates_NK given without replay_ids_NK (gate weights replay "
                         "with the experts they weighted)")

    def chosen(natural_NK):
        if replay_ids_NK is None:
            return natural_NK
        return torch.where(replay_mask_N[:, None], replay_ids_NK, natural_NK)

    if cfg.router == "softmax_topk":  # Qwen2/3-MoE
        probs_NE = softmax(logits_NE)
        natural_NK = topk(probs_NE, K)
        ids_NK = chosen(natural_NK)
        # NOTE: gather from the full softmax, not from top-k-zeroed probs: replayed experts
        # outside the current top-k must keep a non-zero weight and a gradient.
        gates_NK = probs_NE.gather(1, ids_NK)
        if cfg.norm_topk_prob:
            gates_NK = gates_NK / row_sum(gates_NK, -1)
    elif cfg.router == "topk_softmax":  # Mixtral: softmax over the k chosen logits
        natural_NK = topk(logits_NE, K)
        ids_NK = chosen(natural_NK)
        gates_NK = softmax(logits_NE.gather(1, ids_NK))
    else:  # sigmoid: DeepSeek-V3, Kimi-K2, GLM-4.5
        scores_NE = sigmoid(logits_NE)
        natural_NK = sigmoid_topk(scores_NE.detach(), cfg, bias_E, topk)
        ids_NK = chosen(natural_NK)
        gates_NK = scores_NE.gather(1, ids_NK)
        if cfg.norm_topk_prob:
            gates_NK = gates_NK / (row_sum(gates_NK, -1) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        gates_NK = gates_NK * cfg.routed_scaling_factor
    if replay_gates_NK is not None:
        # x - x.detach() is exactly 0 in the forward: the value is the replayed weights bit
        # for bit, the gradient d(gates)/d(logits) of the recomputed ones.
        st_NK = replay_gates_NK.float() + (gates_NK - gates_NK.detach())
        gates_NK = torch.where(replay_mask_N[:, None], st_NK, gates_NK)
    return ids_NK, gates_NK, natural_NK


def sigmoid_topk(scores_NE: torch.Tensor, cfg: ModelConfig, bias_E: torch.Tensor | None,
                 topk=None):
    """DeepSeek-V3's selection: top-k of scores + bias among the experts of the topk_group
    groups whose two best biased scores sum highest (no group limit when n_group == 1).
    `topk(x, k)` -> indices: torch's by default (`route` passes the exact one)."""
    if topk is not None:  # the exact one: ties to the lower index; the pair sum is one add
        return _sigmoid_topk_with(scores_NE, cfg, bias_E, topk)
    N, E = scores_NE.shape
    choice_NE = scores_NE if bias_E is None else scores_NE + bias_E
    if cfg.n_group > 1:
        G = cfg.n_group
        group_NG = choice_NE.view(N, G, E // G).topk(2, dim=-1).values.sum(dim=-1)
        best_NG = group_NG.topk(cfg.topk_group, dim=-1).indices
        keep_NG = torch.zeros(N, G, dtype=torch.bool, device=scores_NE.device)
        keep_NG.scatter_(1, best_NG, True)
        choice_NE = choice_NE.masked_fill(~keep_NG.repeat_interleave(E // G, dim=1),
                                          float("-inf"))
    return choice_NE.topk(cfg.num_experts_per_tok, dim=-1).indices


def _sigmoid_topk_with(scores_NE, cfg, bias_E, topk):
    N, E = scores_NE.shape
    choice_NE = scores_NE if bias_E is None else scores_NE + bias_E
    if cfg.n_group > 1:
        G = cfg.n_group
        grouped = choice_NE.view(N, G, E // G)
        top2 = grouped.gather(-1, topk(grouped, 2))
        best_NG = topk(top2[..., 0] + top2[..., 1], cfg.topk_group)
        keep_NG = torch.zeros(N, G, dtype=torch.bool, device=scores_NE.device)
        keep_NG.scatter_(1, best_NG, True)
        choice_NE = choice_NE.masked_fill(~keep_NG.repeat_interleave(E // G, dim=1),
                                          float("-inf"))
    return topk(choice_NE, cfg.num_experts_per_tok)


def router_probs(logits_NE: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Per-token distribution over experts for the load-balancing loss: the softmax for the
    softmax families, the sigmoid scores normalised to sum to one for the sigmoid family (as
    DeepSeek-V3's sequence-wise auxiliary loss)."""
    if cfg.router == "sigmoid":
        s = logits_NE.sigmoid()
        return s / s.sum(dim=-1, keepdim=True)
    return logits_NE.softmax(dim=-1)


def router_margin(logits_NE: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """fp32 [N]: `router_probs`' k-th minus (k+1)-th largest expert probability per token (k =
    num_experts_per_tok; 1 when every expert is picked): how far the router was from picking
    another set. What rollout dumps call the router margin (both actor backends)."""
    K = cfg.num_experts_per_tok
    probs_NE = router_probs(logits_NE.float(), cfg)
    if probs_NE.shape[-1] <= K:
        return torch.ones_like(probs_NE[:, 0])
    top_NK = probs_NE.topk(K + 1, dim=-1).values
    return top_NK[:, K - 1] - top_NK[:, K]


def partial_replay_mask(logits_NE: torch.Tensor, cfg: ModelConfig, replay_ids_NK: torch.Tensor,
                        rule: str, threshold: float) -> torch.Tensor:
    """bool [N]: where partial replay replays the given ids (lockstep.replay.PartialReplay):
    rule "margin": `router_margin` < threshold; rule "tolerance": the current `router_probs`
    mass on the own top-k minus the mass on the replayed ids <= threshold. No gradient."""
    with torch.no_grad():
        if rule == "margin":
            return router_margin(logits_NE, cfg) < threshold
        probs_NE = router_probs(logits_NE.float(), cfg)
        own_N = probs_NE.topk(cfg.num_experts_per_tok, dim=-1).values.sum(-1)
        replayed_N = probs_NE.gather(1, replay_ids_NK.long()).sum(-1)
        return own_N - replayed_N <= threshold


def expert_load(ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, fp32 [E], counting the (token, k) slots given."""
    return torch.bincount(ids_NK.reshape(-1).long(), minlength=num_experts).float()


def bias_update(load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step for e_score_correction_bias:
    rate * sign(mean load - load): under-loaded experts become more likely to be picked."""
    return rate * torch.sign(load_E.mean() - load_E)
