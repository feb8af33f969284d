"""`lockstep compare`: overlays runs' metrics into plots and a summary table."""

import json

from lockstep.launch.cli import main


def write_run(d, rewards, k3):
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for i, (r, k) in enumerate(zip(rewards, k3), start=1):
            f.write(json.dumps({"step": i, "reward/mean": r, "rollout_corr/k3_kl": k,
                                "routing/flip_rate": 0.01, "routing/flip_rate/layer_0": 0.02,
                                "routing/flip_rate/layer_1": 0.0}) + "\n")


def test_compare_writes_overlay_plots_and_table(tmp_path, capsys):
    write_run(tmp_path / "off", [0.2, 0.3, 0.4, 0.5], [2e-3] * 4)
    write_run(tmp_path / "r3", [0.2, 0.4, 0.6, 0.8], [1e-3] * 4)
    assert main(["compare", str(tmp_path / "off"), str(tmp_path / "r3"),
                 "--out", str(tmp_path / "cmp"), "--window", "2"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[1:3]}
    assert float(lines["off"][0]) == 0.25 and float(lines["off"][1]) == 0.45
    assert float(lines["r3"][1]) == 0.7 and float(lines["r3"][2]) == 1e-3
    for png in ("reward.png", "k3_kl.png", "flip_rate_layers_off.png", "flip_rate_layers_r3.png"):
        assert (tmp_path / "cmp" / png).stat().st_size > 1000


def test_compare_names_a_directory_without_metrics(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), "--out", str(tmp_path / "cmp")]) == 2
    assert "no metrics.jsonl in" in capsys.readouterr().err


def test_compare_refuses_a_run_with_a_doubled_metrics_row(tmp_path, capsys):
    write_run(tmp_path / "r3", [0.2, 0.4, 0.6], [1e-3] * 3)
    with open(tmp_path / "r3" / "metrics.jsonl") as f:
        lines = f.readlines()
    (tmp_path / "r3" / "metrics.jsonl").write_text(lines[0] + lines[0] + "".join(lines[1:]))
    assert main(["compare", str(tmp_path / "r3"), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert "step 1 appears more than once" in err, err
    assert not (tmp_path / "cmp").exists()


def test_compare_never_writes_its_plots_into_a_run_directory(tmp_path, capsys):
    write_run(tmp_path / "off", [0.2, 0.3], [2e-3] * 2)
    write_run(tmp_path / "r3", [0.2, 0.4], [1e-3] * 2)
    (tmp_path / "r3" / "reward.png").write_bytes(b"the run's own plot")
    assert main(["compare", str(tmp_path / "off"), "--out", str(tmp_path / "r3")]) == 2
    assert "is a run directory" in capsys.readouterr().err
    assert (tmp_path / "r3" / "reward.png").read_bytes() == b"the run's own plot"
