"""Build a megatron-core MoE `GPTModel` equivalent to our `ModelConfig` (Qwen3-MoE and
GLM-4.5-style: docs/megatron.md "Supported families"; `check_supported` refuses the rest).

Shapes: B batch, T time (tokens per row), S = T padded to a multiple of TP (megatron-core
runs sequence-first, [S, B, D]), D model dim, V vocab (V/TP per tensor-parallel rank).

Mapping (Qwen3-MoE -> megatron-core `TransformerConfig`): GQA = `num_query_groups`; q/k norm =
`qk_layernorm` with RMSNorm; RoPE = `position_embedding_type="rope"`, `rotary_base`,
non-interleaved halves (HF `rotate_half`); softmax router top-k with `norm_topk_prob` =
softmax over the K selected logits (`moe_router_pre_softmax=False`), without it = softmax over
all E then top-k (`pre_softmax=True`); SwiGLU experts without bias = `gated_linear_unit` +
silu + `add_bias_linear=False`; dense layers = `moe_layer_freq` as a per-layer 0/1 list.

Routing replay is always on (`moe_enable_routing_replay=True`). Options that bypass it
(fused router, sinkhorn, token dropping / expert capacity) are refused by
`check_replay_compatible`, which `build_gpt_model` runs on the final TransformerConfig.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lockstep.kernels.dtypes import torch_dtype
from lockstep.moe.checks import ConfigError
from lockstep.moe.config import ModelConfig
# the options and the layout rules need no megatron-core import (trainer/config/load.py, the plan)
from lockstep.trainer.config.megatron import (MegatronOptions, check_layout,
                                              context_parallel_problems,
                                              megatron_args)


class ReplayBypassError(ValueError):
    """A megatron-core option that would silently skip `RouterReplay` was requested."""


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (the TE spec needs both)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(cfg: ModelConfig, opts: MegatronOptions):
    """megatron-core `TransformerConfig` for `cfg` laid out as `opts` says: the arguments of
    `layout.megatron_args` (what `lockstep plan` prints), after the layout rules and the
    checks of what this machine has (Transformer Engine, a GPU)."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    use_te = te_available() if opts.use_transformer_engine is None else opts.use_transformer_engine
    cp_problems = context_parallel_problems(opts, on_gpu, use_te)  # the TE reason first
    if cp_problems:
        raise ConfigError(cp_problems[0])
    check_layout(opts, None, on_gpu=on_gpu, cfg=cfg)
    if use_te and not te_available():
        raise ConfigError("megatron.use_transformer_engine=True needs a CUDA GPU and the "
                          "transformer_engine package")
    grouped = use_te if opts.grouped_gemm is None else opts.grouped_gemm
    if grouped and not use_te:
        raise ConfigError("megatron.grouped_gemm=True needs the Transformer Engine spec "
                          "(use_transformer_engine=True on a GPU)")
    if opts.fp8 and not use_te:
        raise ConfigError("actor.fp8=true with the megatron backend needs the Transformer "
                          "Engine spec (a CUDA GPU and transformer_engine): megatron-core's "
                          "local layers have no FP8 GEMM")
    if opts.router_dtype is not None and on_gpu and not use_te:
        # 0.16.1 reads `te_general_gemm` unconditionally once moe_router_dtype is set; only the
        # CPU bridge defines it when TE is missing, and the bridge never runs on a GPU.
        raise ConfigError("megatron.router_dtype on a GPU needs transformer_engine "
                          "(megatron-core 0.16.1 uses te_general_gemm for the router GEMM)")
    args = megatron_args(cfg, opts, use_te=use_te, on_gpu=on_gpu)
    if args["activation_func"] == "quick_gelu":  # gpt-oss: x * sigmoid(1.702 x)
        from megatron.core.activations import quick_gelu
        args["activation_func"] = quick_gelu
    else:
        args["activation_func"] = getattr(F, args["activation_func"])
    for k in ("params_dtype", "pipeline_dtype"):
        if args[k] is not None:
            args[k] = torch_dtype(args[k])
    config_cls = TransformerConfig
    if cfg.is_mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        config_cls = MLATransformerConfig
    yarn = {k: args.pop(k) for k in [k for k in args if k.startswith("yarn_")]}
    tc = config_cls(**args)
    for k, v in yarn.items():  # read by getattr (GPTModel, attention): not dataclass fields
        setattr(tc, k, v)
    return tc


def check_replay_compatible(tc) -> None:
    """Refuse TransformerConfig settings under which megatron-core skips or undoes replay."""
    if not tc.moe_enable_routing_replay:
        raise ReplayBypassError("moe_enable_routing_replay is False: routes cannot be replayed")
    if tc.moe_router_fusion:
        raise ReplayBypassError("moe_router_fusion=True: the fused TE top-k kernel never calls "
                                "RouterReplay, so given routes would be ignored")
    if tc.moe_router_load_balancing_type == "sinkhorn":
        raise ReplayBypassError("moe_router_load_balancing_type='sinkhorn' routes outside the "
                                "replayable top-k function")
    if tc.moe_expert_capacity_factor is not None:
        raise ReplayBypassError(f"moe_expert_capacity_factor={tc.moe_expert_capacity_factor}: "
                                "token dropping runs after replay and drops replayed routes")


def build_gpt_model(cfg: ModelConfig, opts: MegatronOptions | None = None, *, tc=None,
                    vp_stage: int | None = None):
    """A megatron-core GPTModel for `cfg` on the current parallel state (one PP stage, or its
    model chunk `vp_stage` under a virtual pipeline: `build_model_chunks` builds them all).

    `tc` overrides the TransformerConfig derived from `cfg`/`opts` (checked all the same).
    Weights are megatron-core's random init; load real ones with `convert.load_hf_into_megatron`.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    opts = opts or MegatronOptions()
    tc = tc if tc is not None else transformer_config(cfg, opts)
    check_replay_compatible(tc)
    use_te = tc.moe_grouped_gemm or (te_available() if opts.use_transformer_engine is None
                                     else opts.use_transformer_engine)
    from megatron.core import parallel_state as ps

    if getattr(tc, "multi_latent_attention", False) and not use_te:
        _patch_local_mla()
    vp = tc.virtual_pipeline_model_parallel_size is not None
    if vp and vp_stage is None:
        raise ValueError("a virtual pipeline model needs vp_stage (use build_model_chunks)")
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=use_te, normalization="RMSNorm",
                                      vp_stage=vp_stage if vp else None)
    pp = tc.pipeline_model_parallel_size > 1
    stage = dict(ignore_virtual=False, vp_stage=vp_stage) if vp else {}
    model = GPTModel(
        pre_process=ps.is_pipeline_first_stage(**stage) if pp else True,
        post_process=ps.is_pipeline_last_stage(**stage) if pp else True,
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="yarn" if hasattr(tc, "yarn_rotary_scaling_factor") else "rope",
        rotary_percent=cfg.partial_rotary_factor,
        rotary_base=int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        parallel_output=True,
        vp_stage=vp_stage if vp else None,
    )
    if tc.add_bias_linear and tc.num_moe_experts:
        _expert_bias_out_of_place(model)
    return model


def _expert_bias_out_of_place(model) -> None:
    """Local-spec experts with a bias (gpt-oss) at EP = ETP = 1: megatron-core 0.16.1's expert
    MLP adds its fc2 bias in place (`output += bias * probs`, transformer/mlp.py) to the
    output of the fc2's all-reduce, which over a group of one returns its input as-is from a
    custom autograd Function, and autograd forbids that in-place add. The all-reduce over one
    rank is the identity, so each such fc2 skips it as it does under expert parallelism
    (`explicit_expert_comm`): the same numbers, a fresh tensor."""
    for name, module in model.named_modules():
        if ".experts.local_experts." in name and name.endswith("linear_fc2") and \
                module.skip_bias_add and module.tp_group.size() == 1:
            module.explicit_expert_comm = True


def build_model_chunks(cfg: ModelConfig, opts: MegatronOptions | None = None, *, tc=None
                       ) -> list:
    """This rank's model chunks: one GPTModel per virtual pipeline stage (a list of one
    without a virtual pipeline). Chunk 0 of the first stage holds the embedding, the last
    chunk of the last stage the final norm and LM head."""
    opts = opts or MegatronOptions()
    tc = tc if tc is not None else transformer_config(cfg, opts)
    if opts.vpp == 1:
        return [build_gpt_model(cfg, opts, tc=tc)]
    return [build_gpt_model(cfg, opts, tc=tc, vp_stage=c) for c in range(opts.vpp)]


def _patch_local_mla() -> None:
    """megatron-core 0.16.1's local spec cannot build MLA as shipped (REFERENCE.md): the local
    `DotProductAttention` does not take the `k_channels` / `v_channels` MLA passes (its output
    width must be heads * v_channels), and without Transformer Engine MLA's
    `isinstance(linear_proj, TELinear)` meets a placeholder. Idempotent."""
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention as mla

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        mla.HAVE_TE = False
    cls = dpa.DotProductAttention
    if getattr(cls.__init__, "_lockstep_mla", False):
        return
    original = cls.__init__

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    __init__._lockstep_mla = True
    cls.__init__ = __init__


def initialize_parallel(opts: MegatronOptions) -> None:
    """megatron-core model-parallel groups + RNG tracker on an initialised torch.distributed.

    On a CPU-only torch this installs the CPU bridge first (see cpu_bridge.py).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "dist.init_process_group('gloo' | 'nccl', ...) first")
    if not torch.cuda.is_available():
        from lockstep.trainer.actor.megatron import cpu_bridge
        cpu_bridge.install()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=opts.tensor_parallel,
        expert_model_parallel_size=opts.expert_parallel,
        expert_tensor_parallel_size=opts.etp,
        pipeline_model_parallel_size=opts.pipeline_parallel,
        context_parallel_size=opts.context_parallel,
        virtual_pipeline_model_parallel_size=opts.vpp if opts.vpp > 1 else None,
    )
    model_parallel_cuda_manual_seed(opts.seed)


def padded_length(T: int, tensor_parallel: int) -> int:
    """Sequence length S >= T that sequence parallelism can split evenly over TP ranks."""
    return -(-T // tensor_parallel) * tensor_parallel


def forward_logits(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V/TP] (vocab-sharded under TP) for right-padded rows at positions 0..T-1;
    on a pipeline stage before the last, that stage's output hidden states (sequence-first).

    megatron-core's RoPE always uses positions arange(S), so rows must start at position 0
    (right padding). T is padded to a multiple of TP for sequence parallelism; the padding is
    at the end of every row, so causal attention keeps it invisible to real tokens.
    """
    tp = model.config.tensor_model_parallel_size
    B, T = input_ids_BT.shape
    S = padded_length(T, tp)
    ids_BS = F.pad(input_ids_BT, (0, S - T)) if S != T else input_ids_BT
    device = ids_BS.device
    pos_BS = torch.arange(S, device=device).expand(B, S)
    if ids_BS.is_cuda:
        # causal attention masks itself (TE / flash attention take no explicit causal mask)
        mask_11SS = None
    else:
        # True = masked out (megatron-core convention); explicit, as the default is built
        # on "cuda"
        mask_11SS = torch.ones(1, 1, S, S, dtype=torch.bool, device=device).triu(1)
    out = model(ids_BS, pos_BS, mask_11SS)
    if not is_last_stage(model):
        return out  # hidden states [S/TP, B, D] for the next pipeline stage
    return out[:, :T]


def is_last_stage(model) -> bool:
    """Whether `model` (a GPTModel, maybe DDP-wrapped) computes logits (the last PP stage)."""
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    return bool(model.post_process)


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(target) [B, T] in fp32 from (possibly vocab-sharded) logits, exact under TP."""
    from megatron.core import tensor_parallel

    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    # vocab_parallel_cross_entropy works sequence-first on [T, B, V/TP] and all-reduces the
    # max and the sum over the TP group, so no rank ever holds the full vocabulary.
    logits_TBV = logits.transpose(0, 1).contiguous()
    if logits_TBV.data_ptr() == logits_BTV.data_ptr():
        logits_TBV = logits_TBV.clone()  # NOTE: it works in place; never on the caller's logits
    nll_TB = tensor_parallel.vocab_parallel_cross_entropy(
        logits_TBV, targets_BT.transpose(0, 1).contiguous())
    return -nll_TB.transpose(0, 1)


def token_logprobs_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor,
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) [B, T] fp32 of softmax(logits / temperature), differentiable,
    from logits sharded over the vocabulary by TP (rank r holds ids r*V/TP ..).

    The sums over the vocabulary are all-reduced over the TP group with megatron-core's
    autograd-aware reduction (forward all-reduce, backward identity).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    x = logits_BTV.float() / temperature
    tp = ps.get_tensor_model_parallel_world_size()
    m = x.detach().amax(dim=-1)
    if tp > 1:
        import torch.distributed as dist
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    x = x - m[..., None]  # the max cancels in both results; it only keeps exp() finite
    e = x.exp()
    v_local = x.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local if tp > 1 else 0
    local_t = targets_BT - start
    here = (local_t >= 0) & (local_t < v_local)
    x_t = x.gather(-1, local_t.clamp(0, v_local - 1)[..., None])[..., 0] * here
    sums = torch.stack([e.sum(-1), (e * x).sum(-1), x_t], dim=-1)
    if tp > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    z, ex, xt = sums.unbind(-1)
    log_z = z.log()
    return xt - log_z, log_z - ex / z
