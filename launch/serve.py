"""`lockstep serve --model DIR`: serve an HF Qwen3-MoE folder with SGLang's /generate wire format.

    lockstep serve --model runs/toy/ckpt/hf --dtype bf16 --port 30000
    lockstep serve --model DIR --api-key secret --router-dtype fp32 --lm-head-dtype fp32

DIR is any HF Qwen3-MoE folder: one written by lockstep (`save_hf`) or by transformers'
`save_pretrained`. The server binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import sys

_DTYPES = ["bf16", "fp16", "fp32"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over HTTP (SGLang /generate wire format)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="HF Qwen3-MoE folder")
    p.add_argument("--dtype", choices=_DTYPES, default="bf16", help="engine dtype (default bf16)")
    p.add_argument("--router-dtype", choices=_DTYPES, default=None, help="router weights dtype")
    p.add_argument("--lm-head-dtype", choices=_DTYPES, default=None, help="LM head dtype")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-running", type=int, default=64, help="sequences decoded at once")
    p.add_argument("--max-len", type=int, default=None,
                   help="prompt + generated tokens per sequence (default: model's max positions)")
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096,
                   help="refuse sampling-mask requests whose support could exceed this (SGLang's flag)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without sampling_seed")
    p.add_argument("--weight-version", default="0", help="initial weight version")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from lockstep.moe.checkpoint import CheckpointError
    from lockstep.moe.config import ConfigError
    from lockstep.rollout.engine import Engine, EngineConfig
    from lockstep.rollout.server import run_server

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = EngineConfig(dtype=args.dtype, router_dtype=args.router_dtype,
                           lm_head_dtype=args.lm_head_dtype, max_running=args.max_running,
                           max_len=args.max_len, seed=args.seed)
        engine = Engine.from_hf(args.model, cfg, weight_version=args.weight_version)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"lockstep serve: cannot load {args.model}: {e}", file=sys.stderr)
        return 2
    print(f"lockstep serve: {args.model} ({args.dtype}) on http://{args.host}:{args.port}",
          flush=True)
    run_server(engine, host=args.host, port=args.port, api_key=args.api_key,
               model_path=args.model, sampling_mask_max_tokens=args.sampling_mask_max_tokens)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m lockstep.launch.serve --model DIR ...` (same as `lockstep serve`)."""
    parser = argparse.ArgumentParser(prog="lockstep")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
