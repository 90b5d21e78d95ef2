"""``bench/house/train_target.py --tiny``: the house target's pipeline end to end, in seconds.

Corpus from named packages (standard-library ones in the tiny run, whole packages held out), a BPE
trained with ``tokenizers``, the vocabulary padded with reserved ids, a Llama trained from scratch,
and a checkpoint the engine loads and generates from.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from training_helpers import engine_logits

from bench.house.train_target import (
    CHAT_ASK,
    CHAT_EVERY,
    CHAT_TEMPLATE,
    TINY,
    HouseConfig,
    assemble_corpus,
    build_house,
)
from services.router.openai_http import ChatTemplate
from shared.config import EngineConfig
from shared.engine import Engine
from shared.model.tokenizer import Tokenizer
from shared.sampling import SamplingParams

SMALL = EngineConfig(max_running=4, max_context=256)  # (the config says 131072 positions)


@pytest.fixture(scope="module")
def house(one_thread_module, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("house")
    return out, build_house(HouseConfig(out=str(out), **TINY), log=lambda line: None)


def test_house_writes_a_checkpoint_the_engine_loads_with_its_record(house):
    out, summary = house
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "house.json",
                 "corpus/train.jsonl", "corpus/heldout.jsonl"):
        assert (out / name).exists(), name
    assert json.loads((out / "house.json").read_text())["train"]["heldout_loss"] == summary["train"]["heldout_loss"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 1024 and cfg["head_dim"] == 128
    assert cfg["rope_parameters"]["rope_type"] == "llama3" and cfg["rope_parameters"]["rope_theta"] == 500000.0
    packages = {p["name"]: p for p in summary["packages"]}
    assert [p["split"] for p in packages.values()] == ["train", "train", "heldout"]
    assert all(p["files"] > 0 and p["bytes"] > 0 for p in packages.values())
    assert summary["missing_packages"] == []
    # The greedy samples came from the engine on the written checkpoint: generating again gives them.
    engine = Engine(out, config=SMALL)
    for s in summary["samples"]:
        again = engine.generate(s["prompt"], SamplingParams(max_new_tokens=len(s["token_ids"])))[0]
        assert again.token_ids == s["token_ids"] and again.text == s["completion"]


def test_house_training_learns_and_reserved_ids_stay_unlikely(house):
    out, summary = house
    train = summary["train"]
    curve = [c["loss"] for c in train["loss_curve"]]
    assert curve[-1] < curve[0] - 1.0  # from about ln(1024) = 6.9
    assert train["heldout_loss"] < 6.0 and train["heldout_perplexity"] < 400
    assert train["tokens"] == train["steps"] * 8 * 64
    tok = Tokenizer(out)
    assert tok.vocab_size == 1024  # every model id has a token: the BPE's, then reserved ones
    assert tok.token_id("<|reserved_special_token_0|>") == 384
    assert tok.token_id("<|end_of_text|>") == 1
    held = [json.loads(line)["text"] for line in (out / "corpus" / "heldout.jsonl").read_text().splitlines()]
    ids = tok.encode(held[0])[:64]
    assert max(ids) < 384  # text never tokenizes to a reserved id
    p = torch.softmax(engine_logits(Engine(out, config=SMALL), [ids])[0], -1)
    reserved_mass = p[:, 384:].sum(-1).mean().item()
    assert reserved_mass < 0.1  # 640 of 1024 ids: about 0.6 for an untrained model


def test_corpus_holds_out_whole_packages_in_a_fixed_order():
    cfg = HouseConfig(out="-", **{**TINY, "heldout_packages": ("http", "no_such_package_xyz")})
    train, held, packages, missing = assemble_corpus(cfg)
    again = assemble_corpus(cfg)
    assert (train, held) == again[:2]
    assert missing == ["no_such_package_xyz"]
    assert not set(train) & set(held)
    assert [p.name for p in packages] == ["json", "email", "http"] and packages[-1].split == "heldout"
    assert len(held) == packages[-1].files and sum(map(len, held)) == packages[-1].bytes
    capped = assemble_corpus(replace(cfg, max_package_bytes=20_000))[2]
    assert all(p.bytes <= 20_000 or p.files == 1 for p in capped)


def test_house_writes_the_chat_template_and_trains_on_chats_rendered_with_it(house):
    out, summary = house
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    records = [json.loads(line) for line in (out / "corpus" / "train.jsonl").read_text().splitlines()]
    chats = [r["messages"] for r in records if "messages" in r]
    texts = [r["text"] for r in records if "text" in r]
    assert summary["chats"] == len(chats) > 0 and len(chats) <= len(texts[::CHAT_EVERY])
    first = chats[0]
    assert first[0]["content"].startswith(CHAT_ASK) and first[1]["role"] == "assistant"
    # the question is a module's opening lines, the answer what follows them
    opening = first[0]["content"][len(CHAT_ASK):]
    source = next(t for t in texts if t.startswith(opening))
    assert source[len(opening):].lstrip("\n").startswith(first[1]["content"][:200])
    rendered = ChatTemplate(out).render(first, add_generation_prompt=False)
    assert rendered.startswith("# user: " + CHAT_ASK.rstrip("\n")) and rendered.endswith("<|end_of_text|>\n")
    tok = Tokenizer(out)
    assert tok.encode(rendered).count(tok.token_id("<|end_of_text|>")) == 1  # the turn ends in EOS itself
    prompt = ChatTemplate(out).render(first[:1])
    assert rendered.startswith(prompt)  # a chat request's prompt is how the trained chats begin


def test_the_shipped_pair_carries_the_house_chat_template():
    from shared.model.default_pair import DEFAULT_DIR

    config = json.loads((DEFAULT_DIR / "target" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
