"""Routing traces, their wire codecs, divergence metrics and R2/R3 replay policies; the
lightning indexer's picks likewise (indexer.py, indexer_codec.py).

Imports of lockstep's only lockstep.kernels.routes (the one RouteError); otherwise torch,
numpy, safetensors and the standard library.
"""

from .codec import (
    COMPACT_HEADER_BYTES,
    ENCODING_COMPACT,
    ENCODING_INT32,
    ENCODING_REQUEST_FIELD,
    ENCODINGS,
    decode_compact,
    decode_routes,
    decode_sglang,
    encode_compact,
    encode_routes,
    encode_sglang,
    wire_bytes_per_token,
)
from .route_divergence import RouteComparison, compare_routes, routing_divergence
from .gates import GATES_REQUEST_FIELD, GATES_RESPONSE_FIELD, decode_gates, encode_gates
from .indexer import (IndexerTrace, batch_indexer_traces, concat_indexer_traces,
                      indexer_flip_rate)
from .policy import (GATES, INDEXER_MODES, NO_REPLAY, PARTIAL_RULES, PartialReplay, ReplayMode,
                     ReplayOptions, ReplayPlan, old_logprob_plan, update_plan)
from .trace import (
    RouteError,
    RoutingTrace,
    batch_traces,
    compact_dtype,
    concat_traces,
    load_traces,
    save_traces,
)

__all__ = [
    "COMPACT_HEADER_BYTES", "ENCODING_COMPACT", "ENCODING_INT32", "ENCODING_REQUEST_FIELD",
    "ENCODINGS", "GATES", "GATES_REQUEST_FIELD", "GATES_RESPONSE_FIELD", "INDEXER_MODES",
    "IndexerTrace", "batch_indexer_traces", "concat_indexer_traces", "indexer_flip_rate",
    "NO_REPLAY",
    "PARTIAL_RULES", "PartialReplay",
    "ReplayMode", "ReplayOptions", "ReplayPlan", "decode_gates", "encode_gates", "RouteComparison", "RouteError",
    "RoutingTrace", "batch_traces", "compact_dtype", "compare_routes", "concat_traces",
    "decode_compact", "decode_routes", "decode_sglang", "encode_compact", "encode_routes",
    "encode_sglang", "load_traces", "old_logprob_plan", "routing_divergence", "save_traces",
    "update_plan", "wire_bytes_per_token",
]
