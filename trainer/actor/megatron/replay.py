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

Positions without a route (`valid_BT` False) are routed naturally *in the same forward*,
given the replayed history, exactly as lockstep's torch model does (`where(valid, given,
natural)` per layer): the adapter wraps each router's `get_replay_topk`, computes the router's
own top-k from the scores it was handed, and merges it with the given ids before gathering the
gate weights. The merged ids are what REPLAY_BACKWARD replays on recomputation and what
`used()` reports. The same wrapper notes the natural top-k for `natural()` (no extra GEMM).

Load-balancing loss (`aux_loss_coef > 0`): megatron-core's own `aux_loss` counts the natural
top-k even under replay, sums the MoE layers and (0.16.1) is only masked when the caller
threads a padding mask through GPTModel. The adapter computes the torch model's loss instead
(`MoEModel.load_balancing_loss`: E * sum_e f_e * P_e with f from the routes the forward ran and
P the mean router softmax, both over real tokens, averaged over MoE layers) and attaches it to
each router's output with megatron-core's `MoEAuxLossAutoScaler`, so it is backpropagated
inside the layer (also under activation recomputation).

Replay validator (`replay.check`, moe/replay_check.py): with `check` on, `set_routes` also
makes the forward's `RouteCheck` (in router order); the wrapper of each `TopKRouter.routing`
reports the experts in the routing map the router returned (what the dispatcher runs, read
after megatron-core, so a bypassed replay shows) with the natural top-k, and `finish_forward`
checks after the forward. A router in REPLAY_FORWARD with no routes set for its forward (the
last micro-batch's would be replayed), and routes set for a forward that never ran, stop it too.

Router margins (rollout dumps): a session opened with `margins=fn` also applies `fn` to each
router's logits in every forward (`moe.router.router_margin`: the torch model's definition)
and returns them per layer in [B, T] order, like the routes (`margins()`).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch

from lockstep.kernels.routes import RouteError, check_routes_BTLK
from lockstep.moe.replay_check import (LOGPROB_FORWARD, ReplayCheck, ReplayCheckError,
                                       RouteCheck, sample_slice)

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


def moe_indices(decoder_layers: list[int], moe_layer_ids: list[int], where: str) -> list[int]:
    """The MoE-layer index (L) of each router's decoder layer. A router in a layer the model
    config calls dense is one the replay plan does not know: `ReplayCheckError` naming it
    (`where`: the chunk or stage it is in) instead of routing on its own."""
    index = {i: j for j, i in enumerate(moe_layer_ids)}
    for i in decoder_layers:
        if i not in index:
            raise ReplayCheckError(
                f"megatron-core built a router in decoder layer {i} ({where}), but the model "
                f"config's MoE layers are {list(moe_layer_ids)}: a router the replay plan does "
                f"not know (it would route on its own)")
    return [index[i] for i in decoder_layers]


def build_replay_ids(ids_BTLK: Tensor, valid_BT: Tensor, *, num_experts: int) -> Tensor:
    """Int64 routes [B, T, L, K]: the given ids where valid, a placeholder elsewhere (expert
    ids (t*K + k) % E; the forward replaces them with the router's natural choice). Shapes are
    checked; the ids were validated where they entered (`RoutingTrace`) or are recorded ones."""
    check_routes_BTLK(ids_BTLK, valid_BT, mask="valid_BT")
    B, T, L, K = ids_BTLK.shape
    ids = ids_BTLK.to(torch.int64)
    t_T, k_K = torch.arange(T, device=ids.device), torch.arange(K, device=ids.device)
    spread_TK = (t_T[:, None] * K + k_K) % num_experts
    fill = spread_TK[None, :, None, :].expand(B, T, L, K)
    return torch.where(valid_BT[..., None, None], ids, fill)


def mask_to_router_order(mask_BT: Tensor, tp: int, tp_rank: int) -> Tensor:
    """bool [N] of this TP rank's router tokens (n = s_local * B + b); sequence padding False."""
    B, T = mask_BT.shape
    S = -(-T // tp) * tp
    m_SB = torch.zeros(S, B, dtype=torch.bool, device=mask_BT.device)
    m_SB[:T] = mask_BT.transpose(0, 1)
    s_loc = S // tp
    return m_SB[tp_rank * s_loc:(tp_rank + 1) * s_loc].reshape(-1)


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
                      tp_group=None, dtype: torch.dtype = torch.int64,
                      device: torch.device | str | None = "cpu") -> Tensor:
    """Inverse of `to_router_order`: recorded local shards -> [B, T, L, K] `dtype` (all
    ranks) on `device` (None: where the routers ran; the TP gather runs there)."""
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
    return ids_SBLK[:T].transpose(0, 1).to(device=device, dtype=dtype).contiguous()


class RouteReplay:
    """Record or replay routes on one megatron-core GPTModel (its own routers only).

    `aux_loss_coef` > 0 adds the torch model's load-balancing loss (module doc) to every
    training forward; `num_moe_layers` is the model's MoE layer count it is averaged over
    (default: the routers found here)."""

    def __init__(self, model, num_experts: int, aux_loss_coef: float = 0.0,
                 num_moe_layers: int | None = None, check: ReplayCheck = ReplayCheck.OFF,
                 min_overlap: float | None = None, moe_ids: list[int] | None = None):
        """`check` / `min_overlap`: the replay validator (module doc); `moe_ids`: the
        model's MoE-layer index of each router here (messages; default 0..)."""
        self.model = model
        self.num_experts = num_experts
        self.router_modules = _router_modules(model)
        self.routers = [m.router_replay for m in self.router_modules]
        self.tp = model.config.tensor_model_parallel_size
        self.device = next(model.parameters()).device  # the routers' device
        self.aux_loss_coef = aux_loss_coef
        self.aux_layers = num_moe_layers or len(self.routers)
        self._mode: Mode | None = None
        self._keep_N: Tensor | None = None      # replay: True = use the given id
        self._tokens_N: Tensor | None = None    # aux loss: real tokens
        self._aux_weight = 0.0
        self._natural: list[Tensor | None] = [None] * len(self.routers)
        self._used: list[Tensor | None] = [None] * len(self.routers)
        self._aux: list[Tensor | None] = [None] * len(self.routers)
        self._margin_fn = None                  # session(margins=...): logits_NE -> [N]
        self._margin: list[Tensor | None] = [None] * len(self.routers)
        self.check, self.min_overlap, self.moe_ids = ReplayCheck(check), min_overlap, moe_ids
        self._check: RouteCheck | None = None   # the forward's ledger, set by set_routes
        self._checked_forwards = 0
        for layer, (m, r) in enumerate(zip(self.router_modules, self.routers)):
            r.get_replay_topk = self._replay_topk(layer, r, r.get_replay_topk)
            m.routing = self._routing(layer, m, m.routing)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def decoder_layers(self) -> list[int]:
        """Global 0-based decoder layer of each router (megatron-core's `layer_number` - 1),
        in the order of `routers`: where the routes this model ran belong."""
        return [m.layer_number - 1 for m in self.router_modules]

    def _tp_rank_and_group(self):
        from megatron.core import parallel_state as ps
        if self.tp == 1:
            return 0, None
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()

    @contextlib.contextmanager
    def session(self, mode: Mode, margins=None) -> Iterator["RouteReplay"]:
        """Routers in `mode` for the body; action and all route tensors cleared on exit.
        `margins` (logits_NE -> fp32 [N], e.g. `moe.router.router_margin` for the model's
        family): each forward also notes it from every router's logits, for `margins()`."""
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
            self._mode, self._margin_fn = mode, margins
            yield self
            if self._check is not None:
                raise ReplayCheckError(
                    f"replay check ({self._check.what}): routes were set for MoE layers "
                    f"{self._check.moe_ids} but no forward consumed them")
        finally:
            for h in hooks:
                h.remove()
            self.clear()

    def clear(self) -> None:
        """Drop action, given and recorded routes on every router of the model."""
        for r in self.routers:
            r.clear_router_replay_action()
            r.clear_indices()
        n = self.num_layers
        self._natural, self._used, self._aux = [None] * n, [None] * n, [None] * n
        self._margin, self._margin_fn = [None] * n, None
        self._keep_N = self._tokens_N = None
        self._aux_weight = 0.0
        self._check = None
        self._mode = None

    def _replay_topk(self, layer: int, r, original):
        """`RouterReplay.get_replay_topk` that, in REPLAY_FORWARD, also computes the router's
        own top-k from the same scores, merges it in where no route was given, and notes both."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk=None):
            action = r.router_replay_action
            if action is RouterReplayAction.RECORD:
                out = original(scores, topk, num_groups, group_topk, default_compute_topk)
                self._natural[layer] = self._used[layer] = out[1]
                return out
            if action is not RouterReplayAction.REPLAY_FORWARD:
                return original(scores, topk, num_groups, group_topk, default_compute_topk)
            with torch.no_grad():
                natural = default_compute_topk(scores.detach(), topk, num_groups=num_groups,
                                               group_topk=group_topk)[1]
            ids = r.target_topk_idx.to(scores.device)
            if self._keep_N is not None:
                ids = torch.where(self._keep_N.to(scores.device)[:, None], ids, natural)
                r.target_topk_idx = ids
                if r.replay_backward_list:  # what recomputation replays: the merged ids
                    r.replay_backward_list[-1] = ids
            self._natural[layer], self._used[layer] = natural, ids
            return scores.gather(1, ids), ids
        return get_replay_topk

    def _routing(self, layer: int, module, original):
        """`TopKRouter.routing` plus the torch model's load-balancing loss and the replay
        validator's report (module doc)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def routing(logits, padding_mask=None):
            if self._margin_fn is not None:  # the router's logits as megatron-core gates them
                with torch.no_grad():
                    self._margin[layer] = self._margin_fn(
                        logits.detach().reshape(-1, self.num_experts)).float()[:, None]
            checking = (self.check is not ReplayCheck.OFF and module.router_replay
                        .router_replay_action is RouterReplayAction.REPLAY_FORWARD)
            if checking:
                if self._check is None:
                    raise ReplayCheckError(
                        f"replay check: MoE layer {self._moe_id(layer)} (decoder layer "
                        f"{module.layer_number - 1}) replays, but no routes were set for this "
                        f"forward (it would run an earlier micro-batch's)")
                self._natural[layer] = None  # set again by get_replay_topk if it runs
            probs, routing_map = original(logits, padding_mask=padding_mask)
            if checking:
                with torch.no_grad():  # the experts the dispatcher runs, as megatron-core left them
                    ran = routing_map.to(torch.float32).topk(module.topk, dim=-1).indices
                natural = self._natural[layer]
                self._check.ran(layer, ran, ran if natural is None else natural)
            if self.aux_loss_coef > 0 and self._tokens_N is not None and module.training:
                # without grad (the first pass of a recomputed layer) only the value is noted
                probs = self._attach_aux(layer, logits, routing_map, probs)
            return probs, routing_map
        return routing

    def _attach_aux(self, layer: int, logits, routing_map_NE, probs_NE):
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        E = self.num_experts
        logits_NE = logits.reshape(-1, E)
        tok_N = self._tokens_N
        counts_E = (routing_map_NE & tok_N[:, None]).sum(0).float()
        n = tok_N.sum().float().reshape(1)
        P_E = (torch.softmax(logits_NE.float(), -1) * tok_N[:, None]).sum(0)
        if self.tp > 1:  # SP: this rank routes its slice of the positions; sum over TP
            import torch.distributed as dist
            _, group = self._tp_rank_and_group()
            stats = torch.cat([counts_E, n])
            dist.all_reduce(stats, group=group)
            counts_E, n = stats[:E], stats[E:]
            P_E = reduce_from_tensor_model_parallel_region(P_E)
        n = n.clamp(min=1)
        k = self.router_modules[layer].topk
        aux = E * ((counts_E / (n * k)) * (P_E / n)).sum()
        self._aux[layer] = aux.detach()
        if not torch.is_grad_enabled():
            return probs_NE
        return MoEAuxLossAutoScaler.apply(probs_NE, aux * self._aux_weight)

    def _moe_id(self, layer: int) -> int:
        return layer if self.moe_ids is None else self.moe_ids[layer]

    def finish_forward(self) -> None:
        """After a replayed forward: the validator's checks (no-op when off or recording)."""
        check, self._check = self._check, None
        if check is not None:
            check.finish()

    def begin_micro_batch(self, token_mask_BT: Tensor | None, aux_weight: float = 0.0) -> None:
        """Before a training forward: its real tokens [B, T] and the weight of its load-
        balancing loss in the gradient (applied as aux * aux_weight per MoE layer)."""
        tp_rank, _ = self._tp_rank_and_group()
        self._tokens_N = None if token_mask_BT is None \
            else mask_to_router_order(token_mask_BT, self.tp, tp_rank).to(self.device)
        self._aux_weight = aux_weight
        self._aux = [None] * self.num_layers

    def aux_loss_sum(self) -> Tensor | None:
        """Sum over this model's MoE layers of the last forward's load-balancing losses."""
        vals = [x for x in self._aux if x is not None]
        return torch.stack(vals).sum() if vals else None

    def natural(self, B: int, T: int) -> Tensor:
        """The routers' own top-k in the last forward, int64 [B, T, L, K] on the routers'
        device (as `used` and `margins`)."""
        return self._gather(self._natural, B, T, "natural")

    def margins(self, B: int, T: int) -> Tensor:
        """fp32 [B, T, L]: the last forward's router margins (a session with `margins`)."""
        if self._margin_fn is None:
            raise RuntimeError("margins() needs a session opened with margins=...")
        return self._gather(self._margin, B, T, "margins", torch.float32)[..., 0]

    def used(self, B: int, T: int) -> Tensor:
        """The routes the last forward ran (given ids merged with natural ones), int64."""
        return self._gather(self._used, B, T, "used")

    def _gather(self, per_layer, B: int, T: int, what: str,
                dtype: torch.dtype = torch.int64) -> Tensor:
        missing = [l for l, x in enumerate(per_layer) if x is None]
        if self._mode is None or missing:
            raise RuntimeError(f"{what}() needs an open session after a forward (MoE layers "
                               f"{missing} saw none)")
        _, group = self._tp_rank_and_group()
        return from_router_order(per_layer, B, T, self.tp, group, dtype, device=None)

    def set_routes(self, ids_BTLK: Tensor, valid_BT: Tensor | None = None, *,
                   tokens_BT: Tensor | None = None, rows: Tensor | None = None,
                   what: str = LOGPROB_FORWARD) -> None:
        """Routes for the next forward (one micro-batch) in a REPLAY session: the given ids
        where `valid_BT`, the router's natural choice elsewhere (decided in the forward).
        With the validator on, also that forward's `RouteCheck` over the real tokens
        `tokens_BT` (default all) of batch rows `rows` (messages), a `what` forward; call
        `finish_forward()` after it.

        Also queues them for REPLAY_BACKWARD, so a recomputed forward in the backward pass
        replays the same experts; call `backward_replays(output)` on the forward's output.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._mode is not Mode.REPLAY:
            raise RuntimeError("set_routes needs an open Mode.REPLAY session")
        if ids_BTLK.dim() != 4 or ids_BTLK.shape[2] != self.num_layers:
            raise RouteError(f"routes have shape {tuple(ids_BTLK.shape)}; expected [B, T, "
                             f"L={self.num_layers}, K] (MoE layers of this model)")
        if valid_BT is None:
            valid_BT = torch.ones(ids_BTLK.shape[:2], dtype=torch.bool, device="cpu")
        valid_BT = valid_BT.cpu()  # checks and masks on the host, the ids to the device once
        full = build_replay_ids(ids_BTLK.cpu(), valid_BT, num_experts=self.num_experts)
        full = full.to(self.device)
        tp_rank, _ = self._tp_rank_and_group()
        self._keep_N = None if bool(valid_BT.all()) and full.shape[1] % self.tp == 0 \
            else mask_to_router_order(valid_BT, self.tp, tp_rank).to(self.device)
        per_layer = to_router_order(full, self.tp, tp_rank)
        for r, x in zip(self.routers, per_layer):
            r.set_target_indices(x)
            # a previous micro-batch's backward may have left REPLAY_BACKWARD on
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        if self.check is not ReplayCheck.OFF:
            self._check = self._route_check(per_layer, valid_BT, tokens_BT, rows, what, tp_rank)

    def _route_check(self, per_layer: list[Tensor], valid_BT: Tensor, tokens_BT, rows, what,
                     tp_rank: int) -> RouteCheck:
        """The validator's ledger of the next forward, in router order (n = s_local * B + b)."""
        B, T = valid_BT.shape
        checked_BT = valid_BT if tokens_BT is None else valid_BT & tokens_BT.cpu().bool()
        s_loc = -(-T // self.tp)
        names = [] if rows is None else rows.tolist()

        def where(n: int) -> tuple[int, int]:
            s, b = divmod(n, B)
            return (names[b] if names else b), tp_rank * s_loc + s
        self._checked_forwards += 1
        return RouteCheck(
            torch.stack(per_layer, 1), mask_to_router_order(checked_BT, self.tp, tp_rank),
            sample_slice(self.check, self._checked_forwards), self.decoder_layers, where,
            num_experts=self.num_experts, what=what, any_order=True,
            min_overlap=self.min_overlap if what == LOGPROB_FORWARD else 0.0,
            moe_ids=[self._moe_id(l) for l in range(self.num_layers)])

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
