"""Widening the tiny trained pair with its vocabulary (``bench/house/widen_tiny.py``) keeps what it computes.

The new ids' LM-head rows copy a real id's, so their logits tie with it and argmax keeps the real id:
greedy output is unchanged at every position, whatever the logits. At a small widened shape (hidden x4,
vocabulary x2) the widened pair decodes held-out prompts to the same tokens with the same accept length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench.house.widen_tiny import padding_exactness, pick_filler, write_safetensors
from shared.model.tokenizer import Tokenizer
from shared.training.widen import WidenError, pad_vocab_eagle3, pad_vocab_target

ROOT = Path(__file__).resolve().parents[3]
PAIR = ROOT / "models" / "tiny-pair"


def small_state(vocab: int = 32, hidden: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
            "lm_head.weight": torch.randn(vocab, hidden, generator=gen)}


def test_new_ids_never_win_the_argmax_and_embed_to_zero():
    state = small_state()
    wide, cfg = pad_vocab_target(state, {"vocab_size": 32}, 100, filler=5)
    assert cfg["vocab_size"] == 100 and wide["lm_head.weight"].shape == (100, 8)
    assert torch.equal(wide["model.embed_tokens.weight"][32:], torch.zeros(68, 8))
    assert torch.equal(wide["lm_head.weight"][:32], state["lm_head.weight"])
    h = torch.randn(4096, 8, generator=torch.Generator().manual_seed(1))
    small, padded = h @ state["lm_head.weight"].T, h @ wide["lm_head.weight"].T
    assert (small.argmax(1) == 5).any()  # the filler itself wins somewhere: the tie goes to it, not a copy
    assert torch.equal(padded.argmax(1), small.argmax(1))
    with pytest.raises(WidenError, match="tied"):
        pad_vocab_target(state, {"tie_word_embeddings": True}, 100, filler=5)


def test_head_keeps_its_draft_vocabulary_and_maps_no_new_id():
    state = {"lm_head.weight": torch.randn(16, 8), "d2t": torch.zeros(16, dtype=torch.int64),
             "t2d": torch.ones(16, dtype=torch.bool)}
    wide, cfg = pad_vocab_eagle3(state, {"vocab_size": 16}, 40)
    assert cfg["vocab_size"] == 40 and cfg["draft_vocab_size"] == 16
    assert wide["t2d"].tolist() == [True] * 16 + [False] * 24 and torch.equal(wide["d2t"], state["d2t"])


def test_padding_record_counts_where_zero_rows_would_win():
    logits = torch.full((10, 6), 2.0)
    logits[:, 3] = -30.0  # an id never expected: the filler
    logits[:4] = -1.0  # every real logit negative: a zero row's logit 0 would win here
    logits[:4, 3] = -30.0
    filler = pick_filler(logits)
    assert filler == 3
    rec = padding_exactness(logits, 1006, filler)
    assert rec["zero_rows_greedy_wins"] == pytest.approx(0.4) and rec["copy_rows_greedy_wins"] == 0.0
    assert rec["zero_rows_sampled_mass_t1"]["max"] > 0.9  # 1000 ids at logit 0 over 6 at -1
    assert rec["copy_rows_sampled_mass_t1"]["max"] < 1e-6


def test_safetensors_writer_round_trips_and_leaves_zero_tensors_unwritten(tmp_path):
    tensors = {"w": torch.randn(3, 5).bfloat16(), "zeros": torch.zeros(1024, 1024, dtype=torch.bfloat16),
               "mask": torch.tensor([True, False, True]), "ids": torch.arange(7), "f": torch.randn(2, 3),
               "empty": torch.zeros(0, 4)}
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            assert torch.equal(f.get_tensor(k), tensors[k]), k
    st = path.stat()
    assert st.st_size > 2 << 20 and st.st_blocks * 512 < 1 << 20  # the 2 MiB of zeros are a hole


def test_widened_tiny_pair_decodes_the_same_tokens_with_the_same_acceptance(tmp_path):
    out = tmp_path / "wide"
    cmd = [sys.executable, "-m", "bench.house.widen_tiny", "--out", str(out), "--hidden", "1024", "--layers", "5",
           "--intermediate", "768", "--heads", "8", "--kv-heads", "2", "--vocab", "4096", "--dtype", "float32",
           "--shard-gb", "0.05", "--check", "2", "--check-tokens", "16"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "widen.json").read_text())
    assert record["check"]["outputs_equal"] is True
    assert record["check"]["accept_length_small"] == record["check"]["accept_length_wide"] > 1.0
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (4096, 1024, 5)
    index = json.loads((out / "target" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as the public checkpoints
    assert Tokenizer(out / "target").vocab_size == 4096
    small_cfg = json.loads((PAIR / "target" / "config.json").read_text())
    assert record["padding"]["new_ids"] == 4096 - small_cfg["vocab_size"]
    assert record["padding"]["copy_rows_greedy_wins"] == 0.0
    assert (out / "heldout.jsonl").stat().st_size > 10_000
