"""Tokenizer: a Hugging Face ``tokenizer.json`` behind a small interface, and a builder for tiny models."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))

    @classmethod
    def beside(cls, model) -> Tokenizer | None:
        """The tokenizer saved beside the checkpoint directory ``model``; None for a model passed in built, or a
        checkpoint without ``tokenizer.json``."""
        return cls(model) if isinstance(model, (str, Path)) and (Path(model) / "tokenizer.json").exists() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, the texts spread over the library's threads."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar engine builds its own view from)."""
        return self._tok.to_str()


def _training_text(max_bytes: int = 400_000) -> list[str]:
    """Offline text: the Python standard library's own sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for name in ("this.py", "textwrap.py", "string.py", "json/__init__.py", "argparse.py",
                 "collections/__init__.py", "functools.py", "dataclasses.py", "typing.py"):
        file = stdlib / name
        if file.exists() and total < max_bytes:
            text = file.read_text(encoding="utf-8", errors="ignore")
            texts.append(text)
            total += len(text)
    return texts or ["the quick brown fox jumps over the lazy dog"]


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Train a byte-level BPE on offline text; write tokenizer.json and tokenizer_config.json."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 100000,
        "chat_template": (
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        ),
    }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=1)
