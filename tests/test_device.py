"""Device placement of the hot loops without a GPU (cluster.device / EngineConfig.device).

The check: run the embedded engine (and the torch actor) with `torch.set_default_device("meta")`
while their own device is "cpu". A tensor the code creates without naming a device
(`torch.tensor(..)`, `torch.zeros(..)` with no `device=`) then becomes a meta tensor; a
TorchDispatchMode records every op that touches one (or fails where the op cannot mix it with
real tensors). On a GPU that tensor would have been a CPU tensor in a CUDA loop: a host copy per
step, or a device-mismatch error. Deliberate host tensors (results going back, the CPU
generators' uniforms) name their device explicitly and are not flagged. The same mode counts
the host syncs (`aten._local_scalar_dense`: `int()`, `bool()`, `.item()` of a tensor) per
decode step, so a new wait on the device in the step fails the bound below.
"""

import copy
import sys
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
from lockstep.rollout.types import GenerateRequest, SamplingParams
from lockstep.trainer.actor.torch_actor import TorchActor
from lockstep.trainer.config.sections import ActorConfig

from model_fixtures import tiny_config

SYNC = torch.ops.aten._local_scalar_dense.default


class DeviceAudit(TorchDispatchMode):
    """Records ops that see a meta tensor (made without a device) and counts host syncs."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict = strict
        self.strays: Counter = Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SYNC:
            self.syncs += 1
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta"
               for t in tree_leaves((args, kwargs, out))):
            self.strays[str(func)] += 1
            if self.strict:  # the traceback shows where the device-less tensor is used
                raise AssertionError(f"{func} on a tensor made without a device")
        return out


class audited:
    """`with audited() as audit:` default device meta + DeviceAudit."""

    def __enter__(self) -> DeviceAudit:
        self.audit = DeviceAudit()
        torch.set_default_device("meta")
        self.audit.__enter__()
        return self.audit

    def __exit__(self, *exc):
        self.audit.__exit__(*exc)
        torch.set_default_device(None)


# pass-through frames: torch itself, and the CPU bridge's stand-ins for megatron-core's
# `device="cuda"` factories (the device is chosen by megatron-core, their caller)
PASS_THROUGH = ("torch", "lockstep.trainer.actor.megatron.cpu_bridge")


def _caller_module(depth: int = 2) -> str:
    """`__name__` of the first calling frame outside `PASS_THROUGH`."""
    f = sys._getframe(depth)
    while f is not None and f.f_globals.get("__name__", "").startswith(PASS_THROUGH):
        f = f.f_back
    return "" if f is None else f.f_globals.get("__name__", "")


class LockstepMeta(TorchFunctionMode):
    """`torch.set_default_device("meta")` for lockstep's own code only: a tensor factory
    (`torch.zeros`, `torch.tensor`, ...) called from a `lockstep.*` module without `device=`
    makes a meta tensor. megatron-core's internals keep torch's default (its CPU fallbacks of
    fused GPU kernels, e.g. the local grad-norm, make host tensors that are not ours to fix)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None \
                and _caller_module().startswith("lockstep."):
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


class lockstep_audited:
    """`with lockstep_audited() as audit:` LockstepMeta + DeviceAudit."""

    def __enter__(self) -> DeviceAudit:
        self.audit, self.meta = DeviceAudit(), LockstepMeta()
        self.meta.__enter__()
        self.audit.__enter__()
        return self.audit

    def __exit__(self, *exc):
        self.audit.__exit__(*exc)
        self.meta.__exit__(*exc)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single")


class collective_devices:
    """`with collective_devices() as seen:` records (collective, devices of its tensors,
    calling module) for every tensor collective of `torch.distributed` while inside."""

    def __enter__(self) -> list:
        import torch.distributed as dist
        self.seen, self.saved = [], {n: getattr(dist, n) for n in COLLECTIVES}

        def wrap(name, fn):
            def call(*args, **kwargs):
                devs = {str(t.device) for t in tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)}
                self.seen.append((name, devs, _caller_module()))
                return fn(*args, **kwargs)
            return call
        for n, fn in self.saved.items():
            setattr(dist, n, wrap(n, fn))
        return self.seen

    def __exit__(self, *exc):
        import torch.distributed as dist
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0], eos_token_id=5))


def _requests():
    """Every per-step path: n > 1 (prefix copy), min_new_tokens (banned stop ids), top-p /
    top-k truncation, a greedy row, sampling masks, top log-probs, prompt log-probs."""
    return [
        GenerateRequest([3, 9, 14, 7], SamplingParams(max_new_tokens=10, n=3, seed=1,
                                                      temperature=0.9, top_p=0.8,
                                                      min_new_tokens=4)),
        GenerateRequest([11, 4], SamplingParams(max_new_tokens=7, seed=2, top_k=5),
                        return_sampling_mask=True, top_logprobs_num=2,
                        return_input_logprobs=True),
        GenerateRequest([8, 8, 30, 2, 17, 6], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                             seed=3)),
    ]


@pytest.mark.parametrize("device", ["cpu"])  # "cuda": tests/gpu/check_engine_cuda.py
def test_engine_makes_no_tensor_off_its_device_and_one_sync_per_step(model, device):
    want = Engine.from_model(model, EngineConfig(dtype="bf16", max_running=6, max_len=32,
                                                 device=device)).generate(_requests())
    src = copy.deepcopy(model)
    with audited() as audit:
        eng = Engine(src, EngineConfig(dtype="bf16", max_running=6, max_len=32, device=device))
        built = sum(audit.strays.values())
        got = eng.generate(_requests())
        assert not eng.running
        # decode-only steps (nothing admitted, nothing finishing mid-way is fine): syncs per step
        eng.add_request(GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=9, seed=4,
                                                                  ignore_eos=True)))
        eng.step()  # prefill + first decode
        before, steps = audit.syncs, 5
        for _ in range(steps):
            eng.step()
        per_step = (audit.syncs - before) / steps
    assert built == 0 and not audit.strays, dict(audit.strays)
    assert [(r.output_ids, r.routes_NLK.tolist(), r.output_logprobs.tolist()) for r in got] == \
        [(r.output_ids, r.routes_NLK.tolist(), r.output_logprobs.tolist()) for r in want]
    for r in got:  # results are host tensors, moved once per finished sample
        assert r.output_logprobs.device.type == "cpu" and r.routes_NLK.device.type == "cpu"
    # decode_step: max position, first slot, consecutive slots; the uniform refill check;
    # "did a row finish" (rollout/engine.py); nothing per row or per layer
    assert per_step <= 5, per_step


def test_torch_actor_makes_no_tensor_off_its_device():
    """The rank interface's hot loop (old_logprobs, policy_update with the KL reference,
    aux loss and expert-bias update) creates every tensor on the actor's device or, for the
    host-side results and batch bookkeeping, names the CPU."""
    from lockstep.replay import ReplayMode
    from lockstep.trainer.actor.rank import UpdateInputs
    from lockstep.trainer.actor.reference import ReferencePolicy
    from lockstep.trainer.objective.correction import CorrectionConfig
    from lockstep.trainer.objective.losses import LossConfig
    from test_router_families import _actor_batch, make
    model = make("deepseek_mla")  # MLA, sigmoid router with the expert bias it updates
    batch = _actor_batch(model)
    cfg = ActorConfig(dtype="bf16", mini_batch_size=2, micro_batch_size=1, aux_loss_coef=0.01,
                      expert_bias_update_rate=0.01)
    reference = ReferencePolicy(copy.deepcopy(model), cfg, temperature=1.0)
    actor = TorchActor(model, cfg, 2)
    actor.set_reference(reference)
    mask_BT = batch.response_mask_BT.float()
    with audited() as audit:
        old = actor.old_logprobs(batch, ReplayMode.R2, 1)
        inputs = UpdateInputs(old.logprobs_BT, torch.linspace(-1, 1, 4, device="cpu")[:, None]
                              * mask_BT, mask_BT, None, 7, LossConfig(kl_coef=0.1),
                              CorrectionConfig())
        upd = actor.policy_update(batch, inputs, ReplayMode.R2, 1)
    assert not audit.strays, dict(audit.strays)
    assert upd.stats["actor/kl_loss"][1] > 0 and upd.logprobs_BT.device.type == "cpu"


def test_pi_gen_makes_no_tensor_off_its_device():
    """loop.max_staleness >= 1 on the rank (`RankActor.gen_logprobs`, trainer/actor/versions.py):
    keeping a version (CPU copies of the bf16 compute model and the router's expert bias),
    swapping it in for pi_gen and back, names every device; pi_gen of the stale rows is the
    forward under version 0, the current rows' is pi_old."""
    from lockstep.replay import ReplayMode
    from lockstep.trainer.actor.rank import UpdateInputs
    from lockstep.trainer.actor.versions import VersionSplit
    from lockstep.trainer.objective.correction import CorrectionConfig
    from lockstep.trainer.objective.losses import LossConfig
    from test_router_families import _actor_batch, make
    model = make("deepseek_mla")  # a sigmoid router with an expert bias (a buffer): the
    # update moves it enough (rate 1) to change natural routes, so a kept copy without it fails
    batch = _actor_batch(model)
    actor = TorchActor(model, ActorConfig(dtype="bf16", mini_batch_size=4, micro_batch_size=2,
                                          lr=1e-2, expert_bias_update_rate=1.0), 2)
    split, mode = VersionSplit(1), ReplayMode.R2
    mask_BT = batch.response_mask_BT.float()
    want = actor.logprobs(batch).logprobs_BT  # version 0, natural routing (R2's pi_old plan)
    with audited() as audit:
        old = actor.old_logprobs(batch, mode, 1)
        assert split.gen_logprobs(actor, batch, ["0"] * 4, old.logprobs_BT, mode, 1) \
            is old.logprobs_BT
        inputs = UpdateInputs(old.logprobs_BT, torch.linspace(-1, 1, 4, device="cpu")[:, None]
                              * mask_BT, mask_BT, None, 7, LossConfig(), CorrectionConfig())
        actor.policy_update(batch, inputs, mode, 1)
        old = actor.old_logprobs(batch, mode, 2)
        gen = split.gen_logprobs(actor, batch, ["0", "1", "0", "1"], old.logprobs_BT, mode, 2)
    assert not audit.strays, dict(audit.strays)
    assert torch.equal(gen[1::2], old.logprobs_BT[1::2])
    assert torch.allclose(gen[0::2], want[0::2], atol=1e-6, rtol=0)
    assert float((gen[0::2] - old.logprobs_BT[0::2]).abs().max()) > 1e-3


@pytest.mark.megatron
def test_megatron_actor_makes_no_tensor_off_its_device():
    """The in-process MegatronActor (gloo world of one) through the rank interface: old
    log-probs (R2), the dump's actor fields, pi_gen of a stale version, the update with the
    load-balancing loss, the weight export. Every tensor lockstep's code makes names its
    device (`LockstepMeta`), every tensor collective it runs gets device tensors, and what
    goes back to the driver is on the host."""
    pytest.importorskip("megatron.core")
    from lockstep.replay import ReplayMode
    from lockstep.trainer.actor.megatron.actor import MegatronActor
    from lockstep.trainer.actor.rank import UpdateInputs
    from lockstep.trainer.actor.versions import VersionSplit
    from lockstep.trainer.objective.correction import CorrectionConfig
    from lockstep.trainer.objective.losses import LossConfig
    from test_router_families import _actor_batch, make
    model = make("qwen3_softmax_topk")
    batch = _actor_batch(model)
    actor = MegatronActor(model, ActorConfig(mini_batch_size=4, micro_batch_size=2, lr=1e-2,
                                             aux_loss_coef=0.01), 2)
    split, mode = VersionSplit(1), ReplayMode.R2
    mask_BT = batch.response_mask_BT.float()
    with lockstep_audited() as audit, collective_devices() as seen:
        old = actor.old_logprobs(batch, mode, 1)
        split.gen_logprobs(actor, batch, ["0"] * 4, old.logprobs_BT, mode, 1)
        dump = actor.dump_fields(batch, mode, 1)
        inputs = UpdateInputs(old.logprobs_BT, torch.linspace(-1, 1, 4, device="cpu")[:, None]
                              * mask_BT, mask_BT, None, 7, LossConfig(), CorrectionConfig())
        upd = actor.policy_update(batch, inputs, mode, 1)
        old = actor.old_logprobs(batch, mode, 2)
        gen = split.gen_logprobs(actor, batch, ["0", "1", "0", "1"], old.logprobs_BT, mode, 2)
        weights = [t for bucket in actor.export_weights(1 << 16) for _, t in bucket]
    assert not audit.strays, dict(audit.strays)
    ours = [(n, d) for n, d, caller in seen if caller.startswith("lockstep.")]
    assert all(d == {str(actor.device)} for _, d in ours), ours
    for t in (old.logprobs_BT, gen, upd.logprobs_BT, *dump.values(), *weights):
        assert t.device.type == "cpu"
    assert upd.stats["actor/aux_loss"][0] > 0
    assert float((gen[0::2] - old.logprobs_BT[0::2]).abs().max()) > 1e-4  # version 0 ran
