"""Fixtures shared by the client and server tests: one tiny random-init model (layer 0 dense)
and a loopback `ServerThread` over it, both module-scoped. Import them into a test module:
`from server_fixtures import ENGINE, model, server  # noqa: F401`."""

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine, EngineConfig
from lockstep.rollout.server import ServerThread

from model_fixtures import tiny_config

ENGINE = EngineConfig(dtype="fp32", max_running=16, max_len=48)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoEModel(tiny_config(max_position_embeddings=64, mlp_only_layers=[0]))


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(Engine.from_model(model, ENGINE)) as srv:
        yield srv
