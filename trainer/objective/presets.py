"""verl 0.9.1's named rollout-correction presets (`RolloutCorrectionConfig.<name>()`, every one
of its classmethods, with their default arguments) as the `CorrectionConfig` fields each sets.

`correction.preset: NAME` in an experiment YAML (or `CorrectionConfig.from_dict({"preset":
NAME, ...})`) expands to all seven of verl's fields; the run's config.yaml records the expanded
fields, not the name. A field given next to a preset must equal the preset's value (else an
error names both); fields verl does not have (`prob_diff_eps`, ...) combine freely.
tests/test_correction_presets.py checks every entry against verl's own classmethod.
"""

from __future__ import annotations

from typing import Any

VERL_FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
               "rollout_rs_threshold", "bypass_mode", "loss_type")

_GEO = ("seq_mean_k1", "0.999_1.001")  # verl's geometric-mean RS: E[log r] within +-0.1%
_K3 = ("seq_mean_k3", 0.01)            # verl's K3 RS: sequence-mean k3 <= 0.01
_ICEPOP = "0.5_5.0"                    # verl's token IcePop bounds [0.5, 5.0]


def _preset(rollout_is=None, is_threshold: float | str = 2.0, rs: tuple | None = None,
            bypass: bool = False, loss_type: str = "ppo_clip") -> dict[str, Any]:
    rs_name, rs_threshold = rs if rs is not None else (None, None)
    return {"rollout_is": rollout_is, "rollout_is_threshold": is_threshold,
            "rollout_is_batch_normalize": False, "rollout_rs": rs_name,
            "rollout_rs_threshold": rs_threshold, "bypass_mode": bypass, "loss_type": loss_type}


PRESETS: dict[str, dict[str, Any]] = {
    # decoupled (three policies: IS/RS on pi_old / mu_old, PPO ratio pi_theta / pi_old)
    "decoupled_token_is": _preset("token"),
    "decoupled_seq_is": _preset("sequence"),
    "decoupled_token_icepop": _preset("token", _ICEPOP),
    "decoupled_seq_is_rs": _preset("sequence", rs=("seq_sum_k1", "0.5_2.0")),
    "decoupled_geo_rs": _preset(rs=_GEO),
    "decoupled_geo_rs_seq_tis": _preset("sequence", rs=_GEO),
    "decoupled_geo_rs_token_tis": _preset("token", rs=_GEO),
    "decoupled_k3_rs": _preset(rs=_K3),
    "decoupled_k3_rs_seq_tis": _preset("sequence", rs=_K3),
    "decoupled_k3_rs_token_tis": _preset("token", rs=_K3),
    # bypass (two policies: pi_old := mu_old); ppo_clip: the ratio is the IS
    "bypass_ppo_clip": _preset(bypass=True),
    "bypass_ppo_clip_geo_rs": _preset(rs=_GEO, bypass=True),
    "bypass_ppo_clip_k3_rs": _preset(rs=_K3, bypass=True),
    # bypass with REINFORCE and explicit weights
    "bypass_pg_is": _preset("sequence", bypass=True, loss_type="reinforce"),
    "bypass_pg_token_icepop": _preset("token", _ICEPOP, bypass=True, loss_type="reinforce"),
    "bypass_pg_geo_rs": _preset(rs=_GEO, bypass=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_seq_tis": _preset("sequence", rs=_GEO, bypass=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_token_tis": _preset("token", rs=_GEO, bypass=True, loss_type="reinforce"),
    # metrics only
    "disabled": _preset(),
}


def expand_preset(given: dict[str, Any]) -> dict[str, Any]:
    """`given` correction fields with a `preset` key replaced by the preset's fields; a given
    field that differs from the preset's value is a ValueError naming both."""
    if "preset" not in given:
        return given
    out = dict(given)
    name = out.pop("preset")
    if name not in PRESETS:
        raise ValueError(f"correction.preset={name!r} is not one of verl's presets: {', '.join(PRESETS)}")
    for key, value in PRESETS[name].items():
        if key in out and not _same(out[key], value):
            raise ValueError(f"correction.preset={name} sets {key}={value!r} but correction.{key}="
                             f"{out[key]!r} was given too; drop one of them")
        out[key] = value
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal as config values: 2 and 2.0 are; a bool is not a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b and type(a) in (type(b), int, float) and type(b) in (type(a), int, float)
