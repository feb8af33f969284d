"""The CPU bridge for megatron-core: refuses on CUDA, idempotent, reversible, and the configs
that would bypass routing replay are refused."""

import pytest
import torch

pytest.importorskip("megatron.core")

from lockstep.moe.checks import ConfigError  # noqa: E402
from lockstep.moe.config import ModelConfig  # noqa: E402
from lockstep.trainer.actor.megatron import cpu_bridge  # noqa: E402
from lockstep.trainer.actor.megatron.model import (check_replay_compatible, ReplayBypassError,
                                                   transformer_config)
from lockstep.trainer.config.megatron import MegatronOptions

pytestmark = pytest.mark.megatron


@pytest.fixture
def restore_bridge():
    was = cpu_bridge.is_installed()
    yield
    cpu_bridge.uninstall()
    if was:
        cpu_bridge.install()


def test_install_refuses_when_cuda_is_available(restore_bridge, monkeypatch):
    cpu_bridge.uninstall()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cpu_bridge.CudaPresentError, match="CUDA is available"):
        cpu_bridge.install()
    assert not cpu_bridge.is_installed()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bridge is CPU-only")
def test_install_is_idempotent_and_uninstall_restores(restore_bridge):
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cpu_bridge.uninstall()
    orig_get = mc_random._get_cuda_rng_state
    orig_sync = token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()  # CPU-only torch: what the bridge answers for
    cpu_bridge.install()
    cpu_bridge.install()
    assert torch.cuda.current_device() == torch.device("cpu")
    assert moe_utils.te_general_gemm is None
    assert mc_random._get_cuda_rng_state is not orig_get
    cpu_bridge.uninstall()
    assert mc_random._get_cuda_rng_state is orig_get
    assert token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize is orig_sync
    assert not hasattr(moe_utils, "te_general_gemm")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bridge is CPU-only")
def test_rng_tracker_forks_reproducible_cpu_streams(restore_bridge):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    cpu_bridge.install()
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 7)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        x = torch.rand(3)
    with tracker.fork("a"):
        y = torch.rand(3)  # the stream continues, like a CUDA generator would
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    assert torch.equal(x, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert not torch.equal(x, y)
    with pytest.raises(Exception, match="seed 7 already exists"):
        tracker.add("b", 7)


def test_options_that_bypass_replay_are_refused():
    cfg = ModelConfig(vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2)
    tc = transformer_config(cfg, MegatronOptions())
    check_replay_compatible(tc)
    for field, value, msg in [("moe_router_fusion", True, "fused TE top-k"),
                              ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
                              ("moe_expert_capacity_factor", 1.0, "token dropping"),
                              ("moe_enable_routing_replay", False, "cannot be replayed")]:
        bad = transformer_config(cfg, MegatronOptions())
        setattr(bad, field, value)
        with pytest.raises(ReplayBypassError, match=msg):
            check_replay_compatible(bad)


def test_options_are_validated():
    with pytest.raises(ConfigError, match=r"megatron options: unknown keys \['tp'\]; valid keys are"):
        MegatronOptions.from_dict({"tp": 2})
    with pytest.raises(ConfigError, match="tensor_parallel must be a positive integer"):
        MegatronOptions(tensor_parallel=0)
    with pytest.raises(ConfigError, match="expert_tensor_parallel=1 with expert_parallel=1 "
                                          "must equal tensor_parallel=2"):
        MegatronOptions(tensor_parallel=2, expert_tensor_parallel=1)
    assert MegatronOptions(tensor_parallel=2).etp == 2
    assert MegatronOptions(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1).etp == 1
    cfg = ModelConfig(vocab_size=15, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match=r"actor\.megatron\.tensor_parallel=2 does not divide vocab_size=15"):
        transformer_config(cfg, MegatronOptions(tensor_parallel=2))
    with pytest.raises(ConfigError, match=r"actor\.megatron\.expert_parallel=3 does not divide the model's num_experts=4"):
        transformer_config(cfg, MegatronOptions(expert_parallel=3))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="use_transformer_engine=True needs a CUDA GPU"):
            transformer_config(cfg, MegatronOptions(use_transformer_engine=True))
