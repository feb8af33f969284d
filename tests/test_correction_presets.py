"""`correction.preset: NAME`: every preset equals verl 0.9.1's `RolloutCorrectionConfig.NAME()`
(all of its classmethods), expands in the config with the expanded fields saved, and a preset
plus a conflicting field is refused naming both."""

import dataclasses

import pytest

from lockstep.trainer.config.load import load_config, save_config
from lockstep.trainer.objective.correction import CorrectionConfig
from lockstep.trainer.objective.presets import PRESETS, VERL_FIELDS
from lockstep.trainer.config.types import ExperimentConfigError


def _verl_presets() -> dict[str, dict]:
    algorithm = pytest.importorskip("verl.trainer.config.algorithm")
    R = algorithm.RolloutCorrectionConfig
    assert tuple(f.name for f in dataclasses.fields(R) if not f.name.startswith("_")) == VERL_FIELDS
    return {name: {f: getattr(getattr(R, name)(), f) for f in VERL_FIELDS}
            for name, v in vars(R).items() if isinstance(v, classmethod)}


def test_every_verl_classmethod_is_a_preset_with_its_fields():
    theirs = _verl_presets()
    assert len(theirs) == 19 and sorted(PRESETS) == sorted(theirs)
    for name, fields in theirs.items():
        assert PRESETS[name] == fields, name
        for k, v in fields.items():  # the same types too (a "0.5_5.0" string stays a string)
            assert type(PRESETS[name][k]) is type(v), (name, k)
        assert dataclasses.asdict(CorrectionConfig(preset=name)) == {
            **dataclasses.asdict(CorrectionConfig(**fields)), "preset": None}, name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_in_a_config_saves_its_expansion(tmp_path, name):
    cfg = load_config(None, [f"correction.preset={name}", "correction.prob_diff_eps=0.3"])
    written_out = load_config(None, [f"correction.{k}={'null' if v is None else v}"
                                     for k, v in PRESETS[name].items()] + ["correction.prob_diff_eps=0.3"])
    assert cfg == written_out and cfg.hash() == written_out.hash()
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "preset" not in text and load_config(tmp_path / "config.yaml") == cfg


def test_preset_plus_conflicting_field_is_refused_naming_both():
    with pytest.raises(ExperimentConfigError, match=r"^correction.preset=decoupled_token_icepop sets "
                       r"rollout_is_threshold='0.5_5.0' but correction.rollout_is_threshold=2.0 "
                       r"was given too; drop one of them$"):
        load_config(None, ["correction.preset=decoupled_token_icepop",
                           "correction.rollout_is_threshold=2.0"])  # 2.0 is the default: still refused
    with pytest.raises(ExperimentConfigError, match="sets bypass_mode=True but correction.bypass_mode=False"):
        load_config(None, ["correction={preset: bypass_ppo_clip, bypass_mode: false}"])
    with pytest.raises(ValueError, match="sets rollout_is='token' but correction.rollout_is='sequence'"):
        CorrectionConfig(preset="decoupled_token_is", rollout_is="sequence")
    # a field equal to the preset's value agrees (2 and 2.0 are the same number)
    assert load_config(None, ["correction.preset=decoupled_token_is",
                              "correction.rollout_is_threshold=2"]).correction.rollout_is == "token"
    with pytest.raises(ExperimentConfigError, match="correction.preset='tis' is not one of verl's presets: "
                                                    "decoupled_token_is, "):
        load_config(None, ["correction.preset=tis"])
