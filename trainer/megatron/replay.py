"""The one place in lockstep that touches megatron-core's `RouterReplay` state.

Shapes: B batch, T tokens per row, S = T padded to a multiple of TP, L MoE layers, K top-k,
E experts; N = S_local * B tokens a router sees on this rank.

megatron-core keeps replay state on one `RouterReplay` object per MoE router (also listed in
a class-level global) and switches it with an action (RECORD / REPLAY_FORWARD /
REPLAY_BACKWARD). `RouteReplay` wraps that in one context manager per call: it finds the
model's own routers (dense layers have none, so layer l is the l-th MoE layer), converts
`[B, T, L, K]` routes to the router's token order, sets the action, reads recordings back, and
always clears action and tensors on exit, also when the forward raised.

Router token order: megatron-core runs sequence-first ([S, B, D]); under tensor + sequence
parallelism TP rank r holds positions r*S/TP .. (r+1)*S/TP - 1 of every row, and its router
flattens them as n = s_local * B + b. Each data-parallel / expert-parallel rank routes only
its own micro-batch, so nothing else changes with EP.

Positions without a route (`valid_BT` False). megatron-core replays all tokens of a layer or
none, so "natural routing where no route was given" cannot happen inside one replayed
forward. lockstep therefore distinguishes:
- don't-care positions: padding and each row's last token. Causal attention means their
  routes reach no log-prob we compute (the last token predicts nothing). They get the
  natural routes from `fill_BTLK` when given, else expert ids (t*K + k) % E (a deterministic
  spread, so padding does not pile onto expert 0's EP rank).
- gaps: a position without route that an output depends on. They need `fill_BTLK`, which the
  actor takes from a RECORD pass of the same batch (natural routes with nothing replayed);
  without it, `build_replay_ids` raises naming sample and position.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch

Tensor = torch.Tensor


class Mode(enum.Enum):
    """What the routers do during a `RouteReplay.session`."""

    RECORD = "record"
    """Route naturally and record the chosen experts (R2's old-log-prob pass)."""
    REPLAY = "replay"
    """Use the given experts (R3 everywhere, R2 in updates); recomputation replays them too."""


def _router_modules(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if any(m.router_replay is None for m in found):
        raise ValueError("the model was built without moe_enable_routing_replay=True")
    return found


def build_replay_ids(ids_BTLK: Tensor, valid_BT: Tensor, *, num_experts: int,
                     fill_BTLK: Tensor | None = None,
                     seq_lens_B: Tensor | None = None) -> Tensor:
    """Full int64 routes [B, T, L, K]: given ids where valid, fills elsewhere (module doc).

    `seq_lens_B`: tokens per row; without it a row's tokens are taken to end one position
    after its last valid route (the routes contract: P+R tokens have P+R-1 routes).
    """
    if ids_BTLK.dim() != 4:
        raise ValueError(f"routes must be [B, T, L, K], got shape {tuple(ids_BTLK.shape)}")
    B, T, L, K = ids_BTLK.shape
    if valid_BT.shape != (B, T) or valid_BT.dtype != torch.bool:
        raise ValueError(f"valid_BT must be bool [{B}, {T}], got {valid_BT.dtype} "
                         f"{tuple(valid_BT.shape)}")
    if ids_BTLK.dtype.is_floating_point or ids_BTLK.dtype == torch.bool:
        raise ValueError(f"routes must be an integer tensor, got {ids_BTLK.dtype}")
    ids = ids_BTLK.to(torch.int64)
    bad = valid_BT[..., None, None] & ((ids < 0) | (ids >= num_experts))
    if bad.any():
        b, t, l, k = bad.nonzero()[0].tolist()
        raise ValueError(f"sample {b} position {t} MoE layer {l}: expert id {ids[b, t, l, k]} "
                         f"is outside [0, {num_experts})")
    if fill_BTLK is not None:
        if fill_BTLK.shape != ids.shape:
            raise ValueError(f"fill routes have shape {tuple(fill_BTLK.shape)}, expected "
                             f"{tuple(ids.shape)}")
        fill = fill_BTLK.to(torch.int64)
    else:
        t_T = torch.arange(T)
        spread_TK = (t_T[:, None] * K + torch.arange(K)) % num_experts
        fill = spread_TK[None, :, None, :].expand(B, T, L, K)
        t_BT = t_T.expand(B, T)
        if seq_lens_B is None:
            last_valid_B = torch.where(valid_BT, t_BT, torch.full_like(t_BT, -1)).amax(dim=1)
            needed_BT = t_BT <= last_valid_B[:, None]
        else:
            needed_BT = t_BT < (seq_lens_B.to(torch.int64)[:, None] - 1)
        gap_BT = needed_BT & ~valid_BT
        if gap_BT.any():
            b, t = gap_BT.nonzero()[0].tolist()
            raise ValueError(
                f"sample {b} position {t} has no route but later tokens depend on it; "
                "megatron-core replays a whole layer or nothing, so pass fill_BTLK (natural "
                "routes from a RECORD pass of this batch)")
    return torch.where(valid_BT[..., None, None], ids, fill)


def to_router_order(ids_BTLK: Tensor, tp: int, tp_rank: int) -> list[Tensor]:
    """Per-MoE-layer replay tensors [N, K] int64 for this TP rank (megatron's token order)."""
    B, T, L, K = ids_BTLK.shape
    S = -(-T // tp) * tp
    ids_SBLK = ids_BTLK.transpose(0, 1)
    if S != T:  # sequence padding added by forward_logits: don't-care positions
        pad = torch.zeros(S - T, B, L, K, dtype=ids_SBLK.dtype, device=ids_SBLK.device)
        pad += torch.arange(K, device=pad.device)
        ids_SBLK = torch.cat([ids_SBLK, pad], dim=0)
    s_loc = S // tp
    shard = ids_SBLK[tp_rank * s_loc:(tp_rank + 1) * s_loc]
    return [shard[:, :, l].reshape(-1, K).to(torch.int64).contiguous() for l in range(L)]


def from_router_order(per_layer_NK: list[Tensor], B: int, T: int, tp: int,
                      tp_group=None) -> Tensor:
    """Inverse of `to_router_order`: recorded local shards -> int64 [B, T, L, K] (all ranks)."""
    import torch.distributed as dist

    if tp > 1:
        gathered = []
        for x in per_layer_NK:
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x.contiguous(), group=tp_group)
            gathered.append(torch.cat(parts, dim=0))
        per_layer_NK = gathered
    K = per_layer_NK[0].shape[-1]
    ids_SBLK = torch.stack([x.view(-1, B, K) for x in per_layer_NK], dim=2)
    return ids_SBLK[:T].transpose(0, 1).to(device="cpu", dtype=torch.int64).contiguous()


class RouteReplay:
    """Record or replay routes on one megatron-core GPTModel (its own routers only)."""

    def __init__(self, model, num_experts: int):
        self.model = model
        self.num_experts = num_experts
        self.router_modules = _router_modules(model)
        self.routers = [m.router_replay for m in self.router_modules]
        self.tp = model.config.tensor_model_parallel_size
        self._mode: Mode | None = None
        self._natural: list[Tensor | None] = [None] * len(self.routers)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _tp_rank_and_group(self):
        from megatron.core import parallel_state as ps
        if self.tp == 1:
            return 0, None
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()

    @contextlib.contextmanager
    def session(self, mode: Mode, observe_natural: bool = False) -> Iterator["RouteReplay"]:
        """Routers in `mode` for the body; action and all route tensors cleared on exit.

        `observe_natural` (REPLAY): also note each router's own top-k for `natural()`, by
        re-running its gating on the same input after it ran (one small extra GEMM per
        layer; RECORD needs no such thing: what it records is the natural top-k).
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._mode is not None:
            raise RuntimeError(f"a {self._mode.value} session is already open on this model")
        self.clear()  # nothing from an earlier, foreign use may leak in
        action = RouterReplayAction.RECORD if mode is Mode.RECORD \
            else RouterReplayAction.REPLAY_FORWARD
        hooks = []
        try:
            for layer, (m, r) in enumerate(zip(self.router_modules, self.routers)):
                r.set_router_replay_action(action)
                if mode is Mode.REPLAY:
                    hooks.append(m.register_forward_pre_hook(_check_token_count(layer, r)))
                    if observe_natural:
                        hooks.append(m.register_forward_hook(self._observer(layer)))
            self._natural = [None] * self.num_layers
            self._mode = mode
            yield self
        finally:
            for h in hooks:
                h.remove()
            self.clear()

    def clear(self) -> None:
        """Drop action, given and recorded routes on every router of the model."""
        for r in self.routers:
            r.clear_router_replay_action()
            r.clear_indices()
        self._natural = [None] * self.num_layers
        self._mode = None

    def _observer(self, layer: int):
        def hook(module, args, output):
            with torch.no_grad():
                logits = module.gating(args[0]).view(-1, module.config.num_moe_experts)
                if module.config.moe_router_pre_softmax:  # what megatron-core's top-k sees
                    logits = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                self._natural[layer] = logits.topk(module.topk, dim=-1).indices
        return hook

    def natural(self, B: int, T: int) -> Tensor:
        """The routers' own top-k in the last forward, int64 [B, T, L, K]."""
        if self._mode is Mode.RECORD:
            return self.recorded(B, T)
        missing = [l for l, x in enumerate(self._natural) if x is None]
        if self._mode is None or missing:
            raise RuntimeError("natural() needs a RECORD session, or a REPLAY session opened "
                               "with observe_natural=True after a forward")
        _, group = self._tp_rank_and_group()
        return from_router_order(self._natural, B, T, self.tp, group)

    def set_routes(self, ids_BTLK: Tensor, valid_BT: Tensor | None = None, *,
                   fill_BTLK: Tensor | None = None, seq_lens_B: Tensor | None = None) -> Tensor:
        """Routes for the next forward (one micro-batch) in a REPLAY session; returns the
        int64 [B, T, L, K] routes it will run (given ids, fills elsewhere).

        Also queues them for REPLAY_BACKWARD, so a recomputed forward in the backward pass
        replays the same experts; call `backward_replays(output)` on the forward's output.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._mode is not Mode.REPLAY:
            raise RuntimeError("set_routes needs an open Mode.REPLAY session")
        if ids_BTLK.dim() != 4 or ids_BTLK.shape[2] != self.num_layers:
            raise ValueError(f"routes have shape {tuple(ids_BTLK.shape)}; expected [B, T, "
                             f"L={self.num_layers}, K] (MoE layers of this model)")
        if valid_BT is None:
            valid_BT = torch.ones(ids_BTLK.shape[:2], dtype=torch.bool)
        full = build_replay_ids(ids_BTLK, valid_BT.cpu(), num_experts=self.num_experts,
                                fill_BTLK=fill_BTLK, seq_lens_B=seq_lens_B)
        tp_rank, _ = self._tp_rank_and_group()
        for r, x in zip(self.routers, to_router_order(full, self.tp, tp_rank)):
            r.set_target_indices(x)
            # a previous micro-batch's backward may have left REPLAY_BACKWARD on
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return full

    def natural_routes_of(self, forward, B: int, T: int) -> Tensor:
        """Inside a REPLAY session: run `forward()` (no grad) with natural routing and return
        the routes it picked, int64 [B, T, L, K]; the session is left as it was (routes for
        the next forward still to be set). Used to fill gaps (module doc)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._mode is not Mode.REPLAY:
            raise RuntimeError("natural_routes_of needs an open Mode.REPLAY session")
        for r in self.routers:
            r.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            with torch.no_grad():
                forward()
            data = [r.get_recorded_indices() for r in self.routers]
            _, group = self._tp_rank_and_group()
            return from_router_order(data, B, T, self.tp, group)
        finally:
            for r in self.routers:
                r.recorded_topk_idx = None
                r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def backward_replays(self, output: Tensor) -> Tensor:
        """Identity on `output` that switches the routers to REPLAY_BACKWARD when the backward
        pass reaches it, i.e. before activation recomputation re-runs this micro-batch."""
        if self._mode is not Mode.REPLAY or not output.requires_grad:
            return output
        return _SwitchToBackwardReplay.apply(output, self)

    def recorded(self, B: int, T: int) -> Tensor:
        """Routes recorded by the last forward in a RECORD session: int64 [B, T, L, K]."""
        if self._mode is not Mode.RECORD:
            raise RuntimeError("recorded() needs an open Mode.RECORD session")
        data = [r.get_recorded_indices() for r in self.routers]
        missing = [l for l, x in enumerate(data) if x is None]
        if missing:
            raise RuntimeError(f"MoE layers {missing} recorded nothing: run a forward first")
        _, group = self._tp_rank_and_group()
        return from_router_order(data, B, T, self.tp, group)


def _check_token_count(layer: int, replay):
    """Pre-hook on a router: the replayed routes must cover exactly the tokens it routes.

    megatron-core gathers replayed ids with `scores.gather(1, ids)`, which accepts an index
    with FEWER rows than scores and silently leaves the remaining tokens unrouted.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def hook(module, args):
        action = replay.router_replay_action
        if action is RouterReplayAction.REPLAY_FORWARD:
            target = replay.target_topk_idx
        elif action is RouterReplayAction.REPLAY_BACKWARD:
            target = replay.replay_backward_list[0] if replay.replay_backward_list else None
        else:
            return None
        n = args[0].shape[:-1].numel()
        if target is None:
            raise RuntimeError(f"MoE layer {layer}: replay is on but no routes were set "
                               "for this forward (call set_routes first)")
        if target.shape[0] != n:
            raise RuntimeError(f"MoE layer {layer}: the router sees {n} tokens but the "
                               f"replayed routes cover {target.shape[0]} (routes were set for "
                               "another batch shape or TP layout)")
        return None

    return hook


class _SwitchToBackwardReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, replay: RouteReplay) -> Tensor:
        ctx.replay = replay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if ctx.replay._mode is Mode.REPLAY:
            for r in ctx.replay.routers:
                r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad, None
