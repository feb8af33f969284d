"""Stitching overhead of multi-turn routes on the wire: a turn after the first asks only its new
route rows (`routed_experts_start_len` = the previous turn's trace end, `GenerateRequest.
routes_start`) vs asking for every row of the trajectory at every turn.

B trajectories run together (one /generate call per turn, B requests), each turn sampling R
tokens and appending an observation of O tokens, over `lockstep serve` (its app on a loopback
thread, fp32) or any SGLang-compatible server given by --url (real SGLang: its prefix cache
serves the earlier turns). Measured in one run, both modes interleaved, for SGLang's int32
route encoding and lockstep's compact one:

- route bytes received per trajectory (the base64 `routed_experts` payloads, all turns), and
  the ratio stitched / all rows (< 1: what stitching saves; it falls as turns grow, since
  asking all rows every turn sends O(turns^2) rows);
- wall time per turn (median over turns x repeats), ratio stitched / all rows;
- a check that both give the same trace (the stitched one equals the last turn's full one)
  wherever both sampled the same tokens (all of them for lockstep serve; real SGLang ignores
  sampling_seed without --enable-deterministic-inference, so use --temperature 0 there).

Measured on the shared 2-core host (lockstep serve on a thread, 4 layers / 3 MoE, top-4 of 16,
8 trajectories, prompt 32, 16 + 16 tokens per turn): route bytes stitched / all rows 0.63 at 2
turns, 0.38 at 4, 0.21 at 8 (int32: 6.6 vs 10.5, 11.9 vs 31.7, 22.6 vs 106.0 KiB per
trajectory; compact: 0.6 vs 1.0, 1.1 vs 3.0, 2.2 vs 10.0 KiB); time per turn ratio 0.79-1.16:
at this size a turn's time is the engine's sampling, and the host's drift (+-25%) hides the
decode saving. Against real SGLang 0.5.23 on CPU (fp32, the same shape with 4 MoE layers,
--temperature 0): the same bytes and ratios (SGLang sends int32 whatever is asked), time per
turn ratio 0.94-1.53 (noise of a loaded host, not a trend).

    OMP_NUM_THREADS=1 python bench/agent_stitch.py
    python bench/agent_stitch.py --turns 2 4 --repeats 1                  # quick
    python bench/agent_stitch.py --url http://127.0.0.1:30000 --model-path <hf folder>
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def model_and_server(args):
    """(model config, server URL, what to stop): a random model served on a thread, or the
    folder of --model-path for --url."""
    from lockstep.moe.config import ModelConfig
    if args.url:
        from pathlib import Path
        return ModelConfig.from_json(Path(args.model_path) / "config.json"), args.url, None
    from lockstep.moe.model import MoEModel
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.server import ServerThread
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                      max_position_embeddings=1024, mlp_only_layers=[0], eos_token_id=2,
                      pad_token_id=0, bos_token_id=1)
    torch.manual_seed(0)
    srv = ServerThread(Engine.from_model(MoEModel(cfg), EngineConfig(
        dtype="fp32", max_len=1024, max_running=args.trajectories))).start()
    return cfg, srv.url, srv


def run(client, cfg, args, turns: int, stitch: bool, seed: int):
    """One batch of trajectories; (route bytes, [seconds per turn], traces, token ids)."""
    from lockstep.replay.trace import RoutingTrace
    from lockstep.rollout.types import GenerateRequest, SamplingParams
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, cfg.vocab_size, (args.prompt,), generator=g).tolist()
           for _ in range(args.trajectories)]
    traces: list = [None] * args.trajectories
    before, times = client.route_bytes_received, []
    for t in range(turns):
        reqs = [GenerateRequest(list(x), SamplingParams(max_new_tokens=args.sampled,
                                                        temperature=args.temperature,
                                                        ignore_eos=True, seed=seed + 97 * b + t),
                                routes_start=traces[b].end if stitch and t else 0)
                for b, x in enumerate(ids)]
        t0 = time.perf_counter()
        results = client.generate(reqs)
        times.append(time.perf_counter() - t0)
        for b, res in enumerate(results):
            part = RoutingTrace(res.routes_NLK, cfg.num_experts, start=res.routes_start)
            traces[b] = part if traces[b] is None or not stitch else traces[b].extend(part)
            obs = torch.randint(3, cfg.vocab_size, (args.observation,), generator=g).tolist()
            ids[b] = ids[b] + res.output_ids + (obs if t + 1 < turns else [])
    return client.route_bytes_received - before, times, traces, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--sampled", type=int, default=16, help="tokens sampled per turn")
    ap.add_argument("--observation", type=int, default=16, help="observation tokens per turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--url", help="an SGLang-compatible server (default: lockstep serve here)")
    ap.add_argument("--model-path", help="the HF folder --url serves")
    args = ap.parse_args()
    if bool(args.url) != bool(args.model_path):
        ap.error("--url and --model-path go together")
    from lockstep.rollout.client import HTTPBackend
    cfg, url, srv = model_and_server(args)
    c = cfg
    print(f"model: {c.num_hidden_layers} layers ({len(c.moe_layer_ids)} MoE), "
          f"top-{c.num_experts_per_tok} of {c.num_experts} experts; {args.trajectories} "
          f"trajectories, prompt {args.prompt}, {args.sampled} sampled + {args.observation} observation tokens per turn; {url}")
    try:
        for compact in (False, True):
            client = HTTPBackend(url, cfg, compact_routes=compact)
            enc = "compact" if compact else "int32 (SGLang's)"
            for turns in args.turns:
                got = {True: ([], []), False: ([], [])}
                for rep in range(args.repeats):
                    for stitch in (True, False):  # interleaved: the host's drift hits both
                        nbytes, times, traces, ids = run(client, cfg, args, turns, stitch,
                                                         100 + rep)
                        got[stitch][0].append(nbytes / args.trajectories)
                        got[stitch][1].extend(times)
                        if stitch:
                            want = (traces, ids)
                        else:  # the last turn's full routes: the whole trajectory (where
                            # the tokens are the same: real SGLang ignores sampling_seed)
                            same = [(a, b) for a, b, x, y in zip(want[0], traces, want[1], ids)
                                    if x == y]
                            assert all(a == b for a, b in same), "traces differ"
                (sb, st), (fb, ft) = got[True], got[False]
                b_s, b_f = statistics.median(sb), statistics.median(fb)
                t_s, t_f = statistics.median(st), statistics.median(ft)
                print(f"{enc:>16}, {turns} turns: route bytes per trajectory stitched "
                      f"{b_s / 1024:.1f} KiB vs all rows every turn {b_f / 1024:.1f} KiB: ratio "
                      f"{b_s / b_f:.3f}; time per turn {t_s * 1e3:.1f} ms vs {t_f * 1e3:.1f} ms: "
                      f"ratio {t_s / t_f:.2f}")
    finally:
        if srv is not None:
            srv.stop()


if __name__ == "__main__":
    main()
