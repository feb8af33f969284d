"""Disk-free weight sync over NCCL (GPU only; not run on the CPU machines): the trainer on
cuda:0 broadcasts to a `lockstep serve` process that receives on the second GPU (NCCL refuses
two ranks of one communicator on one device, so this needs two GPUs)."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_push_equals_disk_push(tmp_path):
    from test_weight_sync import _buckets, _greedy, _model, _serve, _stop  # noqa: PLC0415

    from lockstep.moe.checkpoint import save_hf
    from lockstep.rollout.weight_sync import DistributedWeightSync
    from server_fixtures import call

    folder = save_hf(_model(0), tmp_path / "m0")
    env = dict(os.environ)
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the server process sees the second GPU only
    try:
        proc, url = _serve(folder)
        disk_proc, disk_url = _serve(folder)
    finally:
        os.environ.clear()
        os.environ.update(env)
    try:
        new = _model(1)
        buckets = [[(k, t.cuda()) for k, t in b] for b in _buckets(new)]
        with DistributedWeightSync([url], backend="nccl", timeout_s=120) as sync:
            sync.push(buckets, "7")
        m1 = save_hf(new, tmp_path / "m1")
        assert call(disk_url, "/update_weights_from_disk",
                    {"model_path": str(m1), "weight_version": "7"})[0] == 200
        assert _greedy(url) == _greedy(disk_url)
    finally:
        _stop(proc)
        _stop(disk_proc)
