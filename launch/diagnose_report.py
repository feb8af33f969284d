"""What `lockstep diagnose` writes: report.json, PNG plots, one self-contained HTML page
(images inlined as data URIs, no network) and the terminal summary."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

PLOTS = {  # file -> caption
    "flip_heatmap.png": "Flip rate by MoE layer and absolute position (prompt + response)",
    "flip_layers.png": "Flip rate and top-k overlap per MoE layer",
    "by_position.png": "Flip rate (any layer) and k3 KL by position",
    "margin_hist.png": "Router margin (k-th minus (k+1)-th expert probability) of flipped vs kept routes",
    "is_weights.png": "IS weights pi_old / mu_old of response tokens (log scale), TIS cap and IcePop bounds",
    "confusion.png": "Expert confusion: expert the engine used (row) vs the actor's router (column)",
    "expert_load.png": "Share of the routed (token, k) slots per expert and MoE layer: the engine's routes vs the actor's router",
}
def _headline(m: dict) -> list[tuple[str, str]]:
    """HEADLINE without the indexer rows of a model that has no indexer."""
    return [(k, label) for k, label in HEADLINE if not k.startswith("indexer/") or k in m]


HEADLINE = (
    ("routing/flip_rate", "flip rate, (token, layer) pairs"),
    ("routing/token_any_flip", "tokens with >= 1 flipped layer"),
    ("routing/topk_overlap", "top-k overlap"),
    ("indexer/flip_rate", "indexer flip rate, picked keys (DSA models)"),
    ("indexer/token_any_flip", "tokens with >= 1 indexer layer flipped"),
    ("rollout_corr/kl", "KL(mu_old || pi_old), k1"),
    ("rollout_corr/k3_kl", "k3 KL"),
    ("rollout_corr/chi2_token", "chi2, token"),
    ("rollout_corr/training_ppl", "training PPL"),
    ("rollout_corr/rollout_ppl", "rollout PPL"),
    ("diagnose/k3_kl_natural", "k3 KL, actor on its own routes"),
    ("diagnose/k3_kl_replayed", "k3 KL, actor replaying the engine's routes"),
    ("diagnose/routing_k3_kl", "k3 KL caused by routing (this run's mode)"),
    ("diagnose/routing_k3_share", "routing share of the k3 KL"),
    ("diagnose/flipped_token_fraction", "response tokens predicted by a flipped row"),
    ("diagnose/flipped_token_k3_share", "share of the k3 KL on those tokens"),
    ("diagnose/tis_clip_fraction", "tokens token-TIS would clip"),
    ("diagnose/icepop_mask_fraction", "tokens IcePop would mask"),
    ("rollout/moe/max_vio/max", "expert load max/mean - 1, engine, worst layer"),
    ("actor/moe/max_vio/max", "expert load max/mean - 1, actor, worst layer"),
    ("rollout/moe/dead_experts/max", "dead experts, engine, worst layer"),
)


def jsonable(v: Any) -> Any:
    """NaN / inf -> null (JSON has no NaN; null reads as "not measured")."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


# ---------------------------------------------------------------- plots
def write_plots(report: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        paths.append(out / name)

    heat = report["flip_heatmap"]
    rows = np.array([[np.nan if x is None else x for x in r] for r in heat["rows"]], dtype=float)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(heat["layers"]) + 1.8))
    im = ax.imshow(rows, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_yticks(range(len(heat["layers"])), [f"L{i}" for i in heat["layers"]])
    ax.set_xlabel("position")
    ax.set_title("flip rate (layer x position)")
    fig.colorbar(im, ax=ax)
    save(fig, "flip_heatmap.png")

    per = report["per_layer"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = np.arange(len(per))
    ax.bar(x - 0.2, [r["flip_rate"] for r in per], 0.4, label="flip rate")
    ax.bar(x + 0.2, [1 - r["topk_overlap"] for r in per], 0.4, label="1 - top-k overlap")
    ax.set_xticks(x, [f"L{r['layer']}" for r in per])
    ax.legend()
    ax.set_title("per MoE layer")
    save(fig, "flip_layers.png")

    pos = [p for p in report["by_position"] if p["routed_tokens"] or p["response_tokens"]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([p["position"] for p in pos], [np.nan if p["token_any_flip"] is None else
                                           p["token_any_flip"] for p in pos],
            "o-", label="tokens with >= 1 flip")
    ax.set_xlabel("position")
    ax.set_ylabel("fraction")
    ax2 = ax.twinx()
    ax2.plot([p["position"] for p in pos], [np.nan if p["k3_kl"] is None else p["k3_kl"]
                                            for p in pos], "s--", color="C3", label="k3 KL")
    ax2.set_ylabel("k3 KL (response tokens)")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    save(fig, "by_position.png")

    mh = report["margin"]["hist"]
    edges = np.array(mh["edges"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for key, color in (("kept", "C0"), ("flipped", "C3")):
        counts = np.array(mh[key], dtype=float)
        dens = counts / max(counts.sum(), 1)
        ax.stairs(dens, edges, label=f"{key} ({int(counts.sum())})", color=color, fill=key == "kept",
                  alpha=0.5 if key == "kept" else 1)
    ax.set_xlabel("router margin p_k - p_(k+1)")
    ax.set_ylabel("share of routes")
    ax.legend()
    save(fig, "margin_hist.png")

    wh = report["is_weights"]["log_hist"]
    m = report["metrics"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.stairs(np.array(wh["counts"], dtype=float) + 1e-9, np.array(wh["edges"]), fill=True)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)
    ax.axvline(math.log(m["diagnose/tis_threshold"]), color="C3", ls="--", label="TIS cap")
    for i, b in enumerate(m["diagnose/icepop_bounds"]):
        ax.axvline(math.log(b), color="C2", ls=":", label="IcePop bounds" if i == 0 else None)
    ax.set_xlabel("log(pi_old / mu_old)")
    ax.set_ylabel("tokens")
    ax.legend()
    save(fig, "is_weights.png")

    conf = {k: np.array(v, dtype=float) for k, v in report["confusion"].items()}
    total = sum(conf.values())
    worst = max(conf, key=lambda k: conf[k].sum() - np.trace(conf[k]))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, (title, mat) in zip(axes, (("all layers", total), (f"{worst} (most flips)",
                                                                conf[worst]))):
        im = ax.imshow(np.log10(mat + 1), cmap="viridis", interpolation="nearest")
        ax.set_title(f"{title}, log10(count + 1)")
        ax.set_xlabel("actor's expert")
        ax.set_ylabel("engine's expert")
        fig.colorbar(im, ax=ax, fraction=0.046)
    save(fig, "confusion.png")

    load = report["expert_load"]
    cols = min(3, len(load["layers"]))
    nrows = -(-len(load["layers"]) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.4 * nrows + 0.4),
                             squeeze=False)
    for ax, i, eng, act in zip(axes.flat, load["layers"], load["rollout"], load["actor"]):
        x = np.arange(len(eng))
        for off, (who, c) in ((-0.2, ("engine", eng)), (0.2, ("actor", act))):
            total = max(sum(c), 1)
            ax.bar(x + off, [v / total for v in c], 0.4, label=who)
        ax.axhline(1 / len(eng), color="k", lw=0.6, ls=":")  # an even load
        ax.set_title(f"layer {i}", fontsize=9)
        ax.set_xlabel("expert", fontsize=8)
    for ax in axes.flat[len(load["layers"]):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    save(fig, "expert_load.png")
    return paths


# ---------------------------------------------------------------- text
def summary_text(report: dict) -> str:
    h, m = report["header"], report["metrics"]
    lines = [f"lockstep diagnose: step {h['step']} (weights {h['weight_version']}), replay "
             f"{h['replay_mode']}, engine {h['engine']['dtype']} (router "
             f"{h['engine'].get('router_dtype') or 'same'}, LM head "
             f"{h['engine'].get('lm_head_dtype') or 'same'}), actor {h['actor']['dtype']}, "
             f"{m['diagnose/num_samples']} samples, {m['diagnose/num_response_tokens']} "
             f"response tokens, source {h['source']}"]
    lines += [f"  {label:48s} {_fmt(m.get(key))}" for key, label in _headline(m)]
    lines.append("  flip rate per layer: " + "  ".join(
        f"L{r['layer']} {r['flip_rate']:.4f}" for r in report["per_layer"]))
    mg = report["margin"]
    if mg["flipped"].get("count"):
        lines.append(f"  router margin median: flipped {mg['flipped']['p50']:.3g} vs kept "
                     f"{mg['kept']['p50']:.3g}")
    for t in report["top_tokens"][:3]:
        lines.append(f"  divergent: sample {t['sample']} pos {t['position']} k3 {t['k3']:.3g} "
                     f"flipped layers {t['flipped_layers']}: {t['context']}")
    inj = injection_settings(m)
    if inj:
        body = ", ".join(f"{k}: {v:.3g}" for k, v in inj.items())
        lines.append(f"  this mismatch, injected into lockstep's embedded engine (docs/training.md "
                     f"\"Injected mismatch\"): --set 'rollout.mismatch={{{body}}}'")
    return "\n".join(lines)


def injection_settings(m: dict) -> dict[str, float]:
    """`rollout.mismatch` settings that reproduce a report's mismatch: `router_flip_rate` =
    its `routing/flip_rate` (the target is calibrated with replay off, so a report made under
    R3, which measures each layer's own disagreement only, undershoots the compounded rate),
    `logprob_noise` = sqrt(2 x the k3 KL its flips do not carry), the std whose k3 is that on a
    flat distribution (a peaked one gets less: read the first steps' rollout_corr/k3_kl). Zero
    parts are left out; {} for a report with no mismatch."""
    out = {}
    flip = m.get("routing/flip_rate")
    if flip is not None and flip == flip and flip > 0:
        out["router_flip_rate"] = float(flip)
    k3 = m.get("rollout_corr/k3_kl")
    share = m.get("diagnose/routing_k3_share") or 0.0
    if k3 is not None and k3 == k3:
        rest = k3 * (1.0 - (share if share == share else 0.0))
        if rest > 1e-12:
            out["logprob_noise"] = (2.0 * rest) ** 0.5
    return out


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def write_html(report: dict, out: Path, plots: list[Path]) -> Path:
    """One page, images as data URIs; a script writes each image's natural size into
    `#image-sizes` once the page has loaded (the headless-browser test reads it)."""
    h, m = report["header"], report["metrics"]
    figs = "".join(
        f'<figure><img alt="{html.escape(p.name)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(PLOTS[p.name])}'
        f"</figcaption></figure>" for p in plots)
    head = _table(["metric", "name", "value"], [[label, key, m.get(key)] for key, label in _headline(m)])
    layers = _table(["layer", "flip rate", "top-k overlap", "flips", "margin median (flipped)",
                     "margin median (kept)"],
                    [[r["layer"], r["flip_rate"], r["topk_overlap"], r["flips"],
                      r["margin_flipped_median"], r["margin_kept_median"]]
                     for r in report["per_layer"]])
    toks = _table(["sample", "pos", "token", "log mu_old", "log pi_old", "k3", "flipped layers",
                   "context ([token])"],
                  [[t["sample"], t["position"], t["token"], t["rollout_logprob"],
                    t["old_logprob"], t["k3"], ",".join(map(str, t["flipped_layers"])) or "-",
                    t["context"]] for t in report["top_tokens"]])
    w = report["is_weights"]["stats"]
    wtab = _table(list(k for k in w), [list(w.values())])
    settings = _table(["", "dtype", "router", "LM head"],
                      [["engine", h["engine"]["dtype"], h["engine"].get("router_dtype"),
                        h["engine"].get("lm_head_dtype")],
                       ["actor", h["actor"]["dtype"], h["actor"].get("router_dtype"),
                        h["actor"].get("lm_head_dtype")]])
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>lockstep diagnose: step {h['step']}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:1em 0;font-size:13px}}td,th{{border:1px solid #ccc;
padding:3px 8px;text-align:left}}figure{{display:inline-block;margin:8px}}
img{{max-width:520px}}pre{{font-size:12px}}</style></head><body>
<h1>lockstep diagnose: step {h['step']}, replay {html.escape(h['replay_mode'])}</h1>
<p>weights {html.escape(str(h['weight_version']))}, source {html.escape(h['source'])},
{m['diagnose/num_samples']} samples, {m['diagnose/num_response_tokens']} response tokens.</p>
{settings}<h2>Headline</h2>{head}<h2>Plots</h2>{figs}<h2>Per layer</h2>{layers}
<h2>IS weights pi_old / mu_old</h2>{wtab}<h2>Most divergent tokens</h2>{toks}
<h2>Image sizes</h2><pre id="image-sizes">not loaded</pre>
<script>window.addEventListener("load", function () {{
  var s = Array.prototype.map.call(document.images, function (i) {{
    return {{alt: i.alt, w: i.naturalWidth, h: i.naturalHeight, complete: i.complete}}; }});
  document.getElementById("image-sizes").textContent = JSON.stringify(s);
}});</script></body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return path


def write_report(report: dict, out: str | Path) -> dict[str, Path]:
    """report.json, the PNGs and report.html into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report.setdefault("injection", injection_settings(report["metrics"]))  # rollout.mismatch
    (out / "report.json").write_text(json.dumps(jsonable(report), indent=1) + "\n")
    plots = write_plots(report, out)
    return {"json": out / "report.json", "html": write_html(report, out, plots),
            **{p.stem: p for p in plots}}
