"""A small character-level tokenizer in the `tokenizers` JSON format.

Our synthetic tasks use a handful of characters; writing them as a real `tokenizer.json`
(WordLevel over single characters) lets SGLang, vLLM and transformers load our folders.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def build_char_tokenizer(chars: str, specials: tuple[str, ...] = (PAD, BOS, EOS)) -> Tokenizer:
    """Ids: specials first (in order), then each distinct character of `chars` in order."""
    seen: list[str] = []
    for c in chars:
        if c not in seen:
            seen.append(c)
    overlap = [s for s in specials if s in seen]
    if overlap:
        raise ValueError(f"special tokens {overlap} collide with characters")
    vocab = {tok: i for i, tok in enumerate(list(specials) + seen)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    return tok


def save_tokenizer(tok: Tokenizer, folder: str | Path, cfg=None) -> None:
    """Write tokenizer.json plus the small config files transformers/SGLang look for."""
    folder = Path(folder)
    if hasattr(tok, "save_pretrained"):  # a transformers tokenizer (model.path): its own files
        tok.save_pretrained(str(folder))
        return
    tok.save(str(folder / "tokenizer.json"))
    vocab = tok.get_vocab()
    specials = {name: t for name, t in (("pad_token", PAD), ("bos_token", BOS),
                                         ("eos_token", EOS)) if t in vocab}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
            cfg.max_position_embeddings if cfg is not None else 2048,
            "clean_up_tokenization_spaces": False, **specials}
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")


def load_tokenizer(folder: str | Path) -> Tokenizer:
    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    return Tokenizer.from_file(str(path))
