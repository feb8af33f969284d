"""Top-level `/generate` fields: what SGLang 0.5.23 knows, what lockstep serves, what it refuses.

SGLang parses the body into its `GenerateReqInput` dataclass (python/sglang/srt/managers/
io_struct.py) and drops keys it does not know, so a misspelled flag (`return_logprobs`)
silently means "off". The lockstep server is
stricter: a field outside SGLang's set and our documented extensions is refused with HTTP 400
naming it and the closest valid field. SGLang fields this server does not implement are
refused by name unless they hold their "off" value; fields that only label or route a
request (priority, routing key, trace headers, ...) are accepted and have no effect here.
"""

from __future__ import annotations

import difflib
from typing import Any

from .types import RequestError

# Fields lockstep implements (docs/rollout.md describes each).
SERVED = (
    "rid", "input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_routed_experts", "routed_experts_start_len",
    "return_sampling_mask", "sampling_logprobs_mode", "stream", "return_indexer_topk",
)
# Our extensions to the wire (a real SGLang server would not accept them in strict mode).
EXTENSIONS = ("lockstep_routed_experts_encoding", "lockstep_return_routed_gates",
              "lockstep_indexer_topk_start_len", "lockstep_indexer_topk_encoding")
# SGLang fields that label, log or route a request: no effect on one lockstep server.
NO_EFFECT = (
    "session_id", "log_metrics", "routed_dp_rank", "data_parallel_rank",
    "disagg_prefill_dp_rank", "kv_router_hint", "kv_hints", "routing_key", "conversation_id",
    "http_worker_ipc", "priority", "extra_key", "cache_salt", "no_logs", "custom_labels",
    "external_trace_header", "received_time", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "background",
    "return_text_in_logprobs",
)
# SGLang fields whose feature lockstep does not implement: refused unless null/false/empty/0.
NOT_SUPPORTED = (
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "token_ids_logprob", "return_flat_raw_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "return_flat_raw_output_top_logprobs",
    "return_hidden_states", "modalities", "session_params", "lora_path",
    "lora_id", "custom_logit_processor", "positional_embed_overrides", "require_reasoning",
    "max_thinking_tokens", "return_bytes", "return_entropy", "return_prompt_token_ids",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "multi_item_delimiter_indices", "token_indices_to_pool",
)
VALID = frozenset(SERVED + EXTENSIONS + NO_EFFECT + NOT_SUPPORTED)


def _off(v: Any) -> bool:
    return v is None or v is False or v == 0 or v in ([], {}, "")


def check_generate_fields(body: dict) -> None:
    """Refuse unknown top-level fields (naming the closest valid one) and SGLang features
    this server does not implement; accept the rest."""
    for k in body:
        if not isinstance(k, str) or k not in VALID:
            near = difflib.get_close_matches(str(k), sorted(VALID), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise RequestError(f"unknown /generate field {str(k)[:100]!r}{hint} (valid: SGLang's "
                               f"GenerateReqInput fields and {list(EXTENSIONS)}; see "
                               f"docs/rollout.md)")
        if k in NOT_SUPPORTED and not _off(body[k]):
            raise RequestError(f"/generate field {k!r} is an SGLang feature the lockstep server "
                               f"does not implement; leave it out")
