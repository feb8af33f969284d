"""Tiny random HF folders of every supported MoE family, written by transformers itself."""

from pathlib import Path

import torch

# transformers config kwargs per family: hidden 32, 3 layers, vocab 64; routers sharpened and
# expert biases randomised after init (transformers initialises the bias to zero).
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2,
              bos_token_id=1, pad_token_id=0)
_DSA = dict(num_hidden_layers=4, num_key_value_heads=4, intermediate_size=48,
            moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=24,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
            index_topk=4, index_head_dim=16, index_n_heads=8)
HF_FAMILIES = {
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, rope_interleave=True)),
    # swiglu_limit small enough that the clamp bites at this init scale; a window of 4 under
    # prompts of 9-13 tokens; YaRN as gpt-oss releases it (factor 32, truncate false)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
        sliding_window=4, swiglu_limit=0.05,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16})),
    # 3 Gated DeltaNet layers to 1 gated full-attention layer, 2 key heads to 4 value heads
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, attention_bias=True)),
    # MLA with the lightning indexer keeping 4 of up to 13 keys; GLM-5 shares every second
    # layer's pick
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(_DSA)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        _DSA, indexer_types=["full", "shared", "full", "shared"])),
}


def write_hf_folder(family: str, out: Path, seed: int = 0, **overrides) -> Path:
    """save_pretrained a random tiny model of `family` to `out` (offline)."""
    import transformers

    cfg_cls, model_cls, kw = HF_FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **kw, **overrides})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                t.normal_(0.0, 0.5)  # decisive routing: ties would make top-k ambiguous
            if ".indexer." in name and "norm" not in name:
                t.normal_(0.0, 0.5)  # an indexer whose scores are spread: no ties at the k-th
            if name.endswith(("sinks", "router.bias", "_proj_bias", "proj.bias")) or \
                    (name.endswith("norm.weight") and not t.detach().ne(0).any()):
                t.normal_(0.0, 0.5)  # transformers initialises these (and 1 + w norms) to 0
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(out)
    return out


def hf_forward_with_routes(model, ids_BT, with_gates: bool = False):
    """transformers logits [B, T, V] and the router's top-k ids per MoE layer, sorted,
    [B, T, L, K], captured from the router modules' outputs (`with_gates`: also their gate
    weights [B, T, L, K], in the order of the sorted ids, and the lightning indexers' picks as
    bool [B, T, indexer layers, T], causal keys only; None without indexers)."""
    B, T = ids_BT.shape
    captured, weights, picks = [], [], []
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def indexer_hook(_module, _inputs, top_BTK):
        mask = torch.zeros(B, T, T, dtype=torch.bool).scatter_(-1, top_BTK.long(), True)
        picks.append(mask & causal)

    def hook(_module, _inputs, out):
        ids, order = out[2].reshape(B, T, -1).sort(-1)
        captured.append(ids)
        weights.append(out[1].reshape(B, T, -1).gather(-1, order))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith(("mlp.gate", "mlp.router"))
               and type(m).__name__.endswith(("Router", "TopkRouter", "TopKRouter"))]
    handles += [m.register_forward_hook(indexer_hook) for m in model.modules()
                if type(m).__name__.endswith("Indexer")]
    try:
        with torch.no_grad():
            logits = model(ids_BT).logits
    finally:
        for h in handles:
            h.remove()
    if with_gates:
        return (logits, torch.stack(captured, 2), torch.stack(weights, 2),
                torch.stack(picks, 2) if picks else None)
    return logits, torch.stack(captured, 2)
