"""``train-draft``'s bounded data preparation: with ``--max-windows`` only a seeded sample of the corpus is
tokenized (enough for the windows and the draft vocabulary's counts), and the run records each phase's time."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

from shared.training.corpus import Document, heldout_mask, sample_split, tokenize_split, vocab_coverage
from shared.training.trainer import VOCAB_TOKENS_PER_ID, TrainConfig, token_budgets, train_draft


def byte_encode_batch(texts: list[str]) -> list[list[int]]:
    """A stand-in tokenizer: one id per UTF-8 byte (ids 2..257), counting its calls' texts."""
    byte_encode_batch.texts += len(texts)
    return [[2 + b for b in t.encode()] for t in texts]


byte_encode_batch.texts = 0


def documents(n: int) -> list[Document]:
    return [Document(f"doc{i}", f"document {i}: " + "x" * (50 + 7 * i)) for i in range(n)]


def test_without_a_budget_the_split_is_tokenize_splits_own():
    docs = documents(40)
    whole = tokenize_split(docs, lambda t: byte_encode_batch([t])[0], 1, 300, 0.1)
    sampled = sample_split(docs, byte_encode_batch, 1, 300, 0.1, None, None, seed=0)
    assert torch.equal(sampled.train, whole.train) and torch.equal(sampled.heldout, whole.heldout)
    assert (sampled.train_docs, sampled.heldout_docs) == (whole.train_docs, whole.heldout_docs) == (36, 4)


def test_a_budget_tokenizes_a_seeded_sample_of_documents_just_past_it():
    docs = documents(400)
    byte_encode_batch.texts = 0
    split = sample_split(docs, byte_encode_batch, 1, 300, 0.1, 2000, 500, seed=3)
    assert byte_encode_batch.texts < 200  # a few batches of documents, not the 400
    assert 2000 <= split.train.numel() < 2000 + 60 + 7 * 400 + 2  # stops at the first document past the budget
    assert 500 <= split.heldout.numel() and split.heldout_docs < 40
    # The sampled documents come from their own split (the split is the whole corpus's, by hash).
    held = {d.text for d, m in zip(docs, heldout_mask(docs, 0.1)) if m}
    texts = bytes(int(t) - 2 if t != 1 else ord("|") for t in split.heldout).decode().split("|")[:-1]
    assert len(texts) == split.heldout_docs and set(texts) <= held
    again = sample_split(docs, byte_encode_batch, 1, 300, 0.1, 2000, 500, seed=3)
    other = sample_split(docs, byte_encode_batch, 1, 300, 0.1, 2000, 500, seed=4)
    assert torch.equal(again.train, split.train) and not torch.equal(other.train, split.train)


def test_budgets_cover_the_windows_and_the_draft_vocabularys_counts():
    cfg = TrainConfig(target="t", corpus=["c"], out="o", max_windows=2048, seq_len=512, eval_windows=4,
                      eval_prompts=16, eval_prompt_len=32)
    train, heldout = token_budgets(cfg, draft_vocab=32000)
    assert train == VOCAB_TOKENS_PER_ID * 32000 > 2048 * 512  # the house head: 4.1M tokens
    assert token_budgets(cfg, draft_vocab=None)[0] == 2048 * 512 and heldout >= 4 * 512
    assert token_budgets(TrainConfig(target="t", corpus=["c"], out="o"), 32000) == (None, None)


def test_vocab_coverage_is_the_share_of_tokens_in_the_draft_vocabulary():
    assert vocab_coverage(torch.tensor([1, 3]), torch.tensor([1, 1, 2, 3]), 5) == 0.75


def test_train_draft_samples_a_large_corpus_and_records_each_phases_time(oracle_model_dir, tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = (stdlib / "textwrap.py").read_text()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": text[i:i + 400]}) for i in range(0, len(text), 400)))
    summary = train_draft(TrainConfig(target=str(Path(oracle_model_dir) / "target"), corpus=[str(corpus)],
                                      out=str(tmp_path / "head"), steps=2, seq_len=32, batch_tokens=64, ttt_steps=2,
                                      draft_vocab=4, max_windows=8, regenerate=4, eval_every=0, eval_prompts=1,
                                      eval_prompt_len=8, eval_new_tokens=4, eval_windows=1, progress=False))
    docs = summary["corpus_docs"]
    assert docs > 40 and summary["train_docs"] < docs // 2  # 8 windows of 32 and 4 x 128 tokens: a few documents
    assert summary["train_tokens"] >= max(8 * 32, VOCAB_TOKENS_PER_ID * 4)
    assert 0 < summary["draft_vocab_heldout_coverage"] <= 1
    phases = summary["phases"]
    assert set(phases) == {"load_s", "read_s", "tokenize_s", "vocab_s", "windows_s", "regenerate_s", "eval_s",
                           "save_s", "train_s"}
    assert all(v >= 0 for v in phases.values()) and phases["train_s"] > 0
    assert [e["step"] for e in summary["evals"]] == [0, 2] and all(e["seconds"] > 0 for e in summary["evals"])
    assert phases["eval_s"] >= sum(e["seconds"] for e in summary["evals"]) - 0.02
