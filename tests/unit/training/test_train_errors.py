"""Bad corpora and mismatched targets: ``eyrie train-draft`` exits with status 2 and one line naming
the file (and line) or the setting at fault, before any training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.cli import chat_renderer, main
from shared.model.tokenizer import build_tiny_tokenizer
from shared.training.corpus import Document, heldout_mask, read_documents


def train_draft_fails(capsys, target: Path, corpus: list[Path], out: Path, *extra: str) -> str:
    """Run the command in-process; return its one error line (asserting status 2, one line)."""
    with pytest.raises(SystemExit) as exc:
        main(["train-draft", "--target", str(target), "--corpus", *map(str, corpus), "--out", str(out),
              "--steps", "1", "--seq-len", "16", "--batch-tokens", "32", "--ttt-steps", "2", "--no-progress", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("eyrie: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def target(oracle_model_dir) -> Path:
    return Path(oracle_model_dir) / "target"


@pytest.mark.parametrize("case, expect", [
    ("empty_file", "no text (every document is empty)"),
    ("empty_dir", "the directory holds no files"),
    ("missing", "no such file or directory"),
    ("not_utf8", "not UTF-8 text"),
    ("bad_json_line", "bad.jsonl:3: not valid JSON"),
    ("no_text_field", "bad.jsonl:2: expected an object with a \"text\" string or a \"messages\" list"),
    ("bad_messages", "bad.jsonl:1: \"messages\" must be a non-empty list"),
])
def test_bad_corpus_is_one_line_naming_the_file_and_line(capsys, tmp_path, target, case, expect):
    good = json.dumps({"text": "def f(x):\n    return x\n"})
    if case == "empty_file":
        corpus = tmp_path / "empty.txt"
        corpus.write_text("  \n\n")
    elif case == "empty_dir":
        corpus = tmp_path / "nothing"
        corpus.mkdir()
    elif case == "missing":
        corpus = tmp_path / "nowhere.txt"
    elif case == "not_utf8":
        corpus = tmp_path / "latin1.txt"
        corpus.write_bytes("caf\xe9 au lait".encode("latin-1"))
    else:
        corpus = tmp_path / "bad.jsonl"
        lines = {"bad_json_line": [good, "", "{\"text\": oops}"],
                 "no_text_field": [good, json.dumps({"content": "x"})],
                 "bad_messages": [json.dumps({"messages": [{"role": "user"}]})]}[case]
        corpus.write_text("\n".join(lines) + "\n")
    err = train_draft_fails(capsys, target, [corpus], tmp_path / "out")
    assert expect in err and str(corpus.name) in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_chat_corpus_without_a_template_names_the_line(capsys, tmp_path, target):
    bare = tmp_path / "no-template"
    shutil.copytree(target, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text(json.dumps({"text": "x = 1"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    err = train_draft_fails(capsys, bare, [corpus], tmp_path / "out")
    assert "chat.jsonl:2: chat messages need the target's chat template" in err


def test_chat_records_render_whole_conversations_with_the_template(target, tmp_path):
    corpus = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": "def add(a, b):"}]
    corpus.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"text": "plain"}) + "\n")
    docs = read_documents([corpus], chat_renderer(str(target)))
    assert docs[0].source == f"{corpus}:1" and docs[1].text == "plain"
    # The tiny tokenizer's template: "<|role|>\ncontent\n" per message, no generation prompt after.
    assert docs[0].text == "<|user|>\nadd two numbers\n<|assistant|>\ndef add(a, b):\n"


def test_target_that_is_a_draft_head_or_no_checkpoint(capsys, tmp_path, oracle_model_dir, small_corpus):
    err = train_draft_fails(capsys, Path(oracle_model_dir) / "eagle3", [small_corpus], tmp_path / "out")
    assert "is a draft head (LlamaForCausalLMEagle3), not a target model" in err
    err = train_draft_fails(capsys, tmp_path, [small_corpus], tmp_path / "out")
    assert "is not a checkpoint directory (no config.json)" in err


def test_tokenizer_of_another_vocabulary_is_a_mismatched_target(capsys, tmp_path, target, small_corpus):
    """A target whose tokenizer.json makes ids past its vocabulary (a wider tokenizer)."""
    other = tmp_path / "target"
    shutil.copytree(target, other)
    build_tiny_tokenizer(other, 2048)
    err = train_draft_fails(capsys, other, [small_corpus], tmp_path / "out")
    assert "outside the target's vocabulary [0, 512)" in err and "does not belong to this target" in err


def test_resuming_with_another_target_is_refused(capsys, tmp_path, target, tiny_model_dir, small_corpus):
    out = tmp_path / "out"
    args = ["train-draft", "--target", str(target), "--corpus", str(small_corpus), "--out", str(out), "--steps", "1",
            "--seq-len", "16", "--batch-tokens", "32", "--ttt-steps", "2", "--no-progress", "--eval-prompts", "1",
            "--eval-new-tokens", "4"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 1 and (out / "model.safetensors").exists()
    other = Path(tiny_model_dir) / "target"  # same shape, other weights
    err = train_draft_fails(capsys, other, [small_corpus], out, "--resume")
    assert "--resume: the checkpoint" in err and "was trained for another target" in err
    err = train_draft_fails(capsys, target, [small_corpus], out, "--resume", "--kind", "eagle")
    assert "--resume: the checkpoint was trained with kind='eagle3', this run has kind='eagle'" in err
    err = train_draft_fails(capsys, target, [small_corpus], tmp_path / "fresh", "--resume")
    assert "no checkpoint of an earlier run" in err


@pytest.mark.parametrize("extra, expect", [
    (("--kind", "medusa"), "--kind"),
    (("--seq-len", "3"), "--seq-len: 3 leaves no anchor for --ttt-steps 2"),
    (("--draft-vocab", "9999"), "--draft-vocab: 9999 is outside [1, 512]"),
    (("--regenerate", "16"), "--regenerate: must be in [0, --seq-len 16)"),
    (("--dtype", "int8"), "dtype: 'int8' is not one of"),
    (("--max-windows", "0"), "--max-windows: must be >= 1, got 0"),
    (("--kind", "mtp", "--eval-spec-steps", "3"), "--eval-spec-steps: 3 draft steps need as many layers"),
])
def test_bad_settings_are_one_line(capsys, tmp_path, target, small_corpus, extra, expect):
    assert expect in train_draft_fails(capsys, target, [small_corpus], tmp_path / "out", *extra)


def test_heldout_documents_do_not_depend_on_the_order_of_the_corpus():
    docs = [Document(f"d{i}", f"text number {i}") for i in range(40)]
    held = {d.source for d, m in zip(docs, heldout_mask(docs, 0.1)) if m}
    again = {d.source for d, m in zip(docs[::-1], heldout_mask(docs[::-1], 0.1)) if m}
    assert held == again and len(held) == 4
