"""Parity of our families with transformers in fp32: the numbers of docs/model.md's parity
table, measured by the tests that assert them (tests/test_families.py).

    python tests/families_parity.py            # print the table
    python tests/families_parity.py --write    # and rewrite it in docs/model.md

Each row: a random tiny folder written by transformers (tests/arch_fixtures.py), loaded by
ours; a forward over 3 x 13 random tokens; max |logit diff|, per MoE layer the fraction of
tokens whose top-k expert set is identical, max |gate weight diff| (same experts, sorted by id),
and (DSA families) per indexer layer the fraction of tokens whose picked key set is identical.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from arch_fixtures import hf_forward_with_routes, write_hf_folder  # noqa: E402

DOC = Path(__file__).parents[1] / "docs" / "model.md"
BEGIN, END = "<!-- parity-table:begin -->", "<!-- parity-table:end -->"
NEW_FAMILIES = ("gpt_oss", "qwen3_next", "qwen3_5_moe_text", "deepseek_v32", "glm_moe_dsa")


def parity(ours, hf, ids_BT) -> dict:
    """Our model against transformers' on the same weights and tokens (fp32)."""
    logits, hf_ids, hf_gates, hf_picks = hf_forward_with_routes(hf, ids_BT, with_gates=True)
    with torch.no_grad():
        out = ours(ids_BT)
    ids, order = out.natural_BTLK.sort(-1)
    gates = out.gates_BTLK.gather(-1, order)
    same_BTL = (ids == hf_ids).all(-1)
    r = dict(logit_diff=float((out.logits_BTV - logits).abs().max()),
             topk_agree=[float(a) for a in same_BTL.float().mean((0, 1))],
             gate_diff=float((gates - hf_gates).abs().max()) if same_BTL.all() else None,
             experts_used=int(out.natural_BTLK.unique().numel()), indexer_agree=None)
    if hf_picks is not None:
        from lockstep.moe.dsa import picks_to_mask

        B, T = ids_BT.shape
        ours_BTLT = torch.stack([picks_to_mask(out.indexer_natural_BTLK[:, :, l], T)
                                 for l in range(out.indexer_natural_BTLK.shape[2])], 2)
        r["indexer_agree"] = [float(a) for a in (ours_BTLT == hf_picks).all(-1).float()
                              .mean((0, 1))]
    return r


def family_parity(family: str, folder: Path) -> dict:
    import transformers

    from lockstep.moe.checkpoint import load_hf

    write_hf_folder(family, folder)
    ours = load_hf(folder).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(1))
    return parity(ours, hf, ids)


def table(rows: dict[str, dict]) -> str:
    lines = ["| family | max \\|logit diff\\| | top-k agreement per MoE layer "
             "| max \\|gate diff\\| | indexer agreement per indexer layer |",
             "| --- | --- | --- | --- | --- |"]

    def pct(values):
        return " / ".join(f"{100 * a:.0f}%" for a in values)

    for family, r in rows.items():
        gate = "-" if r["gate_diff"] is None else f"{r['gate_diff']:.1e}"
        index = "-" if r["indexer_agree"] is None else pct(r["indexer_agree"])
        lines.append(f"| `{family}` | {r['logit_diff']:.1e} | {pct(r['topk_agree'])} | {gate} "
                     f"| {index} |")
    return "\n".join(lines)


def write_table(text: str, doc: Path = DOC) -> None:
    s = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(s):
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block")
    doc.write_text(pattern.sub(f"{BEGIN}\n{text}\n{END}", s))


def documented_families(doc: Path = DOC) -> dict[str, str]:
    """family -> its row in the parity table of `doc`."""
    s = doc.read_text()
    block = s[s.index(BEGIN):s.index(END)] if BEGIN in s else ""
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", block, re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/model.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {f: family_parity(f, Path(tmp) / f) for f in NEW_FAMILIES}
    text = table(rows)
    print(text)
    if args.write:
        write_table(text)


if __name__ == "__main__":
    main()
