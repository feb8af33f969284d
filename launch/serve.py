"""`lockstep serve --model DIR`: serve an HF Qwen3-MoE folder with SGLang's /generate wire format.

    lockstep serve --model runs/toy/checkpoints/step_200/hf --dtype bf16 --port 30000
    LOCKSTEP_API_KEY=... lockstep serve --model DIR --host 0.0.0.0 --router-dtype fp32

DIR is any HF Qwen3-MoE folder: one written by lockstep (`save_hf`) or by transformers'
`save_pretrained`. The server binds 127.0.0.1 unless --host says otherwise; on any other
address set an API key (LOCKSTEP_API_KEY or --api-key-file: clients then send
'Authorization: Bearer KEY'). User errors print one line `lockstep serve: ...`; --debug adds
the traceback.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import traceback

from lockstep.launch import entry  # first: sets the wait policy before torch loads

from lockstep.kernels.dtypes import ENGINE_PRECISIONS, PRECISIONS

_DTYPES = list(PRECISIONS)
API_KEY_ENV = "LOCKSTEP_API_KEY"


class ServeError(Exception):
    """A user error: printed as one line `lockstep serve: ...`."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over HTTP (SGLang /generate wire format)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="HF Qwen3-MoE folder")
    p.add_argument("--dtype", choices=list(ENGINE_PRECISIONS), default="bf16",
                   help="engine dtype (default bf16; fp8: bf16 with block-FP8 matmuls)")
    p.add_argument("--router-dtype", choices=_DTYPES, default=None, help="router weights dtype")
    p.add_argument("--lm-head-dtype", choices=_DTYPES, default=None, help="LM head dtype")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help=f"require 'Authorization: Bearer KEY', KEY read from FILE "
                        f"(or set {API_KEY_ENV})")
    p.add_argument("--api-key", default=None,
                   help=f"as --api-key-file, but visible to every user in `ps`: prefer "
                        f"{API_KEY_ENV} or --api-key-file")
    p.add_argument("--max-running", type=int, default=64, help="sequences decoded at once")
    p.add_argument("--max-len", type=int, default=None,
                   help="prompt + generated tokens per sequence (default: model's max positions)")
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096,
                   help="refuse sampling-mask requests whose support could exceed this (SGLang's flag)")
    p.add_argument("--max-request-mb", type=float, default=64.0,
                   help="largest request body in MiB (HTTP 413 above it; default 64)")
    p.add_argument("--weight-sync-timeout", type=float, default=600.0, metavar="S",
                   help="bound on joining a weight-update group and on each weight broadcast "
                        "(/init_weights_update_group, /update_weights_from_distributed)")
    p.add_argument("--idle-timeout", type=float, default=30.0, metavar="S",
                   help="close a connection with no request (idle, or headers still arriving) "
                        "after S seconds (default 30)")
    p.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="a request body must arrive within S seconds of its headers (HTTP 408; "
                        "default 60)")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="open connections at most (default 4096, and below the open-file "
                        "limit): one more evicts the oldest idle or slow-body connection")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without sampling_seed")
    p.add_argument("--weight-version", default="0", help="initial weight version")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="where the engine runs: cpu (default), cuda, cuda:N, or auto (cuda "
                        "when torch sees a GPU)")
    p.set_defaults(run=run)
    return p


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key is not None:
        print("lockstep serve: warning: --api-key shows the key to every user of this machine "
              f"(ps, /proc); use {API_KEY_ENV} or --api-key-file", file=sys.stderr, flush=True)
        key = args.api_key
    elif args.api_key_file is not None:
        path = args.api_key_file
        if not os.path.isfile(path):
            raise ServeError(f"--api-key-file {path}: not a readable regular file")
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ServeError(f"--api-key-file {path}: {e}") from None
        if not key:
            raise ServeError(f"--api-key-file {path} is empty")
    else:
        key = os.environ.get(API_KEY_ENV) or None
    if key is not None and (any(c.isspace() for c in key) or not key.isprintable()):
        raise ServeError("the API key must be printable with no whitespace (it is sent in an "
                         "HTTP header)")
    return key


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_args(args: argparse.Namespace) -> None:
    for name in ("threads", "max_running", "sampling_mask_max_tokens", "max_connections"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ServeError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    if args.max_len is not None and args.max_len < 2:
        raise ServeError(f"--max-len must be at least 2, got {args.max_len}")
    for name in ("idle_timeout", "body_timeout"):
        v = getattr(args, name)
        if not 0 < v < float("inf"):
            raise ServeError(f"--{name.replace('_', '-')} must be a positive number of seconds, "
                             f"got {v}")
    if not 0 < args.weight_sync_timeout < float("inf"):
        raise ServeError(f"--weight-sync-timeout must be a positive number of seconds, got "
                         f"{args.weight_sync_timeout}")
    if not 0 < args.max_request_mb <= 64 * 1024:
        raise ServeError(f"--max-request-mb must be in (0, 65536], got {args.max_request_mb}")
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in [0, 65535], got {args.port}")
    from lockstep.kernels.device import resolve_device
    try:
        resolve_device(args.device, "--device")
    except RuntimeError:  # torch's parse error lists every device type torch knows
        raise ServeError(f"--device {args.device}: expected 'cpu', 'cuda', 'cuda:N' or "
                         f"'auto'") from None
    except ValueError as e:  # cuda without a GPU here
        raise ServeError(f"--device {args.device}: {str(e).split(' but ')[-1]}") from None


def _check_port(host: str, port: int) -> None:
    """Fail before the (slow) model load when the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: {e.strerror or e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another "
                             f"server running there? pick another --port)") from None


def _serve(args: argparse.Namespace) -> int:
    import torch

    from lockstep.moe.checks import ConfigError
    from lockstep.moe.config import ModelConfig
    from lockstep.moe.hf_lazy import CheckpointError
    from lockstep.rollout.engine import Engine
    from lockstep.rollout.engine_config import EngineConfig
    from lockstep.rollout.server import run_server
    from lockstep.rollout.server_limits import ServerLimits

    _check_args(args)
    api_key = _api_key(args)
    if not _is_loopback(args.host) and api_key is None:
        print(f"lockstep serve: warning: listening on {args.host} without an API key: anyone "
              f"who can reach this port can generate and replace the weights; set "
              f"{API_KEY_ENV} or --api-key-file", file=sys.stderr, flush=True)
    _check_port(args.host, args.port)
    if args.threads:
        torch.set_num_threads(args.threads)
    from lockstep.kernels.threads import describe
    print(f"lockstep serve: {describe()}", file=sys.stderr, flush=True)
    try:
        mcfg = ModelConfig.from_json(args.model)
        if args.max_len is not None and args.max_len > mcfg.max_position_embeddings:
            raise ServeError(f"--max-len {args.max_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        cfg = EngineConfig(dtype=args.dtype, router_dtype=args.router_dtype,
                           lm_head_dtype=args.lm_head_dtype, max_running=args.max_running,
                           max_len=args.max_len, seed=args.seed, device=args.device)
        engine = Engine.from_hf(args.model, cfg, weight_version=args.weight_version)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        raise ServeError(f"cannot load {args.model}: {e}") from None
    print(f"lockstep serve: {args.model} ({args.dtype}) on http://{args.host}:{args.port}",
          flush=True)
    try:
        run_server(engine, host=args.host, port=args.port, api_key=api_key,
                   model_path=args.model, sampling_mask_max_tokens=args.sampling_mask_max_tokens,
                   max_body_bytes=int(args.max_request_mb * 1024 * 1024),
                   weight_sync_timeout_s=args.weight_sync_timeout,
                   limits=ServerLimits(idle_timeout_s=args.idle_timeout,
                                       body_timeout_s=args.body_timeout,
                                       max_connections=args.max_connections))
    except OSError as e:
        raise ServeError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    return 0


def run(args: argparse.Namespace) -> int:
    """User errors -> one line and exit 2 here; anything else goes to the CLI's handler
    (one line too, the traceback with --debug)."""
    try:
        return _serve(args)
    except ServeError as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"lockstep serve: {e}", file=sys.stderr, flush=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    """`python -m lockstep.launch.serve --model DIR ...` (same as `lockstep serve`)."""
    return entry.run(entry.command_parser([add_parser]),
                     ["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
