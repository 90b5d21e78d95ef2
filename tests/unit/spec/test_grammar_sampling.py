"""Sampled speculative decoding under a JSON schema keeps the target's distribution under the same schema.

The method of ``test_sampling_lossless.py`` (chi-square goodness of fit against a law computed exactly):
a 16-token target with oracle drafts and a 16-token tokenizer of JSON pieces, a schema of an object of
integers, seeded requests at temperature 1; the first DEPTH output tokens (the first from prefill, the
rest from speculative verification) must follow the exact law of masked target-only sampling, computed
with ``transformers`` and a fresh matcher per prefix. A request ends where the schema's value completes,
so the law is over sequences of up to DEPTH tokens. The negative control masks every tree node with the
committed state's mask; the test rejects it. Marked slow: about a minute of CPU (4000 + 700 requests).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from test_sampling_lossless import DEVICES, P_MIN, chi_square_p, reference_probs
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from shared.config import EngineConfig, SpecConfig
from shared.engine import Engine
from shared.grammar import Grammar, GrammarCompiler, unpack_masks
from shared.model.tokenizer import Tokenizer
from shared.sampling import SamplingParams

PIECES = ["<s>", "</s>", '"', "a", "b", "c", "ab", "ba", '"a', "\\", "{", "}", "1", "2", ":", ","]  # ids 0..15
SCHEMA = json.dumps({"type": "object", "additionalProperties": {"type": "integer"},
                     "x-guidance": {"item_separator": ",", "key_separator": ":"}})  # no space piece here
PROMPT = [3, 4, 5, 6, 7]
DEPTH = 4
REQUESTS = 2000
BATCH = 600
pytestmark = pytest.mark.slow
SPECS = {"chain": ("eagle", SpecConfig(topk=1, steps=3, num_draft_tokens=4)),
         "tree": ("eagle3", SpecConfig(topk=3, steps=2, num_draft_tokens=6))}


def write_json_tokenizer(target_dir) -> None:
    """A byte-level BPE whose 16 ids are the JSON pieces above (no merges: the ids are what matters)."""
    tok = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(PIECES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(target_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def json_vocab(tmp_path_factory):
    """The 16-token oracle pair with the JSON tokenizer, and the exact law of its first DEPTH sampled
    tokens after PROMPT under SCHEMA at temperature 1."""
    import transformers

    from tests.oracle_model import make_oracle_model

    root = make_oracle_model(tmp_path_factory.mktemp("json16"), seed=0, vocab_size=16, num_hidden_layers=2)
    write_json_tokenizer(root / "target")
    hf = transformers.LlamaForCausalLM.from_pretrained(root / "target", torch_dtype=torch.float32).eval()
    compiler = GrammarCompiler(Tokenizer(root / "target"), 16, (1,))

    def state(prefix: tuple) -> Grammar:
        g = compiler.compile(SCHEMA)
        assert all(g.advance(t) for t in prefix)
        return g

    law, ended = {(): 1.0}, {}
    for _ in range(DEPTH):
        grown = {}
        for prefix, mass in law.items():
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            allowed = unpack_masks(torch.from_numpy(state(prefix).mask()), 16)
            probs = reference_probs(logits.masked_fill(~allowed, -torch.inf).unsqueeze(0), 1.0)[0]
            for x, q in enumerate(probs.tolist()):
                if q > 0:
                    seq = prefix + (x,)
                    (ended if state(seq).done else grown)[seq] = mass * q
        law = grown
    return root, {**ended, **law}


def sampled_outputs(root, shape: str, n: int, device: str = "cpu") -> list:
    kind, spec = SPECS[shape]
    engine = Engine(root / "target", root / kind, EngineConfig(page_size=4, max_running=BATCH, max_context=32,
                                                               chunk_size=None, spec=spec, device=device))
    out = []
    for start in range(0, n, BATCH):
        params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=DEPTH, json_schema=SCHEMA)
                  for i in range(start, min(n, start + BATCH))]
        out += engine.generate([PROMPT] * len(params), params)
        assert engine.is_idle_and_clean()
    return out


@pytest.mark.parametrize("device", DEVICES)  # the GPU: the Triton acceptance kernels under the masks
@pytest.mark.parametrize("shape", list(SPECS))
def test_sampling_under_a_schema_matches_masked_target_sampling(json_vocab, shape, device):
    root, law = json_vocab
    rows = sampled_outputs(root, shape, REQUESTS, device)
    assert sum(len(k) < DEPTH for k in law) > 0 and max(law.values()) < 0.5  # the law is not trivial
    p = chi_square_p(Counter(tuple(r.token_ids) for r in rows), law)
    accepted = [r.spec_stats["accepted_drafts"] for r in rows]
    print(f"{shape}: chi-square p {p:.3g}; accepted {sum(accepted)}, two or more in "
          f"{sum(a >= 2 for a in accepted)} requests")
    assert p > P_MIN, f"{shape}: chi-square p = {p:.2e}"
    assert sum(accepted) > REQUESTS / 5, "speculation barely ran"  # drafts were accepted inside the JSON value


def test_negative_control_the_committed_mask_at_every_node_is_rejected(json_vocab, monkeypatch):
    root, law = json_vocab
    monkeypatch.setattr(Grammar, "node_states", lambda self, tokens, parents: [self.matcher.deep_copy()
                                                                               for _ in tokens])
    rows = sampled_outputs(root, "tree", REQUESTS // 3)
    assert chi_square_p(Counter(tuple(r.token_ids) for r in rows), law) < P_MIN
