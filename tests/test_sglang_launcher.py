"""SGLang launcher: the exact argv, config validation, and failure when SGLang is absent.

No fake SGLang here: on CPU machines only the command is checked (and that a missing SGLang
is reported as an error, not a hang).
"""

import importlib.util
import sys

import pytest

from lockstep.rollout.sglang import SGLangConfig, SGLangError, SGLangServer


def test_command_has_required_flags_in_order():
    cfg = SGLangConfig(model_path="/ckpt/step_10", port=31000, tp_size=4, ep_size=2)
    assert cfg.command() == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/ckpt/step_10",
        "--host", "127.0.0.1", "--port", "31000", "--tp-size", "4", "--ep-size", "2",
        "--dtype", "bfloat16", "--skip-tokenizer-init", "--enable-return-routed-experts"]
    assert cfg.url == "http://127.0.0.1:31000"
    # Log-probs after temperature (the engine's and trainer's definition), whatever the shell says.
    assert cfg.env()["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"


def test_command_optional_flags_and_extra_args():
    cfg = SGLangConfig.from_dict(dict(
        model_path="m", host="0.0.0.0", dtype="float16", mem_fraction_static=0.7,
        context_length=4096, sampling_mask_max_tokens=512, random_seed=3, api_key="k",
        weight_version="v7", enable_fp32_lm_head=True, enable_deterministic_inference=True,
        extra_args=["--attention-backend", "triton"], python="/opt/py"))
    argv = cfg.command("/tmp/key.yaml")
    assert argv[:3] == ["/opt/py", "-m", "sglang.launch_server"]
    pairs = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")
             and not argv[i + 1].startswith("--")}
    assert pairs["--dtype"] == "float16" and pairs["--mem-fraction-static"] == "0.7"
    assert pairs["--context-length"] == "4096" and pairs["--sampling-mask-max-tokens"] == "512"
    assert pairs["--random-seed"] == "3"
    assert "--api-key" not in argv and "k" not in argv  # never on the command line (`ps`)
    assert pairs["--config"] == "/tmp/key.yaml" and "--device" not in argv
    assert pairs["--weight-version"] == "v7" and pairs["--host"] == "0.0.0.0"
    assert "--enable-fp32-lm-head" in argv and "--enable-deterministic-inference" in argv
    assert argv[-2:] == ["--attention-backend", "triton"]
    assert cfg.url == "http://127.0.0.1:30000"  # a wildcard bind is reached on loopback


def test_cpu_device_flags_and_env():
    cfg = SGLangConfig(model_path="m", device="cpu", extra_env={"PYTHONPATH": "/shims", "A": "1"})
    argv = cfg.command()
    i = argv.index("--device")
    assert argv[i:i + 5] == ["--device", "cpu", "--attention-backend", "torch_native",
                             "--disable-cuda-graph"]
    assert argv[argv.index("--max-total-tokens") + 1] == "8192"  # not a share of free RAM
    env = cfg.env()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"] == "/shims"
    assert env["A"] == "1" and env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
    gpu = SGLangConfig(model_path="m", max_total_tokens=100)
    assert "--device" not in gpu.command() and "SGLANG_USE_CPU_ENGINE" not in gpu.env()
    assert gpu.command()[gpu.command().index("--max-total-tokens") + 1] == "100"
    assert "--max-total-tokens" not in SGLangConfig(model_path="m").command()


@pytest.mark.parametrize("kw,msg", [
    (dict(dtype="bf16"), "dtype must be one of"),
    (dict(tp_size=4, ep_size=3), "ep_size=3 must divide tp_size=4"),
    (dict(port=0), "port"),
    (dict(mem_fraction_static=1.5), "mem_fraction_static"),
    (dict(extra_args="--foo"), "extra_args"),
    (dict(device="tpu"), "device must be cuda or cpu"),
    (dict(extra_env={"A": 1}), "extra_env must map names to strings"),
])
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SGLangConfig(model_path="m", **kw)
    with pytest.raises(ValueError, match=r"unknown keys \['tp'\]; valid keys are"):
        SGLangConfig.from_dict({"model_path": "m", "tp": 2})


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_start_without_sglang_fails_fast(tmp_path):
    log = tmp_path / "sglang.log"
    srv = SGLangServer(SGLangConfig(model_path=str(tmp_path), port=39517), log_path=str(log))
    with pytest.raises(SGLangError, match="exited with code 1 before it was healthy") as e:
        srv.start(timeout_s=60)
    assert "No module named 'sglang'" in log.read_text()
    assert "No module named 'sglang'" in str(e.value)  # the log tail is in the error
