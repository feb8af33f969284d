"""Comparing two runs' metrics at fp32 rounding, for tests whose runs sum in other orders."""


def metric_close(key: str, a: float, b: float, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """|a - b| <= rel |a| + abs_, except for the metrics whose rounding is relative to E[w^2]
    (~1) rather than to their value (~0): chi2 = E[w^2] - 1, and a token-level `*_std` of
    rollout_corr (verl's sqrt(E[w^2] - E[w]^2)), which reads sqrt(one ulp) = 3.5e-4 or 0 for
    weights all within 1e-6 of 1. Those are compared at 1e-5 on E[w^2] - 1 and on the
    variance."""
    if "chi2" in key:
        return abs(a - b) <= 1e-5
    if key.startswith("rollout_corr/") and key.endswith("_std") and "_seq_" not in key:
        return abs(a * a - b * b) <= 1e-5
    return abs(a - b) <= rel * abs(a) + abs_
