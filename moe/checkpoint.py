"""Hugging Face checkpoint folders for the supported MoE families (Qwen3-MoE, Qwen2-MoE,
Mixtral, GLM-4.5, DeepSeek-V3).

A folder holds `config.json`, `model.safetensors` (or shards `model-0000i-of-0000n.safetensors`
plus `model.safetensors.index.json` above `max_shard_bytes`), `generation_config.json`, and,
when given, the tokenizer files. SGLang, vLLM, transformers and Megatron bridges load it.
Experts are stacked in memory and written under HF's per-expert names.

`fp8=True` writes block FP8 in DeepSeek-V3's layout: every attention, MLP and expert
projection (`FP8_WEIGHTS`, the matmuls `MoEModel.set_precision(fp8=True)` quantises) as
float8_e4m3fn `X.weight` plus fp32 `X.weight_scale_inv` per 128x128 block, the rest (router,
norms, embeddings, LM head) in bf16, and config.json's `quantization_config` {quant_method:
fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}: what SGLang's
block-FP8 path loads. Reading such a folder dequantises (moe/hf_lazy.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..kernels.fp8 import BLOCK, quantize_weight
from .config import ModelConfig
from .hf_lazy import INDEX_FILE, SCALE_SUFFIX, SINGLE_FILE, CheckpointError, LazyHF
from .model import MoEModel

FP8_WEIGHTS = re.compile(
    r"\.(self_attn\.(q|k|v|o|q_a|q_b|kv_b)_proj|self_attn\.kv_a_proj_with_mqa"
    r"|mlp\.(experts\.\d+\.|shared_experts?\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
"""HF names of the weights a block-FP8 folder stores in FP8 (routers `mlp.gate`, the
shared-expert gate, norms, embeddings and the LM head stay bf16)."""
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [BLOCK, BLOCK]}


def hf_state_dict(model: MoEModel) -> dict[str, torch.Tensor]:
    """The model's weights under its family's HF names (experts unstacked; views, no copies).

    gpt-oss keeps transformers' stacked tensors (`mlp.router.{weight,bias}`,
    `mlp.experts.{gate_up_proj,gate_up_proj_bias,down_proj,down_proj_bias}`, `self_attn.sinks`).
    Mixtral's experts are `block_sparse_moe.experts.{e}.w1|w3|w2` (gate|up|down) and its router
    `block_sparse_moe.gate`; the others use `mlp.gate` and `mlp.experts.{e}.{gate,up,down}_proj`,
    with `mlp.gate.e_score_correction_bias` (sigmoid routers), `mlp.shared_experts.*`
    (DeepSeek-V3, GLM-4.5) or `mlp.shared_expert.*` + `mlp.shared_expert_gate` (Qwen2-MoE).
    """
    cfg = model.cfg
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens.weight}
    for i, layer in enumerate(model.layers):
        _layer_tensors(cfg, i, layer, sd)
    for k, mtp in enumerate(model.mtp):  # DeepSeek's layout: decoder layer L + k (moe/mtp.py)
        p = f"model.layers.{cfg.num_hidden_layers + k}."
        for name in ("enorm", "hnorm", "eh_proj"):
            sd[p + name + ".weight"] = getattr(mtp, name).weight
        sd[p + "shared_head.norm.weight"] = mtp.post_norm.weight
        _layer_tensors(cfg, cfg.num_hidden_layers + k, mtp.block, sd)
    sd["model.norm.weight"] = model.norm.weight
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight
    return sd


def mtp_copies(cfg: ModelConfig) -> set[str]:
    """Names an MTP layer of a released checkpoint may carry that are copies of the main
    model's embedding and LM head (transformers' MtpModel ignores them, so do we)."""
    return {f"model.layers.{cfg.num_hidden_layers + k}.{n}.weight"
            for k in range(cfg.num_nextn_predict_layers)
            for n in ("embed_tokens", "shared_head.head")}


def _layer_tensors(cfg: ModelConfig, i: int, layer, sd: dict[str, torch.Tensor]) -> None:
    """Decoder layer i's tensors under their HF names (into `sd`)."""
    p = f"model.layers.{i}."
    sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
    sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    mixer = "linear_attn." if i < cfg.num_hidden_layers and \
        cfg.layer_type(i) == "linear_attention" else "self_attn."
    for name, t in layer.self_attn.named_parameters():
        sd[p + mixer + name] = t
    if layer.is_moe:
        mlp = layer.mlp
        if cfg.model_type == "gpt_oss":  # stacked experts, as transformers stores them
            m = p + "mlp."
            sd[m + "router.weight"], sd[m + "router.bias"] = mlp.gate.weight, mlp.gate.bias
            for name, t in mlp.experts.named_parameters():
                sd[m + "experts." + name] = t
            return
        if cfg.model_type == "mixtral":
            m, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            m, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        sd[m + "gate.weight"] = mlp.gate.weight
        if mlp.e_score_correction_bias is not None:
            sd[m + "gate.e_score_correction_bias"] = mlp.e_score_correction_bias
        I = cfg.moe_intermediate_size
        gu, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
        for e in range(cfg.num_experts):
            sd[m + f"experts.{e}.{names[0]}.weight"] = gu[e, :I]
            sd[m + f"experts.{e}.{names[1]}.weight"] = gu[e, I:]
            sd[m + f"experts.{e}.{names[2]}.weight"] = down[e]
        for shared in ("shared_experts", "shared_expert", "shared_expert_gate"):
            if hasattr(mlp, shared):
                for name, t in getattr(mlp, shared).named_parameters():
                    sd[m + f"{shared}.{name}"] = t
    else:
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{n}.weight"] = getattr(layer.mlp, n).weight


def check_tensors(targets: dict[str, torch.Tensor], sd: Mapping[str, torch.Tensor],
                  values: bool = True) -> None:
    """Validate `sd` against `targets` (same names, shapes; floating point; finite) without
    touching either: every missing, unexpected or mis-shaped tensor in one error, then the
    first integer-typed or non-finite tensor by name (`values=False`: names and shapes only;
    `sd` then needs only `.shape`s)."""
    missing = sorted(k for k in targets if k not in sd)
    unexpected = sorted(k for k in sd if k not in targets)
    misshaped = sorted(f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(t.shape)}"
                       for k, t in targets.items() if k in sd and sd[k].shape != t.shape)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
    if misshaped:
        problems.append(f"mis-shaped tensors ({len(misshaped)}): {misshaped}")
    if problems:
        raise CheckpointError("checkpoint does not match the model config:\n  "
                              + "\n  ".join(problems))
    for k, t in targets.items() if values else ():
        src = sd[k]
        if t.is_floating_point() and not src.is_floating_point():
            raise CheckpointError(f"tensor {k} has dtype {src.dtype}; weights must be floating "
                                  f"point (the model's is {t.dtype})")
        if src.is_floating_point():
            problem = nonfinite(src, t.dtype)
            if problem:
                raise CheckpointError(f"tensor {k} {problem}")


def nonfinite(src: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why floating `src` cast to `dtype` (the model's) is not all finite, or None.

    Checked after the cast: a float64/fp32 value that is finite but beyond `dtype`'s range
    becomes inf in a bf16/fp16 model. fp8 tensors (which `isfinite` does not take) are
    checked through their cast too."""
    cast = src if src.dtype == dtype else src.to(dtype)
    if bool(torch.isfinite(cast).all()):
        return None
    wide = src.to(torch.float64)
    if bool(torch.isfinite(wide).all()):
        top = float(wide.abs().max())
        return (f"overflows the model's {str(dtype).removeprefix('torch.')}: |values| up to "
                f"{top:.3g}, its largest finite value is {torch.finfo(dtype).max:.3g}")
    return "contains NaN or Inf"


@torch.no_grad()
def load_hf_state_dict(model: MoEModel, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the model (casting to each parameter's dtype).

    Validate, then swap: every tensor is checked (`check_tensors`) before any is copied, so a
    bad checkpoint leaves the model as it was. A tied model accepts (and ignores) a
    `lm_head.weight` equal in shape. A `LazyHF` is read one tensor at a time (`_load_lazily`).
    """
    targets = hf_state_dict(model)
    if isinstance(sd, LazyHF):
        return _load_lazily(targets, sd, tied=model.lm_head is None,
                            skip=mtp_copies(model.cfg))
    extra = {k: v for k, v in sd.items() if k not in mtp_copies(model.cfg)}
    if model.lm_head is None:
        extra.pop("lm_head.weight", None)
    check_tensors(targets, extra)
    for k, t in targets.items():
        t.copy_(extra[k].to(t.dtype))


def _load_lazily(targets: dict[str, torch.Tensor], hf: LazyHF, tied: bool,
                 skip: set[str] = frozenset()) -> None:
    """`load_hf_state_dict` from a `LazyHF`, one tensor in memory at a time: names and shapes
    are checked from the headers first (`check_tensors`' message), each tensor's dtype and
    finiteness before its copy (a bad tensor stops a half-loaded model: for models being
    built, e.g. `load_hf`)."""
    check_tensors(targets, {k: torch.empty(hf.shape(k), device="meta") for k in hf
                            if not (tied and k == "lm_head.weight") and k not in skip},
                  values=False)
    for k, t in targets.items():
        src = hf[k]
        check_tensors({k: t}, {k: src})
        t.copy_(src.to(t.dtype))
        del src


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_hf(model: MoEModel, out_dir: str | os.PathLike, tokenizer=None,
            generation_config: dict | None = None, max_shard_bytes: int = 2 * 1024**3,
            dtype: torch.dtype | None = None, fp8: bool = False) -> Path:
    """Write an HF folder (`fp8`: in block FP8, module docstring). The write goes to a
    temporary sibling and is renamed into place, so a killed save never leaves a half-written
    checkpoint under `out_dir`."""
    return save_hf_state_dict(hf_state_dict(model), model.cfg, out_dir, tokenizer,
                              generation_config, max_shard_bytes, dtype, fp8)


def fp8_state_dict(weights: Mapping[str, torch.Tensor],
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """HF-named tensors in block FP8: each `FP8_WEIGHTS` tensor as float8_e4m3fn + its fp32
    `weight_scale_inv`, every other one in `dtype` (the selection bias stays fp32)."""
    out = {}
    for k, v in weights.items():
        v = v.detach()
        if FP8_WEIGHTS.search(k):
            out[k], out[k + SCALE_SUFFIX] = quantize_weight(v)
        else:
            out[k] = v if k.endswith("e_score_correction_bias") else v.to(dtype)
    return out


def save_hf_state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig,
                       out_dir: str | os.PathLike, tokenizer=None,
                       generation_config: dict | None = None, max_shard_bytes: int = 2 * 1024**3,
                       dtype: torch.dtype | None = None, fp8: bool = False) -> Path:
    """`save_hf` from HF-named tensors (e.g. an actor's exported weight buckets) and a config."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        _rmtree(tmp)
    tmp.mkdir(parents=True)
    if fp8:
        weights = fp8_state_dict(weights, dtype or torch.bfloat16)
        dtype = None
    # The selection bias stays fp32 whatever `dtype` (as transformers keeps it).
    sd = {k: (v.detach().to(dtype) if dtype and not k.endswith("e_score_correction_bias")
              else v.detach()).contiguous().cpu()
          for k, v in weights.items()}
    cfg.save_json(tmp / "config.json")
    if fp8:
        hf = json.loads((tmp / "config.json").read_text())
        hf.update(quantization_config=FP8_QUANTIZATION_CONFIG, torch_dtype="bfloat16")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        if shards[-1] and size + _tensor_bytes(v) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += _tensor_bytes(v)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], tmp / SINGLE_FILE, metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / name, metadata=meta)
            weight_map.update({k: name for k in shard})
        total = sum(_tensor_bytes(v) for v in sd.values())
        (tmp / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    write_hf_extras(cfg, tmp, tokenizer, generation_config, config=False)
    if out.exists():
        _rmtree(out)
    tmp.rename(out)
    return out


def write_hf_extras(cfg: ModelConfig, folder: str | os.PathLike, tokenizer=None,
                    generation_config: dict | None = None, config: bool = True) -> None:
    """The files of an HF folder besides the weights: config.json (when `config`),
    generation_config.json and, when given, the tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if config:
        cfg.save_json(folder / "config.json")
    gen = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, name) is not None:
            gen[name] = getattr(cfg, name)
    gen.update(generation_config or {})
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        from .tokenizer import save_tokenizer

        save_tokenizer(tokenizer, folder, cfg)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def read_hf_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a folder (single file or sharded with an index), under their HF names,
    as stored (`LazyHF` read whole). Only regular files are opened; a damaged file is named
    in the error."""
    hf = LazyHF(folder, dtype=None)
    return {k: hf[k] for k in hf}


_SAID_NO_MTP: set[str] = set()


def folder_config(folder: str | os.PathLike) -> ModelConfig:
    """The ModelConfig a folder loads as: its config.json, less the MTP layers
    (`num_nextn_predict_layers`) when the folder holds weights but none of theirs.
    transformers' `save_pretrained` writes `num_nextn_predict_layers: 1` without the MTP
    weights, and a DeepSeek / GLM release stripped of its MTP layer keeps the key; the policy's
    log-probs never go through MTP (docs/model.md "MTP layers"), so such a folder loads without
    them, said once per folder (a warning). A folder of config.json alone (a plan) is left as
    it says. Every loader of a policy folder reads its config here (load_hf, the experiment's
    `model.path`, `lockstep serve`, the fleet)."""
    cfg = ModelConfig.from_json(folder)
    folder = Path(folder)
    folder = folder.parent if folder.name == "config.json" else folder
    if not cfg.num_nextn_predict_layers or not (
            (folder / INDEX_FILE).exists() or (folder / SINGLE_FILE).exists()
            or any(folder.glob("*.safetensors"))):
        return cfg
    if f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in LazyHF(folder, dtype=None):
        return cfg
    key = str(folder.resolve())
    if key not in _SAID_NO_MTP:
        _SAID_NO_MTP.add(key)
        import warnings

        warnings.warn(f"{folder}: config.json says num_nextn_predict_layers="
                      f"{cfg.num_nextn_predict_layers} but the folder holds no MTP weights "
                      f"(model.layers.{cfg.num_hidden_layers}.eh_proj.weight): loading it "
                      "without MTP layers (they only draft; the policy never uses them)",
                      stacklevel=2)
    return dataclasses.replace(cfg, num_nextn_predict_layers=0)


def load_hf(folder: str | os.PathLike, dtype: torch.dtype = torch.float32) -> MoEModel:
    """Build a model from an HF folder of a supported family (ours or one written by
    transformers); the family comes from config.json's model_type (MTP layers the folder has
    no weights for are left out: `folder_config`)."""
    cfg = folder_config(folder)
    hf = LazyHF(folder, dtype=None)
    model = MoEModel(cfg)
    try:  # one tensor at a time: the model plus one tensor in memory
        load_hf_state_dict(model, hf)
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    if dtype != torch.float32:
        model.set_precision(dtype)
    return model
