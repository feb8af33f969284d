"""Multi-token-prediction (MTP) layers of DeepSeek-V3 / GLM-4.5 / DeepSeek-V3.2 / GLM-5
checkpoints (`num_nextn_predict_layers`; transformers' `MtpModel` is the reference;
docs/model.md "MTP layers").

Shape legend (suffixes): B batch, T time, D model width, V vocabulary.

MTP layer k predicts the token two (k + 2) positions ahead: at position t it combines the
previous depth's hidden state h_t (for k = 0 the main model's final-normed hidden state) with
the embedding of token t + 1, as h' = block(eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])) at
position t + 1, and its logits are lm_head(post_norm(h')) (the embedding and the head are the
main model's). The block is a decoder layer of the family (an MoE layer with its own router).

Engines use these layers to draft tokens (speculative decoding); the policy's log-probs never
go through them, so they are loaded and saved with the model (and pushed to engines) but are
not part of `MoEModel.forward`, of its route axis or of route replay: an MTP router routes on
its own, and a routes tensor of the decoder's MoE layers never reaches it (NeMo-RL #3903:
replaying the decoder layer's routes that shares its layer number silently ran wrong experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import ModelConfig
from .layers import linear, rope_cos_sin


class MTPLayer(nn.Module):
    """One MTP depth: input norms and projection, a decoder block, its output norm. Its HF
    names are those of decoder layer `num_hidden_layers + k` (moe/checkpoint.py)."""

    def __init__(self, cfg: ModelConfig, k: int, decoder_layer, norm):
        super().__init__()
        D = cfg.hidden_size
        self.enorm, self.hnorm = norm(cfg, D), norm(cfg, D)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = decoder_layer(cfg, cfg.num_hidden_layers + k)
        self.post_norm = norm(cfg, D)  # HF name: shared_head.norm

    def forward(self, embeds_BTD, hidden_BTD, cos, sin_signed):
        x = linear(torch.cat([self.enorm(embeds_BTD), self.hnorm(hidden_BTD)], -1),
                   self.eh_proj.weight)
        b = self.block
        x = x + b.self_attn(b.input_layernorm(x), cos, sin_signed, None)
        h = b.post_attention_layernorm(x)
        if b.is_moe:  # routes on its own: no replayed ids, ever (module docstring)
            y = b.mlp(h, None, None)[0]
        else:
            y = b.mlp(h)
        return x + y


def mtp_hidden(model, hidden_BTD: torch.Tensor, next_ids_BT: torch.Tensor,
               positions_BT: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each MTP depth's post-normed hidden states [B, T, D], depth k over the pairs (h_t,
    x_{t+1+k}): `hidden_BTD` is the main model's final-normed hidden state at positions t,
    `next_ids_BT` the tokens at t + 1 (depth k > 0 takes the ids shifted by k more, which the
    caller appends: it gets T - k rows). `positions_BT`: of the next tokens (default 1..T)."""
    cfg = model.cfg
    B, T = next_ids_BT.shape
    if positions_BT is None:
        positions_BT = torch.arange(1, T + 1, device=next_ids_BT.device).expand(B, T)
    out, h = [], hidden_BTD.to(model.compute_dtype)
    for k, layer in enumerate(model.mtp):
        ids, pos = next_ids_BT[:, k:], positions_BT[:, k:]
        h = h[:, :ids.shape[1]]
        cos, sin_signed = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, h.dtype,
                                       cfg.rope_scaling, cfg.max_position_embeddings)
        h = layer.post_norm(layer(model.embed_tokens(ids).to(h.dtype), h, cos, sin_signed))
        out.append(h)
    return out
