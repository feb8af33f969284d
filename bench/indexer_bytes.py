"""Bytes per token of lightning-indexer picks at DeepSeek-V3.2's shape (61 decoder layers, each
with an indexer keeping index_topk = 2048 keys per query): SGLang's int32 layout (the baseline,
measured in the same run) against our compact encoding (replay/indexer_codec.py), and what one
RL step of a cluster would move.

Picks are synthetic, at each position p >= 2048 a set of 2048 of the p + 1 causal keys drawn
as a DSA indexer's tend to be (docs/replay.md "Indexer replay" says what real ones look like):
- `local`: the `--window` most recent keys, the first 16 (attention sinks) and the rest
  uniformly among the older keys;
- `uniform`: 2048 keys uniformly among the p + 1 (the worst case for gap coding).
Every layer draws its own set. Rows at p < 2048 pick every key (the compact encoding sends
nothing for them). The int32 bytes are exact (rows x 61 x 2048 x 4); the compact bytes are the
codec's real output for `--layers` layers at a grid of positions, scaled to 61 layers and
integrated over the sample's positions (they are linear in layers; the grid's spacing is
printed). Also the codec's own encode + decode time per token at that reduced shape.

    OMP_NUM_THREADS=1 python bench/indexer_bytes.py
    python bench/indexer_bytes.py --lengths 4096 8192 --grid 8      # quick
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from lockstep.replay.indexer import IndexerTrace
from lockstep.replay.indexer_codec import decode_compact_bytes, encode_compact_bytes, \
    leb128_sizes

LAYERS, TOPK = 61, 2048  # DeepSeek-V3.2: num_hidden_layers, index_topk
HEADER = 27              # the compact header (magic, version, rows, layers, top-k, start, bitmaps)


def picks_at(p: int, layers: int, kind: str, window: int, rng: np.random.Generator):
    """[layers, TOPK] ascending key positions for the query at position p (p >= TOPK)."""
    out = np.empty((layers, TOPK), dtype=np.int64)
    for layer in range(layers):
        if kind == "uniform":
            sel = rng.choice(p + 1, TOPK, replace=False)
        else:
            recent = np.arange(p + 1 - window, p + 1)
            sinks = np.arange(16)
            pool = np.arange(16, p + 1 - window)
            sel = np.concatenate([sinks, recent,
                                  rng.choice(pool, TOPK - window - 16, replace=False)])
        out[layer] = np.sort(sel)
    return out


def row_bytes(p: int, layers: int, kind: str, window: int, rng) -> tuple[int, int]:
    """(delta, bitmap) bytes the compact encoding would spend on the row at position p over
    `layers` layers (it sends the smaller)."""
    picks = picks_at(p, layers, kind, window, rng)
    gaps = np.diff(picks, axis=-1, prepend=-1) - 1
    return int(leb128_sizes(gaps).sum()), layers * ((p + 1 + 7) // 8)


def per_token(length: int, layers: int, kind: str, window: int, grid: int, rng) -> dict:
    """Mean bytes per token of a sample of `length` tokens (rows 0..length-2)."""
    rows = length - 1
    chosen = np.arange(TOPK, rows)                # rows with a real choice
    points = np.unique(np.linspace(TOPK, rows - 1, grid).astype(int))
    sizes = np.array([row_bytes(int(p), layers, kind, window, rng) for p in points], float)
    scale = LAYERS / layers
    delta_R = np.interp(chosen, points, sizes[:, 0]) * scale
    bitmap_R = np.interp(chosen, points, sizes[:, 1]) * scale
    raw = rows * LAYERS * TOPK * 4
    compact = np.minimum(delta_R, bitmap_R).sum() + HEADER + (len(chosen) + 7) // 8
    return dict(length=length, kind=kind, int32_per_token=raw / length,
                compact_per_token=compact / length, delta_per_token=delta_R.sum() / length,
                bitmap_per_token=bitmap_R.sum() / length, ratio=raw / compact,
                bitmap_rows=float((bitmap_R < delta_R).mean()), grid_spacing=int(
                    np.diff(points).mean()) if len(points) > 1 else 0)


def codec_time(length: int, layers: int, window: int, rng) -> dict:
    """Encode + decode of a whole sample at `layers` layers (the real codec, no scaling)."""
    picks = np.full((length - 1, layers, TOPK), -1, dtype=np.int64)
    for p in range(length - 1):
        if p + 1 <= TOPK:
            picks[p, :, :p + 1] = np.arange(p + 1)
        else:
            picks[p] = picks_at(p, layers, "local", window, rng)
    trace = IndexerTrace(torch.from_numpy(picks))
    t0 = time.perf_counter()
    raw = encode_compact_bytes(trace)
    t1 = time.perf_counter()
    back = decode_compact_bytes(raw, length - 1, layers, TOPK, 0)
    t2 = time.perf_counter()
    assert back == trace
    return dict(length=length, layers=layers, bytes=len(raw),
                int32_bytes=(length - 1) * layers * TOPK * 4,
                encode_s_per_token=(t1 - t0) / length, decode_s_per_token=(t2 - t1) / length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--layers", type=int, default=2, help="layers encoded (scaled to 61)")
    ap.add_argument("--grid", type=int, default=12, help="positions measured per length")
    ap.add_argument("--window", type=int, default=512, help="recent keys always picked (local)")
    ap.add_argument("--step-tokens", type=float, default=8192 * 8 * 512,
                    help="tokens of one cluster RL step (default 512 prompts x 8 samples x 8K)")
    ap.add_argument("--codec-length", type=int, default=3072,
                    help="sample length of the timed encode / decode")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("local", "uniform"):
        for length in args.lengths:
            r = per_token(length, args.layers, kind, args.window, args.grid, rng)
            rows.append(r)
            print(f"{kind:7s} {length:6d} tokens: int32 {r['int32_per_token'] / 1e3:6.1f} KB/token"
                  f"  compact {r['compact_per_token'] / 1e3:5.1f} KB/token  ratio "
                  f"{r['ratio']:5.1f}x  (all delta {r['delta_per_token'] / 1e3:5.1f}, all bitmap "
                  f"{r['bitmap_per_token'] / 1e3:5.1f} KB/token; {100 * r['bitmap_rows']:.0f}% "
                  f"of rows as bitmaps)")
    step = args.step_tokens
    for r in rows:
        if r["length"] == 8192:
            print(f"one RL step of {step / 1e6:.0f}M tokens at 8K ({r['kind']}): int32 "
                  f"{step * r['int32_per_token'] / 1e12:.1f} TB, compact "
                  f"{step * r['compact_per_token'] / 1e12:.2f} TB")
    t = codec_time(args.codec_length, args.layers, args.window, rng)
    print(f"codec at {args.layers} layers, {t['length']} tokens: {t['bytes'] / 1e3:.0f} KB vs "
          f"int32 {t['int32_bytes'] / 1e3:.0f} KB ({t['int32_bytes'] / t['bytes']:.1f}x); encode "
          f"{t['encode_s_per_token'] * 1e6:.0f} us/token, decode "
          f"{t['decode_s_per_token'] * 1e6:.0f} us/token (x {LAYERS / args.layers:.1f} for "
          f"61 layers)")
    print(json.dumps(dict(rows=rows, codec=t)))


if __name__ == "__main__":
    main()
