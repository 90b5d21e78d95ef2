"""Training text for a draft head: plain text files and JSONL, tokenized with the target's tokenizer.

A corpus path is a file or a directory (its files, recursively, in sorted order, hidden ones
skipped). A ``.jsonl`` file holds one JSON object per line: ``{"text": ...}``, or a chat
``{"messages": [{"role", "content"}, ...]}`` rendered with the target's chat template (the whole
conversation, no generation prompt); any other file is one plain-text document. Every problem is a
``CorpusError`` whose message is one line naming the file (and the line of a JSONL file).

Documents are split into training and held-out sets whole (by a hash of their text, so the split
does not depend on the order the paths were given); a single document is split by its tokens.
``sample_split`` tokenizes only a seeded sample of each split, enough for a token budget: a run that
trains on a million tokens of a corpus of fifty million reads them all but tokenizes a few.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ChatRenderer = Callable[[list[dict]], str]
EncodeBatch = Callable[[list[str]], list[list[int]]]
ENCODE_BATCH = 64  # documents per call of the batch encoder (the tokenizers library spreads them over threads)


class CorpusError(ValueError):
    """A corpus that cannot be used; the message names the file and line at fault."""


@dataclass
class Document:
    source: str  # "path" or "path:line"
    text: str


@dataclass
class TokenSplit:
    """The corpus as token streams: each document's tokens followed by the separator (EOS)."""

    train: torch.Tensor  # [N] int64
    heldout: torch.Tensor  # [M] int64
    train_docs: int  # documents tokenized (all of the split's, or a sample: see sample_split)
    heldout_docs: int


def corpus_files(path: Path) -> list[Path]:
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise CorpusError(f"{path}: the directory holds no files")
    return files


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror or e})") from None


def jsonl_documents(path: Path, render_chat: ChatRenderer | None) -> list[Document]:
    docs = []
    for n, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        docs.append(Document(where, record_text(obj, where, render_chat)))
    return docs


def record_text(obj, where: str, render_chat: ChatRenderer | None) -> str:
    """The text of one JSONL record: its ``text``, or its ``messages`` through the chat template."""
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return obj["text"]
    if not isinstance(obj, dict) or "messages" not in obj:
        raise CorpusError(f"{where}: expected an object with a \"text\" string or a \"messages\" list")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise CorpusError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}")
    if render_chat is None:
        raise CorpusError(f"{where}: chat messages need the target's chat template, and the target has none "
                          f"(chat_template in tokenizer_config.json or chat_template.jinja)")
    try:
        return render_chat(messages)
    except Exception as e:  # the template's raise_exception(), or a template bug
        raise CorpusError(f"{where}: the chat template refused these messages: {e}") from None


def read_documents(paths: list[str | Path], render_chat: ChatRenderer | None = None) -> list[Document]:
    docs = []
    for p in paths:
        for file in corpus_files(Path(p)):
            if file.suffix == ".jsonl":
                docs += jsonl_documents(file, render_chat)
            else:
                docs.append(Document(str(file), read_text(file)))
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise CorpusError(f"corpus {', '.join(map(str, paths))}: no text (every document is empty)")
    return docs


def heldout_mask(docs: list[Document], fraction: float) -> list[bool]:
    """Which documents are held out: the ``ceil(fraction * n)`` (at least one, at most n - 1) whose
    text hashes lowest, so the split is the same whatever order the corpus paths come in."""
    n = len(docs)
    k = min(max(1, math.ceil(fraction * n)), n - 1)
    digests = [hashlib.sha256(d.text.encode()).hexdigest() for d in docs]
    held = set(sorted(range(n), key=lambda i: (digests[i], i))[:k])
    return [i in held for i in range(n)]


def tokenize_split(docs: list[Document], encode: Callable[[str], list[int]], separator: int | None,
                   vocab_size: int, heldout_fraction: float) -> TokenSplit:
    """Token streams of the training and held-out documents (each document then ``separator``)."""
    streams: list[list[int]] = []
    for d in docs:
        ids = encode(d.text)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise CorpusError(f"{d.source}: the tokenizer gives id {bad}, outside the target's vocabulary "
                              f"[0, {vocab_size}): the tokenizer does not belong to this target")
        streams.append(ids + ([separator] if separator is not None else []))
    if len(docs) == 1:  # one document: its last tokens are held out
        ids = streams[0]
        cut = len(ids) - max(1, int(heldout_fraction * len(ids)))
        train, held, n_train, n_held = ids[:cut], ids[cut:], 1, 1
    else:
        mask = heldout_mask(docs, heldout_fraction)
        train = [t for s, m in zip(streams, mask) if not m for t in s]
        held = [t for s, m in zip(streams, mask) if m for t in s]
        n_held = sum(mask)
        n_train = len(docs) - n_held
    return TokenSplit(torch.tensor(train, dtype=torch.int64), torch.tensor(held, dtype=torch.int64),
                      n_train, n_held)


def sample_split(docs: list[Document], encode_batch: EncodeBatch, separator: int | None, vocab_size: int,
                 heldout_fraction: float, train_tokens: int | None, heldout_tokens: int | None,
                 seed: int) -> TokenSplit:
    """``tokenize_split`` of a seeded sample: each split's documents (the same split, by hash) in a seeded
    order, tokenized until the split has ``train_tokens`` (``heldout_tokens``) tokens; None: all of them,
    in corpus order. One document is split by its tokens, whole."""
    if len(docs) == 1:
        return tokenize_split(docs, lambda text: encode_batch([text])[0], separator, vocab_size, heldout_fraction)
    mask = heldout_mask(docs, heldout_fraction)
    train, n_train = sampled_stream([d for d, m in zip(docs, mask) if not m], encode_batch, separator, vocab_size,
                                    train_tokens, seed)
    held, n_held = sampled_stream([d for d, m in zip(docs, mask) if m], encode_batch, separator, vocab_size,
                                  heldout_tokens, seed + 1)
    return TokenSplit(train, held, n_train, n_held)


def sampled_stream(docs: list[Document], encode_batch: EncodeBatch, separator: int | None, vocab_size: int,
                   budget: int | None, seed: int) -> tuple[torch.Tensor, int]:
    """(the token stream [N] int64 of the first documents of a seeded order holding ``budget`` tokens, or of
    every document in order when ``budget`` is None; how many documents that took)."""
    order = list(range(len(docs)))
    if budget is not None:
        order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    parts, total = [], 0
    for start in range(0, len(order), ENCODE_BATCH):
        chunk = [docs[i] for i in order[start:start + ENCODE_BATCH]]
        for doc, ids in zip(chunk, encode_batch([d.text for d in chunk])):
            if budget is not None and total >= budget:
                break
            part = torch.tensor(ids + ([separator] if separator is not None else []), dtype=torch.int64)
            if part.numel() and not (0 <= int(part.min()) and int(part.max()) < vocab_size):
                bad = next(t for t in part.tolist() if not 0 <= t < vocab_size)
                raise CorpusError(f"{doc.source}: the tokenizer gives id {bad}, outside the target's vocabulary "
                                  f"[0, {vocab_size}): the tokenizer does not belong to this target")
            parts.append(part)
            total += part.numel()
        if budget is not None and total >= budget:
            break
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)), len(parts)


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[n, seq_len] non-overlapping windows of the stream (the tail shorter than a window dropped)."""
    n = tokens.numel() // seq_len
    if n == 0:
        raise CorpusError(f"corpus: {tokens.numel()} training tokens, fewer than one window of --seq-len {seq_len}")
    return tokens[:n * seq_len].view(n, seq_len).clone()


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """EAGLE-3's draft vocabulary: the ``draft_vocab_size`` most frequent target ids of ``tokens``
    (ties and never-seen ids by lower id), ascending. ``d2t``/``t2d`` derive from it (``vocab_maps``)."""
    counts = torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    # Stable sort on -count keeps the lower id first among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size].sort().values


def vocab_coverage(hot: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> float:
    """The fraction of ``tokens`` that the draft vocabulary ``hot`` holds (what a draft can propose at all)."""
    if tokens.numel() == 0:
        return 0.0
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[hot] = True
    return float(inside[tokens].float().mean())


def vocab_maps(hot: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64: target id = draft id + d2t[draft id], t2d [V] bool: in the draft vocabulary)."""
    d2t = hot - torch.arange(hot.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[hot] = True
    return d2t, t2d
