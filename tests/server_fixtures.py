"""Fixtures shared by the client and server tests: one tiny random-init model (layer 0 dense)
and a loopback `ServerThread` over it, both module-scoped; `call`, a plain urllib client. Import them into a test module:
`from server_fixtures import ENGINE, model, server  # noqa: F401`."""

import json
import urllib.error
import urllib.request

import pytest
import torch

from lockstep.moe.model import MoEModel
from lockstep.rollout.engine import Engine
from lockstep.rollout.engine_config import EngineConfig
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


def call(url, path, body=None, raw=None, headers=None, method=None, timeout=60):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if text.strip().startswith(("{", "[")) else text)
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text or "null")
        except ValueError:
            return e.code, text
