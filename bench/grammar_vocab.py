"""A tokenizer of any vocabulary size for grammar benchmarks on random-weight models (no download).

llguidance's mask cost depends on the vocabulary: its size and how many tokens share prefixes. Llama 3's
128256 tokens are not here offline, so ``write_tokenizer`` writes a byte-level BPE ``tokenizer.json``
of the requested size: ids 0 and 1 the special BOS and EOS (the factory configs' ids), then the 256
byte tokens, then the most frequent substrings (2 to 12 bytes) of the Python standard library's sources,
the shape of a real code-and-text vocabulary. Only the id -> bytes map matters (prompts are ids).
"""

from __future__ import annotations

import sysconfig
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a byte-level BPE vocabulary is written in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = dict(zip(keep, map(chr, keep))), 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _corpus(max_bytes: int) -> bytes:
    root, out = Path(sysconfig.get_paths()["stdlib"]), bytearray()
    for path in sorted(root.rglob("*.py")):
        if len(out) >= max_bytes:
            break
        out += path.read_bytes()
    return bytes(out[:max_bytes])


def vocabulary(size: int, max_bytes: int = 2_000_000) -> list[str]:
    """``size`` distinct tokens in byte-level characters: specials, bytes, then frequent substrings."""
    chars = _byte_chars()
    tokens = SPECIALS + [chars[b] for b in range(256)]
    text = _corpus(max_bytes)
    counts: Counter[bytes] = Counter()
    for n in range(2, 13):
        counts.update(text[i:i + n] for i in range(0, len(text) - n, max(1, n // 3)))
    for piece, _ in counts.most_common():
        if len(tokens) >= size:
            break
        tokens.append("".join(chars[b] for b in piece))
    if len(tokens) < size:
        raise ValueError(f"the corpus gives {len(tokens)} tokens, {size} were asked for")
    return tokens[:size]


def write_tokenizer(out_dir: str | Path, size: int) -> Path:
    """Write ``tokenizer.json`` of ``size`` tokens into ``out_dir``; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocabulary(size))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    return out
