"""The docs a newcomer configures from name the config's real keys: docs/training.md's table
lists every field of every section, and every `--set key=value` in README.md and docs/*.md is a
key the config knows."""

import re
import typing
from pathlib import Path

from lockstep.trainer.config.experiment import ExperimentConfig
from lockstep.trainer.config.load import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _fields(annotation) -> dict:
    if hasattr(annotation, "model_fields"):
        return annotation.model_fields
    return next((a.model_fields for a in typing.get_args(annotation)
                 if hasattr(a, "model_fields")), {})


def test_the_section_table_lists_every_field():
    text = (ROOT / "docs" / "training.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}
    missing = {}
    for name, field in ExperimentConfig.model_fields.items():
        if name == "model":  # HF's fields, documented in docs/model.md
            continue
        assert name in rows, f"docs/training.md has no row for section {name!r}"
        absent = [k for k in _fields(field.annotation) if f"`{k}" not in rows[name]]
        if absent:
            missing[name] = absent
    assert not missing, f"docs/training.md's section table does not name {missing}"


def test_every_set_in_the_docs_is_a_known_key():
    sets = sorted({m.group(1) for doc in DOCS for m in
                   re.finditer(r"--set '?([a-z_]+\.[a-z_.]+=[^\s`']*)", doc.read_text())})
    assert len(sets) > 20
    unknown = []
    for kv in sets:
        if kv.startswith("section.key="):  # the README's placeholder
            continue
        try:
            load_config(ROOT / "configs" / "toy_r3.yaml", [kv])
        except Exception as e:  # a value wrong for the toy is fine here; a wrong key is not
            if "not a valid key" in str(e):
                unknown.append(f"{kv}: {e}")
    assert not unknown, "\n".join(unknown)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_every_link_in_the_docs_resolves():
    """A relative link names a file that exists, and its #anchor a heading of that file (the
    README's links are the newcomer's way in; a renamed heading broke two of them once)."""
    broken = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
